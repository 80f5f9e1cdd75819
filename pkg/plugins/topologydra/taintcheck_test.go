package topologydra

import (
	"context"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/topodra/topodra/pkg/topology"
)

// TestPreBindRefusesDeviceTaintedSinceChosen: a device gets a NoSchedule
// taint (a GPU's health taint) between the cycle that chose it and
// PreBind. PreBind writes nothing and fails, so the pod is scheduled
// again and gets another device; a taint on a device not chosen, or one
// the claim tolerates, changes nothing.
func TestPreBindRefusesDeviceTaintedSinceChosen(t *testing.T) {
	const node, key = "node-a", healthKey
	tolerating := testClaim("tolerating", 1)
	tolerating.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{Key: key, Operator: resourceapi.DeviceTolerationOpExists}}
	// The devices carry the owned taint, as the agent publishes them: the
	// results' tolerations must hold the owned toleration, or PreBind
	// would refuse every allocation.
	h := newHarness(t, []*v1.Node{testNode(node)}, testDeviceClass(), ownedSlice(node, 8), testClaim("one", 1), testClaim("two", 1), tolerating)
	for _, c := range []string{"one", "two", "tolerating"} {
		h.waitForClaim(c, func(*resourceapi.ResourceClaim) bool { return true })
	}
	chosen := func(cs fwk.CycleState) string { return chosenDevice(t, cs) }
	taint := func(device string) { h.taintDevice(node, device, key) }
	other := func(device string) string {
		if device == "gpu-0" {
			return "gpu-1"
		}
		return "gpu-0"
	}

	first := testPod("first", "one")
	cs := h.reserve(first, node)
	firstDevice := chosen(cs)
	taint(other(firstDevice))
	if st := h.pl.PreBind(h.tCtx, cs, first, node); !st.IsSuccess() {
		t.Fatalf("PreBind after a device not chosen was tainted: %v", st)
	}

	second := testPod("second", "two")
	cs = h.reserve(second, node)
	device := chosen(cs)
	taint(device)
	st := h.pl.PreBind(h.tCtx, cs, second, node)
	if st.IsSuccess() || !strings.Contains(st.Message(), device) || !strings.Contains(st.Message(), key+"=xid-79:NoSchedule") {
		t.Fatalf("PreBind after the chosen device %s was tainted: %v; want a failure naming the device and the taint", device, st)
	}
	if c := h.apiClaim("two"); c.Status.Allocation != nil || len(c.Status.ReservedFor) != 0 {
		t.Fatalf("claim two written although its device was tainted: %+v", c.Status)
	}
	h.pl.Unreserve(h.tCtx, cs, second, node)
	cs = h.reserve(second, node)
	if again := chosen(cs); again == device {
		t.Fatalf("the next attempt chose the tainted device %s again", device)
	}
	if st := h.pl.PreBind(h.tCtx, cs, second, node); !st.IsSuccess() {
		t.Fatalf("PreBind of the next attempt: %v", st)
	}

	// A taint the claim tolerates.
	third := testPod("third", "tolerating")
	cs = h.reserve(third, node)
	taint(chosen(cs))
	if st := h.pl.PreBind(h.tCtx, cs, third, node); !st.IsSuccess() {
		t.Fatalf("PreBind after the chosen device got a taint the claim tolerates: %v", st)
	}
}

// healthKey is the health taint's key, as the node agent publishes it.
const healthKey = "gpu.topodra.io/unhealthy"

// ownedSlice is testSlice with the owned taint on every device, as the
// node agent publishes them.
func ownedSlice(node string, n int) *resourceapi.ResourceSlice {
	slice := testSlice(node, n)
	for i := range slice.Spec.Devices {
		slice.Spec.Devices[i].Taints = []resourceapi.DeviceTaint{{Key: topology.DefaultTaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	}
	return slice
}

// chosenDevice returns the one device of the one allocation a cycle chose.
func chosenDevice(t *testing.T, cs fwk.CycleState) string {
	t.Helper()
	s, err := getState(cs)
	if err != nil || len(s.allocations) != 1 || s.allocations[0] == nil || len(s.allocations[0].Devices.Results) != 1 {
		t.Fatalf("cycle state %v, %v: want one allocation of one device", s, err)
	}
	return s.allocations[0].Devices.Results[0].Device
}

// taintDevice gives device of node's slice (testSlice) the NoSchedule
// taint key=xid-79 in the API and waits until the plugin's slices show it.
func (h *harness) taintDevice(node, device, key string) {
	h.tCtx.Helper()
	slice, err := h.client.ResourceV1().ResourceSlices().Get(h.tCtx, node+"-gpus", metav1.GetOptions{})
	h.tCtx.ExpectNoError(err, "get slice")
	for i := range slice.Spec.Devices {
		if slice.Spec.Devices[i].Name == device {
			slice.Spec.Devices[i].Taints = append(slice.Spec.Devices[i].Taints, resourceapi.DeviceTaint{Key: key, Value: "xid-79", Effect: resourceapi.DeviceTaintEffectNoSchedule})
		}
	}
	_, err = h.client.ResourceV1().ResourceSlices().Update(h.tCtx, slice, metav1.UpdateOptions{})
	h.tCtx.ExpectNoError(err, "taint "+device)
	err = wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		listed, err := h.pl.draManager.ResourceSlices().ListWithDeviceTaintRules()
		if err != nil {
			return false, nil
		}
		for _, s := range listed {
			for _, d := range s.Spec.Devices {
				for _, taint := range d.Taints {
					if d.Name == device && taint.Key == key {
						return true, nil
					}
				}
			}
		}
		return false, nil
	})
	h.tCtx.ExpectNoError(err, "the slice tracker never showed the taint of "+device)
}

