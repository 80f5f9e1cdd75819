package topologydra

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/component-base/metrics/testutil"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

func TestHeadroomFor(t *testing.T) {
	for _, tc := range []struct {
		percent        int32
		total, n, want int
	}{
		{12, 64, 8, 8},   // 7.68 rounded up: one node's worth on 8 nodes
		{12, 64, 16, 8},  // two claims of 8
		{12, 64, 4, 2},   // half a node: a quarter
		{12, 64, 7, 2},   // still half a node's class
		{12, 64, 3, 0},   // smaller pods keep none
		{12, 64, 1, 0},   //
		{12, 128, 8, 16}, // 15.36
		{12, 128, 4, 4},  //
		{12, 56, 8, 0},   // 6.72: less than a whole node, off
		{12, 56, 4, 0},   // and for half-node pods too
		{12, 16, 8, 0},   // two nodes: never held back
		{0, 1000, 8, 0},
		{50, 16, 8, 8},
		{50, 16, 4, 2},
	} {
		if got := HeadroomFor(tc.percent, tc.total, tc.n, 8); got != tc.want {
			t.Errorf("HeadroomFor(%d, %d, %d, 8) = %d, want %d", tc.percent, tc.total, tc.n, got, tc.want)
		}
	}
	// Nodes of four: 12 % of 64 GPUs (16 nodes) is 8, kept from pods of
	// 4 or more, a quarter of it from pods of 2 or 3; 12 % of 32 (8
	// nodes) is 4, a whole node, still kept.
	for _, tc := range []struct {
		percent        int32
		total, n, want int
	}{
		{12, 64, 4, 8},
		{12, 64, 2, 2},
		{12, 64, 1, 0},
		{12, 32, 4, 4},
		{12, 24, 4, 0}, // 2.88: less than a node of four
	} {
		if got := HeadroomFor(tc.percent, tc.total, tc.n, 4); got != tc.want {
			t.Errorf("HeadroomFor(%d, %d, %d, 4) = %d, want %d", tc.percent, tc.total, tc.n, got, tc.want)
		}
	}
	// Nodes of three: half a node is two (rounded up), so a 1-GPU pod
	// keeps none; 12 % of 300 is 36.
	for _, tc := range []struct{ n, want int }{{3, 36}, {2, 9}, {1, 0}} {
		if got := HeadroomFor(12, 300, tc.n, 3); got != tc.want {
			t.Errorf("HeadroomFor(12, 300, %d, 3) = %d, want %d", tc.n, got, tc.want)
		}
	}
}

