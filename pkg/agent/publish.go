package agent

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
)

// Event reasons on the Node about publishing.
const (
	// ReasonPublishFailed (Warning, once per distinct cause whichever
	// slice the API server's message names, for at most 8 causes, until
	// the slices are published): the API server refuses the agent's
	// ResourceSlice writes for a cause that retrying does not fix (401
	// or 403: RBAC, a webhook, the agent's credentials; 422 or 400: an
	// admission policy, or the slice is invalid). The node's slices in
	// the API stay as they were; the note names the cause and what to
	// check.
	ReasonPublishFailed = "TopodraPublishFailed"
	// ReasonPublished (Normal): the node's slices are published as the
	// agent wants them, after a ReasonPublishFailed.
	ReasonPublished = "TopodraPublished"
)

// Values of the "reason" label of MetricPublishErrors.
const (
	// PublishErrorForbidden: 403 or 401, RBAC, a webhook or the agent's
	// credentials refuse the write. Not fixed by retrying
	// (ReasonPublishFailed).
	PublishErrorForbidden = "forbidden"
	// PublishErrorInvalid: 422 or 400, an admission policy refuses the
	// slice or the API server finds it invalid. Not fixed by retrying
	// (ReasonPublishFailed).
	PublishErrorInvalid = "invalid"
	// PublishErrorConflict: 409, the slice changed or was created
	// meanwhile; the retry reads it again.
	PublishErrorConflict = "conflict"
	// PublishErrorUnavailable: the API server cannot be reached, times
	// out, is overloaded (429) or fails (5xx); retried.
	PublishErrorUnavailable = "unavailable"
	// PublishErrorDroppedFields: the API server stored a slice without
	// some of its fields (resourceslice.DroppedFieldsError,
	// ReasonSliceFieldsDropped).
	PublishErrorDroppedFields = "dropped_fields"
	PublishErrorOther         = "other"
)

// publishErrorReasons are the values of the "reason" label of
// MetricPublishErrors, in the order of Agent.publishErrors.
var publishErrorReasons = [...]string{
	PublishErrorForbidden,
	PublishErrorInvalid,
	PublishErrorConflict,
	PublishErrorUnavailable,
	PublishErrorDroppedFields,
	PublishErrorOther,
}

// PublishErrorReasons returns the values of the "reason" label of
// MetricPublishErrors, in the order the metric reports them.
func PublishErrorReasons() []string {
	return publishErrorReasons[:]
}

// publishErrorCounts counts publishing errors by the index of their
// reason in publishErrorReasons.
type publishErrorCounts [len(publishErrorReasons)]atomic.Uint64

// publishErrorIndex is the index in publishErrorReasons of the reason of
// err, an error that the resourceslice controller reported.
func publishErrorIndex(err error) int {
	reason := PublishErrorOther
	var dropped *resourceslice.DroppedFieldsError
	var netErr net.Error
	switch {
	case errors.As(err, &dropped):
		reason = PublishErrorDroppedFields
	case apierrors.IsForbidden(err), apierrors.IsUnauthorized(err):
		reason = PublishErrorForbidden
	case apierrors.IsInvalid(err), apierrors.IsBadRequest(err):
		reason = PublishErrorInvalid
	case apierrors.IsConflict(err), apierrors.IsAlreadyExists(err):
		reason = PublishErrorConflict
	case apierrors.IsTooManyRequests(err), apierrors.IsServerTimeout(err), apierrors.IsTimeout(err),
		statusCode(err) >= http.StatusInternalServerError,
		errors.As(err, &netErr), errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, context.DeadlineExceeded):
		reason = PublishErrorUnavailable
	}
	for i, r := range publishErrorReasons {
		if r == reason {
			return i
		}
	}
	return len(publishErrorReasons) - 1
}

// statusCode is the HTTP status code of the API server's answer that err
// wraps, 0 for none.
func statusCode(err error) int32 {
	var status apierrors.APIStatus
	if !errors.As(err, &status) {
		return 0
	}
	return status.Status().Code
}

