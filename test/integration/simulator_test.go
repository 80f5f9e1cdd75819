package integration

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/html"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/kubernetes/test/utils/ktesting"

	"github.com/topodra/topodra/pkg/sim"
	"github.com/topodra/topodra/test/integration/framework"
)

// testWriter turns progress lines into test log lines.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// TestSimulator runs topodra-sim small: 4 nodes (3 DGX H100 with
// NICs, 1 PCIe box with NVLink pairs), 40 pods through topodra-scheduler and
// the stock scheduler, each on its own fresh control plane, after a warm-up
// of 6 pods through each. Pods are pinned
// to nodes by the seed (sim.Options.Pin), so node choice is out of the
// schedulers' hands and the stock run is reproducible; the comparison is
// then about device choice, where topodra must never be worse.
func TestSimulator(t *testing.T) {
	tCtx := ktesting.Init(t)
	const nodes = 4
	opts := smallPinned(t)
	// A small warm-up, to check that it runs and that nothing of it is
	// counted in the measured runs.
	opts.WarmUpPods = 6
	report, _ := runSimulator(tCtx, t, opts)

	if got, want := len(report.Results), 2; got != want {
		t.Fatalf("got %d results, want %d", got, want)
	}
	if len(report.Nodes) != nodes {
		t.Fatalf("report has %d nodes, want %d", len(report.Nodes), nodes)
	}
	totalGPUs := countGPUs(report)
	if report.WarmUpPods != opts.WarmUpPods {
		t.Errorf("report says warm-up of %d pods, want %d", report.WarmUpPods, opts.WarmUpPods)
	}
	byName := map[string]sim.Result{}
	for _, res := range report.Results {
		byName[res.Scheduler] = res
		checkCounts(t, res, report.Pods, totalGPUs)
		// Successful attempts: one per placed pod and one for the probe
		// pod that shows the scheduler is up; none of the warm-up's.
		if got, most := res.Attempts["scheduled"], uint64(res.Placed+1); got > most {
			t.Errorf("%s: %d successful scheduling attempts counted for %d placed pods and the probe: the warm-up's leaked into the measured run", res.Scheduler, got, res.Placed)
		}
	}
	topodra, stock := byName[sim.SchedulerTopodra], byName[sim.SchedulerStock]
	if topodra.AlignedFraction < stock.AlignedFraction {
		t.Errorf("topodra aligned %.3f of multi-GPU and GPU+NIC allocations, stock %.3f: topodra must not be worse", topodra.AlignedFraction, stock.AlignedFraction)
	}
	if topodra.Alignment.MultiGPU == 0 || topodra.Alignment.GPUNIC == 0 {
		t.Errorf("workload exercised too little: %d multi-GPU and %d GPU+NIC allocations", topodra.Alignment.MultiGPU, topodra.Alignment.GPUNIC)
	}

	var page bytes.Buffer
	tCtx.ExpectNoError(report.WriteHTML(&page))
	checkHTML(t, page.Bytes(), report)
}

