package invariant

import (
	"context"
	"fmt"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/pager"
)

// Defaults of [CheckOptions].
const (
	DefaultInterval = time.Second
	DefaultReads    = 3
	DefaultPageSize = 500
	// DefaultStaleAfter outlasts the resourceclaim controller's clean-up
	// after a burst of finished pods: it writes each claim up to three
	// times (status, finalizer, deletion of a generated claim) at
	// kube-controller-manager's default 20 QPS, about 5 minutes for
	// 2,000 claims.
	DefaultStaleAfter = 10 * time.Minute
	// DefaultUnpublishedAfter outlasts what removes a pool's slices
	// for a while: a kubelet that restarts, a driver restarted or
	// upgraded (the kubelet removes its slices 30 s after it
	// unregisters), and a deleted Node, whose pods the pod garbage
	// collector deletes within a minute, after which the resourceclaim
	// controller deallocates their claims.
	DefaultUnpublishedAfter = 5 * time.Minute
)

// CheckOptions tune [CheckWith]. The zero value asks for the defaults.
type CheckOptions struct {
	// Interval is the wait before each read after the first. Zero:
	// DefaultInterval. Must not be negative.
	Interval time.Duration
	// Reads is the most times the cluster is read: the first read, one
	// re-read that confirms its violations, and further re-reads while a
	// confirmed violation is pending (see [Report.Pending]) or a
	// StaleReservation, which the cluster's controllers repair on their
	// own. Zero: DefaultReads. Otherwise at least 2.
	Reads int
	// PageSize is the most objects one list request asks for. Zero:
	// DefaultPageSize. Must not be negative.
	PageSize int64
	// StaleAfter is how long the pods of a StaleReservation must have
	// been done before it is reported, and how long the reads must have
	// found an UnreservedAllocation; until then it is pending. A pod
	// that succeeded or failed is done since the time it records (see
	// podDoneSince), a pod deleted before it was bound since its
	// deletionTimestamp. A pod that is gone, or records no such time,
	// is done since the first read that found the reservation: such a
	// claim is reported only where the reads span StaleAfter. Zero:
	// DefaultStaleAfter. Negative: none, a StaleReservation is reported
	// once every read finds it.
	StaleAfter time.Duration
	// UnpublishedAfter is how long the pool of an UnpublishedPool must
	// have been found without ResourceSlices before it is reported;
	// until then it is pending. Nothing in the cluster records when a
	// pool's slices went, so the time counts from the first read that
	// found it: such a pool is reported only where the reads span
	// UnpublishedAfter (and every read finds it). Zero:
	// DefaultUnpublishedAfter. Negative: none, an UnpublishedPool is
	// reported once every read finds it.
	UnpublishedAfter time.Duration
}

func (o CheckOptions) withDefaults() (CheckOptions, error) {
	switch {
	case o.Interval < 0:
		return o, fmt.Errorf("interval %s is negative", o.Interval)
	case o.Reads < 0 || o.Reads == 1:
		return o, fmt.Errorf("reads is %d, want at least 2", o.Reads)
	case o.PageSize < 0:
		return o, fmt.Errorf("page size %d is negative", o.PageSize)
	}
	if o.Interval == 0 {
		o.Interval = DefaultInterval
	}
	if o.Reads == 0 {
		o.Reads = DefaultReads
	}
	if o.PageSize == 0 {
		o.PageSize = DefaultPageSize
	}
	if o.StaleAfter == 0 {
		o.StaleAfter = DefaultStaleAfter
	}
	if o.UnpublishedAfter == 0 {
		o.UnpublishedAfter = DefaultUnpublishedAfter
	}
	return o, nil
}

// Report is what [CheckWith] found.
type Report struct {
	// Violations are those that every read found, sorted as by [Find],
	// each as the last read found it.
	Violations []Violation
	// Pending are violations that every read found but that the cluster
	// may yet resolve on its own, each with why: a VanishedDevice of a
	// device that is DevicePending at the last read (see
	// [Publication.Presence]: an artefact of a pool its driver is
	// republishing slice by slice), a StaleReservation whose pods
	// have not been done for CheckOptions.StaleAfter, and an
	// UnpublishedPool not found so for CheckOptions.UnpublishedAfter.
	// They are not in Violations; [Find], judging a cluster at rest,
	// reports them.
	Pending []PendingViolation
	// Reads is how many times the cluster was read in full.
	Reads int
	// NotJudged says why a kind of violation, or part of one, was not
	// looked for (at the last read): nodes that may not be listed leave
	// PodClaimOnOtherNode unjudged, DeviceClasses that may not be listed
	// the class selectors of AllocationMismatch, DeviceTaintRules that
	// may not be listed their taints for UntoleratedDeviceTaint; a
	// selector that does not compile or evaluate, the other parts that
	// AllocationMismatch leaves unjudged, and untolerated taints whose
	// age or the allocation's is not recorded, are named with their
	// claims.
	NotJudged []string
}

