package topologydra

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/scheme"
	cgotesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/events"
	"k8s.io/component-base/metrics/testutil"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

func code(st *fwk.Status) fwk.Code {
	if st == nil {
		return fwk.Success
	}
	return st.Code()
}

// cycle runs PreFilter and Filter on every node of the harness and returns
// the cycle state.
func (h *harness) cycle(pod *v1.Pod, nodes ...string) (fwk.CycleState, map[string]*fwk.Status) {
	h.tCtx.Helper()
	cs := framework.NewCycleState()
	var all []fwk.NodeInfo
	for _, n := range slices.Sorted(maps.Keys(h.nodes)) {
		all = append(all, h.nodes[n])
	}
	_, st := h.pl.PreFilter(h.tCtx, cs, pod, all)
	if !st.IsSuccess() {
		h.tCtx.Fatalf("PreFilter: %v", st)
	}
	out := map[string]*fwk.Status{}
	for _, n := range nodes {
		out[n] = h.pl.Filter(h.tCtx, cs, pod, h.nodes[n])
	}
	return cs, out
}

// reserve runs PreFilter and Filter for pod (Filter must pass on node)
// and then Reserve on node, and returns the cycle state.
func (h *harness) reserve(pod *v1.Pod, node string) fwk.CycleState {
	h.tCtx.Helper()
	cs, st := h.cycle(pod, node)
	if !st[node].IsSuccess() {
		h.tCtx.Fatalf("Filter of pod %s on node %s: %v", pod.Name, node, st[node])
	}
	if st := h.pl.Reserve(h.tCtx, cs, pod, node); !st.IsSuccess() {
		h.tCtx.Fatalf("Reserve of pod %s on node %s: %v", pod.Name, node, st)
	}
	return cs
}

func TestPreFilter(t *testing.T) {
	nodes := []*v1.Node{testNode("node-a")}
	tests := map[string]struct {
		objs          []runtime.Object
		pod           *v1.Pod
		wantCode      fwk.Code
		wantMsg       string
		wantEvent     string
		wantAllocator bool
		// pending: another pod's cycle is allocating claim "c".
		pending bool
	}{
		"no claims": {pod: testPod("p"), wantCode: fwk.Skip},
		// Rejections of the pod as a whole are unresolvable, as with the
		// stock plugin: preempting pods cannot help, and Filter would pass
		// every node on the state written so far.
		"claim not created yet": {
			pod: testPod("p", "absent"), wantCode: fwk.UnschedulableAndUnresolvable, wantMsg: "waiting for resource claim ns/absent",
		},
		"claim being allocated for another pod": {
			objs: []runtime.Object{testDeviceClass(), testSlice("node-a", 2), testClaim("c", 1)}, pending: true,
			pod: testPod("p", "c"), wantCode: fwk.UnschedulableAndUnresolvable, wantMsg: "being allocated for another pod",
		},
		"missing device class": {
			objs: []runtime.Object{func() *resourceapi.ResourceClaim {
				c := testClaim("c", 1)
				c.Spec.Devices.Requests[0].Exactly.DeviceClassName = "nope"
				return c
			}()},
			pod:      testPod("p", "c"),
			wantCode: fwk.UnschedulableAndUnresolvable, wantMsg: "device class nope does not exist", wantEvent: "InvalidClaim",
		},
		"invalid CEL": {
			objs:     []runtime.Object{testDeviceClass(), testClaim("c", 1, `device.attributes["x"].`)},
			pod:      testPod("p", "c"),
			wantCode: fwk.UnschedulableAndUnresolvable, wantMsg: "invalid CEL selector", wantEvent: "InvalidClaim",
		},
		// A selector type newer than the scheduler: upstream's allocator
		// would dereference its nil CEL and take the scheduler down.
		"class selector of an unknown type": {
			objs: []runtime.Object{func() *resourceapi.DeviceClass {
				c := testDeviceClass()
				c.Spec.Selectors = append(c.Spec.Selectors, resourceapi.DeviceSelector{})
				return c
			}(), testSlice("node-a", 2), testClaim("c", 1)},
			pod:      testPod("p", "c"),
			wantCode: fwk.UnschedulableAndUnresolvable, wantMsg: "is of a type this scheduler does not know", wantEvent: "InvalidClaim",
		},
		"invalid alignment annotation": {
			objs: []runtime.Object{testDeviceClass(), testSlice("node-a", 2), func() *resourceapi.ResourceClaim {
				c := testClaim("c", 1)
				c.Annotations = map[string]string{topology.AnnotationAlignment: "requried"}
				return c
			}()},
			pod:      testPod("p", "c"),
			wantCode: fwk.UnschedulableAndUnresolvable, wantMsg: `annotation topodra.io/alignment: invalid alignment "requried"`, wantEvent: "InvalidClaim",
		},
		"invalid align-with annotation": {
			objs: []runtime.Object{testDeviceClass(), testSlice("node-a", 2), func() *resourceapi.ResourceClaim {
				c := testClaim("c", 1)
				c.Annotations = map[string]string{topology.AnnotationAlignWith: "node"}
				return c
			}()},
			pod:      testPod("p", "c"),
			wantCode: fwk.UnschedulableAndUnresolvable, wantMsg: `invalid value "node" (want pod)`, wantEvent: "InvalidClaim",
		},
		"claim to allocate": {
			objs: []runtime.Object{testDeviceClass(), testSlice("node-a", 2), testClaim("c", 1)},
			pod:  testPod("p", "c"), wantCode: fwk.Success, wantAllocator: true,
		},
		"claim allocated already": {
			objs: []runtime.Object{testDeviceClass(), testSlice("node-a", 2), allocatedOn(testClaim("c", 1), "node-a", "gpu-0")},
			pod:  testPod("p", "c"), wantCode: fwk.Success,
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			h := newHarness(t, nodes, tc.objs...)
			if tc.pending {
				c, err := h.client.ResourceV1().ResourceClaims(testNS).Get(h.tCtx, "c", metav1.GetOptions{})
				if err != nil {
					t.Fatal(err)
				}
				h.pl.draManager.ResourceClaims().SignalClaimPendingAllocation(c.UID, allocatedOn(c.DeepCopy(), "node-a", "gpu-0"))
			}
			cs := framework.NewCycleState()
			_, st := h.pl.PreFilter(h.tCtx, cs, tc.pod, nil)
			if code(st) != tc.wantCode {
				t.Fatalf("PreFilter: %v, want code %v", st, tc.wantCode)
			}
			if tc.wantMsg != "" && !strings.Contains(st.Message(), tc.wantMsg) {
				t.Errorf("message %q does not contain %q", st.Message(), tc.wantMsg)
			}
			if tc.wantEvent != "" {
				select {
				case e := <-h.recorder.Events:
					if !strings.Contains(e, tc.wantEvent) {
						t.Errorf("event %q, want %s", e, tc.wantEvent)
					}
				default:
					t.Errorf("no %s event on the claim", tc.wantEvent)
				}
			}
			if tc.wantCode != fwk.Success {
				return
			}
			s, err := getState(cs)
			if err != nil {
				t.Fatal(err)
			}
			if (s.allocator != nil) != tc.wantAllocator {
				t.Errorf("allocator built: %v, want %v", s.allocator != nil, tc.wantAllocator)
			}
		})
	}
}

