package topologydra

import (
	"context"
	"fmt"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

func TestClaimQueueingHint(t *testing.T) {
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p"},
		Spec:       v1.PodSpec{ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: ptr.To("mine")}}},
	}
	claim := func(name string, allocated bool, reserved int) *resourceapi.ResourceClaim {
		c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name}}
		if allocated {
			c.Status.Allocation = &resourceapi.AllocationResult{}
		}
		for range reserved {
			c.Status.ReservedFor = append(c.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{Resource: "pods", Name: "x"})
		}
		return c
	}
	annotated := func(c *resourceapi.ResourceClaim, key, value string) *resourceapi.ResourceClaim {
		c.Annotations = map[string]string{key: value}
		return c
	}
	pl := &TopologyDRA{}
	tests := map[string]struct {
		old, new *resourceapi.ResourceClaim
		want     fwk.QueueingHint
	}{
		"own claim created":                 {new: claim("mine", false, 0), want: fwk.Queue},
		"own claim status changed":          {old: claim("mine", false, 0), new: claim("mine", true, 0), want: fwk.Queue},
		"own claim unchanged status":        {old: claim("mine", true, 1), new: claim("mine", true, 1), want: fwk.QueueSkip},
		"other claim allocated":             {old: claim("other", false, 0), new: claim("other", true, 1), want: fwk.QueueSkip},
		"other claim deallocated":           {old: claim("other", true, 0), new: claim("other", false, 0), want: fwk.Queue},
		"other allocated claim deleted":     {old: claim("other", true, 0), want: fwk.Queue},
		"other unallocated claim deleted":   {old: claim("other", false, 0), want: fwk.QueueSkip},
		"own claim's alignment fixed":       {old: annotated(claim("mine", false, 0), topology.AnnotationAlignment, "requried"), new: annotated(claim("mine", false, 0), topology.AnnotationAlignment, "require"), want: fwk.Queue},
		"own claim's align-with removed":    {old: annotated(claim("mine", false, 0), topology.AnnotationAlignWith, "node"), new: claim("mine", false, 0), want: fwk.Queue},
		"own claim, other annotation":       {old: claim("mine", false, 0), new: annotated(claim("mine", false, 0), "example.com/x", "y"), want: fwk.QueueSkip},
		"claim in other namespace, my name": {new: &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "x", Name: "mine"}}, want: fwk.QueueSkip},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var oldObj, newObj any
			if tc.old != nil {
				oldObj = tc.old
			}
			if tc.new != nil {
				newObj = tc.new
			}
			got, err := pl.isSchedulableAfterClaimChange(klog.Background(), pod, oldObj, newObj)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("hint = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestSliceQueueingHint(t *testing.T) {
	pl := &TopologyDRA{}
	a := &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: "s", ResourceVersion: "1"}, Spec: resourceapi.ResourceSliceSpec{Driver: "d"}}
	metaOnly := a.DeepCopy()
	metaOnly.ResourceVersion = "2"
	withDevice := a.DeepCopy()
	withDevice.Spec.Devices = []resourceapi.Device{{Name: "gpu-0"}}
	for name, tc := range map[string]struct {
		old, new *resourceapi.ResourceSlice
		want     fwk.QueueingHint
	}{
		"new slice":       {new: a, want: fwk.Queue},
		"metadata-only":   {old: a, new: metaOnly, want: fwk.QueueSkip},
		"devices changed": {old: a, new: withDevice, want: fwk.Queue},
	} {
		t.Run(name, func(t *testing.T) {
			var oldObj any
			if tc.old != nil {
				oldObj = tc.old
			}
			got, err := pl.isSchedulableAfterSliceChange(klog.Background(), nil, oldObj, tc.new)
			if err != nil || got != tc.want {
				t.Errorf("hint = %v (%v), want %v", got, err, tc.want)
			}
		})
	}
}

