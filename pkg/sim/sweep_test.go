package sim

import (
	"fmt"
	"maps"
	"math"
	"regexp"
	"slices"
	"strings"
	"testing"
	"text/tabwriter"

	resourceapi "k8s.io/api/resource/v1"
)

func TestParseSeeds(t *testing.T) {
	tests := map[string]struct {
		in      string
		want    []int64
		wantErr bool
	}{
		"range":  {in: "1-4", want: []int64{1, 2, 3, 4}},
		"single": {in: "3", want: []int64{3}},
		"mixed":  {in: "1,4,7-8", want: []int64{1, 4, 7, 8}},
		"empty":  {in: "", wantErr: true},
		"zero":   {in: "0-2", wantErr: true},
		"down":   {in: "5-2", wantErr: true},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			got, err := ParseSeeds(tc.in)
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, wantErr %v", err, tc.wantErr)
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("got %v, want %v", got, tc.want)
			}
		})
	}
}

func TestStatOf(t *testing.T) {
	s := statOf([]float64{4, 1, 3, 2})
	if s.Median != 2.5 || s.Min != 1 || s.Max != 4 || s.P25 != 1.75 || s.P75 != 3.25 || s.N != 4 {
		t.Errorf("statOf = %+v", s)
	}
}

// TestRowOf: a sweep row carries the run's waits by size and the
// alignment counts behind its aligned fraction.
func TestRowOf(t *testing.T) {
	res := &Result{Scheduler: "topodra", Pending: 2, Stuck: 3,
		Alignment:       Alignment{MultiGPU: 3, Clique: Ratio{2, 3}, Root: Ratio{1, 2}, NUMA: Ratio{3, 3}, GPUNIC: 1, NICRoot: Ratio{1, 1}},
		AlignedFraction: 7.0 / 9,
		WaitByGPUs:      map[int]*Wait{1: {Pods: 2, Ticks: 1}, 8: {}},
	}
	row := rowOf("builtin-8", 3, 1, res)
	if row.Alignment != res.Alignment || row.Aligned != res.AlignedFraction || row.NeverPlaced != 2 {
		t.Errorf("row %+v, want the alignment %+v (%.3f) and 2 never placed", row, res.Alignment, res.AlignedFraction)
	}
	if row.Stuck != 3 {
		t.Errorf("row counts %d stuck pods, want the run's 3", row.Stuck)
	}
	if len(row.MeanWait) != 1 || row.MeanWait[1] != 0.5 {
		t.Errorf("mean waits %v, want 1 GPU: 0.5 and no entry for sizes without pods", row.MeanWait)
	}
}

func TestTargets(t *testing.T) {
	stat := func(v float64) Stat { return Stat{Median: v, N: 1} }
	topodra := SweepSummary{Scheduler: SchedulerTopodra, MeanWait: map[int]Stat{1: stat(0), 2: stat(0.1), 4: stat(0.5), 8: stat(1)},
		Aligned: stat(0.97), Throughput: stat(50), Fit8: 10}
	stock := SweepSummary{Scheduler: SchedulerStock, MeanWait: map[int]Stat{1: stat(0.1), 2: stat(0.1), 4: stat(1), 8: stat(3)},
		Aligned: stat(0.7), Throughput: stat(51), Fit8: 5, NeverPlaced: 1}
	for _, tg := range targets(topodra, stock, nil) {
		if !tg.Met {
			t.Errorf("target %q not met: %+v", tg.Measure, tg)
		}
	}
	topodra.MeanWait[8] = stat(2)
	met := 0
	for _, tg := range targets(topodra, stock, nil) {
		if tg.Met {
			met++
		}
	}
	if want := len(targets(topodra, stock, nil)) - 1; met != want {
		t.Errorf("8-GPU wait 2 vs stock 3: %d targets met, want %d (only the 0.5x target fails)", met, want)
	}
}

