package perf

import (
	"testing"

	"k8s.io/utils/ptr"
)

func TestMergeRounds(t *testing.T) {
	a := Result{Workload: "w", Scheduler: Topodra, Pods: 100, Seconds: 10, PodsPerSecond: 10, P50Ms: 20, P99Ms: 100,
		SchedulerCPUSeconds: 1, SchedulerHeapMB: 3, AlignedPercent: ptr.To(50.0), AlignedOf: 10}
	b := Result{Workload: "w", Scheduler: Topodra, Pods: 300, Seconds: 10, PodsPerSecond: 30, P50Ms: 40, P99Ms: 200,
		SchedulerCPUSeconds: 3, SchedulerHeapMB: 5, AlignedPercent: ptr.To(100.0), AlignedOf: 30}
	m := mergeRounds([]Result{a, b})
	if m.Rounds != 2 || m.Pods != 400 || m.Seconds != 20 || m.PodsPerSecond != 20 {
		t.Errorf("rounds %d pods %d seconds %v pods/s %v, want 2, 400, 20, 20", m.Rounds, m.Pods, m.Seconds, m.PodsPerSecond)
	}
	if m.P50Ms != 30 || m.P99Ms != 150 {
		t.Errorf("latency p50/p99 %v/%v, want the means 30/150", m.P50Ms, m.P99Ms)
	}
	if m.SchedulerCPUMsPerPod != 10 || m.SchedulerHeapMB != 5 {
		t.Errorf("CPU %v ms/pod, heap %v MiB; want 10 and 5", m.SchedulerCPUMsPerPod, m.SchedulerHeapMB)
	}
	if m.AlignedPercent == nil || *m.AlignedPercent != 87.5 || m.AlignedOf != 40 {
		t.Errorf("aligned %v of %d, want 87.5 of 40", m.AlignedPercent, m.AlignedOf)
	}
	if one := mergeRounds([]Result{a}); one.Rounds != 1 || one.Pods != 100 {
		t.Errorf("one round: %+v", one)
	}
}