// TestFreedDevicesQueueingHint: a claim that gives devices back requeues
// a pending pod only when, for the driver and node it came from, enough
// devices are now free for one of the pod's requests, counting the claim's
// own devices, and those given back just before, as free while the claim
// cache still shows them held by the claims that gave them back.
func TestFreedDevicesQueueingHint(t *testing.T) {
	// Node d publishes two pools of two GPUs each.
	pool := func(name string) *resourceapi.ResourceSlice {
		s := testSlice("d", 2)
		s.Name, s.Spec.Pool.Name = name, name
		return s
	}
	inPool := func(c *resourceapi.ResourceClaim, p string) *resourceapi.ResourceClaim {
		for i := range c.Status.Allocation.Devices.Results {
			c.Status.Allocation.Devices.Results[i].Pool = p
		}
		return c
	}
	twoRequests := testClaim("two-requests", 4)
	twoRequests.Spec.Devices.Requests = append(twoRequests.Spec.Devices.Requests, resourceapi.DeviceRequest{
		Name: "one", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: testClass, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
	})
	h := newHarness(t, []*v1.Node{testNode("a"), testNode("b"), testNode("c"), testNode("d")},
		testDeviceClass(), testSlice("a", 4), testSlice("b", 4), testSlice("c", 4), pool("d-a"), pool("d-b"),
		testClaim("big", 4), testClaim("small", 2), twoRequests,
		&resourceapi.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{Namespace: testNS, Name: "all"},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: testClass, AllocationMode: resourceapi.DeviceAllocationModeAll},
			}}}},
		},
		allocatedOn(testClaim("x", 2), "a", "gpu-0", "gpu-1"),
		allocatedOn(testClaim("y", 1), "a", "gpu-2"),
		allocatedOn(testClaim("z", 4), "b", "gpu-0", "gpu-1", "gpu-2", "gpu-3"),
		allocatedOn(testClaim("c1", 2), "c", "gpu-0", "gpu-1"),
		allocatedOn(testClaim("c2", 2), "c", "gpu-2", "gpu-3"),
		inPool(allocatedOn(testClaim("da", 2), "d", "gpu-0", "gpu-1"), "d-a"),
		inPool(allocatedOn(testClaim("db", 2), "d", "gpu-0", "gpu-1"), "d-b"),
	)
	for _, name := range []string{"big", "small", "two-requests", "all", "x", "y", "z", "c1", "c2", "da", "db"} {
		h.waitForClaim(name, func(*resourceapi.ResourceClaim) bool { return true })
	}
	// Four GPUs, or else one: the one counts.
	fourOrOne := testClaim("four-or-one", 1)
	fourOrOne.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "gpu", FirstAvailable: []resourceapi.DeviceSubRequest{
		{Name: "four", DeviceClassName: testClass, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 4},
		{Name: "one", DeviceClassName: testClass, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
	}}}
	h.create(fourOrOne)
	h.waitForClaim("four-or-one", func(*resourceapi.ResourceClaim) bool { return true })
	big, small, two := testPod("big", "big"), testPod("small", "small"), testPod("two", "two-requests")
	all, missing := testPod("all", "all"), testPod("missing", "nope")
	firstAvailable := testPod("first-available", "four-or-one")
	hint := func(pod *v1.Pod, old, new *resourceapi.ResourceClaim) fwk.QueueingHint {
		t.Helper()
		var newObj any
		if new != nil {
			newObj = new
		}
		got, err := h.pl.isSchedulableAfterClaimChange(klog.Background(), pod, old, newObj)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	deallocated := func(c *resourceapi.ResourceClaim) *resourceapi.ResourceClaim {
		c = c.DeepCopy()
		c.Status.Allocation = nil
		c.ResourceVersion += "-next"
		return c
	}
	giveBackInCache := func(name string) {
		c := h.apiClaim(name)
		c.Status.Allocation = nil
		_, err := h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(h.tCtx, c, metav1.UpdateOptions{})
		h.tCtx.ExpectNoError(err)
		h.waitForClaim(name, func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation == nil })
	}

	// y frees gpu-2 on a: two free there, not four. A pod with a request
	// for one device might use them.
	y := h.apiClaim("y")
	for pod, want := range map[*v1.Pod]fwk.QueueingHint{big: fwk.QueueSkip, small: fwk.Queue, two: fwk.Queue, all: fwk.Queue, missing: fwk.Queue, firstAvailable: fwk.Queue} {
		if got := hint(pod, y, deallocated(y)); got != want {
			t.Errorf("y deallocated, pod %s: hint %v, want %v", pod.Name, got, want)
		}
	}
	// Only nodes the pod may use count: pinned to b (nodeSelector), the
	// pod that asks for two and the one with a one-device request are
	// not requeued for devices freed on a; pinned to a, they are.
	pinned := func(pod *v1.Pod, node string) *v1.Pod {
		pod = pod.DeepCopy()
		pod.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": node}
		return pod
	}
	for pod, want := range map[*v1.Pod]fwk.QueueingHint{
		pinned(small, "b"): fwk.QueueSkip, pinned(two, "b"): fwk.QueueSkip,
		pinned(small, "a"): fwk.Queue, pinned(two, "a"): fwk.Queue,
	} {
		if got := hint(pod, y, deallocated(y)); got != want {
			t.Errorf("y deallocated on a, pod %s pinned to %s: hint %v, want %v", pod.Name, pod.Spec.NodeSelector["kubernetes.io/hostname"], got, want)
		}
	}
	// The pod's own claim given back always requeues it.
	own := allocatedOn(testClaim("big", 4), "a", "gpu-3")
	own.UID = h.apiClaim("big").UID
	if got := hint(big, own, deallocated(own)); got != fwk.Queue {
		t.Errorf("own claim deallocated, pod big: hint %v, want Queue", got)
	}
	// Deleted while allocated: the same answer.
	if got := hint(big, y, nil); got != fwk.QueueSkip {
		t.Errorf("y deleted, pod big: hint %v, want QueueSkip", got)
	}

	// givesBack checks the hint for pod big when claim name (as the API
	// has it, allocated) is deallocated.
	givesBack := func(name string, want fwk.QueueingHint, why string) {
		t.Helper()
		c := h.apiClaim(name)
		if got := hint(big, c, deallocated(c)); got != want {
			t.Errorf("%s deallocated (%s), pod big: hint %v, want %v", name, why, got, want)
		}
	}

	// The cache learns that y is gone, and gpu-2 is taken again by y2:
	// when x frees gpu-0 and gpu-1, three are free on a. When y2 gives
	// gpu-2 back, all four are, although the cache still holds x.
	giveBackInCache("y")
	h.create(allocatedOn(testClaim("y2", 1), "a", "gpu-2"))
	h.waitForClaim("y2", func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation != nil })
	givesBack("x", fwk.QueueSkip, "gpu-2 taken again by y2")
	givesBack("y2", fwk.Queue, "right after x")

	// Two claims on c give their devices back at once, and the cache has
	// seen neither: the second event still finds c free.
	givesBack("c1", fwk.QueueSkip, "two of c free")
	givesBack("c2", fwk.Queue, "right after c1")

	// Node d's free GPUs count together across its two pools.
	giveBackInCache("db")
	givesBack("da", fwk.Queue, "db free: four on d in two pools")

	// A claim on b freeing all of b's devices is enough too.
	givesBack("z", fwk.Queue, "all of b")
}

