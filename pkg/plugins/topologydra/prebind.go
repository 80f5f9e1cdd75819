package topologydra

import (
	"context"
	"fmt"
	"slices"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
)

// PreBindPreFlight lets PreBind run in parallel with other plugins' PreBind
// and skips pods without claims.
func (pl *TopologyDRA) PreBindPreFlight(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, nodeName string) (*fwk.PreBindPreFlightResult, *fwk.Status) {
	result := &fwk.PreBindPreFlightResult{AllowParallel: true}
	if _, err := getState(cs); err != nil {
		return result, fwk.NewStatus(fwk.Skip)
	}
	return result, nil
}

// PreBind writes the allocations chosen in Reserve to the claims and adds
// the pod to their reservedFor, with optimistic concurrency (retry on
// conflict against the latest claim). On failure the scheduler calls
// Unreserve, which undoes the reservation; an allocation that reached the
// API stays and is reused or deallocated by a later cycle (PostFilter), so
// nothing is half-written.
func (pl *TopologyDRA) PreBind(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, nodeName string) *fwk.Status {
	logger := klog.FromContext(ctx)
	s, err := getState(cs)
	if err != nil {
		return nil
	}
	if err := pl.taintedSinceListed(s); err != nil {
		return internalError(logger, err, "pod", klog.KObj(pod))
	}
	bound := false
	ext := s.extended
	for i, claim := range s.claims {
		if s.isExtendedInMemory(i) {
			if err := pl.bindExtendedClaim(ctx, pod, nodeName, s); err != nil {
				return internalError(logger, err, "pod", klog.KObj(pod))
			}
			bound = bound || ext.created != nil
			continue
		}
		if resourceclaim.IsReservedForPod(pod, claim, false) {
			continue
		}
		updated, err := pl.bindClaim(ctx, pod, claim, s.allocations[i])
		if err != nil {
			if s.allocations[i] != nil {
				pl.settleFailedWrite(ctx, pod.UID, s, i, updated, err)
			}
			return internalError(logger, err, "pod", klog.KObj(pod), "claim", klog.KObj(claim))
		}
		s.claims[i] = updated
		if s.allocations[i] != nil {
			// In the API now, and assumed in the claim cache: the
			// in-flight entry goes at once, so that Unreserve after a
			// later claim fails does not put back the informer's copy,
			// which may not show the allocation yet (the devices would
			// look free while the claim holds them).
			pl.draManager.ResourceClaims().MaybeRemoveClaimPendingAllocation(claim.UID, true)
			bound = true
		}
	}
	if st := pl.waitForBindingConditions(ctx, pod, nodeName, s); st != nil {
		return st
	}
	if s.result != nil && bound {
		pl.recordPlacement(pod, nodeName, s)
		pl.noteUnowned(klog.FromContext(ctx), s.allocator, s.result.Allocations)
	}
	return nil
}