// apiMessage is the message of the API server's answer that err wraps, or
// err's own where it wraps none.
func apiMessage(err error) string {
	var status apierrors.APIStatus
	if errors.As(err, &status) && status.Status().Message != "" {
		return status.Status().Message
	}
	return err.Error()
}

// refusalCause identifies the cause of a slice write that the API server
// refused with reason (a value of publishErrorReasons): reason and the API
// server's message, with the refused slice's name, where the answer's
// details give it, replaced by "<name>". The API server names a slice
// that the controller creates (generateName) before admission, so each
// retry of a refused create names another slice in the message; the cause
// is the same.
func refusalCause(reason string, err error) string {
	msg := apiMessage(err)
	var status apierrors.APIStatus
	if errors.As(err, &status) {
		if details := status.Status().Details; details != nil && details.Name != "" {
			msg = strings.ReplaceAll(msg, details.Name, "<name>")
		}
	}
	return reason + ": " + msg
}

// maxPublishRefused is how many causes of refused slice writes are
// reported on the Node until the slices are published: a refusal for
// another cause is only logged, so that messages that differ on every
// retry (a webhook's that names the generated slice without the
// answer's details naming it) cannot add an event per retry.
const maxPublishRefused = 8

// publishFailed handles an error that the resourceslice controller
// reports (see publishHooks): it counts it in MetricPublishErrors, reports
// dropped fields (checkDroppedFields), and reports a write that the API
// server refuses for a cause that retrying does not fix as a
// ReasonPublishFailed Warning on the Node, once per cause (refusalCause)
// and for at most maxPublishRefused causes until the slices are published
// (publishSynced). The controller has logged the error and retries.
func (a *Agent) publishFailed(ctx context.Context, err error) {
	a.checkDroppedFields(ctx, err)
	i := publishErrorIndex(err)
	a.publishErrors[i].Add(1)
	var check string
	switch publishErrorReasons[i] {
	case PublishErrorForbidden:
		check = "check the ClusterRole topodra-node-agent (resourceslices create, update, delete), webhooks on resourceslices and the agent's credentials"
	case PublishErrorInvalid:
		check = "check the ValidatingAdmissionPolicy that the message names (topodra-node-agent-own-slices admits only the slices of the node that the agent's service-account token names: ServiceAccountTokenPodNodeInfo), otherwise the slice's fields (--owned-taint-key, the agent's version against the API server's)"
	default:
		return
	}
	cause := refusalCause(publishErrorReasons[i], err)
	a.mutex.Lock()
	seen := a.publishRefused.Has(cause)
	full := !seen && a.publishRefused.Len() >= maxPublishRefused
	if !seen && !full {
		a.publishRefused.Insert(cause)
	}
	a.mutex.Unlock()
	if full {
		klog.FromContext(ctx).V(2).Info("Not reporting another cause of refused ResourceSlice writes on the Node", "reported", maxPublishRefused, "cause", cause)
	}
	if seen || full {
		return
	}
	a.nodeCauseEvent(v1.EventTypeWarning, ReasonPublishFailed, "Publish",
		"the API server refuses the ResourceSlice writes of %s (%v), and retrying does not help: until it accepts them the node's slices in the API stay as they were, without the devices and taints that changed since (a faulty GPU's %s), and schedulers allocate from them; %s",
		a.opts.DriverName, err, HealthTaintKey, check)
}

// publishSynced handles a sync that left the node's slices in the API as
// the agent wants them: after a ReasonPublishFailed it logs that and
// records a ReasonPublished event, and forgets the causes reported, so
// that a later refusal is reported again.
func (a *Agent) publishSynced(ctx context.Context) {
	a.mutex.Lock()
	refused := a.publishRefused.Len()
	a.publishRefused.Clear()
	a.mutex.Unlock()
	if refused == 0 {
		return
	}
	klog.FromContext(ctx).Info("The API server accepts the node's ResourceSlices again")
	a.nodeEvent(v1.EventTypeNormal, ReasonPublished, "Publish", "%s publishes the node's devices again: the API server accepts its ResourceSlices", a.opts.DriverName)
}

