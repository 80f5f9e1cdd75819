package perf

import (
	"bufio"
	"fmt"
	"math"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"k8s.io/component-base/metrics/legacyregistry"
)

// attemptMetric is the scheduler's per-attempt latency histogram (labels
// result and profile). Both schedulers of a run live in this process and
// register it once in the legacy registry; the profile label tells them
// apart and a run reads the difference between two snapshots.
const attemptMetric = "scheduler_scheduling_attempt_duration_seconds"

// algorithmMetric is the latency of the scheduling algorithm alone
// (PreFilter, Filter, Score: no API calls). It has no profile label; only
// one scheduler runs at a time, so a run's difference is its own.
const algorithmMetric = "scheduler_scheduling_algorithm_duration_seconds"

// histogram is a cumulative bucket histogram.
type histogram struct {
	bounds []float64 // upper bounds, ascending, last is +Inf
	counts []float64 // cumulative counts
}

// gatherHistogram returns a histogram of the legacy registry, summed over
// its series (for the attempt histogram: over results scheduled,
// unschedulable, error), only those of one profile unless profile is "".
func gatherHistogram(name, profile string) (histogram, error) {
	families, err := legacyregistry.DefaultGatherer.Gather()
	if err != nil {
		return histogram{}, fmt.Errorf("gather metrics: %w", err)
	}
	var h histogram
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if (profile != "" && label(m, "profile") != profile) || m.GetHistogram() == nil {
				continue
			}
			buckets := m.GetHistogram().GetBucket()
			if h.bounds == nil {
				for _, b := range buckets {
					h.bounds = append(h.bounds, b.GetUpperBound())
				}
				h.bounds = append(h.bounds, math.Inf(1))
				h.counts = make([]float64, len(h.bounds))
			}
			for i, b := range buckets {
				h.counts[i] += float64(b.GetCumulativeCount())
			}
			h.counts[len(h.counts)-1] += float64(m.GetHistogram().GetSampleCount())
		}
	}
	return h, nil
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// sub returns h - before (before may be empty).
func (h histogram) sub(before histogram) histogram {
	out := histogram{bounds: h.bounds, counts: slices.Clone(h.counts)}
	if len(before.counts) == len(h.counts) {
		for i := range out.counts {
			out.counts[i] -= before.counts[i]
		}
	}
	return out
}

func (h histogram) total() float64 {
	if len(h.counts) == 0 {
		return 0
	}
	return h.counts[len(h.counts)-1]
}

// quantile interpolates linearly within the bucket that holds quantile q,
// like Prometheus' histogram_quantile. Samples above the last finite bound
// report that bound. Buckets are 1 ms, 2 ms, 4 ms, ... so results are
// estimates within a factor of two's bucket.
func (h histogram) quantile(q float64) float64 {
	total := h.total()
	if total == 0 {
		return math.NaN()
	}
	rank := q * total
	lower, prev := 0.0, 0.0
	for i, c := range h.counts {
		if c >= rank {
			upper := h.bounds[i]
			if math.IsInf(upper, 1) {
				return lower
			}
			if c == prev {
				return upper
			}
			return lower + (upper-lower)*(rank-prev)/(c-prev)
		}
		lower, prev = h.bounds[i], c
	}
	return lower
}

// liveHeapMB is the heap in use after a full GC, in MiB.
func liveHeapMB() float64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return float64(ms.HeapAlloc) / (1 << 20)
}

// processRSSMB returns the process' resident set size and its peak, in
// MiB (0 where /proc is not available).
func processRSSMB() (rss, peak float64) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, 0
	}
	defer func() { _ = f.Close() }()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 {
			continue
		}
		kb, err := strconv.ParseFloat(fields[1], 64)
		if err != nil {
			continue
		}
		switch fields[0] {
		case "VmRSS:":
			rss = kb / 1024
		case "VmHWM:":
			peak = kb / 1024
		}
	}
	return rss, peak
}

// windowRates returns pods/s in each whole window of length window between
// start and end, from the bind times.
func windowRates(binds []time.Time, start, end time.Time, window time.Duration) []float64 {
	n := int(end.Sub(start) / window)
	if n <= 0 {
		return nil
	}
	counts := make([]float64, n)
	for _, b := range binds {
		i := int(b.Sub(start) / window)
		if i >= 0 && i < n {
			counts[i]++
		}
	}
	for i := range counts {
		counts[i] /= window.Seconds()
	}
	return counts
}

// percentile of a sample (nearest rank); NaN for an empty one.
func percentile(values []float64, p float64) float64 {
	if len(values) == 0 {
		return math.NaN()
	}
	s := slices.Clone(values)
	slices.Sort(s)
	i := int(math.Ceil(p/100*float64(len(s)))) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// ProcessRSSMB returns the process' resident set size and its peak, in
// MiB (0 where /proc is not available).
func ProcessRSSMB() (rss, peak float64) { return processRSSMB() }
