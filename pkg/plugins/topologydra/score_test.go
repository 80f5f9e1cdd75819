package topologydra

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/cache"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/allocator"
	"github.com/topodra/topodra/pkg/eventnote"
	"github.com/topodra/topodra/pkg/plugins/topologydra/apis/config"
	"github.com/topodra/topodra/pkg/topology"
)

func TestPolicyScore(t *testing.T) {
	args := *DefaultArgs() // room 70 / packing 30, MostAllocated, 3 levels: bands of 25
	args.WholeNodeTrade = 1
	args.AgeWeight = 0 // the table leaves age out (TestSettlednessAndDrainingByAge)
	score := policyFromArgs(args).Score
	one, two := []string{"a"}, []string{"a", "b"}
	tests := map[string]struct {
		q    allocator.Quality
		want int64
	}{
		"single device, empty node":              {q: allocator.Quality{Devices: one, Shared: 3, BreaksNode: true, Room: 0, Packing: 0.06}, want: 50},
		"single device, busy node, no break":     {q: allocator.Quality{Devices: one, Shared: 3, Room: 1, Packing: 0.5}, want: 95},
		"single device, fills the node":          {q: allocator.Quality{Devices: one, Shared: 3, Room: 1, Packing: 1}, want: 99},
		"root pair breaking a whole node":        {q: allocator.Quality{Devices: two, Shared: 3, BreaksNode: true, Room: 0, Packing: 0.2}, want: 51},
		"pair in one NUMA node of a busy node":   {q: allocator.Quality{Devices: two, Shared: 2, Room: 1, Packing: 0.5}, want: 70},
		"four in a free NUMA node of a busy one": {q: allocator.Quality{Devices: two, Shared: 2, Room: 0.6, Packing: 0.75}, want: 65},
		"four spanning NUMA nodes in a clique":   {q: allocator.Quality{Devices: two, Shared: 1, Room: 1, Packing: 1}, want: 49},
		"sharing no domain, packed":              {q: allocator.Quality{Devices: two, Shared: 0, Room: 1, Packing: 1}, want: 24},
		"clique only, breaking a whole node":     {q: allocator.Quality{Devices: two, Shared: 1, BreaksNode: true, Room: 0, Packing: 0}, want: 25},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			if got := score(tc.q); got != tc.want {
				t.Errorf("score = %d, want %d", got, tc.want)
			}
		})
	}
	// Alignment is lexicographically first: the best room and packing of a
	// looser placement lose to the worst of a tighter one.
	for shared := 1; shared <= 3; shared++ {
		worst := allocator.Quality{Devices: two, Shared: shared, Room: 0, Packing: 0}
		best := allocator.Quality{Devices: two, Shared: shared - 1, Room: 1, Packing: 1}
		if score(worst) <= score(best) {
			t.Errorf("rank %d at worst (%d) should beat rank %d at best (%d)", shared, score(worst), shared-1, score(best))
		}
	}
	// Breaking a whole free node costs one rank: a looser placement on a
	// busy node wins; with no trade, the tighter one keeps winning.
	tight := allocator.Quality{Devices: two, Shared: 2, BreaksNode: true, Room: 0, Packing: 0.25}
	loose := allocator.Quality{Devices: two, Shared: 1, Room: 0.6, Packing: 0.5}
	if score(tight) >= score(loose) {
		t.Errorf("trade 1: breaking a whole node (%d) should lose to one rank looser on a busy node (%d)", score(tight), score(loose))
	}
	args.WholeNodeTrade = 0
	if strict := policyFromArgs(args).Score; strict(tight) <= strict(loose) {
		t.Errorf("trade 0: the tighter placement (%d) should win (%d)", strict(tight), strict(loose))
	}
	args.ScoringStrategy = config.LeastAllocated
	spread := policyFromArgs(args).Score
	if spread(allocator.Quality{Devices: two, Shared: 3, Packing: 0.2}) <= spread(allocator.Quality{Devices: two, Shared: 3, Packing: 0.8}) {
		t.Error("LeastAllocated should prefer the emptier node")
	}
}

func TestScoreIsProportional(t *testing.T) {
	if ext := (&TopologyDRA{}).ScoreExtensions(); ext != nil {
		t.Error("scores must not be normalised: a stretched 1-point difference would override users' preferred affinities")
	}
}