// TestFilterKeepsHeadroom: on eight nodes of eight GPUs (headroom 8 of 64
// at 12 %, 2 for pods of 4 to 7 GPUs), an 8-GPU pod may not take the
// empty node while only 7 other GPUs are free; with 8 free it may; a
// 1-GPU pod is never held back; a pod pinned to one node keeps no
// headroom there; 0 switches it off. A 4-GPU pod may not leave fewer
// than 2 free, a 2-GPU pod may. Single GPUs free on a node do not count:
// 8 free besides the empty node, one of them alone on its node, hold the
// 8-GPU pod back, and a 4-GPU pod may not leave two single GPUs on two
// nodes (nor one on its own node and one on another), while it may leave
// two on one node.
func TestFilterKeepsHeadroom(t *testing.T) {
	var nodes []*v1.Node
	var names []string
	for i := range 8 {
		name := fmt.Sprintf("node-%d", i)
		names = append(names, name)
		nodes = append(nodes, testNode(name))
	}
	// setup frees free[i] GPUs on node-i, none on the others.
	setup := func(free ...int) *harness {
		objs := []runtime.Object{testDeviceClass(), testClaim("eight", 8), testClaim("four", 4), testClaim("two", 2), testClaim("one", 1)}
		for i, n := range names {
			objs = append(objs, testSlice(n, 8))
			held := 8
			if i < len(free) {
				held = 8 - free[i]
			}
			if held > 0 {
				objs = append(objs, allocatedOn(testClaim("held-"+n, int64(held)), n, gpuNames(0, held)...))
			}
		}
		h := newHarness(t, nodes, objs...)
		h.pl.headroomPercent = 12
		return h
	}

	h := setup(8, 7)
	_, st := h.cycle(testPod("p", "eight"), names...)
	if code(st["node-0"]) != fwk.UnschedulableAndUnresolvable {
		t.Errorf("7 free besides the empty node: Filter(node-0) = %v, want UnschedulableAndUnresolvable", st["node-0"])
	}
	for _, n := range names[1:] {
		if st[n].IsSuccess() {
			t.Errorf("Filter(%s) succeeded on a node without 8 free GPUs", n)
		}
	}
	if msg := st["node-0"].Message(); !strings.Contains(msg, "keeping 8 of the 64") || !strings.Contains(msg, "15 are free (15 of them on nodes with 2 or more free) and this pod needs 8") {
		t.Errorf("message %q does not say what is kept and why", msg)
	}
	_, st = h.cycle(testPod("small", "one"), names...)
	if !st["node-0"].IsSuccess() || !st["node-1"].IsSuccess() {
		t.Errorf("a 1-GPU pod was held back: %v, %v", st["node-0"], st["node-1"])
	}
	pinned := testPod("pinned", "eight")
	pinned.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": "node-0"}
	anyNode := testPod("any", "eight")
	anyNode.Spec.Affinity = &v1.Affinity{NodeAffinity: &v1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &v1.NodeSelector{
		NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{{Key: "kubernetes.io/hostname", Operator: v1.NodeSelectorOpExists}}}},
	}}}
	if _, st = h.cycle(pinned, "node-0"); !st["node-0"].IsSuccess() {
		t.Errorf("a pod that may use one node only keeps no headroom: %v", st["node-0"])
	}
	h.pl.headroomPercent = 0
	if _, st = h.cycle(testPod("p", "eight"), "node-0"); !st["node-0"].IsSuccess() {
		t.Errorf("headroom off: %v", st["node-0"])
	}

	h = setup(8, 8)
	_, st = h.cycle(testPod("p", "eight"), names...)
	if !st["node-0"].IsSuccess() || !st["node-1"].IsSuccess() {
		t.Errorf("8 free besides the empty node: %v, %v, want both nodes feasible", st["node-0"], st["node-1"])
	}
	// A 4-GPU pod held back on two nodes that it would leave with
	// different counts free: one message, so that the pod's condition
	// counts the two nodes under it.
	h = setup(5, 6)
	h.pl.headroomPercent = 50 // 8 of 64 kept from 4-GPU pods
	before, err := testutil.GetCounterMetricValue(headroomHolds)
	if err != nil {
		t.Fatal(err)
	}
	_, st = h.cycle(testPod("p", "four"), names...)
	if code(st["node-0"]) != fwk.UnschedulableAndUnresolvable || st["node-0"].Message() != st["node-1"].Message() {
		t.Errorf("Filter(node-0) = %v, Filter(node-1) = %v, want both held back with one message", st["node-0"], st["node-1"])
	}
	// One attempt held back on two nodes counts once.
	if after, _ := testutil.GetCounterMetricValue(headroomHolds); after != before+1 {
		t.Errorf("topodra_headroom_holds_total went from %v to %v in one attempt, want +1", before, after)
	}

	h = setup(5, 0)
	_, st = h.cycle(testPod("p", "four"), "node-0")
	if code(st["node-0"]) != fwk.UnschedulableAndUnresolvable {
		t.Errorf("5 free: Filter(node-0) for 4 GPUs = %v, want UnschedulableAndUnresolvable", st["node-0"])
	}
	if msg := st["node-0"].Message(); !strings.Contains(msg, "keeping 2 of the 64") || !strings.Contains(msg, "5 are free (5 of them on nodes with 2 or more free) and this pod needs 4") {
		t.Errorf("message %q does not say what is kept and why", msg)
	}
	if _, st = h.cycle(testPod("p", "two"), "node-0"); !st["node-0"].IsSuccess() {
		t.Errorf("a 2-GPU pod was held back: %v", st["node-0"])
	}
	h = setup(6, 0)
	if _, st = h.cycle(testPod("p", "four"), "node-0"); !st["node-0"].IsSuccess() {
		t.Errorf("6 free: a 4-GPU pod that leaves 2 was held back: %v", st["node-0"])
	}

	h = setup(8, 7, 1)
	_, st = h.cycle(testPod("p", "eight"), "node-0")
	if code(st["node-0"]) != fwk.UnschedulableAndUnresolvable {
		t.Errorf("8 free besides the empty node, one alone on its node: Filter(node-0) = %v, want UnschedulableAndUnresolvable", st["node-0"])
	}
	if msg := st["node-0"].Message(); !strings.Contains(msg, "16 are free (15 of them on nodes with 2 or more free) and this pod needs 8 (that would leave fewer than 8)") {
		t.Errorf("message %q does not say that single free GPUs do not count", msg)
	}
	h = setup(4, 1, 1)
	if _, st = h.cycle(testPod("p", "four"), "node-0"); code(st["node-0"]) != fwk.UnschedulableAndUnresolvable {
		t.Errorf("a 4-GPU pod that leaves two single GPUs on two nodes: Filter(node-0) = %v, want UnschedulableAndUnresolvable", st["node-0"])
	}
	h = setup(4, 2)
	if _, st = h.cycle(testPod("p", "four"), "node-0"); !st["node-0"].IsSuccess() {
		t.Errorf("a 4-GPU pod that leaves two GPUs on one node was held back: %v", st["node-0"])
	}
	h = setup(5, 1)
	if _, st = h.cycle(testPod("p", "four"), "node-0"); code(st["node-0"]) != fwk.UnschedulableAndUnresolvable {
		t.Errorf("a 4-GPU pod that leaves a single GPU on its node and one on another: Filter(node-0) = %v, want UnschedulableAndUnresolvable", st["node-0"])
	}
}

