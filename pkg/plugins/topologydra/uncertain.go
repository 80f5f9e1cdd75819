package topologydra

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/scheduler/util/assumecache"
)

// uncertainWrites holds the claims whose allocation write failed without
// telling whether the API server stored it (a timeout, a reset
// connection), and whose state could not be read afterwards either, and
// the extended resource claims that Unreserve could not delete while
// their allocation may be stored. Their in-flight allocation stays, so
// that their devices never look free while the claim may hold them:
// Unreserve keeps it, and it goes only once the claim's state is known,
// from a read (the next PreFilter of a pod that uses the claim), from the
// claim's deletion (the pod's next PreFilter deletes a leftover extended
// resource claim), from an informer event of the claim, or, where none of
// those comes (the pod is gone and the write was not stored, so the claim
// does not change), from the background re-read (rereadUncertain). The
// zero value is ready to use; safe for concurrent use.
type uncertainWrites struct {
	mu     sync.Mutex
	claims map[types.UID]uncertainWrite
}

// uncertainWrite is a claim whose write is uncertain: the resourceVersion
// the write started from, the UID under which its allocation is in
// flight (the claim's own, or the in-memory UID of an extended resource
// claim), and when it was recorded.
type uncertainWrite struct {
	namespace, name, resourceVersion string
	pending                          types.UID
	since                            time.Time
	// attempted is the allocation write as sent, where it may be sent
	// again to settle it (fenceWrite); nil otherwise.
	attempted *resourceapi.ResourceClaim
}

// add records claim (as of the write) with its allocation in flight under
// pending; attempted, where not nil, is the write as sent.
func (u *uncertainWrites) add(claim *resourceapi.ResourceClaim, pending types.UID, attempted *resourceapi.ResourceClaim) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.claims == nil {
		u.claims = map[types.UID]uncertainWrite{}
	}
	if _, ok := u.claims[claim.UID]; !ok {
		// Counted up and down, not set: every profile's plugin has a
		// list of its own.
		uncertainClaims.Inc()
	}
	u.claims[claim.UID] = uncertainWrite{claim.Namespace, claim.Name, claim.ResourceVersion, pending, time.Now(), attempted}
}

func (u *uncertainWrites) get(uid types.UID) (uncertainWrite, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	w, ok := u.claims[uid]
	return w, ok
}

func (u *uncertainWrites) has(uid types.UID) bool {
	_, ok := u.get(uid)
	return ok
}

// take removes uid and reports whether it was there.
func (u *uncertainWrites) take(uid types.UID) (uncertainWrite, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	w, ok := u.claims[uid]
	if ok {
		delete(u.claims, uid)
		uncertainClaims.Dec()
	}
	return w, ok
}

// olderThan lists the writes recorded before cutoff, by claim UID.
func (u *uncertainWrites) olderThan(cutoff time.Time) map[types.UID]uncertainWrite {
	u.mu.Lock()
	defer u.mu.Unlock()
	out := map[types.UID]uncertainWrite{}
	for uid, w := range u.claims {
		if w.since.Before(cutoff) {
			out[uid] = w
		}
	}
	return out
}

// takeIf removes uid where it still records w (not a later write of the
// same claim) and reports whether it did.
func (u *uncertainWrites) takeIf(uid types.UID, w uncertainWrite) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	if cur, ok := u.claims[uid]; !ok || cur != w {
		return false
	}
	delete(u.claims, uid)
	uncertainClaims.Dec()
	return true
}

// writeRefused reports whether err proves that the API server did not
// store the write: it answered with a status that refuses the request, or
// the request was never sent (no connection to the API server could be
// made). Anything else (timeouts, server errors, other transport errors)
// leaves the outcome open.
func writeRefused(err error) bool {
	var dial *net.OpError
	if errors.As(err, &dial) && dial.Op == "dial" {
		return true
	}
	var status apierrors.APIStatus
	if !errors.As(err, &status) {
		return false
	}
	switch status.Status().Code {
	case http.StatusBadRequest, http.StatusUnauthorized, http.StatusForbidden, http.StatusNotFound, http.StatusMethodNotAllowed,
		http.StatusConflict, http.StatusGone, http.StatusUnprocessableEntity, http.StatusTooManyRequests:
		return true
	}
	return false
}

// writeOutcome is what a read of a claim says about an allocation
// written to it for pod.
type writeOutcome int

