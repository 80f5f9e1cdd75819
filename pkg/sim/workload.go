package sim

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/sim/workload"
)

// Annotations on the pods of a workload file (see package workload).
const (
	AnnotationArrival  = workload.AnnotationArrival
	AnnotationLifetime = workload.AnnotationLifetime
)

// LabelProfile is the node label that names a simulated node's machine
// profile.
const LabelProfile = "sim.topodra.io/profile"

// Job is one pod of a workload (see package workload).
type Job = workload.Job

// Workload is what a run creates (see package workload).
type Workload = workload.Workload

// jobKind is one shape of the built-in workload.
type jobKind struct {
	prefix   string
	template string
	gpus     int
	nics     int
	weight   int
}

var builtinKinds = []jobKind{
	{prefix: "train-1g", template: "gpu-1", gpus: 1, weight: 33},
	{prefix: "train-2g", template: "gpu-2", gpus: 2, weight: 25},
	{prefix: "train-4g", template: "gpu-4", gpus: 4, weight: 15},
	{prefix: "train-8g", template: "gpu-8", gpus: 8, weight: 9},
	{prefix: "rdma-1g", template: "gpu-1-nic-1", gpus: 1, nics: 1, weight: 18},
}

// builtinTemplates are the claim templates of the built-in workload. The
// GPU+NIC template has two requests in one claim and no matchAttribute: a
// shared PCIe root is a preference, which the stock allocator cannot
// express and topodra can.
func builtinTemplates() []*resourceapi.ResourceClaimTemplate {
	var out []*resourceapi.ResourceClaimTemplate
	for _, k := range builtinKinds {
		out = append(out, k.claimTemplate())
	}
	return out
}

// claimTemplate is the kind's template: one request for its GPUs and, if it
// has NICs, one for them.
func (k jobKind) claimTemplate() *resourceapi.ResourceClaimTemplate {
	tmpl := &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: k.template}}
	add := func(name, class string, n int) {
		tmpl.Spec.Spec.Devices.Requests = append(tmpl.Spec.Spec.Devices.Requests, resourceapi.DeviceRequest{
			Name: name,
			Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: class,
				AllocationMode:  resourceapi.DeviceAllocationModeExactCount,
				Count:           int64(n),
			},
		})
	}
	add("gpu", GPUClassName, k.gpus)
	if k.nics > 0 {
		add("nic", NICClassName, k.nics)
	}
	return tmpl
}

// nodeCapacity is what the generator knows about a node.
type nodeCapacity struct {
	name string
	gpus int
	nics int
}

// clusterTotals sums the capacities of a workload's nodes.
type clusterTotals struct{ gpus, nics, maxGPUs int }

func totalsOf(caps []nodeCapacity) clusterTotals {
	var t clusterTotals
	for _, c := range caps {
		t.gpus += c.gpus
		t.nics += c.nics
		t.maxGPUs = max(t.maxGPUs, c.gpus)
	}
	return t
}

// fits reports whether some node can take a pod of kind k.
func (t clusterTotals) fits(k jobKind) bool {
	return k.gpus <= t.maxGPUs && (k.nics == 0 || t.nics > 0)
}

func capacities(nodes []NodeSpec) ([]nodeCapacity, error) {
	var out []nodeCapacity
	for _, n := range nodes {
		spec, err := mockgpu.ProfileSpec(n.Profile)
		if err != nil {
			return nil, err
		}
		out = append(out, nodeCapacity{name: n.Name, gpus: len(spec.GPUs), nics: len(spec.NICs)})
	}
	return out, nil
}

