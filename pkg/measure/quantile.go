// Package measure holds the measurements that the simulator and the
// benchmark harness share: quantiles of samples and of Prometheus
// histograms, read from a metrics registry.
//
// One convention throughout: a quantile q is a fraction in [0, 1] (the
// median is 0.5, p99 is 0.99), and a measurement without samples is NaN,
// never 0, so that "nothing measured" cannot pass for "instant". Callers
// that write JSON, which has no NaN, turn it into 0 with ZeroIfNaN where
// they write it.
package measure

import (
	"math"
	"slices"
)

// Quantile returns the q-quantile of a sample by the nearest-rank method:
// the smallest value v of the sample such that at least a fraction q of the
// values are ≤ v. For n sorted values that is values[ceil(q·n)-1]; q ≤ 0
// gives the minimum, q ≥ 1 the maximum. It never interpolates, so the
// result is always a value of the sample. values need not be sorted and are
// not changed. An empty sample gives NaN.
func Quantile(values []float64, q float64) float64 {
	if len(values) == 0 {
		return math.NaN()
	}
	sorted := slices.Clone(values)
	slices.Sort(sorted)
	// The epsilon keeps q·n that should be an integer but is a hair above
	// it in floating point (0.07·100 = 7.000000000000001) on that rank.
	rank := int(math.Ceil(q*float64(len(sorted))-1e-9)) - 1
	return sorted[min(max(rank, 0), len(sorted)-1)]
}

// ZeroIfNaN returns v, or 0 where v is NaN (a measurement without
// samples), for output formats without NaN.
func ZeroIfNaN(v float64) float64 {
	if math.IsNaN(v) {
		return 0
	}
	return v
}