const (
	outcomeUnknown writeOutcome = iota
	// outcomeStored: the claim is allocated and reserved for the pod.
	outcomeStored
	// outcomeNotStored: the claim is gone, replaced, or not allocated
	// for the pod, at a newer resourceVersion than the write's: the write
	// can no longer be stored.
	outcomeNotStored
	// outcomeNotYet: the claim is not allocated for the pod and still at
	// the resourceVersion the write started from. Not stored yet: the API
	// server may still be processing the write (a timeout or a cancelled
	// request does not stop it there), and it would then store it.
	outcomeNotYet
)

// readOutcome reads the claim from the API server (a quorum read) and
// tells whether the allocation written for podUID to claim (as sent: its
// resourceVersion is the one the write started from) is there; latest is
// the claim read (nil where it is gone).
func (pl *TopologyDRA) readOutcome(ctx context.Context, claim *resourceapi.ResourceClaim, podUID types.UID) (writeOutcome, *resourceapi.ResourceClaim, error) {
	latest, err := pl.client.ResourceV1().ResourceClaims(claim.Namespace).Get(ctx, claim.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return outcomeNotStored, nil, nil
	case err != nil:
		return outcomeUnknown, nil, err
	case latest.UID != claim.UID:
		return outcomeNotStored, latest, nil
	}
	if latest.Status.Allocation != nil {
		for _, r := range latest.Status.ReservedFor {
			if r.Resource == "pods" && r.UID == podUID {
				return outcomeStored, latest, nil
			}
		}
	}
	if !newerVersion(latest.ResourceVersion, claim.ResourceVersion) {
		return outcomeNotYet, latest, nil
	}
	return outcomeNotStored, latest, nil
}

// fenceWrite settles a write of claim (as sent) that is not stored yet
// (outcomeNotYet) by sending it again: the API server stores at most one
// of two writes from the same resourceVersion. Stored, it returns the
// claim as stored; a conflict means the first write (or another writer)
// got there first, which the next read tells; any other error leaves it
// open. A write that allocated nothing (the finalizer's update, which
// comes first) is not sent again: whatever becomes of it, no devices are
// taken.
func (pl *TopologyDRA) fenceWrite(ctx context.Context, claim *resourceapi.ResourceClaim) (writeOutcome, *resourceapi.ResourceClaim, error) {
	if claim.Status.Allocation == nil {
		return outcomeNotStored, nil, nil
	}
	stored, err := pl.client.ResourceV1().ResourceClaims(claim.Namespace).UpdateStatus(ctx, claim, metav1.UpdateOptions{})
	if err != nil {
		return outcomeUnknown, nil, err
	}
	return outcomeStored, stored, nil
}

// settleReads is how often, and how far apart, PreBind reads a claim
// whose write failed before it leaves the outcome to a later read.
var settleReads = wait.Backoff{Duration: 100 * time.Millisecond, Factor: 2, Steps: 5}

// settleTimeout bounds PreBind's reads of a claim whose write failed
// (settleReads). They do not end with PreBind's context: that is
// cancelled when another plugin's PreBind fails or the pod is preempted,
// and a write whose outcome no read tells keeps the claim's devices taken.
const settleTimeout = 10 * time.Second