// TestHeadroomQueueingHint: eight nodes of eight GPUs, 10 free (an empty
// node and two GPUs on another), so a waiting 8-GPU pod is kept out by the
// headroom (8 of 64). A claim giving back 1 GPU leaves the cluster short
// of it: no retry. A claim giving back 7 GPUs on a node that then has 7
// free brings the cluster to 17 free: retry, though no node gained room
// for the pod (it fits on the empty one). Without the headroom only the
// node's count decides, and so for a pod pinned to one node (where 8 GPUs
// leave no headroom); a pod whose node affinity admits every node keeps
// the cluster's. With one GPU free on the other node instead of two, the
// 7 GPUs given back bring the cluster to 16 free, but one of them alone
// on its node does not count: no retry.
func TestHeadroomQueueingHint(t *testing.T) {
	// cluster holds heldOnNode1 GPUs of node-1, all of node-2 to node-7.
	cluster := func(heldOnNode1 int) *harness {
		var nodes []*v1.Node
		objs := []runtime.Object{testDeviceClass(), testClaim("eight", 8)}
		for i := range 8 {
			name := fmt.Sprintf("node-%d", i)
			nodes = append(nodes, testNode(name))
			objs = append(objs, testSlice(name, 8))
			switch {
			case i == 1:
				objs = append(objs, allocatedOn(testClaim("held-"+name, int64(heldOnNode1)), name, gpuNames(0, heldOnNode1)...))
			case i > 1:
				objs = append(objs,
					allocatedOn(testClaim("seven-"+name, 7), name, "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6"),
					allocatedOn(testClaim("one-"+name, 1), name, "gpu-7"))
			}
		}
		h := newHarness(t, nodes, objs...)
		h.waitForClaim("eight", func(*resourceapi.ResourceClaim) bool { return true })
		h.waitForClaim("one-node-2", func(*resourceapi.ResourceClaim) bool { return true })
		h.waitForClaim("seven-node-3", func(*resourceapi.ResourceClaim) bool { return true })
		return h
	}
	hint := func(h *harness, pod *v1.Pod, claim string) fwk.QueueingHint { return freeingHint(t, h, pod, claim) }
	h := cluster(6)
	pinned := testPod("pinned", "eight")
	pinned.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": "node-0"}
	anyNode := testPod("any", "eight")
	anyNode.Spec.Affinity = &v1.Affinity{NodeAffinity: &v1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &v1.NodeSelector{
		NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{{Key: "kubernetes.io/hostname", Operator: v1.NodeSelectorOpExists}}}},
	}}}
	for _, tc := range []struct {
		name    string
		percent int32
		claim   string
		pod     *v1.Pod
		want    fwk.QueueingHint
	}{
		{"1 GPU back, cluster still short", 12, "one-node-2", testPod("p", "eight"), fwk.QueueSkip},
		{"7 GPUs back, cluster reaches the headroom", 12, "seven-node-3", testPod("p", "eight"), fwk.Queue},
		{"7 GPUs back, no headroom, no node with 8", 0, "seven-node-3", testPod("p", "eight"), fwk.QueueSkip},
		{"pod pinned to the empty node (no headroom there), 7 GPUs back elsewhere", 12, "seven-node-3", pinned, fwk.QueueSkip},
		{"pod with a node affinity that admits all nodes, 1 GPU back", 12, "one-node-2", anyNode, fwk.QueueSkip},
		{"pod with a node affinity that admits all nodes, 7 GPUs back", 12, "seven-node-3", anyNode, fwk.Queue},
	} {
		h.pl.headroomPercent = tc.percent
		if got := hint(h, tc.pod, tc.claim); got != tc.want {
			t.Errorf("%s: hint %v, want %v", tc.name, got, tc.want)
		}
	}

	h = cluster(7)
	h.pl.headroomPercent = 12
	if got := hint(h, testPod("p", "eight"), "seven-node-3"); got != fwk.QueueSkip {
		t.Errorf("7 GPUs back, 16 free but one alone on its node: hint %v, want %v", got, fwk.QueueSkip)
	}
}

// TestHeadroomHintWithOtherDrivers: a claim that gave back a GPU and a NIC
// brings the GPUs of the cluster up to the headroom a waiting 4-GPU pod
// keeps (8 nodes of 8 GPUs: 2 of 64), while the NICs, too few for any
// headroom of their own, leave its node short of four. The pod is retried
// on every such event, whichever driver the hint looks at first.
func TestHeadroomHintWithOtherDrivers(t *testing.T) {
	const nicDriver = "nic.test.topodra.io"
	var nodes []*v1.Node
	objs := []runtime.Object{testDeviceClass(), testClaim("four", 4)}
	for i := range 8 {
		name := fmt.Sprintf("node-%d", i)
		nodes = append(nodes, testNode(name))
		nics := testSlice(name, 0)
		nics.Name, nics.Spec.Driver = name+"-nics", nicDriver
		for n := range 2 {
			nics.Spec.Devices = append(nics.Spec.Devices, resourceapi.Device{Name: fmt.Sprintf("nic-%d", n)})
		}
		objs = append(objs, testSlice(name, 8), nics)
		switch i {
		case 0: // 4 GPUs free
			objs = append(objs, allocatedOn(testClaim("held-"+name, 4), name, gpuNames(0, 4)...))
		case 1: // gpu-7 free; gpu-6 and nic-0 held by one claim
			gpuNIC := allocatedOn(testClaim("gpu-nic", 1), name, "gpu-6")
			gpuNIC.Status.Allocation.Devices.Results = append(gpuNIC.Status.Allocation.Devices.Results,
				resourceapi.DeviceRequestAllocationResult{Request: "nic", Driver: nicDriver, Pool: name, Device: "nic-0"})
			objs = append(objs, allocatedOn(testClaim("held-"+name, 6), name, gpuNames(0, 6)...), gpuNIC)
		default:
			objs = append(objs, allocatedOn(testClaim("held-"+name, 8), name, gpuNames(0, 8)...))
		}
	}
	h := newHarness(t, nodes, objs...)
	h.pl.headroomPercent = 12
	h.waitForClaim("gpu-nic", func(*resourceapi.ResourceClaim) bool { return true })
	h.waitForClaim("held-node-7", func(*resourceapi.ResourceClaim) bool { return true })

	pod := testPod("p", "four")
	if _, st := h.cycle(pod, "node-0"); code(st["node-0"]) != fwk.UnschedulableAndUnresolvable {
		t.Fatalf("before the event: Filter(node-0) = %v, want the headroom to hold the pod back", st["node-0"])
	}
	old := h.apiClaim("gpu-nic")
	for i := range 20 {
		freed := old.DeepCopy()
		freed.Status.Allocation = nil
		freed.ResourceVersion = fmt.Sprintf("%s-%d", old.ResourceVersion, i)
		prev := old.DeepCopy()
		prev.ResourceVersion = fmt.Sprintf("%s-%d-old", old.ResourceVersion, i)
		got, err := h.pl.isSchedulableAfterClaimChange(klog.Background(), pod, prev, freed)
		if err != nil {
			t.Fatal(err)
		}
		if got != fwk.Queue {
			t.Fatalf("event %d: hint %v, want %v: the GPU given back brings the cluster up to the headroom", i, got, fwk.Queue)
		}
	}
}

