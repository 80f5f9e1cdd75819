package topologydra

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	"k8s.io/utils/ptr"
)

// reservedFor reserves claim for pod.
func reservedFor(claim *resourceapi.ResourceClaim, pod *v1.Pod) *resourceapi.ResourceClaim {
	claim.Status.ReservedFor = append(claim.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{Resource: "pods", Name: pod.Name, UID: pod.UID})
	return claim
}

func podInfo(t *testing.T, pod *v1.Pod) fwk.PodInfo {
	t.Helper()
	pi, err := framework.NewPodInfo(pod)
	if err != nil {
		t.Fatal(err)
	}
	return pi
}

func devicesOfResult(s *stateData, node string) []string {
	res := s.getResult(node)
	if res == nil {
		return nil
	}
	var out []string
	for _, a := range res.Allocations {
		for _, r := range a.Devices.Results {
			out = append(out, r.Device)
		}
	}
	return out
}

// TestPreemptionTrials: Filter in preemption's trials. A node's four GPUs
// are held by a victim's claim (two), by a claim whose pod is gone (one,
// not deallocated yet) and by a running pod's claim (one). The pod needs
// one GPU: it fails with a status that lets preemption try where it has a
// higher priority than the pods holding claims; it fits in the
// trial that removes the victim, and in the one that gives the victim
// back too, on the gone pod's GPU; the trials' results are not kept for
// Reserve.
func TestPreemptionTrials(t *testing.T) {
	victim := testPod("victim", "victim-claim")
	victim.Spec.NodeName = "node-a"
	other := testPod("other", "other-claim")
	other.Spec.NodeName = "node-a"
	gone := testPod("gone")
	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 4),
		reservedFor(allocatedOn(testClaim("victim-claim", 2), "node-a", "gpu-0", "gpu-1"), victim),
		reservedFor(allocatedOn(testClaim("gone-claim", 1), "node-a", "gpu-2"), gone),
		testClaim("want", 1))
	victim = h.createSeen(victim)
	other = h.createSeen(other)
	h.create(reservedFor(allocatedOn(testClaim("other-claim", 1), "node-a", "gpu-3"), other))
	h.waitForClaim("other-claim", func(*resourceapi.ResourceClaim) bool { return true })
	// The victim's claim names the pod's API UID.
	claim := h.apiClaim("victim-claim")
	claim.Status.ReservedFor[0].UID = victim.UID
	if _, err := h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(h.tCtx, claim, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitForClaim("victim-claim", func(c *resourceapi.ResourceClaim) bool { return c.Status.ReservedFor[0].UID == victim.UID })
	h.nodes["node-a"].AddPodInfo(podInfo(t, victim))
	h.nodes["node-a"].AddPodInfo(podInfo(t, other))

	// Of the priority of the node's pods: preemption finds no victim
	// there, and is not asked to try.
	pod := testPod("p", "want")
	if _, st := h.cycle(pod, "node-a"); st["node-a"].Code() != fwk.UnschedulableAndUnresolvable {
		t.Errorf("full node, no pod of lower priority: %v, want UnschedulableAndUnresolvable", st["node-a"])
	}
	pod.Spec.Priority = ptr.To[int32](100)
	cs, st := h.cycle(pod, "node-a")
	if st["node-a"].Code() != fwk.Unschedulable {
		t.Fatalf("full node: %v, want Unschedulable (preemption may help)", st["node-a"])
	}
	s, _ := getState(cs)

	trial := cs.Clone()
	if st := h.pl.RemovePod(h.tCtx, trial, pod, podInfo(t, victim), h.nodes["node-a"]); !st.IsSuccess() {
		t.Fatal(st)
	}
	if st := h.pl.Filter(h.tCtx, trial, pod, h.nodes["node-a"]); !st.IsSuccess() {
		t.Fatalf("victim removed: %v", st)
	}
	if got := devicesOfResult(s, "node-a"); got != nil {
		t.Errorf("a trial's result was kept: %v", got)
	}
	if st := h.pl.AddPod(h.tCtx, trial, pod, podInfo(t, victim), h.nodes["node-a"]); !st.IsSuccess() {
		t.Fatal(st)
	}
	// Reprieved: what is left is the gone pod's GPU, which its claim
	// gives back once the claim controller gets to it.
	if st := h.pl.Filter(h.tCtx, trial, pod, h.nodes["node-a"]); !st.IsSuccess() {
		t.Errorf("victim given back, the gone pod's GPU freed: %v", st)
	}
	// A trial that removes a pod without claims frees nothing of its
	// own, and the gone pod's GPU only in a trial that removes pods.
	if st := h.pl.Filter(h.tCtx, cs, pod, h.nodes["node-a"]); st.Code() != fwk.Unschedulable {
		t.Errorf("the cycle's own state after the trials: %v", st)
	}
	if got := devicesOfResult(s, "node-a"); got != nil {
		t.Errorf("a trial's result was kept: %v", got)
	}

	// Without a pod lister the gone pod's claim cannot be told from one
	// in use: the reprieved trial fails.
	h.pl.pods = nil
	cs, _ = h.cycle(pod, "node-a")
	trial = cs.Clone()
	h.pl.RemovePod(h.tCtx, trial, pod, podInfo(t, victim), h.nodes["node-a"])
	h.pl.AddPod(h.tCtx, trial, pod, podInfo(t, victim), h.nodes["node-a"])
	if st := h.pl.Filter(h.tCtx, trial, pod, h.nodes["node-a"]); st.Code() != fwk.Unschedulable {
		t.Errorf("victim given back, the gone pod's claim counted as in use: %v", st)
	}
}