func TestFilter(t *testing.T) {
	nodes := []*v1.Node{testNode("node-a"), testNode("node-b")}
	t.Run("best aligned devices where they fit", func(t *testing.T) {
		// gpu-0 is taken, so the pair goes to the free PCIe root pci-1
		// (gpu-2, gpu-3), not to gpu-1 + gpu-2.
		h := newHarness(t, nodes, testDeviceClass(), testSlice("node-a", 4), allocatedOn(testClaim("taken", 1), "node-a", "gpu-0"), testClaim("c", 2))
		cs, st := h.cycle(testPod("p", "c"), "node-a", "node-b")
		if !st["node-a"].IsSuccess() {
			t.Fatalf("Filter(node-a): %v", st["node-a"])
		}
		if code(st["node-b"]) != fwk.UnschedulableAndUnresolvable {
			t.Errorf("Filter(node-b) without devices: %v, want UnschedulableAndUnresolvable", st["node-b"])
		}
		s, _ := getState(cs)
		res := s.getResult("node-a")
		if res == nil || len(res.Allocations) != 1 {
			t.Fatalf("no allocation recorded for node-a: %+v", res)
		}
		got := devicesOf(res.Allocations[0])
		if strings.Join(got, ",") != "gpu-2,gpu-3" {
			t.Errorf("allocated %v, want gpu-2,gpu-3", got)
		}
		if s.getResult("node-b") != nil {
			t.Error("a result was recorded for the infeasible node")
		}
	})
	t.Run("all devices where another node's pool is being updated or invalid", func(t *testing.T) {
		// An All request fails only on the node whose pool upstream
		// cannot take all devices of: a pool still being published
		// (one of its two slices) or an invalid one (a device name
		// twice). The other node is not given up with it.
		incomplete := testSlice("node-a", 2)
		incomplete.Spec.Pool.ResourceSliceCount = 2
		invalid := testSlice("node-a", 2)
		invalid.Spec.Devices[1].Name = invalid.Spec.Devices[0].Name
		for name, broken := range map[string]*resourceapi.ResourceSlice{"incomplete": incomplete, "invalid": invalid} {
			t.Run(name, func(t *testing.T) {
				c := testClaim("c", 0)
				c.Spec.Devices.Requests[0].Exactly.AllocationMode = resourceapi.DeviceAllocationModeAll
				h := newHarness(t, nodes, testDeviceClass(), broken, testSlice("node-b", 2), c)
				_, st := h.cycle(testPod("p", "c"), "node-a", "node-b")
				if code(st["node-a"]) != fwk.UnschedulableAndUnresolvable || !strings.Contains(st["node-a"].Message(), "all matching devices") || strings.Contains(st["node-a"].Message(), "node-a") {
					t.Errorf("Filter(node-a): %v, want UnschedulableAndUnresolvable for this node only, saying why in words that do not name the node", st["node-a"])
				}
				if !st["node-b"].IsSuccess() {
					t.Errorf("Filter(node-b): %v, want success", st["node-b"])
				}
			})
		}
	})
	t.Run("claim allocated for another node", func(t *testing.T) {
		h := newHarness(t, nodes, testDeviceClass(), testSlice("node-b", 2), allocatedOn(testClaim("c", 1), "node-b", "gpu-0"))
		cs, st := h.cycle(testPod("p", "c"), "node-a", "node-b")
		if code(st["node-a"]) != fwk.UnschedulableAndUnresolvable || !strings.Contains(st["node-a"].Message(), "cannot use") {
			t.Errorf("Filter(node-a): %v, want UnschedulableAndUnresolvable naming the claim", st["node-a"])
		}
		if !st["node-b"].IsSuccess() {
			t.Errorf("Filter(node-b): %v, want success", st["node-b"])
		}
		s, _ := getState(cs)
		if !s.unavailableClaims.Has(0) {
			t.Error("the claim was not marked unavailable for PostFilter")
		}
	})
	t.Run("claim allocated on devices that skip node operations", func(t *testing.T) {
		// Only a node that declares DRAOptionalNodeOperations can use
		// it, as with the stock plugin.
		for _, declared := range []bool{false, true} {
			node := testNode("node-a")
			if declared {
				node.Status.DeclaredFeatures = []string{"DRAOptionalNodeOperations"}
			}
			c := allocatedOn(testClaim("c", 1), "node-a", "gpu-0")
			c.Status.Allocation.Devices.Results[0].SkipNodeOperations = []resourceapi.SkipNodeOperation{resourceapi.SkipNodeOperationAll}
			h := newHarness(t, []*v1.Node{node}, testDeviceClass(), testSlice("node-a", 2), c)
			cs, st := h.cycle(testPod("p", "c"), "node-a")
			s, _ := getState(cs)
			switch {
			case declared && !st["node-a"].IsSuccess():
				t.Errorf("Filter on a node that declares the feature: %v, want success", st["node-a"])
			case !declared && (code(st["node-a"]) != fwk.UnschedulableAndUnresolvable || !strings.Contains(st["node-a"].Message(), "DRAOptionalNodeOperations") || !strings.Contains(st["node-a"].Message(), "deallocated and allocated again")):
				t.Errorf("Filter on a node without the feature: %v, want UnschedulableAndUnresolvable naming it and saying what PostFilter does", st["node-a"])
			case !declared && !s.unavailableClaims.Has(0):
				t.Error("the claim was not marked unavailable for PostFilter")
			}
		}
	})
	t.Run("allocation past the filter timeout", func(t *testing.T) {
		h := newHarness(t, nodes, testDeviceClass(), testSlice("node-a", 4), testClaim("c", 2))
		if h.pl.filterTimeout <= 0 {
			t.Fatal("DRASchedulerFilterTimeout is on by default, but the plugin has no filter timeout")
		}
		h.pl.filterTimeout = time.Nanosecond
		_, st := h.cycle(testPod("p", "c"), "node-a")
		if code(st["node-a"]) != fwk.Error || !strings.Contains(st["node-a"].Message(), "timed out trying to allocate devices") {
			t.Errorf("Filter: %v, want Error saying the allocation timed out", st["node-a"])
		}
	})
	t.Run("CEL runtime error", func(t *testing.T) {
		h := newHarness(t, nodes, testDeviceClass(), testSlice("node-a", 2),
			testClaim("c", 1, `device.attributes["gpu.topodra.io"].missing == 1`))
		_, st := h.cycle(testPod("p", "c"), "node-a")
		// Like the stock plugin: the cycle fails, the pod is not placed
		// on another node where the selector happens not to fail.
		if code(st["node-a"]) != fwk.Error || !strings.Contains(st["node-a"].Message(), "ns/c") {
			t.Errorf("Filter: %v, want Error naming claim ns/c", st["node-a"])
		}
		expectInvalidClaimEvent(t, h, "missing")
	})
	t.Run("more devices than a claim can hold", func(t *testing.T) {
		c := testClaim("c", 20)
		more := *c.Spec.Devices.Requests[0].DeepCopy()
		more.Name = "more"
		c.Spec.Devices.Requests = append(c.Spec.Devices.Requests, more)
		h := newHarness(t, nodes, testDeviceClass(), testSlice("node-a", 2), c)
		_, st := h.cycle(testPod("p", "c"), "node-a")
		// Like the stock plugin: an error, retried with backoff; and a
		// warning on the claim, which the stock plugin does not give.
		if code(st["node-a"]) != fwk.Error || !strings.Contains(st["node-a"].Message(), "at least 40 devices, which exceeds the claim limit of 32") {
			t.Errorf("Filter: %v, want Error naming the claim limit", st["node-a"])
		}
		expectInvalidClaimEvent(t, h, "claim limit")
	})
}

