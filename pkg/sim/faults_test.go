package sim

import (
	"maps"
	"slices"
	"testing"
)

func TestPlanFaults(t *testing.T) {
	arrivals := []int{0, 0, 1, 3, 3, 4, 7, 9, 9, 12}
	distinct := []int{0, 1, 3, 4, 7, 9, 12}
	for _, n := range []int{0, 1, 4, 7, 20} {
		p := planFaults(n, 5, arrivals)
		ticks := slices.Sorted(maps.Keys(p.at))
		if want := min(n, len(distinct)); len(ticks) != want {
			t.Errorf("n=%d: faults at %v, want %d", n, ticks, want)
		}
		for i, tick := range ticks {
			if !slices.Contains(distinct, tick) {
				t.Errorf("n=%d: fault at tick %d, at which no pod arrives", n, tick)
			}
			want := []string{FaultSchedulerRestart, FaultAgentRestart, FaultGPUXID, FaultAPIServerRestart}[i%4]
			if p.at[tick] != want {
				t.Errorf("n=%d: fault %d (tick %d) is %s, want %s: scheduler, agent, GPU and API server in turn", n, i, tick, p.at[tick], want)
			}
		}
		if again := planFaults(n, 5, arrivals); !maps.Equal(again.at, p.at) {
			t.Errorf("n=%d: the same seed planned %v, then %v", n, p.at, again.at)
		}
	}
}

func TestFaultsRowOnlyWithFaults(t *testing.T) {
	has := func(rows []resultRow) bool {
		return slices.ContainsFunc(rows, func(r resultRow) bool { return r.label == "faults injected" })
	}
	if has(resultRows([]Result{{}, {}})) {
		t.Error("a faults row for runs without faults")
	}
	res := Result{Faults: []Fault{{Kind: FaultSchedulerRestart}, {Kind: FaultAgentRestart, Node: "n"}, {Kind: FaultSchedulerRestart}, {Kind: FaultAPIServerRestart}}}
	if !has(resultRows([]Result{{}, res})) {
		t.Error("no faults row for a run with faults")
	}
	if got, want := faultsText(res), "2 scheduler, 1 agent, 1 API server restarts"; got != want {
		t.Errorf("faultsText = %q, want %q", got, want)
	}
	// Slow attempts: counted under faults only, right below the latency
	// they explain.
	slowRow := func(rows []resultRow) int {
		return slices.IndexFunc(rows, func(r resultRow) bool { return r.label == "successful attempts over 4 s" })
	}
	if slowRow(resultRows([]Result{{}, {}})) >= 0 {
		t.Error("a row of slow attempts for runs without faults")
	}
	res.SlowAttempts = 6
	rows := resultRows([]Result{{}, res})
	if i := slowRow(rows); i < 1 || rows[i-1].label != "attempt latency p50 / p99" || !rows[i].sub || rows[i].cell(res) != "6" {
		t.Errorf("the row of slow attempts is at %d (after %q) or says the wrong count", i, rows[max(i-1, 0)].label)
	}
	tainted := func(rows []resultRow) bool {
		return slices.ContainsFunc(rows, func(r resultRow) bool { return r.label == "allocations of a tainted GPU" })
	}
	if tainted(resultRows([]Result{{}, res})) {
		t.Error("a row of tainted allocations for runs without GPU faults")
	}
	// A GPU fault that found no healthy GPU is no XID.
	res.Faults = append(res.Faults, Fault{Kind: FaultGPUXID, Node: "n", Device: "d", XID: 79}, Fault{Kind: FaultGPUXID, Node: "n"})
	if got, want := faultsText(res), "2 scheduler, 1 agent, 1 API server restarts; 1 GPU XID"; got != want {
		t.Errorf("faultsText = %q, want %q", got, want)
	}
	if !tainted(resultRows([]Result{{}, res})) {
		t.Error("no row of tainted allocations for a run with GPU faults")
	}
}
