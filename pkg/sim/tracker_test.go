package sim

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/topology"
)

// TestRetryableSameRoot: a pending pod whose claim needs a GPU and a NIC
// on one PCIe root is retryable only while some root of a node it may use
// has both free; free devices on different roots do not count.
func TestRetryableSameRoot(t *testing.T) {
	// One node, two PCIe roots, each with two GPUs and one NIC.
	slice := func(driver string, devs ...resourceapi.Device) resourceapi.ResourceSlice {
		return resourceapi.ResourceSlice{Spec: resourceapi.ResourceSliceSpec{Driver: driver, NodeName: ptr.To("n"), Pool: resourceapi.ResourcePool{Name: "n"}, Devices: devs}}
	}
	dev := func(name, root string) resourceapi.Device {
		return resourceapi.Device{Name: name, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			topology.AttrPCIeRoot: {StringValue: ptr.To(root)},
		}}
	}
	tr := newTracker(Namespace)
	tr.loadDevices([]resourceapi.ResourceSlice{
		slice(topology.DriverName, dev("gpu-0", "root-a"), dev("gpu-1", "root-a"), dev("gpu-2", "root-b"), dev("gpu-3", "root-b")),
		slice(mockNICDriver, dev("nic-0", "root-a"), dev("nic-1", "root-b")),
	}, []*v1.Node{{ObjectMeta: metav1.ObjectMeta{Name: "n"}}})
	key := func(driver, name string) string { return driver + "/n/" + name }

	templates := map[string]*resourceapi.ResourceClaimTemplate{}
	for _, kind := range []traceKind{
		{jobKind: jobKind{template: "gpu-1-nic-1-match", gpus: 1, nics: 1}, match: true},
		{jobKind: jobKind{template: "gpu-1-nic-1", gpus: 1, nics: 1}},
	} {
		tmpl := traceTemplates([]traceKind{kind})[0]
		templates[tmpl.Name] = tmpl
	}
	pod := func(name, template string) *v1.Pod {
		return &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: v1.PodSpec{ResourceClaims: []v1.PodResourceClaim{{Name: "devices", ResourceClaimTemplateName: ptr.To(template)}}}}
	}
	for _, p := range []*v1.Pod{pod("match", "gpu-1-nic-1-match"), pod("any", "gpu-1-nic-1")} {
		d := demandOf(p, templates)
		if d == nil {
			t.Fatalf("pod %s: no demand", p.Name)
		}
		if d.SameRoot != (p.Name == "match") {
			t.Fatalf("pod %s: SameRoot %v", p.Name, d.SameRoot)
		}
		tr.created(p, 0, d, gpusAsked(p, templates))
	}

	for _, tc := range []struct {
		used []string
		want []string
	}{
		{used: nil, want: []string{"any", "match"}},
		// Root a: GPUs used, NIC free. Root b: GPUs free, NIC used.
		{used: []string{key(topology.DriverName, "gpu-0"), key(topology.DriverName, "gpu-1"), key(mockNICDriver, "nic-1")}, want: []string{"any"}},
		// Root b: one GPU and its NIC free.
		{used: []string{key(topology.DriverName, "gpu-0"), key(topology.DriverName, "gpu-1"), key(topology.DriverName, "gpu-2")}, want: []string{"any", "match"}},
		{used: []string{key(mockNICDriver, "nic-0"), key(mockNICDriver, "nic-1")}, want: nil},
	} {
		for k := range tr.devices {
			tr.inv.Release(k)
		}
		for _, k := range tc.used {
			tr.inv.Use(k, "other")
		}
		if got := tr.retryable(nil); !slices.Equal(got, tc.want) {
			t.Errorf("in use %v: retryable %v, want %v", tc.used, got, tc.want)
		}
	}
}