// expectInvalidClaimEvent checks that an InvalidClaim event that says want
// has been recorded.
func expectInvalidClaimEvent(t *testing.T, h *harness, want string) {
	t.Helper()
	select {
	case e := <-h.recorder.Events:
		if !strings.Contains(e, "InvalidClaim") || !strings.Contains(e, want) {
			t.Errorf("event %q, want InvalidClaim that says %q", e, want)
		}
	default:
		t.Error("no InvalidClaim event on the claim")
	}
}

func devicesOf(a resourceapi.AllocationResult) []string {
	var out []string
	for _, r := range a.Devices.Results {
		out = append(out, r.Device)
	}
	return out
}

// TestReserveVerifyFails: Filter decided node-a by counting; by the time
// Reserve verifies with upstream, the chosen device and every other one is
// in use, so Reserve must reject the node without marking anything in
// flight.
func TestReserveVerifyFails(t *testing.T) {
	nodes := []*v1.Node{testNode("node-a")}
	h := newHarness(t, nodes, testDeviceClass(), testSlice("node-a", 2), allocatedOn(testClaim("taken", 1), "node-a", "gpu-0"), testClaim("c", 1))
	pod := testPod("p", "c")
	first, st := h.cycle(pod, "node-a")
	if !st["node-a"].IsSuccess() {
		t.Fatalf("Filter: %v", st["node-a"])
	}
	s1, _ := getState(first)
	res := s1.getResult("node-a")
	if !res.Unverified {
		t.Fatal("Filter verified the 1-GPU claim with upstream already; this test needs a counted result")
	}

	// Another writer takes gpu-1; a cycle state whose allocator sees that
	// gets the counted result of the first Filter.
	h.create(allocatedOn(testClaim("late", 1), "node-a", "gpu-1"))
	h.waitForClaim("late", func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation != nil })
	second, _ := h.cycle(pod)
	s2, _ := getState(second)
	s2.setResult("node-a", res, false)

	st2 := h.pl.Reserve(h.tCtx, second, pod, "node-a")
	if code(st2) != fwk.Error || !strings.Contains(st2.Message(), "not confirmed by the upstream allocator") {
		t.Errorf("Reserve: %v, want an error (retried after backoff) saying upstream did not confirm the counted allocation", st2)
	}
	claim, _ := h.pl.draManager.ResourceClaims().Get(testNS, "c")
	if h.pl.draManager.ResourceClaims().GetPendingAllocation(claim.UID) != nil {
		t.Error("a rejected Reserve left an in-flight allocation")
	}
	// The next attempt on node-a asks upstream directly.
	if !h.pl.countingSkipped("node-a") {
		t.Fatal("node-a is still decided by counting")
	}
	// Once gpu-1 is free again, node-a is decided by upstream (a verified
	// result), not by counting.
	h.tCtx.ExpectNoError(h.client.ResourceV1().ResourceClaims(testNS).Delete(h.tCtx, "late", metav1.DeleteOptions{}))
	h.waitForClaimGone("late")
	third, st3 := h.cycle(pod, "node-a")
	if !st3["node-a"].IsSuccess() {
		t.Fatalf("Filter after the mismatch: %v", st3["node-a"])
	}
	if s3, _ := getState(third); s3.getResult("node-a").Unverified {
		t.Error("Filter still decided node-a by counting after upstream refused a counted allocation there")
	}
}

