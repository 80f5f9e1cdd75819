package allocator

import (
	"context"
	"fmt"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/topology"
)

// benchShape is one benchmark input: a node's slices, what is in use, and
// the pod's claims.
type benchShape struct {
	name    string
	slices  func(nodeName string) []*resourceapi.ResourceSlice
	inUse   []string // device names in the node's GPU pool
	nicUse  []string
	claims  []*resourceapi.ResourceClaim
	classes classLister
}

// perfDevices mimics the scheduler_perf ResourceSlice: 10 devices with a
// realistic set of attributes, cycling through 2 PCIe roots (published under
// the standard name as well).
func perfDevices(nodeName string) []*resourceapi.ResourceSlice {
	var devs []resourceapi.Device
	for i := range 10 {
		d := device(fmt.Sprintf("basic-device-%d", i), attrs{
			"driver":                         str("xe"),
			"driverVersion":                  {VersionValue: ptrTo("1.2.3")},
			"resource.k8s.io/pciRoot":        str(fmt.Sprintf("%d", i%2)),
			"family":                         str("Arc Pro B-Series"),
			"health":                         str("Healthy"),
			"model":                          str("B60"),
			"pciAddress":                     str(fmt.Sprintf("0000:0%d:00.0", i)),
			"pciId":                          str("0xe211"),
			"pciRoot":                        str(fmt.Sprintf("0%d", i%2)),
			topology.AttrPCIBusID:            str(fmt.Sprintf("0000:0%d:00.0", i)),
			topology.AttrPCIeRoot:            str(fmt.Sprintf("pci0000:0%d", i%2)),
			"resource.kubernetes.io/pciRoot": str(fmt.Sprintf("pci0000:0%d", i%2)),
			"sriov":                          {BoolValue: ptrTo(true)},
			"type":                           str("gpu"),
		})
		d.Capacity = map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
			"memory":     {Value: resource.MustParse("24480Mi")},
			"millicores": {Value: resource.MustParse("1k")},
		}
		devs = append(devs, d)
	}
	return []*resourceapi.ResourceSlice{slice(nodeName, gpuDriver, devs...)}
}

func ptrTo[T any](v T) *T { return &v }

// dgxWithNICs is the DGX shape plus 4 NICs, one per PCIe root.
func dgxWithNICs(nodeName string) []*resourceapi.ResourceSlice {
	var nics []resourceapi.Device
	for i := range 4 {
		nics = append(nics, device(fmt.Sprintf("nic-%d", i), attrs{
			topology.AttrPCIeRoot: str(fmt.Sprintf("pci%04x:00", 3-i)),
			topology.AttrNUMANode: num(int64((3 - i) / 2)),
		}))
	}
	return append(dgx(nodeName), slice(nodeName, nicDriver, nics...))
}

