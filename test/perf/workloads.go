// Package perf is topodra's throughput and placement-quality benchmark. It
// runs each workload through topodra-scheduler and through the stock
// kube-scheduler (DynamicResources plugin), one after the other on the same
// in-process control plane with identical inputs, and reports pods/s,
// per-attempt latency, placement alignment and scheduler heap for both.
//
// The workloads mirror upstream's scheduler_perf DRA benchmarks
// (k8s.io/kubernetes test/integration/scheduler_perf/dra/performance-config.yaml)
// and keep their names, plus two topology shapes on DGX-like nodes. See
// README.md for what is measured and how.
package perf

import (
	"fmt"
	"time"
)

// Shape is the kind of node a workload runs on.
type Shape string

const (
	// ShapeBasic is upstream's resourceslice-basic-devices.yaml: 10
	// devices of driver test-driver.cdi.k8s.io per node, PCIe roots
	// alternating between two values (device i on root i%2).
	ShapeBasic Shape = "basic10"
	// ShapeDGX is framework.DGXLikeGPUs: 8 GPUs, PCIe roots in pairs,
	// NUMA nodes 4+4, one NVLink clique.
	ShapeDGX Shape = "dgx8"
	// ShapeDGXNIC is ShapeDGX plus 4 NICs (driver nic.topodra.io), one on
	// each PCIe root.
	ShapeDGXNIC Shape = "dgx8+nic4"
)

// Mode is how pods are created.
type Mode string

const (
	// Burst creates all measured pods at once and measures until all are
	// bound (or no pod got bound for Workload.Stall).
	Burst Mode = "burst"
	// Steady keeps Workload.Pods pods pending: every pod that gets bound is
	// deleted and replaced by a new one, for Workload.Duration.
	Steady Mode = "steady"
)

// Request is one request of a claim template.
type Request struct {
	Name  string
	Class string
	Count int64
	// Selector is a CEL expression added to the request, or "".
	Selector string
}

// Template is a ResourceClaimTemplate of the measured pods.
type Template struct {
	Name     string
	Requests []Request
	// MatchAttribute, if set, is a matchAttribute constraint over all
	// requests.
	MatchAttribute string
}

// Mix says how many measured pods use a template (burst mode). Pods of the
// mix are created in a deterministic shuffled order.
type Mix struct {
	Template string
	Pods     int
}

// Workload is one benchmark case.
type Workload struct {
	Name  string
	Shape Shape
	Nodes int
	// InitClaims single-device claims are allocated before the measured
	// pods are created: on a pseudo-random node each, first free device
	// (upstream's allocResourceClaims) or, with RandomDevice, a random
	// free device (fragmentation as left behind by earlier jobs).
	InitClaims   int
	RandomDevice bool
	Mode         Mode
	// Pods is the number of measured pods (Burst) or of pods kept pending
	// (Steady).
	Pods      int
	Templates []Template
	// Mix is the burst mix; empty means all pods use Templates[0].
	Mix []Mix
	// Duration of a Steady run.
	Duration time.Duration
	// Stall ends a Burst run when no pod got bound for this long (pods
	// that fit nowhere).
	Stall time.Duration
	// Aligned says whether placement alignment is measured (topology
	// shapes).
	Aligned bool
	// Background pods are scheduled by the scheduler under test before the
	// measured pods are created, in a namespace of their own, at the
	// default priority (0), and are not measured. They are deleted at
	// once when evicted (grace period 0: no kubelet runs here).
	Background []Mix
	// PriorityClass of the measured pods, "" for none. HighPriority is
	// the one the harness creates (value 1000): measured pods of it
	// outrank the background pods and may preempt them.
	PriorityClass string
}

const (
	basicDriver = "test-driver.cdi.k8s.io"
	basicClass  = "test-class"
	gpuClass    = "gpu.topodra.io"
	nicClass    = "nic.topodra.io"
	nicDriver   = "nic.topodra.io"

	// upstreamSelector is the CEL selector of upstream's selector_* cases.
	upstreamSelector = `device.attributes["test-driver.cdi.k8s.io"].driverVersion.major() >= 1 && device.capacity["test-driver.cdi.k8s.io"].memory.isGreaterThan(quantity("1Mi"))`
	// pcieRoot is the standard attribute (KEP-6072); upstream's template
	// spells it resource.kubernetes.io/pciRoot, we use the standard name
	// so that topodra sees the domains.
	pcieRoot = "resource.kubernetes.io/pcieRoot"

	// HighPriority is the PriorityClass of measured pods that preempt.
	HighPriority      = "perf-high"
	highPriorityValue = 1000
)

