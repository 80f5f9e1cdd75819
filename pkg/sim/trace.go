package sim

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"

	resourceapi "k8s.io/api/resource/v1"
	schedulingv1 "k8s.io/api/scheduling/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/topodra/topodra/pkg/topology"
)

// Names of the generated workloads (Options.Trace).
const (
	// TraceBuiltin is the built-in workload of Generate.
	TraceBuiltin = "builtin"
	// TracePoisson: Poisson arrivals asking for a quarter more than the cluster holds,
	// lifetimes that grow with the pod's size (1 GPU: 2-6 ticks, 8 GPUs:
	// 8-18), one GPU+NIC pod in ten (soft alignment), and one 1-GPU
	// service in ten that runs to the end (restartPolicy Always; the
	// others Never).
	TracePoisson = "poisson"
	// TraceNICMatch: like TracePoisson, but a third of the pods ask for one
	// or two GPUs and a NIC with a hard matchAttribute on
	// resource.kubernetes.io/pcieRoot (GPUDirect RDMA), which only the
	// PCIe roots of machines with NICs can satisfy.
	TraceNICMatch = "nic-match"
	// TraceUrgent: like TracePoisson, but a quarter of the 4- and 8-GPU
	// jobs are urgent: PriorityClass UrgentClass, above the others, so
	// that a scheduler may preempt them for it. A preempted pod ends (a
	// batch system that does not retry it).
	TraceUrgent = "urgent"
)

// UrgentClass is the PriorityClass of TraceUrgent's urgent jobs, and
// UrgentPriority its value.
const (
	UrgentClass          = "sim-urgent"
	UrgentPriority int32 = 1000
)

// Traces lists the workload names Options.Trace accepts.
func Traces() []string { return []string{TraceBuiltin, TracePoisson, TraceNICMatch, TraceUrgent} }

// traceKind is one shape of a generated trace.
type traceKind struct {
	jobKind
	// match: the claim requires all its devices on one PCIe root.
	match bool
	// minLife, maxLife bound the lifetime in ticks.
	minLife, maxLife int
	// urgent: the pod has PriorityClass UrgentClass.
	urgent bool
}

func traceKinds(trace string) []traceKind {
	life := map[int][2]int{1: {2, 6}, 2: {3, 8}, 4: {5, 12}, 8: {8, 18}}
	k := func(prefix, template string, gpus, nics, weight int, match bool) traceKind {
		return traceKind{jobKind: jobKind{prefix: prefix, template: template, gpus: gpus, nics: nics, weight: weight},
			match: match, minLife: life[gpus][0], maxLife: life[gpus][1]}
	}
	switch trace {
	case TracePoisson:
		return []traceKind{
			k("job-1g", "gpu-1", 1, 0, 32, false),
			k("job-2g", "gpu-2", 2, 0, 25, false),
			k("job-4g", "gpu-4", 4, 0, 20, false),
			k("job-8g", "gpu-8", 8, 0, 13, false),
			k("rdma-1g", "gpu-1-nic-1", 1, 1, 10, false),
		}
	case TraceUrgent:
		urgent := func(kind traceKind) traceKind { kind.urgent = true; return kind }
		return []traceKind{
			k("job-1g", "gpu-1", 1, 0, 32, false),
			k("job-2g", "gpu-2", 2, 0, 25, false),
			k("job-4g", "gpu-4", 4, 0, 15, false),
			urgent(k("urgent-4g", "gpu-4", 4, 0, 5, false)),
			k("job-8g", "gpu-8", 8, 0, 10, false),
			urgent(k("urgent-8g", "gpu-8", 8, 0, 3, false)),
			k("rdma-1g", "gpu-1-nic-1", 1, 1, 10, false),
		}
	case TraceNICMatch:
		return []traceKind{
			k("job-1g", "gpu-1", 1, 0, 20, false),
			k("job-2g", "gpu-2", 2, 0, 15, false),
			k("job-4g", "gpu-4", 4, 0, 18, false),
			k("job-8g", "gpu-8", 8, 0, 12, false),
			k("rdma-1g", "gpu-1-nic-1-match", 1, 1, 20, true),
			k("rdma-2g", "gpu-2-nic-1-match", 2, 1, 15, true),
		}
	}
	return nil
}

