package topologydra

import (
	"context"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
	"k8s.io/component-base/metrics/testutil"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2/ktesting"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources"
	"k8s.io/kubernetes/pkg/scheduler/util/assumecache"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

// holderClaim is claim name (UID uid-<name>) at resourceVersion rv,
// allocated device x of driver d, pool p where allocated.
func holderClaim(name, rv string, allocated bool) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID("uid-" + name), ResourceVersion: rv}}
	if allocated {
		c.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{
			{Request: "r", Driver: "d", Pool: "p", Device: "x"},
		}}}
	}
	return c
}

var deviceX = structured.MakeDeviceID("d", "p", "x")

// TestDeviceAllocatedTwice: a device that two claims hold at once in the
// claim cache's view is reported (the gauge, once) only after
// twiceConfirm, and stays allocated while either claim holds it, whichever
// gives it back first. Claims seen out of order, and a view that shows
// both only for a moment, report nothing.
func TestDeviceAllocatedTwice(t *testing.T) {
	logger, _ := ktesting.NewTestContext(t)
	a, aFree, b, bFree := holderClaim("a", "10", true), holderClaim("a", "20", false), holderClaim("b", "30", true), holderClaim("b", "40", false)
	now := time.Unix(1000, 0)
	newHolders := func() *deviceHolders {
		h := newDeviceHolders(logger, false)
		h.now = func() time.Time { return now }
		return h
	}
	restore := func(h *deviceHolders, view ...*resourceapi.ResourceClaim) sets.Set[structured.DeviceID] {
		byName := map[string]*resourceapi.ResourceClaim{}
		for _, c := range view {
			byName[c.Namespace+"/"+c.Name] = c
		}
		set := sets.New[structured.DeviceID]()
		h.restore(set, func(namespace, name string) (*resourceapi.ResourceClaim, error) {
			if c, ok := byName[namespace+"/"+name]; ok {
				return c, nil
			}
			return nil, apierrors.NewNotFound(resourceapi.Resource("resourceclaims"), name)
		})
		return set
	}
	gauge := func(step string, want float64) {
		t.Helper()
		got, err := testutil.GetGaugeMetricValue(devicesAllocatedTwice)
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("%s: topodra_devices_allocated_twice %v, want %v", step, got, want)
		}
	}

	for _, first := range []string{"a", "b"} {
		h := newHolders()
		h.set("ns/a", a)
		h.set("ns/b", b) // both hold x
		restore(h, a, b)
		gauge("both hold x, just seen", 0)
		now = now.Add(twiceConfirm)
		restore(h, a, b)
		gauge("both hold x for twiceConfirm", 1)
		restore(h, a, b)
		gauge("both hold x, seen again", 1)
		// The set drops x when either claim gives it back; the other
		// still holds it.
		view := []*resourceapi.ResourceClaim{aFree, b}
		if first == "a" {
			h.set("ns/a", aFree)
		} else {
			h.set("ns/b", bFree)
			view = []*resourceapi.ResourceClaim{a, bFree}
		}
		if got := restore(h, view...); !got.Has(deviceX) {
			t.Errorf("%s gave x back while the other claim holds it: x is not allocated", first)
		}
		gauge(first+" gave x back", 0)
		h.set("ns/a", aFree)
		h.set("ns/b", bFree)
		if got := restore(h, aFree, bFree); got.Len() != 0 {
			t.Errorf("both gave x back: restored %v", got.UnsortedList())
		}
	}

	// Seen out of order: b takes x before a is seen giving it back, which
	// the claim cache already shows.
	h := newHolders()
	h.set("ns/a", a)
	h.set("ns/b", b)
	restore(h, aFree, b)
	now = now.Add(twiceConfirm)
	restore(h, aFree, b)
	gauge("out of order", 0)
	h.set("ns/a", aFree)
	restore(h, aFree, b)
	gauge("out of order, caught up", 0)

	// The view shows both for a moment, then a's release.
	h = newHolders()
	h.set("ns/a", a)
	h.set("ns/b", b)
	restore(h, a, b)
	now = now.Add(twiceConfirm / 2)
	restore(h, aFree, b)
	now = now.Add(twiceConfirm)
	restore(h, aFree, b)
	gauge("both for a moment", 0)
}