// TestFreedDevicesQueueingHintAcrossGroups: one request may take devices
// of several pools and drivers at once: a node's own GPUs and those of a
// pool that is not local to a node (allNodes, nodeSelector) that admits
// it, or the devices of two drivers that its class matches. Node a's
// GPUs (gpu-0, gpu-1) and the devices of pool net (net-0, net-1) or of a
// second driver on a (nic-0, nic-1) are all held but one; a pod asks for
// two, so it does not fit on a. Claim gone gives one back; the hint must
// retry the pod where Filter now passes on a, and only where devices it
// can use make up its request.
func TestFreedDevicesQueueingHintAcrossGroups(t *testing.T) {
	const nicDriver = "nic.test.topodra.io"
	// pool publishes two devices of driver named prefix-0 and prefix-1:
	// local to node a (local), for every node (allNodes), for node b
	// alone (nodeSelector), or per device: the first for every node, the
	// second for node b.
	type reach int
	const (
		local reach = iota
		allNodes
		onlyB
		perDevice
	)
	pool := func(name, driver, prefix string, r reach) *resourceapi.ResourceSlice {
		s := testSlice("a", 0)
		s.Name, s.Spec.Driver, s.Spec.Pool.Name = name, driver, name
		switch r {
		case allNodes:
			s.Spec.NodeName, s.Spec.AllNodes = nil, ptr.To(true)
		case onlyB:
			s.Spec.NodeName = nil
			s.Spec.NodeSelector = &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{
				{Key: "kubernetes.io/hostname", Operator: v1.NodeSelectorOpIn, Values: []string{"b"}},
			}}}}
		}
		for i := range 2 {
			s.Spec.Devices = append(s.Spec.Devices, resourceapi.Device{Name: fmt.Sprintf("%s-%d", prefix, i)})
		}
		if r == perDevice {
			s.Spec.NodeName, s.Spec.PerDeviceNodeSelection = nil, ptr.To(true)
			s.Spec.Devices[0].AllNodes, s.Spec.Devices[1].NodeName = ptr.To(true), ptr.To("b")
		}
		return s
	}
	// held is a claim allocated devices of driver in pool.
	held := func(name, driver, pool string, devices ...string) *resourceapi.ResourceClaim {
		c := allocatedOn(testClaim(name, int64(len(devices))), "a", devices...)
		for i := range c.Status.Allocation.Devices.Results {
			c.Status.Allocation.Devices.Results[i].Driver = driver
			c.Status.Allocation.Devices.Results[i].Pool = pool
		}
		return c
	}
	// plus adds a device of driver in pool to c's allocation.
	plus := func(c *resourceapi.ResourceClaim, driver, pool, device string) *resourceapi.ResourceClaim {
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results,
			resourceapi.DeviceRequestAllocationResult{Request: "gpu", Driver: driver, Pool: pool, Device: device})
		return c
	}
	// both is a class whose devices are the GPUs and the NICs.
	both := testDeviceClass()
	both.Name = "gpu-or-nic"
	both.Spec.Selectors[0].CEL.Expression = fmt.Sprintf("device.driver in [%q, %q]", topology.DriverName, nicDriver)
	want := func(className string) *resourceapi.ResourceClaim {
		c := testClaim("want", 2)
		c.Spec.Devices.Requests[0].Exactly.DeviceClassName = className
		return c
	}
	for name, tc := range map[string]struct {
		objs []runtime.Object
		// gone gives its devices back.
		gone string
		// fits: Filter passes on a once gone's devices are free; the
		// hint must then be Queue, and QueueSkip otherwise.
		fits bool
	}{
		"GPU of a given back, net-1 free in an allNodes pool": {
			objs: []runtime.Object{pool("net", topology.DriverName, "net", allNodes), want(testClass),
				held("x", topology.DriverName, "a", "gpu-0"), held("gone", topology.DriverName, "a", "gpu-1"),
				held("n", topology.DriverName, "net", "net-0")},
			gone: "gone", fits: true,
		},
		"net-0 of an allNodes pool given back, gpu-1 of a free": {
			objs: []runtime.Object{pool("net", topology.DriverName, "net", allNodes), want(testClass),
				held("x", topology.DriverName, "a", "gpu-0"),
				held("gone", topology.DriverName, "net", "net-0"), held("n", topology.DriverName, "net", "net-1")},
			gone: "gone", fits: true,
		},
		"net-0 of a pool with per-device node selection given back, for every node": {
			objs: []runtime.Object{pool("net", topology.DriverName, "net", perDevice), want(testClass),
				held("x", topology.DriverName, "a", "gpu-0"),
				held("gone", topology.DriverName, "net", "net-0"), held("n", topology.DriverName, "net", "net-1")},
			gone: "gone", fits: true,
		},
		"net-1 of a pool with per-device node selection given back, for node b": {
			objs: []runtime.Object{pool("net", topology.DriverName, "net", perDevice), want(testClass),
				held("x", topology.DriverName, "a", "gpu-0"),
				held("n", topology.DriverName, "net", "net-0"), held("gone", topology.DriverName, "net", "net-1")},
			gone: "gone", fits: false,
		},
		"GPU of a given back, net-1 free in a pool for node b only": {
			objs: []runtime.Object{pool("net", topology.DriverName, "net", onlyB), want(testClass),
				held("x", topology.DriverName, "a", "gpu-0"), held("gone", topology.DriverName, "a", "gpu-1"),
				held("n", topology.DriverName, "net", "net-0")},
			gone: "gone", fits: false,
		},
		"a GPU and a NIC given back together, class of both drivers": {
			objs: []runtime.Object{pool("a-nics", nicDriver, "nic", local), both, want(both.Name),
				held("x", topology.DriverName, "a", "gpu-0"), held("n", nicDriver, "a-nics", "nic-1"),
				plus(held("gone", topology.DriverName, "a", "gpu-1"), nicDriver, "a-nics", "nic-0")},
			gone: "gone", fits: true,
		},
		"a NIC given back, class of both drivers, a GPU free": {
			objs: []runtime.Object{pool("a-nics", nicDriver, "nic", local), both, want(both.Name),
				held("x", topology.DriverName, "a", "gpu-0"),
				held("gone", nicDriver, "a-nics", "nic-0"), held("n", nicDriver, "a-nics", "nic-1")},
			gone: "gone", fits: true,
		},
		"a GPU given back, class of GPUs only, NICs free": {
			objs: []runtime.Object{pool("a-nics", nicDriver, "nic", local), want(testClass),
				held("x", topology.DriverName, "a", "gpu-0"), held("gone", topology.DriverName, "a", "gpu-1")},
			gone: "gone", fits: false,
		},
	} {
		t.Run(name, func(t *testing.T) {
			objs := append([]runtime.Object{testDeviceClass(), testSlice("a", 2)}, tc.objs...)
			h := newHarness(t, []*v1.Node{testNode("a"), testNode("b")}, objs...)
			for _, obj := range objs {
				if c, ok := obj.(*resourceapi.ResourceClaim); ok {
					h.waitForClaim(c.Name, func(*resourceapi.ResourceClaim) bool { return true })
				}
			}
			pod := testPod("p", "want")
			if _, st := h.cycle(pod, "a"); st["a"].IsSuccess() {
				t.Fatalf("Filter on a before %s gives its devices back: success, want a misfit", tc.gone)
			}
			old := h.apiClaim(tc.gone)
			freed := old.DeepCopy()
			freed.Status.Allocation = nil
			freed, err := h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(h.tCtx, freed, metav1.UpdateOptions{})
			h.tCtx.ExpectNoError(err)
			// The hint runs before the claim tracker sees the event, and
			// again (a later event) once it has.
			wantHint := map[bool]fwk.QueueingHint{true: fwk.Queue, false: fwk.QueueSkip}[tc.fits]
			if got, err := h.pl.isSchedulableAfterClaimChange(klog.Background(), pod, old, freed); err != nil || got != wantHint {
				t.Errorf("hint before the tracker saw %s freed: %v (%v), want %v", tc.gone, got, err, wantHint)
			}
			h.waitForClaim(tc.gone, func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation == nil })
			if _, st := h.cycle(pod, "a"); st["a"].IsSuccess() != tc.fits {
				t.Fatalf("Filter on a after %s gave its devices back: %v, want success %v", tc.gone, st["a"], tc.fits)
			}
			again := old.DeepCopy()
			again.ResourceVersion += "-again"
			if got, err := h.pl.isSchedulableAfterClaimChange(klog.Background(), pod, again, freed); err != nil || got != wantHint {
				t.Errorf("hint after the tracker saw %s freed: %v (%v), want %v", tc.gone, got, err, wantHint)
			}
		})
	}
}

