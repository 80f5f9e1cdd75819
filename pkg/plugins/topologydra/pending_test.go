package topologydra

import (
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/cache"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/allocator"
	"github.com/topodra/topodra/pkg/plugins/topologydra/apis/config"
)

func TestPendingIndexCountsWholeNodePods(t *testing.T) {
	claims := map[string]*resourceapi.ResourceClaim{}
	claimOf := func(name string, count int64, allocated bool) {
		c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: testNS, Name: name}}
		c.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: testClass, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count}}}
		if allocated {
			c.Status.Allocation = &resourceapi.AllocationResult{}
		}
		claims[name] = c
	}
	get := func(ns, name string) (*resourceapi.ResourceClaim, error) {
		if c, ok := claims[name]; ok {
			return c, nil
		}
		return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "resourceclaims"}, name)
	}
	pod := func(name, sched, node string, claimNames ...string) *v1.Pod {
		p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: testNS, Name: name, UID: types.UID(name)}}
		p.Spec.SchedulerName, p.Spec.NodeName = sched, node
		for _, c := range claimNames {
			p.Spec.ResourceClaims = append(p.Spec.ResourceClaims, v1.PodResourceClaim{Name: c, ResourceClaimName: ptr.To(c)})
		}
		return p
	}
	nodeInfo := func(name, group string) fwk.NodeInfo {
		ni := framework.NewNodeInfo()
		ni.SetNode(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"group": group}}})
		return ni
	}
	nodes := []fwk.NodeInfo{nodeInfo("node-1", "a"), nodeInfo("node-2", "b")}
	ix := newPendingIndex()
	ix.profile = "s"
	h := ix.handler()
	self := pod("self", "s", "", "small")
	claimOf("small", 2, false)
	claimOf("eight", 8, false)
	claimOf("four-a", 4, false)
	claimOf("four-b", 4, false)
	claimOf("done", 8, true)
	claimOf("four-gpus-four-nics", 4, false)
	claims["four-gpus-four-nics"].Spec.Devices.Requests = append(claims["four-gpus-four-nics"].Spec.Devices.Requests,
		resourceapi.DeviceRequest{Name: "nic", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "nic", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 4}})
	h.OnAdd(self, false)
	h.OnAdd(pod("big", "s", "", "eight"), false)
	h.OnAdd(pod("split", "s", "", "four-a", "four-b"), false) // 8 in two claims
	h.OnAdd(pod("allocated", "s", "", "done"), false)
	h.OnAdd(pod("unknown", "s", "", "not-created-yet"), false)
	h.OnAdd(pod("other-scheduler", "other", "", "eight"), false)
	h.OnAdd(pod("bound", "s", "node-1", "eight"), false)
	h.OnAdd(pod("no-claims", "s", ""), false)
	h.OnAdd(pod("half-node-with-nics", "s", "", "four-gpus-four-nics"), false) // 4 of each class
	if got, _ := ix.wholeNodePods(self, get, nodes); got != 2 {
		t.Errorf("whole-node pods waiting = %d, want 2 (big and split; not self, allocated, unknown, another scheduler's, bound, 4 GPUs + 4 NICs)", got)
	}

	claimOf("not-created-yet", 8, false)
	if got, _ := ix.wholeNodePods(self, get, nodes); got != 3 {
		t.Errorf("after its claim appeared: %d, want 3", got)
	}
	big := pod("big", "s", "node-2", "eight")
	h.OnUpdate(pod("big", "s", "", "eight"), big)
	h.OnDelete(cache.DeletedFinalStateUnknown{Key: "ns/split", Obj: pod("split", "s", "", "four-a", "four-b")})
	if got, _ := ix.wholeNodePods(self, get, nodes); got != 1 {
		t.Errorf("after one was bound and one deleted: %d, want 1", got)
	}
	// The index of profile "s" keeps no pod of another scheduler.
	if got, _ := ix.wholeNodePods(pod("x", "other", "", "small"), get, nodes); got != 0 {
		t.Errorf("for the other scheduler: %d, want 0", got)
	}

	// A waiting pod pinned to other nodes does not count for these.
	claimOf("pinned-eight", 8, false)
	pinned := pod("pinned", "s", "", "pinned-eight")
	pinned.Spec.NodeSelector = map[string]string{"group": "c"}
	h.OnAdd(pinned, false)
	if got, _ := ix.wholeNodePods(self, get, nodes); got != 1 {
		t.Errorf("with a whole-node pod pinned to group c: %d, want 1", got)
	}
	if got, _ := ix.wholeNodePods(self, get, append(nodes, nodeInfo("node-3", "c"))); got != 2 {
		t.Errorf("with a node of group c among the candidates: %d, want 2", got)
	}
	// Only the nodes some waiting pod may use are admitted.
	if got, admitted := ix.wholeNodePods(self, get, append(nodes, nodeInfo("node-3", "c"))); got != 2 || !admitted.Equal(sets.New("node-1", "node-2", "node-3")) {
		t.Errorf("admitted nodes: %v (%d waiting), want all three", sets.List(admitted), got)
	}
	h.OnDelete(pod("unknown", "s", "", "not-created-yet"))
	if got, admitted := ix.wholeNodePods(self, get, append(nodes, nodeInfo("node-3", "c"))); got != 1 || !admitted.Equal(sets.New("node-3")) {
		t.Errorf("with only the pod pinned to group c waiting: %d, admitted %v, want 1 and node-3", got, sets.List(admitted))
	}

	// A pod held back by a scheduling gate does not wait to be scheduled;
	// once the gate is gone, its node selector as updated counts.
	claimOf("gated-eight", 8, false)
	gated := pod("gated", "s", "", "gated-eight")
	gated.Spec.SchedulingGates = []v1.PodSchedulingGate{{Name: "example.com/quota"}}
	h.OnAdd(gated, false)
	if got, _ := ix.wholeNodePods(self, get, nodes); got != 0 {
		t.Errorf("with a gated whole-node pod (and one pinned elsewhere): %d, want 0", got)
	}
	admittedPod := pod("gated", "s", "", "gated-eight")
	admittedPod.Spec.NodeSelector = map[string]string{"group": "c"}
	h.OnUpdate(gated, admittedPod)
	if got, _ := ix.wholeNodePods(self, get, nodes); got != 0 {
		t.Errorf("with the pod released to group c only: %d, want 0", got)
	}
	unpinned := admittedPod.DeepCopy()
	unpinned.Spec.NodeSelector = nil
	h.OnUpdate(admittedPod, unpinned)
	if got, _ := ix.wholeNodePods(self, get, nodes); got != 1 {
		t.Errorf("with its node selector removed: %d, want 1", got)
	}
	// A node the waiting pod may not use (a taint it does not tolerate,
	// a cordon) is not admitted: nothing drains there for it.
	tainted, cordoned := nodeInfo("node-4", "a"), nodeInfo("node-5", "a")
	tainted.Node().Spec.Taints = []v1.Taint{{Key: "dedicated", Value: "x", Effect: v1.TaintEffectNoSchedule}}
	cordoned.Node().Spec.Unschedulable = true
	if got, admitted := ix.wholeNodePods(self, get, []fwk.NodeInfo{tainted, cordoned}); got != 0 || admitted.Len() != 0 {
		t.Errorf("with only a tainted and a cordoned node: %d waiting, admitted %v, want none", got, sets.List(admitted))
	}
	tolerant := unpinned.DeepCopy()
	tolerant.Spec.Tolerations = []v1.Toleration{{Key: "dedicated", Operator: v1.TolerationOpExists}}
	h.OnUpdate(unpinned, tolerant)
	if got, admitted := ix.wholeNodePods(self, get, []fwk.NodeInfo{tainted, cordoned}); got != 1 || !admitted.Equal(sets.New("node-4")) {
		t.Errorf("with the pod tolerating the taint: %d waiting, admitted %v, want 1 and node-4", got, sets.List(admitted))
	}
}