// PendingViolation is a violation that [CheckWith] does not report (yet).
type PendingViolation struct {
	Violation
	// Why says, in words, why it is not reported.
	Why string
}

// IncompleteError is the error of [CheckWith] and [Check] when a re-read
// fails: the violations of the reads before it come with it, but are not
// confirmed.
type IncompleteError struct {
	// Reads is how many reads succeeded before the failed one.
	Reads int
	// Err is why the re-read failed.
	Err error
}

func (e *IncompleteError) Error() string {
	return fmt.Sprintf("check incomplete: read %d of the cluster failed, the violations found are not confirmed: %v", e.Reads+1, e.Err)
}

func (e *IncompleteError) Unwrap() error { return e.Err }

// Check is [CheckWith] with the default options; it returns the confirmed
// violations and drops the pending ones.
func Check(ctx context.Context, client kubernetes.Interface) ([]Violation, error) {
	report, err := CheckWith(ctx, client, CheckOptions{})
	return report.Violations, err
}

// CheckWith lists slices, device classes, device taint rules, nodes, and the claims and pods of all namespaces
// and returns the violations among them. The lists are not one snapshot, and a
// cluster changes while it is read: a pod may be bound or deleted between
// two lists, a claim deallocated, a pool republished. So when the first
// read finds violations, CheckWith waits opts.Interval and reads again,
// and reports only the violations that every read found (the same kind,
// device, counter, pod and claims). While such a violation is pending
// (see [Report.Pending]) it reads again, up to opts.Reads times in all; a
// violation still pending at the last read goes to Report.Pending. So
// does it while a StaleReservation or an UnpublishedPool is found, which
// is reported only if every one of the opts.Reads reads finds it and, at
// the last read, its pods have been done for opts.StaleAfter, or its
// pool has been without slices since a read opts.UnpublishedAfter
// earlier (see [CheckOptions]): the resourceclaim controller repairs the
// one on its own when it runs, the pool's driver or the deletion of the
// pods on a deleted node the other. A first read without violations is
// the answer, without a wait.
//
// An error of the first read, or of opts, comes with an empty Report. An
// error of a re-read is an [*IncompleteError], and comes with the
// violations (and pending ones) that every read before it found; they
// are not confirmed. Cancelling ctx during a wait is such an error too.
func CheckWith(ctx context.Context, client kubernetes.Interface, opts CheckOptions) (Report, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return Report{}, fmt.Errorf("check options: %w", err)
	}
	j := newJudge(ctx)
	var found []finding
	for read := 1; ; read++ {
		if read > 1 {
			if err := wait(ctx, opts.Interval); err != nil {
				return report(found, read-1), &IncompleteError{Reads: read - 1, Err: err}
			}
		}
		readAt := time.Now()
		state, err := list(ctx, client, opts.PageSize)
		if err != nil {
			if read == 1 {
				return Report{}, err
			}
			return report(found, read-1), &IncompleteError{Reads: read - 1, Err: err}
		}
		now, notes := find(j, state)
		now = append(now, unreservedAllocations(state.Pods, state.Claims)...)
		sortFindings(now)
		for i := range now {
			now[i].firstSeen = readAt
		}
		if read == 1 {
			found = now
		} else {
			found = again(found, now)
		}
		settleStale(found, readAt, opts.StaleAfter)
		settleUnpublished(found, readAt, opts.UnpublishedAfter)
		if len(found) == 0 || read >= 2 && (read == opts.Reads || !anyUnsettled(found)) {
			r := report(found, read)
			if state.NodesUnread != nil {
				r.NotJudged = append(r.NotJudged, fmt.Sprintf("%s not looked for: %v", PodClaimOnOtherNode, state.NodesUnread))
			}
			if state.DeviceClassesUnread != nil {
				r.NotJudged = append(r.NotJudged, fmt.Sprintf("%s: the selectors of DeviceClasses not checked: %v", AllocationMismatch, state.DeviceClassesUnread))
			}
			if state.DeviceTaintRulesUnread != nil {
				r.NotJudged = append(r.NotJudged, fmt.Sprintf("%s: the taints of DeviceTaintRules not checked, only those of ResourceSlices (allow list on devicetaintrules.resource.k8s.io to check them): %v", UntoleratedDeviceTaint, state.DeviceTaintRulesUnread))
			}
			r.NotJudged = append(r.NotJudged, notes...)
			return r, nil
		}
	}
}