// bindClaim writes the allocation (where not nil) and the pod's
// reservation to the claim, and returns the claim written. On error it
// returns the claim as of the last write attempted (its resourceVersion is
// the one that write started from). Only the claim with claim's UID is
// written: where the name now belongs to another claim (deleted and
// created again), it returns an error, and the claim it returns still
// has claim's UID. Where allocation is nil (the claim was allocated
// before the cycle), the pod is reserved only while the claim has the
// allocation the cycle chose the node by: one deallocated and allocated
// again meanwhile (its last pod gone, another pod's cycle) may be on
// another node, and the pod would be bound where its devices are not.
func (pl *TopologyDRA) bindClaim(ctx context.Context, pod *v1.Pod, claim *resourceapi.ResourceClaim, allocation *resourceapi.AllocationResult) (*resourceapi.ResourceClaim, error) {
	logger := klog.FromContext(ctx)
	claims := pl.client.ResourceV1().ResourceClaims(claim.Namespace)
	claim = claim.DeepCopy()
	refresh := false
	var modified bool
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if refresh {
			latest, err := claims.Get(ctx, claim.Name, metav1.GetOptions{})
			if err != nil {
				return fmt.Errorf("get claim %s after conflict: %w", claim.Name, err)
			}
			if latest.UID != claim.UID {
				// Its allocation was made for the deleted claim's spec.
				return fmt.Errorf("claim %s was deleted and created again since it was allocated", claim.Name)
			}
			if allocation == nil && latest.Status.Allocation != nil && !apiequality.Semantic.DeepEqual(latest.Status.Allocation, claim.Status.Allocation) {
				return fmt.Errorf("claim %s was deallocated and allocated again since the pod's node was chosen", claim.Name)
			}
			claim = latest
		}
		refresh = true
		if claim.DeletionTimestamp != nil {
			return fmt.Errorf("claim %s is being deleted", claim.Name)
		}
		if allocation != nil {
			if claim.Status.Allocation != nil {
				return fmt.Errorf("claim %s was allocated by someone else in the meantime", claim.Name)
			}
			if !slices.Contains(claim.Finalizers, resourceapi.Finalizer) {
				// The finalizer protects the allocation from deletion of
				// the claim; it needs a normal update first.
				claim.Finalizers = append(claim.Finalizers, resourceapi.Finalizer)
				updated, err := claims.Update(ctx, claim, metav1.UpdateOptions{})
				if err != nil {
					return err
				}
				claim = updated
			}
			claim.Status.Allocation = allocation.DeepCopy()
			if pl.features.DeviceBindingAndStatus && claim.Status.Allocation.AllocationTimestamp == nil {
				claim.Status.Allocation.AllocationTimestamp = &metav1.Time{Time: time.Now()}
			}
		} else if claim.Status.Allocation == nil {
			return fmt.Errorf("claim %s was deallocated in the meantime", claim.Name)
		}
		// The apiserver enforces the reservedFor limit and rejects
		// duplicates; no need to re-check here.
		claim.Status.ReservedFor = append(claim.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{
			Resource: "pods", Name: pod.Name, UID: pod.UID,
		})
		updated, err := claims.UpdateStatus(ctx, claim, metav1.UpdateOptions{})
		if err != nil {
			return err
		}
		claim = updated
		modified = true
		return nil
	})
	if modified {
		pl.assumeWritten(logger, claim)
	}
	if err != nil {
		return claim, fmt.Errorf("write allocation and reservation of claim %s: %w", claim.Name, err)
	}
	return claim, nil
}

// bindExtendedClaim creates the in-memory extended resource claim for the
// node (where Filter gave it requests there), writes its allocation and
// reservation, and names it in the pod's status. The claim created is
// kept in s.extended.created for Unreserve, which deletes it when a later
// step fails.
func (pl *TopologyDRA) bindExtendedClaim(ctx context.Context, pod *v1.Pod, nodeName string, s *stateData) error {
	ext := s.extended
	variant, _ := ext.onNode(nodeName)
	allocation := s.allocations[ext.index]
	if variant == nil || allocation == nil {
		// A device plugin offers the pod's extended resources here.
		if ext.earlier {
			return pl.checkNoEarlierStatus(ctx, pod)
		}
		return nil
	}
	if ext.created == nil {
		created, err := pl.createExtendedClaim(ctx, pod, variant)
		if err != nil {
			return err
		}
		ext.created = created
	}
	updated, err := pl.bindClaim(ctx, pod, ext.created, allocation)
	if err != nil {
		// Unreserve deletes the claim, whatever the write did; where it
		// cannot, the claim as of the write tells which versions of it
		// are newer than the write.
		ext.created = updated
		return err
	}
	ext.created = updated
	s.claims[ext.index] = updated
	// Until the claim cache has the claim, its devices are known only as
	// the in-flight allocation under the random UID, which stays till then:
	// where PreBind ends first (cancelled), a background wait drops it.
	if pl.awaitCached(ctx, updated) {
		pl.draManager.ResourceClaims().MaybeRemoveClaimPendingAllocation(ext.pendingUID, true)
	} else {
		pl.takeInStored(klog.FromContext(ctx), updated, ext.pendingUID)
	}
	return pl.setExtendedStatus(ctx, pod, &v1.PodExtendedResourceClaimStatus{ResourceClaimName: updated.Name, RequestMappings: variant.mappings})
}
