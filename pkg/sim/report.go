package sim

import (
	"cmp"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	v1 "k8s.io/api/core/v1"
)

// Placement is one allocated claim, rated against the free devices just
// before its allocation was written.
type Placement struct {
	Pod   string   `json:"pod"`
	Claim string   `json:"claim"`
	Node  string   `json:"node"`
	Tick  int      `json:"tick"`
	GPUs  []string `json:"gpus,omitempty"`
	NICs  []string `json:"nics,omitempty"`

	// MultiGPU: the claim got two or more GPUs. The In* fields say whether
	// they all share one NVLink clique / PCIe root / NUMA node; the
	// *Possible fields whether some node the pod could use had that many
	// free GPUs in one such domain.
	MultiGPU       bool `json:"multiGPU,omitempty"`
	InClique       bool `json:"inClique,omitempty"`
	CliquePossible bool `json:"cliquePossible,omitempty"`
	InRoot         bool `json:"inRoot,omitempty"`
	RootPossible   bool `json:"rootPossible,omitempty"`
	InNUMA         bool `json:"inNUMA,omitempty"`
	NUMAPossible   bool `json:"numaPossible,omitempty"`
	// GPUNIC: the claim got GPUs and NICs. NICSameRoot: all on one PCIe
	// root; NICPossible: a root with enough free GPUs and NICs existed.
	GPUNIC bool `json:"gpuNIC,omitempty"`
	// PodLevel: the GPU+NIC fields cover all claims of the pod (this is
	// its last claim to be allocated), not only this claim.
	PodLevel bool `json:"podLevel,omitempty"`
	// OpenedNode: a GPU-only claim went to a node no other pod used;
	// BusyNodeHadRoom: a node in use had room for it in the same kind of
	// domain (as aligned), so a whole node was broken up needlessly.
	OpenedNode      bool `json:"openedNode,omitempty"`
	BusyNodeHadRoom bool `json:"busyNodeHadRoom,omitempty"`
	NICSameRoot     bool `json:"nicSameRoot,omitempty"`
	NICPossible     bool `json:"nicPossible,omitempty"`
	// The *Trivial fields say that the allocation could not have missed
	// the level on its node: every GPU of the node (for NICRootTrivial
	// every GPU and NIC) shares one domain of it, so any allocation there
	// is aligned. Each implies its In* (or NICSameRoot) field.
	CliqueTrivial  bool `json:"cliqueTrivial,omitempty"`
	RootTrivial    bool `json:"rootTrivial,omitempty"`
	NUMATrivial    bool `json:"numaTrivial,omitempty"`
	NICRootTrivial bool `json:"nicRootTrivial,omitempty"`
}

// Snapshot is the device assignment at one tick: device key -> pod.
type Snapshot struct {
	Label string            `json:"label"`
	Tick  int               `json:"tick"`
	Used  map[string]string `json:"used"`
	// Unhealthy are the devices with a NoSchedule or NoExecute taint (a
	// GPU fault): key -> the taints' key=value.
	Unhealthy map[string]string `json:"unhealthy,omitempty"`
}

// Wait is how long pods of one size waited, in ticks.
type Wait struct {
	Pods  int `json:"pods"`
	Ticks int `json:"ticks"`
}

// Mean is the mean wait per pod.
func (w *Wait) Mean() float64 {
	if w == nil || w.Pods == 0 {
		return 0
	}
	return float64(w.Ticks) / float64(w.Pods)
}

// waitText renders the mean wait in ticks per pod size, with two
// decimals, e.g. "1:0.01 2:0.08 8:5.25".
func waitText(res Result) string {
	sizes := make([]int, 0, len(res.WaitByGPUs))
	for g := range res.WaitByGPUs {
		sizes = append(sizes, g)
	}
	slices.Sort(sizes)
	parts := make([]string, 0, len(sizes))
	for _, g := range sizes {
		parts = append(parts, fmt.Sprintf("%d:%.2f", g, res.WaitByGPUs[g].Mean()))
	}
	return strings.Join(parts, " ")
}

// openedText counts claims that went to an empty node, and those of them
// for which a node in use had room in the same kind of domain.
func openedText(res Result) string {
	opened, needless := 0, 0
	for _, p := range res.Placements {
		if p.OpenedNode {
			opened++
		}
		if p.BusyNodeHadRoom {
			needless++
		}
	}
	return fmt.Sprintf("%d / %d", opened, needless)
}

// Ratio counts aligned allocations among those where alignment was
// possible.
type Ratio struct {
	Aligned  int `json:"aligned"`
	Possible int `json:"possible"`
}

// Percent is Aligned/Possible in percent; 100 when nothing was possible.
func (r Ratio) Percent() float64 {
	if r.Possible == 0 {
		return 100
	}
	return 100 * float64(r.Aligned) / float64(r.Possible)
}

