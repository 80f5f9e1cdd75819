package topologydra

import (
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/structured"
)

// freedDevices answers, for one event that gave devices back, how many
// devices of each driver are free in each pool the devices came from. It
// serves the queueing hint of every pending pod for that event: the queue
// asks the hints of all its pods one after another, so the counts are
// kept for the last event only. Safe for concurrent use.
type freedDevices struct {
	mu sync.Mutex
	// key identifies the event: the claim and its resourceVersion.
	key  freedKey
	free map[poolKey]int
	// recent holds the devices given back by the events of the last
	// recentlyFreed, by when: the claim tracker is fed by its own event
	// handler, so when several claims on one node give devices back at
	// once it may not have seen the earlier ones yet. They count as free.
	recent map[structured.DeviceID]time.Time
}

// recentlyFreed is how long devices given back count as free whatever the
// claim tracker says. Counting a device as free that was taken again in
// the meantime only costs a retry.
const recentlyFreed = 30 * time.Second

type freedKey struct {
	uid             types.UID
	resourceVersion string
}

// poolKey names the devices of one driver in one pool.
type poolKey struct{ driver, pool string }

// largestRequest is the most devices that one request of the pod's claims
// that are not allocated yet asks for: the exact count, or the smallest
// count of a firstAvailable request's subrequests. ok is false when it
// cannot say (a claim is not there yet, or a request asks for all
// matching devices).
func (pl *TopologyDRA) largestRequest(pod *v1.Pod) (need int, ok bool) {
	claims, err := pl.podClaims(pod)
	if err != nil {
		return 0, false
	}
	for _, claim := range claims {
		if claim.Status.Allocation != nil {
			continue
		}
		for _, r := range claim.Spec.Devices.Requests {
			switch {
			case r.Exactly != nil:
				if r.Exactly.AllocationMode == resourceapi.DeviceAllocationModeAll {
					return 0, false
				}
				need = max(need, int(r.Exactly.Count))
			case len(r.FirstAvailable) > 0:
				least := -1
				for _, sub := range r.FirstAvailable {
					if sub.AllocationMode == resourceapi.DeviceAllocationModeAll {
						return 0, false
					}
					if least < 0 || int(sub.Count) < least {
						least = int(sub.Count)
					}
				}
				need = max(need, least)
			}
		}
	}
	return need, true
}

// freedEnough reports whether the devices that claim gave back (its
// allocation before the event) can let pod fit: whether some pool that the
// claim held devices in now has, for one driver, at least as many free
// devices as the pod's largest request asks for. Free means published and
// not allocated; the claim's own devices, and those given back by other
// claims in the last recentlyFreed, count as free whether or not the claim
// tracker has seen those events yet. In-flight allocations and device
// taints are not subtracted, so the answer errs towards yes. It also says
// yes whenever it cannot tell.
//
// Without it every pod that waits for devices is retried, and fails
// again, whenever any claim is deallocated anywhere; each failure renews
// the pod's place at the back of the queue and its backoff. A pod that
// needs many devices fails on nearly every such event, so when a node
// finally frees up for it, smaller pods that failed less recently are
// tried first and take the devices.
func (pl *TopologyDRA) freedEnough(pod *v1.Pod, claim *resourceapi.ResourceClaim) bool {
	if claim.Status.Allocation == nil || len(claim.Status.Allocation.Devices.Results) == 0 {
		return true
	}
	need, ok := pl.largestRequest(pod)
	if !ok || need <= 1 {
		return true
	}
	free, ok := pl.freed.count(pl, claim)
	if !ok {
		return true
	}
	for _, n := range free {
		if n >= need {
			return true
		}
	}
	return false
}

// count returns the free devices per driver and pool in the pools that
// claim's allocation used, computing them once per event.
func (f *freedDevices) count(pl *TopologyDRA, claim *resourceapi.ResourceClaim) (map[poolKey]int, bool) {
	key := freedKey{uid: claim.UID, resourceVersion: claim.ResourceVersion}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.free != nil && f.key == key {
		return f.free, true
	}
	now := time.Now()
	if f.recent == nil {
		f.recent = map[structured.DeviceID]time.Time{}
	}
	for id, at := range f.recent {
		if now.Sub(at) > recentlyFreed {
			delete(f.recent, id)
		}
	}
	pools := map[poolKey]bool{}
	for _, r := range claim.Status.Allocation.Devices.Results {
		pools[poolKey{driver: r.Driver, pool: r.Pool}] = true
		f.recent[structured.MakeDeviceID(r.Driver, r.Pool, r.Device)] = now
	}
	slices, err := pl.draManager.ResourceSlices().ListWithDeviceTaintRules()
	if err != nil {
		return nil, false
	}
	allocated, err := pl.draManager.ResourceClaims().ListAllAllocatedDevices()
	if err != nil {
		return nil, false
	}
	// Only the newest generation of a pool counts.
	generation := map[poolKey]int64{}
	for _, s := range slices {
		k := poolKey{driver: s.Spec.Driver, pool: s.Spec.Pool.Name}
		if pools[k] {
			generation[k] = max(generation[k], s.Spec.Pool.Generation)
		}
	}
	free := map[poolKey]int{}
	for _, s := range slices {
		k := poolKey{driver: s.Spec.Driver, pool: s.Spec.Pool.Name}
		if !pools[k] || s.Spec.Pool.Generation != generation[k] {
			continue
		}
		for _, d := range s.Spec.Devices {
			id := structured.MakeDeviceID(k.driver, k.pool, d.Name)
			if _, freed := f.recent[id]; freed || !allocated.Has(id) {
				free[k]++
			}
		}
	}
	f.key, f.free = key, free
	return free, true
}