// checkCounts checks that a result's numbers add up.
func checkCounts(t *testing.T, res sim.Result, pods, totalGPUs int) {
	t.Helper()
	name := res.Scheduler
	for _, e := range res.Errors {
		t.Errorf("%s: tracking found: %s", name, e)
	}
	if res.InvariantViolations != 0 {
		t.Errorf("%s: %d invariant violations at the end of the run, want 0 (checked)", name, res.InvariantViolations)
	}
	if res.Pods != pods || res.Placed+res.Pending != pods {
		t.Errorf("%s: pods %d, placed %d + pending %d, want %d in all", name, res.Pods, res.Placed, res.Pending, pods)
	}
	// Pinned pods go where they fit by count: nothing may stay pending,
	// unless a GPU failed (a pod pinned to its node may not fit any
	// more; the run's stuck pods say whether one that fits was left).
	gpuFaults := slices.ContainsFunc(res.Faults, func(f sim.Fault) bool { return f.Kind == sim.FaultGPUXID })
	if res.Pending != 0 && !gpuFaults {
		t.Errorf("%s: %d pods pending with a pinned workload that fits: %v", name, res.Pending, res.PendingPods)
	}
	evicted := 0
	for _, n := range res.Evicted {
		evicted += n
	}
	if res.Finished+res.RunningAtEnd+evicted != res.Placed {
		t.Errorf("%s: finished %d + running %d + evicted %d != placed %d", name, res.Finished, res.RunningAtEnd, evicted, res.Placed)
	}
	// Every pod of the built-in workload has one claim: one placement per
	// placed pod.
	if len(res.Placements) != res.Placed {
		t.Errorf("%s: %d placements for %d placed pods", name, len(res.Placements), res.Placed)
	}
	// The scheduler's own CPU time: its goroutines carry the pprof label.
	switch {
	case res.SchedulerCPUSeconds < 0:
		t.Logf("%s: scheduler CPU not measured (another CPU profile was running, e.g. go test -cpuprofile)", name)
	case res.SchedulerCPUSeconds == 0:
		t.Errorf("%s: scheduler CPU 0 s over a run that placed %d pods: no profile sample carried the label scheduler=%s", name, res.Placed, name)
	}
	multi, gpuNIC := 0, 0
	for _, p := range res.Placements {
		if len(p.GPUs) >= 2 {
			multi++
		}
		if len(p.GPUs) > 0 && len(p.NICs) > 0 {
			gpuNIC++
		}
	}
	a := res.Alignment
	if a.MultiGPU != multi || a.GPUNIC != gpuNIC {
		t.Errorf("%s: alignment counts %d multi-GPU / %d GPU+NIC, placements say %d / %d", name, a.MultiGPU, a.GPUNIC, multi, gpuNIC)
	}
	for label, r := range map[string]sim.Ratio{"clique": a.Clique, "root": a.Root, "numa": a.NUMA} {
		if r.Aligned > r.Possible || r.Possible > a.MultiGPU {
			t.Errorf("%s: %s: aligned %d, possible %d, multi-GPU %d", name, label, r.Aligned, r.Possible, a.MultiGPU)
		}
	}
	if a.NICRoot.Aligned > a.NICRoot.Possible || a.NICRoot.Possible > a.GPUNIC {
		t.Errorf("%s: GPU+NIC: aligned %d, possible %d, total %d", name, a.NICRoot.Aligned, a.NICRoot.Possible, a.GPUNIC)
	}
	if tr := a.Trivial; tr == nil || tr.Clique > a.Clique.Aligned || tr.Root > a.Root.Aligned || tr.NUMA > a.NUMA.Aligned || tr.NICRoot > a.NICRoot.Aligned {
		t.Errorf("%s: trivial allocations %+v, want counted and among the aligned (%+v)", name, tr, a)
	}
	end := res.Snapshots[len(res.Snapshots)-1]
	usedGPUs, unhealthyFree := 0, 0
	for key := range end.Used {
		if strings.HasPrefix(key, "gpu.topodra.io/") {
			usedGPUs++
		}
	}
	for key := range end.Unhealthy {
		if _, used := end.Used[key]; !used && strings.HasPrefix(key, "gpu.topodra.io/") {
			unhealthyFree++
		}
	}
	if res.FreeGPUs+usedGPUs+unhealthyFree != totalGPUs {
		t.Errorf("%s: free %d + used %d + unused unhealthy %d GPUs at the end != %d", name, res.FreeGPUs, usedGPUs, unhealthyFree, totalGPUs)
	}
	fit8, fit4 := 0, 0
	for _, n := range res.Nodes {
		if n.LargestBlock > n.FreeGPUs || n.Fit8*8 > n.FreeGPUs || n.Fit4*4 > n.FreeGPUs {
			t.Errorf("%s: node %s: free %d, block %d, 8-GPU %d, 4-GPU %d do not fit together", name, n.Node, n.FreeGPUs, n.LargestBlock, n.Fit8, n.Fit4)
		}
		fit8 += n.Fit8
		fit4 += n.Fit4
	}
	if fit8 != res.Fit8 || fit4 != res.Fit4 {
		t.Errorf("%s: totals 8-GPU %d / 4-GPU %d, per node %d / %d", name, res.Fit8, res.Fit4, fit8, fit4)
	}
	// Waiting: every pod counted once, the sizes add up to the total.
	waitPods, waitTicks := 0, 0
	for _, w := range res.WaitByGPUs {
		waitPods += w.Pods
		waitTicks += w.Ticks
	}
	if waitPods != res.Pods || waitTicks != res.PendingPodTicks || waitTicks < 0 {
		t.Errorf("%s: waiting by size counts %d pods and %d ticks, want %d pods and %d ticks", name, waitPods, waitTicks, res.Pods, res.PendingPodTicks)
	}
	// GPU-weighted waiting and idle capacity agree with the sizes and the
	// timeline.
	gpuTicks := 0
	for g, w := range res.WaitByGPUs {
		gpuTicks += g * w.Ticks
	}
	idle := 0
	for _, p := range res.Timeline {
		if p.Waiting > 0 {
			idle += p.FreeGPUs
		}
	}
	if gpuTicks != res.PendingGPUTicks || idle != res.IdleWhileWaiting {
		t.Errorf("%s: GPU-ticks waiting %d, idle while waiting %d; by size and timeline %d and %d", name, res.PendingGPUTicks, res.IdleWhileWaiting, gpuTicks, idle)
	}
	if res.FreeInWholeNUMA < 0 || res.FreeInWholeNUMA > 1 {
		t.Errorf("%s: share of free GPUs in whole NUMA nodes %f is not in [0,1]", name, res.FreeInWholeNUMA)
	}
}

