package perf

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	schedulingv1 "k8s.io/api/scheduling/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// initNamespace holds the pre-allocated claims.
const initNamespace = "init"

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)) }

// nodeName is the name of node i, as upstream names them.
func nodeName(i int) string { return fmt.Sprintf("scheduler-perf-dra-%d", i) }

// parallel runs f(0..n-1) on workers goroutines and returns the first error.
func parallel(ctx context.Context, n, workers int, f func(ctx context.Context, i int) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	next := make(chan int)
	var wg sync.WaitGroup
	for range min(workers, max(n, 1)) {
		wg.Go(func() {
			for i := range next {
				if err := f(ctx, i); err != nil {
					cancel(err)
				}
			}
		})
	}
	for i := 0; i < n; i++ {
		select {
		case next <- i:
		case <-ctx.Done():
			i = n
		}
	}
	close(next)
	wg.Wait()
	return context.Cause(ctx)
}

// deviceSpec is a device of a node shape with its topology coordinates
// (what the alignment tracker needs).
type deviceSpec struct {
	driver string
	name   string
	root   int // PCIe root index within the node
	numa   int
	nic    bool
}

// shapeDevices lists the devices of one node of a shape.
func shapeDevices(shape Shape) []deviceSpec {
	var out []deviceSpec
	switch shape {
	case ShapeBasic:
		for i := range 10 {
			out = append(out, deviceSpec{driver: basicDriver, name: fmt.Sprintf("basic-device-%d", i), root: i % 2, numa: i % 2})
		}
	case ShapeDGX, ShapeDGXNIC:
		for i := range 8 {
			out = append(out, deviceSpec{driver: topology.DriverName, name: fmt.Sprintf("gpu-%d", i), root: i / 2, numa: i / 4})
		}
		if shape == ShapeDGXNIC {
			for i := range 4 {
				out = append(out, deviceSpec{driver: nicDriver, name: fmt.Sprintf("nic-%d", i), root: i, numa: i / 2, nic: true})
			}
		}
	}
	return out
}

// basicDevices is upstream's resourceslice-basic-devices.yaml for one node,
// with the PCIe root under its standard name (see pcieRoot).
func basicDevices() []framework.Device {
	var out []framework.Device
	for i := range 10 {
		root := i % 2
		out = append(out, framework.Device{
			Name: fmt.Sprintf("basic-device-%d", i),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"driver":                          framework.StringAttr("xe"),
				"driverVersion":                   {VersionValue: ptr.To("1.2.3")},
				"resource.k8s.io/pciRoot":         framework.StringAttr(fmt.Sprint(root)),
				"family":                          framework.StringAttr("Arc Pro B-Series"),
				"health":                          framework.StringAttr("Healthy"),
				"model":                           framework.StringAttr("B60"),
				"pciAddress":                      framework.StringAttr(fmt.Sprintf("0000:0%d:00.0", i)),
				"pciId":                           framework.StringAttr("0xe211"),
				"pciRoot":                         framework.StringAttr(fmt.Sprintf("0%d", root)),
				"resource.kubernetes.io/pciBusID": framework.StringAttr(fmt.Sprintf("0000:0%d:00.0", i)),
				pcieRoot:                          framework.StringAttr(fmt.Sprintf("pci0000:0%d", root)),
				"sriov":                           {BoolValue: ptr.To(true)},
				"type":                            framework.StringAttr("gpu"),
			},
			Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
				"memory":     {Value: resource.MustParse("24480Mi")},
				"millicores": {Value: resource.MustParse("1k")},
			},
		})
	}
	return out
}

// nicDevices are 4 NICs, one per PCIe root of framework.DGXLikeGPUs.
func nicDevices() []framework.Device {
	var out []framework.Device
	for i := range 4 {
		out = append(out, framework.Device{
			Name: fmt.Sprintf("nic-%d", i),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"type":                framework.StringAttr("nic"),
				"rdma":                {BoolValue: ptr.To(true)},
				topology.AttrPCIeRoot: framework.StringAttr(fmt.Sprintf("pci0000:%02x", i)),
				topology.AttrNUMANode: framework.IntAttr(int64(i / 2)),
				topology.AttrPCIBusID: framework.StringAttr(fmt.Sprintf("0000:%02x:01.0", i)),
			},
		})
	}
	return out
}