// TestReserveVerifyCancelled: a verification that stops because the
// scheduler cancelled it is an error (the pod is retried after backoff),
// never "0/1 nodes are available".
func TestReserveVerifyCancelled(t *testing.T) {
	nodes := []*v1.Node{testNode("node-a")}
	h := newHarness(t, nodes, testDeviceClass(), testSlice("node-a", 2), testClaim("c", 1))
	pod := testPod("p", "c")
	cs, st := h.cycle(pod, "node-a")
	if !st["node-a"].IsSuccess() {
		t.Fatalf("Filter: %v", st["node-a"])
	}
	if s, _ := getState(cs); !s.getResult("node-a").Unverified {
		t.Fatal("Filter verified the 1-GPU claim with upstream already; this test needs a counted result")
	}
	ctx, cancel := context.WithCancelCause(h.tCtx)
	cancel(errors.New("scheduler stopping"))
	if st := h.pl.Reserve(ctx, cs, pod, "node-a"); code(st) != fwk.Error {
		t.Errorf("Reserve with the context cancelled: %v, want Error", st)
	}
	claim, _ := h.pl.draManager.ResourceClaims().Get(testNS, "c")
	if h.pl.draManager.ResourceClaims().GetPendingAllocation(claim.UID) != nil {
		t.Error("a failed Reserve left an in-flight allocation")
	}
}