// settleFailedWrite handles a failed write of claim i's allocation. Where
// the API shows the claim allocated and reserved for the pod (a timeout
// may come after the API server stored it), the cycle state, the claim
// cache and the in-flight entry take that in, as after a successful
// write, so that Unreserve removes the reservation and the devices never
// look free while the claim holds them. Where the error does not prove
// the write refused and no read tells, the claim is recorded as
// uncertain (see uncertainWrites). A claim that reads as not stored yet
// (outcomeNotYet) is settled by sending the write again (fenceWrite), but
// only while PreBind's context is live: a scheduler that is stopping (its
// lease lost) writes nothing more, and a pod whose PreBind was cancelled
// otherwise has it sent again at its next attempt (settleUncertain).
// attempted is the claim as of the last write attempted (nil:
// s.claims[i]).
func (pl *TopologyDRA) settleFailedWrite(ctx context.Context, podUID types.UID, s *stateData, i int, attempted *resourceapi.ResourceClaim, writeErr error) {
	logger := klog.FromContext(ctx)
	claim := s.claims[i]
	if attempted != nil {
		claim = attempted
	}
	var outcome writeOutcome
	var latest *resourceapi.ResourceClaim
	var readErr error
	live := ctx
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	refused := writeRefused(writeErr)
	_ = wait.ExponentialBackoffWithContext(ctx, settleReads, func(ctx context.Context) (bool, error) {
		outcome, latest, readErr = pl.readOutcome(ctx, claim, podUID)
		if outcome == outcomeNotYet {
			switch {
			case refused || claim.Status.Allocation == nil:
				// Refused, or what may still land allocates nothing (the
				// finalizer's update, which comes first).
				outcome = outcomeNotStored
			case live.Err() == nil:
				outcome, latest, readErr = pl.fenceWrite(ctx, claim)
			default:
				// Not written again from here: open.
				return true, nil
			}
		}
		return outcome != outcomeUnknown || refused, nil
	})
	switch outcome {
	case outcomeStored:
		pl.takeInStored(logger, latest, latest.UID)
		s.claims[i] = latest
	case outcomeUnknown, outcomeNotYet:
		if refused {
			return
		}
		pl.uncertain.add(claim, claim.UID, claim.DeepCopy())
		// The informer may have shown a newer version of the claim
		// already, before it was uncertain.
		if cached, err := pl.draManager.ResourceClaims().Get(claim.Namespace, claim.Name); err == nil {
			pl.settleFromInformer(cached)
		}
		if outcome == outcomeNotYet {
			logger.Error(writeErr, "Allocation write with unknown outcome, not stored yet: its devices stay taken until the pod's next attempt writes it again or the API server can no longer store it",
				"claim", klog.KObj(claim))
			return
		}
		logger.Error(readErr, "Allocation write with unknown outcome: its devices stay taken until the claim can be read",
			"claim", klog.KObj(claim), "writeErr", writeErr)
	}
}

// preFilterAPITimeout bounds the API requests that PreFilter makes (the
// read of a claim whose write is uncertain, the deletion of leftover
// extended resource claims): they run on the scheduling cycle, which no
// other pod passes meanwhile, and they come up when the API server is in
// trouble. A request that times out leaves the matter to the pod's next
// attempt.
var preFilterAPITimeout = 5 * time.Second

// settleUncertain settles claim if its write is uncertain: it reads the
// claim and, where the outcome is known, drops the in-flight entry (taking
// in the stored claim). It returns the claim to use (the one read where
// it was stored) and an error where the outcome is still unknown or the
// claim is gone (not found, or the name belongs to a claim with another
// UID): the claim cache has yet to see the deletion.
func (pl *TopologyDRA) settleUncertain(ctx context.Context, claim *resourceapi.ResourceClaim) (*resourceapi.ResourceClaim, error) {
	if !pl.uncertain.has(claim.UID) {
		return claim, nil
	}
	allocation := pl.draManager.ResourceClaims().GetPendingAllocation(claim.UID)
	// read returns the claim as the API has it; nil where it is gone or
	// replaced by one of another UID.
	read := func() (*resourceapi.ResourceClaim, error) {
		latest, err := pl.client.ResourceV1().ResourceClaims(claim.Namespace).Get(ctx, claim.Name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			return nil, nil
		case err != nil:
			return nil, fmt.Errorf("an allocation of claim %s was written without a known outcome, and the claim cannot be read: %w", claim.Name, err)
		case latest.UID != claim.UID:
			return nil, nil
		}
		return latest, nil
	}
	latest, err := read()
	if err != nil {
		return nil, err
	}
	if w, ok := pl.uncertain.get(claim.UID); ok && latest != nil && latest.Status.Allocation == nil &&
		!newerVersion(latest.ResourceVersion, w.resourceVersion) && time.Since(w.since) < uncertainRereadAge {
		// Unchanged since the write, which the API server may still
		// store: sending it again settles it (fenceWrite).
		var fenceErr error
		if w.attempted != nil {
			var outcome writeOutcome
			var stored *resourceapi.ResourceClaim
			outcome, stored, fenceErr = pl.fenceWrite(ctx, w.attempted)
			switch {
			case outcome == outcomeStored:
				latest = stored
			case outcome == outcomeNotStored:
				// It allocated nothing: nothing to wait for.
				fenceErr = nil
				w.resourceVersion = ""
			case apierrors.IsConflict(fenceErr):
				// The first write, or another writer, got there first.
				if latest, err = read(); err != nil {
					return nil, err
				}
				fenceErr = nil
			}
		}
		if latest != nil && latest.Status.Allocation == nil && w.resourceVersion != "" && !newerVersion(latest.ResourceVersion, w.resourceVersion) {
			again := ""
			if fenceErr != nil {
				again = fmt.Sprintf("; writing it again failed: %v", fenceErr)
			}
			return nil, fmt.Errorf("an allocation of claim %s was written without a known outcome, and the API server may still store it (the claim has not changed since%s); its devices stay taken until the claim changes or, at the latest, %v after the write", claim.Name, again, uncertainRereadAge)
		}
	}
	if _, ok := pl.uncertain.take(claim.UID); ok {
		if latest != nil && latest.Status.Allocation != nil && allocation != nil {
			pl.takeInStored(klog.FromContext(ctx), latest, latest.UID)
			return latest, nil
		}
		pl.releaseInFlight(claim.Namespace, claim.Name, claim.UID)
	}
	// Settled here, or meanwhile (an informer event): the claim as read.
	if latest == nil {
		return nil, fmt.Errorf("claim %s was deleted", claim.Name)
	}
	return latest, nil
}

