package sim

import (
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