// TestUnreserveRestores: Unreserve drops the in-flight allocation after
// Reserve, and after PreBind also removes the pod from reservedFor.
func TestUnreserveRestores(t *testing.T) {
	nodes := []*v1.Node{testNode("node-a")}
	for _, afterPreBind := range []bool{false, true} {
		name := "after Reserve"
		if afterPreBind {
			name = "after PreBind"
		}
		t.Run(name, func(t *testing.T) {
			h := newHarness(t, nodes, testDeviceClass(), testSlice("node-a", 2), testClaim("c", 1))
			pod := testPod("p", "c")
			cs := h.reserve(pod, "node-a")
			claims := h.pl.draManager.ResourceClaims()
			uid := h.apiClaim("c").UID
			if claims.GetPendingAllocation(uid) == nil {
				t.Fatal("Reserve recorded no in-flight allocation")
			}
			if afterPreBind {
				if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); !st.IsSuccess() {
					t.Fatalf("PreBind: %v", st)
				}
				if c := h.apiClaim("c"); c.Status.Allocation == nil || len(c.Status.ReservedFor) != 1 {
					t.Fatalf("PreBind wrote allocation %v, reservedFor %v", c.Status.Allocation, c.Status.ReservedFor)
				}
			}
			h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
			if claims.GetPendingAllocation(uid) != nil {
				t.Error("Unreserve left the in-flight allocation")
			}
			c := h.apiClaim("c")
			if len(c.Status.ReservedFor) != 0 {
				t.Errorf("Unreserve left reservedFor %v", c.Status.ReservedFor)
			}
			if !afterPreBind {
				state, err := h.pl.gatherAllocatedState(h.tCtx)
				h.tCtx.ExpectNoError(err)
				if n := state.AllocatedDevices.Len(); n != 0 {
					t.Errorf("after Unreserve %d devices still count as allocated", n)
				}
			}
			// Idempotent.
			h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
		})
	}
}

// conflictOnce makes the first status update of claim name fail with a
// conflict; before that it runs meanwhile (another writer), if not nil.
func conflictOnce(h *harness, name string, meanwhile func()) *atomic.Int32 {
	var hits atomic.Int32
	h.client.PrependReactor("update", "resourceclaims", func(action cgotesting.Action) (bool, runtime.Object, error) {
		u := action.(cgotesting.UpdateAction)
		if u.GetSubresource() != "status" || u.GetObject().(*resourceapi.ResourceClaim).Name != name || hits.Add(1) > 1 {
			return false, nil, nil
		}
		if meanwhile != nil {
			meanwhile()
		}
		return true, nil, apierrors.NewConflict(schema.GroupResource{Group: "resource.k8s.io", Resource: "resourceclaims"}, name, nil)
	})
	return &hits
}

func TestPreBindConflict(t *testing.T) {
	nodes := []*v1.Node{testNode("node-a")}
	t.Run("retried on the latest claim", func(t *testing.T) {
		h := newHarness(t, nodes, testDeviceClass(), testSlice("node-a", 2), testClaim("c", 1))
		pod := testPod("p", "c")
		cs, _ := h.cycle(pod, "node-a")
		if st := h.pl.Reserve(h.tCtx, cs, pod, "node-a"); !st.IsSuccess() {
			t.Fatalf("Reserve: %v", st)
		}
		hits := conflictOnce(h, "c", nil)
		if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); !st.IsSuccess() {
			t.Fatalf("PreBind: %v", st)
		}
		if hits.Load() < 2 {
			t.Errorf("status written %d times, want a conflict and a retry", hits.Load())
		}
		c := h.apiClaim("c")
		if c.Status.Allocation == nil || len(c.Status.ReservedFor) != 1 || c.Status.ReservedFor[0].UID != pod.UID {
			t.Errorf("after the retry: allocation %v, reservedFor %v", c.Status.Allocation, c.Status.ReservedFor)
		}
	})
	t.Run("allocated by another writer meanwhile", func(t *testing.T) {
		h := newHarness(t, nodes, testDeviceClass(), testSlice("node-a", 2), testClaim("c", 1))
		pod := testPod("p", "c")
		cs, _ := h.cycle(pod, "node-a")
		if st := h.pl.Reserve(h.tCtx, cs, pod, "node-a"); !st.IsSuccess() {
			t.Fatalf("Reserve: %v", st)
		}
		conflictOnce(h, "c", func() {
			// Reactors run under the fake client's lock: use the tracker.
			gvr := resourceapi.SchemeGroupVersion.WithResource("resourceclaims")
			obj, err := h.client.Tracker().Get(gvr, testNS, "c")
			if err != nil {
				t.Errorf("other writer: %v", err)
				return
			}
			other := allocatedOn(obj.(*resourceapi.ResourceClaim).DeepCopy(), "node-a", "gpu-1")
			if err := h.client.Tracker().Update(gvr, other, testNS); err != nil {
				t.Errorf("other writer: %v", err)
			}
		})
		st := h.pl.PreBind(h.tCtx, cs, pod, "node-a")
		if st.IsSuccess() || !strings.Contains(st.Message(), "allocated by someone else") {
			t.Errorf("PreBind: %v, want an error saying the claim was allocated by someone else", st)
		}
		if c := h.apiClaim("c"); len(c.Status.ReservedFor) != 0 || devicesOf(*c.Status.Allocation)[0] != "gpu-1" {
			t.Errorf("PreBind overwrote the other writer's allocation: %v, reservedFor %v", c.Status.Allocation, c.Status.ReservedFor)
		}
	})
}