// again returns those of now that before has too, each first seen when
// before's was.
func again(before, now []finding) []finding {
	seen := make(map[string]time.Time, len(before))
	for _, f := range before {
		seen[key(f)] = f.firstSeen
	}
	var out []finding
	for _, f := range now {
		if first, ok := seen[key(f)]; ok {
			f.firstSeen = first
			out = append(out, f)
		}
	}
	return out
}

// settleStale marks pending each StaleReservation of found whose pods
// have not been done for staleAfter at readAt, and each
// UnreservedAllocation that the reads have not found for staleAfter (see
// [CheckOptions.StaleAfter]); a negative staleAfter marks none.
func settleStale(found []finding, readAt time.Time, staleAfter time.Duration) {
	if staleAfter < 0 {
		return
	}
	for i := range found {
		f := &found[i]
		if f.Kind == UnreservedAllocation {
			if readAt.Sub(f.firstSeen) < staleAfter {
				f.pending = fmt.Sprintf("the reads span %s, less than the stale-after time %s: a pod that uses the claim may be on its way, or the claim's allocation about to be removed (to judge it, read for longer: more reads or a longer interval)", readAt.Sub(f.firstSeen).Truncate(time.Millisecond), staleAfter)
			}
			continue
		}
		if f.Kind != StaleReservation {
			continue
		}
		switch {
		case !f.doneSince.IsZero() && readAt.Sub(f.doneSince) < staleAfter:
			f.pending = fmt.Sprintf("its pods stopped %s ago, less than the stale-after time %s: the resourceclaim controller may still be working through a backlog", readAt.Sub(f.doneSince).Truncate(time.Second), staleAfter)
		case f.doneSince.IsZero() && readAt.Sub(f.firstSeen) < staleAfter:
			f.pending = fmt.Sprintf("its pods are gone (or record no finish time) and the reads span %s, less than the stale-after time %s: the resourceclaim controller may still be working through a backlog (to judge it, read for longer: more reads or a longer interval)", readAt.Sub(f.firstSeen).Truncate(time.Millisecond), staleAfter)
		}
	}
}

// settleUnpublished marks pending each UnpublishedPool of found that the
// reads up to readAt have found for less than unpublishedAfter (see
// [CheckOptions.UnpublishedAfter]), and says in the message of the
// others how long they have lasted; a negative unpublishedAfter marks
// none.
func settleUnpublished(found []finding, readAt time.Time, unpublishedAfter time.Duration) {
	for i := range found {
		f := &found[i]
		if f.Kind != UnpublishedPool {
			continue
		}
		lasted := readAt.Sub(f.firstSeen)
		if unpublishedAfter >= 0 && lasted < unpublishedAfter {
			f.pending = fmt.Sprintf("%s; the reads found it for %s, less than the unpublished-after time %s (to judge it, read for longer: more reads or a longer interval)", unpublishedPending, lasted.Truncate(time.Millisecond), unpublishedAfter)
			continue
		}
		f.pending = ""
		f.Message = fmt.Sprintf("%s, through reads spanning %s: neither has its driver published the pool again nor have the pods holding its devices been deleted", f.unpublishedMessage, lasted.Truncate(time.Millisecond))
	}
}

// key identifies a violation across reads (see finding.identity).
func key(f finding) string {
	if f.identity != "" {
		return string(f.Kind) + "|" + f.identity
	}
	return strings.Join([]string{string(f.Kind), deviceKey(f.Device), f.Counter, f.Pod, strings.Join(f.Claims, ",")}, "|")
}

// anyUnsettled tells whether a further read may change the verdict on one
// of found: a pending violation may turn out an artefact of a
// republication, a repairable one may be repaired.
func anyUnsettled(found []finding) bool {
	for _, f := range found {
		if f.pending != "" || f.repairable {
			return true
		}
	}
	return false
}

func report(found []finding, reads int) Report {
	r := Report{Reads: reads}
	for _, f := range found {
		if f.pending != "" {
			r.Pending = append(r.Pending, PendingViolation{Violation: f.Violation, Why: f.pending})
		} else {
			r.Violations = append(r.Violations, f.Violation)
		}
	}
	return r
}

