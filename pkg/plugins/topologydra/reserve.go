package topologydra

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/topodra/topodra/pkg/allocator"
)

// Reserve marks the allocation chosen for the node as in flight in the
// scheduler's shared claim tracker, so that no other pod — of this profile
// or another one in the same binary — is given the same devices before
// PreBind has written them to the API.
func (pl *TopologyDRA) Reserve(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, nodeName string) *fwk.Status {
	logger := klog.FromContext(ctx)
	s, err := getState(cs)
	if err != nil {
		return nil // PreFilter skipped the pod: no claims.
	}
	// The pod has a node: the headroom holds it back no longer.
	pl.heldBack.done(pod.UID)
	toAllocate, allocClaims := s.claimsOn(nodeName)
	if len(toAllocate) == 0 {
		// Nothing to allocate, or only extended resources that a device
		// plugin offers on this node.
		return nil
	}
	res := s.getResult(nodeName)
	if res == nil || len(res.Allocations) != len(toAllocate) {
		// Filter accepted the node, so this is a bug.
		return internalError(logger, errors.New("no allocation recorded for the chosen node"), "node", klog.KRef("", nodeName))
	}
	if res.Unverified {
		// Filter decided this node by counting; upstream allocates the
		// chosen devices now, on this node only.
		nodeInfo, err := pl.handle.SnapshotSharedLister().NodeInfos().Get(nodeName)
		if err != nil {
			return internalError(logger, fmt.Errorf("node %s: %w", nodeName, err))
		}
		verifyCtx, cancel := pl.withFilterTimeout(ctx)
		verified, err := s.allocator.Verify(verifyCtx, nodeInfo.Node(), allocClaims, res)
		cancel()
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			// Reserve runs serially: a slow verification must not stall
			// every other pod. The pod retries with backoff.
			return fwk.AsStatus(fmt.Errorf("node %s: timed out verifying the allocation of devices", nodeName))
		}
		if err != nil {
			// As in Filter: bad input fails the cycle like a CEL error
			// there; anything else is a fault. Both retry with backoff.
			if errors.Is(err, allocator.ErrInvalidInput) {
				return inputError(logger, err, "pod", klog.KObj(pod), "node", klog.KRef("", nodeName))
			}
			if ctx.Err() != nil {
				return fwk.AsStatus(fmt.Errorf("verifying the allocation on node %s: %w", nodeName, context.Cause(ctx)))
			}
			return internalError(logger, fmt.Errorf("verify the allocation on node %s: %w", nodeName, err), "pod", klog.KObj(pod))
		}
		if verified.CountingRefused {
			// Filter and Verify saw the same snapshot, so counting and
			// upstream disagree: a bug to report, and a node to allocate
			// with upstream directly for a while.
			verifyMismatches.Inc()
			pl.skipCountingOn(nodeName)
			logger.Error(nil, "Counted allocation not confirmed by the upstream allocator", "pod", klog.KObj(pod), "node", klog.KRef("", nodeName),
				"claims", klog.KObjSlice(allocClaims), "counted", klog.Format(res.Allocations), "upstreamFeasible", verified.Allocations != nil)
		}
		if verified.Allocations == nil || len(verified.Allocations) != len(toAllocate) {
			// The next attempt allocates this node with upstream directly.
			// An error, not unschedulable: no cluster event need follow,
			// so the pod retries after its backoff.
			return fwk.AsStatus(fmt.Errorf("the allocation counted for node %s was not confirmed by the upstream allocator; retrying with it", nodeName))
		}
		res = verified
	}
	s.nodeName, s.result = nodeName, res
	for j, index := range toAllocate {
		allocation := res.Allocations[j].DeepCopy()
		claim := s.claims[index].DeepCopy()
		if s.isExtendedInMemory(index) {
			// The node's variant of the claim, under its random UID.
			claim = allocClaims[j].DeepCopy()
		}
		if !slices.Contains(claim.Finalizers, resourceapi.Finalizer) {
			claim.Finalizers = append(claim.Finalizers, resourceapi.Finalizer)
		}
		claim.Status.Allocation = allocation
		if err := pl.draManager.ResourceClaims().SignalClaimPendingAllocation(claim.UID, claim); err != nil {
			return internalError(logger, fmt.Errorf("mark allocation of claim %s in flight: %w", claim.Name, err))
		}
		s.allocations[index] = allocation
		logger.V(5).Info("Reserved devices", "pod", klog.KObj(pod), "claim", klog.KObj(claim), "node", klog.KRef("", nodeName), "allocation", klog.Format(allocation))
	}
	return nil
}