func TestPostFilterDeallocates(t *testing.T) {
	nodes := []*v1.Node{testNode("node-a")}
	tests := map[string]struct {
		reservedFor  []resourceapi.ResourceClaimConsumerReference
		shared       bool
		wantDealloc  bool
		wantMsgMatch string
	}{
		"unused allocation no node can use": {wantDealloc: true, wantMsgMatch: "deallocated resource claim c"},
		"in use by another pod":             {reservedFor: []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: "other", UID: "other"}}},
		// Filter marks every claim the node cannot use, not only the
		// first: the shared claim before it stays, this one goes.
		"after a claim in use by another pod": {shared: true, wantDealloc: true, wantMsgMatch: "deallocated resource claim c"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			claim := allocatedOn(testClaim("c", 1), "node-gone", "gpu-0")
			claim.Status.ReservedFor = tc.reservedFor
			objs := []runtime.Object{testDeviceClass(), claim}
			pod := testPod("p", "c")
			if tc.shared {
				shared := allocatedOn(testClaim("shared", 1), "node-gone", "gpu-1")
				shared.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: "other", UID: "other"}}
				objs = append(objs, shared)
				pod = testPod("p", "shared", "c")
			}
			h := newHarness(t, nodes, objs...)
			cs, st := h.cycle(pod, "node-a")
			if code(st["node-a"]) != fwk.UnschedulableAndUnresolvable {
				t.Fatalf("Filter: %v", st["node-a"])
			}
			_, pst := h.pl.PostFilter(h.tCtx, cs, pod, nil)
			if code(pst) != fwk.Unschedulable || !strings.Contains(pst.Message(), tc.wantMsgMatch) {
				t.Errorf("PostFilter: %v, want Unschedulable with %q", pst, tc.wantMsgMatch)
			}
			if got := h.apiClaim("c").Status.Allocation == nil; got != tc.wantDealloc {
				t.Errorf("deallocated: %v, want %v", got, tc.wantDealloc)
			}
		})
	}
}

func TestSignPod(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass())
	if frags, st := h.pl.SignPod(h.tCtx, testPod("plain")); !st.IsSuccess() || len(frags) != 0 {
		t.Errorf("pod without claims: fragments %v, status %v; want signed with no fragment", frags, st)
	}
	if _, st := h.pl.SignPod(h.tCtx, testPod("p", "c")); code(st) != fwk.Unschedulable {
		t.Errorf("pod with a claim: %v, want Unschedulable (not signable)", st)
	}
}

// TestScorePrefersFirstChoice: with a prioritized list, the node where the
// pod gets its first choice scores higher than one that only offers the
// second, whatever the topology, as the stock plugin scores.
func TestScorePrefersFirstChoice(t *testing.T) {
	model := func(node, value string) *resourceapi.ResourceSlice {
		s := testSlice(node, 2)
		for i := range s.Spec.Devices {
			s.Spec.Devices[i].Attributes["model"] = resourceapi.DeviceAttribute{StringValue: &value}
		}
		return s
	}
	claim := testClaim("c", 1)
	claim.Spec.Devices.Requests = []resourceapi.DeviceRequest{{
		Name: "gpu",
		FirstAvailable: []resourceapi.DeviceSubRequest{
			{Name: "h100", DeviceClassName: testClass, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
				Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: `device.attributes["gpu.topodra.io"].model == "h100"`}}}},
			{Name: "any", DeviceClassName: testClass, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
		},
	}}
	nodes := []*v1.Node{testNode("node-a"), testNode("node-b")}
	h := newHarness(t, nodes, testDeviceClass(), model("node-a", "a100"), model("node-b", "h100"), claim)
	pod := testPod("p", "c")
	cs, st := h.cycle(pod, "node-a", "node-b")
	for n, s := range st {
		if !s.IsSuccess() {
			t.Fatalf("Filter(%s): %v", n, s)
		}
	}
	if st := h.pl.PreScore(h.tCtx, cs, pod, []fwk.NodeInfo{h.nodes["node-a"], h.nodes["node-b"]}); !st.IsSuccess() {
		t.Fatalf("PreScore: %v", st)
	}
	scoreA, _ := h.pl.Score(h.tCtx, cs, pod, h.nodes["node-a"])
	scoreB, _ := h.pl.Score(h.tCtx, cs, pod, h.nodes["node-b"])
	if scoreB <= scoreA {
		t.Errorf("first choice on node-b scores %d, second choice on node-a %d: want node-b higher", scoreB, scoreA)
	}
	if scoreA < 0 || scoreB > fwk.MaxNodeScore {
		t.Errorf("scores %d, %d outside 0..%d", scoreA, scoreB, fwk.MaxNodeScore)
	}
}