func TestDrainingNodes(t *testing.T) {
	s := &stateData{results: map[string]*allocator.Result{}}
	var nodes []fwk.NodeInfo
	add := func(name string, devices, inUse int) {
		s.results[name] = &allocator.Result{Quality: allocator.Quality{NodeDevices: devices, NodeInUse: inUse}}
		info := framework.NewNodeInfo()
		info.SetNode(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}})
		nodes = append(nodes, info)
	}
	add("d", 8, 5)
	add("c", 8, 2)
	add("b", 8, 2)
	add("small", 2, 0) // too small for a whole-node pod
	add("a", 8, 7)
	info := framework.NewNodeInfo()
	info.SetNode(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "infeasible"}})
	nodes = append(nodes, info)
	for waiting, want := range map[int][]string{1: {"b"}, 2: {"b", "c"}, 3: {"b", "c", "d"}, 9: {"a", "b", "c", "d"}} {
		t.Run(fmt.Sprint(waiting), func(t *testing.T) {
			got := drainingNodes(s, nodes, waiting, nodeAges{}, allNames(nodes), 8)
			if !got.Equal(sets.New(want...)) {
				t.Errorf("draining = %v, want %v", got.UnsortedList(), want)
			}
		})
	}
	// Every node with a result draining: the small one is not; without
	// it they all are.
	all := drainingNodes(s, nodes, 9, nodeAges{}, allNames(nodes), 8)
	if drainsAll(s, nodes, all) {
		t.Errorf("drainsAll with the small node free of marks: true")
	}
	var big []fwk.NodeInfo
	for _, n := range nodes {
		if n.Node().Name != "small" {
			big = append(big, n)
		}
	}
	if !drainsAll(s, big, all) {
		t.Errorf("drainsAll over the four nodes that drain: false")
	}
	if drainsAll(s, big, drainingNodes(s, big, 3, nodeAges{}, allNames(big), 8)) {
		t.Errorf("drainsAll with three of four draining: true")
	}
	// Only nodes a waiting pod may use drain: b and c are not admitted.
	if got := drainingNodes(s, nodes, 2, nodeAges{}, sets.New("a", "d", "small"), 8); !got.Equal(sets.New("a", "d")) {
		t.Errorf("draining among a, d and small = %v, want a and d", sets.List(got))
	}
}