// Unreserve undoes Reserve and whatever PreBind managed to write: in-flight
// allocations are dropped (the claim cache goes back to the API's view),
// an allocation PreBind wrote for a claim that only this pod uses is
// removed (nothing else would give back a claim the pod names, once the
// pod is gone), and the pod is removed from reservedFor of the other
// claims that list it. It is idempotent.
func (pl *TopologyDRA) Unreserve(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, nodeName string) {
	logger := klog.FromContext(ctx)
	s, err := getState(cs)
	if err != nil {
		return
	}
	ext := s.extended
	var created string
	if ext != nil && ext.created != nil {
		// PreBind created it for this attempt; the next one makes its own.
		// Deleted before its in-flight allocation is released, so that its
		// devices do not look free while the API may still hold its
		// allocation (a write whose reply was lost). The allocation still
		// in flight is uncertain from before the delete: where the delete
		// fails, it stays until the claim's state is known (the pod's next
		// PreFilter deletes the claim, or the informer shows it).
		created = ext.created.Name
		if pl.draManager.ResourceClaims().GetPendingAllocation(ext.pendingUID) != nil {
			pl.uncertain.add(ext.created, ext.pendingUID, nil)
		}
		if err := pl.deleteExtendedClaim(ctx, ext.created); err != nil {
			logger.Error(err, "Delete the extended resource claim", "pod", klog.KObj(pod), "claim", klog.KObj(ext.created))
			// The informer may have shown a newer version of the claim
			// already, before it was uncertain.
			if cached, err := pl.draManager.ResourceClaims().Get(ext.created.Namespace, ext.created.Name); err == nil {
				pl.settleFromInformer(cached)
			}
		} else {
			logger.V(5).Info("Deleted extended resource claim", "pod", klog.KObj(pod), "claim", klog.KObj(ext.created))
			pl.uncertain.take(ext.created.UID)
			ext.created = nil
		}
	}
	for _, index := range s.toAllocate {
		claim := s.claims[index]
		if s.isExtendedInMemory(index) {
			if ext.created != nil && pl.uncertain.has(ext.created.UID) {
				// Not deleted, and its allocation may be stored.
				continue
			}
			// In flight under its random UID.
			if pl.draManager.ResourceClaims().MaybeRemoveClaimPendingAllocation(ext.pendingUID, false) {
				if created != "" {
					pl.draManager.ResourceClaims().AssumedClaimRestore(claim.Namespace, created)
				}
				pl.released.add(pod.UID)
				logger.V(5).Info("Released in-flight allocation", "pod", klog.KObj(pod), "claim", klog.KObj(claim))
			}
			continue
		}
		if pl.uncertain.has(claim.UID) {
			// Its write may be stored: the devices stay taken until the
			// claim's state is known.
			continue
		}
		if pl.draManager.ResourceClaims().MaybeRemoveClaimPendingAllocation(claim.UID, false) {
			pl.draManager.ResourceClaims().AssumedClaimRestore(claim.Namespace, claim.Name)
			pl.released.add(pod.UID)
			logger.V(5).Info("Released in-flight allocation", "pod", klog.KObj(pod), "claim", klog.KObj(claim))
		}
	}
	for i, claim := range s.claims {
		if s.isExtendedInMemory(i) {
			continue
		}
		if claim.Status.Allocation == nil || !resourceclaim.IsReservedForPod(pod, claim, false) {
			continue
		}
		if s.allocations[i] != nil && len(claim.Status.ReservedFor) == 1 && !pl.uncertain.has(claim.UID) && pl.deallocateWritten(ctx, pod, claim) {
			continue
		}
		// A strategic merge patch removes just this pod, whatever else
		// changed in the claim meanwhile.
		patch := fmt.Sprintf(`{"metadata":{"uid":%q},"status":{"reservedFor":[{"$patch":"delete","uid":%q}]}}`, claim.UID, pod.UID)
		patched, err := pl.client.ResourceV1().ResourceClaims(claim.Namespace).Patch(ctx, claim.Name, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}, "status")
		if err != nil {
			// The next scheduling attempt of the pod runs Unreserve again.
			logger.Error(err, "Remove pod from claim reservedFor", "pod", klog.KObj(pod), "claim", klog.KObj(claim))
			continue
		}
		// The claim cache may hold the copy PreBind wrote, reserved for
		// the pod: the next attempt must see the reservation gone and
		// write it again, whatever the informer shows by then.
		pl.assumeWritten(logger, patched)
	}
}