// TestFit8WhileWaiting: of the whole-node slots free at the end, those
// that 8-GPU pods still waiting could take are counted and shown beside
// the slots, in a run's table and summed over a sweep; bound pods and
// smaller pending pods do not count.
func TestFit8WhileWaiting(t *testing.T) {
	tr := newTracker(Namespace)
	for _, p := range []struct {
		name  string
		gpus  int
		bound bool
	}{{"big-bound", 8, true}, {"big-waiting", 8, false}, {"huge-waiting", 16, false}, {"small-waiting", 4, false}} {
		tr.created(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: p.name}}, 0, nil, p.gpus)
		tr.pods[p.name].Bound = p.bound
	}
	if got := tr.pendingWithGPUs(8); got != 2 {
		t.Errorf("pending pods of 8 GPUs or more: %d, want 2", got)
	}
	for _, tc := range []struct {
		res  Result
		want string
	}{
		{Result{Fit8: 3}, "3"},
		{Result{Fit8: 3, Fit8Waited: 2}, "3 (2 while 8-GPU pods wait)"},
	} {
		if got := fitLabel(tc.res.Fit8, tc.res.Fit8Waited, 8); got != tc.want {
			t.Errorf("fitLabel(%d, %d, 8) = %q, want %q", tc.res.Fit8, tc.res.Fit8Waited, got, tc.want)
		}
	}
	rows := []SweepRow{
		{Scheduler: "topodra", Fit8: 2, Fit8Waited: 1},
		{Scheduler: "topodra", Fit8: 1},
		{Scheduler: "stock", Fit8: 1},
	}
	for scheduler, want := range map[string]string{"topodra": "3 (1 while 8-GPU pods wait)", "stock": "1"} {
		sum := summarize(scheduler, rows)
		if got := fitLabel(sum.Fit8, sum.Fit8Waited, 8); got != want {
			t.Errorf("%s's sum %q, want %q", scheduler, got, want)
		}
	}
	// The target counts the slots that no 8-GPU pod waits for.
	for _, tc := range []struct {
		topodra, stock SweepRow
		want           bool
	}{
		{SweepRow{Scheduler: "topodra", Fit8: 2, Fit8Waited: 1}, SweepRow{Scheduler: "stock", Fit8: 1}, true},
		{SweepRow{Scheduler: "topodra", Fit8: 1, Fit8Waited: 1}, SweepRow{Scheduler: "stock", Fit8: 1}, false},
	} {
		rows := []SweepRow{tc.topodra, tc.stock}
		for _, tg := range targets(summarize("topodra", rows), summarize("stock", rows), rows) {
			if strings.HasPrefix(tg.Measure, "8-GPU jobs that fit") && tg.Met != tc.want {
				t.Errorf("topodra %d fit (%d while waiting), stock %d: met %v, want %v", tc.topodra.Fit8, tc.topodra.Fit8Waited, tc.stock.Fit8, tg.Met, tc.want)
			}
		}
	}
}

// TestClaimAllocatedAgainCountsOnce: a claim deallocated and allocated
// again on another node (PostFilter, a failed binding) counts as one
// placement, the last one, and the pod bound where that one is is no
// error.
func TestClaimAllocatedAgainCountsOnce(t *testing.T) {
	slice := func(node string) resourceapi.ResourceSlice {
		return resourceapi.ResourceSlice{Spec: resourceapi.ResourceSliceSpec{Driver: topology.DriverName, NodeName: ptr.To(node), Pool: resourceapi.ResourcePool{Name: node},
			Devices: []resourceapi.Device{{Name: "gpu-0"}, {Name: "gpu-1"}}}}
	}
	tr := newTracker(Namespace)
	tr.loadDevices([]resourceapi.ResourceSlice{slice("a"), slice("b")}, []*v1.Node{{ObjectMeta: metav1.ObjectMeta{Name: "a"}}, {ObjectMeta: metav1.ObjectMeta{Name: "b"}}})
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: Namespace}, Spec: v1.PodSpec{ResourceClaims: []v1.PodResourceClaim{{Name: "gpus", ResourceClaimName: ptr.To("c")}}}}
	tr.created(pod, 0, nil, 2)
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: Namespace, UID: "c-1",
		OwnerReferences: []metav1.OwnerReference{{Kind: "Pod", Name: "p"}}}}
	allocatedOn := func(node string) *resourceapi.ResourceClaim {
		c := claim.DeepCopy()
		c.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{
			{Request: "gpus", Driver: topology.DriverName, Pool: node, Device: "gpu-0"},
			{Request: "gpus", Driver: topology.DriverName, Pool: node, Device: "gpu-1"},
		}}}
		return c
	}
	tr.onClaim(allocatedOn("a"), false)
	tr.onClaim(claim, false)
	tr.onClaim(allocatedOn("b"), false)
	bound := pod.DeepCopy()
	bound.Spec.NodeName = "b"
	tr.onPod(bound, false)
	res := &Result{}
	tr.fill(res)
	if len(res.Placements) != 1 || res.Placements[0].Node != "b" {
		t.Errorf("placements %+v, want one, on node b", res.Placements)
	}
	if len(res.Errors) != 0 {
		t.Errorf("errors %q, want none", res.Errors)
	}
}

