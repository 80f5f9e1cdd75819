package topologydra

import (
	"context"
	"sync"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources"
	"k8s.io/kubernetes/pkg/scheduler/util/assumecache"
	"k8s.io/utils/ptr"
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

// TestDeviceHoldersRestore: a device given back by a claim after another
// claim was seen taking it is put back into a copy of the allocated set
// while that claim holds it, and forgotten once it gives it back; in
// order, nothing is put back. Admin access and shares hold nothing.
func TestDeviceHoldersRestore(t *testing.T) {
	logger, _ := ktesting.NewTestContext(t)
	a, aFree, b, bFree := holderClaim("a", "10", true), holderClaim("a", "20", false), holderClaim("b", "30", true), holderClaim("b", "40", false)

	h := newDeviceHolders(logger)
	h.track(nil, a)
	h.track(nil, b) // b seen taking x before a is seen giving it back
	h.track(a, aFree)
	if got := h.restore(sets.New[structured.DeviceID]()); got != 1 {
		t.Errorf("out of order: restored %d, want x", got)
	}
	if got := h.restore(sets.New(deviceX)); got != 0 {
		t.Errorf("x already in the set: restored %d, want 0", got)
	}
	h.track(b, bFree)
	if got := h.restore(sets.New[structured.DeviceID]()); got != 0 || h.heldAgain.Len() != 0 {
		t.Errorf("after b gave x back: restored %d, held again %v; want none", got, h.heldAgain)
	}

	h = newDeviceHolders(logger)
	h.track(nil, a)
	h.track(a, aFree)
	h.track(nil, b)
	h.track(aFree, nil) // a deleted after it was seen deallocated
	if got := h.restore(sets.New[structured.DeviceID]()); got != 0 {
		t.Errorf("in order: restored %d, want 0", got)
	}

	h = newDeviceHolders(logger)
	h.track(nil, b)
	h.track(a, nil) // a's deletion, missed, after b: its last state held x
	if got := h.restore(sets.New[structured.DeviceID]()); got != 1 {
		t.Errorf("deletion after b: restored %d, want x", got)
	}

	admin := holderClaim("admin", "50", true)
	admin.Status.Allocation.Devices.Results[0].AdminAccess = ptr.To(true)
	shared := holderClaim("shared", "60", true)
	shared.Status.Allocation.Devices.Results[0].ShareID = ptr.To(types.UID("s"))
	if got := len(heldDevices(admin)) + len(heldDevices(shared)); got != 0 {
		t.Errorf("admin access and a share hold %d devices, want 0", got)
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
	holders := newDeviceHolders(logger)
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
	// Both handlers have run once the DRA manager's set lost x and the
	// holders recorded it.
	poll("handlers ran", func() bool {
		up, _ := allocated()
		holders.mu.Lock()
		defer holders.mu.Unlock()
		return !up.Has(deviceX) && holders.heldAgain.Has(deviceX)
	})
	if _, gathered := allocated(); !gathered.Has(deviceX) {
		t.Errorf("gathered state %v lacks x, which aaa-b holds", gathered)
	}
}