// TestNominatedPodKeepsItsDevices: a pod nominated to the node (higher
// priority, not bound, its claim not allocated) takes in Filter's first
// pass the devices it would get; the scheduled pod's result of that pass
// is the one Reserve uses, also after the pass without it.
func TestNominatedPodKeepsItsDevices(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 4),
		allocatedOn(testClaim("held", 2), "node-a", "gpu-0", "gpu-1"),
		testClaim("nominated-claim", 1), testClaim("want", 1), testClaim("want-two", 2))
	nominated := testPod("nominated", "nominated-claim")
	nominated.UID = types.UID("pod-nominated")

	// Without the nominated pod the pod gets this device.
	_, _ = h.cycle(testPod("alone", "want"), "node-a")
	cs, st := h.cycle(testPod("alone", "want"), "node-a")
	if !st["node-a"].IsSuccess() {
		t.Fatal(st["node-a"])
	}
	s, _ := getState(cs)
	alone := devicesOfResult(s, "node-a")

	pod := testPod("p", "want")
	cs = framework.NewCycleState()
	if _, st := h.pl.PreFilter(h.tCtx, cs, pod, []fwk.NodeInfo{h.nodes["node-a"]}); !st.IsSuccess() {
		t.Fatal(st)
	}
	s, _ = getState(cs)
	first := cs.Clone()
	if st := h.pl.AddPod(h.tCtx, first, pod, podInfo(t, nominated), h.nodes["node-a"]); !st.IsSuccess() {
		t.Fatal(st)
	}
	if st := h.pl.Filter(h.tCtx, first, pod, h.nodes["node-a"]); !st.IsSuccess() {
		t.Fatalf("first pass: %v", st)
	}
	if st := h.pl.Filter(h.tCtx, cs, pod, h.nodes["node-a"]); !st.IsSuccess() {
		t.Fatalf("second pass: %v", st)
	}
	got := devicesOfResult(s, "node-a")
	if len(got) != 1 || len(alone) != 1 || got[0] == alone[0] {
		t.Errorf("with a pod nominated: %v, alone: %v; want the device the nominated pod does not get", got, alone)
	}

	// Two GPUs left and the nominated pod takes one: a pod that needs two
	// does not fit in the first pass.
	two := testPod("two", "want-two")
	cs = framework.NewCycleState()
	if _, st := h.pl.PreFilter(h.tCtx, cs, two, []fwk.NodeInfo{h.nodes["node-a"]}); !st.IsSuccess() {
		t.Fatal(st)
	}
	first = cs.Clone()
	h.pl.AddPod(h.tCtx, first, two, podInfo(t, nominated), h.nodes["node-a"])
	if st := h.pl.Filter(h.tCtx, first, two, h.nodes["node-a"]); st.IsSuccess() {
		t.Errorf("two GPUs with one of the two free kept for the nominated pod: fits")
	}
	if st := h.pl.Filter(h.tCtx, cs, two, h.nodes["node-a"]); !st.IsSuccess() {
		t.Errorf("without the nominated pod: %v", st)
	}
}