func TestPairedWaits(t *testing.T) {
	row := func(scenario string, seed int64, sched string, waits map[int]float64) SweepRow {
		return SweepRow{Scenario: scenario, Seed: seed, Scheduler: sched, MeanWait: waits}
	}
	rows := []SweepRow{
		row("a", 1, SchedulerTopodra, map[int]float64{1: 0, 8: 2}),
		row("a", 1, SchedulerStock, map[int]float64{1: 0.1, 8: 5}),
		row("a", 2, SchedulerTopodra, map[int]float64{1: 0.2, 8: 6}),
		row("a", 2, SchedulerStock, map[int]float64{1: 0, 8: 6}),
		// The same seed in another scenario is another run.
		row("b", 1, SchedulerTopodra, map[int]float64{1: 0, 8: 1}),
		row("b", 1, SchedulerStock, map[int]float64{1: 0, 8: 3}),
		// A run without 8-GPU pods for one of them, and a run stock did
		// not do, are left out.
		row("b", 2, SchedulerTopodra, map[int]float64{1: 0.5}),
		row("b", 2, SchedulerStock, map[int]float64{1: 0.5, 8: 2}),
		row("c", 1, SchedulerTopodra, map[int]float64{1: 9, 8: 9}),
	}
	for g, want := range map[int]Paired{
		// Runs a1, a2, b1, b2: topodra 0, 0.2, 0, 0.5; stock 0.1, 0, 0, 0.5.
		1: {Lower: 1, Equal: 2, Higher: 1, ZeroTopodra: 2, ZeroStock: 2, MeanTopodra: 0.7 / 4, MeanStock: 0.6 / 4},
		// Runs a1, a2, b1: topodra 2, 6, 1; stock 5, 6, 3.
		8: {Lower: 2, Equal: 1, Higher: 0, MeanTopodra: 3, MeanStock: 14.0 / 3},
		2: {},
	} {
		if got := pairedWaits(rows, g); *got != want {
			t.Errorf("%d GPU: got %+v, want %+v", g, *got, want)
		}
	}
	stat := func(v float64) Stat { return Stat{Median: v, N: 1} }
	sum := SweepSummary{MeanWait: map[int]Stat{1: stat(0), 2: stat(0), 4: stat(0), 8: stat(1)}}
	// Only the waits of each size against stock's compare run by run.
	for _, tg := range targets(sum, sum, rows) {
		perSize := strings.HasPrefix(tg.Measure, "median mean wait") && tg.Want == "<= stock"
		if perSize != (tg.Paired != nil) {
			t.Errorf("%s, %s: paired %v", tg.Measure, tg.Want, tg.Paired)
		}
		if tg.Measure == "median mean wait, 8 GPU" && perSize && tg.Paired.String() != "2 / 1 / 0" {
			t.Errorf("8-GPU target: paired %v, want 2 / 1 / 0", tg.Paired)
		}
	}
}

func TestGenerateTraceIsSeeded(t *testing.T) {
	nodes, err := PlanNodes(DefaultProfile, 8)
	if err != nil {
		t.Fatal(err)
	}
	for _, trace := range []string{TracePoisson, TraceNICMatch, TraceUrgent} {
		a, err := GenerateTrace(trace, 2, 80, nodes)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := GenerateTrace(trace, 2, 80, nodes)
		if len(a.Jobs) != 80 || len(b.Jobs) != 80 {
			t.Fatalf("%s: %d and %d jobs, want 80", trace, len(a.Jobs), len(b.Jobs))
		}
		constrained := 0
		for i := range a.Jobs {
			if a.Jobs[i].Pod.Name != b.Jobs[i].Pod.Name || a.Jobs[i].Arrival != b.Jobs[i].Arrival || a.Jobs[i].Lifetime != b.Jobs[i].Lifetime {
				t.Fatalf("%s: job %d differs between equal seeds", trace, i)
			}
			if i > 0 && a.Jobs[i].Arrival < a.Jobs[i-1].Arrival {
				t.Fatalf("%s: arrivals not in order at job %d", trace, i)
			}
		}
		for _, tmpl := range a.Templates {
			if len(tmpl.Spec.Spec.Devices.Constraints) > 0 {
				constrained++
			}
		}
		if trace == TraceNICMatch && constrained == 0 {
			t.Errorf("%s: no template with a matchAttribute constraint", trace)
		}
		urgent := 0
		for _, j := range a.Jobs {
			if j.Pod.Spec.PriorityClassName == UrgentClass {
				urgent++
				if gpus := gpusAsked(j.Pod, templatesByName(a.Templates)); gpus < 4 {
					t.Errorf("%s: urgent pod %s asks for %d GPUs, want 4 or 8", trace, j.Pod.Name, gpus)
				}
			}
		}
		hasClass := len(a.PriorityClasses) == 1 && a.PriorityClasses[0].Name == UrgentClass && a.PriorityClasses[0].Value == UrgentPriority
		if trace == TraceUrgent && (urgent == 0 || !hasClass) {
			t.Errorf("%s: %d urgent pods, priority classes %v; want some, and the class", trace, urgent, a.PriorityClasses)
		}
		if trace != TraceUrgent && (urgent > 0 || len(a.PriorityClasses) > 0) {
			t.Errorf("%s: %d urgent pods, %d priority classes; want none", trace, urgent, len(a.PriorityClasses))
		}
	}
}

