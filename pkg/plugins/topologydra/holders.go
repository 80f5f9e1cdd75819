package topologydra

import (
	"sync"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

// deviceHolders keeps the devices that the scheduler's set of allocated
// devices lost although a claim holds them.
//
// That set (the DRA manager's, which the stock plugin uses too) adds a
// claim's devices when the claim is seen allocated and removes them when
// it is seen deallocated or deleted, whoever else holds them. When the
// claim informer lists anew after it lost its watch, it delivers the
// claims of the list in the list's order: a claim that was allocated a
// device after another claim gave it back can come first, and the late
// deallocation then removes the device from the set while the first
// claim holds it. A scheduler whose informer missed both (a standby
// replica, while the leader gave the device back and allocated it again)
// would count the device free and could allocate it a second time.
//
// deviceHolders follows the claim informer too, with the holder of each
// dedicated device (results with admin access or a share ID hold none, as
// for the set). A release by a claim that no longer holds the device
// records it as held again; restore puts such devices back into a copy
// of the set while their holder holds them. Safe for concurrent use.
type deviceHolders struct {
	logger    klog.Logger
	mu        sync.Mutex
	holder    map[structured.DeviceID]types.UID
	heldAgain sets.Set[structured.DeviceID]
}

func newDeviceHolders(logger klog.Logger) *deviceHolders {
	return &deviceHolders{logger: logger, holder: map[structured.DeviceID]types.UID{}, heldAgain: sets.New[structured.DeviceID]()}
}

// heldDevices lists the dedicated devices of a claim's allocation; none
// where it is not allocated.
func heldDevices(claim *resourceapi.ResourceClaim) []structured.DeviceID {
	if claim == nil || claim.Status.Allocation == nil {
		return nil
	}
	var out []structured.DeviceID
	for _, r := range claim.Status.Allocation.Devices.Results {
		if ptr.Deref(r.AdminAccess, false) || r.ShareID != nil {
			continue
		}
		out = append(out, structured.MakeDeviceID(r.Driver, r.Pool, r.Device))
	}
	return out
}

// track takes in a claim seen changed from old to claim (either nil: seen
// added, or deleted).
func (h *deviceHolders) track(old, claim *resourceapi.ResourceClaim) {
	before, after := heldDevices(old), heldDevices(claim)
	if len(before) == 0 && len(after) == 0 {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	now := sets.New(after...)
	for _, id := range before {
		if now.Has(id) && old.UID == claim.UID {
			continue
		}
		switch holder, ok := h.holder[id]; {
		case !ok:
		case holder == old.UID:
			delete(h.holder, id)
		default:
			// Another claim was seen taking the device before this one
			// was seen giving it back.
			h.heldAgain.Insert(id)
			h.logger.V(2).Info("Device given back by a claim after another claim was seen holding it (claims seen out of order after the claim informer listed anew): it stays allocated",
				"device", id, "claim", klog.KObj(old), "holder", holder)
		}
	}
	for _, id := range after {
		h.holder[id] = claim.UID
	}
}

// restore adds to allocated (a copy of the scheduler's set of allocated
// devices) the devices recorded as held again whose holder still holds
// them, and forgets the others; it returns how many it added.
func (h *deviceHolders) restore(allocated sets.Set[structured.DeviceID]) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	added := 0
	for id := range h.heldAgain {
		if _, held := h.holder[id]; !held {
			h.heldAgain.Delete(id)
			continue
		}
		if !allocated.Has(id) {
			allocated.Insert(id)
			added++
		}
	}
	return added
}

// handler feeds track from the claim informer.
func (h *deviceHolders) handler() cache.ResourceEventHandler {
	claimOf := func(obj any) *resourceapi.ResourceClaim {
		if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = tomb.Obj
		}
		claim, _ := obj.(*resourceapi.ResourceClaim)
		return claim
	}
	return cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if claim := claimOf(obj); claim != nil {
				h.track(nil, claim)
			}
		},
		UpdateFunc: func(oldObj, obj any) {
			old, claim := claimOf(oldObj), claimOf(obj)
			if claim == nil {
				return
			}
			h.track(old, claim)
		},
		DeleteFunc: func(obj any) {
			if claim := claimOf(obj); claim != nil {
				h.track(claim, nil)
			}
		},
	}
}