// TestNICRootPairsWanted: only a pcieRoot matchAttribute over requests of
// two or more device classes (all requests where the constraint names
// none; firstAvailable subrequests count) turns nicRootTrade on.
func TestNICRootPairsWanted(t *testing.T) {
	root := ptr.To(resourceapi.FullyQualifiedName(topology.AttrPCIeRoot))
	numa := ptr.To(resourceapi.FullyQualifiedName(topology.AttrNUMANode))
	exact := func(name, class string) resourceapi.DeviceRequest {
		return resourceapi.DeviceRequest{Name: name, Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1}}
	}
	claim := func(constraints []resourceapi.DeviceConstraint, requests ...resourceapi.DeviceRequest) *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: requests, Constraints: constraints}}}
	}
	choice := resourceapi.DeviceRequest{Name: "gpu-or-nic", FirstAvailable: []resourceapi.DeviceSubRequest{
		{Name: "gpu", DeviceClassName: "gpu", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
		{Name: "nic", DeviceClassName: "nic", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
	}}
	for name, tc := range map[string]struct {
		claims []*resourceapi.ResourceClaim
		want   bool
	}{
		"none":                          {nil, false},
		"GPU and NIC, no constraint":    {[]*resourceapi.ResourceClaim{claim(nil, exact("gpu", "gpu"), exact("nic", "nic"))}, false},
		"GPU and NIC on one root":       {[]*resourceapi.ResourceClaim{claim([]resourceapi.DeviceConstraint{{MatchAttribute: root}}, exact("gpu", "gpu"), exact("nic", "nic"))}, true},
		"GPU and NIC on one NUMA node":  {[]*resourceapi.ResourceClaim{claim([]resourceapi.DeviceConstraint{{MatchAttribute: numa}}, exact("gpu", "gpu"), exact("nic", "nic"))}, false},
		"two GPUs on one root":          {[]*resourceapi.ResourceClaim{claim([]resourceapi.DeviceConstraint{{MatchAttribute: root}}, exact("a", "gpu"), exact("b", "gpu"))}, false},
		"root match over the GPUs only": {[]*resourceapi.ResourceClaim{claim([]resourceapi.DeviceConstraint{{MatchAttribute: root, Requests: []string{"a", "b"}}}, exact("a", "gpu"), exact("b", "gpu"), exact("nic", "nic"))}, false},
		"root match naming GPU and NIC": {[]*resourceapi.ResourceClaim{claim([]resourceapi.DeviceConstraint{{MatchAttribute: root, Requests: []string{"a", "nic"}}}, exact("a", "gpu"), exact("b", "gpu"), exact("nic", "nic"))}, true},
		"firstAvailable of two classes": {[]*resourceapi.ResourceClaim{claim([]resourceapi.DeviceConstraint{{MatchAttribute: root}}, choice)}, true},
	} {
		got := nicRootPairsWanted(func() ([]*resourceapi.ResourceClaim, error) { return tc.claims, nil })
		if got != tc.want {
			t.Errorf("%s: %v, want %v", name, got, tc.want)
		}
	}
	if nicRootPairsWanted(func() ([]*resourceapi.ResourceClaim, error) { return nil, errors.New("no cache") }) {
		t.Error("a list error turned the trade on")
	}
}

// TestRootPairClaimsFollowEvents: the plugin knows from the claim
// informer's events whether some claim wants a GPU and a NIC on one PCIe
// root: yes while one exists, no once it is deleted (also as a tombstone,
// or replaced under its name by another claim) or where claims ask for
// nothing of the kind.
func TestRootPairClaimsFollowEvents(t *testing.T) {
	root := ptr.To(resourceapi.FullyQualifiedName(topology.AttrPCIeRoot))
	pair := testClaim("pair", 1)
	nic := pair.Spec.Devices.Requests[0].DeepCopy()
	nic.Name, nic.Exactly.DeviceClassName = "nic", "nic"
	pair.Spec.Devices.Requests = append(pair.Spec.Devices.Requests, *nic)
	pair.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{MatchAttribute: root}}
	pair.UID = "pair-1"
	plain := testClaim("plain", 1)
	plain.UID = "plain-1"

	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), plain, pair)
	if err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return h.pl.rootPairs != nil && h.pl.rootPairsWanted(), nil
	}); err != nil {
		t.Fatal("the plugin's claim informer never told it of the claim that wants a root pair")
	}

	r := newRootPairClaims()
	events := r.handler()
	replaced := plain.DeepCopy()
	replaced.Name = "pair"
	for _, step := range []struct {
		what string
		do   func()
		want bool
	}{
		{"a plain claim added", func() { events.OnAdd(plain, true) }, false},
		{"a pair claim added", func() { events.OnAdd(pair, true) }, true},
		{"its status updated", func() { events.OnUpdate(pair, pair.DeepCopy()) }, true},
		{"replaced under its name by a plain claim", func() { events.OnUpdate(pair, replaced) }, false},
		{"added again", func() { events.OnAdd(pair, false) }, true},
		{"deleted as a tombstone", func() { events.OnDelete(cache.DeletedFinalStateUnknown{Key: "ns/pair", Obj: pair}) }, false},
		{"added, then deleted", func() { events.OnAdd(pair, false); events.OnDelete(pair) }, false},
	} {
		step.do()
		if got := r.any(); got != step.want {
			t.Errorf("%s: root pairs wanted %v, want %v", step.what, got, step.want)
		}
	}
}