// checkAgainstAPI runs before a cluster is torn down: every pod the report
// calls running is bound, its claims are allocated on its node with devices
// that the node's ResourceSlices publish and reserved for it, and the
// report's final map matches the API.
func checkAgainstAPI(ctx context.Context, client kubernetes.Interface, res *sim.Result) error {
	slices_, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	published := map[string]string{} // driver/pool/device -> node
	for _, s := range slices_.Items {
		if s.Spec.NodeName == nil {
			continue
		}
		for _, d := range s.Spec.Devices {
			published[s.Spec.Driver+"/"+s.Spec.Pool.Name+"/"+d.Name] = *s.Spec.NodeName
		}
	}
	pods, err := client.CoreV1().Pods(sim.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	var problems []string
	apiUsed := map[string]string{}
	running := 0
	for i := range pods.Items {
		pod := &pods.Items[i]
		if pod.Spec.NodeName == "" {
			continue
		}
		running++
		claims, err := framework.PodClaims(ctx, client, pod)
		if err != nil {
			problems = append(problems, err.Error())
			continue
		}
		for _, claim := range claims {
			if claim.Status.Allocation == nil {
				problems = append(problems, fmt.Sprintf("pod %s on %s: claim %s not allocated", pod.Name, pod.Spec.NodeName, claim.Name))
				continue
			}
			if !slices.ContainsFunc(claim.Status.ReservedFor, func(r resourceapi.ResourceClaimConsumerReference) bool { return r.UID == pod.UID }) {
				problems = append(problems, fmt.Sprintf("pod %s: claim %s not reserved for it", pod.Name, claim.Name))
			}
			for _, r := range claim.Status.Allocation.Devices.Results {
				key := r.Driver + "/" + r.Pool + "/" + r.Device
				node, ok := published[key]
				switch {
				case !ok:
					problems = append(problems, fmt.Sprintf("pod %s: claim %s: device %s is not published", pod.Name, claim.Name, key))
				case node != pod.Spec.NodeName:
					problems = append(problems, fmt.Sprintf("pod %s on %s: claim %s: device %s is on %s", pod.Name, pod.Spec.NodeName, claim.Name, key, node))
				}
				if other, dup := apiUsed[key]; dup {
					problems = append(problems, fmt.Sprintf("device %s allocated to %s and %s", key, other, pod.Name))
				}
				apiUsed[key] = pod.Name
			}
		}
	}
	if running != res.RunningAtEnd {
		problems = append(problems, fmt.Sprintf("API has %d bound pods, report says %d running", running, res.RunningAtEnd))
	}
	end := res.Snapshots[len(res.Snapshots)-1].Used
	for key, pod := range apiUsed {
		if end[key] != pod {
			problems = append(problems, fmt.Sprintf("device %s: API says pod %s, report map says %q", key, pod, end[key]))
		}
	}
	if len(end) != len(apiUsed) {
		problems = append(problems, fmt.Sprintf("report map has %d used devices, API %d", len(end), len(apiUsed)))
	}
	if len(problems) > 0 {
		return fmt.Errorf("%s: %s", res.Scheduler, strings.Join(problems, "; "))
	}
	return nil
}

// checkHTML parses the report page and counts the final node maps.
func checkHTML(t *testing.T, page []byte, report *sim.Report) {
	t.Helper()
	doc, err := html.Parse(bytes.NewReader(page))
	if err != nil {
		t.Fatalf("report HTML does not parse: %v", err)
	}
	attr := func(n *html.Node, key string) string {
		for _, a := range n.Attr {
			if a.Key == key {
				return a.Val
			}
		}
		return ""
	}
	endMaps := map[string][]string{} // scheduler -> nodes
	timelines := map[string]int{}    // scheduler -> series plotted
	maps, external := 0, 0
	for n := range doc.Descendants() {
		if n.Type != html.ElementNode {
			continue
		}
		switch n.Data {
		case "script", "link", "img", "iframe":
			external++
		}
		if n.Data == "svg" && strings.Contains(attr(n, "class"), "timeline") {
			for c := range n.Descendants() {
				if c.Type == html.ElementNode && c.Data == "polyline" && attr(c, "data-series") != "" {
					timelines[attr(n, "data-scheduler")]++
				}
			}
		}
		if n.Data == "svg" && strings.Contains(attr(n, "class"), "node-map") {
			maps++
			if attr(n, "data-snapshot") == "end" {
				endMaps[attr(n, "data-scheduler")] = append(endMaps[attr(n, "data-scheduler")], attr(n, "data-node"))
			}
		}
	}
	if external > 0 {
		t.Errorf("report has %d script/link/img/iframe elements; it must be self-contained", external)
	}
	var nodeNames []string
	for _, n := range report.Nodes {
		nodeNames = append(nodeNames, n.Node)
	}
	for _, res := range report.Results {
		if len(res.Timeline) != report.Ticks {
			t.Errorf("%s: timeline has %d points, want one per tick (%d)", res.Scheduler, len(res.Timeline), report.Ticks)
		}
		if timelines[res.Scheduler] != 3 {
			t.Errorf("%s: over-time plot has %d series, want 3 (pods waiting, whole free nodes, whole free NUMA nodes)", res.Scheduler, timelines[res.Scheduler])
		}
		got := endMaps[res.Scheduler]
		slices.Sort(got)
		want := slices.Sorted(slices.Values(nodeNames))
		if !slices.Equal(got, want) {
			t.Errorf("%s: final maps for nodes %v, want one per node %v", res.Scheduler, got, want)
		}
	}
	if want := len(report.Nodes) * len(report.Results) * 2; maps < want {
		t.Errorf("report has %d maps, want at least %d (the end and checkpoints)", maps, want)
	}
}

// TestSimulatorSurvivesFaults runs the small pinned workload of
// TestSimulator through both schedulers with four faults each: the
// scheduler and a node's agent restarted, a critical XID on a GPU, and
// the kube-apiserver restarted, each a few milliseconds after a tick's
// pods were created (sim.Options.Faults). No pod is left stuck although
// it fits (every pod is placed but those pinned to the failed GPU's node
// that no longer fit there), the failed GPU is tainted to the end and no
// claim is allocated it once the scheduler could know, the claims and
// slices agree with the API, and the invariant checker finds nothing.
func TestSimulatorSurvivesFaults(t *testing.T) {
	tCtx := ktesting.Init(t)
	opts := smallPinned(t)
	opts.Faults, opts.WarmUpPods = 4, -1
	report, table := runSimulator(tCtx, t, opts)
	if !strings.Contains(table, "1 scheduler, 1 agent, 1 API server restarts; 1 GPU XID") {
		t.Error("the table does not say which faults were injected")
	}

	totalGPUs := countGPUs(report)
	var ticks [][]string
	for _, res := range report.Results {
		checkCounts(t, res, report.Pods, totalGPUs)
		if res.Stuck != 0 {
			t.Errorf("%s: %d pods fit by count and were not bound within the retry wait", res.Scheduler, res.Stuck)
		}
		if len(res.Faults) != opts.Faults {
			t.Fatalf("%s: %d faults injected, want %d: %+v", res.Scheduler, len(res.Faults), opts.Faults, res.Faults)
		}
		var at []string
		for i, f := range res.Faults {
			want := []string{sim.FaultSchedulerRestart, sim.FaultAgentRestart, sim.FaultGPUXID, sim.FaultAPIServerRestart}[i%4]
			if f.Kind != want || (f.Kind == sim.FaultAgentRestart || f.Kind == sim.FaultGPUXID) != (f.Node != "") {
				t.Errorf("%s: fault %d is %+v, want a %s (naming its node for an agent or a GPU)", res.Scheduler, i, f, want)
			}
			at = append(at, fmt.Sprintf("%d %s %s", f.Tick, f.Node, f.Device))
			if f.Kind != sim.FaultGPUXID {
				continue
			}
			// The GPU's taint is published, stays to the end, and no
			// claim is allocated the GPU once the scheduler could know
			// (an allocation picked before the taint reached the
			// scheduler is written a few milliseconds later).
			if f.Device == "" || f.XID == 0 || f.Tainted <= 0 {
				t.Errorf("%s: GPU fault %+v: want a device, its XID and when its taint was seen", res.Scheduler, f)
			}
			if _, ok := res.Snapshots[len(res.Snapshots)-1].Unhealthy[f.Device]; !ok {
				t.Errorf("%s: %s is not unhealthy at the end of the run", res.Scheduler, f.Device)
			}
		}
		for _, a := range res.TaintedAllocations {
			if a.After > time.Second {
				t.Errorf("%s: %s", res.Scheduler, a)
			} else {
				t.Logf("%s: an allocation raced with its taint: %s", res.Scheduler, a)
			}
		}
		ticks = append(ticks, at)
	}
	if len(ticks) == 2 && !slices.Equal(ticks[0], ticks[1]) {
		t.Errorf("the schedulers got different faults (tick, node, device): %v and %v", ticks[0], ticks[1])
	}
}

// smallPinned is the small workload of the simulator's tests: 4 nodes (3
// DGX H100 with NICs, 1 PCIe box with NVLink pairs), 40 pods pinned to
// nodes by the seed, through topodra-scheduler and the stock scheduler;
// each run's claims and slices are checked against the API at its end.
func smallPinned(t *testing.T) sim.Options {
	return sim.Options{
		Nodes:    4,
		Profile:  "dgx-h100=3,pcie-nvlink-pairs=1",
		Pods:     40,
		Seed:     7,
		Pin:      true,
		Progress: testWriter{t},
		AfterRun: func(ctx context.Context, client kubernetes.Interface, res *sim.Result) error {
			return checkAgainstAPI(ctx, client, res)
		},
	}
}

// runSimulator runs the simulator and logs its table, which it returns.
func runSimulator(tCtx ktesting.TContext, t *testing.T, opts sim.Options) (*sim.Report, string) {
	report, err := sim.Run(tCtx, opts)
	tCtx.ExpectNoError(err, "simulator run")
	var table bytes.Buffer
	tCtx.ExpectNoError(report.WriteTable(&table))
	t.Logf("report:\n%s", table.String())
	return report, table.String()
}

// countGPUs counts the GPUs of a report's nodes.
func countGPUs(report *sim.Report) int {
	n := 0
	for _, node := range report.Nodes {
		for _, d := range node.Devices {
			if d.GPU {
				n++
			}
		}
	}
	return n
}

// TestSimulatorPreemption: one DGX node, two long 4-GPU jobs, then an
// urgent 4-GPU job of a higher PriorityClass. Through topodra the urgent
// job preempts one of the others (by preemption, once) and runs; through
// the stock scheduler, which never preempts for devices, it waits to the
// end and nothing is evicted. Both runs end consistent with the API.
func TestSimulatorPreemption(t *testing.T) {
	tCtx := ktesting.Init(t)
	pod := func(name string, arrival int, class string) string {
		doc := fmt.Sprintf(`---
apiVersion: v1
kind: Pod
metadata:
  name: %s
  annotations: {sim.topodra.io/arrival: "%d"}
spec:
  terminationGracePeriodSeconds: 0
  containers: [{name: c, image: registry.k8s.io/pause:3.10, resources: {claims: [{name: gpus}]}}]
  resourceClaims: [{name: gpus, resourceClaimTemplateName: four-gpus}]
`, name, arrival)
		if class != "" {
			doc += "  priorityClassName: " + class + "\n"
		}
		return doc
	}
	yaml := `apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: four-gpus}
spec:
  spec:
    devices:
      requests: [{name: gpu, exactly: {deviceClassName: gpu.topodra.io, count: 4}}]
---
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {name: urgent}
value: 1000
` + pod("low-a", 0, "") + pod("low-b", 0, "") + pod("urgent", 2, "urgent")
	w, err := sim.ParseWorkload([]byte(yaml))
	tCtx.ExpectNoError(err)
	w.Drain = 3
	report, _ := runSimulator(tCtx, t, sim.Options{
		Nodes: 1, Profile: "dgx-h100", Workload: w, WarmUpPods: -1, Progress: testWriter{t},
		AfterRun: func(ctx context.Context, client kubernetes.Interface, res *sim.Result) error {
			return checkAgainstAPI(ctx, client, res)
		},
	})
	for _, res := range report.Results {
		for _, e := range res.Errors {
			t.Errorf("%s: tracking found: %s", res.Scheduler, e)
		}
		if res.InvariantViolations != 0 || res.Stuck != 0 {
			t.Errorf("%s: %d invariant violations, %d stuck pods", res.Scheduler, res.InvariantViolations, res.Stuck)
		}
		_, urgentPending := res.PendingPods["urgent"]
		switch res.Scheduler {
		case sim.SchedulerTopodra:
			if res.Evicted[v1.PodReasonPreemptionByScheduler] != 1 || urgentPending || res.RunningAtEnd != 2 || res.Finished != 0 {
				t.Errorf("topodra: evicted %v, urgent pending %v, running at end %d; want one preempted, the urgent job and one other running", res.Evicted, urgentPending, res.RunningAtEnd)
			}
			// The urgent job's first attempt, before its victim was
			// evicted, found the node's GPUs in use.
			if res.TurnedDown["devices_in_use"] == 0 {
				t.Errorf("topodra: attempts turned down by reason %v, want the urgent job's under devices_in_use", res.TurnedDown)
			}
		case sim.SchedulerStock:
			if len(res.Evicted) != 0 || !urgentPending {
				t.Errorf("stock: evicted %v, urgent pending %v; want nothing evicted and the urgent job waiting", res.Evicted, urgentPending)
			}
			if len(res.TurnedDown) != 0 {
				t.Errorf("stock: attempts turned down by TopologyDRA %v, want none (its profile has no TopologyDRA)", res.TurnedDown)
			}
		}
	}
}