func (r Ratio) String() string {
	if r.Possible == 0 {
		return "-"
	}
	return fmt.Sprintf("%d/%d (%.0f%%)", r.Aligned, r.Possible, r.Percent())
}

func (r *Ratio) add(aligned, possible bool) {
	// An aligned allocation proves that alignment was possible, even if
	// the tracked state (written, not in-flight, allocations) said not.
	if aligned || possible {
		r.Possible++
	}
	if aligned {
		r.Aligned++
	}
}

// Alignment sums up placement quality.
type Alignment struct {
	MultiGPU int   `json:"multiGPU"`
	Clique   Ratio `json:"nvlinkClique"`
	Root     Ratio `json:"pcieRoot"`
	NUMA     Ratio `json:"numaNode"`
	GPUNIC   int   `json:"gpuNIC"`
	NICRoot  Ratio `json:"gpuNICPCIeRoot"`
	// Trivial counts, per measure, the aligned allocations that could not
	// have missed (Placement's *Trivial fields); they are counted in the
	// Ratios above too. Nil in reports written before they were counted.
	Trivial *TrivialCounts `json:"trivial,omitempty"`
}

// TrivialCounts counts, per measure, the allocations that were aligned
// whatever the scheduler did: every GPU of the node they went to (for the
// GPU+NIC measure every GPU and NIC) shares one domain of the level, say
// the one NVLink clique of all eight GPUs of a DGX H100.
type TrivialCounts struct {
	Clique  int `json:"nvlinkClique"`
	Root    int `json:"pcieRoot"`
	NUMA    int `json:"numaNode"`
	NICRoot int `json:"gpuNICPCIeRoot"`
}

// add counts one allocation: a multi-GPU one in the GPU measures, a
// GPU+NIC one in the NIC measure, and its trivial levels in Trivial (which
// it creates where nil).
func (a *Alignment) add(p Placement) {
	if a.Trivial == nil {
		a.Trivial = &TrivialCounts{}
	}
	trivial := func(n *int, yes bool) {
		if yes {
			*n++
		}
	}
	if p.MultiGPU {
		a.MultiGPU++
		a.Clique.add(p.InClique, p.CliquePossible)
		a.Root.add(p.InRoot, p.RootPossible)
		a.NUMA.add(p.InNUMA, p.NUMAPossible)
		trivial(&a.Trivial.Clique, p.CliqueTrivial)
		trivial(&a.Trivial.Root, p.RootTrivial)
		trivial(&a.Trivial.NUMA, p.NUMATrivial)
	}
	if p.GPUNIC {
		a.GPUNIC++
		a.NICRoot.add(p.NICSameRoot, p.NICPossible)
		trivial(&a.Trivial.NICRoot, p.NICRootTrivial)
	}
}

// Counts sums the aligned and the possible allocations over the four
// measures.
func (a Alignment) Counts() (aligned, possible int) {
	return a.Clique.Aligned + a.Root.Aligned + a.NUMA.Aligned + a.NICRoot.Aligned,
		a.Clique.Possible + a.Root.Possible + a.NUMA.Possible + a.NICRoot.Possible
}

// Fraction is all aligned over all possible, across the four measures.
func (a Alignment) Fraction() float64 {
	aligned, possible := a.Counts()
	if possible == 0 {
		return 1
	}
	return float64(aligned) / float64(possible)
}

// MissableCounts is Counts without the trivial allocations: the aligned
// and the possible ones, over the four measures, on nodes where an
// allocation could have missed the level. ok is false where the trivial
// ones were not counted (Trivial is nil).
func (a Alignment) MissableCounts() (aligned, possible int, ok bool) {
	if a.Trivial == nil {
		return 0, 0, false
	}
	aligned, possible = a.Counts()
	n := a.Trivial.Clique + a.Trivial.Root + a.Trivial.NUMA + a.Trivial.NICRoot
	return aligned - n, possible - n, true
}

// MissableFraction is the aligned over the possible of MissableCounts.
// ok is false where that has nothing to say: the trivial allocations were
// not counted, or every possible one was trivial.
func (a Alignment) MissableFraction() (fraction float64, ok bool) {
	aligned, possible, ok := a.MissableCounts()
	if !ok || possible == 0 {
		return 0, false
	}
	return float64(aligned) / float64(possible), true
}

// missableText is MissableFraction in percent, "-" where it has nothing
// to say.
func missableText(a Alignment) string {
	f, ok := a.MissableFraction()
	if !ok {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*f)
}