// TestAllocationTaintedBeforeBind: a pod's claim was allocated and
// reserved for it (PreBind wrote it) but the pod was not bound (its
// binding failed), and the device got a health taint meanwhile. The
// pod's next attempt finds the claim unusable on every node and
// PostFilter deallocates it, so that the attempt after allocates a
// healthy device. A claim that a bound pod has reserved is left alone,
// and so is an allocation by another writer whose results do not
// tolerate the owned taint, which every device carries. A claim that an
// unbound pod has reserved is unusable, but stays allocated until that
// pod's reservation is gone.
func TestAllocationTaintedBeforeBind(t *testing.T) {
	const node = "node-a"
	h := newHarness(t, []*v1.Node{testNode(node)}, testDeviceClass(), ownedSlice(node, 8), testClaim("solo", 1), testClaim("shared", 1),
		testClaim("pair", 1), allocatedOn(testClaim("elsewhere", 1), node, "gpu-7"))
	for _, c := range []string{"solo", "shared", "pair", "elsewhere"} {
		h.waitForClaim(c, func(*resourceapi.ResourceClaim) bool { return true })
	}
	written := func(claim string, pod *v1.Pod) string {
		t.Helper()
		cs := h.reserve(pod, node)
		device := chosenDevice(t, cs)
		if st := h.pl.PreBind(h.tCtx, cs, pod, node); !st.IsSuccess() {
			t.Fatalf("PreBind of %s: %v", pod.Name, st)
		}
		h.waitForClaim(claim, func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation != nil })
		return device
	}

	// Allocated by another writer, without the owned toleration.
	if _, st := h.cycle(testPod("elsewhere", "elsewhere"), node); !st[node].IsSuccess() {
		t.Fatalf("Filter of a pod whose claim another writer allocated on an owned device: %v; want the allocation used", st[node])
	}

	solo := testPod("solo", "solo")
	device := written("solo", solo)
	if _, st := h.cycle(solo, node); !st[node].IsSuccess() {
		t.Fatalf("Filter of the pod whose claim is allocated on a healthy device: %v", st[node])
	}
	h.taintDevice(node, device, healthKey)
	cs, st := h.cycle(solo, node)
	if st[node].IsSuccess() || !strings.Contains(st[node].Message(), device) || !strings.Contains(st[node].Message(), healthKey) {
		t.Fatalf("Filter after the allocated device %s was tainted: %v; want the node turned down naming the device and the taint", device, st[node])
	}
	if _, pst := h.pl.PostFilter(h.tCtx, cs, solo, nil); !strings.Contains(pst.Message(), "deallocated") {
		t.Fatalf("PostFilter: %v; want the claim deallocated", pst)
	}
	if c := h.apiClaim("solo"); c.Status.Allocation != nil {
		t.Fatalf("claim solo still allocated %v", c.Status.Allocation.Devices.Results)
	}
	h.waitForClaim("solo", func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation == nil })
	if again := chosenDevice(t, h.reserve(solo, node)); again == device {
		t.Errorf("the next attempt chose the tainted device %s again", device)
	}

	// Shared: the claim is reserved for a pod placed before, bound.
	first := h.createSeen(testPod("first", "shared"))
	device = written("shared", first)
	first.Spec.NodeName = node
	_, err := h.client.CoreV1().Pods(testNS).Update(h.tCtx, first, metav1.UpdateOptions{})
	h.tCtx.ExpectNoError(err, "bind pod first")
	err = wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		p, err := h.pl.pods.Pods(testNS).Get("first")
		return err == nil && p.Spec.NodeName == node, nil
	})
	h.tCtx.ExpectNoError(err, "the pod lister never saw pod first bound")
	h.taintDevice(node, device, healthKey)
	if _, st := h.cycle(testPod("second", "shared"), node); !st[node].IsSuccess() {
		t.Errorf("Filter of a pod sharing a claim that a bound pod has reserved, its device tainted since: %v; want the claim left as it is", st[node])
	}

	// Shared with a pod that is not bound either (both waited for the
	// claim's binding conditions, say): the claim is unusable, and
	// PostFilter leaves it until that pod's reservation is gone.
	waiting := h.createSeen(testPod("waiting", "pair"))
	device = written("pair", waiting)
	h.taintDevice(node, device, healthKey)
	partner := testPod("partner", "pair")
	cs, st = h.cycle(partner, node)
	if st[node].IsSuccess() || !strings.Contains(st[node].Message(), device) {
		t.Fatalf("Filter of a pod sharing a claim that an unbound pod has reserved, its device tainted since: %v; want the node turned down naming the device", st[node])
	}
	if _, pst := h.pl.PostFilter(h.tCtx, cs, partner, nil); strings.Contains(pst.Message(), "deallocated") {
		t.Fatalf("PostFilter deallocated a claim reserved for another pod: %v", pst)
	}
	if c := h.apiClaim("pair"); c.Status.Allocation == nil {
		t.Fatalf("claim pair deallocated while reserved for pod waiting")
	}
}