// setUpCluster creates the nodes, their ResourceSlices, the DeviceClasses
// and the pre-allocated claims of a workload.
func setUpCluster(ctx context.Context, client kubernetes.Interface, w *Workload) error {
	const workers = 16
	classes := []*resourceapi.DeviceClass{}
	switch w.Shape {
	case ShapeBasic:
		classes = append(classes, framework.DeviceClass(basicClass, basicDriver))
	default:
		classes = append(classes, framework.DeviceClass(gpuClass, topology.DriverName), framework.DeviceClass(nicClass, nicDriver))
	}
	for _, c := range classes {
		if _, err := client.ResourceV1().DeviceClasses().Create(ctx, c, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create class %s: %w", c.Name, err)
		}
	}
	err := parallel(ctx, w.Nodes, workers, func(ctx context.Context, i int) error {
		name := nodeName(i)
		if _, err := framework.CreateReadyNode(ctx, client, name, nil); err != nil {
			return err
		}
		var slices []*resourceapi.ResourceSlice
		switch w.Shape {
		case ShapeBasic:
			slices = append(slices, framework.SliceForNode(name, basicDriver, basicDevices()))
		case ShapeDGX:
			slices = append(slices, framework.SliceForNode(name, topology.DriverName, framework.DGXLikeGPUs(name)))
		case ShapeDGXNIC:
			slices = append(slices, framework.SliceForNode(name, topology.DriverName, framework.DGXLikeGPUs(name)),
				framework.SliceForNode(name, nicDriver, nicDevices()))
		}
		for _, s := range slices {
			if _, err := client.ResourceV1().ResourceSlices().Create(ctx, s, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("create slice %s: %w", s.Name, err)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("create nodes: %w", err)
	}
	if w.PriorityClass != "" {
		if w.PriorityClass != HighPriority {
			return fmt.Errorf("priority class %q: the harness creates only %q", w.PriorityClass, HighPriority)
		}
		pc := &schedulingv1.PriorityClass{ObjectMeta: metav1.ObjectMeta{Name: HighPriority}, Value: highPriorityValue}
		if _, err := client.SchedulingV1().PriorityClasses().Create(ctx, pc, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create priority class: %w", err)
		}
	}
	if w.InitClaims == 0 {
		return nil
	}
	if _, err := client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: initNamespace}}, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create namespace: %w", err)
	}
	allocs, err := initialAllocations(w)
	if err != nil {
		return err
	}
	class := basicClass
	if w.Shape != ShapeBasic {
		class = gpuClass
	}
	err = parallel(ctx, len(allocs), workers, func(ctx context.Context, i int) error {
		a := allocs[i]
		claim := &resourceapi.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{Namespace: initNamespace, Name: fmt.Sprintf("test-claim-%d", i)},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name:    "req-0",
				Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
			}}}},
		}
		created, err := client.ResourceV1().ResourceClaims(initNamespace).Create(ctx, claim, metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("create claim: %w", err)
		}
		created.Status.Allocation = &resourceapi.AllocationResult{
			Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
				Request: "req-0", Driver: a.driver, Pool: a.node, Device: a.device,
			}}},
			NodeSelector: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{
				MatchFields: []v1.NodeSelectorRequirement{{Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{a.node}}},
			}}},
		}
		if _, err := client.ResourceV1().ResourceClaims(initNamespace).UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("allocate claim %s: %w", created.Name, err)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("pre-allocate claims: %w", err)
	}
	return nil
}

type initAlloc struct{ node, driver, device string }

// initialAllocations picks the devices of the pre-allocated claims: one
// pseudo-random node with a free device per claim, its first free device
// or (RandomDevice) a random free one. The seed is fixed, so both
// schedulers start from the same state in every run.
func initialAllocations(w *Workload) ([]initAlloc, error) {
	devices := shapeDevices(w.Shape)
	var gpus []int // indexes of devices the init claims may take
	for i, d := range devices {
		if !d.nic {
			gpus = append(gpus, i)
		}
	}
	if w.InitClaims > w.Nodes*len(gpus) {
		return nil, fmt.Errorf("%d initial claims do not fit on %d nodes", w.InitClaims, w.Nodes)
	}
	rng := newRand(1)
	used := make([][]bool, w.Nodes)
	free := make([]int, w.Nodes)
	var withFree []int
	for i := range used {
		used[i] = make([]bool, len(devices))
		free[i] = len(gpus)
		withFree = append(withFree, i)
	}
	var out []initAlloc
	for range w.InitClaims {
		k := rng.IntN(len(withFree))
		node := withFree[k]
		var candidates []int
		for _, g := range gpus {
			if !used[node][g] {
				candidates = append(candidates, g)
			}
		}
		pick := candidates[0]
		if w.RandomDevice {
			pick = candidates[rng.IntN(len(candidates))]
		}
		used[node][pick] = true
		free[node]--
		if free[node] == 0 {
			withFree = append(withFree[:k], withFree[k+1:]...)
		}
		out = append(out, initAlloc{node: nodeName(node), driver: devices[pick].driver, device: devices[pick].name})
	}
	return out, nil
}

// createTemplates creates the workload's claim templates in namespace.
func createTemplates(ctx context.Context, client kubernetes.Interface, namespace string, w *Workload) error {
	for _, t := range w.Templates {
		tmpl := &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: t.Name}}
		spec := &tmpl.Spec.Spec.Devices
		var names []string
		for _, r := range t.Requests {
			req := resourceapi.DeviceRequest{Name: r.Name, Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: r.Class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: r.Count,
			}}
			if r.Selector != "" {
				req.Exactly.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: r.Selector}}}
			}
			spec.Requests = append(spec.Requests, req)
			names = append(names, r.Name)
		}
		if t.MatchAttribute != "" {
			spec.Constraints = []resourceapi.DeviceConstraint{{
				Requests: names, MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(t.MatchAttribute)),
			}}
		}
		if _, err := client.ResourceV1().ResourceClaimTemplates(namespace).Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create template %s: %w", t.Name, err)
		}
	}
	return nil
}

// newPod is a measured pod: one claim from template, for schedulerName,
// of the workload's priority class.
func (w *Workload) newPod(namespace, schedulerName, template string) *v1.Pod {
	pod := framework.PodWithClaims(namespace, "", schedulerName, template)
	pod.GenerateName = "test-dra-"
	pod.Spec.PriorityClassName = w.PriorityClass
	return pod
}

// backgroundPod is a pod of the workload's background: priority 0, and
// gone at once when deleted (an evicted pod waits for no kubelet).
func backgroundPod(namespace, schedulerName, template string) *v1.Pod {
	pod := framework.PodWithClaims(namespace, "", schedulerName, template)
	pod.GenerateName = "background-"
	pod.Spec.TerminationGracePeriodSeconds = ptr.To[int64](0)
	return pod
}