// NodeEnd is a node's free capacity at the end of a run.
type NodeEnd struct {
	Node     string `json:"node"`
	Profile  string `json:"profile"`
	GPUs     int    `json:"gpus"`
	FreeGPUs int    `json:"freeGPUs"`
	// LargestBlock is the most free GPUs that share one NUMA node and one
	// NVLink clique (devices without the attribute count as sharing it).
	LargestBlock int `json:"largestAlignedFreeBlock"`
	// Fit8 is how many more 8-GPU jobs fit; Fit4 how many more 4-GPU jobs
	// fit inside one NUMA node each.
	Fit8 int `json:"fit8GPU"`
	Fit4 int `json:"fit4GPUNUMAAligned"`
	// Unhealthy counts the GPUs with a NoSchedule or NoExecute taint,
	// which are not free (used or not).
	Unhealthy int `json:"unhealthyGPUs,omitempty"`
}

// TickPoint is the state of a run at the end of one tick.
type TickPoint struct {
	Tick int `json:"tick"`
	// Waiting counts the pods created and not bound.
	Waiting int `json:"waiting"`
	// FreeNodes counts the nodes with GPUs of which all are free;
	// FreeNUMA the whole free NUMA nodes of 4 GPUs (NodeEnd.Fit4 summed).
	FreeNodes int `json:"freeNodes"`
	FreeNUMA  int `json:"freeNUMANodes"`
	// FreeGPUs counts the free GPUs: neither in use nor unhealthy (a
	// node with an unhealthy GPU is never whole).
	FreeGPUs int `json:"freeGPUs"`
}