// TestPostFilterWaitsForVictimsDevices: a pod nominated to a node where it
// fits once a claim of a pod that is gone gives its GPU back keeps its
// nomination, and PostFilter ends there (DefaultPreemption evicts nobody
// more), also where only the scheduler's record of nominations has it yet.
// Nominated elsewhere, needing more than that frees, or with the claim's
// pod still there, it does not.
func TestPostFilterWaitsForVictimsDevices(t *testing.T) {
	gone := testPod("gone")
	h := newHarness(t, []*v1.Node{testNode("node-a"), testNode("node-b")}, testDeviceClass(), testSlice("node-a", 2), testSlice("node-b", 2),
		reservedFor(allocatedOn(testClaim("gone-claim", 1), "node-a", "gpu-0"), gone),
		allocatedOn(testClaim("held", 1), "node-a", "gpu-1"),
		allocatedOn(testClaim("held-b", 2), "node-b", "gpu-0", "gpu-1"),
		testClaim("want", 1), testClaim("want-two", 2))
	for _, tc := range []struct {
		claim, nominated string
		wait             bool
	}{{"want", "node-a", true}, {"want", "node-b", false}, {"want", "", false}, {"want-two", "node-a", false}} {
		pod := testPod("p", tc.claim)
		pod.Status.NominatedNodeName = tc.nominated
		cs, _ := h.cycle(pod, "node-a", "node-b")
		res, st := h.pl.PostFilter(h.tCtx, cs, pod, nil)
		if tc.wait != st.IsSuccess() {
			t.Errorf("%s nominated to %q: PostFilter %v, want success %v", tc.claim, tc.nominated, st, tc.wait)
		}
		if tc.wait && (res == nil || res.NominatingInfo == nil || res.NominatedNodeName != tc.nominated) {
			t.Errorf("%s nominated to %q: result %+v, want the nomination kept", tc.claim, tc.nominated, res)
		}
	}
	// Where another plugin rules the nominated node out (cordoned,
	// unreachable), the pod does not wait there: DefaultPreemption
	// preempts elsewhere. A node that only TopologyDRA turns down, or that
	// another plugin turns down for what preemption frees, it waits on.
	for _, tc := range []struct {
		status *fwk.Status
		wait   bool
	}{
		{fwk.NewStatus(fwk.UnschedulableAndUnresolvable, "node(s) were unschedulable").WithPlugin("NodeUnschedulable"), false},
		{fwk.NewStatus(fwk.UnschedulableAndUnresolvable, "node(s) cannot allocate claim").WithPlugin(Name), true},
		{fwk.NewStatus(fwk.Unschedulable, "Insufficient cpu").WithPlugin("NodeResourcesFit"), true},
	} {
		pod := testPod("p", "want")
		pod.Status.NominatedNodeName = "node-a"
		cs, _ := h.cycle(pod, "node-a", "node-b")
		statuses := framework.NewDefaultNodeToStatus()
		statuses.Set("node-a", tc.status)
		if _, st := h.pl.PostFilter(h.tCtx, cs, pod, statuses); st.IsSuccess() != tc.wait {
			t.Errorf("nominated node turned down by %s (%s): PostFilter %v, want success %v", tc.status.Plugin(), tc.status.Code(), st, tc.wait)
		}
	}
	// Nominated in the scheduler's record, before its status says so: the
	// record is read within nominationWindow of a preemption trial in
	// which a pod fit.
	pod := testPod("p", "want")
	h.nominator.AddNominatedPod(klog.Background(), podInfo(t, pod), &fwk.NominatingInfo{NominatedNodeName: "node-a", NominatingMode: fwk.ModeOverride})
	cs, _ := h.cycle(pod, "node-a", "node-b")
	if _, st := h.pl.PostFilter(h.tCtx, cs, pod, nil); st.IsSuccess() {
		t.Errorf("nominated in the scheduler's record only, no preemption trial: PostFilter %v, want unschedulable", st)
	}
	h.nominator.DeleteNominatedPodIfExists(pod)
	h.pl.lastTrialFit.Store(time.Now().UnixNano())
	for node, wait := range map[string]bool{"node-a": true, "node-b": false} {
		pod := testPod("p", "want")
		h.nominator.AddNominatedPod(klog.Background(), podInfo(t, pod), &fwk.NominatingInfo{NominatedNodeName: node, NominatingMode: fwk.ModeOverride})
		cs, _ := h.cycle(pod, "node-a", "node-b")
		res, st := h.pl.PostFilter(h.tCtx, cs, pod, nil)
		if wait != st.IsSuccess() || wait && (res == nil || res.NominatingInfo == nil || res.NominatedNodeName != node) {
			t.Errorf("nominated to %s in the scheduler's record only: PostFilter %+v %v, want success %v with the nomination kept", node, res, st, wait)
		}
		h.nominator.DeleteNominatedPodIfExists(pod)
	}
	// The claim's pod terminates because the scheduler preempted it, as
	// the pod lister says before the cycle's snapshot may: its devices are
	// counted as being given back, as DefaultPreemption counts a victim
	// terminating on the nominated node (it preempts no more then).
	// Terminating for another reason, the pod still uses them.
	seen := func(what string, ok func(*v1.Pod, error) bool) {
		t.Helper()
		err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
			return ok(h.pl.pods.Pods(testNS).Get(gone.Name)), nil
		})
		h.tCtx.ExpectNoError(err, "the pod lister never saw "+what)
	}
	terminating := gone.DeepCopy()
	terminating.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	terminating.Status.Conditions = []v1.PodCondition{{Type: v1.DisruptionTarget, Status: v1.ConditionTrue, Reason: v1.PodReasonPreemptionByScheduler}}
	terminating = h.createSeen(terminating)
	for _, reason := range []string{v1.PodReasonPreemptionByScheduler, "DeletionByTaintManager"} {
		if terminating.Status.Conditions[0].Reason != reason {
			terminating.Status.Conditions[0].Reason = reason
			var err error
			terminating, err = h.client.CoreV1().Pods(testNS).UpdateStatus(h.tCtx, terminating, metav1.UpdateOptions{})
			h.tCtx.ExpectNoError(err)
			seen("the pod's new condition", func(p *v1.Pod, err error) bool {
				return err == nil && len(p.Status.Conditions) == 1 && p.Status.Conditions[0].Reason == reason
			})
		}
		pod := testPod("p", "want")
		pod.Status.NominatedNodeName = "node-a"
		cs, _ := h.cycle(pod, "node-a", "node-b")
		res, st := h.pl.PostFilter(h.tCtx, cs, pod, nil)
		if want := reason == v1.PodReasonPreemptionByScheduler; want != st.IsSuccess() || want && (res == nil || res.NominatingInfo == nil || res.NominatedNodeName != "node-a") {
			t.Errorf("the claim's pod terminating, DisruptionTarget %s: PostFilter %+v %v, want success %v with the nomination kept", reason, res, st, want)
		}
	}
	h.tCtx.ExpectNoError(h.client.CoreV1().Pods(testNS).Delete(h.tCtx, gone.Name, metav1.DeleteOptions{}))
	seen("the pod deleted", func(_ *v1.Pod, err error) bool { return apierrors.IsNotFound(err) })

	// The claim's pod exists: its claim is in use.
	h.createSeen(gone)
	pod = testPod("p", "want")
	pod.Status.NominatedNodeName = "node-a"
	cs, _ = h.cycle(pod, "node-a", "node-b")
	if _, st := h.pl.PostFilter(h.tCtx, cs, pod, nil); st.IsSuccess() {
		t.Errorf("the claim's pod exists: PostFilter %v, want unschedulable", st)
	}
}

