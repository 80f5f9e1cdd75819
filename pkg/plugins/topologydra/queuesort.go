package topologydra

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/runtime"
	fwk "k8s.io/kube-scheduler/framework"
)

// SortName is the name of the DeviceCountSort plugin in the registry and
// in configurations.
const SortName = "DeviceCountSort"

// DeviceCountSort is a QueueSort plugin. It orders the scheduling queue by
// pod priority (higher first), then by the number of devices of one
// device class the pod's claims ask for (fewer first), then by the time
// the pod entered the queue, as PrioritySort does. So, of the pods of one
// priority that wait together, those that need fewest devices are tried
// first, and a pod that needs a whole node is tried once the smaller pods
// have taken what they fit in.
//
// Device counts are as in the pending-pod index: per device class, the
// exact counts and the first subrequest of a firstAvailable request of
// all the pod's claims, allocated or not (claim specs do not change, so a
// pod's place in the queue does not either), and of those the largest: a
// pod that asks for a GPU and a NIC counts one, as a pod that asks for a
// GPU does. A pod without claims asks for none. A claim not in the
// scheduler's claim cache counts as none; PreEnqueue keeps such a pod out
// of the active queue until the claim is there. Entities that are not
// single pods (pod groups) count as asking for none.
//
// All profiles of a scheduler share one queue, so every profile must
// name the same QueueSort plugin.
type DeviceCountSort struct {
	claims claimGetter
}

var _ fwk.QueueSortPlugin = &DeviceCountSort{}

// NewSort builds the plugin; it takes no args.
func NewSort(_ context.Context, _ runtime.Object, h fwk.Handle) (fwk.Plugin, error) {
	m := h.SharedDRAManager()
	if m == nil {
		return nil, fmt.Errorf("%s needs the scheduler's DRA manager (DynamicResourceAllocation feature disabled?)", SortName)
	}
	return &DeviceCountSort{claims: m.ResourceClaims().Get}, nil
}

// Name returns the plugin's name.
func (s *DeviceCountSort) Name() string { return SortName }

// Less reports whether a goes before b in the queue.
func (s *DeviceCountSort) Less(a, b fwk.QueuedEntityInfo) bool {
	if pa, pb := a.GetPriority(), b.GetPriority(); pa != pb {
		return pa > pb
	}
	if da, db := s.devices(a), s.devices(b); da != db {
		return da < db
	}
	return a.GetTimestamp().Before(b.GetTimestamp())
}

// devices is what a queued pod's claims ask for.
func (s *DeviceCountSort) devices(e fwk.QueuedEntityInfo) int {
	p, ok := e.(interface{ GetPodInfo() fwk.PodInfo })
	if !ok {
		return 0
	}
	n, _ := podDevices(p.GetPodInfo().GetPod(), s.claims, false)
	return n
}