// Generate builds the built-in workload: training-like pods asking 1, 2, 4
// or 8 GPUs, and pods asking one GPU plus one NIC (only when some node has
// NICs), arriving at a steady rate that keeps the cluster about full and
// slower for the last quarter, then a few ticks without arrivals, so that
// it drains; most finish after 4 to 16
// ticks, a tenth of the 1- and 2-GPU pods run to the end (services, with
// restartPolicy Always; the others are Jobs' pods, Never). The same seed and
// nodes give the same workload. With pin, every pod gets a node (see
// Options.Pin); a pod that fits nowhere at its tick arrives at the first
// later tick where it fits; pinned workloads have no pods that run to the
// end.
func Generate(seed int64, pods int, nodes []NodeSpec, pin bool) (*Workload, error) {
	caps, err := capacities(nodes)
	if err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(uint64(seed), 0x70_70_d7a))
	total := totalsOf(caps)
	if total.gpus == 0 {
		return nil, errors.New("the nodes have no GPUs")
	}
	var kinds []jobKind
	weightSum := 0
	for _, k := range builtinKinds {
		if !total.fits(k) {
			continue
		}
		kinds = append(kinds, k)
		weightSum += k.weight
	}
	meanGPUs := 0.0
	for _, k := range kinds {
		meanGPUs += float64(k.gpus*k.weight) / float64(weightSum)
	}
	const (
		minLife, maxLife = 4, 16
		foreverPercent   = 10 // of the 1- and 2-GPU pods
		targetLoad       = 1.1
		// The last quarter of the pods arrives at 40% of the rate, so the
		// cluster drains towards the end and the free capacity left
		// (fragmentation) shows.
		rampFrom  = 0.75
		rampSpeed = 0.4
		// Then a few ticks without arrivals: what the long runners leave
		// behind is the fragmentation.
		drainTicks = 6
	)
	meanLife := float64(minLife+maxLife) / 2
	rate := targetLoad * float64(total.gpus) / (meanGPUs * meanLife) // pods per tick
	rate = math.Max(rate, 0.5)

	w := &Workload{Templates: builtinTemplates(), Drain: drainTicks}
	// For pinning: GPUs and NICs held per node until a tick.
	type hold struct {
		node, until, gpus, nics int
	}
	var holds []hold
	free := func(node, tick int) (int, int) {
		g, n := caps[node].gpus, caps[node].nics
		for _, h := range holds {
			if h.node == node && (h.until == 0 || h.until > tick) {
				g -= h.gpus
				n -= h.nics
			}
		}
		return g, n
	}
	counts := map[string]int{}
	tick := 0
	for i := range pods {
		kind := kinds[weightedPick(rng, weightSum, func(i int) int { return kinds[i].weight })]
		life := minLife + rng.IntN(maxLife-minLife+1)
		if kind.gpus <= 2 && rng.IntN(100) < foreverPercent && !pin {
			// Pinned workloads have no long runners: every pinned pod
			// must fit its node eventually.
			life = 0
		}
		at := float64(i) / rate
		if cut := rampFrom * float64(pods); float64(i) > cut {
			at = cut/rate + (float64(i)-cut)/(rate*rampSpeed)
		}
		arrival := int(at)
		arrival = max(arrival, tick)
		name := fmt.Sprintf("%s-%03d", kind.prefix, counts[kind.prefix])
		counts[kind.prefix]++
		pod := builtinPod(name, kind, life)
		if pin {
			for {
				var fits []int
				for n := range caps {
					g, nc := free(n, arrival)
					if g >= kind.gpus && nc >= kind.nics {
						fits = append(fits, n)
					}
				}
				if len(fits) > 0 {
					node := fits[rng.IntN(len(fits))]
					until := 0
					if life > 0 {
						until = arrival + life
					}
					holds = append(holds, hold{node: node, until: until, gpus: kind.gpus, nics: kind.nics})
					pod.Spec.NodeSelector = map[string]string{v1.LabelHostname: caps[node].name}
					break
				}
				if !slices.ContainsFunc(holds, func(h hold) bool { return h.until > arrival }) {
					// Nothing will ever be released: the pod can never fit.
					return nil, fmt.Errorf("pinned workload: pod %s needs %d GPUs and %d NICs, which no node can ever free", name, kind.gpus, kind.nics)
				}
				arrival++
			}
		}
		tick = arrival
		w.Jobs = append(w.Jobs, Job{Pod: pod, Arrival: arrival, Lifetime: life})
	}
	return w, nil
}

// What each pod of the generated workloads requests per GPU besides its
// devices, as GPU pods do (a DGX H100 has 224 hardware threads and 2 TiB
// for 8 GPUs; the simulated nodes have 256 CPUs and 2 TiB, so these never
// run out before the GPUs do). Options.NoHostRequests leaves them out.
const (
	HostCPUPerGPU    = 24
	HostMemoryPerGPU = 192 << 30
)

// HostRequestsText describes the requests of the generated pods.
var HostRequestsText = fmt.Sprintf("%d CPUs and %d GiB of memory per GPU", HostCPUPerGPU, HostMemoryPerGPU>>30)

func builtinPod(name string, kind jobKind, life int) *v1.Pod {
	requests := v1.ResourceList{
		v1.ResourceCPU:    *resource.NewQuantity(int64(HostCPUPerGPU*kind.gpus), resource.DecimalSI),
		v1.ResourceMemory: *resource.NewQuantity(int64(HostMemoryPerGPU*kind.gpus), resource.BinarySI),
	}
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:   name,
			Labels: map[string]string{"app.kubernetes.io/name": kind.prefix},
		},
		Spec: v1.PodSpec{
			Containers: []v1.Container{{
				Name:      "trainer",
				Image:     "registry.k8s.io/pause:3.10",
				Resources: v1.ResourceRequirements{Requests: requests, Claims: []v1.ResourceClaim{{Name: "devices"}}},
			}},
			ResourceClaims: []v1.PodResourceClaim{{
				Name:                      "devices",
				ResourceClaimTemplateName: ptr.To(kind.template),
			}},
			TerminationGracePeriodSeconds: ptr.To[int64](0),
			RestartPolicy:                 restartPolicyFor(life),
		},
	}
}

// restartPolicyFor is the restart policy of a generated pod with this
// lifetime: a pod that runs to the end is a service (Always, as the pods
// of a Deployment), one that finishes is a Job's pod (Never).
func restartPolicyFor(life int) v1.RestartPolicy {
	if life == 0 {
		return v1.RestartPolicyAlways
	}
	return v1.RestartPolicyNever
}

// LoadWorkload reads a workload file (workload.Load).
func LoadWorkload(path string) (*Workload, error) { return workload.Load(path) }

// ParseWorkload parses the contents of a workload file (workload.Parse).
func ParseWorkload(data []byte) (*Workload, error) { return workload.Parse(data) }

// weightedPick draws an index i with probability weight(i)/sum (sum is the
// sum of all weights).
func weightedPick(rng *rand.Rand, sum int, weight func(i int) int) int {
	pick := rng.IntN(sum)
	for i := 0; ; i++ {
		if pick < weight(i) {
			return i
		}
		pick -= weight(i)
	}
}

// withoutHostRequests is a copy of w whose pods request no CPU or memory.
func withoutHostRequests(w *Workload) *Workload {
	out := *w
	out.Jobs = slices.Clone(w.Jobs)
	for i := range out.Jobs {
		pod := out.Jobs[i].Pod.DeepCopy()
		for c := range pod.Spec.Containers {
			delete(pod.Spec.Containers[c].Resources.Requests, v1.ResourceCPU)
			delete(pod.Spec.Containers[c].Resources.Requests, v1.ResourceMemory)
		}
		out.Jobs[i].Pod = pod
	}
	return &out
}
