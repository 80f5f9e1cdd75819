package sim

import (
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

func TestGenerateIsSeeded(t *testing.T) {
	nodes, err := PlanNodes(DefaultProfile, 0)
	if err != nil {
		t.Fatal(err)
	}
	a, err := Generate(3, 100, nodes, false)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Generate(3, 100, nodes, false)
	c, _ := Generate(4, 100, nodes, false)
	if !reflect.DeepEqual(a, b) {
		t.Error("same seed gave different workloads")
	}
	if reflect.DeepEqual(a, c) {
		t.Error("different seeds gave the same workload")
	}
	if len(a.Jobs) != 100 {
		t.Fatalf("got %d jobs, want 100", len(a.Jobs))
	}
	sizes := map[string]int{}
	finite := 0
	for i, j := range a.Jobs {
		if i > 0 && j.Arrival < a.Jobs[i-1].Arrival {
			t.Errorf("job %d arrives before job %d", i, i-1)
		}
		sizes[*j.Pod.Spec.ResourceClaims[0].ResourceClaimTemplateName]++
		if j.Lifetime > 0 {
			finite++
		}
	}
	for _, tmpl := range []string{"gpu-1", "gpu-2", "gpu-4", "gpu-8", "gpu-1-nic-1"} {
		if sizes[tmpl] == 0 {
			t.Errorf("no pod uses template %s: %v", tmpl, sizes)
		}
	}
	if finite == 0 || finite == len(a.Jobs) {
		t.Errorf("%d of %d pods finish; want churn and some long runners", finite, len(a.Jobs))
	}
}

func TestGeneratePinnedFits(t *testing.T) {
	nodes, err := PlanNodes("dgx-h100=3,pcie-nvlink-pairs=1", 0)
	if err != nil {
		t.Fatal(err)
	}
	w, err := Generate(7, 60, nodes, true)
	if err != nil {
		t.Fatal(err)
	}
	caps, _ := capacities(nodes)
	capOf := map[string]nodeCapacity{}
	for _, c := range caps {
		capOf[c.name] = c
	}
	// Replay: at every tick, the pinned pods alive on a node fit it.
	for tick := 0; tick < w.Ticks(); tick++ {
		gpus, nics := map[string]int{}, map[string]int{}
		for _, j := range w.Jobs {
			if j.Arrival <= tick && (j.Lifetime == 0 || j.Arrival+j.Lifetime > tick) {
				node := j.Pod.Spec.NodeSelector[v1.LabelHostname]
				tmpl := *j.Pod.Spec.ResourceClaims[0].ResourceClaimTemplateName
				for _, k := range builtinKinds {
					if k.template == tmpl {
						gpus[node] += k.gpus
						nics[node] += k.nics
					}
				}
			}
		}
		for node, g := range gpus {
			if g > capOf[node].gpus || nics[node] > capOf[node].nics {
				t.Fatalf("tick %d: node %s holds %d GPUs, %d NICs; has %d, %d", tick, node, g, nics[node], capOf[node].gpus, capOf[node].nics)
			}
		}
	}
}

func TestParseWorkload(t *testing.T) {
	good := `
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: two-gpus
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.topodra.io
          count: 2
---
# a comment-only document
---
apiVersion: v1
kind: Pod
metadata:
  name: late
  annotations:
    sim.topodra.io/arrival: "5"
    sim.topodra.io/lifetime: "3"
spec:
  containers:
  - name: c
    image: registry.k8s.io/pause:3.10
    resources:
      claims: [{name: gpus}]
  resourceClaims:
  - name: gpus
    resourceClaimTemplateName: two-gpus
---
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata:
  name: urgent
value: 1000
---
apiVersion: v1
kind: Pod
metadata:
  name: next
spec:
  priorityClassName: urgent
  containers:
  - name: c
    image: registry.k8s.io/pause:3.10
`
	w, err := ParseWorkload([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Templates) != 1 || len(w.Jobs) != 2 || len(w.PriorityClasses) != 1 {
		t.Fatalf("got %d templates, %d priority classes and %d jobs", len(w.Templates), len(w.PriorityClasses), len(w.Jobs))
	}
	if j := w.Jobs[0]; j.Pod.Name != "late" || j.Arrival != 5 || j.Lifetime != 3 {
		t.Errorf("first job %s arrival %d lifetime %d", j.Pod.Name, j.Arrival, j.Lifetime)
	}
	if j := w.Jobs[1]; j.Pod.Name != "next" || j.Arrival != 6 || j.Lifetime != 0 {
		t.Errorf("second job %s arrival %d lifetime %d", j.Pod.Name, j.Arrival, j.Lifetime)
	}

	bad := map[string]struct {
		doc     string
		wantErr string
	}{
		"missing template": {doc: "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers: [{name: c, image: x}]\n  resourceClaims: [{name: g, resourceClaimTemplateName: nope}]\n", wantErr: "ResourceClaimTemplate nope is not in the file"},
		"bad lifetime":     {doc: "apiVersion: v1\nkind: Pod\nmetadata: {name: p, annotations: {sim.topodra.io/lifetime: \"0\"}}\nspec:\n  containers: [{name: c, image: x}]\n", wantErr: "must be an integer >= 1"},
		"other kind":       {doc: "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n", wantErr: "is not supported"},
		"no pods":          {doc: "# nothing\n", wantErr: "no pods"},
		"missing class":    {doc: "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  priorityClassName: nope\n  containers: [{name: c, image: x}]\n", wantErr: "PriorityClass nope is not in the file"},
		"priority":         {doc: "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  priority: 5\n  containers: [{name: c, image: x}]\n", wantErr: "set priorityClassName, not priority"},
	}
	for name, tc := range bad {
		t.Run(name, func(t *testing.T) {
			_, err := ParseWorkload([]byte(tc.doc))
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("got %v, want error containing %q", err, tc.wantErr)
			}
		})
	}
}

// TestGeneratedPodsRequestHostResources: every generated pod requests CPU
// and memory in proportion to the GPUs of its template; withoutHostRequests
// removes them from a copy and leaves the workload it was given alone.
func TestGeneratedPodsRequestHostResources(t *testing.T) {
	nodes, err := PlanNodes(DefaultProfile, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, trace := range Traces() {
		w, err := GenerateTrace(trace, 5, 60, nodes)
		if err != nil {
			t.Fatal(err)
		}
		gpus := map[string]int64{}
		for _, tmpl := range w.Templates {
			for _, r := range tmpl.Spec.Spec.Devices.Requests {
				if r.Exactly != nil && r.Exactly.DeviceClassName == GPUClassName {
					gpus[tmpl.Name] += r.Exactly.Count
				}
			}
		}
		for _, j := range w.Jobs {
			n := gpus[*j.Pod.Spec.ResourceClaims[0].ResourceClaimTemplateName]
			req := j.Pod.Spec.Containers[0].Resources.Requests
			if n == 0 || req.Cpu().Value() != HostCPUPerGPU*n || req.Memory().Value() != HostMemoryPerGPU*n {
				t.Errorf("%s: pod %s with %d GPUs requests %s CPU and %s memory, want %d and %d per GPU", trace, j.Pod.Name, n, req.Cpu(), req.Memory(), HostCPUPerGPU, HostMemoryPerGPU)
			}
		}
		bare := withoutHostRequests(w)
		for i, j := range bare.Jobs {
			if req := j.Pod.Spec.Containers[0].Resources.Requests; len(req) != 0 {
				t.Errorf("%s: pod %s still requests %v", trace, j.Pod.Name, req)
			}
			if len(w.Jobs[i].Pod.Spec.Containers[0].Resources.Requests) != 2 {
				t.Fatalf("%s: withoutHostRequests changed the workload it was given", trace)
			}
		}
	}
}

// TestDescriptionSaysWhatPodsRequest: the report's description names the
// pods' CPU and memory requests for generated workloads only.
func TestDescriptionSaysWhatPodsRequest(t *testing.T) {
	for _, c := range []struct {
		report Report
		want   string
	}{
		{Report{Workload: "built-in", Seed: 3, HostRequests: HostRequestsText}, "built-in workload, seed 3, pods request 24 CPUs and 192 GiB of memory per GPU"},
		{Report{Workload: "poisson", Seed: 3, HostRequests: "none"}, "workload poisson, pods without CPU or memory requests"},
		{Report{Workload: "jobs.yaml"}, "workload jobs.yaml"},
	} {
		if got := c.report.Description(); got != c.want {
			t.Errorf("Description() = %q, want %q", got, c.want)
		}
	}
}

// TestGPUsAsked: every generated pod's wait is counted under the GPUs its
// claim asks for (the size in its name), also where a matchAttribute
// constraint keeps the simulator from judging it by free counts, and a
// firstAvailable request counts its first subrequest.
func TestGPUsAsked(t *testing.T) {
	nodes, err := PlanNodes(DefaultProfile, 0)
	if err != nil {
		t.Fatal(err)
	}
	size := regexp.MustCompile(`-(\d+)g-`)
	for _, trace := range Traces() {
		w, err := GenerateTrace(trace, 3, 200, nodes)
		if err != nil {
			t.Fatal(err)
		}
		templates := map[string]*resourceapi.ResourceClaimTemplate{}
		for _, tmpl := range w.Templates {
			templates[tmpl.Name] = tmpl
		}
		constrained := 0
		for _, j := range w.Jobs {
			m := size.FindStringSubmatch(j.Pod.Name)
			if m == nil {
				t.Fatalf("%s: pod name %s names no size", trace, j.Pod.Name)
			}
			want, _ := strconv.Atoi(m[1])
			if got := gpusAsked(j.Pod, templates); got != want {
				t.Errorf("%s: pod %s asks for %d GPUs, counted %d", trace, j.Pod.Name, want, got)
			}
			if d := demandOf(j.Pod, templates); d == nil || d.SameRoot {
				constrained++
			}
		}
		if trace == TraceNICMatch && constrained == 0 {
			t.Errorf("%s: no pod with a matchAttribute constraint, so that case was not checked", trace)
		}
	}

	tmpl := &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: "choice"}}
	tmpl.Spec.Spec.Devices.Requests = []resourceapi.DeviceRequest{
		{Name: "gpus", FirstAvailable: []resourceapi.DeviceSubRequest{
			{Name: "four", DeviceClassName: GPUClassName, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 4},
			{Name: "two", DeviceClassName: GPUClassName, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 2},
		}},
		{Name: "all", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: GPUClassName, AllocationMode: resourceapi.DeviceAllocationModeAll}},
		{Name: "nic", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: NICClassName, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1}},
	}
	pod := &v1.Pod{Spec: v1.PodSpec{ResourceClaims: []v1.PodResourceClaim{{Name: "c", ResourceClaimTemplateName: ptr.To("choice")}, {Name: "direct", ResourceClaimName: ptr.To("shared")}}}}
	if got := gpusAsked(pod, map[string]*resourceapi.ResourceClaimTemplate{"choice": tmpl}); got != 4 {
		t.Errorf("firstAvailable 4 or 2, All, a NIC and a claim by name: counted %d GPUs, want 4", got)
	}
}