// TestSharedDeviceFreedQueueingHint: a claim gives back its share of a
// device that allows multiple allocations while another claim still holds
// a share. No device becomes free, but capacity does: every pod is
// requeued. When an exclusive device is given back, the shared device
// counts as free beside it, as it does for Filter (its shares do not take
// it): a pod of two GPUs is requeued, one of three is not.
func TestSharedDeviceFreedQueueingHint(t *testing.T) {
	share := func(c *resourceapi.ResourceClaim) *resourceapi.ResourceClaim {
		for i := range c.Status.Allocation.Devices.Results {
			c.Status.Allocation.Devices.Results[i].ShareID = ptr.To(types.UID("share-" + c.Name))
		}
		return c
	}
	slice := testSlice("e", 3)
	slice.Spec.Devices[1].AllowMultipleAllocations = ptr.To(true)
	h := newHarness(t, []*v1.Node{testNode("e")}, testDeviceClass(), slice, testClaim("one", 1), testClaim("two", 2), testClaim("three", 3),
		allocatedOn(testClaim("full", 1), "e", "gpu-0"), allocatedOn(testClaim("other", 1), "e", "gpu-2"),
		share(allocatedOn(testClaim("s1", 1), "e", "gpu-1")), share(allocatedOn(testClaim("s2", 1), "e", "gpu-1")))
	for _, name := range []string{"one", "two", "three", "full", "other", "s1", "s2"} {
		h.waitForClaim(name, func(*resourceapi.ResourceClaim) bool { return true })
	}
	for _, tc := range []struct {
		claim, pod string
		want       fwk.QueueingHint
	}{
		{"s1", "one", fwk.Queue}, {"s1", "two", fwk.Queue},
		{"full", "one", fwk.Queue}, {"full", "two", fwk.Queue}, {"full", "three", fwk.QueueSkip},
	} {
		c := h.apiClaim(tc.claim)
		freed := c.DeepCopy()
		freed.Status.Allocation = nil
		freed.ResourceVersion += "-next"
		got, err := h.pl.isSchedulableAfterClaimChange(klog.Background(), testPod(tc.pod, tc.pod), c, freed)
		if err != nil {
			t.Fatal(err)
		}
		if got != tc.want {
			t.Errorf("%s deallocated, pod asking for %s: hint %v, want %v", tc.claim, tc.pod, got, tc.want)
		}
	}
}

// TestPodUpdateQueueingHint: a pod whose claims come from templates is
// requeued by its own update once the claim controller has named every
// claim in its status and the claims are in the cache, not before.
func TestPodUpdateQueueingHint(t *testing.T) {
	generated := testClaim("p-gpu-abc", 1)
	generated.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Pod", Name: "p", UID: "p", Controller: ptr.To(true)}}
	h := newHarness(t, []*v1.Node{testNode("a")}, testDeviceClass(), testSlice("a", 2), generated)
	h.waitForClaim("p-gpu-abc", func(*resourceapi.ResourceClaim) bool { return true })
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: testNS, Name: "p", UID: "p"}}
	pod.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To("tmpl")}}
	named := func(claim string) *v1.Pod {
		p := pod.DeepCopy()
		p.Status.ResourceClaimStatuses = []v1.PodResourceClaimStatus{{Name: "gpu", ResourceClaimName: ptr.To(claim)}}
		return p
	}
	for name, tc := range map[string]struct {
		updated *v1.Pod
		want    fwk.QueueingHint
	}{
		"claim not named yet":          {updated: pod, want: fwk.QueueSkip},
		"claim named, not in cache":    {updated: named("p-gpu-xyz"), want: fwk.QueueSkip},
		"claim named and in the cache": {updated: named("p-gpu-abc"), want: fwk.Queue},
	} {
		got, err := h.pl.isSchedulableAfterPodUpdate(klog.Background(), pod, pod, tc.updated)
		if err != nil {
			t.Fatal(err)
		}
		if got != tc.want {
			t.Errorf("%s: hint %v, want %v", name, got, tc.want)
		}
	}
}