func TestDrainTradeLowersDrainingNodes(t *testing.T) {
	args := *DefaultArgs()
	p := policyFromArgs(args)
	pair := []string{"a", "b"}
	rootPair := allocator.Quality{Devices: pair, Shared: 3, Room: 0.95, Packing: 0.3}
	numaPair := allocator.Quality{Devices: pair, Shared: 2, Room: 0.95, Packing: 0.6}
	spanning := allocator.Quality{Devices: pair, Shared: 1, Room: 1, Packing: 0.8}
	if p.ScoreOn(rootPair, true) >= p.ScoreOn(numaPair, false) {
		t.Errorf("a root pair on a draining node (%d) should lose to a NUMA pair elsewhere (%d)", p.ScoreOn(rootPair, true), p.ScoreOn(numaPair, false))
	}
	if p.RankOn(numaPair, true) != 1 {
		t.Errorf("draining never lowers below rank 1: got %d", p.RankOn(numaPair, true))
	}
	if unaligned := (allocator.Quality{Devices: pair, Shared: 0, Room: 1, Packing: 1}); p.ScoreOn(spanning, true) <= p.ScoreOn(unaligned, false) {
		t.Error("an aligned placement on a draining node should still beat one that shares no domain")
	}
	if p.ScoreOn(rootPair, false) != p.Score(rootPair) {
		t.Error("ScoreOn(q, false) should be Score(q)")
	}
	args.DrainTrade = 0
	strict := policyFromArgs(args)
	if strict.RankOn(rootPair, true) != 3 {
		t.Errorf("drainTrade 0 keeps the rank on a draining node: got %d", strict.RankOn(rootPair, true))
	}
	if strict.ScoreOn(rootPair, true) <= strict.ScoreOn(numaPair, false) {
		t.Error("drainTrade 0: the better rank on a draining node should still win")
	}
	sameRank := allocator.Quality{Devices: pair, Shared: 3, Room: 0.95, Packing: 0.1}
	if strict.ScoreOn(rootPair, true) >= strict.Score(sameRank) {
		t.Errorf("within one rank the draining node (%d) should come last, even against an emptier node (%d)", strict.ScoreOn(rootPair, true), strict.Score(sameRank))
	}
	args.DrainTrade = 2
	args.ScoringStrategy = config.LeastAllocated
	if spread := policyFromArgs(args); spread.RankOn(rootPair, true) != 3 {
		t.Error("draining only counts when packing")
	}
}