// GenerateTrace builds one of the generated workloads (see Traces); the
// same trace, seed, pod count and nodes give the same workload.
func GenerateTrace(trace string, seed int64, pods int, nodes []NodeSpec) (*Workload, error) {
	if trace == "" || trace == TraceBuiltin {
		return Generate(seed, pods, nodes, false)
	}
	all := traceKinds(trace)
	if all == nil {
		return nil, fmt.Errorf("unknown trace %q (known: %v)", trace, Traces())
	}
	caps, err := capacities(nodes)
	if err != nil {
		return nil, err
	}
	total := totalsOf(caps)
	var kinds []traceKind
	weightSum := 0
	for _, k := range all {
		if !total.fits(k.jobKind) {
			continue
		}
		kinds = append(kinds, k)
		weightSum += k.weight
	}
	if len(kinds) == 0 {
		return nil, fmt.Errorf("trace %s: no pod shape fits these nodes", trace)
	}
	// GPU-ticks demanded per pod on average; arrivals at the rate that
	// asks for the whole cluster.
	const (
		load           = 1.25
		servicePercent = 10 // 1-GPU pods that run to the end
		drainTicks     = 6
	)
	gpuTicks := 0.0
	for _, k := range kinds {
		gpuTicks += float64(k.weight*k.gpus) * float64(k.minLife+k.maxLife) / 2 / float64(weightSum)
	}
	rate := load * float64(total.gpus) / gpuTicks
	rng := rand.New(rand.NewPCG(uint64(seed), 0x7ace))
	w := &Workload{Templates: traceTemplates(kinds), Drain: drainTicks}
	counts := map[string]int{}
	at := 0.0
	for range pods {
		at += rng.ExpFloat64() / rate
		kind := kinds[weightedPick(rng, weightSum, func(i int) int { return kinds[i].weight })]
		life := kind.minLife + rng.IntN(kind.maxLife-kind.minLife+1)
		if kind.gpus == 1 && kind.nics == 0 && rng.IntN(100) < servicePercent {
			life = 0
		}
		name := fmt.Sprintf("%s-%03d", kind.prefix, counts[kind.prefix])
		counts[kind.prefix]++
		pod := builtinPod(name, kind.jobKind, life)
		if kind.urgent {
			pod.Spec.PriorityClassName = UrgentClass
		}
		w.Jobs = append(w.Jobs, Job{Pod: pod, Arrival: int(math.Floor(at)), Lifetime: life})
	}
	if slices.ContainsFunc(kinds, func(k traceKind) bool { return k.urgent }) {
		w.PriorityClasses = []*schedulingv1.PriorityClass{{
			ObjectMeta:  metav1.ObjectMeta{Name: UrgentClass},
			Value:       UrgentPriority,
			Description: "urgent jobs of the simulator's urgent trace: they may preempt the others",
		}}
	}
	return w, nil
}

// traceTemplates are the claim templates of kinds, one per template name.
func traceTemplates(kinds []traceKind) []*resourceapi.ResourceClaimTemplate {
	var out []*resourceapi.ResourceClaimTemplate
	var seen []string
	for _, k := range kinds {
		if slices.Contains(seen, k.template) {
			continue
		}
		seen = append(seen, k.template)
		tmpl := k.claimTemplate()
		if k.match {
			attr := resourceapi.FullyQualifiedName(topology.AttrPCIeRoot)
			tmpl.Spec.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{MatchAttribute: &attr}}
		}
		out = append(out, tmpl)
	}
	return out
}