// Result is the outcome of one scheduler's run.
type Result struct {
	Scheduler     string `json:"scheduler"`
	SchedulerName string `json:"schedulerName"`
	Pods          int    `json:"pods"`
	Placed        int    `json:"placed"`
	Pending       int    `json:"pending"`
	RunningAtEnd  int    `json:"runningAtEnd"`
	// Finished counts the placed pods that ran their lifetime (evicted
	// pods are counted in Evicted).
	Finished        int       `json:"finished"`
	Alignment       Alignment `json:"alignment"`
	AlignedFraction float64   `json:"alignedFraction"`
	Nodes           []NodeEnd `json:"nodes"`
	Fit8            int       `json:"fit8GPU"`
	Fit4            int       `json:"fit4GPUNUMAAligned"`
	// Fit8Waited is how many of the Fit8 whole-node slots 8-GPU pods that
	// still wait at the end could take: the room counts as room for more
	// jobs, but a scheduler that keeps it free while such pods wait (the
	// headroom for smaller pods) does not give it to them.
	Fit8Waited int `json:"fit8GPUWhileWaiting,omitempty"`
	// Fit4Waited is the same for Fit4: how many of its NUMA-node slots
	// the pods asking for 4 GPUs that still wait at the end could take.
	Fit4Waited int `json:"fit4GPUNUMAAlignedWhileWaiting,omitempty"`
	FreeGPUs   int `json:"freeGPUs"`
	// PendingPodTicks sums, over all pods, the ticks from arrival to
	// binding (to the end of the run for pods never bound).
	PendingPodTicks int `json:"pendingPodTicks"`
	// PendingGPUTicks sums the same weighted by the GPUs each pod asks
	// for: the demand that waited. While the cluster is full, a scheduler
	// can only move it between pods, unless it leaves fewer GPUs idle
	// while pods wait (IdleWhileWaiting).
	PendingGPUTicks int `json:"pendingGPUTicks"`
	// IdleWhileWaiting sums, over the ticks at whose end a pod waits, the
	// GPUs that are free then: capacity left unused while there was demand
	// (the waiting pods did not fit into it).
	IdleWhileWaiting int `json:"idleGPUTicksWhileWaiting"`
	// WaitByGPUs splits that by the GPUs a pod's claims ask for, whatever
	// their selectors and constraints (0: no GPUs, or all of a node's).
	WaitByGPUs map[int]*Wait `json:"waitByGPUs,omitempty"`
	// WaitedBy counts the pods that were not bound in the tick they
	// arrived in, by what they ask for and what the cluster lacked at the
	// end of that tick (see ClassifyWait).
	WaitedBy WaitedBy `json:"waitedBy,omitempty"`
	// FreeInWholeNUMA is the mean over the ticks of the share of free GPUs
	// that sit in whole free NUMA nodes (4 GPUs), where a 4-GPU job can
	// start aligned: the fragmentation measure that does not depend on
	// which jobs happen to run at the end.
	FreeInWholeNUMA float64 `json:"freeInWholeNUMA"`
	// Timeline has one point per tick, taken after the tick's arrivals
	// were bound or marked unschedulable.
	Timeline []TickPoint `json:"timeline,omitempty"`
	// Throughput is pods bound in their arrival tick per second of time
	// spent waiting for them.
	Throughput float64 `json:"throughputPodsPerSecond"`
	// Latency from pod creation to the bind being observed, for pods
	// bound in their arrival tick.
	LatencyP50Ms   float64 `json:"latencyP50Ms"`
	LatencyP99Ms   float64 `json:"latencyP99Ms"`
	LatencySamples int     `json:"latencySamples"`
	// AttemptP50Ms and AttemptP99Ms come from the scheduler's own
	// histogram scheduler_scheduling_attempt_duration_seconds (scheduling
	// algorithm + binding) for successful attempts, interpolated within
	// its exponential buckets. Attempts counts attempts by result.
	AttemptP50Ms float64           `json:"attemptP50Ms"`
	AttemptP99Ms float64           `json:"attemptP99Ms"`
	Attempts     map[string]uint64 `json:"attempts,omitempty"`
	// TurnedDown counts the attempts that TopologyDRA turned down, by
	// reason (topodra_unschedulable_attempts_total); empty for stock.
	TurnedDown map[string]uint64 `json:"turnedDown,omitempty"`
	// SlowAttempts counts the successful attempts of more than 4 s (the
	// histogram's bucket above 4.096 s). Under faults these are, as a
	// rule, binding cycles that met a restart of the kube-apiserver,
	// which asks clients to retry after 5 s while it shuts down; their
	// number, not the scheduler, decides whether the p99 shows them.
	SlowAttempts int `json:"slowAttempts"`
	// SchedulerCPUSeconds is the CPU time of the scheduler's goroutines
	// while the ticks ran (they carry the pprof label scheduler=<name>;
	// from a CPU profile sampled at 100 Hz), or -1 where it could not be
	// measured (another CPU profile was running).
	SchedulerCPUSeconds float64     `json:"schedulerCPUSeconds"`
	WallSeconds         float64     `json:"wallSeconds"`
	Snapshots           []Snapshot  `json:"snapshots"`
	Placements          []Placement `json:"placements"`
	// PendingPods names the pods never bound, with the scheduler's last
	// message.
	PendingPods map[string]string `json:"pendingPods,omitempty"`
	// Notes are observations worth a look, like pods that fit by count
	// but stayed pending.
	Notes []string `json:"notes,omitempty"`
	// PrioritizedWait is the wait of the pods of a priority above 0 (nil:
	// none), counted as WaitByGPUs.
	PrioritizedWait *Wait `json:"prioritizedWait,omitempty"`
	// Evicted counts the pods that someone else than the simulator
	// deleted, by the reason of their DisruptionTarget condition
	// (PreemptionByScheduler for preemption); the simulator finished
	// their deletion, and they do not come back.
	Evicted map[string]int `json:"evicted,omitempty"`
	// Stuck counts the pods that fit by count after devices were freed
	// and were not bound within the retry wait (each once): pods the
	// scheduler did not retry when it could have, or turned down for a
	// reason the simulator does not know.
	Stuck int `json:"stuckPods,omitempty"`
	// Faults are the faults injected into the run (Options.Faults).
	Faults []Fault `json:"faults,omitempty"`
	// TaintedAllocations describe the allocations of devices that had a
	// NoSchedule or NoExecute taint when the simulator saw the
	// allocation, with how long it had seen the taint: a scheduler whose
	// view of the slices lags (its watch broken by an API server restart,
	// say) may make them; the node's agent then refuses to prepare the
	// claim, which the simulator, without kubelets, does not model.
	TaintedAllocations []TaintedAllocation `json:"taintedAllocations,omitempty"`
	// Errors are inconsistencies found while tracking (allocated devices
	// that do not exist, double allocation, claims on another node), and
	// the violations that the invariant checker (pkg/invariant, shipped
	// as topodra-check) finds in the cluster as the run leaves it.
	Errors []string `json:"errors,omitempty"`
	// InvariantViolations is how many violations the invariant checker
	// found at the end of the run; -1 where it could not read the cluster
	// (a note says why).
	InvariantViolations int `json:"invariantViolations"`
}

// TaintedAllocation is an allocation of a device that had a NoSchedule or
// NoExecute taint when the simulator saw the allocation.
type TaintedAllocation struct {
	Claim  string `json:"claim"`
	Pod    string `json:"pod"`
	Device string `json:"device"`
	// Taint is the device's taints, key=value.
	Taint string `json:"taint"`
	// After is how long the simulator had seen the taint: an allocation
	// that the scheduler picked before the taint reached it and wrote
	// after shows a few milliseconds.
	After time.Duration `json:"afterNs"`
}

func (a TaintedAllocation) String() string {
	return fmt.Sprintf("claim %s of pod %s: %s allocated %s after the simulator saw its taint %s", a.Claim, a.Pod, a.Device, a.After.Round(time.Millisecond), a.Taint)
}