func TestSettlednessAndDrainingByAge(t *testing.T) {
	now := time.Now()
	self := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "self", UID: "self", CreationTimestamp: metav1.NewTime(now.Add(-time.Hour))}}
	self.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "c"}}
	pod := func(name string, age time.Duration, claims bool) *v1.Pod {
		p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID(name), CreationTimestamp: metav1.NewTime(now.Add(-age))}}
		p.Status.Conditions = []v1.PodCondition{{Type: v1.PodScheduled, Status: v1.ConditionTrue, LastTransitionTime: metav1.NewTime(now.Add(-age))}}
		if claims {
			p.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "c"}}
		}
		return p
	}
	s := &stateData{results: map[string]*allocator.Result{}}
	var nodes []fwk.NodeInfo
	add := func(name string, inUse int, pods ...*v1.Pod) {
		s.results[name] = &allocator.Result{Quality: allocator.Quality{NodeDevices: 8, NodeInUse: inUse}}
		info := framework.NewNodeInfo(pods...)
		info.SetNode(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}})
		nodes = append(nodes, info)
	}
	add("old", 1, pod("service", 40*time.Minute, true), pod("young", time.Minute, true))
	// A pod that waited long counts from its binding, not its creation.
	waited := pod("waited", 60*time.Minute, true)
	waited.Status.Conditions = []v1.PodCondition{{Type: v1.PodScheduled, Status: v1.ConditionTrue, LastTransitionTime: metav1.NewTime(now.Add(-2 * time.Minute))}}
	// A pod placed but not seen bound yet (assumed, or waiting in
	// PreBind) has only just been placed, however long it waited before.
	assumed := pod("assumed", 60*time.Minute, true)
	assumed.Status.Conditions = nil
	add("young", 3, pod("job-1", 10*time.Minute, true), pod("job-2", 5*time.Minute, true), pod("no-claims", 50*time.Minute, false), waited, assumed)
	add("empty", 0)
	add("self-only", 0, self) // the pod being placed does not count

	ages := agesOf(nodes, self, now, nil)
	want := map[string]float64{"old": 1, "young": 0.25, "empty": 0, "self-only": 0}
	for name, w := range want {
		if got := ages.settled(name); math.Abs(got-w) > 1e-9 {
			t.Errorf("settled[%s] = %v, want %v", name, got, w)
		}
	}
	// Nodes whose pods are youngest drain first, whatever their count in
	// use: the node of the long-running service is never a target while
	// another node can take the waiting pod.
	if got := drainingNodes(s, nodes, 3, ages, allNames(nodes), 8); !got.Equal(sets.New("empty", "self-only", "young")) {
		t.Errorf("draining by age = %v, want empty, self-only, young", sets.List(got))
	}
	if got := drainingNodes(s, nodes, 3, nodeAges{}, allNames(nodes), 8); !got.Equal(sets.New("empty", "self-only", "old")) {
		t.Errorf("draining by devices in use = %v, want empty, self-only, old", sets.List(got))
	}

	// With AgeWeight (the default), a small pod goes beside the
	// long-running pod when the placements are otherwise equal.
	args := *DefaultArgs()
	if args.AgeWeight == 0 {
		t.Fatal("ageWeight is off by default")
	}
	p := policyFromArgs(args)
	q := allocator.Quality{Devices: []string{"a"}, Shared: 3, Room: 0.95, Packing: 0.5}
	atOld, atYoung := q, q
	atOld.Settled, atYoung.Settled = ages.settled("old"), ages.settled("young")
	if p.ScoreOn(atOld, false) <= p.ScoreOn(atYoung, false) {
		t.Errorf("beside the older pods %d, beside the younger %d: want higher beside the older", p.ScoreOn(atOld, false), p.ScoreOn(atYoung, false))
	}
	// Alignment still comes first.
	looser := atOld
	looser.Shared = 2
	if p.ScoreOn(looser, false) >= p.ScoreOn(atYoung, false) {
		t.Errorf("a looser placement beside old pods (%d) beat a tighter one (%d)", p.ScoreOn(looser, false), p.ScoreOn(atYoung, false))
	}
	// Without AgeWeight, age does not count.
	args.AgeWeight = 0
	p0 := policyFromArgs(args)
	if p0.ScoreOn(atOld, false) != p0.ScoreOn(atYoung, false) {
		t.Error("age counted with AgeWeight 0")
	}
}