// uncertainRereadAge is how old an uncertain write must be before the
// background re-read settles it: longer than the API server's default
// request timeout (60 s), so that the write can no longer be stored
// after the read.
const uncertainRereadAge = 2 * time.Minute

// uncertainRereadInterval is how often the background re-read runs.
const uncertainRereadInterval = time.Minute

// rereadUncertain reads, from the API server, each claim whose write was
// recorded as uncertain before now less uncertainRereadAge, and settles
// it where the read succeeds: an allocation stored is taken in, as after
// a write that succeeded (the claim controller or the pod's next attempt
// deals with it from there); where there is none, or the claim is gone,
// its in-flight allocation goes. Without it, a write that was not stored
// keeps its devices taken for as long as the scheduler runs where the
// claim does not change and no pod reads it again (its pod deleted).
// Pods waiting for devices are then retried (activateWaiting): no claim
// event marks the release.
func (pl *TopologyDRA) rereadUncertain(ctx context.Context, now time.Time) {
	logger := klog.FromContext(ctx)
	for uid, w := range pl.uncertain.olderThan(now.Add(-uncertainRereadAge)) {
		latest, err := pl.client.ResourceV1().ResourceClaims(w.namespace).Get(ctx, w.name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			latest = nil
		case err != nil:
			logger.V(2).Info("Claim of an allocation write with unknown outcome still cannot be read", "claim", klog.KRef(w.namespace, w.name), "err", err)
			continue
		case latest.UID != uid:
			latest = nil
		}
		if !pl.uncertain.takeIf(uid, w) {
			continue // settled meanwhile, or written again
		}
		if latest != nil && latest.Status.Allocation != nil {
			pl.takeInStored(logger, latest, w.pending)
			logger.V(2).Info("Allocation write with unknown outcome was stored", "claim", klog.KObj(latest))
			continue
		}
		pl.releaseInFlight(w.namespace, w.name, w.pending)
		logger.V(2).Info("Allocation write with unknown outcome was not stored: its devices are free again", "claim", klog.KRef(w.namespace, w.name))
	}
}

// settleFromInformer settles claim's uncertain write, if any, where the
// informer shows the claim at a newer resourceVersion than the write
// started from: the write was stored before that version, or not at all.
func (pl *TopologyDRA) settleFromInformer(claim *resourceapi.ResourceClaim) {
	w, ok := pl.uncertain.get(claim.UID)
	if !ok || !newerVersion(claim.ResourceVersion, w.resourceVersion) {
		return
	}
	w, ok = pl.uncertain.take(claim.UID)
	if !ok {
		return
	}
	if claim.Status.Allocation != nil {
		// The claim cache follows the informer through a handler of its
		// own, which may not have run yet: the allocation goes in first,
		// so that the devices never look free.
		pl.takeInStored(klog.Background(), claim, w.pending)
		return
	}
	pl.dropInFlight(w.pending, nil)
}

// settleGone settles the uncertain write, if any, of a claim that is gone
// from the API (deleted): an allocation stored went with it.
func (pl *TopologyDRA) settleGone(uid types.UID) {
	if w, ok := pl.uncertain.take(uid); ok {
		pl.dropInFlight(w.pending, nil)
	}
}

// dropInFlight drops the in-flight allocation under pending of a write
// that was not stored and, where there was one, runs then (nil: nothing)
// and retries the pods waiting for devices.
func (pl *TopologyDRA) dropInFlight(pending types.UID, then func()) {
	if !pl.draManager.ResourceClaims().MaybeRemoveClaimPendingAllocation(pending, false) {
		return
	}
	if then != nil {
		then()
	}
	pl.activateWaiting(klog.Background())
}