// DeviceInfo describes one device for the maps.
type DeviceInfo struct {
	Key    string `json:"key"`
	Name   string `json:"name"`
	GPU    bool   `json:"gpu"`
	NUMA   string `json:"numaNode,omitempty"`
	Root   string `json:"pcieRoot,omitempty"`
	Clique string `json:"nvlinkClique,omitempty"`
}

// NodeTopology is a node's devices as published.
type NodeTopology struct {
	Node    string       `json:"node"`
	Profile string       `json:"profile"`
	Devices []DeviceInfo `json:"devices"`
}

// Report is the outcome of Run.
type Report struct {
	Seed int64 `json:"seed"`
	// Workload is "built-in" or the workload's name (its file).
	Workload string `json:"workload"`
	Profile  string `json:"profile"`
	Pods     int    `json:"pods"`
	Ticks    int    `json:"ticks"`
	// HostRequests says what the generated pods request besides devices
	// (HostRequestsText, or "none"); empty for a workload file.
	HostRequests string `json:"hostRequests,omitempty"`
	// WarmUpPods is the size of the unmeasured warm-up run through each
	// scheduler before the measured ones (0: none).
	WarmUpPods  int            `json:"warmUpPods,omitempty"`
	Nodes       []NodeTopology `json:"nodes"`
	Results     []Result       `json:"results"`
	WallSeconds float64        `json:"wallSeconds"`
}

// WriteTable prints the side-by-side table.
func (r *Report) WriteTable(out io.Writer) error {
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	header := "\t"
	for _, res := range r.Results {
		header += res.Scheduler + "\t"
	}
	fmt.Fprintln(w, header)
	for _, row := range resultRows(r.Results) {
		line := row.label + "\t"
		if row.sub {
			line = "  " + line
		}
		for _, res := range r.Results {
			line += row.cell(res) + "\t"
		}
		fmt.Fprintln(w, line)
	}
	if err := w.Flush(); err != nil {
		return err
	}

	// Per node at the end.
	fmt.Fprintln(out)
	fmt.Fprintln(out, "at the end, per node: free GPUs / largest aligned free block / more 8-GPU jobs / more 4-GPU NUMA-aligned jobs")
	w = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	header = "node\tprofile\t"
	for _, res := range r.Results {
		header += res.Scheduler + "\t"
	}
	fmt.Fprintln(w, header)
	for i, n := range r.Nodes {
		line := n.Node + "\t" + n.Profile + "\t"
		for _, res := range r.Results {
			if i < len(res.Nodes) {
				e := res.Nodes[i]
				line += fmt.Sprintf("%d / %d / %d / %d", e.FreeGPUs, e.LargestBlock, e.Fit8, e.Fit4)
				if e.Unhealthy > 0 {
					line += fmt.Sprintf(" (%d unhealthy)", e.Unhealthy)
				}
			}
			line += "\t"
		}
		fmt.Fprintln(w, line)
	}
	if err := w.Flush(); err != nil {
		return err
	}

	// What a run noticed beyond the numbers: pods that fit by count but
	// were not bound within the retry wait, and the like.
	for _, res := range r.Results {
		for _, note := range res.Notes {
			fmt.Fprintf(out, "[%s] note: %s\n", res.Scheduler, note)
		}
	}

	fmt.Fprintln(out)
	fmt.Fprintln(out, "pods not bound in the tick they arrived in, by size and what the cluster lacked at the end of that tick")
	for _, res := range r.Results {
		fmt.Fprintf(out, "%s:\n", res.Scheduler)
		if len(res.WaitedBy) == 0 {
			fmt.Fprintln(out, "  none")
		}
		for _, size := range res.WaitedBy.Sizes() {
			fmt.Fprintf(out, "  %s: %s\n", size, res.WaitedBy.Line(size, nil))
		}
	}

	run := r.RunTargets()
	if len(run) == 0 {
		return nil
	}
	fmt.Fprintln(out)
	if slices.ContainsFunc(r.Results, func(res Result) bool { return len(res.Faults) > 0 }) {
		fmt.Fprintln(out, "placement targets in this run alone, under faults (a restarted scheduler starts without its predecessor's state; throughput leaves out the time the faults took, latency does not): not a placement verdict")
	} else {
		fmt.Fprintln(out, "placement targets in this run alone (runs vary; the verdict is the multi-seed sweep: --seeds 1-8)")
	}
	w = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "target\twant\ttopodra\tstock\tmet\tbehind it, topodra vs stock\t")
	for _, t := range run {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t\n", runTargetName(t), t.Want, t.Topodra, t.Stock, verdict(t), r.runTargetBasis(t))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(out, "%d of %d met in this run%s\n", metCount(run), applicableCount(run), naNote(run, " (", ")"))
	return nil
}