// TestWaitingWholeNodePodDrainsThroughScore: PreScore reads the pending
// whole-node pods and Score applies the drain: with an 8-GPU pod waiting,
// the node closest to free is draining and a 1-GPU pod scores lower there
// than it did before the pod waited; a pod pinned to other nodes does not
// drain these.
func TestWaitingWholeNodePodDrainsThroughScore(t *testing.T) {
	nodes := []*v1.Node{testNode("node-a"), testNode("node-b")}
	h := newHarness(t, nodes, testDeviceClass(), testSlice("node-a", 8), testSlice("node-b", 8), testClaim("small", 1), testClaim("eight", 8),
		allocatedOn(testClaim("on-a", 1), "node-a", "gpu-0"), allocatedOn(testClaim("on-b", 3), "node-b", "gpu-0", "gpu-1", "gpu-2"))
	for _, c := range []string{"small", "eight", "on-a", "on-b"} {
		h.waitForClaim(c, func(*resourceapi.ResourceClaim) bool { return true })
	}
	small := testPod("small", "small")
	all := []fwk.NodeInfo{h.nodes["node-a"], h.nodes["node-b"]}
	scoreA := func() (int64, sets.Set[string]) {
		t.Helper()
		cs, filtered := h.cycle(small, "node-a", "node-b")
		for n, s := range filtered {
			if !s.IsSuccess() {
				t.Fatalf("Filter(%s): %v", n, s)
			}
		}
		if st := h.pl.PreScore(h.tCtx, cs, small, all); !st.IsSuccess() {
			t.Fatalf("PreScore: %v", st)
		}
		score, scored := h.pl.Score(h.tCtx, cs, small, h.nodes["node-a"])
		if !scored.IsSuccess() {
			t.Fatalf("Score: %v", scored)
		}
		s, err := getState(cs)
		if err != nil {
			t.Fatal(err)
		}
		return score, s.draining
	}
	before, draining := scoreA()
	if draining.Len() != 0 {
		t.Fatalf("draining %v with no pod waiting", sets.List(draining))
	}

	waitFor := func(pod *v1.Pod, want int) {
		t.Helper()
		if _, err := h.client.CoreV1().Pods(testNS).Create(h.tCtx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
			n, _ := h.pl.pending.wholeNodePods(small, h.pl.draManager.ResourceClaims().Get, all)
			return n == want, nil
		}); err != nil {
			t.Fatalf("the pending index never counted %d whole-node pods: %v", want, err)
		}
	}
	pinned := testPod("pinned", "eight")
	pinned.Spec.NodeSelector = map[string]string{"elsewhere": "true"}
	if _, err := h.client.CoreV1().Pods(testNS).Create(h.tCtx, pinned, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		h.pl.pending.mu.Lock()
		defer h.pl.pending.mu.Unlock()
		return h.pl.pending.pods[""][pinned.UID] != nil, nil
	}); err != nil {
		t.Fatalf("the pending index never saw the pinned pod: %v", err)
	}
	if got, draining := scoreA(); got != before || draining.Len() != 0 {
		t.Errorf("with a whole-node pod pinned elsewhere: node-a scores %d (before %d), draining %v; want unchanged", got, before, sets.List(draining))
	}

	waitFor(testPod("big", "eight"), 1)
	after, draining := scoreA()
	if !draining.Equal(sets.New("node-a")) {
		t.Errorf("draining %v, want node-a (one GPU in use, against three)", sets.List(draining))
	}
	if after >= before {
		t.Errorf("node-a scores %d with the 8-GPU pod waiting, %d before: want lower", after, before)
	}
}