// takeInStored puts a claim as the API stores it, allocated, into the
// claim cache and drops its in-flight allocation (under pending), as
// after a write that succeeded. Where the claim cache has not seen the
// claim yet (an extended resource claim created in PreBind, its informer
// behind), the in-flight allocation is what keeps the devices taken: it
// goes once the cache has the claim (awaitCached, in the background).
func (pl *TopologyDRA) takeInStored(logger klog.Logger, claim *resourceapi.ResourceClaim, pending types.UID) {
	err := pl.draManager.ResourceClaims().AssumeClaimAfterAPICall(claim)
	if errors.Is(err, assumecache.ErrNotFound) {
		go func() {
			pl.awaitCached(klog.NewContext(context.Background(), logger), claim)
			pl.draManager.ResourceClaims().MaybeRemoveClaimPendingAllocation(pending, true)
		}()
		return
	}
	if err != nil {
		logger.V(5).Info("Claim not stored in assume cache", "claim", klog.KObj(claim), "err", err)
	}
	pl.draManager.ResourceClaims().MaybeRemoveClaimPendingAllocation(pending, true)
}

// newerVersion reports whether resourceVersion a is newer than b. Versions
// are compared as the integers etcd gives out, as the scheduler's claim
// cache does; one that is not an integer is never newer.
func newerVersion(a, b string) bool {
	va, errA := strconv.ParseInt(a, 10, 64)
	vb, errB := strconv.ParseInt(b, 10, 64)
	return errA == nil && errB == nil && va > vb
}

// releaseInFlight drops the in-flight allocation of a claim whose write
// was not stored and puts the informer's copy back into the claim cache.
func (pl *TopologyDRA) releaseInFlight(namespace, name string, uid types.UID) {
	pl.dropInFlight(uid, func() { pl.draManager.ResourceClaims().AssumedClaimRestore(namespace, name) })
}

// activateWaiting moves the pods that wait for devices (not bound, with
// claims or DRA-backed extended resources) to the scheduler's active
// queue: the in-flight allocation of a write whose outcome was unknown
// went, and no cluster event tells the queue that its devices are free.
// It lists every pod, which this rare event can afford; pods of other
// schedulers are not in this scheduler's queue, which ignores them.
func (pl *TopologyDRA) activateWaiting(logger klog.Logger) {
	if pl.handle == nil || pl.pods == nil {
		return
	}
	pods, err := pl.pods.List(labels.Everything())
	if err != nil {
		return
	}
	waiting := map[string]*v1.Pod{}
	for _, p := range pods {
		if p.Spec.NodeName != "" || p.DeletionTimestamp != nil {
			continue
		}
		if len(p.Spec.ResourceClaims) == 0 {
			if ext, err := pl.draExtendedResources(p); err != nil || len(ext) == 0 {
				continue
			}
		}
		waiting[p.Namespace+"/"+p.Name] = p
	}
	if len(waiting) > 0 {
		logger.V(2).Info("Devices of an allocation write with unknown outcome are free again: retrying the pods that wait for devices", "pods", len(waiting))
		pl.handle.Activate(logger, waiting)
	}
}

// claimHandler settles uncertain writes from the claim informer: a
// claim deleted, or seen at a newer resourceVersion than the write started
// from, shows the API's state (an allocation there is in the informer's
// copy, so the in-flight entry can go either way).
// It also forgets the untimed binding waits (untimedWaits) of claims that
// are deallocated or deleted.
func (pl *TopologyDRA) claimHandler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(oldObj, obj any) {
			// A claim deleted and created again under its name while the
			// informer listed anew comes as an update.
			if old, ok := oldObj.(*resourceapi.ResourceClaim); ok {
				if claim, ok := obj.(*resourceapi.ResourceClaim); ok && claim.UID != old.UID {
					pl.settleGone(old.UID)
					pl.untimed.forget(old.UID)
				}
			}
			if claim, ok := obj.(*resourceapi.ResourceClaim); ok {
				pl.settleFromInformer(claim)
				if claim.Status.Allocation == nil {
					pl.untimed.forget(claim.UID)
				}
			}
		},
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			if claim, ok := obj.(*resourceapi.ResourceClaim); ok {
				pl.settleGone(claim.UID)
				pl.untimed.forget(claim.UID)
			}
		},
	}
}
