package topologydra

import (
	"fmt"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
)

func TestHeadroomFor(t *testing.T) {
	for _, tc := range []struct {
		percent     int32
		total, want int
	}{
		{12, 64, 8},   // 7.68 rounded up: one node's worth on 8 nodes
		{12, 128, 16}, // 15.36
		{12, 56, 0},   // 6.72: less than a whole node, off
		{12, 16, 0},   // two nodes: never held back
		{0, 1000, 0},
		{50, 16, 8},
	} {
		if got := HeadroomFor(tc.percent, tc.total); got != tc.want {
			t.Errorf("HeadroomFor(%d, %d) = %d, want %d", tc.percent, tc.total, got, tc.want)
		}
	}
}

// TestFilterKeepsHeadroom: on eight nodes of eight GPUs (headroom 8 of 64
// at 12 %), an 8-GPU pod may not take the empty node while only 7 other
// GPUs are free; with 8 free it may; a smaller pod is never held back;
// a pod pinned to one node keeps no headroom there; 0 switches it off.
func TestFilterKeepsHeadroom(t *testing.T) {
	var nodes []*v1.Node
	var names []string
	for i := range 8 {
		name := fmt.Sprintf("node-%d", i)
		names = append(names, name)
		nodes = append(nodes, testNode(name))
	}
	setup := func(freeOnNode1 int, extra ...runtime.Object) *harness {
		objs := []runtime.Object{testDeviceClass(), testClaim("eight", 8), testClaim("one", 1)}
		for i, n := range names {
			objs = append(objs, testSlice(n, 8))
			held := 8
			switch i {
			case 0:
				held = 0
			case 1:
				held = 8 - freeOnNode1
			}
			var devs []string
			for g := range held {
				devs = append(devs, fmt.Sprintf("gpu-%d", g))
			}
			if len(devs) > 0 {
				objs = append(objs, allocatedOn(testClaim("held-"+n, int64(held)), n, devs...))
			}
		}
		h := newHarness(t, nodes, append(objs, extra...)...)
		h.pl.headroomPercent = 12
		return h
	}

	h := setup(7)
	_, st := h.cycle(testPod("p", "eight"), names...)
	if code(st["node-0"]) != fwk.UnschedulableAndUnresolvable {
		t.Errorf("7 free besides the empty node: Filter(node-0) = %v, want UnschedulableAndUnresolvable", st["node-0"])
	}
	for _, n := range names[1:] {
		if st[n].IsSuccess() {
			t.Errorf("Filter(%s) succeeded on a node without 8 free GPUs", n)
		}
	}
	if msg := st["node-0"].Message(); !strings.Contains(msg, "keeping 8 of the 64") || !strings.Contains(msg, "15 are free, this pod needs 8") {
		t.Errorf("message %q does not say what is kept and why", msg)
	}
	_, st = h.cycle(testPod("small", "one"), names...)
	if !st["node-0"].IsSuccess() || !st["node-1"].IsSuccess() {
		t.Errorf("a 1-GPU pod was held back: %v, %v", st["node-0"], st["node-1"])
	}
	pinned := testPod("pinned", "eight")
	pinned.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": "node-0"}
	if _, st = h.cycle(pinned, "node-0"); !st["node-0"].IsSuccess() {
		t.Errorf("a pod that may use one node only keeps no headroom: %v", st["node-0"])
	}
	h.pl.headroomPercent = 0
	if _, st = h.cycle(testPod("p", "eight"), "node-0"); !st["node-0"].IsSuccess() {
		t.Errorf("headroom off: %v", st["node-0"])
	}

	h = setup(8)
	_, st = h.cycle(testPod("p", "eight"), names...)
	if !st["node-0"].IsSuccess() || !st["node-1"].IsSuccess() {
		t.Errorf("8 free besides the empty node: %v, %v, want both nodes feasible", st["node-0"], st["node-1"])
	}
}

// TestHeadroomQueueingHint: a device given back on a node that still has
// fewer free GPUs than a whole node requeues a waiting 8-GPU pod where the
// headroom applies (the cluster may now have enough free), and not where
// it is off.
func TestHeadroomQueueingHint(t *testing.T) {
	var nodes []*v1.Node
	objs := []runtime.Object{testDeviceClass(), testClaim("eight", 8)}
	for i := range 8 {
		name := fmt.Sprintf("node-%d", i)
		nodes = append(nodes, testNode(name))
		objs = append(objs, testSlice(name, 8))
		if i > 0 {
			objs = append(objs,
				allocatedOn(testClaim("seven-"+name, 7), name, "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6"),
				allocatedOn(testClaim("one-"+name, 1), name, "gpu-7"))
		}
	}
	h := newHarness(t, nodes, objs...)
	h.waitForClaim("eight", func(*resourceapi.ResourceClaim) bool { return true })
	h.waitForClaim("one-node-1", func(*resourceapi.ResourceClaim) bool { return true })
	old := h.apiClaim("one-node-1")
	freed := old.DeepCopy()
	freed.Status.Allocation = nil
	freed.ResourceVersion += "-next"
	for _, tc := range []struct {
		percent int32
		want    fwk.QueueingHint
	}{{0, fwk.QueueSkip}, {12, fwk.Queue}} {
		h.pl.headroomPercent = tc.percent
		got, err := h.pl.isSchedulableAfterClaimChange(klog.Background(), testPod("p", "eight"), old, freed)
		if err != nil {
			t.Fatal(err)
		}
		if got != tc.want {
			t.Errorf("smallPodHeadroomPercent %d: hint %v, want %v", tc.percent, got, tc.want)
		}
	}
}