// TestScorePrefersTheSettledNode: PreScore measures the ages of the
// nodes' pods and Score adds them: of two nodes whose placements are
// otherwise alike, the one whose pods have run longer scores higher; with
// the ages swapped, the other one does.
func TestScorePrefersTheSettledNode(t *testing.T) {
	nodes := []*v1.Node{testNode("node-a"), testNode("node-b")}
	h := newHarness(t, nodes, testDeviceClass(), testSlice("node-a", 8), testSlice("node-b", 8), testClaim("small", 1),
		allocatedOn(testClaim("on-a", 1), "node-a", "gpu-0"), allocatedOn(testClaim("on-b", 1), "node-b", "gpu-0"))
	for _, c := range []string{"small", "on-a", "on-b"} {
		h.waitForClaim(c, func(*resourceapi.ResourceClaim) bool { return true })
	}
	running := func(name, claim, node string, bound time.Time) *v1.Pod {
		p := testPod(name, claim)
		p.Spec.NodeName = node
		p.Spec.RestartPolicy = v1.RestartPolicyNever
		p.Status.Conditions = []v1.PodCondition{{Type: v1.PodScheduled, Status: v1.ConditionTrue, LastTransitionTime: metav1.NewTime(bound)}}
		return p
	}
	scores := func(boundA, boundB time.Time) (int64, int64) {
		t.Helper()
		for node, p := range map[string]*v1.Pod{"node-a": running("run-a", "on-a", "node-a", boundA), "node-b": running("run-b", "on-b", "node-b", boundB)} {
			info := framework.NewNodeInfo(p)
			info.SetNode(h.nodes[node].Node())
			h.nodes[node] = info
		}
		small := testPod("small", "small")
		cs, filtered := h.cycle(small, "node-a", "node-b")
		for n, s := range filtered {
			if !s.IsSuccess() {
				t.Fatalf("Filter(%s): %v", n, s)
			}
		}
		if st := h.pl.PreScore(h.tCtx, cs, small, []fwk.NodeInfo{h.nodes["node-a"], h.nodes["node-b"]}); !st.IsSuccess() {
			t.Fatalf("PreScore: %v", st)
		}
		a, st := h.pl.Score(h.tCtx, cs, small, h.nodes["node-a"])
		if !st.IsSuccess() {
			t.Fatalf("Score(node-a): %v", st)
		}
		b, st := h.pl.Score(h.tCtx, cs, small, h.nodes["node-b"])
		if !st.IsSuccess() {
			t.Fatalf("Score(node-b): %v", st)
		}
		return a, b
	}
	now := time.Now()
	if a, b := scores(now.Add(-time.Hour), now.Add(-time.Minute)); a <= b {
		t.Errorf("node-a's pod ran an hour, node-b's a minute: scores %d and %d, want node-a higher", a, b)
	}
	if a, b := scores(now.Add(-time.Minute), now.Add(-time.Hour)); b <= a {
		t.Errorf("node-b's pod ran an hour, node-a's a minute: scores %d and %d, want node-b higher", a, b)
	}
}

// TestPlacementEventSaysWhy: the pod's DevicesAllocated event says why
// its devices span domains, and that its node was being kept for waiting
// whole-node pods.
func TestPlacementEventSaysWhy(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("node-a")})
	s := &stateData{
		result: &allocator.Result{
			Quality:     allocator.Quality{Devices: []string{"gpu-0", "gpu-5"}},
			Explanation: &allocator.Explanation{Requests: []allocator.RequestExplanation{{Claim: "c", Request: "gpus", Reason: "devices span domains: the best domain numaNode=0 has 1 of 2 needed free devices (alignment=prefer)"}}},
		},
		draining: sets.New("node-a"),
	}
	h.pl.recordPlacement(testPod("p"), "node-a", s)
	select {
	case e := <-h.recorder.Events:
		for _, want := range []string{"allocated gpu-0, gpu-5 on node node-a (devices span domains): claim c request gpus: devices span domains: the best domain numaNode=0 has 1 of 2", "kept for waiting whole-node pods"} {
			if !strings.Contains(e, want) {
				t.Errorf("event %q does not say %q", e, want)
			}
		}
	default:
		t.Fatal("no event")
	}
}