// TestLastWord: the scheduler's latest reason for not placing a pod is
// kept for the notes on stuck pods, and nothing is said of a pod it said
// nothing of.
func TestLastWord(t *testing.T) {
	tr := newTracker(Namespace)
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: Namespace}}
	tr.created(pod, 0, nil, 0)
	if got := tr.lastWord("p"); got != "" {
		t.Errorf("lastWord before any condition: %q, want none", got)
	}
	for _, msg := range []string{"0/2 nodes are available: first", "0/2 nodes are available: keeping 8 of the 64 devices free"} {
		p := pod.DeepCopy()
		p.Status.Conditions = []v1.PodCondition{{Type: v1.PodScheduled, Status: v1.ConditionFalse, Reason: v1.PodReasonUnschedulable, Message: msg}}
		tr.onPod(p, false)
	}
	if got := tr.lastWord("p"); !strings.Contains(got, "keeping 8 of the 64 devices free") || !strings.HasPrefix(got, "the scheduler said ") {
		t.Errorf("lastWord = %q, want the latest message", got)
	}
	if got := tr.lastWord("other"); got != "" {
		t.Errorf("lastWord of a pod not tracked: %q", got)
	}
}

// TestEvictedPods: a pod that someone else deletes (the scheduler's
// preemption) is evicted, with the reason of its DisruptionTarget
// condition; evicted returns it once, to be deleted as its kubelet would;
// a pod the simulator deletes itself is not evicted.
func TestEvictedPods(t *testing.T) {
	tr := newTracker(Namespace)
	for _, name := range []string{"victim", "done"} {
		tr.created(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: Namespace}}, 0, nil, 4)
		bound := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: Namespace}, Spec: v1.PodSpec{NodeName: "n", Priority: ptr.To[int32](0)}}
		tr.onPod(bound, false)
	}
	if got := tr.expired(5, func(int) int { return 1 }); !slices.Equal(got, []string{"done", "victim"}) {
		t.Fatalf("expired: %v", got)
	}
	// Undo "victim": only "done" is the simulator's own deletion.
	tr.pods["victim"].Deleting = false
	for _, name := range []string{"victim", "done"} {
		p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: Namespace, DeletionTimestamp: ptr.To(metav1.Now())}, Spec: v1.PodSpec{NodeName: "n"}}
		p.Status.Conditions = []v1.PodCondition{{Type: v1.DisruptionTarget, Status: v1.ConditionTrue, Reason: v1.PodReasonPreemptionByScheduler}}
		tr.onPod(p, false)
	}
	if got := tr.evicted(); !slices.Equal(got, []string{"victim"}) {
		t.Errorf("evicted: %v, want the victim only", got)
	}
	if got := tr.evicted(); len(got) != 0 {
		t.Errorf("evicted again: %v, want nothing (being deleted)", got)
	}
	if got := tr.evictedPods(); !slices.Equal(got, []string{"victim"}) {
		t.Errorf("evictedPods: %v", got)
	}
	res := &Result{}
	tr.fill(res)
	if res.Evicted[v1.PodReasonPreemptionByScheduler] != 1 || len(res.Evicted) != 1 {
		t.Errorf("result evicted: %v", res.Evicted)
	}
	if got := evictedText(*res); got != "1 (1 by preemption)" {
		t.Errorf("report: %q", got)
	}
}