// TestPostFilterWaitsForGoneDevicesUnnominated: a pod nominated nowhere
// fits on node-a once the claim of a pod that no longer exists gives its
// GPU back. Preemption's trials count that GPU as free, so node-a would
// need no victim and DefaultPreemption would evict the lower-priority pod
// on node-b; PostFilter ends it and the pod waits, without a nomination.
// Where the GPU given back is not enough, or the pod may not preempt
// anyway, PostFilter leaves the pod to DefaultPreemption.
func TestPostFilterWaitsForGoneDevicesUnnominated(t *testing.T) {
	gone := testPod("gone")
	h := newHarness(t, []*v1.Node{testNode("node-a"), testNode("node-b")}, testDeviceClass(), testSlice("node-a", 2), testSlice("node-b", 2),
		reservedFor(allocatedOn(testClaim("gone-claim", 1), "node-a", "gpu-0"), gone),
		testClaim("want", 1), testClaim("want-two", 2))
	for node, devices := range map[string][]string{"node-a": {"gpu-1"}, "node-b": {"gpu-0", "gpu-1"}} {
		low := testPod("low-"+node, "low-"+node+"-claim")
		low.Spec.NodeName = node
		low = h.createSeen(low)
		h.create(reservedFor(allocatedOn(testClaim("low-"+node+"-claim", int64(len(devices))), node, devices...), low))
		h.waitForClaim("low-"+node+"-claim", func(*resourceapi.ResourceClaim) bool { return true })
		h.nodes[node].AddPodInfo(podInfo(t, low))
	}
	h.waitForClaim("gone-claim", func(*resourceapi.ResourceClaim) bool { return true })
	for _, tc := range []struct {
		claim    string
		priority int32
		wait     bool
	}{{"want", 100, true}, {"want-two", 100, false}, {"want", 0, false}} {
		pod := testPod("p", tc.claim)
		pod.Spec.Priority = ptr.To(tc.priority)
		cs, _ := h.cycle(pod, "node-a", "node-b")
		res, st := h.pl.PostFilter(h.tCtx, cs, pod, nil)
		if st.IsSuccess() != tc.wait || res != nil && res.NominatingInfo != nil {
			t.Errorf("%s, priority %d: PostFilter %+v %v, want success %v without a nomination", tc.claim, tc.priority, res, st, tc.wait)
		}
	}
}

// TestTrialKeepsSharedClaim: the pod shares an allocated claim with a
// victim. A trial that removes the victim does not free that claim (the
// pod keeps using it, so its other claims cannot have its GPUs); a trial
// that removes the other pod frees that one's.
func TestTrialKeepsSharedClaim(t *testing.T) {
	v, v2 := testPod("v", "shared"), testPod("v2", "held")
	v.Spec.NodeName, v2.Spec.NodeName = "node-a", "node-a"
	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 4), testClaim("want", 2))
	v, v2 = h.createSeen(v), h.createSeen(v2)
	h.create(reservedFor(allocatedOn(testClaim("shared", 2), "node-a", "gpu-0", "gpu-1"), v))
	h.create(reservedFor(allocatedOn(testClaim("held", 2), "node-a", "gpu-2", "gpu-3"), v2))
	h.waitForClaim("shared", func(*resourceapi.ResourceClaim) bool { return true })
	h.waitForClaim("held", func(*resourceapi.ResourceClaim) bool { return true })
	h.nodes["node-a"].AddPodInfo(podInfo(t, v))
	h.nodes["node-a"].AddPodInfo(podInfo(t, v2))

	pod := testPod("p", "shared", "want")
	pod.Spec.Priority = ptr.To[int32](100)
	cs, st := h.cycle(pod, "node-a")
	if st["node-a"].Code() != fwk.Unschedulable {
		t.Fatalf("full node: %v, want Unschedulable", st["node-a"])
	}
	for victim, fits := range map[*v1.Pod]bool{v: false, v2: true} {
		trial := cs.Clone()
		h.pl.RemovePod(h.tCtx, trial, pod, podInfo(t, victim), h.nodes["node-a"])
		if st := h.pl.Filter(h.tCtx, trial, pod, h.nodes["node-a"]); st.IsSuccess() != fits {
			t.Errorf("%s removed: %v, want fits %v", victim.Name, st, fits)
		}
	}
}

