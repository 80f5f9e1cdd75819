package measure

import (
	"math"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

const metric = "test_attempt_duration_seconds"

func newRegistry(t *testing.T) (*prometheus.Registry, *prometheus.HistogramVec) {
	t.Helper()
	reg := prometheus.NewRegistry()
	vec := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    metric,
		Buckets: []float64{1, 2, 4, 8},
	}, []string{"profile", "result"})
	reg.MustRegister(vec)
	return reg, vec
}

func TestGatherAndQuantile(t *testing.T) {
	reg, vec := newRegistry(t)
	for _, v := range []float64{0.5, 1.5, 1.5, 3} {
		vec.WithLabelValues("a", "scheduled").Observe(v)
	}
	vec.WithLabelValues("a", "unschedulable").Observe(100)
	vec.WithLabelValues("b", "scheduled").Observe(7)

	tests := map[string]struct {
		match     map[string]string
		wantCount float64
		q         float64
		want      float64
	}{
		// 4 samples: rank 2 lies in (1, 2], which holds samples 2 and 3.
		"median of one series": {match: map[string]string{"profile": "a", "result": "scheduled"}, wantCount: 4, q: 0.5, want: 1.5},
		"rank in first bucket": {match: map[string]string{"profile": "a", "result": "scheduled"}, wantCount: 4, q: 0.25, want: 1},
		// Beyond the largest finite bound: that bound.
		"in the +Inf bucket": {match: map[string]string{"profile": "a"}, wantCount: 5, q: 1, want: 8},
		"all series":         {match: nil, wantCount: 6, q: 0, want: 0},
		"no series is empty": {match: map[string]string{"profile": "c"}, wantCount: 0, q: 0.5, want: math.NaN()},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			h, err := Gather(reg, metric, tc.match)
			if err != nil {
				t.Fatal(err)
			}
			if got := h.Count(); got != tc.wantCount {
				t.Errorf("Count() = %v, want %v", got, tc.wantCount)
			}
			got := h.Quantile(tc.q)
			if !(got == tc.want || math.IsNaN(got) && math.IsNaN(tc.want)) {
				t.Errorf("Quantile(%v) = %v, want %v", tc.q, got, tc.want)
			}
		})
	}
}

func TestGatherByAndSub(t *testing.T) {
	reg, vec := newRegistry(t)
	vec.WithLabelValues("a", "scheduled").Observe(0.5)
	before, err := GatherBy(reg, metric, map[string]string{"profile": "a"}, "result")
	if err != nil {
		t.Fatal(err)
	}
	vec.WithLabelValues("a", "scheduled").Observe(6)
	vec.WithLabelValues("a", "scheduled").Observe(7)
	vec.WithLabelValues("a", "error").Observe(1)
	after, err := GatherBy(reg, metric, map[string]string{"profile": "a"}, "result")
	if err != nil {
		t.Fatal(err)
	}
	scheduled := after["scheduled"].Sub(before["scheduled"])
	if got := scheduled.Count(); got != 2 {
		t.Errorf("scheduled between readings: %v, want 2", got)
	}
	// Both new samples lie in (4, 8]; the one before them (0.5) is gone.
	if got := scheduled.Quantile(0.5); got != 6 {
		t.Errorf("median between readings: %v, want 6", got)
	}
	// Above a bound: both new samples are over 4; none is over 8, and
	// above 5, not a bound, counts from the bound below it.
	for b, want := range map[float64]float64{2: 2, 4: 2, 5: 2, 8: 0, 0: 2} {
		if got := scheduled.Above(b); got != want {
			t.Errorf("Above(%v) between readings: %v, want %v", b, got, want)
		}
	}
	if got := after["scheduled"].Above(1); got != 2 {
		t.Errorf("Above(1): %v, want 2 (0.5 is not above 1)", got)
	}
	// A series that did not exist before: Sub of an empty histogram.
	if got := after["error"].Sub(before["error"]).Count(); got != 1 {
		t.Errorf("errors between readings: %v, want 1", got)
	}
	if _, ok := after["unschedulable"]; ok {
		t.Error("a result that never occurred has a histogram")
	}
}

func TestEmptyHistogram(t *testing.T) {
	var h Histogram
	if h.Count() != 0 || !math.IsNaN(h.Quantile(0.5)) {
		t.Errorf("empty histogram: count %v, median %v; want 0 and NaN", h.Count(), h.Quantile(0.5))
	}
	if got := h.Sub(Histogram{}).Count(); got != 0 {
		t.Errorf("empty - empty has %v samples", got)
	}
}