// TestClaimsSeenOutOfOrder: after the claim informer lists anew, a claim
// that took a device given back meanwhile can come before the deletion
// or deallocation of the claim that held it. The device stays the new
// holder's (it used to be freed by the late deletion, and pods looked
// stuck on devices in use), and no double allocation is reported; one
// whose holder gave it back only after the second allocation is.
func TestClaimsSeenOutOfOrder(t *testing.T) {
	slice := resourceapi.ResourceSlice{Spec: resourceapi.ResourceSliceSpec{Driver: topology.DriverName, NodeName: ptr.To("n"), Pool: resourceapi.ResourcePool{Name: "n"},
		Devices: []resourceapi.Device{{Name: "gpu-0"}, {Name: "gpu-1"}}}}
	const key = topology.DriverName + "/n/gpu-0"
	claim := func(pod, version string, allocated bool) *resourceapi.ResourceClaim {
		c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: pod + "-gpu", Namespace: Namespace, UID: types.UID(pod), ResourceVersion: version,
			OwnerReferences: []metav1.OwnerReference{{Kind: "Pod", Name: pod}}}}
		if allocated {
			c.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{
				{Request: "gpu", Driver: topology.DriverName, Pool: "n", Device: "gpu-0"},
			}}}
		}
		return c
	}
	setup := func() *tracker {
		tr := newTracker(Namespace)
		tr.loadDevices([]resourceapi.ResourceSlice{slice}, []*v1.Node{{ObjectMeta: metav1.ObjectMeta{Name: "n"}}})
		for _, pod := range []string{"a", "b"} {
			tr.created(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: pod, Namespace: Namespace}}, 0, nil, 1)
		}
		tr.onClaim(claim("a", "10", true), false)
		return tr
	}
	check := func(name string, tr *tracker, wantErrors int) {
		t.Helper()
		if owner, used := tr.inv.Owner(key); !used || owner != "b" {
			t.Errorf("%s: gpu-0 held by %q (%v), want b's", name, owner, used)
		}
		res := &Result{}
		tr.fill(res)
		if len(res.Errors) != wantErrors {
			t.Errorf("%s: errors %q, want %d", name, res.Errors, wantErrors)
		}
	}

	tr := setup()
	tr.onClaim(claim("b", "30", true), false)
	tr.onClaim(cache.DeletedFinalStateUnknown{Key: Namespace + "/a-gpu", Obj: claim("a", "10", true)}, true)
	check("deletion missed, delivered after the new allocation", tr, 0)
	if tr.reordered != 1 {
		t.Errorf("reordered = %d, want 1", tr.reordered)
	}

	tr = setup()
	tr.onClaim(claim("b", "30", true), false)
	tr.onClaim(claim("a", "20", false), false)
	check("deallocated before the new allocation, delivered after it", tr, 0)

	tr = setup()
	tr.onClaim(claim("b", "30", true), false)
	tr.onClaim(claim("a", "40", false), false)
	check("deallocated after the new allocation: held twice meanwhile", tr, 1)

	tr = setup()
	tr.onClaim(claim("a", "20", false), false)
	tr.onClaim(claim("b", "30", true), false)
	check("in order", tr, 0)
}