// TestDeviceHoldersRestore: a device that the scheduler's set lacks is
// put back where its recorded holder holds it in the claim cache's view,
// whatever order the claims were seen in (out of order, a claim seen
// going straight to other devices), and not where this listener is behind
// a release that the view has (the device is free), nor once the holder
// gave it back or was deleted, even as a tombstone without its object.
// Admin access holds nothing, nor does a share with DRAConsumableCapacity
// on.
func TestDeviceHoldersRestore(t *testing.T) {
	logger, _ := ktesting.NewTestContext(t)
	a, aFree, b, bFree := holderClaim("a", "10", true), holderClaim("a", "20", false), holderClaim("b", "30", true), holderClaim("b", "40", false)
	restored := func(h *deviceHolders, view []*resourceapi.ResourceClaim, in ...structured.DeviceID) sets.Set[structured.DeviceID] {
		byName := map[string]*resourceapi.ResourceClaim{}
		for _, c := range view {
			byName[c.Namespace+"/"+c.Name] = c
		}
		set := sets.New(in...)
		h.restore(set, func(namespace, name string) (*resourceapi.ResourceClaim, error) {
			if c, ok := byName[namespace+"/"+name]; ok {
				return c, nil
			}
			return nil, apierrors.NewNotFound(resourceapi.Resource("resourceclaims"), name)
		})
		return set
	}
	check := func(name string, got sets.Set[structured.DeviceID], want ...structured.DeviceID) {
		t.Helper()
		if !got.Equal(sets.New(want...)) {
			t.Errorf("%s: restored set %v, want %v", name, got.UnsortedList(), want)
		}
	}

	h := newDeviceHolders(logger, false)
	h.set("ns/a", a)
	h.set("ns/b", b) // b seen taking x before a is seen giving it back
	h.set("ns/a", aFree)
	check("out of order", restored(h, []*resourceapi.ResourceClaim{aFree, b}), deviceX)
	h.set("ns/b", bFree)
	check("after b gave x back", restored(h, []*resourceapi.ResourceClaim{aFree, bFree}))

	h = newDeviceHolders(logger, false)
	h.set("ns/a", a)
	h.set("ns/a", aFree)
	h.set("ns/b", b)
	h.set("ns/a", nil)
	h.set("ns/b", nil)
	check("in order, then both deleted", restored(h, nil))

	// A deletion missed while not watching, delivered without its last
	// state: what was recorded under the key goes.
	h = newDeviceHolders(logger, false)
	h.set("ns/b", b)
	h.handler().OnDelete(cache.DeletedFinalStateUnknown{Key: "ns/b"})
	check("tombstone without its object", restored(h, []*resourceapi.ResourceClaim{b}))

	// This listener is behind a release that the claim cache has: x is
	// free, and a pod waiting for it must get it.
	h = newDeviceHolders(logger, false)
	h.set("ns/a", a)
	check("listener behind a release", restored(h, []*resourceapi.ResourceClaim{aFree}))

	// a deallocated and allocated device y meanwhile, seen as one change:
	// the set ignores it and keeps x.
	y := structured.MakeDeviceID("d", "p", "y")
	aOnY := holderClaim("a", "50", true)
	aOnY.Status.Allocation.Devices.Results[0].Device = "y"
	h = newDeviceHolders(logger, false)
	h.set("ns/a", a)
	h.set("ns/a", aOnY)
	check("switched to y", restored(h, []*resourceapi.ResourceClaim{aOnY}, deviceX), deviceX, y)

	admin := holderClaim("admin", "60", true)
	admin.Status.Allocation.Devices.Results[0].AdminAccess = ptr.To(true)
	shared := holderClaim("shared", "70", true)
	shared.Status.Allocation.Devices.Results[0].ShareID = ptr.To(types.UID("s"))
	if got := len(newDeviceHolders(logger, true).heldDevices(admin)) + len(newDeviceHolders(logger, true).heldDevices(shared)); got != 0 {
		t.Errorf("admin access and a share (consumable capacity on) hold %d devices, want 0", got)
	}
	if got := len(newDeviceHolders(logger, false).heldDevices(shared)); got != 1 {
		t.Errorf("a share with consumable capacity off holds %d devices, want 1, as for the scheduler's set", got)
	}
}

// noWatchList makes a reflector list and watch (not watch-list), so that
// the test's ListWatch decides what a relist returns.
type noWatchList struct{ *cache.ListWatch }

func (noWatchList) IsWatchListSemanticsUnSupported() bool { return true }