var benchShapes = []benchShape{
	{name: "1gpu-empty", slices: dgx, claims: []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", 1).obj()}},
	{name: "1gpu-half", slices: dgx, inUse: []string{"gpu-0", "gpu-2", "gpu-5", "gpu-7"}, claims: []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", 1).obj()}},
	{name: "4gpu-half", slices: dgx, inUse: []string{"gpu-0", "gpu-2", "gpu-3", "gpu-6"}, claims: []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", 4).obj()}},
	{name: "gpu-nic-pod", slices: dgxWithNICs, inUse: []string{"gpu-0"}, claims: []*resourceapi.ResourceClaim{
		claim("gpu").request("gpus", "gpu", 2).annotate(topology.AnnotationAlignWith, "pod").obj(),
		claim("nic").request("nic", "nic", 1).annotate(topology.AnnotationAlignWith, "pod").obj(),
	}},
	{name: "10dev-2roots", slices: perfDevices, inUse: []string{"basic-device-0", "basic-device-3"}, claims: []*resourceapi.ResourceClaim{claim("c").request("req-0", "test-class", 1).obj()},
		classes: classes(class("test-class", `device.driver == "`+gpuDriver+`"`))},
	{name: "match-5of10", slices: perfDevices, inUse: []string{"basic-device-0"}, claims: []*resourceapi.ResourceClaim{fiveInOneRoot()},
		classes: classes(class("test-class", `device.driver == "`+gpuDriver+`"`))},
}

// fiveInOneRoot is upstream's match workload claim: five one-device
// requests that must share the PCIe root.
func fiveInOneRoot() *resourceapi.ResourceClaim {
	b := claim("c")
	for i := range 5 {
		b.request(fmt.Sprintf("req-%d", i), "test-class", 1)
	}
	b.c.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{MatchAttribute: ptrTo(resourceapi.FullyQualifiedName(topology.AttrPCIeRoot))}}
	return b.obj()
}

func benchState(nodeName string, s benchShape) *structured.AllocatedState {
	state := allocated(gpuDriver, nodeName, s.inUse...)
	for _, n := range s.nicUse {
		state.AllocatedDevices.Insert(structured.MakeDeviceID(nicDriver, nodeName, n))
	}
	return state
}

// benchInput is one shape's inputs on node-0.
type benchInput struct {
	slices   []*resourceapi.ResourceSlice
	state    *structured.AllocatedState
	classes  classLister
	node     *v1.Node
	celCache *cel.Cache
}

func (s benchShape) input() benchInput {
	const nodeName = "node-0"
	in := benchInput{slices: s.slices(nodeName), state: benchState(nodeName, s), classes: s.classes, node: node(nodeName), celCache: newCELCache()}
	if in.classes == nil {
		in.classes = defaultClasses
	}
	return in
}

func benchContext() context.Context {
	return klog.NewContext(context.Background(), klog.Background().V(1))
}

// BenchmarkAllocate compares one Allocate call on one node, topodra vs the
// upstream allocator, on the same inputs. Both allocators are built once,
// as in a scheduling cycle; see BenchmarkCycle for the cost of building.
func BenchmarkAllocate(b *testing.B) {
	ctx := benchContext()
	for _, s := range benchShapes {
		in := s.input()
		slices, state, cl, n, celCache := in.slices, in.state, in.classes, in.node, in.celCache
		b.Run(s.name+"/topodra", func(b *testing.B) {
			a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: cl, Slices: slices, CELCache: celCache, Policy: DefaultPolicy()})
			if err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				res, err := a.Allocate(ctx, n, s.claims)
				if err != nil || res.Allocations == nil {
					b.Fatalf("allocate: %v %v", err, res.Explanation)
				}
			}
		})
		b.Run(s.name+"/upstream", func(b *testing.B) {
			a, err := structured.NewAllocator(ctx, allFeatures, *state, cl, slices, celCache)
			if err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				res, err := a.Allocate(ctx, n, s.claims)
				if err != nil || res == nil {
					b.Fatalf("allocate: %v", err)
				}
			}
		})
	}
}