// A node that holds a pod that runs until deleted (restartPolicy Always:
// a service) never drains, whatever the ages: it counts as more settled
// than any node of Jobs' pods and comes last among the draining nodes.
func TestPodsThatRunUntilDeletedSettleNodes(t *testing.T) {
	now := time.Now()
	self := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "self", UID: "self"}}
	pod := func(name string, age time.Duration, restart v1.RestartPolicy) *v1.Pod {
		p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID(name), CreationTimestamp: metav1.NewTime(now.Add(-age))}}
		p.Status.Conditions = []v1.PodCondition{{Type: v1.PodScheduled, Status: v1.ConditionTrue, LastTransitionTime: metav1.NewTime(now.Add(-age))}}
		p.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "c"}}
		p.Spec.RestartPolicy = restart
		return p
	}
	s := &stateData{results: map[string]*allocator.Result{}}
	var nodes []fwk.NodeInfo
	add := func(name string, pods ...*v1.Pod) {
		s.results[name] = &allocator.Result{Quality: allocator.Quality{NodeDevices: 8, NodeInUse: len(pods)}}
		info := framework.NewNodeInfo(pods...)
		info.SetNode(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}})
		nodes = append(nodes, info)
	}
	add("jobs-old", pod("job-1", 40*time.Minute, v1.RestartPolicyNever))
	add("jobs-young", pod("job-2", 10*time.Minute, v1.RestartPolicyOnFailure))
	add("service", pod("server", 5*time.Minute, v1.RestartPolicyAlways), pod("job-3", 20*time.Minute, v1.RestartPolicyNever))
	add("empty")

	ages := agesOf(nodes, self, now, nil)
	want := map[string]float64{"service": 1, "jobs-old": 0.5, "jobs-young": 0.125, "empty": 0}
	for name, w := range want {
		if got := ages.settled(name); math.Abs(got-w) > 1e-9 {
			t.Errorf("settled[%s] = %v, want %v", name, got, w)
		}
	}
	for k, w := range map[int]sets.Set[string]{
		2: sets.New("empty", "jobs-young"),
		3: sets.New("empty", "jobs-young", "jobs-old"),
		4: sets.New("empty", "jobs-young", "jobs-old", "service"),
	} {
		if got := drainingNodes(s, nodes, k, ages, allNames(nodes), 8); !got.Equal(w) {
			t.Errorf("%d draining = %v, want %v", k, sets.List(got), sets.List(w))
		}
	}

	// Where every node's pods run until deleted (bare pods default to
	// restartPolicy Always), age alone decides, as without the rule.
	nodes, s.results = nil, map[string]*allocator.Result{}
	add("old", pod("a", 40*time.Minute, ""))
	add("young", pod("b", 10*time.Minute, v1.RestartPolicyAlways))
	ages = agesOf(nodes, self, now, nil)
	if got := ages.settled("young"); math.Abs(got-0.25) > 1e-9 {
		t.Errorf("all lasting: settled[young] = %v, want 0.25", got)
	}
	if got := drainingNodes(s, nodes, 1, ages, allNames(nodes), 8); !got.Equal(sets.New("young")) {
		t.Errorf("all lasting: draining = %v, want young", sets.List(got))
	}
}