// TestTrackerFollowsTaints: a device whose slice gains a NoSchedule taint
// is free nowhere (retryable pods, snapshots, the end state) until its
// slice has none again, and a claim allocated it meanwhile (written after
// the slice, by resourceVersion) is recorded with the taint; a NoSchedule
// taint on a used device keeps it unhealthy after its pod releases it.
func TestTrackerFollowsTaints(t *testing.T) {
	gpu := func(i int, taints ...resourceapi.DeviceTaint) resourceapi.Device {
		return resourceapi.Device{Name: fmt.Sprintf("gpu-%d", i), Taints: taints, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			discovery.AttrUUID: {StringValue: ptr.To(fmt.Sprintf("GPU-%d", i))},
		}}
	}
	slice := func(devs ...resourceapi.Device) *resourceapi.ResourceSlice {
		return &resourceapi.ResourceSlice{Spec: resourceapi.ResourceSliceSpec{Driver: topology.DriverName, NodeName: ptr.To("n"), Pool: resourceapi.ResourcePool{Name: "n"}, Devices: devs}}
	}
	health := resourceapi.DeviceTaint{Key: "gpu.topodra.io/unhealthy", Value: "xid-79", Effect: resourceapi.DeviceTaintEffectNoSchedule}
	noEffect := resourceapi.DeviceTaint{Key: "example.com/note", Effect: "None"}
	tr := newTracker(Namespace)
	tr.loadDevices([]resourceapi.ResourceSlice{*slice(gpu(0), gpu(1))}, []*v1.Node{{ObjectMeta: metav1.ObjectMeta{Name: "n"}}})
	topo := tr.topology([]NodeSpec{{Name: "n"}})
	key0 := topology.DriverName + "/n/gpu-0"

	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p"}}
	tr.created(pod, 0, &demand{GPUs: 2}, 2)
	if got := tr.retryable(nil); !slices.Equal(got, []string{"p"}) {
		t.Fatalf("retryable with both GPUs healthy: %v, want [p]", got)
	}

	tainted := slice(gpu(0, health), gpu(1, noEffect))
	tainted.ResourceVersion = "100"
	tr.onSlice(tainted)
	if got := tr.healthyGPUs("n"); !slices.Equal(got, []string{"GPU-1"}) {
		t.Errorf("healthy GPUs with gpu-0 tainted: %v, want [GPU-1] (a taint without effect counts for nothing)", got)
	}
	if k, tainted, since := tr.taintedGPU("n", "GPU-0"); k != key0 || !tainted || since.IsZero() {
		t.Errorf("taintedGPU(GPU-0) = %q, %v, %v; want %q, true, when it was seen", k, tainted, since, key0)
	}
	if got := tr.retryable(nil); len(got) != 0 {
		t.Errorf("retryable with one of two GPUs tainted: %v, want none", got)
	}
	end := nodeEnds(topo, tr.snapshot("end"))
	if len(end) != 1 || end[0].FreeGPUs != 1 || end[0].Unhealthy != 1 {
		t.Errorf("end state %+v, want 1 free GPU, 1 unhealthy", end)
	}

	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: Namespace, UID: "c-1", OwnerReferences: []metav1.OwnerReference{{Kind: "Pod", Name: "q"}}},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{
			{Request: "gpus", Driver: topology.DriverName, Pool: "n", Device: "gpu-0"},
			{Request: "gpus", Driver: topology.DriverName, Pool: "n", Device: "gpu-1"},
		}}}}}
	// Written before the taint (delivered after it): not counted.
	claim.ResourceVersion = "90"
	tr.onClaim(claim, false)
	before := &Result{}
	tr.fill(before)
	if len(before.TaintedAllocations) != 0 {
		t.Errorf("an allocation written before the taint counted as tainted: %+v", before.TaintedAllocations)
	}
	tr.onClaim(claim, true)
	claim.ResourceVersion = "110"
	tr.onClaim(claim, false)
	res := &Result{}
	tr.fill(res)
	if len(res.TaintedAllocations) != 1 || res.TaintedAllocations[0].Device != key0 || res.TaintedAllocations[0].Taint != "gpu.topodra.io/unhealthy=xid-79" {
		t.Errorf("tainted allocations %+v, want gpu-0's with its taint", res.TaintedAllocations)
	}
	if !slices.ContainsFunc(res.Notes, func(n string) bool {
		return strings.Contains(n, "allocated a tainted GPU") && strings.Contains(n, key0)
	}) {
		t.Errorf("notes %q name no tainted allocation of %s", res.Notes, key0)
	}

	// Released, the tainted GPU stays unhealthy; the other is free.
	tr.onClaim(claim, true)
	end = nodeEnds(topo, tr.snapshot("end"))
	if end[0].FreeGPUs != 1 || end[0].Unhealthy != 1 {
		t.Errorf("after release: %+v, want 1 free GPU, 1 unhealthy", end)
	}
	// A slice without the taint: both healthy again.
	tr.onSlice(slice(gpu(0), gpu(1)))
	if got := tr.healthyGPUs("n"); !slices.Equal(got, []string{"GPU-0", "GPU-1"}) {
		t.Errorf("healthy GPUs after the taint went: %v", got)
	}
	if got := tr.retryable(nil); !slices.Equal(got, []string{"p"}) {
		t.Errorf("retryable after the taint went: %v, want [p]", got)
	}
	if snap := tr.snapshot("x"); len(snap.Unhealthy) != 0 {
		t.Errorf("snapshot's unhealthy devices %v, want none", snap.Unhealthy)
	}
}