// TestHeadroomHintRetriesHeldBackPod: eight nodes of eight GPUs, 4 free on
// node-0 and none elsewhere, so a 4-GPU pod is held back by the headroom
// (2 of 64). Then a claim on node-1 gives 2 GPUs back: the cluster now
// keeps the headroom with the pod on node-0, as the pod's retry would
// find. The next event gives back one GPU on node-2, which neither raises
// the headroom's count nor leaves 4 free there: the pod the headroom held
// back is retried all the same (its retry after the first event may have
// run before the tracker saw it), a pod that was not held back is not,
// and neither is the first pod once an attempt found a node for it.
func TestHeadroomHintRetriesHeldBackPod(t *testing.T) {
	nodes, objs := eightNodes(func(i int, name string) []runtime.Object {
		switch i {
		case 0:
			return []runtime.Object{allocatedOn(testClaim("held-"+name, 4), name, gpuNames(0, 4)...)}
		case 1:
			return []runtime.Object{allocatedOn(testClaim("held-"+name, 6), name, gpuNames(0, 6)...), allocatedOn(testClaim("pair", 2), name, gpuNames(6, 8)...)}
		case 2:
			return []runtime.Object{allocatedOn(testClaim("held-"+name, 7), name, gpuNames(0, 7)...), allocatedOn(testClaim("single", 1), name, "gpu-7")}
		}
		return []runtime.Object{allocatedOn(testClaim("held-"+name, 8), name, gpuNames(0, 8)...)}
	}, testDeviceClass(), testClaim("four", 4))
	h := newHarness(t, nodes, objs...)
	h.pl.headroomPercent = 12
	h.waitForClaim("single", func(*resourceapi.ResourceClaim) bool { return true })
	h.waitForClaim("held-node-7", func(*resourceapi.ResourceClaim) bool { return true })

	pod, other := testPod("p", "four"), testPod("other", "four")
	if _, st := h.cycle(pod, "node-0"); code(st["node-0"]) != fwk.UnschedulableAndUnresolvable {
		t.Fatalf("4 free in all: Filter(node-0) = %v, want the headroom to hold the pod back", st["node-0"])
	}
	pair := h.apiClaim("pair")
	pair.Status.Allocation = nil
	_, err := h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(h.tCtx, pair, metav1.UpdateOptions{})
	h.tCtx.ExpectNoError(err, "give back the pair")
	h.waitForClaim("pair", func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation == nil })

	hint := func(p *v1.Pod) fwk.QueueingHint { return freeingHint(t, h, p, "single") }
	if got := hint(pod); got != fwk.Queue {
		t.Errorf("pod held back by the headroom, headroom kept with it placed: hint %v, want %v", got, fwk.Queue)
	}
	if got := hint(other); got != fwk.QueueSkip {
		t.Errorf("pod never held back, no node with 4 free among those the event touched: hint %v, want %v", got, fwk.QueueSkip)
	}
	if _, st := h.cycle(pod, "node-0"); !st["node-0"].IsSuccess() {
		t.Fatalf("2 free on node-1: Filter(node-0) = %v, want success", st["node-0"])
	}
	if got := hint(pod); got != fwk.QueueSkip {
		t.Errorf("pod whose latest attempt found a node: hint %v, want %v", got, fwk.QueueSkip)
	}
}

// gpuNames names the devices gpu-from to gpu-(to-1) of testSlice.
func gpuNames(from, to int) []string {
	var out []string
	for g := from; g < to; g++ {
		out = append(out, fmt.Sprintf("gpu-%d", g))
	}
	return out
}

// closedPoolCluster is sixteen nodes of eight GPUs, node-00 to node-15,
// with a headroom of 12 % and claim "eight" for 8 GPUs (and objs): nodes
// from node-08 are closed to pods that do not tolerate it, node-08 to
// node-11 by a NoSchedule taint, node-12 to node-15 by a cordon; the nodes
// from the firstHeld-th on are full, each held by one 8-GPU claim
// "held-<node>".
func closedPoolCluster(t *testing.T, firstHeld int, objs ...runtime.Object) (*harness, []string) {
	var nodes []*v1.Node
	var names []string
	objs = append(objs, testDeviceClass(), testClaim("eight", 8))
	for i := range 16 {
		name := fmt.Sprintf("node-%02d", i)
		node := testNode(name)
		switch {
		case i >= 12:
			node.Spec.Unschedulable = true
		case i >= 8:
			node.Spec.Taints = []v1.Taint{{Key: "dedicated", Value: "other-team", Effect: v1.TaintEffectNoSchedule}}
		}
		names = append(names, name)
		nodes = append(nodes, node)
		objs = append(objs, testSlice(name, 8))
		if i >= firstHeld {
			objs = append(objs, allocatedOn(testClaim("held-"+name, 8), name, gpuNames(0, 8)...))
		}
	}
	h := newHarness(t, nodes, objs...)
	h.pl.headroomPercent = 12
	return h, names
}

// TestHeadroomOnlyOnNodesThePodMayUse: the headroom is kept on the nodes
// the pod could run on. Of sixteen nodes of eight GPUs, eight are full and
// closed to the pod (four by a taint it does not tolerate, four
// cordoned); with two empty nodes among the others, an 8-GPU pod may take
// one (8 of 64 kept free, 8 left), where counting the closed nodes would
// hold it back (16 of 128). A pod that tolerates both counts them all.
func TestHeadroomOnlyOnNodesThePodMayUse(t *testing.T) {
	h, names := closedPoolCluster(t, 2, testClaim("eight-tolerant", 8))

	if _, st := h.cycle(testPod("p", "eight"), names...); !st["node-00"].IsSuccess() {
		t.Errorf("closed nodes counted: Filter(node-00) = %v, want success", st["node-00"])
	}
	tolerant := testPod("tolerant", "eight-tolerant")
	tolerant.Spec.Tolerations = []v1.Toleration{
		{Key: "dedicated", Operator: v1.TolerationOpEqual, Value: "other-team", Effect: v1.TaintEffectNoSchedule},
		{Key: v1.TaintNodeUnschedulable, Operator: v1.TolerationOpExists, Effect: v1.TaintEffectNoSchedule},
	}
	_, st := h.cycle(tolerant, names...)
	if code(st["node-00"]) != fwk.UnschedulableAndUnresolvable || !strings.Contains(st["node-00"].Message(), "of the 128") {
		t.Errorf("a pod that may use every node: Filter(node-00) = %v, want held back, keeping 16 of the 128", st["node-00"])
	}
}