// allNames is the set of the nodes' names: every node admitted.
func allNames(nodes []fwk.NodeInfo) sets.Set[string] {
	out := sets.New[string]()
	for _, n := range nodes {
		out.Insert(n.Node().Name)
	}
	return out
}

// TestPlacedWholeNodePodIsNotWaiting: once Reserve has given a whole-node
// pod its devices (PreBind still writing them), the next pod's PreScore
// no longer counts it as waiting: no node drains for it.
func TestPlacedWholeNodePodIsNotWaiting(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("n1"), testNode("n2")}, testDeviceClass(), testSlice("n1", 8), testSlice("n2", 8),
		testClaim("eight", 8), testClaim("one", 1))
	h.waitForClaim("eight", func(*resourceapi.ResourceClaim) bool { return true })
	h.waitForClaim("one", func(*resourceapi.ResourceClaim) bool { return true })
	whole, small := testPod("whole", "eight"), testPod("small", "one")
	h.pl.pending.handler().OnAdd(whole, false)
	h.pl.pending.handler().OnAdd(small, false)
	draining := func() sets.Set[string] {
		t.Helper()
		return h.draining(small, "n1", "n2")
	}
	if d := draining(); d.Len() != 1 {
		t.Fatalf("with the whole-node pod waiting: draining %v, want one node", sets.List(d))
	}
	h.reserve(whole, "n1")
	if d := draining(); d.Len() != 0 {
		t.Errorf("after the whole-node pod's Reserve: draining %v, want none", sets.List(d))
	}
}

// TestReplacedPodForgotten: a pod deleted and created again under its
// name while the informer lists anew comes as an update with another UID.
// The pending index, the bind clock and the held-back pods forget the old
// pod as on its deletion.
func TestReplacedPodForgotten(t *testing.T) {
	pod := func(uid, node string) *v1.Pod {
		p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: testNS, Name: "worker-0", UID: types.UID(uid)}}
		p.Spec.SchedulerName, p.Spec.NodeName = "s", node
		p.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "c", ResourceClaimName: ptr.To("c")}}
		return p
	}
	old, replacement := pod("uid-1", ""), pod("uid-2", "node-1")

	ix := newPendingIndex()
	ix.handler().OnAdd(old, false)
	ix.handler().OnUpdate(old, replacement)
	ix.mu.Lock()
	_, stale := ix.pods["s"][old.UID]
	ix.mu.Unlock()
	if stale {
		t.Error("the pending index keeps the replaced pod")
	}

	clock := newBindClock()
	clock.handler().OnUpdate(old, pod("uid-1", "node-1"))
	clock.handler().OnUpdate(pod("uid-1", "node-1"), replacement)
	if _, ok := clock.boundAt(pod("uid-1", "node-1")); ok {
		t.Error("the bind clock keeps the replaced pod")
	}
	if _, ok := clock.boundAt(replacement); !ok {
		t.Error("the bind clock has no time for the bound replacement")
	}

	h := newHarness(t, nil)
	if _, err := h.client.CoreV1().Pods(testNS).Create(h.tCtx, old, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.pl.heldBack.lister = h.podLister
	if err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		_, err := h.podLister.Pods(testNS).Get(old.Name)
		return err == nil, nil
	}); err != nil {
		t.Fatalf("the pod lister never saw the pod: %v", err)
	}
	h.pl.heldBack.hold(old)
	if !h.pl.heldBack.held(old.UID) {
		t.Fatal("the pod is not held back")
	}
	h.pl.heldBack.handler().OnUpdate(old, replacement)
	if h.pl.heldBack.held(old.UID) {
		t.Error("the held-back pods keep the replaced pod")
	}
}
