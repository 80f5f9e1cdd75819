package topologydra

import (
	"fmt"

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
	// A device that allows multiple allocations may be in several
	// results, each with its request's tolerations.
	chosen := map[structured.DeviceID][]*resourceapi.DeviceRequestAllocationResult{}
	pools := map[poolKey]int64{}
	for _, alloc := range s.allocations {
		if alloc == nil {
			continue
		}
		for i := range alloc.Devices.Results {
			r := &alloc.Devices.Results[i]
			id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
			chosen[id] = append(chosen[id], r)
			pools[poolKey{driver: r.Driver, pool: r.Pool}] = 0
		}
	}
	if len(chosen) == 0 {
		return nil
	}
	slices, err := pl.draManager.ResourceSlices().ListWithDeviceTaintRules()
	if err != nil {
		return nil
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
					return fmt.Errorf("device %s/%s/%s, chosen for request %s, got the taint %s=%s:%s since this pod's devices were chosen; the pod is scheduled again without it",
						r.Driver, r.Pool, r.Device, r.Request, t.Key, t.Value, t.Effect)
				}
			}
		}
	}
	return nil
}