// TestNominatedRoomCountsLeavingPods: the pod nominated to a node waits
// for a terminating pod's GPU there (its preemption's victim). Its room is
// counted with that GPU free, so it does not take more of the free GPUs
// than it needs beside it; a nominated pod that does not fit even then
// keeps the whole node from pods of its priority or lower.
func TestNominatedRoomCountsLeavingPods(t *testing.T) {
	leaving := testPod("leaving", "leaving-claim")
	leaving.Spec.NodeName = "node-a"
	leaving.DeletionTimestamp = ptr.To(metav1.Now())
	leaving.Finalizers = []string{"test/keep"}
	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 4),
		testClaim("nominated-two", 2), testClaim("nominated-five", 5), testClaim("want-two", 2))
	leaving = h.createSeen(leaving)
	h.create(reservedFor(allocatedOn(testClaim("leaving-claim", 1), "node-a", "gpu-0"), leaving))
	h.waitForClaim("leaving-claim", func(*resourceapi.ResourceClaim) bool { return true })

	filterWith := func(nominated *v1.Pod) *fwk.Status {
		t.Helper()
		pod := testPod("p", "want-two")
		cs := framework.NewCycleState()
		if _, st := h.pl.PreFilter(h.tCtx, cs, pod, []fwk.NodeInfo{h.nodes["node-a"]}); !st.IsSuccess() {
			t.Fatal(st)
		}
		first := cs.Clone()
		h.pl.AddPod(h.tCtx, first, pod, podInfo(t, nominated), h.nodes["node-a"])
		return h.pl.Filter(h.tCtx, first, pod, h.nodes["node-a"])
	}
	// Two for the nominated pod, gpu-0 among them once it is free: two
	// of gpu-1..3 stay for the pod.
	two := testPod("nominated", "nominated-two")
	if st := filterWith(two); !st.IsSuccess() {
		t.Errorf("nominated pod of two GPUs, one of them leaving: %v, want the pod to fit", st)
	}
	five := testPod("nominated", "nominated-five")
	if st := filterWith(five); st.Code() != fwk.Unschedulable || !strings.Contains(st.Message(), "nominated") {
		t.Errorf("nominated pod that does not fit: %v, want Unschedulable naming the nominated pod's room", st)
	}
}

// TestPreemptorRequeued: a pod nominated to a node (a preemptor) is
// requeued when a pod with claims on that node is deleted (while its
// preemption runs, the queue looks only at pod deletions for it) and when
// a claim gives devices back there, whatever the counts say; other pods
// are not.
func TestPreemptorRequeued(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("a"), testNode("b")}, testDeviceClass(), testSlice("a", 4), testSlice("b", 4),
		testClaim("big", 4),
		allocatedOn(testClaim("x", 2), "a", "gpu-0", "gpu-1"),
		allocatedOn(testClaim("y", 1), "a", "gpu-2"))
	for _, name := range []string{"big", "x", "y"} {
		h.waitForClaim(name, func(*resourceapi.ResourceClaim) bool { return true })
	}
	nominatedTo := func(node string) *v1.Pod {
		p := testPod("big", "big")
		p.Status.NominatedNodeName = node
		return p
	}
	// y gives gpu-2 back: two free on a, the pod needs four.
	y := h.apiClaim("y")
	deallocated := y.DeepCopy()
	deallocated.Status.Allocation = nil
	deallocated.ResourceVersion += "-next"
	for node, want := range map[string]fwk.QueueingHint{"": fwk.QueueSkip, "b": fwk.QueueSkip, "a": fwk.Queue} {
		got, err := h.pl.isSchedulableAfterClaimChange(klog.Background(), nominatedTo(node), y, deallocated)
		if err != nil || got != want {
			t.Errorf("claim hint, nominated to %q: %v %v, want %v", node, got, err, want)
		}
	}
	// A victim with claims deleted on a.
	victim := testPod("victim", "x")
	victim.Spec.NodeName = "a"
	for node, want := range map[string]fwk.QueueingHint{"": fwk.QueueSkip, "b": fwk.QueueSkip, "a": fwk.Queue} {
		got, err := h.pl.isSchedulableAfterAssignedPodDelete(klog.Background(), nominatedTo(node), victim, nil)
		if err != nil || got != want {
			t.Errorf("pod delete hint, nominated to %q: %v %v, want %v", node, got, err, want)
		}
	}
}

