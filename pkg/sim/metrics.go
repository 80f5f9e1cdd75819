package sim

import (
	"slices"

	dto "github.com/prometheus/client_model/go"
	"k8s.io/component-base/metrics/legacyregistry"
)

// attemptMetric is the scheduler's histogram of scheduling attempts
// (scheduling algorithm + binding), labeled by result and profile.
const attemptMetric = "scheduler_scheduling_attempt_duration_seconds"

// attempts is a reading of attemptMetric for one profile: cumulative
// bucket counts of successful attempts, and attempt counts by result.
type attempts struct {
	bounds   []float64
	buckets  []uint64 // cumulative, per bound
	count    uint64   // successful attempts
	byResult map[string]uint64
}

// readAttempts reads the histogram from the process-wide registry, where
// the in-process schedulers register their metrics. Schedulers of one
// process share it, so a run takes the difference of two readings.
func readAttempts(profile string) attempts {
	a := attempts{byResult: map[string]uint64{}}
	families, err := legacyregistry.DefaultGatherer.Gather()
	if err != nil {
		return a
	}
	for _, f := range families {
		if f.GetName() != attemptMetric {
			continue
		}
		for _, m := range f.GetMetric() {
			var result, prof string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "result":
					result = l.GetValue()
				case "profile":
					prof = l.GetValue()
				}
			}
			if prof != profile {
				continue
			}
			h := m.GetHistogram()
			a.byResult[result] += h.GetSampleCount()
			if result != "scheduled" {
				continue
			}
			a.count += h.GetSampleCount()
			a.addBuckets(h)
		}
	}
	return a
}

func (a *attempts) addBuckets(h *dto.Histogram) {
	for _, b := range h.GetBucket() {
		i := slices.Index(a.bounds, b.GetUpperBound())
		if i < 0 {
			a.bounds = append(a.bounds, b.GetUpperBound())
			a.buckets = append(a.buckets, 0)
			i = len(a.bounds) - 1
		}
		a.buckets[i] += b.GetCumulativeCount()
	}
}

// since returns the attempts between an earlier reading and a.
func (a attempts) since(before attempts) attempts {
	d := attempts{bounds: a.bounds, count: a.count - before.count, byResult: map[string]uint64{}}
	for i, bound := range a.bounds {
		c := a.buckets[i]
		if j := slices.Index(before.bounds, bound); j >= 0 {
			c -= before.buckets[j]
		}
		d.buckets = append(d.buckets, c)
	}
	for r, n := range a.byResult {
		d.byResult[r] = n - before.byResult[r]
	}
	return d
}

// quantile estimates a quantile of successful attempts in seconds, like
// PromQL's histogram_quantile: linear within the bucket that holds it.
func (a attempts) quantile(q float64) float64 {
	if len(a.bounds) == 0 {
		return 0
	}
	total := a.count
	if total == 0 {
		return 0
	}
	rank := q * float64(total)
	lower, prev := 0.0, uint64(0)
	for i, bound := range a.bounds {
		c := a.buckets[i]
		if float64(c) >= rank {
			if c == prev {
				return bound
			}
			return lower + (bound-lower)*(rank-float64(prev))/float64(c-prev)
		}
		lower, prev = bound, c
	}
	// Beyond the largest finite bucket: report that bound.
	return a.bounds[len(a.bounds)-1]
}