// TestWholeNodePodWithoutDrainRule: a profile without the drain rule (no
// pending-pod index, as with LeastAllocated scoring) schedules a pod of 8
// GPUs.
func TestWholeNodePodWithoutDrainRule(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 8), testClaim("eight", 8))
	h.pl.pending = nil
	h.waitForClaim("eight", func(*resourceapi.ResourceClaim) bool { return true })
	if _, st := h.cycle(testPod("p", "eight"), "node-a"); !st["node-a"].IsSuccess() {
		t.Errorf("Filter(node-a) = %v, want success", st["node-a"])
	}
}

// TestDrainOnlyWhereTheWaitingPodFits: one driver publishes "h100" GPUs on
// node-h1 and node-h2 and "a100" GPUs on node-a1 and node-a2, eight each.
// A waiting pod that asks for 8 a100s drains no h100 node for a 1-GPU
// h100 pod, once its own PreFilter has found which nodes it cannot fill;
// before that, every node it may use counts, as for a pod whose claims
// are not known. A waiting pod that asks for 8 h100s drains the h100 node
// with fewer in use, also where that node was cordoned at its last
// attempt (a node it did not look at is judged as it is now), and one
// that asks for 16 h100s, more than a node has, drains none.
func TestDrainOnlyWhereTheWaitingPodFits(t *testing.T) {
	model := func(m string) string { return fmt.Sprintf(`device.attributes[%q].model == %q`, topology.DriverName, m) }
	objs := []runtime.Object{testDeviceClass(),
		testClaim("h100-one", 1, model("h100")), testClaim("a100-eight", 8, model("a100")), testClaim("h100-eight", 8, model("h100")),
		testClaim("h100-eight-b", 8, model("h100")), testClaim("h100-eight-c", 8, model("h100")),
		allocatedOn(testClaim("on-h1", 2), "node-h1", "gpu-0", "gpu-1"), allocatedOn(testClaim("on-h2", 1), "node-h2", "gpu-0")}
	var nodes []*v1.Node
	for _, n := range []string{"node-h1", "node-h2", "node-a1", "node-a2"} {
		nodes = append(nodes, testNode(n))
		s := testSlice(n, 8)
		m := "h100"
		if strings.HasPrefix(n, "node-a") {
			m = "a100"
		}
		for d := range s.Spec.Devices {
			s.Spec.Devices[d].Attributes["model"] = resourceapi.DeviceAttribute{StringValue: ptr.To(m)}
		}
		objs = append(objs, s)
	}
	h := newHarness(t, nodes, objs...)
	for _, c := range []string{"h100-one", "a100-eight", "h100-eight", "h100-eight-b", "h100-eight-c", "on-h1", "on-h2"} {
		h.waitForClaim(c, func(*resourceapi.ResourceClaim) bool { return true })
	}
	small := testPod("small", "h100-one")
	draining := func() sets.Set[string] {
		t.Helper()
		return h.draining(small, "node-h1", "node-h2")
	}
	waiting := h.createPending
	remove := func(pod *v1.Pod) { h.pl.pending.remove(pod) }

	a100 := testPod("a100", "a100-eight")
	waiting(a100)
	if got := draining(); !got.Equal(sets.New("node-h2")) {
		t.Errorf("a100 pod waiting, never tried: draining %v, want node-h2 (every node it may use counts)", sets.List(got))
	}
	h.cycle(a100)
	if got := draining(); got.Len() != 0 {
		t.Errorf("a100 pod waiting, tried: draining %v, want none of the h100 nodes", sets.List(got))
	}
	remove(a100)

	// Its latest attempt ran while node-h2 was cordoned: once the cordon
	// is gone, node-h2 counts again.
	h100 := testPod("h100", "h100-eight")
	waiting(h100)
	h.nodes["node-h2"].Node().Spec.Unschedulable = true
	h.cycle(h100)
	h.nodes["node-h2"].Node().Spec.Unschedulable = false
	if got := draining(); !got.Equal(sets.New("node-h2")) {
		t.Errorf("h100 pod waiting: draining %v, want node-h2 (one GPU in use, against two)", sets.List(got))
	}
	remove(h100)

	sixteen := testPod("sixteen", "h100-eight-b", "h100-eight-c")
	waiting(sixteen)
	h.cycle(sixteen)
	if got := draining(); got.Len() != 0 {
		t.Errorf("pod for 16 h100s waiting: draining %v, want none (no node has 16)", sets.List(got))
	}
}