// Workloads returns the benchmark set. nodes is 500 for `make bench` and
// 50 for `--short`; claim and pod counts scale with it, steady-state runs
// last steady.
func Workloads(nodes int, steady time.Duration) []Workload {
	scale := func(per500 int) int { return max(1, per500*nodes/500) }
	one := []Template{{Name: "test-claim-template", Requests: []Request{{Name: "req-0", Class: basicClass, Count: 1}}}}
	selector := []Template{{Name: "test-claim-template", Requests: []Request{{Name: "req-0", Class: basicClass, Count: 1, Selector: upstreamSelector}}}}
	var five []Request
	for i := range 5 {
		five = append(five, Request{Name: fmt.Sprintf("req-%d", i), Class: basicClass, Count: 1})
	}
	match := []Template{{Name: "test-claim-template", Requests: five, MatchAttribute: pcieRoot}}
	stall := 10 * time.Second
	n := fmt.Sprintf("%dnodes", nodes)
	steadyCase := func(name string, init int, templates []Template) Workload {
		return Workload{
			Name: name + "_" + n, Shape: ShapeBasic, Nodes: nodes, InitClaims: init,
			Mode: Steady, Pods: 10, Templates: templates, Duration: steady, Stall: stall,
		}
	}
	gpuTemplates := []Template{
		{Name: "gpu-1", Requests: []Request{{Name: "gpu", Class: gpuClass, Count: 1}}},
		{Name: "gpu-2", Requests: []Request{{Name: "gpu", Class: gpuClass, Count: 2}}},
		{Name: "gpu-4", Requests: []Request{{Name: "gpu", Class: gpuClass, Count: 4}}},
		{Name: "gpu-8", Requests: []Request{{Name: "gpu", Class: gpuClass, Count: 8}}},
	}
	return []Workload{
		{
			// Upstream SchedulingWithResourceClaimTemplate/5000pods_500nodes.
			Name: fmt.Sprintf("claim-template/%dpods_%s", scale(5000), n), Shape: ShapeBasic, Nodes: nodes,
			InitClaims: scale(2500), Mode: Burst, Pods: scale(2500), Templates: one, Stall: stall,
		},
		// Upstream SteadyStateClusterResourceClaimTemplate/*.
		steadyCase("empty", 0, one),
		steadyCase("half", scale(2500), one),
		steadyCase("full", nodes*10-10, one),
		steadyCase("selector", 0, selector),
		steadyCase("match", 0, match),
		{
			// A quarter of the GPUs taken at random, then 1/2/4/8-GPU
			// jobs asking for about 73% of what is free.
			Name: "mixed-1-2-4-8gpu/" + n, Shape: ShapeDGX, Nodes: nodes,
			InitClaims: scale(1000), RandomDevice: true, Mode: Burst,
			Templates: gpuTemplates,
			Mix: []Mix{
				{Template: "gpu-1", Pods: scale(400)},
				{Template: "gpu-2", Pods: scale(300)},
				{Template: "gpu-4", Pods: scale(200)},
				{Template: "gpu-8", Pods: scale(50)},
			},
			Stall: stall, Aligned: true,
		},
		{
			// A quarter of the GPUs taken at random, then jobs with 2 GPUs
			// and 1 NIC in one claim (no matchAttribute: a shared PCIe
			// root is a preference), for half of the NICs.
			Name: "gpu-nic/" + n, Shape: ShapeDGXNIC, Nodes: nodes,
			InitClaims: scale(1000), RandomDevice: true, Mode: Burst, Pods: scale(1000),
			Templates: []Template{{Name: "gpu-2-nic-1", Requests: []Request{
				{Name: "gpu", Class: gpuClass, Count: 2},
				{Name: "nic", Class: nicClass, Count: 1},
			}}},
			Stall: stall, Aligned: true,
		},
		{
			// Every GPU taken by 2-GPU pods of priority 0 (2-GPU pods,
			// as the headroom holds back none), then pods of higher
			// priority that fit only by evicting them: 4 of 5 ask for
			// 4 GPUs (two victims each), 1 of 5 for 8 (four).
			// The stock plugin never preempts for devices, so under it
			// they all stay pending.
			Name: "preempt-4-8gpu/" + n, Shape: ShapeDGX, Nodes: nodes,
			Background: []Mix{{Template: "gpu-2", Pods: 4 * nodes}},
			Mode:       Burst, PriorityClass: HighPriority,
			Templates: gpuTemplates,
			Mix: []Mix{
				{Template: "gpu-4", Pods: scale(40)},
				{Template: "gpu-8", Pods: scale(10)},
			},
			Stall: stall, Aligned: true,
		},
	}
}

// podCount is the number of measured pods of a burst workload.
func (w *Workload) podCount() int {
	if len(w.Mix) == 0 {
		return w.Pods
	}
	n := 0
	for _, m := range w.Mix {
		n += m.Pods
	}
	return n
}

// podTemplates returns the template of each measured pod of a burst, in
// creation order.
func (w *Workload) podTemplates() []string {
	if len(w.Mix) == 0 {
		out := make([]string, w.Pods)
		for i := range out {
			out[i] = w.Templates[0].Name
		}
		return out
	}
	return shuffled(w.Mix)
}

// shuffled returns the template of each pod of mix, in a deterministic
// shuffled order.
func shuffled(mix []Mix) []string {
	var out []string
	for _, m := range mix {
		for range m.Pods {
			out = append(out, m.Template)
		}
	}
	rng := newRand(7)
	rng.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}
