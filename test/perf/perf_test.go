package perf

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"k8s.io/klog/v2"
)

// TestSmoke runs a tiny version of four workloads (a burst on upstream's
// device shape, a steady state with matchAttribute, the GPU+NIC topology
// shape, and pods that fit only by preemption) through both schedulers:
// the harness works end to end and the report is complete. It asserts no
// timing; `go run ./test/perf/cmd --nodes 2 --steady-duration 1s` runs
// every workload at this size.
func TestSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("starts control planes")
	}
	var results []Result
	var progress bytes.Buffer
	opts := Options{Progress: &progress, Logger: klog.Background()}
	for _, w := range Workloads(2, time.Second) {
		preempt := strings.HasPrefix(w.Name, "preempt-")
		if !strings.HasPrefix(w.Name, "claim-template/") && !strings.HasPrefix(w.Name, "match_") && !strings.HasPrefix(w.Name, "gpu-nic/") && !preempt {
			continue
		}
		w.Stall = 5 * time.Second
		res, err := RunWorkload(t.Context(), opts, w)
		if err != nil {
			t.Fatalf("%s: %v\nprogress:\n%s", w.Name, err, progress.String())
		}
		if len(res) != 2 || res[0].Scheduler != Topodra || res[1].Scheduler != Stock {
			t.Fatalf("%s: want one result for topodra then stock, got %+v", w.Name, res)
		}
		for _, r := range res {
			if preempt && r.Scheduler == Stock {
				// The stock plugin reports missing devices as
				// unresolvable, so DefaultPreemption evicts nobody.
				if r.Pods != 0 || r.Unscheduled != w.podCount() {
					t.Errorf("%s/%s: %d pods bound and %d unscheduled, want none bound: the stock plugin does not preempt for devices", w.Name, r.Scheduler, r.Pods, r.Unscheduled)
				}
				continue
			}
			if r.Pods == 0 || r.PodsPerSecond <= 0 || r.Seconds <= 0 {
				t.Errorf("%s/%s: no pods measured: %+v", w.Name, r.Scheduler, r)
			}
			if r.Attempts < r.Pods {
				t.Errorf("%s/%s: %d attempts recorded for %d pods: the attempt histogram was not read", w.Name, r.Scheduler, r.Attempts, r.Pods)
			}
			if w.Mode == Burst && r.Unscheduled != 0 {
				t.Errorf("%s/%s: %d pods unscheduled, the workload fits", w.Name, r.Scheduler, r.Unscheduled)
			}
			if w.Aligned != (r.AlignedPercent != nil) {
				t.Errorf("%s/%s: alignedPercent = %v, want it set exactly for topology shapes", w.Name, r.Scheduler, r.AlignedPercent)
			}
		}
		results = append(results, res...)
	}
	t.Logf("progress:\n%s", progress.String())

	var table bytes.Buffer
	if err := WriteTable(&table, results); err != nil {
		t.Fatal(err)
	}
	t.Logf("table:\n%s", table.String())
	if rows := strings.Count(table.String(), "\n"); rows != 2+4 {
		t.Errorf("table has %d lines, want header, separator and 4 rows", rows)
	}

	var js bytes.Buffer
	if err := WriteJSON(&js, results); err != nil {
		t.Fatal(err)
	}
	var decoded []map[string]any
	if err := json.Unmarshal(js.Bytes(), &decoded); err != nil {
		t.Fatalf("JSON output does not parse: %v", err)
	}
	for _, obj := range decoded {
		for _, key := range []string{"workload", "scheduler", "pods", "seconds", "podsPerSecond", "p50Ms", "p99Ms", "alignedPercent"} {
			if _, ok := obj[key]; !ok {
				t.Errorf("JSON object %v lacks key %q", obj["workload"], key)
			}
		}
	}
}