// TestRelistKeepsDeviceAllocated runs the DRA manager of kube-scheduler
// (the stock plugin's, which the plugin shares) and deviceHolders on one
// claim informer whose watch is lost. The relist returns claim aaa-b,
// which took device x after zzz-a gave it back, before zzz-a: the DRA
// manager's set loses x although aaa-b holds it, and the plugin's
// gathered state keeps it.
func TestRelistKeepsDeviceAllocated(t *testing.T) {
	logger, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var mu sync.Mutex
	lists := 0
	var watchers []*watch.FakeWatcher
	lw := &cache.ListWatch{
		ListFunc: func(metav1.ListOptions) (runtime.Object, error) {
			mu.Lock()
			defer mu.Unlock()
			lists++
			if lists == 1 {
				return &resourceapi.ResourceClaimList{ListMeta: metav1.ListMeta{ResourceVersion: "10"}, Items: []resourceapi.ResourceClaim{*holderClaim("zzz-a", "10", true)}}, nil
			}
			// zzz-a gave x back (20), aaa-b took it (30); lists are sorted by name.
			return &resourceapi.ResourceClaimList{ListMeta: metav1.ListMeta{ResourceVersion: "30"}, Items: []resourceapi.ResourceClaim{
				*holderClaim("aaa-b", "30", true), *holderClaim("zzz-a", "20", false),
			}}, nil
		},
		WatchFunc: func(metav1.ListOptions) (watch.Interface, error) {
			mu.Lock()
			defer mu.Unlock()
			w := watch.NewFake()
			watchers = append(watchers, w)
			return w, nil
		},
	}
	informer := cache.NewSharedIndexInformer(noWatchList{lw}, &resourceapi.ResourceClaim{}, 0, cache.Indexers{})
	claims := assumecache.NewAssumeCache(logger, informer, "ResourceClaim", "", nil)
	manager := dynamicresources.NewDRAManager(ctx, claims, nil, informers.NewSharedInformerFactory(fake.NewClientset(), 0))
	holders := newDeviceHolders(logger, false)
	if _, err := informer.AddEventHandler(holders.handler()); err != nil {
		t.Fatal(err)
	}
	pl := &TopologyDRA{draManager: manager, holders: holders}
	go informer.Run(ctx.Done())
	allocated := func() (upstream, gathered sets.Set[structured.DeviceID]) {
		t.Helper()
		up, err := manager.ResourceClaims().ListAllAllocatedDevices()
		if err != nil {
			t.Fatal(err)
		}
		state, err := pl.gatherAllocatedState(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return up, state.AllocatedDevices
	}
	poll := func(what string, cond func() bool) {
		t.Helper()
		if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) { return cond(), nil }); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	poll("first list", func() bool { up, _ := allocated(); return up.Has(deviceX) })

	mu.Lock()
	w := watchers[len(watchers)-1]
	mu.Unlock()
	w.Error(&metav1.Status{Status: metav1.StatusFailure, Code: 410, Reason: metav1.StatusReasonExpired, Message: "too old resource version"})
	poll("relist delivered", func() bool {
		obj, ok, _ := informer.GetStore().GetByKey("ns/zzz-a")
		return ok && obj.(*resourceapi.ResourceClaim).Status.Allocation == nil && len(informer.GetStore().List()) == 2
	})
	// Both handlers have run once the DRA manager's set lost x and
	// aaa-b holds it in deviceHolders.
	poll("handlers ran", func() bool {
		up, _ := allocated()
		holders.mu.Lock()
		defer holders.mu.Unlock()
		return !up.Has(deviceX) && holders.holder[deviceX].uid == "uid-aaa-b" && len(holders.claims) == 1
	})
	if _, gathered := allocated(); !gathered.Has(deviceX) {
		t.Errorf("gathered state %v lacks x, which aaa-b holds", gathered)
	}
}

// lossyClaims is the scheduler's claim tracker with one device missing
// from its allocated devices, as after the relist flaw.
type lossyClaims struct {
	fwk.ResourceClaimTracker
	lose structured.DeviceID
}

func (l lossyClaims) GatherAllocatedState() (*structured.AllocatedState, error) {
	s, err := l.ResourceClaimTracker.GatherAllocatedState()
	if err == nil {
		s.AllocatedDevices.Delete(l.lose)
	}
	return s, err
}

func (l lossyClaims) ListAllAllocatedDevices() (sets.Set[structured.DeviceID], error) {
	s, err := l.ResourceClaimTracker.ListAllAllocatedDevices()
	if err == nil {
		s.Delete(l.lose)
	}
	return s, err
}

type lossyManager struct {
	fwk.SharedDRAManager
	claims lossyClaims
}

func (l lossyManager) ResourceClaims() fwk.ResourceClaimTracker { return l.claims }

// TestDeviceHoldersWired: the plugin that New builds follows the claim
// informer's holders, and both the state PreFilter allocates from and the
// freed-devices hint's count get back a held device that the scheduler's
// set lost.
func TestDeviceHoldersWired(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("n1")}, testDeviceClass(), testSlice("n1", 4))
	h.create(allocatedOn(testClaim("held", 1), "n1", "gpu-0"))
	held := structured.MakeDeviceID(topology.DriverName, "n1", "gpu-0")
	if err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		h.pl.holders.mu.Lock()
		defer h.pl.holders.mu.Unlock()
		_, ok := h.pl.holders.holder[held]
		_, cached := h.pl.draManager.ResourceClaims().Get(testNS, "held")
		return ok && cached == nil, nil
	}); err != nil {
		t.Fatalf("the claim informer's allocated claim never reached the plugin's holders and the claim cache: %v", err)
	}
	// As after claims seen out of order: gpu-0 is a suspect.
	h.pl.holders.mu.Lock()
	h.pl.holders.suspects[held] = holderRef{}
	h.pl.holders.mu.Unlock()
	h.pl.draManager = lossyManager{SharedDRAManager: h.pl.draManager, claims: lossyClaims{ResourceClaimTracker: h.pl.draManager.ResourceClaims(), lose: held}}
	state, err := h.pl.gatherAllocatedState(h.tCtx)
	if err != nil {
		t.Fatal(err)
	}
	if !state.AllocatedDevices.Has(held) {
		t.Errorf("PreFilter's allocated devices %v lack gpu-0", state.AllocatedDevices.UnsortedList())
	}
	allocated, err := h.pl.allocatedDevices()
	if err != nil {
		t.Fatal(err)
	}
	if !allocated.Has(held) {
		t.Errorf("the hint's allocated devices %v lack gpu-0", allocated.UnsortedList())
	}
}