// resultRow is one row of the side-by-side table of a report, in text
// (WriteTable) and HTML (WriteHTML) alike.
type resultRow struct {
	label string
	// sub rows belong to the row above them (indented, or set apart).
	sub  bool
	cell func(Result) string
}

// resultRows are the rows of the side-by-side table of results, in order;
// the row of injected faults only where a run had some.
func resultRows(results []Result) []resultRow {
	var faults []resultRow
	if slices.ContainsFunc(results, func(res Result) bool { return len(res.Faults) > 0 }) {
		faults = []resultRow{{"faults injected", false, faultsText}}
	}
	if slices.ContainsFunc(results, func(res Result) bool {
		return len(res.TaintedAllocations) > 0 || slices.ContainsFunc(res.Faults, func(f Fault) bool { return f.Kind == FaultGPUXID })
	}) {
		faults = append(faults, resultRow{"allocations of a tainted GPU", true, func(res Result) string { return fmt.Sprint(len(res.TaintedAllocations)) }})
	}
	rows := []resultRow{
		{"pods placed / pending", false, func(res Result) string { return fmt.Sprintf("%d / %d", res.Placed, res.Pending) }},
		{"finished / running at end", true, func(res Result) string { return fmt.Sprintf("%d / %d", res.Finished, res.RunningAtEnd) }},
		{"multi-GPU allocations", false, func(res Result) string { return fmt.Sprint(res.Alignment.MultiGPU) }},
		{"in one NVLink clique", true, func(res Result) string { return res.Alignment.Clique.String() }},
		{"in one PCIe root", true, func(res Result) string { return res.Alignment.Root.String() }},
		{"in one NUMA node", true, func(res Result) string { return res.Alignment.NUMA.String() }},
		{"GPU+NIC allocations", false, func(res Result) string { return fmt.Sprint(res.Alignment.GPUNIC) }},
		{"sharing a PCIe root", true, func(res Result) string { return res.Alignment.NICRoot.String() }},
		{"aligned overall", false, func(res Result) string { return fmt.Sprintf("%.1f%%", 100*res.AlignedFraction) }},
		{"aligned, where a placement there could miss", true, func(res Result) string { return missableText(res.Alignment) }},
		{"waiting: pod-ticks in all", false, func(res Result) string { return fmt.Sprint(res.PendingPodTicks) }},
		{"mean ticks by GPUs per pod", true, waitText},
		{"GPU-ticks waiting / GPUs idle meanwhile", true, func(res Result) string {
			return fmt.Sprintf("%d / %d", res.PendingGPUTicks, res.IdleWhileWaiting)
		}},
		{"empty nodes opened / needlessly", false, openedText},
		{"free GPUs in whole NUMA nodes", false, func(res Result) string { return fmt.Sprintf("%.0f%% (mean over ticks)", 100*res.FreeInWholeNUMA) }},
	}
	if slices.ContainsFunc(results, func(res Result) bool { return res.PrioritizedWait != nil || len(res.Evicted) > 0 }) {
		rows = append(rows,
			resultRow{"mean ticks waiting, pods of higher priority", true, func(res Result) string {
				if res.PrioritizedWait == nil {
					return "none"
				}
				return fmt.Sprintf("%.2f (%d pods)", res.PrioritizedWait.Mean(), res.PrioritizedWait.Pods)
			}},
			resultRow{"pods evicted (preempted)", true, evictedText})
	}
	rows = append(rows, faults...)
	rows = append(rows, []resultRow{
		{"pods stuck (fit by count, not bound within 10 s)", false, func(res Result) string { return fmt.Sprint(res.Stuck) }},
		{"invariant violations at the end (topodra-check)", false, func(res Result) string {
			if res.InvariantViolations < 0 {
				return "not checked"
			}
			return fmt.Sprint(res.InvariantViolations)
		}},
		{"free GPUs at end", false, func(res Result) string { return fmt.Sprint(res.FreeGPUs) }},
		{"more 8-GPU jobs fit", true, func(res Result) string { return fitLabel(res.Fit8, res.Fit8Waited, 8) }},
		{"more 4-GPU NUMA-aligned jobs fit", true, func(res Result) string { return fitLabel(res.Fit4, res.Fit4Waited, 4) }},
		{"throughput (pods/s)", false, func(res Result) string { return fmt.Sprintf("%.1f", res.Throughput) }},
		{"attempt latency p50 / p99", false, func(res Result) string {
			return fmt.Sprintf("%.1f / %.1f ms", res.AttemptP50Ms, res.AttemptP99Ms)
		}},
	}...)
	if len(faults) > 0 {
		rows = append(rows, resultRow{"successful attempts over 4 s", true, func(res Result) string { return fmt.Sprint(res.SlowAttempts) }})
	}
	rows = append(rows, []resultRow{
		{"attempts: scheduled / unschedulable", true, func(res Result) string {
			return fmt.Sprintf("%d / %d", res.Attempts["scheduled"], res.Attempts["unschedulable"])
		}},
		{"attempts TopologyDRA turned down, by reason", true, turnedDownText},
		{"scheduler CPU", true, schedulerCPUText},
		{"create->bind p50 / p99", false, func(res Result) string {
			return fmt.Sprintf("%.0f / %.0f ms", res.LatencyP50Ms, res.LatencyP99Ms)
		}},
		{"wall time", false, func(res Result) string { return fmt.Sprintf("%.1f s", res.WallSeconds) }},
	}...)
	return rows
}

