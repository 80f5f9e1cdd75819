package topologydra

import (
	"maps"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/component-base/metrics/testutil"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/allocator"
	"github.com/topodra/topodra/pkg/topology"
)

// attemptCounts reads topodra_unschedulable_attempts_total of profile
// per reason.
func attemptCounts(t *testing.T, profile string) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, name := range rejectionNames {
		v, err := testutil.GetCounterMetricValue(unschedulableAttempts.WithLabelValues(profile, name))
		if err != nil {
			t.Fatal(err)
		}
		out[name] = v
	}
	return out
}

// expectAttempt checks that the counts went up by one for reason since
// before, and not for any other reason ("" for none).
func expectAttempt(t *testing.T, what, profile string, before map[string]float64, reason string) {
	t.Helper()
	after := attemptCounts(t, profile)
	for name, v := range after {
		want := before[name]
		if name == reason {
			want++
		}
		if v != want {
			t.Errorf("%s: topodra_unschedulable_attempts_total{reason=%q} went from %v to %v, want %v", what, name, before[name], v, want)
		}
	}
	maps.Copy(before, after)
}

// TestUnschedulableAttemptsByReason: an attempt that TopologyDRA turns
// down is counted once, by the reason of the pod's claims (PreFilter) or
// by the reason most nodes were turned down for (PostFilter); an attempt
// whose nodes TopologyDRA did not turn down is not counted.
func TestUnschedulableAttemptsByReason(t *testing.T) {
	nodes := []*v1.Node{testNode("node-a"), testNode("node-b"), testNode("node-c")}
	pair := testClaim("pair", 2)
	pair.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(topology.AttrPCIeRoot))}}
	missingClass := testClaim("no-class", 1)
	missingClass.Spec.Devices.Requests[0].Exactly.DeviceClassName = "missing"
	h := newHarness(t, nodes, testDeviceClass(),
		testSlice("node-a", 2), testSlice("node-b", 2), testSlice("node-c", 4),
		allocatedOn(testClaim("held-a", 2), "node-a", "gpu-0", "gpu-1"),
		allocatedOn(testClaim("held-b", 2), "node-b", "gpu-0", "gpu-1"),
		allocatedOn(testClaim("held-c", 2), "node-c", "gpu-0", "gpu-2"),
		testClaim("eight", 8), testClaim("one", 1), testClaim("two", 2), testClaim("other", 1, `device.driver == "other.example.com"`), pair, missingClass)
	for _, c := range []string{"held-a", "held-b", "held-c", "eight", "one", "two", "other", "pair", "no-class"} {
		h.waitForClaim(c, func(*resourceapi.ResourceClaim) bool { return true })
	}
	all := []string{"node-a", "node-b", "node-c"}
	profile := h.pl.handle.ProfileName() // the harness's framework has none: ""
	before := attemptCounts(t, profile)
	turnedDown := func(what string, pod *v1.Pod, reason string, nodes ...string) {
		t.Helper()
		cs, st := h.cycle(pod, nodes...)
		for _, n := range nodes {
			if st[n].IsSuccess() {
				t.Fatalf("%s: Filter(%s) passed, want the pod turned down", what, n)
			}
		}
		h.pl.PostFilter(h.tCtx, cs, pod, nil)
		expectAttempt(t, what, profile, before, reason)
	}

	turnedDown("8 GPUs on nodes of 2 and 4", testPod("p1", "eight"), "no_matching_devices", all...)
	turnedDown("a selector no device matches", testPod("p2", "other"), "no_matching_devices", all...)
	// node-a and node-b: every GPU allocated; node-c: one free GPU on
	// each PCIe root.
	turnedDown("2 GPUs of one PCIe root on node-c", testPod("p3", "pair"), "constraints", "node-c")
	turnedDown("2 GPUs of one PCIe root", testPod("p3", "pair"), "devices_in_use", all...)
	h.taintDevice("node-c", "gpu-1", healthKey)
	h.taintDevice("node-c", "gpu-3", healthKey)
	turnedDown("1 GPU on node-c, its free GPUs tainted", testPod("p4", "one"), "devices_tainted", "node-c")
	turnedDown("1 GPU: two nodes full, one tainted", testPod("p4", "one"), "devices_in_use", all...)

	// PreFilter: the pod's claims.
	cs := framework.NewCycleState()
	if _, st := h.pl.PreFilter(h.tCtx, cs, testPod("p5", "not-there"), nil); code(st) != fwk.UnschedulableAndUnresolvable {
		t.Fatalf("PreFilter of a pod whose claim is missing: %v", st)
	}
	h.pl.PostFilter(h.tCtx, cs, testPod("p5", "not-there"), nil)
	expectAttempt(t, "a claim not created yet", profile, before, "claim_not_ready")
	cs = framework.NewCycleState()
	if _, st := h.pl.PreFilter(h.tCtx, cs, testPod("p6", "no-class"), nil); code(st) != fwk.UnschedulableAndUnresolvable {
		t.Fatalf("PreFilter of a pod whose claim names a missing class: %v", st)
	}
	h.pl.PostFilter(h.tCtx, cs, testPod("p6", "no-class"), nil)
	expectAttempt(t, "a missing device class", profile, before, "invalid_claim")

	// Other plugins turned every node down: TopologyDRA's Filter was not
	// called, or passed.
	cs = framework.NewCycleState()
	if _, st := h.pl.PreFilter(h.tCtx, cs, testPod("p7", "two"), nil); !st.IsSuccess() {
		t.Fatalf("PreFilter: %v", st)
	}
	h.pl.PostFilter(h.tCtx, cs, testPod("p7", "two"), nil)
	expectAttempt(t, "no node turned down by TopologyDRA", profile, before, "")
}

// TestRejectionCounts: the reason of the most nodes wins, the first in
// rejection order among equals; nothing where no node was turned down.
// An explanation's cause is its first request's in the allocator's
// order, so a node short of matching devices for one request is not
// counted as short of free ones for another.
func TestRejectionCounts(t *testing.T) {
	var n nodeRejections
	if r, ok := n.most(); ok {
		t.Errorf("no node turned down: most() = %v, true", r)
	}
	n.add(rejectConstraints)
	n.add(rejectInUse)
	if r, _ := n.most(); r != rejectInUse {
		t.Errorf("one node each: most() = %v, want %v", r, rejectInUse)
	}
	n.add(rejectConstraints)
	if r, _ := n.most(); r != rejectConstraints {
		t.Errorf("two nodes for constraints, one in use: most() = %v, want %v", r, rejectConstraints)
	}
	for r := range numRejections {
		if rejectionNames[r] == "" {
			t.Errorf("rejection %d has no name", r)
		}
	}

	expl := &allocator.Explanation{Requests: []allocator.RequestExplanation{{Cause: allocator.CauseInUse}, {Cause: allocator.CauseNoMatch}, {}}}
	if got := causeRejection(expl.Cause()); got != rejectNoMatch {
		t.Errorf("requests in use, without a match, unclassified: %v, want %v", got, rejectNoMatch)
	}
	for _, e := range []*allocator.Explanation{nil, {}, {Requests: []allocator.RequestExplanation{{}}}} {
		if got := causeRejection(e.Cause()); got != rejectOther {
			t.Errorf("explanation %+v: %v, want %v", e, got, rejectOther)
		}
	}
}