// TestWholeNodeOfFourGPUs: eight nodes of four GPUs, node-a with 2 free,
// node-b with 3, node-h empty, the rest full. With wholeNodeDevices 4 a
// waiting 4-GPU pod is a whole-node pod: a 1-GPU pod finds node-b (fewer
// in use) draining, and the 4-GPU pod keeps the full headroom (8 of 32 at
// 25 %), so it may not take node-h and leave 5. With the default of 8 the
// 4-GPU pod drains nothing and keeps a quarter of it (2): node-h is its.
func TestWholeNodeOfFourGPUs(t *testing.T) {
	for _, tc := range []struct {
		whole        int
		wantDraining sets.Set[string]
		wantHeld     bool
	}{
		{4, sets.New("node-b"), true},
		{8, sets.New[string](), false},
	} {
		t.Run(fmt.Sprintf("whole node of %d", tc.whole), func(t *testing.T) {
			var nodes []*v1.Node
			objs := []runtime.Object{testDeviceClass(), testClaim("one", 1), testClaim("four", 4)}
			for _, n := range []string{"node-a", "node-b", "node-c", "node-d", "node-e", "node-f", "node-g", "node-h"} {
				nodes = append(nodes, testNode(n))
				objs = append(objs, testSlice(n, 4))
			}
			objs = append(objs, allocatedOn(testClaim("on-a", 2), "node-a", "gpu-0", "gpu-1"), allocatedOn(testClaim("on-b", 1), "node-b", "gpu-0"))
			for _, n := range []string{"node-c", "node-d", "node-e", "node-f", "node-g"} {
				objs = append(objs, allocatedOn(testClaim("full-"+n, 4), n, gpuNames(0, 4)...))
			}
			h := newHarness(t, nodes, objs...)
			h.pl.policy.WholeNode, h.pl.pending.wholeNode = tc.whole, tc.whole
			h.pl.headroomPercent = 25
			for _, c := range []string{"one", "four", "on-a", "on-b", "full-node-g"} {
				h.waitForClaim(c, func(*resourceapi.ResourceClaim) bool { return true })
			}
			big := testPod("big", "four")
			h.createPending(big)
			if got := h.draining(testPod("small", "one"), "node-a", "node-b"); !got.Equal(tc.wantDraining) {
				t.Errorf("draining %v, want %v", sets.List(got), sets.List(tc.wantDraining))
			}
			_, st := h.cycle(big, "node-h")
			held := code(st["node-h"]) == fwk.UnschedulableAndUnresolvable && strings.Contains(st["node-h"].Message(), "keeping 8 of the 32")
			if held != tc.wantHeld || !held && !st["node-h"].IsSuccess() {
				t.Errorf("Filter(node-h) for 4 GPUs = %v, want held back by the full headroom: %v", st["node-h"], tc.wantHeld)
			}
		})
	}
}

