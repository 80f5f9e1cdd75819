package sim

import (
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/measure"
	"github.com/topodra/topodra/pkg/topology"
)

func TestClassifyWait(t *testing.T) {
	never := func() bool { return false }
	always := func() bool { return true }
	for _, tc := range []struct {
		name         string
		want         WaitWant
		nodes, roots []measure.Count
		heldBack     func() bool
		cause        string
	}{
		{"nothing free", WaitWant{GPUs: 1}, []measure.Count{{GPUs: 0, NICs: 2}, {}}, nil, never, CauseClusterFull},
		{"too few free", WaitWant{GPUs: 4}, []measure.Count{{GPUs: 1}, {GPUs: 2}}, nil, never, CauseTooFewFree},
		{"scattered", WaitWant{GPUs: 2}, []measure.Count{{GPUs: 1}, {GPUs: 1}}, nil, never, CauseScattered},
		{"GPUs where no NIC is free", WaitWant{GPUs: 1, NICs: 1}, []measure.Count{{GPUs: 3}, {NICs: 2}}, nil, never, CauseNoNodeNICs},
		{"fits by count", WaitWant{GPUs: 1, NICs: 1}, []measure.Count{{GPUs: 3}, {GPUs: 1, NICs: 1}}, nil, never, CauseFitsByCount},
		{"no root with both", WaitWant{GPUs: 1, NICs: 1, SameRoot: true}, []measure.Count{{GPUs: 3}, {GPUs: 1, NICs: 1}}, []measure.Count{{GPUs: 1}, {NICs: 1}}, never, CauseNoRootNICs},
		{"a root with both", WaitWant{GPUs: 1, NICs: 1, SameRoot: true}, []measure.Count{{GPUs: 3}, {GPUs: 2, NICs: 1}}, []measure.Count{{GPUs: 1}, {GPUs: 1, NICs: 1}}, never, CauseFitsByCount},
		{"held back", WaitWant{GPUs: 8}, []measure.Count{{GPUs: 8}, {GPUs: 1}}, nil, always, CauseHeadroom},
		{"held back, asked only once the counts fit", WaitWant{GPUs: 8}, []measure.Count{{GPUs: 7}, {GPUs: 1}}, nil, always, CauseScattered},
		{"no headroom", WaitWant{GPUs: 8}, []measure.Count{{GPUs: 8}}, nil, nil, CauseFitsByCount},
	} {
		if got := ClassifyWait(tc.want, tc.nodes, tc.roots, tc.heldBack); got != tc.cause {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.cause)
		}
	}
}

func TestWaitedBySizesAndLine(t *testing.T) {
	w := WaitedBy{}
	for _, s := range []string{WaitSize(8, 0), WaitSize(1, 1), WaitSize(2, 0), WaitSize(1, 0), WaitSize(2, 1)} {
		w.Add(s, CauseClusterFull, 1)
	}
	if got, want := w.Sizes(), []string{"1 GPU", "1 GPU + 1 NIC", "2 GPU", "2 GPU + 1 NIC", "8 GPU"}; !slices.Equal(got, want) {
		t.Errorf("sizes %v, want %v", got, want)
	}
	w.Add("1 GPU", CauseFitsByCount, 2)
	runs := WaitedBy{}
	runs.Add("1 GPU", CauseClusterFull, 1)
	runs.Add("1 GPU", CauseFitsByCount, 1)
	if got, want := w.Line("1 GPU", runs), "cluster full 1 (1 run), fits by count on a node 2 (1 run)"; got != want {
		t.Errorf("line %q, want %q", got, want)
	}
}