// TestClaimAllocatedAnewUnseen: a claim that the informer sees allocated
// to other devices without having seen its deallocation (a watch gap)
// releases the devices it had and takes the new ones.
func TestClaimAllocatedAnewUnseen(t *testing.T) {
	tr := newTracker(Namespace)
	tr.loadDevices([]resourceapi.ResourceSlice{{Spec: resourceapi.ResourceSliceSpec{Driver: topology.DriverName, NodeName: ptr.To("n"), Pool: resourceapi.ResourcePool{Name: "n"},
		Devices: []resourceapi.Device{{Name: "gpu-0"}, {Name: "gpu-1"}}}}}, []*v1.Node{{ObjectMeta: metav1.ObjectMeta{Name: "n"}}})
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: Namespace}}
	tr.created(pod, 0, nil, 1)
	claim := func(device string) *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: Namespace, UID: "c-1", OwnerReferences: []metav1.OwnerReference{{Kind: "Pod", Name: "p"}}},
			Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{
				{Request: "gpu", Driver: topology.DriverName, Pool: "n", Device: device},
			}}}}}
	}
	tr.onClaim(claim("gpu-0"), false)
	tr.onClaim(claim("gpu-0"), false)
	tr.onClaim(claim("gpu-1"), false)
	key := func(d string) string { return topology.DriverName + "/n/" + d }
	if !tr.inv.Available(key("gpu-0")) || tr.inv.Available(key("gpu-1")) {
		t.Errorf("gpu-0 available %v, gpu-1 available %v; want gpu-0 released, gpu-1 used", tr.inv.Available(key("gpu-0")), tr.inv.Available(key("gpu-1")))
	}
	res := &Result{}
	tr.fill(res)
	if len(res.Placements) != 1 || len(res.Placements[0].GPUs) != 1 || res.Placements[0].GPUs[0] != "gpu-1" || len(res.Errors) != 0 {
		t.Errorf("placements %+v, errors %q; want one placement on gpu-1, no error", res.Placements, res.Errors)
	}
}

// domains are where a test device sits; an empty clique or root, or a
// negative NUMA node, leaves the attribute out.
type domains struct {
	clique, root string
	numa         int64
}

// topologySlices are one node's ResourceSlices: a GPU slice and, where
// nics has any, a NIC slice, with devices gpu-0, gpu-1, … and nic-0, ….
func topologySlices(node string, gpus, nics []domains) []resourceapi.ResourceSlice {
	devices := func(prefix string, ds []domains) []resourceapi.Device {
		var out []resourceapi.Device
		for i, d := range ds {
			attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{}
			if d.clique != "" {
				attrs[topology.AttrNVLinkClique] = resourceapi.DeviceAttribute{StringValue: ptr.To(d.clique)}
			}
			if d.root != "" {
				attrs[topology.AttrPCIeRoot] = resourceapi.DeviceAttribute{StringValue: ptr.To(d.root)}
			}
			if d.numa >= 0 {
				attrs[topology.AttrNUMANode] = resourceapi.DeviceAttribute{IntValue: ptr.To(d.numa)}
			}
			out = append(out, resourceapi.Device{Name: fmt.Sprintf("%s-%d", prefix, i), Attributes: attrs})
		}
		return out
	}
	slice := func(driver string, devs []resourceapi.Device) resourceapi.ResourceSlice {
		return resourceapi.ResourceSlice{Spec: resourceapi.ResourceSliceSpec{Driver: driver, NodeName: ptr.To(node), Pool: resourceapi.ResourcePool{Name: node}, Devices: devs}}
	}
	out := []resourceapi.ResourceSlice{slice(topology.DriverName, devices("gpu", gpus))}
	if len(nics) > 0 {
		out = append(out, slice(mockNICDriver, devices("nic", nics)))
	}
	return out
}

// dgxSlices are the ResourceSlices of a DGX-like node: eight GPUs in one
// NVLink clique, two to a PCIe root, four to a NUMA node, and one NIC on
// each root.
func dgxSlices(node string) []resourceapi.ResourceSlice {
	var gpus, nics []domains
	for g := range 8 {
		gpus = append(gpus, domains{clique: "clique-0", root: fmt.Sprintf("root-%d", g/2), numa: int64(g / 4)})
	}
	for r := range 4 {
		nics = append(nics, domains{root: fmt.Sprintf("root-%d", r), numa: int64(r / 2)})
	}
	return topologySlices(node, gpus, nics)
}

// dgxTracker is a tracker of n DGX-like nodes n0, n1, …, and their
// topology.
func dgxTracker(n int) (*tracker, []NodeTopology) {
	var slices_ []resourceapi.ResourceSlice
	var nodes []*v1.Node
	var specs []NodeSpec
	for i := range n {
		name := fmt.Sprintf("n%d", i)
		slices_ = append(slices_, dgxSlices(name)...)
		nodes = append(nodes, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}})
		specs = append(specs, NodeSpec{Name: name})
	}
	tr := newTracker(Namespace)
	tr.loadDevices(slices_, nodes)
	return tr, tr.topology(specs)
}