// TestHeadroomHintOnlyNodesThePodMayUse: the freed-devices hint counts the
// headroom over the nodes Filter counts it over. Of sixteen nodes, eight
// are full and closed to the pod (four tainted, four cordoned), node-00 is
// empty and node-01 held by one 8-GPU claim: an 8-GPU pod is held back
// (16 free would leave 8, the headroom over its 64 GPUs). When node-01's
// claim gives its GPUs back, Filter admits the pod, so the hint retries
// it; a pod that tolerates the taints and cordons still keeps 16 of 128.
func TestHeadroomHintOnlyNodesThePodMayUse(t *testing.T) {
	h, _ := closedPoolCluster(t, 1)
	h.waitForClaim("eight", func(*resourceapi.ResourceClaim) bool { return true })
	h.waitForClaim("held-node-15", func(*resourceapi.ResourceClaim) bool { return true })
	if err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return h.pl.nodeKnown("node-15"), nil
	}); err != nil {
		t.Fatalf("the node lister never saw node-15: %v", err)
	}
	hint := func(pod *v1.Pod) fwk.QueueingHint { return freeingHint(t, h, pod, "held-node-01") }
	if got := hint(testPod("p", "eight")); got != fwk.Queue {
		t.Errorf("node-01 freed, 16 of the pod's 64 GPUs free: hint %v, want Queue", got)
	}
	tolerant := testPod("tolerant", "eight")
	tolerant.Spec.Tolerations = []v1.Toleration{
		{Key: "dedicated", Operator: v1.TolerationOpExists},
		{Key: v1.TaintNodeUnschedulable, Operator: v1.TolerationOpExists},
	}
	if got := hint(tolerant); got != fwk.QueueSkip {
		t.Errorf("node-01 freed, 16 of 128 free for a pod that may use every node: hint %v, want QueueSkip", got)
	}
}

