package topologydra

import (
	"fmt"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
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
	slices, err := pl.draManager.ResourceSlices().ListWithDeviceTaintRules()
	if err != nil {
		return nil
	}
	if r, t := untoleratedDevice(results, slices); t != nil {
		return fmt.Errorf("device %s/%s/%s, chosen for request %s, got the taint %s=%s:%s since this pod's devices were chosen; the pod is scheduled again without it",
			r.Driver, r.Pool, r.Device, r.Request, t.Key, t.Value, t.Effect)
	}
	return nil
}

// taintedAllocation returns an error naming a device of an allocated claim
// of pod, which no other pod has reserved, that the scheduler's slices show
// with a NoSchedule or NoExecute taint that its result does not tolerate:
// the pod is not bound yet (PreFilter), so it would start on a device that
// its driver may refuse to prepare, such as a GPU that reported a fault
// after the allocation was written and before the pod was bound (its
// binding failed, or it waited for binding conditions). PreFilter records
// it as the claim's reason to be unusable: Filter turns every node down,
// and PostFilter deallocates the claim, so that the next attempt
// allocates it afresh. A claim that another pod has reserved is left as
// it is, as the stock plugin leaves every allocation. Nil without device
// taints, where the slices cannot be listed, or where there is no such
// device.
func (pl *TopologyDRA) taintedAllocation(pod *v1.Pod, claim *resourceapi.ResourceClaim, published *publishedLookup) error {
	if !pl.features.DeviceTaints || claim.Status.Allocation == nil {
		return nil
	}
	for _, r := range claim.Status.ReservedFor {
		if r.UID != pod.UID {
			return nil
		}
	}
	slices, err := published.list()
	if err != nil {
		return nil
	}
	if r, t := untoleratedDevice(appendResults(nil, claim.Status.Allocation), slices); t != nil {
		return fmt.Errorf("its device %s/%s/%s has the taint %s=%s:%s, which its allocation does not tolerate; the claim is deallocated and allocated again",
			r.Driver, r.Pool, r.Device, t.Key, t.Value, t.Effect)
	}
	return nil
}

// appendResults appends the results of alloc to results.
func appendResults(results []*resourceapi.DeviceRequestAllocationResult, alloc *resourceapi.AllocationResult) []*resourceapi.DeviceRequestAllocationResult {
	for i := range alloc.Devices.Results {
		results = append(results, &alloc.Devices.Results[i])
	}
	return results
}

// untoleratedDevice returns a result of results whose device, in the
// newest generation of its pool among slices, has a NoSchedule or
// NoExecute taint that the result's tolerations do not tolerate, and that
// taint; nil, nil where there is none. A device that allows multiple
// allocations may be in several results, each with its request's
// tolerations: each is judged.
func untoleratedDevice(results []*resourceapi.DeviceRequestAllocationResult, slices []*resourceapi.ResourceSlice) (*resourceapi.DeviceRequestAllocationResult, *resourceapi.DeviceTaint) {
	chosen := map[structured.DeviceID][]*resourceapi.DeviceRequestAllocationResult{}
	pools := map[poolKey]int64{}
	for _, r := range results {
		id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
		chosen[id] = append(chosen[id], r)
		pools[poolKey{driver: r.Driver, pool: r.Pool}] = 0
	}
	// Only the newest generation of a pool counts, as for the allocator.
	for _, slice := range slices {
		k := poolKey{driver: slice.Spec.Driver, pool: slice.Spec.Pool.Name}
		if g, ok := pools[k]; ok && slice.Spec.Pool.Generation > g {
			pools[k] = slice.Spec.Pool.Generation
		}
	}
	for _, slice := range slices {
		k := poolKey{driver: slice.Spec.Driver, pool: slice.Spec.Pool.Name}
		if g, ok := pools[k]; !ok || slice.Spec.Pool.Generation != g {
			continue
		}
		for i := range slice.Spec.Devices {
			d := &slice.Spec.Devices[i]
			for _, r := range chosen[structured.MakeDeviceID(k.driver, k.pool, d.Name)] {
				if t := allocator.UntoleratedTaint(d, r.Tolerations); t != nil {
					return r, t
				}
			}
		}
	}
	return nil, nil
}