// TestJudgeTrivial: an allocation on a node where every GPU (for the NIC
// measure every GPU and NIC) shares one domain of a level is aligned at
// that level whatever the scheduler did, and is counted as trivial; one
// on a node with several domains of the level is not, aligned or missed.
// The share aligned where a placement could miss leaves the trivial ones
// out of both the aligned and the possible, and the existing measure
// keeps them.
func TestJudgeTrivial(t *testing.T) {
	// Node m: two GPUs and a NIC, all on one PCIe root and NUMA node, no
	// NVLink clique.
	oneRoot := topologySlices("m", []domains{{root: "root-m", numa: 0}, {root: "root-m", numa: 0}}, []domains{{root: "root-m", numa: 0}})
	// Node k: the same with a second NIC, on another root.
	nicApart := topologySlices("k", []domains{{root: "root-k", numa: 0}, {root: "root-k", numa: 0}}, []domains{{root: "root-k", numa: 0}, {root: "root-x", numa: 0}})
	type verdict struct{ clique, cliqueTrivial, root, rootTrivial, numa, numaTrivial, nic, nicTrivial bool }
	tests := map[string]struct {
		node    string
		devices []string // gpu-… and nic-… of node
		want    verdict
		// aligned and possible over the four measures, all and without the
		// trivial ones; missable is the report's text.
		aligned, possible, missAligned, missPossible int
		missable                                     string
	}{
		"DGX: across NUMA nodes, the one clique is trivial": {
			node: "n0", devices: []string{"gpu-3", "gpu-4"},
			want:    verdict{clique: true, cliqueTrivial: true},
			aligned: 1, possible: 3, missAligned: 0, missPossible: 2, missable: "0.0%",
		},
		"DGX: on one root, root and NUMA node are not trivial": {
			node: "n0", devices: []string{"gpu-0", "gpu-1"},
			want:    verdict{clique: true, cliqueTrivial: true, root: true, numa: true},
			aligned: 3, possible: 3, missAligned: 2, missPossible: 2, missable: "100.0%",
		},
		"DGX: a GPU and a NIC on one of four roots": {
			node: "n0", devices: []string{"gpu-2", "nic-1"},
			want:    verdict{nic: true},
			aligned: 1, possible: 1, missAligned: 1, missPossible: 1, missable: "100.0%",
		},
		// The NVLink clique is missed: the pod could have gone to n0.
		"one root and NUMA node: those are trivial": {
			node: "m", devices: []string{"gpu-0", "gpu-1", "nic-0"},
			want:    verdict{root: true, rootTrivial: true, numa: true, numaTrivial: true, nic: true, nicTrivial: true},
			aligned: 3, possible: 4, missAligned: 0, missPossible: 1, missable: "0.0%",
		},
		"a NIC on another root: the GPU+NIC root is not trivial": {
			node: "k", devices: []string{"gpu-0", "gpu-1", "nic-0"},
			want:    verdict{root: true, rootTrivial: true, numa: true, numaTrivial: true, nic: true},
			aligned: 3, possible: 4, missAligned: 1, missPossible: 2, missable: "50.0%",
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			tr := newTracker(Namespace)
			tr.loadDevices(slices.Concat(dgxSlices("n0"), oneRoot, nicApart), []*v1.Node{{ObjectMeta: metav1.ObjectMeta{Name: "n0"}}, {ObjectMeta: metav1.ObjectMeta{Name: "m"}}, {ObjectMeta: metav1.ObjectMeta{Name: "k"}}})
			pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: Namespace}, Spec: v1.PodSpec{ResourceClaims: []v1.PodResourceClaim{{Name: "devs", ResourceClaimName: ptr.To("c")}}}}
			tr.created(pod, 0, nil, 2)
			claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: Namespace, UID: "c-1",
				OwnerReferences: []metav1.OwnerReference{{Kind: "Pod", Name: "p"}}},
				Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{}}}
			for _, dev := range tc.devices {
				driver := topology.DriverName
				if strings.HasPrefix(dev, "nic-") {
					driver = mockNICDriver
				}
				claim.Status.Allocation.Devices.Results = append(claim.Status.Allocation.Devices.Results,
					resourceapi.DeviceRequestAllocationResult{Request: "devs", Driver: driver, Pool: tc.node, Device: dev})
			}
			tr.onClaim(claim, false)
			res := &Result{}
			tr.fill(res)
			if len(res.Placements) != 1 {
				t.Fatalf("placements %+v, want one", res.Placements)
			}
			p := res.Placements[0]
			got := verdict{p.InClique, p.CliqueTrivial, p.InRoot, p.RootTrivial, p.InNUMA, p.NUMATrivial, p.NICSameRoot, p.NICRootTrivial}
			if got != tc.want {
				t.Errorf("verdict %+v, want %+v", got, tc.want)
			}
			if aligned, possible := res.Alignment.Counts(); aligned != tc.aligned || possible != tc.possible {
				t.Errorf("aligned overall %d of %d, want %d of %d", aligned, possible, tc.aligned, tc.possible)
			}
			if aligned, possible, ok := res.Alignment.MissableCounts(); !ok || aligned != tc.missAligned || possible != tc.missPossible {
				t.Errorf("aligned where a placement could miss %d of %d (counted %v), want %d of %d", aligned, possible, ok, tc.missAligned, tc.missPossible)
			}
			if got := missableText(res.Alignment); got != tc.missable {
				t.Errorf("report text %q, want %q", got, tc.missable)
			}
		})
	}
}