// TestNominationReleasedRequeues: a pending pod that was nominated to a
// node and is deleted or nominated elsewhere (the scheduler sends its old
// object as an assigned pod's deletion) requeues the pods that Filter kept
// off that node for it, where it holds claims; one that holds none (a
// device plugin's extended resource only) or was not nominated does not.
func TestNominationReleasedRequeues(t *testing.T) {
	pl := &TopologyDRA{}
	waiting := testPod("waiting", "two")
	nominated := func(node string, claims ...string) *v1.Pod {
		p := testPod("preemptor", claims...)
		p.Status.NominatedNodeName = node
		return p
	}
	devicePlugin := nominated("a")
	devicePlugin.Spec.Containers = []v1.Container{{Name: "main", Resources: v1.ResourceRequirements{Requests: v1.ResourceList{"nvidia.com/gpu": resource.MustParse("8")}}}}
	extended := nominated("a")
	extended.Status.ExtendedResourceClaimStatus = &v1.PodExtendedResourceClaimStatus{ResourceClaimName: "preemptor-extended"}
	for name, tc := range map[string]struct {
		gone *v1.Pod
		want fwk.QueueingHint
	}{
		"nominated, with claims":                          {gone: nominated("a", "eight"), want: fwk.Queue},
		"nominated, with its extended resources' claim":   {gone: extended, want: fwk.Queue},
		"nominated, a device plugin's resource only":      {gone: devicePlugin, want: fwk.QueueSkip},
		"nominated, without claims or extended resources": {gone: nominated("a"), want: fwk.QueueSkip},
		"not nominated": {gone: nominated("", "eight"), want: fwk.QueueSkip},
	} {
		t.Run(name, func(t *testing.T) {
			got, err := pl.isSchedulableAfterAssignedPodDelete(klog.Background(), waiting, tc.gone, nil)
			if err != nil || got != tc.want {
				t.Errorf("%v %v, want %v", got, err, tc.want)
			}
		})
	}
}

// TestNominatedPodNotHeldBack: the headroom holds a large pod back, but
// not on the node it is nominated to (it preempted pods for that room,
// and others may have taken free devices elsewhere since), also in the
// pass with other nominated pods added; on other nodes it does, and so it
// does for a pod that may not preempt.
func TestNominatedPodNotHeldBack(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("a"), testNode("b")}, testDeviceClass(), testSlice("a", 4), testSlice("b", 4),
		testClaim("four", 4), allocatedOn(testClaim("full", 4), "b", "gpu-0", "gpu-1", "gpu-2", "gpu-3"))
	h.waitForClaim("full", func(*resourceapi.ResourceClaim) bool { return true })
	h.waitForClaim("four", func(*resourceapi.ResourceClaim) bool { return true })
	h.pl.headroomPercent = 100
	pod := testPod("p", "four")
	if _, st := h.cycle(pod, "a"); !strings.Contains(st["a"].Message(), "held back") {
		t.Fatalf("not nominated: %v, want held back by the headroom", st["a"])
	}
	pod.Status.NominatedNodeName = "a"
	cs, st := h.cycle(pod, "a")
	if !st["a"].IsSuccess() {
		t.Errorf("nominated to a: %v, want it to fit", st["a"])
	}
	// Also in the framework's first pass, with another pod nominated to
	// the node added (one whose claims cannot be read takes nothing).
	first := cs.Clone()
	h.pl.AddPod(h.tCtx, first, pod, podInfo(t, testPod("other", "nope")), h.nodes["a"])
	if st := h.pl.Filter(h.tCtx, first, pod, h.nodes["a"]); !st.IsSuccess() {
		t.Errorf("nominated to a, another pod nominated there too: %v, want it to fit", st)
	}
	// Nominated to a in the scheduler's record only, before its status
	// says so (within nominationWindow of a preemption trial in which a
	// pod fit): not held back there either.
	recorded := testPod("p", "four")
	h.nominator.AddNominatedPod(klog.Background(), podInfo(t, recorded), &fwk.NominatingInfo{NominatedNodeName: "a", NominatingMode: fwk.ModeOverride})
	if _, st := h.cycle(recorded, "a"); !strings.Contains(st["a"].Message(), "held back") {
		t.Errorf("nominated to a in the record, no preemption trial: %v, want held back by the headroom", st["a"])
	}
	h.pl.lastTrialFit.Store(time.Now().UnixNano())
	if _, st := h.cycle(recorded, "a"); !st["a"].IsSuccess() {
		t.Errorf("nominated to a in the record after a preemption trial: %v, want it to fit", st["a"])
	}
	h.nominator.DeleteNominatedPodIfExists(recorded)
	// Nominated elsewhere, the headroom applies here as to any pod.
	pod.Status.NominatedNodeName = "b"
	if _, st := h.cycle(pod, "a"); !strings.Contains(st["a"].Message(), "held back") {
		t.Errorf("nominated to b: %v on a, want held back by the headroom", st["a"])
	}
	// A pod with preemptionPolicy Never made no room by preempting (a
	// nomination it carries was set for another reason, or is stale):
	// the headroom applies on that node too.
	pod.Status.NominatedNodeName = "a"
	pod.Spec.PreemptionPolicy = ptr.To(v1.PreemptNever)
	if _, st := h.cycle(pod, "a"); !strings.Contains(st["a"].Message(), "held back") {
		t.Errorf("preemptionPolicy Never, nominated to a: %v, want held back by the headroom", st["a"])
	}
}