// topodraAndStock finds topodra's and stock's item among items (nil for
// one that is missing), named by scheduler.
func topodraAndStock[T any](items []T, scheduler func(*T) string) (topodra, stock *T) {
	for i := range items {
		switch scheduler(&items[i]) {
		case SchedulerTopodra:
			topodra = &items[i]
		case SchedulerStock:
			stock = &items[i]
		}
	}
	return topodra, stock
}

// runTargetBasis says what a run's value of target t rests on, topodra's
// against stock's: for a wait, the pod-ticks waited by the pods of that
// size and how many there were; for alignment, the placements aligned and
// those that could have been. Empty for the other targets.
func (r *Report) runTargetBasis(t Target) string {
	topodra, stock := topodraAndStock(r.Results, func(res *Result) string { return res.Scheduler })
	if topodra == nil || stock == nil || t.NotApplicable {
		return ""
	}
	switch {
	case t.waitGPUs > 0:
		tw, sw := topodra.WaitByGPUs[t.waitGPUs], stock.WaitByGPUs[t.waitGPUs]
		if tw == nil || sw == nil {
			return ""
		}
		return fmt.Sprintf("%d vs %d pod-ticks over %d vs %d pods of the size", tw.Ticks, sw.Ticks, tw.Pods, sw.Pods)
	case t.alignment:
		ta, tp := topodra.Alignment.Counts()
		sa, sp := stock.Alignment.Counts()
		basis := fmt.Sprintf("%d of %d vs %d of %d aligned where possible", ta, tp, sa, sp)
		_, tm, tok := topodra.Alignment.MissableCounts()
		_, sm, sok := stock.Alignment.MissableCounts()
		if tok && sok {
			basis += fmt.Sprintf(", of which %d vs %d could not miss", tp-tm, sp-sm)
		}
		return basis
	}
	return ""
}

// runTargetName names a sweep's target for one run: its median is the
// run's value, its sum the run's count.
func runTargetName(t Target) string {
	return strings.TrimSuffix(strings.TrimPrefix(t.Measure, "median "), " (sum)")
}

// verdict is "yes" for a target met, "n/a" for one that does not apply,
// else "no".
func verdict(t Target) string {
	if t.NotApplicable {
		return "n/a"
	}
	if t.Met {
		return "yes"
	}
	return "no"
}

// metCount counts the targets met.
func metCount(ts []Target) int {
	n := 0
	for _, t := range ts {
		if t.Met {
			n++
		}
	}
	return n
}

// naNote explains the targets that do not apply, prefix and note in
// front of suffix; "" if all apply.
func naNote(ts []Target, prefix, suffix string) string {
	if applicableCount(ts) == len(ts) {
		return ""
	}
	why := "no pods of that size"
	for _, t := range ts {
		if t.NotApplicable && t.alignment {
			why += "; alignment: no claim that could be aligned"
		}
	}
	return prefix + "n/a: " + why + ", not counted" + suffix
}

// applicableCount counts the targets that apply (not NotApplicable).
func applicableCount(ts []Target) int {
	n := 0
	for _, t := range ts {
		if !t.NotApplicable {
			n++
		}
	}
	return n
}

// RunTargets checks this one run against the placement targets as a sweep
// of this one run would (each median is this run's value); nil unless the
// report has a topodra and a stock result.
func (r *Report) RunTargets() []Target {
	rep := &SweepReport{}
	ran := map[string]bool{}
	for i := range r.Results {
		rep.Rows = append(rep.Rows, rowOf("", r.Seed, 1, &r.Results[i]))
		ran[r.Results[i].Scheduler] = true
	}
	if !ran[SchedulerTopodra] || !ran[SchedulerStock] {
		return nil
	}
	rep.summarize([]string{SchedulerTopodra, SchedulerStock})
	return rep.Targets
}