func wait(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// List reads the objects the invariants are judged on, each kind in pages
// of DefaultPageSize objects. The pods, claims and nodes come without
// their managed fields, which nothing judges and which are a large part
// of each object.
func List(ctx context.Context, client kubernetes.Interface) (State, error) {
	return list(ctx, client, DefaultPageSize)
}

func list(ctx context.Context, client kubernetes.Interface, pageSize int64) (State, error) {
	var s State
	var err error
	s.Pods, err = listAll[v1.Pod](ctx, pageSize, withoutManagedFields(func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
		return client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, opts)
	}))
	if err != nil {
		return State{}, fmt.Errorf("list pods: %w", err)
	}
	s.Claims, err = listAll[resourceapi.ResourceClaim](ctx, pageSize, withoutManagedFields(func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
		return client.ResourceV1().ResourceClaims(metav1.NamespaceAll).List(ctx, opts)
	}))
	if err != nil {
		return State{}, fmt.Errorf("list resource claims: %w", err)
	}
	s.Nodes, err = listAll[v1.Node](ctx, pageSize, withoutManagedFields(func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
		return client.CoreV1().Nodes().List(ctx, opts)
	}))
	// Nodes serve one kind of violation only; without them that kind is
	// not judged, and the report says so.
	if s.NodesUnread, err = optionalList("nodes", err, false); err != nil {
		return State{}, err
	}
	s.Slices, err = listAll[resourceapi.ResourceSlice](ctx, pageSize, func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
		return client.ResourceV1().ResourceSlices().List(ctx, opts)
	})
	if err != nil {
		return State{}, fmt.Errorf("list resource slices: %w", err)
	}
	s.DeviceClasses, err = listAll[resourceapi.DeviceClass](ctx, pageSize, func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
		return client.ResourceV1().DeviceClasses().List(ctx, opts)
	})
	// Classes serve the class selectors of AllocationMismatch only;
	// without them those are not judged, and the report says so.
	if s.DeviceClassesUnread, err = optionalList("device classes", err, false); err != nil {
		return State{}, err
	}
	s.DeviceTaintRules, err = listAll[resourceapi.DeviceTaintRule](ctx, pageSize, func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
		return client.ResourceV1().DeviceTaintRules().List(ctx, opts)
	})
	// Rules serve UntoleratedDeviceTaint only, which still judges the
	// taints of slices without them; the report says so. Not found: the
	// API server does not serve resource.k8s.io/v1 DeviceTaintRules
	// (before Kubernetes 1.37).
	if s.DeviceTaintRulesUnread, err = optionalList("device taint rules", err, true); err != nil {
		return State{}, err
	}
	return s, nil
}

// optionalList sorts the error of listing a kind that the checker can do
// without: where the list is forbidden (or, with notServed, the kind is
// not served) it is the kind's unread error, which the report names;
// any other error is fatal. listAll returns no objects with an error.
func optionalList(kind string, err error, notServed bool) (unread, fatal error) {
	switch {
	case err == nil:
		return nil, nil
	case apierrors.IsForbidden(err), notServed && apierrors.IsNotFound(err):
		return fmt.Errorf("list %s: %w", kind, err), nil
	default:
		return nil, fmt.Errorf("list %s: %w", kind, err)
	}
}

// withoutManagedFields is page with the managed fields of the objects it
// lists dropped as each page arrives, so that a read holds only what the
// judges use. Of managed fields they read only those of ResourceSlices,
// DeviceClasses and DeviceTaintRules (specChanged), whose lists keep
// them.
func withoutManagedFields(page pager.ListPageFunc) pager.ListPageFunc {
	return func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
		obj, err := page(ctx, opts)
		if err != nil {
			return obj, err
		}
		err = meta.EachListItem(obj, func(o runtime.Object) error {
			m, err := meta.Accessor(o)
			if err != nil {
				return err
			}
			m.SetManagedFields(nil)
			return nil
		})
		return obj, err
	}
}

// listAll lists all objects of one kind in pages of pageSize; a list
// whose continuation expires is read again in full.
func listAll[T any](ctx context.Context, pageSize int64, page pager.ListPageFunc) ([]*T, error) {
	p := pager.New(page)
	p.PageSize = pageSize
	obj, _, err := p.List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	var out []*T
	err = meta.EachListItem(obj, func(o runtime.Object) error {
		item, ok := any(o).(*T)
		if !ok {
			return fmt.Errorf("list item is a %T, want a %T", o, item)
		}
		out = append(out, item)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
