package perf

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
)

// WriteJSON writes the results as a JSON array.
func WriteJSON(out io.Writer, results []Result) error {
	if results == nil {
		results = []Result{}
	}
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	return enc.Encode(results)
}

// WriteTable writes a markdown table with one row per workload: topodra
// and stock side by side and the ratio topodra/stock of throughput (higher
// is better) and of scheduler heap (lower is better).
func WriteTable(out io.Writer, results []Result) error {
	type pair struct{ topodra, stock *Result }
	var order []string
	rows := map[string]*pair{}
	for i := range results {
		r := &results[i]
		p := rows[r.Workload]
		if p == nil {
			p = &pair{}
			rows[r.Workload] = p
			order = append(order, r.Workload)
		}
		switch r.Scheduler {
		case Topodra:
			p.topodra = r
		case Stock:
			p.stock = r
		}
	}
	var b strings.Builder
	b.WriteString("| workload | mode | topodra pods/s | stock pods/s | ratio | attempt p50/p99 ms topodra | stock | algorithm p50/p99 ms topodra | stock | scheduler CPU ms/pod topodra | stock | ratio | aligned % topodra | stock | unscheduled topodra/stock | heap MiB topodra | stock | ratio |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, name := range order {
		p := rows[name]
		mode := ""
		for _, r := range []*Result{p.topodra, p.stock} {
			if r != nil {
				mode = r.Mode
			}
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
			name, mode,
			f(p.topodra, func(r *Result) string { return fmt.Sprintf("%.1f", r.PodsPerSecond) }),
			f(p.stock, func(r *Result) string { return fmt.Sprintf("%.1f", r.PodsPerSecond) }),
			ratio(p.topodra, p.stock, func(r *Result) float64 { return r.PodsPerSecond }),
			f(p.topodra, latency), f(p.stock, latency),
			f(p.topodra, algorithm), f(p.stock, algorithm),
			f(p.topodra, cpuPerPod), f(p.stock, cpuPerPod),
			ratio(p.topodra, p.stock, func(r *Result) float64 { return r.SchedulerCPUMsPerPod }),
			f(p.topodra, aligned), f(p.stock, aligned),
			fmt.Sprintf("%s/%s", f(p.topodra, unscheduled), f(p.stock, unscheduled)),
			f(p.topodra, heap), f(p.stock, heap),
			ratio(p.topodra, p.stock, func(r *Result) float64 { return r.SchedulerHeapMB }),
		)
	}
	_, err := io.WriteString(out, b.String())
	return err
}

func f(r *Result, format func(*Result) string) string {
	if r == nil {
		return "–"
	}
	return format(r)
}

func latency(r *Result) string { return fmt.Sprintf("%.1f/%.1f", r.P50Ms, r.P99Ms) }
func algorithm(r *Result) string {
	return fmt.Sprintf("%.2f/%.2f", r.AlgorithmP50Ms, r.AlgorithmP99Ms)
}
func cpuPerPod(r *Result) string {
	if r.SchedulerCPUSeconds < 0 {
		return "?"
	}
	return fmt.Sprintf("%.2f", r.SchedulerCPUMsPerPod)
}
func unscheduled(r *Result) string { return fmt.Sprint(r.Unscheduled) }
func heap(r *Result) string        { return fmt.Sprintf("%.0f", r.SchedulerHeapMB) }

func aligned(r *Result) string {
	if r.AlignedPercent == nil {
		return "n/a"
	}
	return fmt.Sprintf("%.1f (%d)", *r.AlignedPercent, r.AlignedOf)
}

func ratio(a, b *Result, v func(*Result) float64) string {
	if a == nil || b == nil || v(b) <= 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f", v(a)/v(b))
}