// TestFreedDevicesTakenAgainBySameClaim: a claim gives two GPUs back
// before the claim tracker sees it, then is allocated the same GPUs
// again (its pod retried). Those GPUs are held, not free: when another
// claim gives back the other two GPUs of the node, a 4-GPU pod is not
// retried for a node with two free.
func TestFreedDevicesTakenAgainBySameClaim(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("a")}, testDeviceClass(), testSlice("a", 4),
		testClaim("big", 4),
		allocatedOn(testClaim("x", 2), "a", "gpu-0", "gpu-1"),
		allocatedOn(testClaim("z", 2), "a", "gpu-2", "gpu-3"))
	for _, n := range []string{"big", "x", "z"} {
		h.waitForClaim(n, func(*resourceapi.ResourceClaim) bool { return true })
	}
	big := testPod("big", "big")
	hint := func(old, new *resourceapi.ResourceClaim) fwk.QueueingHint {
		t.Helper()
		got, err := h.pl.isSchedulableAfterClaimChange(klog.Background(), big, old, new)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	setAllocation := func(name string, allocation *resourceapi.AllocationResult) {
		t.Helper()
		c := h.apiClaim(name)
		c.Status.Allocation = allocation
		if _, err := h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(h.tCtx, c, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		h.waitForClaim(name, func(c *resourceapi.ResourceClaim) bool { return (c.Status.Allocation == nil) == (allocation == nil) })
	}
	// x gives gpu-0 and gpu-1 back; the hint runs before the tracker
	// sees it.
	x := h.apiClaim("x")
	gone := x.DeepCopy()
	gone.Status.Allocation = nil
	if got := hint(x, gone); got != fwk.QueueSkip {
		t.Errorf("x gave back 2 of 4: hint %v, want QueueSkip", got)
	}
	// The tracker sees x deallocated, then allocated the same GPUs again.
	setAllocation("x", nil)
	setAllocation("x", allocatedOn(testClaim("x", 2), "a", "gpu-0", "gpu-1").Status.Allocation)
	// z gives back gpu-2 and gpu-3: two free on the node, x holds the rest.
	z := h.apiClaim("z")
	setAllocation("z", nil)
	if got := hint(z, h.apiClaim("z")); got != fwk.QueueSkip {
		t.Errorf("z gave back 2 GPUs while x holds the other 2 again: hint %v for a 4-GPU pod, want QueueSkip", got)
	}
}

// TestNodeQueueingHint: new nodes, labels, allocatable and declared
// features requeue any pod; a cordon or taint lifted so that the pod may
// use the node requeues it (devices given back there meanwhile did not);
// any other taint or cordon change, and a node or slice deleted, only a
// pod the headroom held back.
func TestNodeQueueingHint(t *testing.T) {
	pl := &TopologyDRA{}
	pod, held := testPod("p"), testPod("held")
	pl.heldBack.hold(held)
	tolerating := testPod("tolerating")
	tolerating.Spec.Tolerations = []v1.Toleration{{Key: "k", Operator: v1.TolerationOpExists}}
	elsewhere := testPod("elsewhere")
	elsewhere.Spec.NodeSelector = map[string]string{"pool": "other"}
	node := func(mutate func(*v1.Node)) *v1.Node {
		n := testNode("n")
		mutate(n)
		return n
	}
	plain := node(func(*v1.Node) {})
	for _, tc := range []struct {
		name     string
		old, new *v1.Node
		pod      *v1.Pod
		want     fwk.QueueingHint
	}{
		{"node added", nil, plain, pod, fwk.Queue},
		{"label added", plain, node(func(n *v1.Node) { n.Labels["gpu"] = "h100" }), pod, fwk.Queue},
		{"cordoned", plain, node(func(n *v1.Node) { n.Spec.Unschedulable = true }), pod, fwk.QueueSkip},
		{"taint removed", node(func(n *v1.Node) { n.Spec.Taints = []v1.Taint{{Key: "k", Effect: v1.TaintEffectNoSchedule}} }), plain, pod, fwk.Queue},
		{"uncordoned", node(func(n *v1.Node) { n.Spec.Unschedulable = true }), plain, pod, fwk.Queue},
		{"NoExecute taint removed", node(func(n *v1.Node) {
			n.Spec.Taints = []v1.Taint{{Key: v1.TaintNodeUnreachable, Effect: v1.TaintEffectNoExecute}}
		}), plain, pod, fwk.Queue},
		{"one of two taints removed", node(func(n *v1.Node) {
			n.Spec.Taints = []v1.Taint{{Key: "k", Effect: v1.TaintEffectNoSchedule}, {Key: "j", Effect: v1.TaintEffectNoSchedule}}
		}), node(func(n *v1.Node) { n.Spec.Taints = []v1.Taint{{Key: "j", Effect: v1.TaintEffectNoSchedule}} }), pod, fwk.QueueSkip},
		{"tolerated taint removed", node(func(n *v1.Node) { n.Spec.Taints = []v1.Taint{{Key: "k", Effect: v1.TaintEffectNoSchedule}} }), plain, tolerating, fwk.QueueSkip},
		{"PreferNoSchedule taint removed", node(func(n *v1.Node) { n.Spec.Taints = []v1.Taint{{Key: "k", Effect: v1.TaintEffectPreferNoSchedule}} }), plain, pod, fwk.QueueSkip},
		{"uncordoned, node outside the pod's selector", node(func(n *v1.Node) { n.Spec.Unschedulable = true }), plain, elsewhere, fwk.QueueSkip},
		{"cordoned, pod held back by the headroom", plain, node(func(n *v1.Node) { n.Spec.Unschedulable = true }), held, fwk.Queue},
		{"feature declared", plain, node(func(n *v1.Node) { n.Status.DeclaredFeatures = []string{"DRAOptionalNodeOperations"} }), pod, fwk.Queue},
	} {
		var oldObj any
		if tc.old != nil {
			oldObj = tc.old
		}
		got, err := pl.isSchedulableAfterNodeChange(klog.Background(), tc.pod, oldObj, tc.new)
		if err != nil {
			t.Fatal(err)
		}
		if got != tc.want {
			t.Errorf("%s: hint %v, want %v", tc.name, got, tc.want)
		}
	}
	// A node or a slice deleted requeues only a pod the headroom held
	// back (the headroom is a share of the devices that remain).
	events, err := pl.EventsToRegister(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, resource := range []fwk.EventResource{fwk.Node, fwk.ResourceSlice} {
		var hintFn fwk.QueueingHintFn
		for _, e := range events {
			if e.Event.Resource == resource && e.Event.ActionType&fwk.Delete != 0 {
				hintFn = e.QueueingHintFn
			}
		}
		if hintFn == nil {
			t.Errorf("no event registered for a deleted %s", resource)
			continue
		}
		var old any = plain
		if resource == fwk.ResourceSlice {
			old = testSlice("n", 4)
		}
		for p, want := range map[*v1.Pod]fwk.QueueingHint{pod: fwk.QueueSkip, held: fwk.Queue} {
			if got, err := hintFn(klog.Background(), p, old, nil); err != nil || got != want {
				t.Errorf("%s deleted, pod %s: hint %v (%v), want %v", resource, p.Name, got, err, want)
			}
		}
	}
}

// TestAdminAccessHoldsNoDevices: a monitoring claim with admin access on
// every GPU of node a holds none of them (the upstream allocator does not
// count such results as allocated). When the workload claim on a gives its
// four GPUs back, a pod asking for four is requeued, and the count of free
// devices that the headroom uses sees them free. A device that two claims
// share counts once.
func TestAdminAccessHoldsNoDevices(t *testing.T) {
	monitor := allocatedOn(testClaim("monitor", 4), "a", "gpu-0", "gpu-1", "gpu-2", "gpu-3")
	for i := range monitor.Status.Allocation.Devices.Results {
		monitor.Status.Allocation.Devices.Results[i].AdminAccess = ptr.To(true)
	}
	h := newHarness(t, []*v1.Node{testNode("a"), testNode("b")}, testDeviceClass(), testSlice("a", 4), testSlice("b", 4),
		testClaim("big", 4), monitor, allocatedOn(testClaim("work", 4), "a", "gpu-0", "gpu-1", "gpu-2", "gpu-3"),
		allocatedOn(testClaim("share-1", 1), "b", "gpu-0"), allocatedOn(testClaim("share-2", 1), "b", "gpu-0"))
	for _, name := range []string{"big", "monitor", "work", "share-1", "share-2"} {
		h.waitForClaim(name, func(*resourceapi.ResourceClaim) bool { return true })
	}
	work := h.apiClaim("work")
	freed := work.DeepCopy()
	freed.Status.Allocation = nil
	freed, err := h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(h.tCtx, freed, metav1.UpdateOptions{})
	h.tCtx.ExpectNoError(err)
	h.waitForClaim("work", func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation == nil })
	got, err := h.pl.isSchedulableAfterClaimChange(klog.Background(), testPod("big", "big"), work, freed)
	h.tCtx.ExpectNoError(err)
	if got != fwk.Queue {
		t.Errorf("work gave back all four GPUs of a, which monitor only watches: hint %v, want Queue", got)
	}
	if _, st := h.cycle(testPod("big", "big"), "a"); !st["a"].IsSuccess() {
		t.Errorf("Filter on a: %v", st["a"])
	}

	slices, err := h.pl.draManager.ResourceSlices().ListWithDeviceTaintRules()
	h.tCtx.ExpectNoError(err)
	allocated, err := h.pl.allocatedDevices()
	h.tCtx.ExpectNoError(err)
	generation := map[poolKey]int64{}
	for _, s := range slices {
		generation[poolKey{driver: s.Spec.Driver, pool: s.Spec.Pool.Name}] = s.Spec.Pool.Generation
	}
	h.pl.freed.mu.Lock()
	_, free, err := h.pl.freed.givenBack(h.pl, allocated)
	h.tCtx.ExpectNoError(err)
	nodes, _ := h.pl.freed.countNodes(slices, allocated, free, generation, func(string) bool { return true })
	h.pl.freed.mu.Unlock()
	for node, want := range map[string]int{"a": 4, "b": 3} {
		if got := nodes[deviceGroup{driver: topology.DriverName, node: node}].free; got != want {
			t.Errorf("free devices on %s for the headroom: %d, want %d", node, got, want)
		}
	}
}

// TestFreedDevicesOfRemovedPool: devices given back from a pool that is no
// longer published (its node gone) are not remembered: there is nothing
// to count them against, and no later event would forget them.
func TestFreedDevicesOfRemovedPool(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("a"), testNode("b")}, testDeviceClass(), testSlice("a", 4), testSlice("b", 4), testClaim("big", 4),
		allocatedOn(testClaim("za", 2), "a", "gpu-0", "gpu-1"), allocatedOn(testClaim("zb", 4), "b", "gpu-0", "gpu-1", "gpu-2", "gpu-3"))
	for _, name := range []string{"big", "za", "zb"} {
		h.waitForClaim(name, func(*resourceapi.ResourceClaim) bool { return true })
	}
	h.tCtx.ExpectNoError(h.client.ResourceV1().ResourceSlices().Delete(h.tCtx, testSlice("b", 4).Name, metav1.DeleteOptions{}))
	err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		slices, err := h.pl.draManager.ResourceSlices().ListWithDeviceTaintRules()
		return err == nil && len(slices) == 1, nil
	})
	h.tCtx.ExpectNoError(err, "slice of node b still listed")
	for _, name := range []string{"zb", "za"} {
		old := h.apiClaim(name)
		h.tCtx.ExpectNoError(h.client.ResourceV1().ResourceClaims(testNS).Delete(h.tCtx, name, metav1.DeleteOptions{}))
		h.waitForClaimGone(name)
		_, err := h.pl.isSchedulableAfterClaimChange(klog.Background(), testPod("big", "big"), old, nil)
		h.tCtx.ExpectNoError(err)
	}
	h.pl.freed.mu.Lock()
	defer h.pl.freed.mu.Unlock()
	if n := len(h.pl.freed.freedBy); n != 0 {
		t.Errorf("%d devices given back are remembered, want none (node b's pool is gone, node a's were seen free)", n)
	}
}