// Description names the workload ("built-in workload, seed 1", a trace or
// the file) and, for generated workloads, what the pods request besides
// their devices.
func (r *Report) Description() string {
	d := "workload " + r.Workload
	if r.Workload == "" || r.Workload == "built-in" {
		d = fmt.Sprintf("built-in workload, seed %d", r.Seed)
	}
	switch r.HostRequests {
	case "":
	case "none":
		d += ", pods without CPU or memory requests"
	default:
		d += ", pods request " + r.HostRequests
	}
	return d
}

// Summary is a one-line verdict comparing the first two results.
func (r *Report) Summary() string {
	if len(r.Results) < 2 {
		return ""
	}
	a, b := r.Results[0], r.Results[1]
	var parts []string
	parts = append(parts, fmt.Sprintf("aligned %.1f%% (%s) vs %.1f%% (%s)", 100*a.AlignedFraction, a.Scheduler, 100*b.AlignedFraction, b.Scheduler))
	parts = append(parts, fmt.Sprintf("placed %d vs %d", a.Placed, b.Placed))
	parts = append(parts, fmt.Sprintf("pod-ticks waiting %d vs %d", a.PendingPodTicks, b.PendingPodTicks))
	parts = append(parts, fmt.Sprintf("free GPUs in whole NUMA nodes %.0f%% vs %.0f%%", 100*a.FreeInWholeNUMA, 100*b.FreeInWholeNUMA))
	return strings.Join(parts, "; ")
}

// nodeEnds computes per-node free capacity from a snapshot.
func nodeEnds(topo []NodeTopology, snap Snapshot) []NodeEnd {
	var out []NodeEnd
	for _, n := range topo {
		e := NodeEnd{Node: n.Node, Profile: n.Profile}
		block := map[[2]string]int{}
		numa := map[string]int{}
		for _, d := range n.Devices {
			if !d.GPU {
				continue
			}
			e.GPUs++
			if _, unhealthy := snap.Unhealthy[d.Key]; unhealthy {
				e.Unhealthy++
				continue
			}
			if _, used := snap.Used[d.Key]; used {
				continue
			}
			e.FreeGPUs++
			block[[2]string{d.NUMA, d.Clique}]++
			numa[d.NUMA]++
		}
		for _, c := range block {
			e.LargestBlock = max(e.LargestBlock, c)
		}
		e.Fit8 = e.FreeGPUs / 8
		for _, c := range numa {
			e.Fit4 += c / 4
		}
		out = append(out, e)
	}
	return out
}

// fitLabel is the number of jobs of gpus GPUs that fit at the end, with
// how many of those slots pods of that size still waiting could take (see
// Result.Fit8Waited and Result.Fit4Waited).
func fitLabel(fit, waited, gpus int) string {
	if waited == 0 {
		return fmt.Sprint(fit)
	}
	return fmt.Sprintf("%d (%d while %d-GPU pods wait)", fit, waited, gpus)
}

// SchedulerCPUMsPerPod is the scheduler's CPU time per pod placed, in
// milliseconds; -1 where it was not measured or no pod was placed.
func (res Result) SchedulerCPUMsPerPod() float64 {
	if res.SchedulerCPUSeconds < 0 || res.Placed == 0 {
		return -1
	}
	return 1000 * res.SchedulerCPUSeconds / float64(res.Placed)
}

// turnedDownText lists the attempts TopologyDRA turned down by reason,
// most first: "devices_in_use 212, held_back 31"; "none" for a scheduler
// without any.
func turnedDownText(res Result) string {
	if len(res.TurnedDown) == 0 {
		return "none"
	}
	reasons := slices.Collect(maps.Keys(res.TurnedDown))
	slices.SortFunc(reasons, func(a, b string) int {
		return cmp.Or(cmp.Compare(res.TurnedDown[b], res.TurnedDown[a]), strings.Compare(a, b))
	})
	parts := make([]string, 0, len(reasons))
	for _, r := range reasons {
		parts = append(parts, fmt.Sprintf("%s %d", r, res.TurnedDown[r]))
	}
	return strings.Join(parts, ", ")
}

// schedulerCPUText is the scheduler's CPU time over the run and per pod
// placed.
func schedulerCPUText(res Result) string {
	if res.SchedulerCPUSeconds < 0 {
		return "not measured"
	}
	if per := res.SchedulerCPUMsPerPod(); per >= 0 {
		return fmt.Sprintf("%.2f s, %.1f ms per pod placed", res.SchedulerCPUSeconds, per)
	}
	return fmt.Sprintf("%.2f s", res.SchedulerCPUSeconds)
}

// evictedText says how many pods were evicted, and of those how many by
// preemption.
func evictedText(res Result) string {
	n := 0
	for _, c := range res.Evicted {
		n += c
	}
	if n == 0 {
		return "0"
	}
	return fmt.Sprintf("%d (%d by preemption)", n, res.Evicted[v1.PodReasonPreemptionByScheduler])
}
