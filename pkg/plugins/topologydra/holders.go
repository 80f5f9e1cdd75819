package topologydra

import (
	"slices"
	"sync"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
)

// deviceHolders keeps the devices that the scheduler's set of allocated
// devices may lack although a claim holds them.
//
// That set (the DRA manager's, which the stock plugin uses too) adds a
// claim's devices when the claim is seen allocated, removes them when it
// is seen deallocated or deleted, whoever else holds them, and ignores a
// claim seen allocated other devices than before. When the claim informer
// lists anew after it lost its watch, it delivers the claims of the list
// in the list's order, each as it is now: a claim that was allocated a
// device after another claim gave it back can come first, and the late
// deallocation then removes the device while the first claim holds it;
// a claim deallocated and allocated again meanwhile comes as one change
// from its old devices to its new ones. A scheduler whose informer missed
// such changes (a standby replica, while the leader gave devices back and
// allocated them again) would count devices in use as free.
//
// deviceHolders follows the same informer, on its own listener, with the
// claim that holds each dedicated device (results with admin access, and
// shares where DRAConsumableCapacity is on, hold none, as for the set).
// Both listeners see the informer's events in one order, so the set can
// lose a device in use only where this listener sees a device taken while
// another claim holds it, given back by a claim that no longer holds it,
// or taken by a claim going from some devices straight to others. Such a
// device becomes a suspect, logged at level 2; restore puts a suspect that
// the set lacks back into a copy of it where its recorded holder holds it
// as the scheduler's claim cache (the cache the set is fed from) shows
// the claim now: where this listener is behind a release, the device
// stays free. Where this listener is behind both a claim's taking of a
// device and the release that the set then applied to it, the device
// stays free until this listener catches up.
//
// A device taken while another claim held it may also be allocated to
// both at once (another scheduler, a hand-written allocation): restore
// checks both claims in the claim cache, and where both have held the
// device for twiceConfirm (the cache too shows claims out of order for
// the moment a relist takes) it counts it in devicesAllocatedTwice and
// logs it once at level 0.
// While both hold it, the first holder is kept: when either gives the
// device back, the other stays its holder, so the device stays allocated.
// Safe for concurrent use.
type deviceHolders struct {
	logger             klog.Logger
	consumableCapacity bool

	mu sync.Mutex
	// holder is the claim that holds each device.
	holder map[structured.DeviceID]holderRef
	// claims holds, by the informer's key (namespace/name), each
	// allocated claim's UID and devices: a deletion whose last state the
	// informer lost gives back what was recorded.
	claims map[string]heldClaim
	// suspects are the devices the set may have lost (see above), each
	// with the claim that held it when another was seen taking it (zero
	// where none did, or once that claim no longer holds it).
	suspects map[structured.DeviceID]holderRef
	// twice holds the devices that restore found allocated to two claims
	// at once.
	twice map[structured.DeviceID]twiceHeld
	// now is the clock of twiceHeld.since.
	now func() time.Time
}

// twiceConfirm is how long two claims must be seen holding one device
// before it is reported as allocated twice.
const twiceConfirm = 10 * time.Second

// twiceHeld is a device that two claims hold: their UIDs, when restore
// first saw it, and whether it has been reported.
type twiceHeld struct {
	uids     [2]types.UID
	since    time.Time
	reported bool
}

// holderRef names the claim that holds a device.
type holderRef struct {
	uid             types.UID
	namespace, name string
}

// heldClaim is a claim's UID and the dedicated devices it holds.
type heldClaim struct {
	uid     types.UID
	devices []structured.DeviceID
}

func newDeviceHolders(logger klog.Logger, consumableCapacity bool) *deviceHolders {
	return &deviceHolders{
		logger:             logger,
		consumableCapacity: consumableCapacity,
		holder:             map[structured.DeviceID]holderRef{},
		claims:             map[string]heldClaim{},
		suspects:           map[structured.DeviceID]holderRef{},
		twice:              map[structured.DeviceID]twiceHeld{},
		now:                time.Now,
	}
}

// heldDevices lists the devices that a claim's allocation takes
// (takesDevice), as the scheduler's set counts them; none where it is not
// allocated.
func (h *deviceHolders) heldDevices(claim *resourceapi.ResourceClaim) []structured.DeviceID {
	if claim == nil || claim.Status.Allocation == nil {
		return nil
	}
	var out []structured.DeviceID
	for _, r := range claim.Status.Allocation.Devices.Results {
		if !takesDevice(r, h.consumableCapacity) {
			continue
		}
		out = append(out, structured.MakeDeviceID(r.Driver, r.Pool, r.Device))
	}
	return out
}