// victimsHolding creates, per device of node-a, a pod bound there (label
// app=<its name>) with a 1-GPU claim of that device reserved for it, in
// the API and in the node's info.
func victimsHolding(t *testing.T, h *harness, devices ...string) []*v1.Pod {
	t.Helper()
	var victims []*v1.Pod
	for i, dev := range devices {
		name := fmt.Sprintf("v%d", i)
		v := testPod(name, name+"-claim")
		v.Labels = map[string]string{"app": name}
		v.Spec.NodeName = "node-a"
		v = h.createSeen(v)
		h.create(reservedFor(allocatedOn(testClaim(name+"-claim", 1), "node-a", dev), v))
		h.waitForClaim(name+"-claim", func(*resourceapi.ResourceClaim) bool { return true })
		h.nodes["node-a"].AddPodInfo(podInfo(t, v))
		victims = append(victims, v)
	}
	return victims
}

// trialWithout runs pod's cycle on node-a, where it must be Unschedulable
// (preemption may help), and returns a copy of the cycle state with the
// victims removed: preemption's trial, before its first Filter.
func trialWithout(t *testing.T, h *harness, pod *v1.Pod, victims []*v1.Pod) fwk.CycleState {
	t.Helper()
	cs, st := h.cycle(pod, "node-a")
	if st["node-a"].Code() != fwk.Unschedulable {
		t.Fatalf("full node: %v, want Unschedulable (preemption may help)", st["node-a"])
	}
	trial := cs.Clone()
	for _, v := range victims {
		h.pl.RemovePod(h.tCtx, trial, pod, podInfo(t, v), h.nodes["node-a"])
	}
	return trial
}

// TestPreemptionKeepsAlignment: in preemption's trials a victim is given
// back only where the pod's devices stay as aligned as with every
// candidate victim removed. Four 1-GPU pods hold a node's GPUs, two on
// each PCIe root; a pod of 2 GPUs gets a root of its own with all of them
// removed. Given back in preemption's order, the first still leaves a
// root free; the second (on the other root) would leave one GPU free on
// each: the pod fits, but not on one root, so that pod stays a victim;
// the third then leaves a root free again, and the fourth leaves too
// little. Where a PodDisruptionBudget covers the second, it is not evicted
// for alignment: it stays, and the two that would leave too little go.
// The framework's pass with a nominated pod added, which takes the free
// root, fits less aligned and still passes.
func TestPreemptionKeepsAlignment(t *testing.T) {
	setup := func(t *testing.T) (*harness, *v1.Pod, []*v1.Pod, fwk.CycleState) {
		h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 4), testClaim("want", 2))
		victims := victimsHolding(t, h, "gpu-0", "gpu-2", "gpu-1", "gpu-3")
		pod := testPod("p", "want")
		pod.Spec.Priority = ptr.To[int32](100)
		trial := trialWithout(t, h, pod, victims)
		if st := h.pl.Filter(h.tCtx, trial, pod, h.nodes["node-a"]); !st.IsSuccess() {
			t.Fatalf("all removed: %v", st)
		}
		return h, pod, victims, trial
	}
	// reprieve gives the victims back in order, as DefaultPreemption does,
	// and checks which ones the pod still fits with. Each Filter runs in
	// the framework's two passes, the first on a copy with a pod nominated
	// to the node that takes no devices (it has no claims), the second,
	// where the first passed, without it.
	reprieve := func(t *testing.T, h *harness, pod *v1.Pod, victims []*v1.Pod, trial fwk.CycleState, fits []bool) {
		noDevices := testPod("no-devices")
		noDevices.Spec.Priority = ptr.To[int32](100)
		for i, want := range fits {
			v := victims[i]
			h.pl.AddPod(h.tCtx, trial, pod, podInfo(t, v), h.nodes["node-a"])
			first := trial.Clone()
			h.pl.AddPod(h.tCtx, first, pod, podInfo(t, noDevices), h.nodes["node-a"])
			st := h.pl.Filter(h.tCtx, first, pod, h.nodes["node-a"])
			if st.IsSuccess() {
				st = h.pl.Filter(h.tCtx, trial, pod, h.nodes["node-a"])
			}
			if st.IsSuccess() != want {
				t.Errorf("%s given back: %v, want fits = %v", v.Name, st, want)
			}
			if !st.IsSuccess() {
				h.pl.RemovePod(h.tCtx, trial, pod, podInfo(t, v), h.nodes["node-a"])
			}
		}
	}

	t.Run("no budget", func(t *testing.T) {
		h, pod, victims, trial := setup(t)
		reprieve(t, h, pod, victims, trial, []bool{true, false, true, false})
	})
	// budgetForV1 creates a PodDisruptionBudget that selects v1 and allows
	// that many disruptions, and waits until the plugin lists it.
	budgetForV1 := func(t *testing.T, h *harness, allowed int32) {
		h.create(&policyv1.PodDisruptionBudget{
			ObjectMeta: metav1.ObjectMeta{Namespace: testNS, Name: "keep-v1"},
			Spec:       policyv1.PodDisruptionBudgetSpec{Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "v1"}}},
			Status:     policyv1.PodDisruptionBudgetStatus{DisruptionsAllowed: allowed},
		})
		err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
			_, err := h.pl.pdbs.PodDisruptionBudgets(testNS).Get("keep-v1")
			return err == nil, nil
		})
		if err != nil {
			t.Fatal("the plugin never listed the budget")
		}
	}

	t.Run("budget covers the second", func(t *testing.T) {
		h, pod, victims, trial := setup(t)
		budgetForV1(t, h, 0)
		if !h.pl.protected(victims[1:2]) {
			t.Fatal("evicting v1 does not count as violating its budget")
		}
		if h.pl.protected(victims[:1]) {
			t.Fatal("the budget covers v0 too")
		}
		reprieve(t, h, pod, victims, trial, []bool{true, true, false, false})
	})
	t.Run("budget that allows a disruption", func(t *testing.T) {
		h, pod, victims, trial := setup(t)
		budgetForV1(t, h, 1)
		if h.pl.protected(victims[1:2]) {
			t.Fatal("evicting v1 counts as violating a budget that allows a disruption")
		}
		reprieve(t, h, pod, victims, trial, []bool{true, false, true, false})
	})
	t.Run("nominated pod added", func(t *testing.T) {
		// Six GPUs on three roots; gpu-0 and gpu-4 are held by a pod
		// that is no victim. With the victims removed the pod alone
		// gets root pci-1; in the framework's first pass, with a pod
		// nominated to the node added, the nominated pod gets pci-1 and
		// the pod gpu-1 and gpu-5: less aligned, and still a fit, also
		// after a victim without claims is given back.
		h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 6),
			allocatedOn(testClaim("kept", 2), "node-a", "gpu-0", "gpu-4"), testClaim("want", 2), testClaim("nominated-claim", 2))
		h.waitForClaim("kept", func(*resourceapi.ResourceClaim) bool { return true })
		noClaims := testPod("no-claims")
		noClaims.Spec.NodeName = "node-a"
		noClaims = h.createSeen(noClaims)
		h.nodes["node-a"].AddPodInfo(podInfo(t, noClaims))
		victims := append([]*v1.Pod{noClaims}, victimsHolding(t, h, "gpu-2", "gpu-3", "gpu-1", "gpu-5")...)
		pod := testPod("p", "want")
		pod.Spec.Priority = ptr.To[int32](100)
		nominated := testPod("nominated", "nominated-claim")
		nominated.Spec.Priority = ptr.To[int32](100)
		trial := trialWithout(t, h, pod, victims)
		// Both passes, as the framework runs them.
		passes := func(round string) {
			first := trial.Clone()
			h.pl.AddPod(h.tCtx, first, pod, podInfo(t, nominated), h.nodes["node-a"])
			if st := h.pl.Filter(h.tCtx, first, pod, h.nodes["node-a"]); !st.IsSuccess() {
				t.Errorf("%s, with the nominated pod: %v", round, st)
			}
			if st := h.pl.Filter(h.tCtx, trial, pod, h.nodes["node-a"]); !st.IsSuccess() {
				t.Errorf("%s, without it: %v", round, st)
			}
		}
		passes("all removed")
		h.pl.AddPod(h.tCtx, trial, pod, podInfo(t, noClaims), h.nodes["node-a"])
		passes("the pod without claims given back")
	})
}

