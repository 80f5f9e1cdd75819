package sim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// Scenario is one cell of a sweep: machines and a generated workload.
type Scenario struct {
	Name    string `json:"name"`
	Profile string `json:"profile"`
	Nodes   int    `json:"nodes"`
	Pods    int    `json:"pods"`
	Trace   string `json:"trace"`
}

// DefaultScenarios are the sweep's default cells: the built-in workload on
// the default 8-node mix and on a 16-node mix of the same profiles, and the
// poisson and nic-match traces on the default mix. Pod counts keep a full
// sweep of 8 seeds within a few minutes on two cores.
func DefaultScenarios() []Scenario {
	return []Scenario{
		{Name: "builtin-8", Profile: DefaultProfile, Nodes: 8, Pods: 100, Trace: TraceBuiltin},
		{Name: "builtin-16", Profile: "dgx-h100=12,pcie-nvlink-pairs=4", Nodes: 16, Pods: 160, Trace: TraceBuiltin},
		{Name: "poisson-8", Profile: DefaultProfile, Nodes: 8, Pods: 100, Trace: TracePoisson},
		{Name: "nic-match-8", Profile: DefaultProfile, Nodes: 8, Pods: 100, Trace: TraceNICMatch},
	}
}

// ParseSeeds parses "1-8", "3" or "1,4,7-9".
func ParseSeeds(s string) ([]int64, error) {
	var out []int64
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.ParseInt(strings.TrimSpace(lo), 10, 64)
		if err != nil || a < 1 {
			return nil, fmt.Errorf("seeds %q: %q is not a positive integer", s, lo)
		}
		b := a
		if isRange {
			if b, err = strconv.ParseInt(strings.TrimSpace(hi), 10, 64); err != nil || b < a {
				return nil, fmt.Errorf("seeds %q: bad range %q", s, part)
			}
		}
		for v := a; v <= b; v++ {
			out = append(out, v)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("seeds %q: none given", s)
	}
	return out, nil
}

// SweepRow is one scheduler's run of one scenario and seed.
type SweepRow struct {
	Scenario string `json:"scenario"`
	Seed     int64  `json:"seed"`
	// Round numbers the repetitions of a sweep's runs, from 1 (0 in
	// reports written before rounds existed): runs of the same scenario,
	// seed and round ran the same workload through each scheduler.
	Round     int    `json:"round,omitempty"`
	Scheduler string `json:"scheduler"`
	PodTicks  int    `json:"pendingPodTicks"`
	// GPUTicks and Idle are Result.PendingGPUTicks and
	// Result.IdleWhileWaiting.
	GPUTicks int `json:"pendingGPUTicks"`
	Idle     int `json:"idleGPUTicksWhileWaiting"`
	// MeanWait is the mean wait in ticks by GPUs per pod (1, 2, 4, 8);
	// absent where the run had no such pod.
	MeanWait    map[int]float64 `json:"meanWaitByGPUs"`
	NeverPlaced int             `json:"neverPlaced"`
	Fit8        int             `json:"fit8GPU"`
	// Fit8Waited is Result.Fit8Waited.
	Fit8Waited int `json:"fit8GPUWhileWaiting,omitempty"`
	Fit4       int `json:"fit4GPUNUMAAligned"`
	// Fit4Waited is Result.Fit4Waited.
	Fit4Waited int `json:"fit4GPUNUMAAlignedWhileWaiting,omitempty"`
	// FreeInWholeNUMA is Result.FreeInWholeNUMA.
	FreeInWholeNUMA float64 `json:"freeInWholeNUMA"`
	Aligned         float64 `json:"alignedFraction"`
	// Alignment is Result.Alignment: the counts behind Aligned, per
	// measure, and the trivial ones among them.
	Alignment    Alignment `json:"alignment"`
	Throughput   float64   `json:"throughputPodsPerSecond"`
	AttemptP50Ms float64   `json:"attemptP50Ms"`
	// SchedulerCPUMsPerPod is Result.SchedulerCPUMsPerPod.
	SchedulerCPUMsPerPod float64 `json:"schedulerCPUMsPerPod"`
	Errors               int     `json:"errors"`
	// Stuck is Result.Stuck.
	Stuck int `json:"stuckPods,omitempty"`
	// Tainted counts Result.TaintedAllocations.
	Tainted int `json:"taintedAllocations,omitempty"`
	// WaitedBy is Result.WaitedBy.
	WaitedBy WaitedBy `json:"waitedBy,omitempty"`
}

// SweepSizes are the pod sizes whose waits a sweep reports.
var SweepSizes = []int{1, 2, 4, 8}