// publishHooks are the hooks of the agent's publishers.
func (a *Agent) publishHooks() publishHooks {
	return publishHooks{failed: a.publishFailed, synced: a.publishSynced}
}

// slicesSynced says whether the node's slices in the API are those the
// agent wants published (see Publisher.Synced); false before the first
// publish and while the agent publishes nothing (holdPublishing). It does
// not wait for publishMutex: a scrape of the metrics must answer while
// the API server does not.
func (a *Agent) slicesSynced() bool {
	a.mutex.Lock()
	hold := a.holdPublishing
	a.mutex.Unlock()
	p := a.publishing.Load()
	return p != nil && !hold && p.Synced()
}

// syncState follows the syncs of a resourceslice controller, to tell
// whether the API has the slices of the resources last handed to it (see
// Publisher.Synced). The controller syncs one pool at a time, in one
// worker: the errors it reports between the queue's Get of a pool and its
// Done are that sync's.
type syncState struct {
	mutex sync.Mutex
	// version counts the resources handed to the controller after those
	// it started with (version 0); pools are the pools of the latest.
	version int64
	pools   sets.Set[string]
	// running is the sync under way, nil between syncs.
	running *poolSync
	// last holds the last finished sync of each pool of the latest
	// resources that was synced, and of each other pool whose last sync
	// failed (its slices may still be in the API).
	last map[string]poolSync
}

// poolSync is one sync of a pool.
type poolSync struct {
	// version is the syncState's version when the sync began: the sync
	// published the resources of that version or of a later one.
	version int64
	// failed: the sync reported an error other than dropped fields,
	// and did not make every write it needed.
	failed bool
	// dropped: the API server dropped fields of a slice written in this
	// sync, or in one before it of the same version (the controller then
	// takes what was stored for what it wants, and syncs without error).
	dropped bool
}

func newSyncState(resources *resourceslice.DriverResources) *syncState {
	s := &syncState{last: map[string]poolSync{}}
	s.pools = poolNames(resources)
	return s
}

func poolNames(resources *resourceslice.DriverResources) sets.Set[string] {
	pools := sets.New[string]()
	for name := range resources.Pools {
		pools.Insert(name)
	}
	return pools
}

// update records that the controller was handed new resources.
func (s *syncState) update(resources *resourceslice.DriverResources) {
	s.mutex.Lock()
	defer s.mutex.Unlock()
	s.version++
	s.pools = poolNames(resources)
}

// begin records that a sync of a pool begins.
func (s *syncState) begin() {
	s.mutex.Lock()
	defer s.mutex.Unlock()
	s.running = &poolSync{version: s.version}
}

// report records an error that the controller reported.
func (s *syncState) report(err error) {
	s.mutex.Lock()
	defer s.mutex.Unlock()
	if s.running == nil {
		// Not from a sync (an Update the controller refuses): the
		// syncs that follow tell.
		return
	}
	var dropped *resourceslice.DroppedFieldsError
	if errors.As(err, &dropped) {
		s.running.dropped = true
	} else {
		s.running.failed = true
	}
}

// end records that the sync of pool has ended, and returns whether the
// API now has the desired slices (see synced).
func (s *syncState) end(pool string) bool {
	s.mutex.Lock()
	defer s.mutex.Unlock()
	if s.running == nil {
		return s.syncedLocked()
	}
	run := *s.running
	s.running = nil
	if prev, ok := s.last[pool]; ok && prev.version == run.version && prev.dropped {
		run.dropped = true
	}
	if s.pools.Has(pool) || run.failed {
		s.last[pool] = run
	} else {
		delete(s.last, pool)
	}
	return s.syncedLocked()
}

// synced says whether the API has the slices of the latest resources.
func (s *syncState) synced() bool {
	s.mutex.Lock()
	defer s.mutex.Unlock()
	return s.syncedLocked()
}

func (s *syncState) syncedLocked() bool {
	for pool := range s.pools {
		run, ok := s.last[pool]
		if !ok || run.failed || run.dropped || run.version != s.version {
			return false
		}
	}
	for pool, run := range s.last {
		if !s.pools.Has(pool) && run.failed {
			return false
		}
	}
	return true
}