// TestPoolSweeps: pooled reports are summarized over all their runs, each
// report's rounds follow the previous report's, and runs are compared run
// by run only within the report they came from.
func TestPoolSweeps(t *testing.T) {
	sc := Scenario{Name: "a", Profile: DefaultProfile, Nodes: 8, Pods: 100, Trace: TraceBuiltin}
	row := func(seed int64, round int, sched string, wait8 float64) SweepRow {
		return SweepRow{Scenario: "a", Seed: seed, Round: round, Scheduler: sched, MeanWait: map[int]float64{8: wait8}, Aligned: 0.97, Throughput: 50}
	}
	// A report from before rounds (round 0), and one of two rounds.
	first := &SweepReport{Scenarios: []Scenario{sc}, Seeds: []int64{1}, HostRequests: "x", WallSeconds: 10,
		Rows: []SweepRow{row(1, 0, SchedulerTopodra, 2), row(1, 0, SchedulerStock, 6)}}
	second := &SweepReport{Scenarios: []Scenario{sc}, Seeds: []int64{1, 2}, Rounds: 2, HostRequests: "x", WallSeconds: 20,
		Rows: []SweepRow{
			row(1, 1, SchedulerTopodra, 4), row(1, 1, SchedulerStock, 8),
			row(2, 2, SchedulerTopodra, 9), row(2, 2, SchedulerStock, 7),
			// Stock alone in round 1 of seed 2: nothing to pair it with.
			row(2, 1, SchedulerStock, 1),
		}}
	first.Rows[0].Stuck, second.Rows[2].Stuck = 1, 2
	second.Incomplete = "scenario a seed 3 round 2: timed out"
	pooled, err := PoolSweeps([]*SweepReport{first, second})
	if err != nil {
		t.Fatal(err)
	}
	if pooled.Rounds != 3 || len(pooled.Rows) != 7 || !slices.Equal(pooled.Seeds, []int64{1, 2}) || pooled.WallSeconds != 30 {
		t.Errorf("pooled: %d rounds, %d rows, seeds %v, %.0f s; want 3, 7, [1 2], 30 s", pooled.Rounds, len(pooled.Rows), pooled.Seeds, pooled.WallSeconds)
	}
	var rounds []int
	for _, r := range pooled.Rows {
		rounds = append(rounds, r.Round)
	}
	if want := []int{1, 1, 2, 2, 3, 3, 2}; !slices.Equal(rounds, want) {
		t.Errorf("rounds %v, want %v", rounds, want)
	}
	if want := "report 2: scenario a seed 3 round 2: timed out"; pooled.Incomplete != want {
		t.Errorf("pooled incomplete %q, want %q", pooled.Incomplete, want)
	}
	var summary strings.Builder
	if err := pooled.WriteSummary(&summary); err != nil || !strings.Contains(summary.String(), "INCOMPLETE: the sweep stopped early") {
		t.Errorf("the summary of an incomplete pool does not say so (%v):\n%s", err, summary.String())
	}
	if first.Rows[0].Round != 0 || second.Rows[0].Round != 1 {
		t.Errorf("pooling changed its inputs: rounds %d, %d", first.Rows[0].Round, second.Rows[0].Round)
	}
	// Medians over all runs: topodra 2, 4, 9; stock 6, 8, 7, 1.
	var top, stock SweepSummary
	for _, s := range pooled.Summaries {
		switch s.Scheduler {
		case SchedulerTopodra:
			top = s
		case SchedulerStock:
			stock = s
		}
	}
	if top.Runs != 3 || top.MeanWait[8].Median != 4 || stock.Runs != 4 || stock.MeanWait[8].Median != 6.5 {
		t.Errorf("summaries: topodra %d runs, median %v; stock %d runs, median %v; want 3, 4 and 4, 6.5",
			top.Runs, top.MeanWait[8].Median, stock.Runs, stock.MeanWait[8].Median)
	}
	if top.Stuck != 3 || stock.Stuck != 0 {
		t.Errorf("stuck pods summed: topodra %d, stock %d; want 3 and 0", top.Stuck, stock.Stuck)
	}
	var text strings.Builder
	if err := pooled.WriteSummary(&text); err != nil {
		t.Fatal(err)
	}
	if want := "summed over the runs: topodra 3, stock 0"; !strings.Contains(text.String(), want) {
		t.Errorf("summary does not say %q:\n%s", want, text.String())
	}
	if strings.Contains(text.String(), "faults injected") {
		t.Errorf("summary of a sweep without faults speaks of faults:\n%s", text.String())
	}
	faulted := *pooled
	faulted.Faults = 4
	text.Reset()
	if err := faulted.WriteSummary(&text); err != nil {
		t.Fatal(err)
	}
	if want := "4 faults injected into each run"; !strings.Contains(text.String(), want) {
		t.Errorf("summary of a sweep with faults does not say %q:\n%s", want, text.String())
	}
	if len(pooled.PerScenario["a"]) != 2 || len(pooled.Targets) == 0 {
		t.Errorf("per scenario %v, %d targets; want both schedulers and the targets", pooled.PerScenario, len(pooled.Targets))
	}
	for _, tg := range pooled.Targets {
		if tg.Measure == "median mean wait, 8 GPU" && tg.Paired != nil {
			// Pairs: (2, 6), (4, 8), (9, 7).
			if want := (Paired{Lower: 2, Higher: 1, MeanTopodra: 5, MeanStock: 7}); *tg.Paired != want {
				t.Errorf("8-GPU pairs %+v, want %+v", *tg.Paired, want)
			}
		}
	}

	other := *second
	other.HostRequests = "none"
	if _, err := PoolSweeps([]*SweepReport{first, &other}); err == nil || !strings.Contains(err.Error(), "requests") {
		t.Errorf("reports with different pod requests pooled: %v", err)
	}
	other = *second
	other.Faults = 4
	if _, err := PoolSweeps([]*SweepReport{first, &other}); err == nil || !strings.Contains(err.Error(), "faults") {
		t.Errorf("a sweep with faults pooled with one without: %v", err)
	}
	other = *second
	other.Scenarios = []Scenario{{Name: "a", Profile: DefaultProfile, Nodes: 16, Pods: 100, Trace: TraceBuiltin}}
	if _, err := PoolSweeps([]*SweepReport{first, &other}); err == nil || !strings.Contains(err.Error(), "scenario a") {
		t.Errorf("reports with different scenarios of one name pooled: %v", err)
	}
	if _, err := PoolSweeps(nil); err == nil {
		t.Error("no reports pooled without an error")
	}
	if _, err := PoolSweeps([]*SweepReport{first, {HostRequests: "x"}}); err == nil {
		t.Error("a report without runs pooled without an error")
	}
}

