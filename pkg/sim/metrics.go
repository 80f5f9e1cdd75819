package sim

import (
	"k8s.io/component-base/metrics/legacyregistry"

	"github.com/topodra/topodra/pkg/measure"
)

// attemptMetric is the scheduler's histogram of scheduling attempts
// (scheduling algorithm + binding), labeled by result and profile.
const attemptMetric = "scheduler_scheduling_attempt_duration_seconds"

// turnedDownMetric counts the attempts TopologyDRA turns down, by profile
// and reason.
const turnedDownMetric = "topodra_unschedulable_attempts_total"

// turnedDown is a reading of turnedDownMetric for one profile, by reason.
type turnedDown map[string]float64

// readTurnedDown reads turnedDownMetric as readAttempts reads its
// histogram; a profile without TopologyDRA reads empty.
func readTurnedDown(profile string) turnedDown {
	by, err := measure.CountersBy(legacyregistry.DefaultGatherer, turnedDownMetric, map[string]string{"profile": profile}, "reason")
	if err != nil {
		return turnedDown{}
	}
	return by
}

// since returns the attempts between an earlier reading and t, leaving
// out reasons without any.
func (t turnedDown) since(before turnedDown) map[string]uint64 {
	out := map[string]uint64{}
	for reason, v := range t {
		if d := v - before[reason]; d > 0 {
			out[reason] = uint64(d)
		}
	}
	return out
}

// attempts is a reading of attemptMetric for one profile, by result.
type attempts map[string]measure.Histogram

// readAttempts reads the histogram from the process-wide registry, where
// the in-process schedulers register their metrics. Schedulers of one
// process share it, so a run takes the difference of two readings. A
// registry that cannot be read gives an empty reading.
func readAttempts(profile string) attempts {
	by, err := measure.GatherBy(legacyregistry.DefaultGatherer, attemptMetric, map[string]string{"profile": profile}, "result")
	if err != nil {
		return attempts{}
	}
	return by
}

// since returns the attempts between an earlier reading and a.
func (a attempts) since(before attempts) attempts {
	d := attempts{}
	for result, h := range a {
		d[result] = h.Sub(before[result])
	}
	return d
}

// quantile estimates a quantile of successful attempts in seconds (see
// measure.Histogram.Quantile); 0 without any.
func (a attempts) quantile(q float64) float64 {
	return measure.ZeroIfNaN(a["scheduled"].Quantile(q))
}

// slowAttemptSeconds is the bound of the attempt histogram (buckets of
// 1 ms doubling) above which an attempt counts as slow: past 4 s. A
// kube-apiserver that is shutting down answers requests with 429 and
// Retry-After: 5, which client-go honours, so a binding cycle that meets a
// restart of the API server takes more than 5 s.
const slowAttemptSeconds = 4.096

// slow counts the successful attempts over slowAttemptSeconds.
func (a attempts) slow() int {
	return int(a["scheduled"].Above(slowAttemptSeconds))
}

// byResult counts the attempts by result.
func (a attempts) byResult() map[string]uint64 {
	out := map[string]uint64{}
	for result, h := range a {
		out[result] = uint64(h.Count())
	}
	return out
}