// set takes in the claim under key as the informer shows it now; nil:
// deleted.
func (h *deviceHolders) set(key string, claim *resourceapi.ResourceClaim) {
	var now heldClaim
	if claim != nil {
		now = heldClaim{uid: claim.UID, devices: h.heldDevices(claim)}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	before, had := h.claims[key]
	if !had && len(now.devices) == 0 {
		return
	}
	same := had && before.uid == now.uid
	kept := sets.New[structured.DeviceID]()
	if same {
		kept.Insert(now.devices...)
	}
	for _, id := range before.devices {
		if !kept.Has(id) {
			h.giveBack(id, before.uid, key)
		}
	}
	// The same claim seen going from some devices straight to others:
	// the scheduler's set ignores that change.
	switched := same && len(before.devices) > 0 && !slices.Equal(before.devices, now.devices)
	held := sets.New(before.devices...)
	for _, id := range now.devices {
		if same && held.Has(id) {
			continue
		}
		h.take(id, holderRef{uid: now.uid, namespace: claim.Namespace, name: claim.Name}, key, switched)
	}
	if len(now.devices) == 0 {
		delete(h.claims, key)
	} else {
		h.claims[key] = now
	}
}

// take records that claim ref (key) holds id. Caller holds mu.
func (h *deviceHolders) take(id structured.DeviceID, ref holderRef, key string, switched bool) {
	if other, ok := h.holder[id]; ok && other.uid != ref.uid {
		h.suspects[id] = other
		h.logger.V(2).Info("Device seen taken by a claim while another claim held it (claims seen out of order after the claim informer listed anew, or allocated twice): it stays allocated while either holds it",
			"device", id, "claim", key, "holder", klog.KRef(other.namespace, other.name))
	} else if switched {
		if _, ok := h.suspects[id]; !ok {
			h.suspects[id] = holderRef{}
		}
		h.logger.V(2).Info("Claim seen allocated other devices without being seen deallocated (the claim informer listed anew): its new devices stay allocated",
			"device", id, "claim", key)
	}
	h.holder[id] = ref
}

// giveBack records that claim uid (key) no longer holds id. Caller holds
// mu.
func (h *deviceHolders) giveBack(id structured.DeviceID, uid types.UID, key string) {
	switch other, ok := h.holder[id]; {
	case !ok:
	case other.uid == uid:
		delete(h.holder, id)
		// The claim it displaced may still hold the device: it is the
		// holder again, and restore checks it in the claim cache.
		if before := h.suspects[id]; before.uid != "" {
			h.holder[id] = before
			h.suspects[id] = holderRef{}
		}
	default:
		if before := h.suspects[id]; before.uid == uid {
			// The displaced claim gave the device back.
			h.suspects[id] = holderRef{}
			return
		}
		if _, ok := h.suspects[id]; !ok {
			h.suspects[id] = holderRef{}
		}
		h.logger.V(2).Info("Device given back by a claim after another claim was seen taking it (claims seen out of order after the claim informer listed anew): it stays allocated",
			"device", id, "claim", key, "holder", klog.KRef(other.namespace, other.name))
	}
}

// restore adds to allocated (a copy of the scheduler's set of allocated
// devices) each suspect the set lacks that its recorded holder holds as
// get (the scheduler's claim cache) shows the claim now, and forgets the
// suspects no claim holds any longer; it returns how many it added. It
// also finds the suspects that two claims hold at once as get shows them
// (see deviceHolders).
func (h *deviceHolders) restore(allocated sets.Set[structured.DeviceID], get func(namespace, name string) (*resourceapi.ResourceClaim, error)) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	holds := func(ref holderRef, id structured.DeviceID) bool {
		claim, err := get(ref.namespace, ref.name)
		return err == nil && claim.UID == ref.uid && slices.Contains(h.heldDevices(claim), id)
	}
	added := 0
	for id, before := range h.suspects {
		ref, held := h.holder[id]
		if !held {
			delete(h.suspects, id)
			continue
		}
		holderHolds := holds(ref, id)
		if before.uid != "" {
			if holds(before, id) {
				if holderHolds {
					h.allocatedTwice(id, before, ref)
				}
			} else {
				h.suspects[id] = holderRef{}
			}
		}
		if allocated.Has(id) || !holderHolds {
			continue
		}
		allocated.Insert(id)
		added++
	}
	reported := 0
	for id, t := range h.twice {
		if before, ok := h.suspects[id]; !ok || before.uid != t.uids[0] || h.holder[id].uid != t.uids[1] {
			delete(h.twice, id)
			if t.reported {
				h.logger.Info("Device no longer allocated to two claims", "device", id)
			}
			continue
		}
		if t.reported {
			reported++
		}
	}
	devicesAllocatedTwice.Set(float64(reported))
	return added
}

// allocatedTwice records that claims first and second both hold id, and
// reports it, once, after twiceConfirm. Caller holds mu.
func (h *deviceHolders) allocatedTwice(id structured.DeviceID, first, second holderRef) {
	uids := [2]types.UID{first.uid, second.uid}
	t, ok := h.twice[id]
	if !ok || t.uids != uids {
		h.twice[id] = twiceHeld{uids: uids, since: h.now()}
		return
	}
	if t.reported || h.now().Sub(t.since) < twiceConfirm {
		return
	}
	t.reported = true
	h.twice[id] = t
	h.logger.Error(nil, "Device allocated to two claims at once: both claims' pods may use it. Another scheduler or a hand-written allocation gave it out; delete one of the claims' pods so that its claim is deallocated, and run topodra-check",
		"device", id, "claim", klog.KRef(first.namespace, first.name), "otherClaim", klog.KRef(second.namespace, second.name))
}

// handler feeds set from the claim informer.
func (h *deviceHolders) handler() cache.ResourceEventHandler {
	update := func(obj any, deleted bool) {
		key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
		if err != nil {
			return
		}
		if deleted {
			h.set(key, nil)
			return
		}
		if claim, ok := obj.(*resourceapi.ResourceClaim); ok {
			h.set(key, claim)
		}
	}
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { update(obj, false) },
		UpdateFunc: func(_, obj any) { update(obj, false) },
		DeleteFunc: func(obj any) { update(obj, true) },
	}
}