// TestPlacementEventFitsTheAPI: the DevicesAllocated event names each
// pool once, and a longer one is cut to what the API server accepts (it
// refuses a longer note, and the event would be lost).
func TestPlacementEventFitsTheAPI(t *testing.T) {
	node := "ip-10-0-123-45.us-west-2.compute.internal-with-a-longer-suffix"
	h := newHarness(t, []*v1.Node{testNode(node)})
	var devices []string
	for i := range 8 {
		devices = append(devices, fmt.Sprintf("gpu.topodra.io/%s/gpu-%d", node, i), fmt.Sprintf("dra.net/%s/nic-%d", node, i))
	}
	h.pl.recordPlacement(testPod("p"), node, &stateData{result: &allocator.Result{Quality: allocator.Quality{Devices: devices}}})
	select {
	case e := <-h.recorder.Events:
		// The fake recorder writes "<type> <reason> <note>".
		note := strings.TrimPrefix(e, "Normal DevicesAllocated ")
		if len(note) > eventnote.Limit {
			t.Errorf("note of %d bytes (limit %d): %q", len(note), eventnote.Limit, note)
		}
		// Each pool once.
		want := "allocated gpu.topodra.io/" + node + ": gpu-0, gpu-1, gpu-2, gpu-3, gpu-4, gpu-5, gpu-6, gpu-7; dra.net/" + node + ": nic-0, nic-1, nic-2, nic-3, nic-4, nic-5, nic-6, nic-7 on node " + node
		if !strings.HasPrefix(note, want) {
			t.Errorf("note %q, want it to start with %q", note, want)
		}
	default:
		t.Fatal("no event")
	}
	// However many pools, the note is cut.
	devices = nil
	for i := range 40 {
		devices = append(devices, fmt.Sprintf("gpu.topodra.io/%s-%d/gpu-0", node, i))
	}
	h.pl.recordPlacement(testPod("q"), node, &stateData{result: &allocator.Result{Quality: allocator.Quality{Devices: devices}}})
	select {
	case e := <-h.recorder.Events:
		if note := strings.TrimPrefix(e, "Normal DevicesAllocated "); len(note) > eventnote.Limit || !strings.HasSuffix(note, "...") {
			t.Errorf("note of %d bytes (limit %d), want it cut: %q", len(note), eventnote.Limit, note)
		}
	default:
		t.Fatal("no event")
	}
}

// TestInvalidWholeNodePodDrainsNothing: a waiting pod whose claims ask for
// a whole node but cannot be allocated anywhere until they are fixed (a
// device class that does not exist, more devices than an allocation may
// hold, a selector that fails at run time) makes no node drain after its
// attempt; the attempt after the fix counts it again.
func TestInvalidWholeNodePodDrainsNothing(t *testing.T) {
	missingClass := testClaim("missing-class", 8)
	missingClass.Spec.Devices.Requests[0].Exactly.DeviceClassName = "later"
	objs := []runtime.Object{testDeviceClass(), testClaim("one", 1),
		missingClass, testClaim("forty", 40),
		testClaim("fails-at-run-time", 8, `device.attributes["gpu.topodra.io"].noSuchAttribute == "x"`),
		allocatedOn(testClaim("on-1", 2), "node-1", "gpu-0", "gpu-1"), allocatedOn(testClaim("on-2", 1), "node-2", "gpu-0")}
	var nodes []*v1.Node
	for _, n := range []string{"node-1", "node-2"} {
		nodes = append(nodes, testNode(n))
		objs = append(objs, testSlice(n, 8))
	}
	h := newHarness(t, nodes, objs...)
	for _, c := range []string{"one", "missing-class", "forty", "fails-at-run-time", "on-1", "on-2"} {
		h.waitForClaim(c, func(*resourceapi.ResourceClaim) bool { return true })
	}
	small := testPod("small", "one")
	all := []fwk.NodeInfo{h.nodes["node-1"], h.nodes["node-2"]}
	attempt := func(pod *v1.Pod) {
		t.Helper()
		cs := framework.NewCycleState()
		if _, st := h.pl.PreFilter(h.tCtx, cs, pod, all); st.IsSuccess() {
			for _, n := range all {
				h.pl.Filter(h.tCtx, cs, pod, n)
			}
		}
	}
	for _, name := range []string{"missing-class", "forty", "fails-at-run-time"} {
		pod := testPod("waits-"+name, name)
		h.createPending(pod)
		if got := h.draining(small, "node-1", "node-2"); !got.Equal(sets.New("node-2")) {
			t.Errorf("%s: never tried: draining %v, want node-2 (one GPU in use, against two)", name, sets.List(got))
		}
		attempt(pod)
		if got := h.draining(small, "node-1", "node-2"); got.Len() != 0 {
			t.Errorf("%s: tried, its claim invalid: draining %v, want none", name, sets.List(got))
		}
		if name == "missing-class" {
			class := testDeviceClass()
			class.Name = "later"
			h.create(class)
			if err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
				_, err := h.pl.draManager.DeviceClasses().Get("later")
				return err == nil, nil
			}); err != nil {
				t.Fatalf("device class never seen: %v", err)
			}
			attempt(pod)
			if got := h.draining(small, "node-1", "node-2"); !got.Equal(sets.New("node-2")) {
				t.Errorf("%s: tried again once the class exists: draining %v, want node-2", name, sets.List(got))
			}
		}
		h.pl.pending.remove(pod)
	}
}