func rowOf(scenario string, seed int64, round int, res *Result) SweepRow {
	row := SweepRow{Scenario: scenario, Seed: seed, Round: round, Scheduler: res.Scheduler, PodTicks: res.PendingPodTicks,
		GPUTicks: res.PendingGPUTicks, Idle: res.IdleWhileWaiting,
		MeanWait: map[int]float64{}, NeverPlaced: res.Pending, Fit8: res.Fit8, Fit8Waited: res.Fit8Waited, Fit4: res.Fit4, Fit4Waited: res.Fit4Waited,
		FreeInWholeNUMA: res.FreeInWholeNUMA, Aligned: res.AlignedFraction, Alignment: res.Alignment, Throughput: res.Throughput,
		AttemptP50Ms: res.AttemptP50Ms, SchedulerCPUMsPerPod: res.SchedulerCPUMsPerPod(), Errors: len(res.Errors), Stuck: res.Stuck,
		Tainted: len(res.TaintedAllocations), WaitedBy: res.WaitedBy}
	for _, g := range SweepSizes {
		if w := res.WaitByGPUs[g]; w != nil && w.Pods > 0 {
			row.MeanWait[g] = w.Mean()
		}
	}
	return row
}

// Stat is the median and spread (quartiles, range) of one measure.
type Stat struct {
	Median float64 `json:"median"`
	P25    float64 `json:"p25"`
	P75    float64 `json:"p75"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
	N      int     `json:"n"`
}

func statOf(values []float64) Stat {
	if len(values) == 0 {
		return Stat{}
	}
	v := slices.Clone(values)
	slices.Sort(v)
	q := func(p float64) float64 {
		// Linear interpolation between closest ranks.
		x := p * float64(len(v)-1)
		i := int(x)
		if i+1 >= len(v) {
			return v[len(v)-1]
		}
		return v[i] + (x-float64(i))*(v[i+1]-v[i])
	}
	return Stat{Median: q(0.5), P25: q(0.25), P75: q(0.75), Min: v[0], Max: v[len(v)-1], N: len(v)}
}

// String is the median and quartiles; "-" for a measure without values.
func (s Stat) String() string {
	if s.N == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2f [%.2f-%.2f]", s.Median, s.P25, s.P75)
}

// SweepSummary aggregates one scheduler over all rows of a sweep.
type SweepSummary struct {
	Scheduler string       `json:"scheduler"`
	Runs      int          `json:"runs"`
	PodTicks  Stat         `json:"pendingPodTicks"`
	MeanWait  map[int]Stat `json:"meanWaitByGPUs"`
	Aligned   Stat         `json:"alignedFraction"`
	// AlignedMissable is Alignment.MissableFraction, over the runs where
	// it has something to say. No target uses it.
	AlignedMissable Stat `json:"alignedWhereMissable"`
	Throughput      Stat `json:"throughputPodsPerSecond"`
	AttemptP50      Stat `json:"attemptP50Ms"`
	// SchedulerCPU is over the runs where it was measured.
	SchedulerCPU Stat `json:"schedulerCPUMsPerPod"`
	// Sums over runs.
	GPUTicks    int `json:"pendingGPUTicks"`
	Idle        int `json:"idleGPUTicksWhileWaiting"`
	NeverPlaced int `json:"neverPlaced"`
	Fit8        int `json:"fit8GPU"`
	Fit8Waited  int `json:"fit8GPUWhileWaiting,omitempty"`
	Fit4        int `json:"fit4GPUNUMAAligned"`
	Fit4Waited  int `json:"fit4GPUNUMAAlignedWhileWaiting,omitempty"`
	Errors      int `json:"errors"`
	Stuck       int `json:"stuckPods,omitempty"`
	Tainted     int `json:"taintedAllocations,omitempty"`
	// WaitedBy sums the runs' pods that waited by size and cause;
	// WaitedRuns counts the runs in which a pod of that size waited for
	// that cause. Runs of sweeps written before causes were recorded count
	// in neither.
	WaitedBy   WaitedBy `json:"waitedBy,omitempty"`
	WaitedRuns WaitedBy `json:"waitedRuns,omitempty"`
}

func summarize(scheduler string, rows []SweepRow) SweepSummary {
	s := SweepSummary{Scheduler: scheduler, MeanWait: map[int]Stat{}, WaitedBy: WaitedBy{}, WaitedRuns: WaitedBy{}}
	var ticks, aligned, missable, tput, p50, cpu []float64
	waits := map[int][]float64{}
	for _, r := range rows {
		if r.Scheduler != scheduler {
			continue
		}
		s.Runs++
		ticks = append(ticks, float64(r.PodTicks))
		// A run with nothing that could be aligned says nothing of
		// alignment (its fraction is 1 by convention).
		if _, possible := r.Alignment.Counts(); possible > 0 {
			aligned = append(aligned, r.Aligned)
		}
		if f, ok := r.Alignment.MissableFraction(); ok {
			missable = append(missable, f)
		}
		tput = append(tput, r.Throughput)
		p50 = append(p50, r.AttemptP50Ms)
		if r.SchedulerCPUMsPerPod >= 0 {
			cpu = append(cpu, r.SchedulerCPUMsPerPod)
		}
		for g, w := range r.MeanWait {
			waits[g] = append(waits[g], w)
		}
		s.GPUTicks += r.GPUTicks
		s.Idle += r.Idle
		s.NeverPlaced += r.NeverPlaced
		s.Fit8 += r.Fit8
		s.Fit8Waited += r.Fit8Waited
		s.Fit4 += r.Fit4
		s.Fit4Waited += r.Fit4Waited
		s.Errors += r.Errors
		s.Stuck += r.Stuck
		s.Tainted += r.Tainted
		for size, causes := range r.WaitedBy {
			for cause, n := range causes {
				if n > 0 {
					s.WaitedBy.Add(size, cause, n)
					s.WaitedRuns.Add(size, cause, 1)
				}
			}
		}
	}
	s.PodTicks, s.Aligned, s.Throughput, s.AttemptP50 = statOf(ticks), statOf(aligned), statOf(tput), statOf(p50)
	s.SchedulerCPU, s.AlignedMissable = statOf(cpu), statOf(missable)
	for g, w := range waits {
		s.MeanWait[g] = statOf(w)
	}
	return s
}

// Target is one of the placement targets, checked for topodra against stock.
type Target struct {
	Measure string `json:"measure"`
	Want    string `json:"want"`
	Topodra string `json:"topodra"`
	Stock   string `json:"stock"`
	Met     bool   `json:"met"`
	// NotApplicable says that the runs give the target nothing to judge:
	// a target of the waits of pods of one size where one scheduler's
	// runs or the other's had no such pod. Such a target is not Met and
	// does not count among the targets; Topodra and Stock say "n/a".
	NotApplicable bool `json:"notApplicable,omitempty"`
	// Paired compares the two schedulers run by run, for the measures
	// of single runs that the target takes the median of; nil for the
	// others. It does not decide Met.
	Paired *Paired `json:"paired,omitempty"`
	// MetInResamples is the share of Resamples bootstrap resamples of the
	// runs in which the target is met (see metInResamples): how firmly
	// the runs behind Met decide it, over the resamples in which the
	// target applies. Near 0.5 the verdict is a coin toss at this number
	// of runs. It does not decide Met.
	MetInResamples float64 `json:"metInResamples"`
	// waitGPUs is the pod size of a wait target (0 for the others);
	// alignment marks the alignment target. A run's table uses them to
	// say what the target's value rests on.
	waitGPUs  int
	alignment bool
}

// Paired counts the runs (scenario, seed and round) that both schedulers ran in
// which topodra's value was lower than, equal to or higher than stock's.
// Both schedulers see the same workload in a run, so this shows whether a
// difference between the medians holds run by run or is a matter of
// which runs happened to fall in the middle. Over the same runs it counts
// those without a wait (value 0) and takes the mean, per scheduler: where
// most runs have no wait, the median only says whether more than half of
// them had none.
type Paired struct {
	Lower  int `json:"lower"`
	Equal  int `json:"equal"`
	Higher int `json:"higher"`
	// ZeroTopodra and ZeroStock count the runs without a wait.
	ZeroTopodra int `json:"zeroTopodra"`
	ZeroStock   int `json:"zeroStock"`
	// MeanTopodra and MeanStock are the means over the runs.
	MeanTopodra float64 `json:"meanTopodra"`
	MeanStock   float64 `json:"meanStock"`
}

func (p Paired) String() string {
	return fmt.Sprintf("%d / %d / %d", p.Lower, p.Equal, p.Higher)
}

// pairedWaits compares topodra's mean wait of pods with g GPUs with
// stock's in every run where both had such pods.
func pairedWaits(rows []SweepRow, g int) *Paired {
	type run struct {
		scenario string
		seed     int64
		round    int
	}
	stock := map[run]float64{}
	for _, r := range rows {
		if w, ok := r.MeanWait[g]; ok && r.Scheduler == SchedulerStock {
			stock[run{r.Scenario, r.Seed, r.Round}] = w
		}
	}
	p := &Paired{}
	for _, r := range rows {
		if r.Scheduler != SchedulerTopodra {
			continue
		}
		w, ok := r.MeanWait[g]
		sw, both := stock[run{r.Scenario, r.Seed, r.Round}]
		if !ok || !both {
			continue
		}
		switch {
		case w < sw:
			p.Lower++
		case w == sw:
			p.Equal++
		default:
			p.Higher++
		}
		p.MeanTopodra += w
		p.MeanStock += sw
		if w == 0 {
			p.ZeroTopodra++
		}
		if sw == 0 {
			p.ZeroStock++
		}
	}
	if n := p.Lower + p.Equal + p.Higher; n > 0 {
		p.MeanTopodra /= float64(n)
		p.MeanStock /= float64(n)
	}
	return p
}

// targets checks topodra's summary against stock's; rows are the runs
// behind both (for the run-by-run comparison). A target of the waits of
// one size applies only where both schedulers' runs had pods of that
// size, the alignment target only where topodra's runs had a claim that
// could be aligned; otherwise it is NotApplicable.
func targets(t, s SweepSummary, rows []SweepRow) []Target {
	var out []Target
	for _, g := range SweepSizes {
		tw, sw := t.MeanWait[g], s.MeanWait[g]
		tg := Target{Measure: fmt.Sprintf("median mean wait, %d GPU", g), Want: "<= stock", waitGPUs: g}
		if tw.N == 0 || sw.N == 0 {
			out = append(out, notApplicable(tg))
			continue
		}
		tg.Topodra, tg.Stock, tg.Met = fmt.Sprintf("%.3f", tw.Median), fmt.Sprintf("%.3f", sw.Median), tw.Median <= sw.Median
		tg.Paired = pairedWaits(rows, g)
		out = append(out, tg)
	}
	tw, sw := t.MeanWait[8], s.MeanWait[8]
	ratio := Target{Measure: "median mean wait, 8 GPU", Want: "<= 0.5 x stock", waitGPUs: 8}
	if tw.N == 0 || sw.N == 0 {
		ratio = notApplicable(ratio)
	} else {
		ratio.Topodra, ratio.Stock, ratio.Met = fmt.Sprintf("%.3f", tw.Median), fmt.Sprintf("%.3f", sw.Median), tw.Median <= 0.5*sw.Median
	}
	alignment := Target{Measure: "median alignment", Want: ">= 95%", alignment: true,
		Topodra: fmt.Sprintf("%.1f%%", 100*t.Aligned.Median), Stock: fmt.Sprintf("%.1f%%", 100*s.Aligned.Median), Met: t.Aligned.Median >= 0.95}
	if t.Aligned.N == 0 {
		alignment = notApplicable(alignment)
	}
	out = append(out, ratio,
		Target{Measure: "pods never placed (sum)", Want: "<= stock",
			Topodra: fmt.Sprint(t.NeverPlaced), Stock: fmt.Sprint(s.NeverPlaced), Met: t.NeverPlaced <= s.NeverPlaced},
		// A whole-node slot that an 8-GPU pod still waits for is no room
		// for the next one: the target counts the others.
		Target{Measure: "8-GPU jobs that fit at the end (sum)", Want: ">= stock (aim 2x)",
			Topodra: fitLabel(t.Fit8, t.Fit8Waited, 8), Stock: fitLabel(s.Fit8, s.Fit8Waited, 8), Met: t.Fit8-t.Fit8Waited >= s.Fit8-s.Fit8Waited},
		alignment,
		Target{Measure: "median throughput", Want: ">= 0.95 x stock",
			Topodra: fmt.Sprintf("%.1f", t.Throughput.Median), Stock: fmt.Sprintf("%.1f", s.Throughput.Median), Met: t.Throughput.Median >= 0.95*s.Throughput.Median},
	)
	return out
}

// notApplicable marks a target that the runs give nothing to judge.
func notApplicable(t Target) Target {
	t.NotApplicable, t.Met = true, false
	t.Topodra, t.Stock = "n/a", "n/a"
	return t
}

// SweepOptions configure [Sweep].
type SweepOptions struct {
	// Seeds to run each scenario with.
	Seeds []int64
	// Rounds is how many times every scenario and seed runs (default 1).
	// Runs of one seed differ only in the timing of the components, but
	// that is enough to move a median of near-zero waits: more rounds
	// give the medians more runs.
	Rounds int
	// Scenarios to run (default DefaultScenarios).
	Scenarios []Scenario
	// Base supplies everything else of each run (schedulers, scheduler
	// config, timeouts, progress). Its Profile, Nodes, Pods, Seed and
	// Trace are set per run; its Workload must be nil.
	Base Options
	// Rows, if set, receives one line per run and scheduler as runs end.
	Rows io.Writer
	// Build names the build of the program that runs the sweep (see
	// SweepReport.Build); empty if unknown.
	Build string
}

// SweepReport is the outcome of Sweep.
type SweepReport struct {
	Scenarios []Scenario `json:"scenarios"`
	Seeds     []int64    `json:"seeds"`
	// Rounds is how many times each scenario and seed ran (summed over
	// the reports a pooled report was made of).
	Rounds    int            `json:"rounds,omitempty"`
	Rows      []SweepRow     `json:"rows"`
	Summaries []SweepSummary `json:"summaries"`
	// PerScenario are the summaries of each scenario, in scenario order.
	PerScenario map[string][]SweepSummary `json:"perScenario"`
	// HostRequests says what the pods request besides devices
	// (Report.HostRequests).
	HostRequests string `json:"hostRequests"`
	// Faults is how many faults each run had injected (Options.Faults);
	// PoolSweeps pools only reports with the same number.
	Faults int `json:"faults,omitempty"`
	// Targets compare topodra with stock over all rows; empty unless both ran.
	Targets     []Target `json:"targets,omitempty"`
	WallSeconds float64  `json:"wallSeconds"`
	// Incomplete says which run failed, where the sweep stopped early;
	// the rows are then those of the runs before it.
	Incomplete string `json:"incomplete,omitempty"`
	// Build names the build that ran the sweep (SweepOptions.Build), and
	// SchedulerConfigs each scheduler's configuration (SchedulerConfigs);
	// with them PoolSweeps tells whether it pools runs of one policy.
	// Empty in reports written before they were recorded, and in a pooled
	// report whose reports differ in them.
	Build            string            `json:"build,omitempty"`
	SchedulerConfigs map[string]string `json:"schedulerConfigs,omitempty"`
	// Mixed lists, in a pooled report, the builds and configurations of
	// its reports where they are not all the same or not all known.
	Mixed []string `json:"mixed,omitempty"`
}

// SchedulerConfigs names the configuration that each of the schedulers
// runs with under opts: "embedded" or "default" where opts gives none, or
// the SHA-256 (first 12 hex digits) of the configuration it gives.
func SchedulerConfigs(opts Options, schedulers []string) map[string]string {
	digest := func(data []byte, none string) string {
		if len(data) == 0 {
			return none
		}
		sum := sha256.Sum256(data)
		return "sha256:" + hex.EncodeToString(sum[:6])
	}
	out := map[string]string{}
	for _, s := range schedulers {
		switch s {
		case SchedulerTopodra:
			out[s] = digest(opts.SchedulerConfig, "embedded")
		case SchedulerStock:
			out[s] = digest(opts.StockSchedulerConfig, "default")
		}
	}
	return out
}

// Sweep runs every scenario with every seed through the schedulers (one
// fresh cluster per run and scheduler, one run at a time) and summarizes
// the runs: medians with quartiles, sums, and the targets of topodra
// against stock. A failed run stops the sweep: it returns the error and,
// where runs finished before it, the report of those (Incomplete set).
func Sweep(ctx context.Context, opts SweepOptions) (*SweepReport, error) {
	start := time.Now()
	if len(opts.Scenarios) == 0 {
		opts.Scenarios = DefaultScenarios()
	}
	if opts.Base.Workload != nil {
		return nil, fmt.Errorf("a sweep generates its workloads; Workload must be nil")
	}
	schedulers := opts.Base.Schedulers
	if len(schedulers) == 0 {
		schedulers = []string{SchedulerTopodra, SchedulerStock}
	}
	rounds := max(1, opts.Rounds)
	rep := &SweepReport{Scenarios: opts.Scenarios, Seeds: opts.Seeds, Rounds: rounds, HostRequests: opts.Base.hostRequests(), Faults: opts.Base.Faults,
		Build: opts.Build, SchedulerConfigs: SchedulerConfigs(opts.Base, schedulers)}
	var rw *tabwriter.Writer
	if opts.Rows != nil {
		rw = tabwriter.NewWriter(opts.Rows, 0, 0, 1, ' ', tabwriter.AlignRight)
		fmt.Fprintln(rw, sweepHeader)
		_ = rw.Flush()
	}
	for round := 1; round <= rounds; round++ {
		for _, sc := range opts.Scenarios {
			for _, seed := range opts.Seeds {
				o := opts.Base
				o.Profile, o.Nodes, o.Pods, o.Seed, o.Trace = sc.Profile, sc.Nodes, sc.Pods, seed, sc.Trace
				o.Schedulers = runOrder(schedulers, seed, round)
				o.Checkpoints = -1
				// One warm-up per sweep, before its first run.
				if len(rep.Rows) > 0 {
					o.WarmUpPods = -1
				}
				r, err := Run(ctx, o)
				if err != nil {
					err = fmt.Errorf("scenario %s seed %d round %d: %w", sc.Name, seed, round, err)
					if len(rep.Rows) == 0 {
						return nil, err
					}
					rep.Incomplete = err.Error()
					rep.summarize(schedulers)
					rep.WallSeconds = time.Since(start).Seconds()
					return rep, err
				}
				for i := range r.Results {
					row := rowOf(sc.Name, seed, round, &r.Results[i])
					rep.Rows = append(rep.Rows, row)
					if rw != nil {
						writeRow(rw, row)
						_ = rw.Flush()
					}
				}
			}
		}
	}
	rep.summarize(schedulers)
	rep.WallSeconds = time.Since(start).Seconds()
	return rep, nil
}

// runOrder is the order in which the schedulers run the workload of one
// seed and round: as given where seed and round add up to an even number,
// reversed otherwise, so that over a sweep each scheduler runs first, and
// right after the other's run, equally often.
func runOrder(schedulers []string, seed int64, round int) []string {
	order := slices.Clone(schedulers)
	if (seed+int64(round))%2 == 1 {
		slices.Reverse(order)
	}
	return order
}

// summarize fills the summaries, per scenario and over all rows, of
// schedulers, and the targets where both topodra and stock ran.
func (rep *SweepReport) summarize(schedulers []string) {
	rep.Summaries, rep.PerScenario, rep.Targets = nil, map[string][]SweepSummary{}, nil
	for _, s := range schedulers {
		rep.Summaries = append(rep.Summaries, summarize(s, rep.Rows))
		for _, sc := range rep.Scenarios {
			var rows []SweepRow
			for _, r := range rep.Rows {
				if r.Scenario == sc.Name {
					rows = append(rows, r)
				}
			}
			rep.PerScenario[sc.Name] = append(rep.PerScenario[sc.Name], summarize(s, rows))
		}
	}
	t, s := topodraAndStock(rep.Summaries, func(sum *SweepSummary) string { return sum.Scheduler })
	if t != nil && s != nil {
		rep.Targets = targets(*t, *s, rep.Rows)
		for i, share := range metInResamples(rep.Rows, Resamples) {
			rep.Targets[i].MetInResamples = share
		}
	}
}

// Resamples is how many bootstrap resamples of a sweep's runs its targets
// are checked on (Target.MetInResamples).
const Resamples = 1000

// metInResamples checks the targets on n resamples of rows and returns,
// per target in the order of targets, the share of the resamples in which
// it applies in which it was met (0 where it applies in none). The unit
// drawn is a workload: one scenario and seed, with every round of it and
// the rows of both schedulers, so the schedulers stay paired on the same
// workloads, and the rounds of one seed, which repeat its workload with
// other timing, are not taken for independent runs. Each resample draws,
// within each scenario, as many seeds as the scenario has, with
// replacement, so every resample keeps the sweep's mix of scenarios. The
// draws come from a fixed seed: the same rows give the same shares.
func metInResamples(rows []SweepRow, n int) []float64 {
	type workload struct {
		scenario string
		seed     int64
	}
	var scenarios []string
	seeds := map[string][]workload{}
	byWorkload := map[workload][]SweepRow{}
	for _, r := range rows {
		k := workload{r.Scenario, r.Seed}
		if _, ok := byWorkload[k]; !ok {
			if _, ok := seeds[r.Scenario]; !ok {
				scenarios = append(scenarios, r.Scenario)
			}
			seeds[r.Scenario] = append(seeds[r.Scenario], k)
		}
		byWorkload[k] = append(byWorkload[k], r)
	}
	if len(byWorkload) == 0 || n <= 0 {
		return nil
	}
	rng := rand.New(rand.NewPCG(1, 2))
	var met, applied []int
	sample := make([]SweepRow, 0, len(rows))
	for range n {
		sample = sample[:0]
		for _, sc := range scenarios {
			keys := seeds[sc]
			for range keys {
				sample = append(sample, byWorkload[keys[rng.IntN(len(keys))]]...)
			}
		}
		ts := targets(summarize(SchedulerTopodra, sample), summarize(SchedulerStock, sample), nil)
		if met == nil {
			met, applied = make([]int, len(ts)), make([]int, len(ts))
		}
		for i, t := range ts {
			if t.NotApplicable {
				continue
			}
			applied[i]++
			if t.Met {
				met[i]++
			}
		}
	}
	out := make([]float64, len(met))
	for i, m := range met {
		if applied[i] > 0 {
			out[i] = float64(m) / float64(applied[i])
		}
	}
	return out
}

// PoolSweeps joins the runs of several sweep reports into one report and
// summarizes them again, so that the medians and targets are taken over
// all their runs. Each report's rounds are numbered after the previous
// report's, so runs are compared run by run only within the report they
// came from. The reports must agree on the pods' CPU and memory requests
// and on the faults injected into each run;
// a scenario of the same name must have the same machines and workload.
// Reports of different builds or scheduler configurations (or of unknown
// ones) are pooled too, as their runs may still be comparable, but the
// pooled report says so in Mixed, and its summary first of all.
func PoolSweeps(reports []*SweepReport) (*SweepReport, error) {
	if len(reports) == 0 {
		return nil, fmt.Errorf("no sweep reports to pool")
	}
	out := &SweepReport{HostRequests: reports[0].HostRequests, Faults: reports[0].Faults, Mixed: mixedProvenance(reports)}
	if len(out.Mixed) == 0 {
		out.Build, out.SchedulerConfigs = reports[0].Build, reports[0].SchedulerConfigs
	}
	scenarios := map[string]Scenario{}
	var schedulers []string
	for i, r := range reports {
		if len(r.Rows) == 0 {
			return nil, fmt.Errorf("sweep report %d has no runs", i+1)
		}
		if r.HostRequests != out.HostRequests {
			return nil, fmt.Errorf("sweep report %d: pods' requests %q, but report 1 has %q", i+1, r.HostRequests, out.HostRequests)
		}
		if r.Faults != out.Faults {
			return nil, fmt.Errorf("sweep report %d: %d faults injected into each run, but report 1 has %d", i+1, r.Faults, out.Faults)
		}
		for _, sc := range r.Scenarios {
			if prev, ok := scenarios[sc.Name]; ok && prev != sc {
				return nil, fmt.Errorf("sweep report %d: scenario %s is %+v, but an earlier report has %+v", i+1, sc.Name, sc, prev)
			} else if !ok {
				scenarios[sc.Name] = sc
				out.Scenarios = append(out.Scenarios, sc)
			}
		}
		for _, seed := range r.Seeds {
			if !slices.Contains(out.Seeds, seed) {
				out.Seeds = append(out.Seeds, seed)
			}
		}
		offset, last := out.Rounds, 0
		for _, row := range r.Rows {
			if !slices.Contains(schedulers, row.Scheduler) {
				schedulers = append(schedulers, row.Scheduler)
			}
			// Reports from before rounds have round 0: one round.
			round := max(1, row.Round)
			last = max(last, round)
			row.Round = offset + round
			out.Rows = append(out.Rows, row)
		}
		out.Rounds = offset + last
		out.WallSeconds += r.WallSeconds
		if r.Incomplete != "" {
			out.Incomplete = strings.TrimPrefix(out.Incomplete+"; ", "; ") + fmt.Sprintf("report %d: %s", i+1, r.Incomplete)
		}
	}
	slices.Sort(out.Seeds)
	out.summarize(schedulers)
	return out, nil
}

// mixedProvenance describes each report's build and configurations where
// they are not the same in all reports, or unknown in any; nil otherwise.
func mixedProvenance(reports []*SweepReport) []string {
	describe := func(r *SweepReport) string {
		build := r.Build
		if build == "" {
			build = "unknown"
		}
		configs := "unknown"
		if len(r.SchedulerConfigs) > 0 {
			var parts []string
			for _, name := range slices.Sorted(maps.Keys(r.SchedulerConfigs)) {
				parts = append(parts, name+" "+r.SchedulerConfigs[name])
			}
			configs = strings.Join(parts, ", ")
		}
		return "build " + build + "; configurations: " + configs
	}
	mixed := false
	for _, r := range reports {
		known := r.Build != "" && len(r.SchedulerConfigs) > 0
		mixed = mixed || !known || describe(r) != describe(reports[0])
	}
	if !mixed || len(reports) < 2 {
		return nil
	}
	var out []string
	for i, r := range reports {
		out = append(out, fmt.Sprintf("report %d: %s", i+1, describe(r)))
	}
	return out
}

const sweepHeader = "scenario\tseed\tscheduler\tpod-ticks\tGPU-ticks\tidle\twait 1\twait 2\twait 4\twait 8\tnever placed\tfit 8\tfit 4 NUMA\twhole-NUMA free\taligned\taligned, could miss\tpods/s\tattempt p50 ms\tsched CPU ms/pod\t"

func writeRow(w io.Writer, r SweepRow) {
	wait := func(g int) string {
		if v, ok := r.MeanWait[g]; ok {
			return fmt.Sprintf("%.2f", v)
		}
		return "-"
	}
	cpu := "-"
	if r.SchedulerCPUMsPerPod >= 0 {
		cpu = fmt.Sprintf("%.2f", r.SchedulerCPUMsPerPod)
	}
	fmt.Fprintf(w, "%s\t%d\t%s\t%d\t%d\t%d\t%s\t%s\t%s\t%s\t%d\t%d\t%d\t%.0f%%\t%.1f%%\t%s\t%.1f\t%.1f\t%s\t\n",
		r.Scenario, r.Seed, r.Scheduler, r.PodTicks, r.GPUTicks, r.Idle, wait(1), wait(2), wait(4), wait(8),
		r.NeverPlaced, r.Fit8, r.Fit4, 100*r.FreeInWholeNUMA, 100*r.Aligned, missableText(r.Alignment), r.Throughput, r.AttemptP50Ms, cpu)
}

// runsLine says what the runs are: seeds, and rounds where more than one.
func (r *SweepReport) runsLine() string {
	var seeds []string
	for i := 0; i < len(r.Seeds); {
		j := i
		for j+1 < len(r.Seeds) && r.Seeds[j+1] == r.Seeds[j]+1 {
			j++
		}
		if j > i {
			seeds = append(seeds, fmt.Sprintf("%d-%d", r.Seeds[i], r.Seeds[j]))
		} else {
			seeds = append(seeds, strconv.FormatInt(r.Seeds[i], 10))
		}
		i = j + 1
	}
	line := "seeds " + strings.Join(seeds, ",")
	if r.Rounds > 1 {
		line += fmt.Sprintf(", %d rounds", r.Rounds)
	}
	return line
}

// WriteSummary prints the medians (with quartiles) per scenario and over
// all runs, then the targets.
func (r *SweepReport) WriteSummary(out io.Writer) error {
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	if r.Incomplete != "" {
		fmt.Fprintf(w, "INCOMPLETE: the sweep stopped early (%s); these are the runs before it\n", r.Incomplete)
	}
	if len(r.Mixed) > 0 {
		fmt.Fprintf(w, "POOLED ACROSS BUILDS OR CONFIGURATIONS (or unknown ones): the medians mix policies where these differ\n")
		for _, m := range r.Mixed {
			fmt.Fprintf(w, "  %s\n", m)
		}
	} else if r.Build != "" {
		fmt.Fprintf(w, "build %s\n", r.Build)
	}
	fmt.Fprintf(w, "pods' CPU and memory requests: %s\n", r.HostRequests)
	fmt.Fprintf(w, "medians [p25-p75] over the runs (%s); GPU-ticks waiting, GPU-ticks idle while pods wait, never placed, fit 8 and fit 4 summed\n", r.runsLine())
	fmt.Fprintln(w, "scenario\tscheduler\truns\tpod-ticks\tGPU-ticks\tidle\twait 1\twait 2\twait 4\twait 8\tnever placed\tfit 8\tfit 4 NUMA\taligned\taligned, could miss\tpods/s\tattempt p50 ms\tsched CPU ms/pod\t")
	line := func(name string, s SweepSummary) {
		missable := "-"
		if s.AlignedMissable.N > 0 {
			missable = fmt.Sprintf("%.1f%%", 100*s.AlignedMissable.Median)
		}
		fmt.Fprintf(w, "%s\t%s\t%d\t%s\t%d\t%d\t%s\t%s\t%s\t%s\t%d\t%d\t%d\t%.1f%%\t%s\t%.1f\t%.1f\t%.2f\t\n", name, s.Scheduler, s.Runs,
			s.PodTicks, s.GPUTicks, s.Idle, s.MeanWait[1], s.MeanWait[2], s.MeanWait[4], s.MeanWait[8], s.NeverPlaced, s.Fit8, s.Fit4,
			100*s.Aligned.Median, missable, s.Throughput.Median, s.AttemptP50.Median, s.SchedulerCPU.Median)
	}
	for _, sc := range r.Scenarios {
		for _, s := range r.PerScenario[sc.Name] {
			line(sc.Name, s)
		}
	}
	for _, s := range r.Summaries {
		line("all", s)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	r.writeWaitCauses(out)
	if len(r.Targets) == 0 {
		return nil
	}
	fmt.Fprintln(out)
	w = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "target\twant\ttopodra\tstock\tmet\tmet in resamples\truns where topodra is lower / equal / higher\truns without a wait, topodra / stock\tmean over the runs, topodra / stock\t")
	for _, t := range r.Targets {
		paired, zero, mean, resampled := "", "", "", "n/a"
		if !t.NotApplicable {
			resampled = fmt.Sprintf("%.0f %%", 100*t.MetInResamples)
		}
		if p := t.Paired; p != nil {
			paired = p.String()
			zero = fmt.Sprintf("%d / %d", p.ZeroTopodra, p.ZeroStock)
			mean = fmt.Sprintf("%.3f / %.3f", p.MeanTopodra, p.MeanStock)
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", t.Measure, t.Want, t.Topodra, t.Stock, verdict(t), resampled, paired, zero, mean)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(out, "met in resamples: the share of %d resamples of the workloads (scenario and seed, with all their rounds and both schedulers together, drawn with replacement within each scenario) in which the target is met; near 50 %% the verdict is a coin toss at this number of workloads\n", Resamples)
	fmt.Fprintf(out, "%d of %d targets met over %d runs per scheduler (medians decide; %sthe last three columns look at the runs of the same scenario, seed and round that both schedulers did: compared one by one, those without a wait, the mean)\n", metCount(r.Targets), applicableCount(r.Targets), len(r.Rows)/max(1, len(r.Summaries)), naNote(r.Targets, "", "; "))
	var stuck []string
	for _, s := range r.Summaries {
		stuck = append(stuck, fmt.Sprintf("%s %d", s.Scheduler, s.Stuck))
	}
	fmt.Fprintf(out, "pods that fit by free device count but were not bound within %s of the devices being freed, summed over the runs: %s\n", retryTimeout, strings.Join(stuck, ", "))
	if r.Faults > 0 {
		var tainted []string
		for _, s := range r.Summaries {
			tainted = append(tainted, fmt.Sprintf("%s %d", s.Scheduler, s.Tainted))
		}
		fmt.Fprintf(out, "%d faults injected into each run (--faults): waiting, placement and throughput are under faults, not a placement verdict; allocations of a GPU already tainted, summed over the runs: %s\n", r.Faults, strings.Join(tainted, ", "))
	}
	return nil
}

// writeWaitCauses prints, per scheduler, the pods that waited by size and
// cause over all runs, and in how many runs each occurred; nothing where
// no run recorded causes.
func (r *SweepReport) writeWaitCauses(out io.Writer) {
	recorded := false
	for _, s := range r.Summaries {
		recorded = recorded || len(s.WaitedBy) > 0
	}
	if !recorded {
		return
	}
	fmt.Fprintf(out, "\npods not bound in the tick they arrived in, by size and what the cluster lacked at the end of that tick, summed over the runs (%s; in how many runs)\n", r.runsLine())
	for _, s := range r.Summaries {
		fmt.Fprintf(out, "%s:\n", s.Scheduler)
		if len(s.WaitedBy) == 0 {
			fmt.Fprintln(out, "  none")
		}
		for _, size := range s.WaitedBy.Sizes() {
			fmt.Fprintf(out, "  %s: %s\n", size, s.WaitedBy.Line(size, s.WaitedRuns))
		}
	}
}