// TestPoolSweepsProvenance: a pool of reports of one build and the same
// scheduler configurations keeps them; reports of different builds or
// configurations, or of unknown ones, are pooled with each report's named
// in Mixed and a warning at the top of the summary.
func TestPoolSweepsProvenance(t *testing.T) {
	sc := Scenario{Name: "a", Profile: DefaultProfile, Nodes: 8, Pods: 100, Trace: TraceBuiltin}
	report := func(build string, configs map[string]string) *SweepReport {
		return &SweepReport{Scenarios: []Scenario{sc}, Seeds: []int64{1}, HostRequests: "x", Build: build, SchedulerConfigs: configs,
			Rows: []SweepRow{
				{Scenario: "a", Seed: 1, Scheduler: SchedulerTopodra, MeanWait: map[int]float64{8: 2}, Aligned: 0.97, Throughput: 50},
				{Scenario: "a", Seed: 1, Scheduler: SchedulerStock, MeanWait: map[int]float64{8: 6}, Aligned: 0.7, Throughput: 50},
			}}
	}
	configs := SchedulerConfigs(Options{}, []string{SchedulerTopodra, SchedulerStock})
	if want := map[string]string{SchedulerTopodra: "embedded", SchedulerStock: "default"}; !maps.Equal(configs, want) {
		t.Errorf("configurations of the defaults %v, want %v", configs, want)
	}
	own := SchedulerConfigs(Options{SchedulerConfig: []byte("a"), StockSchedulerConfig: []byte("b")}, []string{SchedulerTopodra, SchedulerStock})
	if !strings.HasPrefix(own[SchedulerTopodra], "sha256:") || own[SchedulerTopodra] == own[SchedulerStock] {
		t.Errorf("configurations given %v, want distinct digests", own)
	}
	summary := func(r *SweepReport) string {
		t.Helper()
		var b strings.Builder
		if err := r.WriteSummary(&b); err != nil {
			t.Fatal(err)
		}
		return b.String()
	}

	same, err := PoolSweeps([]*SweepReport{report("v1 sha256:aaa", configs), report("v1 sha256:aaa", configs)})
	if err != nil {
		t.Fatal(err)
	}
	if same.Build != "v1 sha256:aaa" || !maps.Equal(same.SchedulerConfigs, configs) || len(same.Mixed) != 0 {
		t.Errorf("pool of one build: build %q, configurations %v, mixed %v", same.Build, same.SchedulerConfigs, same.Mixed)
	}
	if text := summary(same); strings.Contains(text, "POOLED ACROSS") || !strings.Contains(text, "build v1 sha256:aaa") {
		t.Errorf("summary of a pool of one build:\n%s", text)
	}

	for name, second := range map[string]*SweepReport{
		"another build":         report("v1 sha256:bbb", configs),
		"another configuration": report("v1 sha256:aaa", own),
		"an unknown build":      report("", nil),
	} {
		mixed, err := PoolSweeps([]*SweepReport{report("v1 sha256:aaa", configs), second})
		if err != nil {
			t.Fatal(err)
		}
		if mixed.Build != "" || mixed.SchedulerConfigs != nil || len(mixed.Mixed) != 2 || !strings.HasPrefix(mixed.Mixed[1], "report 2: build ") {
			t.Errorf("%s: build %q, configurations %v, mixed %q; want none, none and both reports named", name, mixed.Build, mixed.SchedulerConfigs, mixed.Mixed)
		}
		if text := summary(mixed); !strings.Contains(text, "POOLED ACROSS BUILDS OR CONFIGURATIONS") {
			t.Errorf("%s: the summary does not warn:\n%s", name, text)
		}
	}
}