// TestBindingFailureRequeues: pod a reserves all four GPUs of node-a and
// pod b, asking for one, is turned down meanwhile. a's binding cycle then
// fails before anything reached the API: Unreserve frees the GPUs without
// a claim event, and the scheduler reports a as an assigned pod deleted.
// That event requeues b; the deletion of a pod that Unreserve released
// nothing for does not (its claims' events do).
func TestBindingFailureRequeues(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 4), testClaim("four", 4), testClaim("one", 1))
	h.waitForClaim("four", func(*resourceapi.ResourceClaim) bool { return true })
	h.waitForClaim("one", func(*resourceapi.ResourceClaim) bool { return true })
	a, b := testPod("a", "four"), testPod("b", "one")
	csA, _ := h.cycle(a, "node-a")
	if st := h.pl.Reserve(h.tCtx, csA, a, "node-a"); !st.IsSuccess() {
		t.Fatalf("Reserve a: %v", st)
	}
	if _, st := h.cycle(b, "node-a"); st["node-a"].IsSuccess() {
		t.Fatal("b fits beside a's in-flight allocation")
	}
	h.pl.Unreserve(h.tCtx, csA, a, "node-a")
	if _, st := h.cycle(b, "node-a"); !st["node-a"].IsSuccess() {
		t.Fatalf("b after a's Unreserve: %v", st["node-a"])
	}
	events, err := h.pl.EventsToRegister(h.tCtx)
	h.tCtx.ExpectNoError(err)
	var hintFn fwk.QueueingHintFn
	for _, e := range events {
		if framework.MatchClusterEvents(e.Event, framework.EventAssignedPodDelete) {
			hintFn = e.QueueingHintFn
		}
	}
	if hintFn == nil {
		t.Fatal("no hint registered for an assigned pod deleted")
	}
	assumed := a.DeepCopy()
	assumed.Spec.NodeName = "node-a"
	other := testPod("other")
	other.Spec.NodeName = "node-a"
	// Pods of another profile, which this plugin instance never reserved:
	// one that failed its binding cycle (it still exists, unbound) with a
	// claim, one bound since, and one without claims or extended resources.
	elsewhere := map[string]*v1.Pod{}
	for name, claim := range map[string]string{"failed": "one", "bound": "one", "plain": ""} {
		var p *v1.Pod
		if claim == "" {
			p = testPod(name)
		} else {
			p = testPod(name, claim)
		}
		p.Spec.SchedulerName = "other-profile"
		if name == "bound" {
			p.Spec.NodeName = "node-a"
		}
		created, err := h.client.CoreV1().Pods(testNS).Create(h.tCtx, p, metav1.CreateOptions{})
		h.tCtx.ExpectNoError(err)
		elsewhere[name] = created
	}
	err = wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		pods, err := h.pl.pods.Pods(testNS).List(labels.Everything())
		return err == nil && len(pods) >= len(elsewhere), nil
	})
	h.tCtx.ExpectNoError(err, "the pod lister never saw the pods")
	assumedElsewhere := func(name string) *v1.Pod {
		p := elsewhere[name].DeepCopy()
		p.Spec.NodeName = "node-a"
		return p
	}
	for gone, want := range map[*v1.Pod]fwk.QueueingHint{
		assumed: fwk.Queue, other: fwk.QueueSkip,
		assumedElsewhere("failed"): fwk.Queue, assumedElsewhere("bound"): fwk.QueueSkip, assumedElsewhere("plain"): fwk.QueueSkip,
	} {
		if got, err := hintFn(klog.Background(), b, gone, nil); err != nil || got != want {
			t.Errorf("assigned pod %s deleted, pod b: hint %v (%v), want %v", gone.Name, got, err, want)
		}
	}
}