// TestLaterSubrequestsSelectorNeedNotCompile: as upstream compiles a
// selector only when its search gets to it, a claim whose later
// subrequest has a selector that does not compile (a CEL function newer
// than the scheduler, say) is allocated by its first subrequest where that
// fits; where it does not, the pod is unschedulable with a message and a
// warning on the claim that name the expression.
func TestLaterSubrequestsSelectorNeedNotCompile(t *testing.T) {
	const broken = `device.attributes["gpu.topodra.io"].model.newerFunction()`
	claim := func(firstCount int64) *resourceapi.ResourceClaim {
		c := testClaim("c", 1)
		c.Spec.Devices.Requests = []resourceapi.DeviceRequest{{
			Name: "gpu",
			FirstAvailable: []resourceapi.DeviceSubRequest{
				{Name: "two", DeviceClassName: testClass, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: firstCount},
				{Name: "newer", DeviceClassName: testClass, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
					Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: broken}}}},
			},
		}}
		return c
	}
	t.Run("first fits", func(t *testing.T) {
		h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 2), claim(2))
		pod := h.createSeen(testPod("p", "c"))
		cs := h.reserve(pod, "node-a")
		if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); !st.IsSuccess() {
			t.Fatalf("PreBind: %v", st)
		}
		c, err := h.client.ResourceV1().ResourceClaims(testNS).Get(h.tCtx, "c", metav1.GetOptions{})
		h.tCtx.ExpectNoError(err)
		if got := c.Status.Allocation; got == nil || len(got.Devices.Results) != 2 || got.Devices.Results[0].Request != "gpu/two" {
			t.Errorf("allocation %+v, want two devices for gpu/two", got)
		}
	})
	t.Run("first does not fit", func(t *testing.T) {
		h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 2), claim(4))
		_, st := h.cycle(testPod("p", "c"), "node-a")
		if st["node-a"].IsSuccess() || !strings.Contains(st["node-a"].Message(), broken) {
			t.Errorf("Filter: %v, want a failure that names %s", st["node-a"], broken)
		}
		select {
		case e := <-h.recorder.Events:
			if !strings.Contains(e, "Warning") || !strings.Contains(e, broken) {
				t.Errorf("event %q, want a warning naming the selector", e)
			}
		default:
			t.Error("no event on the claim")
		}
	})
}

// TestPreEnqueueTellsWhy: a pod held out of the queue for a claim it
// names that does not exist gets a warning event saying so (no
// scheduling attempt runs, so nothing else would); a pod whose template
// claim the controller has not created yet waits silently.
func TestPreEnqueueTellsWhy(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass())
	if st := h.pl.PreEnqueue(h.tCtx, testPod("p", "absent")); code(st) != fwk.Unschedulable {
		t.Fatalf("PreEnqueue: %v, want Unschedulable", st)
	}
	select {
	case e := <-h.recorder.Events:
		if !strings.Contains(e, "Warning FailedScheduling") || !strings.Contains(e, "waiting for resource claim ns/absent") {
			t.Errorf("event %q, want a FailedScheduling warning naming the claim", e)
		}
	default:
		t.Error("no event on the pod")
	}
	fromTemplate := testPod("q")
	fromTemplate.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To("tmpl")}}
	fromTemplate.Status.ResourceClaimStatuses = []v1.PodResourceClaimStatus{{Name: "gpu", ResourceClaimName: ptr.To("q-gpu-x1")}}
	if st := h.pl.PreEnqueue(h.tCtx, fromTemplate); code(st) != fwk.Unschedulable {
		t.Fatalf("PreEnqueue of a pod whose claim is being created: %v, want Unschedulable", st)
	}
	select {
	case e := <-h.recorder.Events:
		t.Errorf("event %q for a claim the controller is creating", e)
	default:
	}
}