// TestMetInResamples: a target that every run meets is met in every
// resample, one that a minority of runs decides is met in some resamples
// only, the schedulers' rows of a run stay together, and the same rows
// give the same shares.
func TestMetInResamples(t *testing.T) {
	row := func(seed int64, sched string, wait1, wait8 float64) SweepRow {
		return SweepRow{Scenario: "a", Seed: seed, Scheduler: sched, MeanWait: map[int]float64{1: wait1, 2: 0, 4: 0, 8: wait8},
			Aligned: 0.97, Alignment: Alignment{Root: Ratio{Aligned: 97, Possible: 100}}, Throughput: 50}
	}
	var rows []SweepRow
	for seed := range int64(20) {
		// Topodra's 8-GPU pods wait a third of stock's in every run;
		// its 1-GPU pods wait in 9 runs of 20 (stock's in none), so the
		// median is 0 and whether a resample keeps it there is a coin toss.
		wait1 := 0.0
		if seed < 9 {
			wait1 = 0.1
		}
		rows = append(rows, row(seed, SchedulerTopodra, wait1, float64(seed+1)), row(seed, SchedulerStock, 0, 3*float64(seed+1)))
	}
	shares := metInResamples(rows, 400)
	ts := targets(summarize(SchedulerTopodra, rows), summarize(SchedulerStock, rows), nil)
	if len(shares) != len(ts) {
		t.Fatalf("%d shares for %d targets", len(shares), len(ts))
	}
	for i, tg := range ts {
		switch tg.Measure {
		case "median mean wait, 1 GPU":
			if !tg.Met || shares[i] < 0.2 || shares[i] > 0.9 {
				t.Errorf("1 GPU: met %v in %.2f of the resamples, want met and between 0.2 and 0.9", tg.Met, shares[i])
			}
		default:
			// Every run meets the others (the 8-GPU wait, paired with
			// stock's, at a third in every run).
			if !tg.Met || shares[i] != 1 {
				t.Errorf("%s, %s: met %v in %.2f of the resamples, want 1", tg.Measure, tg.Want, tg.Met, shares[i])
			}
		}
	}
	if again := metInResamples(rows, 400); !slices.Equal(again, shares) {
		t.Errorf("the same rows gave %v, then %v", shares, again)
	}
	if got := metInResamples(nil, 400); got != nil {
		t.Errorf("no rows: %v, want nil", got)
	}
}

// TestResamplesDrawWorkloads: rounds of one seed repeat one workload, so
// resampling draws seeds with all their rounds. Seeds 1 and 2 favour
// topodra's 8-GPU wait, seed 3 stock's, ten rounds each: the verdict
// holds in fewer resamples than if the 30 runs were independent (which
// gives about 0.96).
func TestResamplesDrawWorkloads(t *testing.T) {
	var rows []SweepRow
	for seed := int64(1); seed <= 3; seed++ {
		topodra, stock := 1.0, 10.0
		if seed == 3 {
			topodra, stock = 10, 1
		}
		for round := range 10 {
			for sched, wait8 := range map[string]float64{SchedulerTopodra: topodra, SchedulerStock: stock} {
				rows = append(rows, SweepRow{Scenario: "a", Seed: seed, Round: round, Scheduler: sched,
					MeanWait: map[int]float64{1: 0, 2: 0, 4: 0, 8: wait8}, Aligned: 0.97, Throughput: 50})
			}
		}
	}
	shares := metInResamples(rows, 1000)
	for i, tg := range targets(summarize(SchedulerTopodra, rows), summarize(SchedulerStock, rows), nil) {
		if tg.Measure == "median mean wait, 8 GPU" && tg.Want == "<= stock" {
			if shares[i] > 0.85 || shares[i] < 0.6 {
				t.Errorf("8-GPU wait met in %.2f of the resamples, want about 0.74 (three workloads, one against)", shares[i])
			}
			return
		}
	}
	t.Fatal("no 8-GPU wait target")
}

