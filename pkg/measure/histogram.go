package measure

import (
	"fmt"
	"math"
	"slices"

	dto "github.com/prometheus/client_model/go"
)

// Gatherer is a source of metric families: a Prometheus registry, or
// k8s.io/component-base/metrics/legacyregistry.DefaultGatherer, where
// in-process schedulers register their metrics.
type Gatherer interface {
	Gather() ([]*dto.MetricFamily, error)
}

// Histogram is a cumulative bucket histogram, as Prometheus exposes one.
// The zero value is an empty histogram. Values are not changed after they
// are returned; Sub returns a new one.
type Histogram struct {
	// Bounds are the buckets' upper bounds, ascending; the last is +Inf.
	Bounds []float64
	// Counts are the cumulative sample counts per bound: Counts[i]
	// samples were ≤ Bounds[i]. The last is the number of samples.
	Counts []float64
}

// Gather reads histogram name from g, summed over the series whose labels
// include every label of match (nil matches all series). A histogram that
// is not registered yet, or has no matching series, is empty.
func Gather(g Gatherer, name string, match map[string]string) (Histogram, error) {
	by, err := GatherBy(g, name, match, "")
	if err != nil {
		return Histogram{}, err
	}
	return by[""], nil
}

// GatherBy is Gather with the matching series grouped by the value of
// label by (series without it under ""). With by == "" all matching series
// are summed under "".
func GatherBy(g Gatherer, name string, match map[string]string, by string) (map[string]Histogram, error) {
	out := map[string]Histogram{}
	err := eachSeries(g, name, match, func(m *dto.Metric) {
		h := m.GetHistogram()
		if h == nil {
			return
		}
		key := ""
		if by != "" {
			key = labelValue(m, by)
		}
		out[key] = out[key].add(fromProto(h))
	})
	return out, err
}

// CountersBy sums the counter called name over its series whose labels
// match, by the value of label by.
func CountersBy(g Gatherer, name string, match map[string]string, by string) (map[string]float64, error) {
	out := map[string]float64{}
	err := eachSeries(g, name, match, func(m *dto.Metric) {
		if c := m.GetCounter(); c != nil {
			out[labelValue(m, by)] += c.GetValue()
		}
	})
	return out, err
}

// eachSeries calls fn with each series of the metric called name whose
// labels match.
func eachSeries(g Gatherer, name string, match map[string]string, fn func(*dto.Metric)) error {
	families, err := g.Gather()
	if err != nil {
		return fmt.Errorf("gather metrics: %w", err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if matches(m, match) {
				fn(m)
			}
		}
	}
	return nil
}

func matches(m *dto.Metric, match map[string]string) bool {
	for k, v := range match {
		if labelValue(m, k) != v {
			return false
		}
	}
	return true
}

func labelValue(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// fromProto converts a Prometheus histogram, adding the +Inf bucket that
// the exposition format leaves implicit.
func fromProto(p *dto.Histogram) Histogram {
	var h Histogram
	for _, b := range p.GetBucket() {
		if math.IsInf(b.GetUpperBound(), 1) {
			continue
		}
		h.Bounds = append(h.Bounds, b.GetUpperBound())
		h.Counts = append(h.Counts, float64(b.GetCumulativeCount()))
	}
	h.Bounds = append(h.Bounds, math.Inf(1))
	h.Counts = append(h.Counts, float64(p.GetSampleCount()))
	return h
}

// add returns h + o, over the union of their bounds.
func (h Histogram) add(o Histogram) Histogram {
	return h.combine(o, 1)
}

// Sub returns h - before: the samples recorded between two readings of one
// histogram. An empty before gives h.
func (h Histogram) Sub(before Histogram) Histogram {
	return h.combine(before, -1)
}

// combine returns h + sign·o over the union of their bounds. A cumulative
// count at a bound one histogram lacks is that histogram's count at its
// next lower bound.
func (h Histogram) combine(o Histogram, sign float64) Histogram {
	bounds := slices.Concat(h.Bounds, o.Bounds)
	slices.Sort(bounds)
	bounds = slices.Compact(bounds)
	out := Histogram{Bounds: bounds, Counts: make([]float64, len(bounds))}
	for i, b := range bounds {
		out.Counts[i] = h.countAt(b) + sign*o.countAt(b)
	}
	return out
}

// countAt is the cumulative count at bound b: of the largest bound ≤ b.
func (h Histogram) countAt(b float64) float64 {
	c := 0.0
	for i, bound := range h.Bounds {
		if bound > b {
			break
		}
		c = h.Counts[i]
	}
	return c
}

// Count is the number of samples.
func (h Histogram) Count() float64 {
	if len(h.Counts) == 0 {
		return 0
	}
	return h.Counts[len(h.Counts)-1]
}

// Above is the number of samples above b, where b is one of the bounds
// (otherwise: above the largest bound below b).
func (h Histogram) Above(b float64) float64 {
	return h.Count() - h.countAt(b)
}

// Quantile estimates the q-quantile like PromQL's histogram_quantile: it
// finds the bucket that holds rank q·Count and interpolates linearly
// within it (the first bucket starts at 0). A quantile in the +Inf bucket
// is reported as the largest finite bound. An empty histogram gives NaN.
func (h Histogram) Quantile(q float64) float64 {
	total := h.Count()
	if total == 0 {
		return math.NaN()
	}
	rank := min(max(q, 0), 1) * total
	lower, prev := 0.0, 0.0
	for i, c := range h.Counts {
		if c >= rank {
			upper := h.Bounds[i]
			if math.IsInf(upper, 1) {
				return lower
			}
			if c == prev {
				return upper
			}
			return lower + (upper-lower)*(rank-prev)/(c-prev)
		}
		lower, prev = h.Bounds[i], c
	}
	return lower
}
