package sim

import (
	"slices"
	"strings"
	"testing"
)

// TestWaitText: the table's mean waits by size have two decimals, as the
// targets' medians beside them have at least, so that waits the targets
// tell apart do not read the same.
func TestWaitText(t *testing.T) {
	tests := map[string]struct {
		waits map[int]*Wait
		want  string
	}{
		"none":           {want: ""},
		"sizes in order": {waits: map[int]*Wait{8: {Pods: 5, Ticks: 59}, 1: {Pods: 82, Ticks: 1}, 2: {Pods: 36}}, want: "1:0.01 2:0.00 8:11.80"},
		// 0.083 against 0.056: one decimal printed both as 0.1.
		"apart by a pod-tick": {waits: map[int]*Wait{2: {Pods: 12, Ticks: 1}}, want: "2:0.08"},
		"close":               {waits: map[int]*Wait{2: {Pods: 18, Ticks: 1}}, want: "2:0.06"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			if got := waitText(Result{WaitByGPUs: tc.waits}); got != tc.want {
				t.Errorf("waitText = %q, want %q", got, tc.want)
			}
		})
	}
	report := &Report{Results: []Result{{Scheduler: SchedulerTopodra, WaitByGPUs: map[int]*Wait{2: {Pods: 12, Ticks: 1}}}}}
	var page strings.Builder
	if err := report.WriteHTML(&page); err != nil {
		t.Fatal(err)
	}
	if want := "<th>mean ticks by GPUs per pod</th><td>2:0.08</td>"; !strings.Contains(page.String(), want) {
		t.Errorf("the HTML report lacks %q", want)
	}
}

// TestTimelineNote: the HTML report's note on runs that vary names what
// varies, timing, and not a random choice among equal nodes, which
// kube-scheduler does not make (it breaks ties at random only for
// extenders' scores).
func TestTimelineNote(t *testing.T) {
	report := &Report{Results: []Result{{Scheduler: SchedulerStock, Timeline: []TickPoint{{Tick: 0, Waiting: 1}, {Tick: 1}}}}}
	var page strings.Builder
	if err := report.WriteHTML(&page); err != nil {
		t.Fatal(err)
	}
	_, note, _ := strings.Cut(page.String(), "<h2>Over time</h2>")
	note, _, _ = strings.Cut(note, "</p>")
	for _, want := range []string{"Runs vary with timing", "informers lag", "order in which bindings land", "the order in which the parallel Filter calls finish", "does not shuffle equal scores"} {
		if !strings.Contains(note, want) {
			t.Errorf("the note lacks %q: %s", want, note)
		}
	}
	if strings.Contains(note, "random") {
		t.Errorf("the note says that a choice is random: %s", note)
	}
}

// TestMissableRow: right under "aligned overall" the table shows the share
// aligned without the allocations that could not miss, "-" where the run
// did not count those or every possible one was such; the run's alignment
// target still rests on the existing measure and says how many of its
// allocations could not miss.
func TestMissableRow(t *testing.T) {
	dgx := Alignment{Clique: Ratio{Aligned: 40, Possible: 40}, Root: Ratio{Aligned: 16, Possible: 20}, NUMA: Ratio{Aligned: 40, Possible: 40},
		Trivial: &TrivialCounts{Clique: 40}}
	tests := map[string]struct {
		alignment Alignment
		want      string
	}{
		"without the one clique":   {alignment: dgx, want: "93.3%"},
		"trivial ones not counted": {alignment: Alignment{Clique: Ratio{Aligned: 40, Possible: 40}}, want: "-"},
		"all trivial":              {alignment: Alignment{Clique: Ratio{Aligned: 5, Possible: 5}, Trivial: &TrivialCounts{Clique: 5}}, want: "-"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			rows := resultRows([]Result{{Alignment: tc.alignment}})
			i := slices.IndexFunc(rows, func(r resultRow) bool { return r.label == "aligned overall" })
			if i < 0 || i+1 >= len(rows) || rows[i+1].label != "aligned, where a placement there could miss" {
				t.Fatalf("no row of the share that could miss under aligned overall")
			}
			if got := rows[i+1].cell(Result{Alignment: tc.alignment}); got != tc.want {
				t.Errorf("%q, want %q", got, tc.want)
			}
		})
	}
	stock := Alignment{Clique: Ratio{Aligned: 30, Possible: 40}, Root: Ratio{Aligned: 5, Possible: 20}, NUMA: Ratio{Aligned: 25, Possible: 40},
		Trivial: &TrivialCounts{Clique: 30}}
	report := &Report{Results: []Result{{Scheduler: SchedulerTopodra, Alignment: dgx, AlignedFraction: dgx.Fraction()}, {Scheduler: SchedulerStock, Alignment: stock, AlignedFraction: stock.Fraction()}}}
	for _, tg := range report.RunTargets() {
		if tg.Measure != "median alignment" {
			continue
		}
		if !tg.Met || tg.Topodra != "96.0%" {
			t.Errorf("alignment target %+v, want met at 96.0%% (the existing measure, 93.3%% without the trivial ones)", tg)
		}
		if got, want := report.runTargetBasis(tg), "96 of 100 vs 60 of 100 aligned where possible, of which 40 vs 30 could not miss"; got != want {
			t.Errorf("basis %q, want %q", got, want)
		}
	}
}