// TestFit4WhileWaiting: of the whole free NUMA nodes at the end, those
// that 4-GPU pods still waiting could take are counted and shown beside
// them, as for 8-GPU pods and whole nodes; bound pods and pending pods of
// other sizes do not count, and no more are counted than there are slots.
func TestFit4WhileWaiting(t *testing.T) {
	tr, topo := dgxTracker(8)
	// 20 of the 64 GPUs kept free, 5 after a 4-GPU allocation.
	tr.setHeadroom(30, 8)
	// All used but NUMA node 0 of n0 and of n1: two 4-GPU slots, which
	// the headroom keeps free.
	for key, d := range tr.devices {
		if d.GPU && !((d.Node == "n0" || d.Node == "n1") && d.NUMA == "0") {
			tr.inv.Use(key, "other")
		}
	}
	pods := func(gpus int, bound bool, names ...string) {
		for _, name := range names {
			tr.created(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name}}, 0, &demand{GPUs: gpus}, gpus)
			tr.pods[name].Bound = bound
		}
	}
	pods(4, false, "four-waiting")
	pods(4, true, "four-bound")
	pods(8, false, "eight-waiting")
	pods(2, false, "two-waiting")
	tr.mu.Lock()
	fits := tr.fitsWithHeadroom(labels.Everything(), 4)
	tr.mu.Unlock()
	if fits {
		t.Fatal("a 4-GPU pod fits within the headroom; the test needs one held back")
	}
	res := &Result{}
	tr.fillEnds(res, topo, tr.snapshot("end"))
	if res.Fit4 != 2 || res.Fit4Waited != 1 || res.Fit8 != 0 || res.Fit8Waited != 0 {
		t.Errorf("fit 4 %d (%d while waiting), fit 8 %d (%d while waiting), want 2 (1) and 0 (0)", res.Fit4, res.Fit4Waited, res.Fit8, res.Fit8Waited)
	}
	want := "2 (1 while 4-GPU pods wait)"
	for _, row := range resultRows([]Result{*res}) {
		if row.label == "more 4-GPU NUMA-aligned jobs fit" {
			if got := row.cell(*res); got != want {
				t.Errorf("report %q, want %q", got, want)
			}
		}
	}
	rows := []SweepRow{rowOf("a", 1, 1, res), {Scheduler: res.Scheduler, Fit4: 2}}
	if sum := summarize(res.Scheduler, rows); sum.Fit4 != 4 || sum.Fit4Waited != 1 {
		t.Errorf("sweep sums fit 4 %d (%d while waiting), want 4 (1)", sum.Fit4, sum.Fit4Waited)
	}
	// Three 4-GPU pods waiting could take both slots, not three.
	pods(4, false, "four-waiting-too", "four-waiting-three")
	res = &Result{}
	tr.fillEnds(res, topo, tr.snapshot("end"))
	if res.Fit4Waited != 2 {
		t.Errorf("with three 4-GPU pods waiting, %d slots while waiting, want 2", res.Fit4Waited)
	}
}