// TestRunTargets checks the demo's targets of one run: the run's own
// values stand for the medians, and the table says which are met.
func TestRunTargets(t *testing.T) {
	topodra := Result{Scheduler: SchedulerTopodra, AlignedFraction: 0.94, Throughput: 60, Fit8: 1,
		Alignment:  Alignment{Clique: Ratio{Aligned: 40, Possible: 40}, Root: Ratio{Aligned: 14, Possible: 20}, NUMA: Ratio{Aligned: 40, Possible: 40}},
		WaitByGPUs: map[int]*Wait{1: {Pods: 80}, 2: {Pods: 36, Ticks: 3}, 4: {Pods: 30, Ticks: 15}, 8: {Pods: 12, Ticks: 60}}}
	stock := Result{Scheduler: SchedulerStock, AlignedFraction: 0.6, Throughput: 58, Pending: 5,
		Alignment:  Alignment{Clique: Ratio{Aligned: 30, Possible: 40}, Root: Ratio{Aligned: 5, Possible: 20}, NUMA: Ratio{Aligned: 25, Possible: 40}},
		WaitByGPUs: map[int]*Wait{1: {Pods: 80}, 2: {Pods: 36, Ticks: 1}, 4: {Pods: 30, Ticks: 30}, 8: {Pods: 12, Ticks: 360}}}
	report := &Report{Seed: 1, Results: []Result{topodra, stock}}
	var missed []string
	for _, tg := range report.RunTargets() {
		if !tg.Met {
			missed = append(missed, tg.Measure)
		}
	}
	if want := []string{"median mean wait, 2 GPU", "median alignment"}; !slices.Equal(missed, want) {
		t.Errorf("missed %q, want %q (2-GPU wait 0.083 against 0.028, alignment 94 %%)", missed, want)
	}
	var out strings.Builder
	if err := report.WriteTable(&out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"placement targets in this run alone", "mean wait, 2 GPU", "7 of 9 met in this run",
		// What the 2-GPU miss rests on: three pod-ticks against one.
		"3 vs 1 pod-ticks over 36 vs 36 pods of the size", "94 of 100 vs 60 of 100 aligned where possible"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the table lacks %q:\n%s", want, out.String())
		}
	}
	var page strings.Builder
	if err := report.WriteHTML(&page); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Placement targets in this run alone", "<th>mean wait, 2 GPU</th>", "7 of 9 met in this run", "3 vs 1 pod-ticks over 36 vs 36 pods of the size"} {
		if !strings.Contains(page.String(), want) {
			t.Errorf("the HTML report lacks %q", want)
		}
	}
	if got := (&Report{Results: []Result{topodra}}).RunTargets(); got != nil {
		t.Errorf("a run of topodra alone has targets %+v, want none", got)
	}
}