// freeingHint is the claim hint for pod on the event in which the named
// claim gives its devices back (the claim cache not updated yet).
func freeingHint(t *testing.T, h *harness, pod *v1.Pod, claim string) fwk.QueueingHint {
	t.Helper()
	old := h.apiClaim(claim)
	freed := old.DeepCopy()
	freed.Status.Allocation = nil
	freed.ResourceVersion += "-next"
	got, err := h.pl.isSchedulableAfterClaimChange(klog.Background(), pod, old, freed)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// TestHeadroomAmongTheModelThePodAsks: one driver publishes two GPU
// models, "h100" on node-0 to node-3 and "a100" on node-4 to node-7, and
// the 8-GPU pod asks for h100s. At 25 % its headroom is 8 of the 32 h100s,
// not 16 of all 64 GPUs: busy a100s do not hold it back while another
// h100 node stays empty, and free a100s leave no room for it on the last
// empty h100 node. A pod that takes any GPU keeps 16 of the 64. With only
// node-0 free the h100 pod is held back, and the freed-devices hint
// retries it when a claim gives back a whole h100 node, which the counts
// of all GPUs would call short of 16, and not when one gives back an a100
// node; a pod whose attempt found no room is judged as a pod without a
// headroom, on the h100 nodes only.
func TestHeadroomAmongTheModelThePodAsks(t *testing.T) {
	// setup frees the GPUs of the nodes named in free, holds the others
	// with one claim each ("held-<node>").
	setup := func(free ...int) *harness {
		objs := []runtime.Object{testDeviceClass(),
			testClaim("h100", 8, fmt.Sprintf(`device.attributes[%q].model == "h100"`, topology.DriverName)), testClaim("any", 8)}
		var nodes []*v1.Node
		var held []string
		for i := range 8 {
			name := fmt.Sprintf("node-%d", i)
			nodes = append(nodes, testNode(name))
			s := testSlice(name, 8)
			model := "h100"
			if i >= 4 {
				model = "a100"
			}
			for d := range s.Spec.Devices {
				s.Spec.Devices[d].Attributes["model"] = resourceapi.DeviceAttribute{StringValue: ptr.To(model)}
			}
			objs = append(objs, s)
			if !slices.Contains(free, i) {
				objs = append(objs, allocatedOn(testClaim("held-"+name, 8), name, gpuNames(0, 8)...))
				held = append(held, "held-"+name)
			}
		}
		h := newHarness(t, nodes, objs...)
		h.pl.headroomPercent = 25
		h.waitForClaim("any", func(*resourceapi.ResourceClaim) bool { return true })
		for _, name := range held {
			h.waitForClaim(name, func(*resourceapi.ResourceClaim) bool { return true })
		}
		return h
	}
	const ofTheH100s = "devices that this pod's requests match on the nodes it may use"

	h := setup(0, 1)
	if _, st := h.cycle(testPod("p", "h100"), "node-0"); !st["node-0"].IsSuccess() {
		t.Errorf("a100s busy, another h100 node empty: Filter(node-0) = %v, want success", st["node-0"])
	}
	_, st := h.cycle(testPod("p", "any"), "node-0")
	if msg := st["node-0"].Message(); code(st["node-0"]) != fwk.UnschedulableAndUnresolvable || !strings.Contains(msg, "keeping 16 of the 64 "+topology.DriverName+" devices of the nodes this pod may use") {
		t.Errorf("a pod that takes any GPU: Filter(node-0) = %v, want it held back for 16 of all 64 GPUs", st["node-0"])
	}

	h = setup(0, 4, 5, 6, 7)
	_, st = h.cycle(testPod("p", "h100"), "node-0")
	if msg := st["node-0"].Message(); code(st["node-0"]) != fwk.UnschedulableAndUnresolvable || !strings.Contains(msg, "keeping 8 of the 32 "+topology.DriverName+" "+ofTheH100s) {
		t.Errorf("a100s free, the last h100 node empty: Filter(node-0) = %v, want the pod held back for 8 of the 32 h100s", st["node-0"])
	}
	if _, st := h.cycle(testPod("p", "any"), "node-0"); !st["node-0"].IsSuccess() {
		t.Errorf("a pod that takes any GPU, 32 a100s free: Filter(node-0) = %v, want success", st["node-0"])
	}

	h = setup(0)
	pod := testPod("p", "h100")
	heldPods := func() float64 {
		v, err := testutil.GetGaugeMetricValue(headroomHeldPods)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	before := heldPods()
	for range 2 {
		_, st = h.cycle(pod, "node-0")
		if msg := st["node-0"].Message(); code(st["node-0"]) != fwk.UnschedulableAndUnresolvable || !strings.Contains(msg, "8 are free (8 of them on nodes with 2 or more free)") {
			t.Fatalf("only node-0 free: Filter(node-0) = %v, want the pod held back", st["node-0"])
		}
	}
	if got := heldPods(); got != before+1 {
		t.Errorf("topodra_headroom_held_pods went from %v to %v after two attempts of one pod, want +1", before, got)
	}
	if got := freeingHint(t, h, pod, "held-node-1"); got != fwk.Queue {
		t.Errorf("held-back h100 pod, a whole h100 node given back: hint %v, want %v", got, fwk.Queue)
	}
	if got := freeingHint(t, h, testPod("never-tried", "h100"), "held-node-1"); got != fwk.QueueSkip {
		t.Errorf("counted over all 64 GPUs, a whole node given back leaves the cluster short of 16: hint %v, want %v", got, fwk.QueueSkip)
	}
	if got := freeingHint(t, h, pod, "held-node-4"); got != fwk.QueueSkip {
		t.Errorf("held-back h100 pod, a whole a100 node given back: hint %v, want %v", got, fwk.QueueSkip)
	}
	// An attempt that finds no node with room (node-1 is full), so the
	// headroom does not hold it back.
	other := testPod("other", "h100")
	if _, st := h.cycle(other, "node-1"); st["node-1"].IsSuccess() || strings.Contains(st["node-1"].Message(), "keeping") || h.pl.heldBack.held(other.UID) {
		t.Fatalf("Filter(node-1) = %v, held back %v; want devices short, not held back", st["node-1"], h.pl.heldBack.held(other.UID))
	}
	if got := freeingHint(t, h, other, "held-node-1"); got != fwk.Queue {
		t.Errorf("h100 pod not held back, a node with room for it given back: hint %v, want %v", got, fwk.Queue)
	}
	if got := freeingHint(t, h, other, "held-node-4"); got != fwk.QueueSkip {
		t.Errorf("h100 pod not held back, an a100 node given back: hint %v, want %v", got, fwk.QueueSkip)
	}
	// Its next attempt ends before the headroom is counted (its claim is
	// gone from the cache): the headroom holds it back no longer.
	gone := pod.DeepCopy()
	gone.Spec.ResourceClaims[0].ResourceClaimName = ptr.To("deleted")
	if _, st := h.pl.PreFilter(h.tCtx, framework.NewCycleState(), gone, nil); st.IsSuccess() {
		t.Fatalf("PreFilter of a pod whose claim is gone: %v, want it unschedulable", st)
	}
	if h.pl.heldBack.held(pod.UID) {
		t.Error("the pod is still held back after an attempt that ended before the headroom")
	}
	if got := heldPods(); got != before {
		t.Errorf("topodra_headroom_held_pods is %v after that attempt, want %v", got, before)
	}
}

// TestHeadroomLeavesNetworkDevicesOut: eight nodes of eight GPUs, all
// taken but node-0's, and eight GPUs of the same driver in a pool that is
// not local to a node (allNodes). An 8-GPU pod that takes the pool's GPUs
// leaves the nodes' GPUs as they are: the headroom (8 of 64 at 12 %) does
// not hold it back, while a pod that takes node-0's GPUs is held back.
func TestHeadroomLeavesNetworkDevicesOut(t *testing.T) {
	objs := []runtime.Object{testDeviceClass(),
		testClaim("rack", 8, fmt.Sprintf(`has(device.attributes[%q].rack)`, topology.DriverName)),
		testClaim("local", 8, fmt.Sprintf(`!has(device.attributes[%q].rack)`, topology.DriverName))}
	var nodes []*v1.Node
	var held []string
	for i := range 8 {
		name := fmt.Sprintf("node-%d", i)
		nodes = append(nodes, testNode(name))
		objs = append(objs, testSlice(name, 8))
		if i > 0 {
			objs = append(objs, allocatedOn(testClaim("held-"+name, 8), name, gpuNames(0, 8)...))
			held = append(held, "held-"+name)
		}
	}
	rack := testSlice("rack", 8)
	rack.Spec.NodeName, rack.Spec.AllNodes = nil, ptr.To(true)
	for d := range rack.Spec.Devices {
		rack.Spec.Devices[d].Attributes["rack"] = resourceapi.DeviceAttribute{BoolValue: ptr.To(true)}
	}
	objs = append(objs, rack)
	h := newHarness(t, nodes, objs...)
	h.pl.headroomPercent = 12
	for _, name := range held {
		h.waitForClaim(name, func(*resourceapi.ResourceClaim) bool { return true })
	}
	if _, st := h.cycle(testPod("p", "rack"), "node-0", "node-1"); !st["node-0"].IsSuccess() || !st["node-1"].IsSuccess() {
		t.Errorf("8 GPUs of a network-attached pool: Filter = %v, %v, want success on both nodes", st["node-0"], st["node-1"])
	}
	if _, st := h.cycle(testPod("p", "local"), "node-0"); code(st["node-0"]) != fwk.UnschedulableAndUnresolvable {
		t.Errorf("node-0's 8 GPUs, none free elsewhere: Filter(node-0) = %v, want the headroom to hold the pod back", st["node-0"])
	}
}

// TestHeldBackForgetsDeletedPod: a pod the headroom holds back is kept,
// and counted in topodra_headroom_held_pods, while it exists; one deleted
// while its attempt ran (its deletion handled before Filter held it back)
// is not; the same for the record of a narrow headroom. Placing the pod
// forgets both.
func TestHeldBackForgetsDeletedPod(t *testing.T) {
	h := newHarness(t, nil)
	h.pl.heldBack.lister = h.podLister
	if h.podLister == nil {
		t.Fatal("the plugin has no pod lister with the headroom on")
	}
	heldPods := func() float64 {
		v, err := testutil.GetGaugeMetricValue(headroomHeldPods)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	exists, gone := testPod("exists"), testPod("gone")
	if _, err := h.client.CoreV1().Pods(testNS).Create(h.tCtx, exists, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		_, err := h.podLister.Pods(testNS).Get(exists.Name)
		return err == nil, nil
	}); err != nil {
		t.Fatalf("the pod lister never saw the pod: %v", err)
	}
	before := heldPods()
	h.pl.heldBack.hold(gone)
	if h.pl.heldBack.held(gone.UID) || heldPods() != before {
		t.Errorf("a pod not in the API: held %v, gauge %v (before %v); want not held, unchanged", h.pl.heldBack.held(gone.UID), heldPods(), before)
	}
	h.pl.heldBack.hold(exists)
	if !h.pl.heldBack.held(exists.UID) || heldPods() != before+1 {
		t.Errorf("a pod in the API: held %v, gauge %v (before %v); want held, +1", h.pl.heldBack.held(exists.UID), heldPods(), before)
	}
	// So is the record of a narrow headroom, which PreFilter writes.
	h.pl.heldBack.setNarrow(gone, true, sets.New("node-a"))
	if _, narrow := h.pl.heldBack.narrowed(gone.UID); narrow {
		t.Error("a pod not in the API: its narrow headroom is recorded")
	}
	h.pl.heldBack.setNarrow(exists, true, sets.New("node-a"))
	if _, narrow := h.pl.heldBack.narrowed(exists.UID); !narrow {
		t.Error("a pod in the API: its narrow headroom is not recorded")
	}
	// Reserve, or the pod's deletion, forgets both.
	h.pl.heldBack.done(exists.UID)
	if _, narrow := h.pl.heldBack.narrowed(exists.UID); narrow || h.pl.heldBack.held(exists.UID) || heldPods() != before {
		t.Errorf("a placed pod: narrow %v, held %v, gauge %v; want neither, gauge %v", narrow, h.pl.heldBack.held(exists.UID), heldPods(), before)
	}
}

// TestHeadroomHintForSplitRequests: a pod asks for six GPUs as two
// requests of three. Filter keeps its headroom (a quarter of 12 % of 64:
// 2 GPUs on nodes left with two or more), counting the six together, and
// holds it back from the only node with six free while no other node has
// two. When a claim gives back one GPU of a node that then has two free,
// the pod fits: the freed-devices hint judges the headroom for the six,
// not for one request of three, which that node alone could not take.
func TestHeadroomHintForSplitRequests(t *testing.T) {
	nodes, objs := eightNodes(func(i int, name string) []runtime.Object {
		switch i {
		case 0:
			return []runtime.Object{allocatedOn(testClaim("two-"+name, 2), name, "gpu-0", "gpu-1")}
		case 1:
			return []runtime.Object{allocatedOn(testClaim("six-"+name, 6), name, gpuNames(0, 6)...), allocatedOn(testClaim("one-"+name, 1), name, "gpu-6")}
		}
		return []runtime.Object{allocatedOn(testClaim("eight-"+name, 8), name, gpuNames(0, 8)...)}
	}, testDeviceClass(), withRequest(testClaim("split", 3), "more", testClass, 3))
	h := newHarness(t, nodes, objs...)
	for _, name := range []string{"split", "two-node-0", "one-node-1", "eight-node-7"} {
		h.waitForClaim(name, func(*resourceapi.ResourceClaim) bool { return true })
	}
	h.pl.headroomPercent = 12
	pod := testPod("p", "split")
	if _, st := h.cycle(pod, "node-0"); st["node-0"].IsSuccess() || !strings.Contains(st["node-0"].Message(), "smallPodHeadroomPercent") {
		t.Fatalf("Filter on node-0 before the release: %v, want held back by the headroom", st["node-0"])
	}
	if got := freeingHint(t, h, pod, "one-node-1"); got != fwk.Queue {
		t.Errorf("one GPU back on node-1, which then has two free: hint %v, want %v", got, fwk.Queue)
	}
}

// eightNodes returns eight nodes node-0 to node-7 of eight GPUs each, and
// objs with their slices and the claims that held(i, name) allocates on
// each.
func eightNodes(held func(i int, name string) []runtime.Object, objs ...runtime.Object) ([]*v1.Node, []runtime.Object) {
	var nodes []*v1.Node
	for i := range 8 {
		name := fmt.Sprintf("node-%d", i)
		nodes = append(nodes, testNode(name))
		objs = append(objs, testSlice(name, 8))
		objs = append(objs, held(i, name)...)
	}
	return nodes, objs
}

// TestHeldBackForgottenOnceAllocated: a pod the headroom held back whose
// claim is then allocated by someone else (a claim it shares with a pod
// placed meanwhile) has nothing left to allocate: its next attempt
// forgets that it was held back, so the held-pods gauge and the hint do
// not count it for as long as it runs.
func TestHeldBackForgottenOnceAllocated(t *testing.T) {
	nodes, objs := eightNodes(func(i int, name string) []runtime.Object {
		if i == 0 {
			return []runtime.Object{allocatedOn(testClaim("held-"+name, 4), name, gpuNames(0, 4)...)}
		}
		return []runtime.Object{allocatedOn(testClaim("held-"+name, 8), name, gpuNames(0, 8)...)}
	}, testDeviceClass(), testClaim("four", 4))
	h := newHarness(t, nodes, objs...)
	h.pl.headroomPercent = 12
	h.waitForClaim("held-node-7", func(*resourceapi.ResourceClaim) bool { return true })

	pod := testPod("p", "four")
	if _, st := h.cycle(pod, "node-0"); code(st["node-0"]) != fwk.UnschedulableAndUnresolvable {
		t.Fatalf("4 free in all: Filter(node-0) = %v, want the headroom to hold the pod back", st["node-0"])
	}
	if !h.pl.heldBack.held(pod.UID) {
		t.Fatal("the pod is not recorded as held back")
	}
	four := h.apiClaim("four")
	four.Status.Allocation = allocatedOn(testClaim("four", 4), "node-0", gpuNames(4, 8)...).Status.Allocation
	_, err := h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(h.tCtx, four, metav1.UpdateOptions{})
	h.tCtx.ExpectNoError(err, "allocate the claim past the plugin")
	h.waitForClaim("four", func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation != nil })
	h.cycle(pod)
	if h.pl.heldBack.held(pod.UID) {
		t.Error("the pod is still recorded as held back after an attempt with nothing to allocate")
	}
}

// TestHeadroomSparesPodThatMayPreempt: on 9 nodes of 8 GPUs, node-0 free
// and the others held, the headroom (9 of 72) holds an 8-GPU pod back. It
// does not hold back a pod that may preempt a pod of lower priority
// holding claims: that pod would evict pods instead, and on a full
// cluster the headroom would keep it from preempting at all. A pod of
// the same priority as every holder, one that may not preempt, and one
// that may not use the holder's node (its headroom then 8 of the other
// 64) are held back as before. The freed-devices hint retries the pod it
// spared when a node is given back, where the headroom would have called
// the cluster short.
func TestHeadroomSparesPodThatMayPreempt(t *testing.T) {
	var nodes []*v1.Node
	objs := []runtime.Object{testDeviceClass(), testClaim("eight", 8)}
	for i := range 9 {
		name := fmt.Sprintf("node-%d", i)
		nodes = append(nodes, testNode(name))
		objs = append(objs, testSlice(name, 8))
		if i > 0 {
			objs = append(objs, allocatedOn(testClaim("held-"+name, 8), name, gpuNames(0, 8)...))
		}
	}
	h := newHarness(t, nodes, objs...)
	h.waitForClaim("eight", func(*resourceapi.ResourceClaim) bool { return true })
	h.waitForClaim("held-node-7", func(*resourceapi.ResourceClaim) bool { return true })
	h.pl.headroomPercent = 12
	low := testPod("low", "held-node-5")
	low.Spec.NodeName = "node-5"
	h.nodes["node-5"].AddPodInfo(podInfo(t, low))

	never := testPod("never", "eight")
	never.Spec.Priority = ptr.To[int32](100)
	never.Spec.PreemptionPolicy = ptr.To(v1.PreemptNever)
	group := testPod("group", "eight")
	group.Spec.Priority = ptr.To[int32](100)
	group.Spec.SchedulingGroup = &v1.PodSchedulingGroup{}
	high := testPod("high", "eight")
	high.Spec.Priority = ptr.To[int32](100)
	elsewhere := testPod("elsewhere", "eight")
	elsewhere.Spec.Priority = ptr.To[int32](100)
	elsewhere.Spec.Affinity = &v1.Affinity{NodeAffinity: &v1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &v1.NodeSelector{
		NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{{Key: "kubernetes.io/hostname", Operator: v1.NodeSelectorOpNotIn, Values: []string{"node-5"}}}}},
	}}}
	for _, tc := range []struct {
		name     string
		pod      *v1.Pod
		heldBack bool
	}{
		{"same priority as every holder", testPod("same", "eight"), true},
		{"higher priority, preemptionPolicy Never", never, true},
		{"higher priority, in a scheduling group", group, true},
		{"higher priority, the holder on a node it may not use", elsewhere, true},
		{"higher priority", high, false},
	} {
		_, st := h.cycle(tc.pod, "node-0")
		if held := strings.Contains(st["node-0"].Message(), "held back"); held != tc.heldBack || !held && !st["node-0"].IsSuccess() {
			t.Errorf("%s: Filter(node-0) = %v, want held back = %v", tc.name, st["node-0"], tc.heldBack)
		}
		if got := h.pl.heldBack.outranks(tc.pod.UID); got == tc.heldBack {
			t.Errorf("%s: recorded as outranking = %v", tc.name, got)
		}
	}

	// node-0 taken meanwhile, node-3 given back: 8 free, short of the
	// headroom with the pod placed.
	h.create(allocatedOn(testClaim("took-node-0", 8), "node-0", gpuNames(0, 8)...))
	h.waitForClaim("took-node-0", func(*resourceapi.ResourceClaim) bool { return true })
	if got := freeingHint(t, h, testPod("same", "eight"), "held-node-3"); got != fwk.QueueSkip {
		t.Errorf("pod held back by the headroom, a node given back: hint %v, want %v", got, fwk.QueueSkip)
	}
	if got := freeingHint(t, h, high, "held-node-3"); got != fwk.Queue {
		t.Errorf("pod spared by the headroom, a node given back: hint %v, want %v", got, fwk.Queue)
	}
}