// TestCacheFollowsSlicesAndNodes: the allocator cache drops a slice's
// entries when the slice changes or goes, and a node's when it is deleted.
func TestCacheFollowsSlicesAndNodes(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("a"), testNode("b")}, testDeviceClass(), testSlice("a", 4), testSlice("b", 4), testClaim("c", 1))
	h.waitForClaim("c", func(*resourceapi.ResourceClaim) bool { return true })
	h.cycle(testPod("p", "c"), "a", "b")
	slices, nodes := h.pl.cache.Size()
	if slices != 2 || nodes != 2 {
		t.Fatalf("after a cycle on two nodes: %d slices and %d nodes cached, want 2 and 2", slices, nodes)
	}
	waitSize := func(wantSlices, wantNodes int, what string) {
		t.Helper()
		err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
			slices, nodes := h.pl.cache.Size()
			return slices == wantSlices && nodes == wantNodes, nil
		})
		if err != nil {
			slices, nodes := h.pl.cache.Size()
			t.Fatalf("%s: %d slices and %d nodes cached, want %d and %d", what, slices, nodes, wantSlices, wantNodes)
		}
	}
	slice, err := h.client.ResourceV1().ResourceSlices().Get(h.tCtx, testSlice("a", 4).Name, metav1.GetOptions{})
	h.tCtx.ExpectNoError(err)
	slice.Generation++
	_, err = h.client.ResourceV1().ResourceSlices().Update(h.tCtx, slice, metav1.UpdateOptions{})
	h.tCtx.ExpectNoError(err)
	waitSize(1, 2, "slice of a changed")
	h.tCtx.ExpectNoError(h.client.ResourceV1().ResourceSlices().Delete(h.tCtx, testSlice("b", 4).Name, metav1.DeleteOptions{}))
	waitSize(0, 2, "slice of b deleted")
	h.tCtx.ExpectNoError(h.client.CoreV1().Nodes().Delete(h.tCtx, "b", metav1.DeleteOptions{}))
	waitSize(0, 1, "node b deleted")
}