// TestJudgeWaits: the tracker judges pods that are not bound by the free
// devices of the nodes their node selector admits, and tells the
// headroom's hold-back apart from a pod that fits with the headroom kept.
func TestJudgeWaits(t *testing.T) {
	slice := func(node string, gpus int) resourceapi.ResourceSlice {
		s := resourceapi.ResourceSlice{Spec: resourceapi.ResourceSliceSpec{Driver: topology.DriverName, NodeName: ptr.To(node), Pool: resourceapi.ResourcePool{Name: node}}}
		for i := range gpus {
			s.Spec.Devices = append(s.Spec.Devices, resourceapi.Device{Name: "gpu-" + string(rune('0'+i))})
		}
		return s
	}
	var slices_ []resourceapi.ResourceSlice
	var nodes []*v1.Node
	for i := range 8 {
		name := "n" + string(rune('0'+i))
		slices_ = append(slices_, slice(name, 8))
		nodes = append(nodes, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"id": name}}})
	}
	tr := newTracker(Namespace)
	tr.loadDevices(slices_, nodes)
	// n0 free, n1 with two free, the rest full: 10 GPUs free, 64 in all.
	for k, d := range tr.devices {
		if d.Node != "n0" && !(d.Node == "n1" && d.Index < 2) {
			tr.inv.Use(k, "other")
		}
	}
	pod := func(name string, selector map[string]string) *v1.Pod {
		return &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: v1.PodSpec{NodeSelector: selector}}
	}
	tr.created(pod("whole", nil), 0, &demand{GPUs: 8}, 8)
	tr.created(pod("pinned", map[string]string{"id": "n2"}), 0, &demand{GPUs: 1}, 1)
	tr.created(pod("one", nil), 0, &demand{GPUs: 1}, 1)
	tr.created(pod("odd", nil), 0, nil, 3)

	tr.setHeadroom(12, 8) // 8 of 64 kept: after an 8-GPU pod on n0, 2 stay free.
	tr.judgeWaits([]string{"whole", "pinned", "one", "odd"})
	for name, want := range map[string]string{"whole": CauseHeadroom, "pinned": CauseClusterFull, "one": CauseFitsByCount, "odd": CauseOther} {
		if got := tr.pods[name].WaitCause; got != want {
			t.Errorf("%s: %q, want %q", name, got, want)
		}
	}
	tr.setHeadroom(0, 8)
	tr.judgeWaits([]string{"whole"})
	if got := tr.pods["whole"].WaitCause; got != CauseFitsByCount {
		t.Errorf("without a headroom: %q, want %q", got, CauseFitsByCount)
	}

	// fill counts the pods that waited: the pinned pod was bound a tick
	// later, the one judged pod bound in its own tick did not wait.
	tr.pods["pinned"].Bound, tr.pods["pinned"].BoundTick = true, 1
	tr.pods["one"].Bound = true
	res := &Result{}
	tr.tick = 2
	tr.fill(res)
	if got, want := res.WaitedBy.Line(WaitSize(1, 0), nil), CauseClusterFull+" 1"; got != want {
		t.Errorf("1 GPU: %q, want %q", got, want)
	}
	if !strings.Contains(res.WaitedBy.Line(WaitSize(8, 0), nil), CauseFitsByCount) || res.WaitedBy.Line(WaitSize(3, 0), nil) != CauseOther+" 1" {
		t.Errorf("waited by %v", res.WaitedBy)
	}
}

// TestSweepWaitCauses: a sweep's summary sums the runs' causes and counts
// the runs they occurred in; runs without recorded causes add nothing.
func TestSweepWaitCauses(t *testing.T) {
	sc := Scenario{Name: "a", Profile: DefaultProfile, Nodes: 8, Pods: 100, Trace: TraceBuiltin}
	row := func(seed int64, sched string, w WaitedBy) SweepRow {
		return SweepRow{Scenario: "a", Seed: seed, Round: 1, Scheduler: sched, MeanWait: map[int]float64{1: 0}, Aligned: 0.97, Throughput: 50, WaitedBy: w}
	}
	rep := &SweepReport{Scenarios: []Scenario{sc}, Seeds: []int64{1, 2, 3}, Rounds: 1, HostRequests: "x", Rows: []SweepRow{
		row(1, SchedulerTopodra, WaitedBy{"1 GPU + 1 NIC": {CauseNoRootNICs: 2}}),
		row(2, SchedulerTopodra, WaitedBy{"1 GPU + 1 NIC": {CauseNoRootNICs: 1, CauseClusterFull: 1}}),
		row(3, SchedulerTopodra, nil),
		row(1, SchedulerStock, nil), row(2, SchedulerStock, nil), row(3, SchedulerStock, nil),
	}}
	pooled, err := PoolSweeps([]*SweepReport{rep})
	if err != nil {
		t.Fatal(err)
	}
	var text strings.Builder
	if err := pooled.WriteSummary(&text); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"  1 GPU + 1 NIC: cluster full 1 (1 run), no PCIe root with its GPUs and NICs 3 (2 runs)\n",
		"stock:\n  none\n",
	} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("summary does not say %q:\n%s", want, text.String())
		}
	}
	rep.Rows[0].WaitedBy, rep.Rows[1].WaitedBy = nil, nil
	pooled, err = PoolSweeps([]*SweepReport{rep})
	if err != nil {
		t.Fatal(err)
	}
	text.Reset()
	if err := pooled.WriteSummary(&text); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(text.String(), "what the cluster lacked") {
		t.Errorf("causes printed for runs that recorded none:\n%s", text.String())
	}
}

func TestWaitCausesHTML(t *testing.T) {
	r := &Report{Results: []Result{
		{Scheduler: SchedulerTopodra, WaitedBy: WaitedBy{"1 GPU + 1 NIC": {CauseNoRootNICs: 2}}},
		{Scheduler: SchedulerStock},
	}}
	var page strings.Builder
	if err := r.WriteHTML(&page); err != nil {
		t.Fatal(err)
	}
	if want := "<tr><th>1 GPU + 1 NIC</th><td>no PCIe root with its GPUs and NICs 2</td><td></td></tr>"; !strings.Contains(page.String(), want) {
		t.Errorf("the report has no row %q", want)
	}
	r.Results[0].WaitedBy = nil
	page.Reset()
	if err := r.WriteHTML(&page); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(page.String(), "<td>bound in the tick it arrived in</td>") {
		t.Error("without waits the report does not say that every pod was bound on arrival")
	}
}
