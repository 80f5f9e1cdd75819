package topologydra

import (
	"fmt"
	"slices"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/dynamic-resource-allocation/structured"

	"github.com/topodra/topodra/pkg/allocator"
)

// taintedSinceListed returns an error naming a device of the allocations
// this cycle chose (s.allocations) that the scheduler's slices, with
// DeviceTaintRules applied, now show with a NoSchedule or NoExecute taint
// that its request does not tolerate (the tolerations its result records,
// as the allocator judged them). The allocator saw the slices as they were
// when PreFilter listed them: a taint added since, such as the health
// taint of a GPU that reported a fault meanwhile, would otherwise be
// written as an allocation that the driver refuses to prepare, leaving the
// pod bound to a node where it cannot start. PreBind checks this before it
// writes anything; the pod is then scheduled again, without the device.
// Nil without device taints (the feature off), where the slices cannot be
// listed, or where no such device is found.
func (pl *TopologyDRA) taintedSinceListed(s *stateData) error {
	if !pl.features.DeviceTaints {
		return nil
	}
	var results []*resourceapi.DeviceRequestAllocationResult
	for _, alloc := range s.allocations {
		if alloc != nil {
			results = appendResults(results, alloc)
		}
	}
	if len(results) == 0 {
		return nil
	}
	if r, t := untoleratedDevice(results, pl.newPublishedLookup().poolSlices, nil); t != nil {
		return fmt.Errorf("device %s/%s/%s, chosen for request %s, got the taint %s=%s:%s since this pod's devices were chosen; the pod is scheduled again without it",
			r.Driver, r.Pool, r.Device, r.Request, t.Key, t.Value, t.Effect)
	}
	return nil
}

// taintedAllocation returns an error (errDeviceTainted) naming a device
// of an allocated claim of pod, a pod not bound yet, which no other pod
// uses (inUseBy), that the scheduler's slices show with a NoSchedule or
// NoExecute taint that neither its result nor topodra's owned toleration
// tolerates: the pod would start on a device that its driver may refuse
// to prepare, such as a GPU that reported a fault after the allocation was
// written and before the pod was bound (its binding failed, or it waited
// for binding conditions). The owned taint is not such a taint: every
// device topodra owns carries it, also for allocations that other writers
// made or that tolerate an earlier owned key. PreFilter records the error
// as the claim's reason to be unusable: Filter turns every node down, and
// PostFilter deallocates the claim, so that the next attempt allocates it
// afresh, once no other pod has it reserved (pods that wait for the
// claim's binding conditions with this one end their waits on the same
// taint). A claim that another pod uses is left as it is, as the stock
// plugin leaves every allocation. Nil without device taints, for a bound
// pod, where the slices cannot be listed, or where there is no such
// device.
func (pl *TopologyDRA) taintedAllocation(pod *v1.Pod, claim *resourceapi.ResourceClaim, published *publishedLookup) error {
	if !pl.features.DeviceTaints || claim.Status.Allocation == nil || pod.Spec.NodeName != "" {
		return nil
	}
	for _, r := range claim.Status.ReservedFor {
		if r.UID != pod.UID && pl.inUseBy(claim.Namespace, r) {
			return nil
		}
	}
	var extra []resourceapi.DeviceToleration
	if pl.ownedToleration != nil {
		extra = append(extra, *pl.ownedToleration)
	}
	r, t := untoleratedDevice(appendResults(nil, claim.Status.Allocation), published.poolSlices, extra)
	if t == nil {
		return nil
	}
	return fmt.Errorf("%w: %s/%s/%s has the taint %s=%s:%s, which its allocation does not tolerate; the claim is deallocated and allocated again",
		errDeviceTainted, r.Driver, r.Pool, r.Device, t.Key, t.Value, t.Effect)
}

// inUseBy reports whether the consumer of a reservation of a claim in
// namespace may be using the claim: any consumer but a pod that the
// scheduler's pod lister shows not bound to a node, gone, or replaced by
// another pod of its name. Without a pod lister every consumer may.
func (pl *TopologyDRA) inUseBy(namespace string, r resourceapi.ResourceClaimConsumerReference) bool {
	if pl.pods == nil || r.APIGroup != "" || r.Resource != "pods" {
		return true
	}
	p, err := pl.pods.Pods(namespace).Get(r.Name)
	switch {
	case apierrors.IsNotFound(err):
		return false
	case err != nil:
		return true
	}
	return p.UID == r.UID && p.Spec.NodeName != ""
}

// appendResults appends the results of alloc to results.
func appendResults(results []*resourceapi.DeviceRequestAllocationResult, alloc *resourceapi.AllocationResult) []*resourceapi.DeviceRequestAllocationResult {
	for i := range alloc.Devices.Results {
		results = append(results, &alloc.Devices.Results[i])
	}
	return results
}

// untoleratedDevice returns a result of results whose device, in the
// newest generation of its pool (slicesOf lists a pool's slices), has a
// NoSchedule or NoExecute taint that neither the result's tolerations nor
// extra tolerate, and that taint; nil, nil where there is none or the
// slices cannot be listed. A device that allows multiple allocations may
// be in several results, each with its request's tolerations: each is
// judged.
func untoleratedDevice(results []*resourceapi.DeviceRequestAllocationResult, slicesOf func(poolKey) ([]*resourceapi.ResourceSlice, error), extra []resourceapi.DeviceToleration) (*resourceapi.DeviceRequestAllocationResult, *resourceapi.DeviceTaint) {
	chosen := map[structured.DeviceID][]*resourceapi.DeviceRequestAllocationResult{}
	pools := map[poolKey]bool{}
	for _, r := range results {
		id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
		chosen[id] = append(chosen[id], r)
		pools[poolKey{driver: r.Driver, pool: r.Pool}] = true
	}
	for k := range pools {
		own, err := slicesOf(k)
		if err != nil {
			return nil, nil
		}
		// Only the newest generation of a pool counts, as for the
		// allocator.
		var newest int64
		for _, slice := range own {
			newest = max(newest, slice.Spec.Pool.Generation)
		}
		for _, slice := range own {
			if slice.Spec.Pool.Generation != newest {
				continue
			}
			for i := range slice.Spec.Devices {
				d := &slice.Spec.Devices[i]
				for _, r := range chosen[structured.MakeDeviceID(k.driver, k.pool, d.Name)] {
					tolerations := r.Tolerations
					if len(extra) > 0 {
						tolerations = append(slices.Clone(r.Tolerations), extra...)
					}
					if t := allocator.UntoleratedTaint(d, tolerations); t != nil {
						return r, t
					}
				}
			}
		}
	}
	return nil, nil
}