// deallocateWritten removes the allocation and the pod's reservation that
// PreBind wrote to claim (claim is the object as written), provided
// nothing changed the claim since: another pod that reserved it meanwhile
// keeps it allocated. It reports whether the claim was deallocated.
func (pl *TopologyDRA) deallocateWritten(ctx context.Context, pod *v1.Pod, claim *resourceapi.ResourceClaim) bool {
	logger := klog.FromContext(ctx)
	// The resourceVersion of the write makes a changed claim a conflict.
	updated, err := pl.deallocate(ctx, claim)
	if err != nil {
		logger.V(2).Info("Allocation written in a failed binding cycle not removed; removing the pod's reservation only", "pod", klog.KObj(pod), "claim", klog.KObj(claim), "err", err)
		return false
	}
	logger.V(5).Info("Removed allocation written in a failed binding cycle", "pod", klog.KObj(pod), "claim", klog.KObj(claim))
	pl.assumeWritten(logger, updated)
	return true
}

// deallocate writes claim without its allocation, reservations and
// devices' status, at claim's resourceVersion (a claim changed since is a
// conflict), and returns the claim written.
func (pl *TopologyDRA) deallocate(ctx context.Context, claim *resourceapi.ResourceClaim) (*resourceapi.ResourceClaim, error) {
	claim = claim.DeepCopy()
	claim.Status.ReservedFor = nil
	claim.Status.Allocation = nil
	claim.Status.Devices = nil
	return pl.client.ResourceV1().ResourceClaims(claim.Namespace).UpdateStatus(ctx, claim, metav1.UpdateOptions{})
}

// assumeWritten puts claim, as a write of this scheduler returned it, into
// the claim cache.
func (pl *TopologyDRA) assumeWritten(logger klog.Logger, claim *resourceapi.ResourceClaim) {
	if err := pl.draManager.ResourceClaims().AssumeClaimAfterAPICall(claim); err != nil {
		// Only fails when the informer already has a newer object.
		logger.V(5).Info("Claim not stored in assume cache", "claim", klog.KObj(claim), "err", err)
	}
}

// noteUnowned counts, per driver, the devices of allocations written to
// claims (PreBind) that do not carry the owned taint (ownedTaintKey, in their slice or from a
// DeviceTaintRule) and logs the first of each driver: the default
// scheduler does not leave such devices to topodra, so where it runs
// beside topodra it can hand out the same device (docs/install.md, "Other
// drivers' devices": a DeviceTaintRule per driver owns them). Nothing is
// counted without an owned taint key.
func (pl *TopologyDRA) noteUnowned(logger klog.Logger, a *allocator.Allocator, allocations []resourceapi.AllocationResult) {
	if pl.ownedToleration == nil || a == nil {
		return
	}
	key := pl.ownedToleration.Key
	for _, alloc := range allocations {
		for _, r := range alloc.Devices.Results {
			if found, tainted := a.DeviceHasTaint(r.Driver, r.Pool, r.Device, key); !found || tainted {
				continue
			}
			unownedAllocations.WithLabelValues(r.Driver).Inc()
			if _, warned := pl.unownedWarned.LoadOrStore(r.Driver, struct{}{}); !warned {
				logger.Info("Allocating devices without the owned taint: a default scheduler running beside topodra can allocate the same devices; own them with a DeviceTaintRule for the driver (see manifests/examples/owned-nic-taint-rule.yaml)",
					"driver", r.Driver, "device", r.Pool+"/"+r.Device, "taintKey", key)
			}
		}
	}
}

// releasedPods remembers, for a while, the pods whose in-flight
// allocations Unreserve dropped. Devices released that way bring no claim
// event (nothing reached the API); the scheduler reports a pod that
// fails its binding cycle as an assigned pod deleted, and the queueing
// hint of that event asks here (isSchedulableAfterAssignedPodDelete).
// The zero value is ready to use; safe for concurrent use.
type releasedPods struct {
	mu   sync.Mutex
	pods map[types.UID]time.Time
}

// releasedFor is how long a pod is remembered: the scheduler reports the
// binding failure right after Unreserve.
const releasedFor = time.Minute

func (r *releasedPods) add(uid types.UID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	for u, at := range r.pods {
		if now.Sub(at) > releasedFor {
			delete(r.pods, u)
		}
	}
	if r.pods == nil {
		r.pods = map[types.UID]time.Time{}
	}
	r.pods[uid] = now
}

func (r *releasedPods) has(uid types.UID) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	at, ok := r.pods[uid]
	return ok && time.Since(at) <= releasedFor
}