// TestTargetsNotApplicable: a size that one scheduler's runs or the
// other's had no pod of gives its wait targets nothing to judge: they say
// n/a, are not met and are not counted, in the demo's table, its HTML
// report and a sweep's summary.
func TestTargetsNotApplicable(t *testing.T) {
	// One 1-GPU pod, as manifests/examples/gpu-nic-pair.yaml; stock's
	// run alone has a 2-GPU pod, so the 2-GPU target does not apply either.
	topodra := Result{Scheduler: SchedulerTopodra, AlignedFraction: 1, Throughput: 10,
		WaitByGPUs: map[int]*Wait{1: {Pods: 1}}}
	stock := Result{Scheduler: SchedulerStock, AlignedFraction: 1, Throughput: 10,
		WaitByGPUs: map[int]*Wait{1: {Pods: 1}, 2: {Pods: 1, Ticks: 1}}}
	report := &Report{Seed: 1, Results: []Result{topodra, stock}}
	var na []string
	for _, tg := range report.RunTargets() {
		if tg.NotApplicable {
			na = append(na, tg.Measure+" "+tg.Want)
			if tg.Met || tg.Topodra != "n/a" || tg.Stock != "n/a" || tg.Paired != nil {
				t.Errorf("%s %s: %+v, want not met, n/a and no pairs", tg.Measure, tg.Want, tg)
			}
		} else if !tg.Met {
			t.Errorf("%s %s not met: %+v", tg.Measure, tg.Want, tg)
		}
	}
	// Nothing could be aligned either: a run's alignment is then 100 % by
	// convention, which says nothing.
	want := []string{"median mean wait, 2 GPU <= stock", "median mean wait, 4 GPU <= stock", "median mean wait, 8 GPU <= stock", "median mean wait, 8 GPU <= 0.5 x stock", "median alignment >= 95%"}
	if !slices.Equal(na, want) {
		t.Errorf("targets that do not apply: %q, want %q", na, want)
	}
	var out strings.Builder
	if err := report.WriteTable(&out); err != nil {
		t.Fatal(err)
	}
	if want := "4 of 4 met in this run (n/a: no pods of that size; alignment: no claim that could be aligned, not counted)"; !strings.Contains(out.String(), want) {
		t.Errorf("the table lacks %q:\n%s", want, out.String())
	}
	if want := regexp.MustCompile(`mean wait, 8 GPU +<= 0.5 x stock +n/a +n/a +n/a`); !want.MatchString(out.String()) {
		t.Errorf("the table lacks the 8-GPU ratio as n/a:\n%s", out.String())
	}
	var page strings.Builder
	if err := report.WriteHTML(&page); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"<th>mean wait, 4 GPU</th><td>&lt;= stock</td><td>n/a</td><td>n/a</td><td>n/a</td>", "4 of 4 met in this run (n/a"} {
		if !strings.Contains(page.String(), want) {
			t.Errorf("the HTML report lacks %q", want)
		}
	}

	rep := &SweepReport{Scenarios: []Scenario{{Name: "a"}}, Seeds: []int64{1, 2}}
	for seed := range int64(2) {
		for _, res := range []Result{topodra, stock} {
			rep.Rows = append(rep.Rows, rowOf("a", seed+1, 1, &res))
		}
	}
	rep.summarize([]string{SchedulerTopodra, SchedulerStock})
	for _, tg := range rep.Targets {
		if tg.NotApplicable && tg.MetInResamples != 0 {
			t.Errorf("%s %s: met in %.2f of the resamples, want 0 for a target that does not apply", tg.Measure, tg.Want, tg.MetInResamples)
		}
	}
	var summary strings.Builder
	if err := rep.WriteSummary(&summary); err != nil {
		t.Fatal(err)
	}
	if want := "4 of 4 targets met over 2 runs per scheduler (medians decide; n/a: no pods of that size; alignment: no claim that could be aligned, not counted; "; !strings.Contains(summary.String(), want) {
		t.Errorf("the sweep's summary lacks %q:\n%s", want, summary.String())
	}
	if want := regexp.MustCompile(`median mean wait, 8 GPU +<= 0.5 x stock +n/a +n/a +n/a +n/a +\n`); !want.MatchString(summary.String()) {
		t.Errorf("the sweep's summary lacks the 8-GPU ratio as n/a:\n%s", summary.String())
	}
}

// TestNotesShown: what a run noticed beyond the numbers (stuck pods, notes,
// inconsistencies) is in the table and in the HTML report, not only in the
// JSON.
func TestNotesShown(t *testing.T) {
	topodra := Result{Scheduler: SchedulerTopodra, Stuck: 2, Notes: []string{"tick 9: pod a fits by free device count but was not scheduled within 10s"},
		Errors: []string{"claim c of pod b: device d is already allocated to pod e"}}
	report := &Report{Seed: 1, Results: []Result{topodra, {Scheduler: SchedulerStock}}}
	var out strings.Builder
	if err := report.WriteTable(&out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"pods stuck (fit by count, not bound within 10 s)", "[topodra] note: tick 9: pod a fits"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the table lacks %q:\n%s", want, out.String())
		}
	}
	var page strings.Builder
	if err := report.WriteHTML(&page); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"pods stuck", "<h2>Notes</h2>", "topodra: tick 9: pod a fits", "topodra: inconsistency: claim c of pod b"} {
		if !strings.Contains(page.String(), want) {
			t.Errorf("the HTML report lacks %q", want)
		}
	}
}

