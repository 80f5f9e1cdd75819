package perf

import (
	"bufio"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"
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

// ProcessRSSMB returns the process' resident set size and its peak, in
// MiB (0 where /proc is not available).
func ProcessRSSMB() (rss, peak float64) { return processRSSMB() }