// BenchmarkCycle measures what a scheduling cycle costs: build the
// allocator from all slices of a cluster, then allocate on every node (as
// PreFilter + Filter do), for a 1-GPU pod on DGX nodes with varied usage.
func BenchmarkCycle(b *testing.B) {
	ctx := benchContext()
	for _, numNodes := range []int{50, 500} {
		all, nodes, state := benchCluster(numNodes)
		claims := []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", 1).obj()}
		celCache := newCELCache()
		b.Run(fmt.Sprintf("%dnodes/topodra", numNodes), func(b *testing.B) {
			cache := NewCache()
			for b.Loop() {
				a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: all, CELCache: celCache, Cache: cache, Policy: DefaultPolicy()})
				if err != nil {
					b.Fatal(err)
				}
				for _, n := range nodes {
					if _, err := a.Allocate(ctx, n, claims); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
		b.Run(fmt.Sprintf("%dnodes/upstream", numNodes), func(b *testing.B) {
			for b.Loop() {
				a, err := structured.NewAllocator(ctx, allFeatures, *state, defaultClasses, all, celCache)
				if err != nil {
					b.Fatal(err)
				}
				for _, n := range nodes {
					if _, err := a.Allocate(ctx, n, claims); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}

// BenchmarkRatio runs topodra and upstream alternately on the same inputs
// in one loop and reports both times and their ratio, which is robust
// against load changes on a shared machine. Per shape it measures one
// Allocate call (allocators built once); "cycle-N" measures building the
// allocator from N nodes' slices plus one Allocate per node.
func BenchmarkRatio(b *testing.B) {
	ctx := benchContext()
	report := func(b *testing.B, topodra, upstream time.Duration, n int) {
		b.ReportMetric(float64(topodra.Nanoseconds())/float64(n), "topodra-ns/op")
		b.ReportMetric(float64(upstream.Nanoseconds())/float64(n), "upstream-ns/op")
		b.ReportMetric(float64(topodra)/float64(upstream), "ratio")
	}
	for _, s := range benchShapes {
		b.Run(s.name, func(b *testing.B) {
			in := s.input()
			slices, state, cl, n, celCache := in.slices, in.state, in.classes, in.node, in.celCache
			top, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: cl, Slices: slices, CELCache: celCache, Policy: DefaultPolicy()})
			if err != nil {
				b.Fatal(err)
			}
			up, err := structured.NewAllocator(ctx, allFeatures, *state, cl, slices, celCache)
			if err != nil {
				b.Fatal(err)
			}
			var tTop, tUp time.Duration
			iterations := 0
			for b.Loop() {
				start := time.Now()
				if res, err := top.Allocate(ctx, n, s.claims); err != nil || res.Allocations == nil {
					b.Fatalf("topodra: %v", err)
				}
				mid := time.Now()
				if res, err := up.Allocate(ctx, n, s.claims); err != nil || res == nil {
					b.Fatalf("upstream: %v", err)
				}
				tTop += mid.Sub(start)
				tUp += time.Since(mid)
				iterations++
			}
			report(b, tTop, tUp, iterations)
		})
	}
	for _, numNodes := range []int{50, 500} {
		b.Run(fmt.Sprintf("cycle-%d", numNodes), func(b *testing.B) {
			all, nodes, state := benchCluster(numNodes)
			claims := []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", 1).obj()}
			celCache := newCELCache()
			cache := NewCache()
			var tTop, tUp time.Duration
			iterations := 0
			for b.Loop() {
				start := time.Now()
				top, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: all, CELCache: celCache, Cache: cache, Policy: DefaultPolicy()})
				if err != nil {
					b.Fatal(err)
				}
				for _, n := range nodes {
					if _, err := top.Allocate(ctx, n, claims); err != nil {
						b.Fatal(err)
					}
				}
				mid := time.Now()
				up, err := structured.NewAllocator(ctx, allFeatures, *state, defaultClasses, all, celCache)
				if err != nil {
					b.Fatal(err)
				}
				for _, n := range nodes {
					if _, err := up.Allocate(ctx, n, claims); err != nil {
						b.Fatal(err)
					}
				}
				tTop += mid.Sub(start)
				tUp += time.Since(mid)
				iterations++
			}
			report(b, tTop, tUp, iterations)
		})
	}
}

// benchCluster builds numNodes DGX nodes; node i has i%8 GPUs in use.
func benchCluster(numNodes int) ([]*resourceapi.ResourceSlice, []*v1.Node, *structured.AllocatedState) {
	var all []*resourceapi.ResourceSlice
	var nodes []*v1.Node
	state := allocated(gpuDriver, "none")
	for i := range numNodes {
		name := fmt.Sprintf("node-%d", i)
		nodes = append(nodes, node(name))
		all = append(all, dgx(name)...)
		for j := range i % 8 {
			state.AllocatedDevices.Insert(structured.MakeDeviceID(gpuDriver, name, fmt.Sprintf("gpu-%d", (j*3)%8)))
		}
	}
	return all, nodes, state
}