// TestRunOrder: within a sweep the schedulers take turns at running
// first, by seed and round, and a single scheduler stays alone.
func TestRunOrder(t *testing.T) {
	both := []string{SchedulerTopodra, SchedulerStock}
	for _, tc := range []struct {
		seed  int64
		round int
		want  []string
	}{
		{1, 1, both},
		{2, 1, []string{SchedulerStock, SchedulerTopodra}},
		{1, 2, []string{SchedulerStock, SchedulerTopodra}},
		{2, 2, both},
	} {
		if got := runOrder(both, tc.seed, tc.round); !slices.Equal(got, tc.want) {
			t.Errorf("seed %d round %d: %v, want %v", tc.seed, tc.round, got, tc.want)
		}
	}
	if got := runOrder(both, 2, 1); !slices.Equal(both, []string{SchedulerTopodra, SchedulerStock}) || len(got) != 2 {
		t.Errorf("the given order was changed: %v", both)
	}
	if got := runOrder([]string{SchedulerTopodra}, 2, 1); !slices.Equal(got, []string{SchedulerTopodra}) {
		t.Errorf("one scheduler: %v", got)
	}
}

func templatesByName(ts []*resourceapi.ResourceClaimTemplate) map[string]*resourceapi.ResourceClaimTemplate {
	out := map[string]*resourceapi.ResourceClaimTemplate{}
	for _, t := range ts {
		out[t.Name] = t
	}
	return out
}

// TestSweepAlignedMissable: a sweep's per-run rows and medians carry the
// share aligned where a placement could miss, over the runs that counted
// the trivial allocations, beside the existing measure; the alignment
// target keeps the existing measure.
func TestSweepAlignedMissable(t *testing.T) {
	// 96 of 100 aligned, of which 40 in the one clique of a DGX: 56 of 60
	// (93.3%) where a placement could miss.
	counted := Alignment{Clique: Ratio{Aligned: 40, Possible: 40}, Root: Ratio{Aligned: 16, Possible: 20}, NUMA: Ratio{Aligned: 40, Possible: 40},
		Trivial: &TrivialCounts{Clique: 40}}
	// The same counts in a report written before trivial ones were counted.
	uncounted := counted
	uncounted.Trivial = nil
	stock := Alignment{Clique: Ratio{Aligned: 30, Possible: 40}, Root: Ratio{Aligned: 5, Possible: 20}, NUMA: Ratio{Aligned: 25, Possible: 40},
		Trivial: &TrivialCounts{Clique: 30}}
	row := func(seed int64, sched string, a Alignment) SweepRow {
		return SweepRow{Scenario: "a", Seed: seed, Round: 1, Scheduler: sched, MeanWait: map[int]float64{8: 1}, Aligned: a.Fraction(), Alignment: a, Throughput: 50}
	}
	rep := &SweepReport{Scenarios: []Scenario{{Name: "a"}}, Seeds: []int64{1, 2}, Rows: []SweepRow{
		row(1, SchedulerTopodra, counted), row(1, SchedulerStock, stock),
		row(2, SchedulerTopodra, uncounted), row(2, SchedulerStock, stock),
	}}
	rep.summarize([]string{SchedulerTopodra, SchedulerStock})
	topodra, _ := topodraAndStock(rep.Summaries, func(s *SweepSummary) string { return s.Scheduler })
	if m := topodra.AlignedMissable; m.N != 1 || math.Abs(m.Median-56.0/60) > 1e-9 {
		t.Errorf("topodra's share that could miss %+v, want 93.3%% over 1 run", m)
	}
	for _, tg := range rep.Targets {
		if tg.Measure == "median alignment" && (!tg.Met || tg.Topodra != "96.0%") {
			t.Errorf("alignment target %+v, want met at 96.0%% (the existing measure)", tg)
		}
	}
	var summary strings.Builder
	if err := rep.WriteSummary(&summary); err != nil {
		t.Fatal(err)
	}
	// Topodra's median over the one run that counted; stock's 30 of 70.
	for _, want := range []string{`aligned\s+aligned, could miss`, `all\s+topodra .* 96\.0%\s+93\.3%`, `all\s+stock .* 60\.0%\s+42\.9%`} {
		if !regexp.MustCompile(want).MatchString(summary.String()) {
			t.Errorf("the summary lacks %q:\n%s", want, summary.String())
		}
	}
	var rows strings.Builder
	w := tabwriter.NewWriter(&rows, 0, 0, 1, ' ', 0)
	fmt.Fprintln(w, sweepHeader)
	for _, r := range rep.Rows {
		writeRow(w, r)
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(rows.String(), "\n")
	for i, want := range map[int]string{0: `aligned\s+aligned, could miss`, 1: `96\.0%\s+93\.3%`, 3: `96\.0%\s+-\s`} {
		if !regexp.MustCompile(want).MatchString(lines[i]) {
			t.Errorf("line %d of the rows lacks %q:\n%s", i, want, rows.String())
		}
	}
}