// TestPreEnqueueEventNotHiddenByEarlierFailure: events of one object,
// type, reason and action form one series that keeps its first note. A
// pod that failed an attempt and now waits for a claim it names gets the
// claim's note in an event of its own, through a real event broadcaster,
// not only a count raised on the earlier failure.
func TestPreEnqueueEventNotHiddenByEarlierFailure(t *testing.T) {
	h := newHarnessWith(t, func(h *harness) {
		broadcaster := events.NewBroadcaster(&events.EventSinkImpl{Interface: h.client.EventsV1()})
		if err := broadcaster.StartRecordingToSinkWithContext(h.tCtx); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(broadcaster.Shutdown)
		h.eventRecorder = broadcaster.NewRecorder(scheme.Scheme, "topodra-scheduler")
	}, []*v1.Node{testNode("node-a")}, testDeviceClass())
	pod := testPod("p", "absent")
	notes := func() []string {
		list, err := h.client.EventsV1().Events(testNS).List(h.tCtx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, e := range list.Items {
			out = append(out, e.Note)
		}
		return out
	}
	// The scheduler's own event for the pod's earlier attempt.
	h.pl.handle.EventRecorder().Eventf(pod, nil, v1.EventTypeWarning, "FailedScheduling", "Scheduling", "0/1 nodes are available: 1 node(s) cannot allocate claim")
	if err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return len(notes()) == 1, nil
	}); err != nil {
		t.Fatalf("the scheduler's event was never written: %v", notes())
	}
	if st := h.pl.PreEnqueue(h.tCtx, pod); code(st) != fwk.Unschedulable {
		t.Fatalf("PreEnqueue: %v, want Unschedulable", st)
	}
	if err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return slices.ContainsFunc(notes(), func(n string) bool { return strings.Contains(n, "waiting for resource claim ns/absent") }), nil
	}); err != nil {
		t.Errorf("no event says the pod waits for its claim: notes %q", notes())
	}
}

// TestUnownedDevicesCounted: with the owned taint key set (the default),
// PreBind counts the devices it wrote to claims that carry no owned
// taint, per driver, and not those that do; Reserve counts nothing.
func TestUnownedDevicesCounted(t *testing.T) {
	owned := testSlice("node-owned", 2)
	for i := range owned.Spec.Devices {
		owned.Spec.Devices[i].Taints = []resourceapi.DeviceTaint{{Key: topology.DefaultTaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	}
	h := newHarness(t, []*v1.Node{testNode("node-owned"), testNode("node-free")}, testDeviceClass(), owned, testSlice("node-free", 2), testClaim("a", 1), testClaim("b", 1))
	if h.pl.ownedToleration == nil || h.pl.ownedToleration.Key != topology.DefaultTaintKey {
		t.Fatalf("owned toleration %v, want the default key %s", h.pl.ownedToleration, topology.DefaultTaintKey)
	}
	count := func() float64 {
		v, err := testutil.GetCounterMetricValue(unownedAllocations.WithLabelValues(topology.DriverName))
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	before := count()
	for _, tc := range []struct{ claim, node string }{{"a", "node-owned"}, {"b", "node-free"}} {
		pod := testPod("p-"+tc.claim, tc.claim)
		cs, st := h.cycle(pod, tc.node)
		if !st[tc.node].IsSuccess() {
			t.Fatalf("Filter(%s): %v", tc.node, st[tc.node])
		}
		if st := h.pl.Reserve(h.tCtx, cs, pod, tc.node); !st.IsSuccess() {
			t.Fatalf("Reserve on %s: %v", tc.node, st)
		}
		if got := count(); got != before {
			t.Errorf("counted at Reserve: %v, want %v until PreBind writes the claim", got, before)
		}
		if st := h.pl.PreBind(h.tCtx, cs, pod, tc.node); !st.IsSuccess() {
			t.Fatalf("PreBind on %s: %v", tc.node, st)
		}
	}
	if got := count(); got != before+1 {
		t.Errorf("topodra_unowned_devices_allocated_total went from %v to %v after one owned and one unowned device, want +1", before, got)
	}
}

// TestUnschedulableMessageCountsNodes: the pod's condition, which the
// framework builds from Filter's statuses by counting the nodes that fail
// alike, reads as a number of nodes and the reason for each group.
func TestUnschedulableMessageCountsNodes(t *testing.T) {
	nodes := []*v1.Node{testNode("node-a"), testNode("node-b"), testNode("node-c")}
	h := newHarness(t, nodes, testDeviceClass(), testSlice("node-a", 1), testSlice("node-b", 1), testSlice("node-c", 3), testClaim("c", 4))
	pod := testPod("p", "c")
	_, st := h.cycle(pod, "node-a", "node-b", "node-c")
	diagnosis := framework.Diagnosis{NodeToStatus: framework.NewDefaultNodeToStatus()}
	for node, s := range st {
		if s.IsSuccess() {
			t.Fatalf("Filter(%s) passed a 4-GPU claim", node)
		}
		diagnosis.NodeToStatus.Set(node, s)
	}
	got := (&framework.FitError{Pod: pod, NumAllNodes: 3, Diagnosis: diagnosis}).Error()
	for _, want := range []string{"0/3 nodes are available: 1 node(s) cannot allocate claim c request ", "2 node(s) cannot allocate claim c request "} {
		if !strings.Contains(got, want) {
			t.Errorf("pod's message %q does not contain %q", got, want)
		}
	}
}