// TestFreedDeviceTakenAgainForgotten: a device given back on node a and
// taken again by another claim is forgotten at the next event that gives
// devices back, wherever that is (here on node b): the claim that gave it
// back no longer holds it. Remembered, it would make every later event
// list every claim to tell whether it is taken.
func TestFreedDeviceTakenAgainForgotten(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("a"), testNode("b")}, testDeviceClass(), testSlice("a", 2), testSlice("b", 2), testClaim("big", 2),
		allocatedOn(testClaim("ga", 1), "a", "gpu-0"), allocatedOn(testClaim("gb", 1), "b", "gpu-0"))
	for _, name := range []string{"big", "ga", "gb"} {
		h.waitForClaim(name, func(*resourceapi.ResourceClaim) bool { return true })
	}
	pod := testPod("big", "big")
	giveBack := func(name string) {
		t.Helper()
		old := h.apiClaim(name)
		freed := old.DeepCopy()
		freed.Status.Allocation = nil
		freed, err := h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(h.tCtx, freed, metav1.UpdateOptions{})
		h.tCtx.ExpectNoError(err)
		h.waitForClaim(name, func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation == nil })
		_, err = h.pl.isSchedulableAfterClaimChange(klog.Background(), pod, old, freed)
		h.tCtx.ExpectNoError(err)
	}
	// The event of ga comes before the claim tracker has seen it: a/gpu-0
	// is remembered as given back.
	ga := h.apiClaim("ga")
	freed := ga.DeepCopy()
	freed.Status.Allocation = nil
	_, err := h.pl.isSchedulableAfterClaimChange(klog.Background(), pod, ga, freed)
	h.tCtx.ExpectNoError(err)
	h.pl.freed.mu.Lock()
	_, remembered := h.pl.freed.freedBy[structured.MakeDeviceID(topology.DriverName, "a", "gpu-0")]
	h.pl.freed.mu.Unlock()
	if !remembered {
		t.Fatal("a/gpu-0, given back by ga before the tracker saw it, is not remembered")
	}
	// ga's update reaches the tracker; its event was the one above.
	_, err = h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(h.tCtx, freed, metav1.UpdateOptions{})
	h.tCtx.ExpectNoError(err)
	h.waitForClaim("ga", func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation == nil })
	taker := allocatedOn(testClaim("taker", 1), "a", "gpu-0")
	_, err = h.client.ResourceV1().ResourceClaims(testNS).Create(h.tCtx, taker, metav1.CreateOptions{})
	h.tCtx.ExpectNoError(err)
	h.waitForClaim("taker", func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation != nil })
	giveBack("gb")
	h.pl.freed.mu.Lock()
	defer h.pl.freed.mu.Unlock()
	if _, ok := h.pl.freed.freedBy[structured.MakeDeviceID(topology.DriverName, "a", "gpu-0")]; ok {
		t.Error("a/gpu-0, given back by ga and taken by taker, is still remembered as given back")
	}
}

// TestLowerHolderRequeuesHeldBackPod: a pod of lower priority that holds
// claims, bound to a node the held pod may use, requeues a pod that the
// headroom held back while it could preempt no holder, so that it may
// preempt at once; nothing else does.
func TestLowerHolderRequeuesHeldBackPod(t *testing.T) {
	withPriority := func(p *v1.Pod, prio int32) *v1.Pod {
		p.Spec.Priority = ptr.To(prio)
		return p
	}
	held := withPriority(testPod("held"), 100)
	never := withPriority(testPod("never"), 100)
	never.Spec.PreemptionPolicy = ptr.To(v1.PreemptNever)
	outranking := withPriority(testPod("outranking"), 100)
	free := withPriority(testPod("free"), 100)
	elsewhere := withPriority(testPod("elsewhere"), 100)
	elsewhere.Spec.NodeSelector = map[string]string{"pool": "other"}

	nodes := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	cordoned := testNode("cordoned")
	cordoned.Spec.Unschedulable = true
	for _, n := range []*v1.Node{testNode("open"), cordoned} {
		if err := nodes.Add(n); err != nil {
			t.Fatal(err)
		}
	}
	pl := &TopologyDRA{nodes: corelisters.NewNodeLister(nodes)}
	for _, p := range []*v1.Pod{held, never, outranking, elsewhere} {
		pl.heldBack.hold(p)
	}
	pl.heldBack.setOutranks(outranking, true)

	bound := func(name string, prio int32, node string, claims ...string) *v1.Pod {
		p := withPriority(testPod(name, claims...), prio)
		p.Spec.NodeName = node
		return p
	}
	extended := bound("extended", 10, "open")
	extended.Status.ExtendedResourceClaimStatus = &v1.PodExtendedResourceClaimStatus{ResourceClaimName: "extended-gpus"}
	for name, tc := range map[string]struct {
		pod, bound *v1.Pod
		want       fwk.QueueingHint
	}{
		"a lower pod with claims bound":              {pod: held, bound: bound("low", 10, "open", "c"), want: fwk.Queue},
		"a lower pod with extended resources bound":  {pod: held, bound: extended, want: fwk.Queue},
		"a lower pod bound to a cordoned node":       {pod: held, bound: bound("low", 10, "cordoned", "c"), want: fwk.QueueSkip},
		"a lower pod bound where the pod may not go": {pod: elsewhere, bound: bound("low", 10, "open", "c"), want: fwk.QueueSkip},
		"a lower pod without claims bound":           {pod: held, bound: bound("plain", 10, "open"), want: fwk.QueueSkip},
		"a pod of equal priority bound":              {pod: held, bound: bound("equal", 100, "open", "c"), want: fwk.QueueSkip},
		"a higher pod bound":                         {pod: held, bound: bound("high", 200, "open", "c"), want: fwk.QueueSkip},
		"pod may not preempt":                        {pod: never, bound: bound("low", 10, "open", "c"), want: fwk.QueueSkip},
		"pod was not held back":                      {pod: free, bound: bound("low", 10, "open", "c"), want: fwk.QueueSkip},
		"pod outranked a holder already":             {pod: outranking, bound: bound("low", 10, "open", "c"), want: fwk.QueueSkip},
	} {
		t.Run(name, func(t *testing.T) {
			got, err := pl.isSchedulableAfterAssignedPodAdd(klog.Background(), tc.pod, nil, tc.bound)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("hint = %v, want %v", got, tc.want)
			}
		})
	}
}