// TestPostFilterCountsClaimsReleasedSinceTheCycle: the claim controller
// gives the victims' claims back one by one, and a preemptor may be
// retried in between. Its cycle began with both of a node's GPUs held by
// claims of pods that are gone; by PostFilter one claim is deallocated
// (neither allocated any more nor a claim of a gone pod), the other not
// yet. The pod, nominated there, fits once the second is given back, and
// keeps its nomination.
func TestPostFilterCountsClaimsReleasedSinceTheCycle(t *testing.T) {
	gone, gone2 := testPod("gone"), testPod("gone2")
	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 2),
		reservedFor(allocatedOn(testClaim("gone-claim", 1), "node-a", "gpu-0"), gone),
		reservedFor(allocatedOn(testClaim("gone2-claim", 1), "node-a", "gpu-1"), gone2),
		testClaim("want-two", 2))
	h.waitForClaim("gone2-claim", func(*resourceapi.ResourceClaim) bool { return true })
	pod := testPod("p", "want-two")
	pod.Status.NominatedNodeName = "node-a"
	cs, _ := h.cycle(pod, "node-a")
	claim := h.apiClaim("gone2-claim")
	claim.Status.Allocation, claim.Status.ReservedFor = nil, nil
	if _, err := h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(h.tCtx, claim, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitForClaim("gone2-claim", func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation == nil })
	res, st := h.pl.PostFilter(h.tCtx, cs, pod, nil)
	if !st.IsSuccess() || res == nil || res.NominatingInfo == nil || res.NominatedNodeName != "node-a" {
		t.Errorf("one claim given back since the cycle began, the other's pod gone: PostFilter %+v %v, want the nomination kept", res, st)
	}
}
