package allocator

import (
	"context"
	"slices"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/structured"

	"github.com/topodra/topodra/pkg/topology"
)

// TestVerifyKeepsRequiredAlignment: six GPUs, two per PCIe root and NUMA
// node; gpu-1 and gpu-4 are in use. Claim A asks for two GPUs with
// alignment require, claim B for two GPUs. Whatever the claim order,
// Allocate must find the assignment that keeps A on one root (gpu-2,
// gpu-3), and Verify must hand each claim exactly its planned devices
// (upstream assigns a union of devices first-fit in claim order).
func TestVerifyKeepsRequiredAlignment(t *testing.T) {
	const nodeName = "worker"
	var devs []resourceapi.Device
	for i := range 6 {
		devs = append(devs, device("gpu-"+string(rune('0'+i)), attrs{
			topology.AttrPCIeRoot: str("r" + string(rune('0'+i/2))),
			topology.AttrNUMANode: num(int64(i / 2)),
		}))
	}
	nodeSlices := []*resourceapi.ResourceSlice{slice(nodeName, gpuDriver, devs...)}
	required := func() *resourceapi.ResourceClaim {
		return claim("a").request("gpus", "gpu", 2).annotate(topology.AnnotationAlignment, "require").obj()
	}
	plain := func() *resourceapi.ResourceClaim { return claim("b").request("gpus", "gpu", 2).obj() }
	for name, order := range map[string][]*resourceapi.ResourceClaim{
		"required first": {required(), plain()},
		"required last":  {plain(), required()},
	} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			state := allocated(gpuDriver, nodeName, "gpu-1", "gpu-4")
			a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: nodeSlices, CELCache: newCELCache()})
			if err != nil {
				t.Fatal(err)
			}
			res, err := a.Allocate(ctx, node(nodeName), order)
			if err != nil {
				t.Fatal(err)
			}
			if res.Allocations == nil {
				t.Fatalf("infeasible, but b = gpu-0, gpu-5 with a = gpu-2, gpu-3 is valid: %v", res.Explanation)
			}
			verified, err := a.Verify(ctx, node(nodeName), order, res)
			if err != nil {
				t.Fatal(err)
			}
			if verified.Allocations == nil {
				t.Fatal("Verify found nothing")
			}
			for i, c := range order {
				got := deviceNames(verified.Allocations[i : i+1])
				if c.Name == "a" && !slices.Equal(got, []string{"gpu-2", "gpu-3"}) {
					t.Errorf("required claim a got %v, want gpu-2, gpu-3 (one PCIe root)", got)
				}
				if res.Unverified {
					planned := deviceNames(res.Allocations[i : i+1])
					if !slices.Equal(got, planned) {
						t.Errorf("claim %s: planned %v, verified %v", c.Name, planned, got)
					}
				}
			}
			// Upstream agrees the verified allocation is valid.
			check, err := structured.NewAllocator(ctx, allFeatures, *state, defaultClasses, onlyAllocated(nodeSlices, verified.Allocations), newCELCache())
			if err != nil {
				t.Fatal(err)
			}
			if up, err := check.Allocate(ctx, node(nodeName), order); err != nil || up == nil {
				t.Errorf("upstream refuses the verified devices: %v", err)
			}
		})
	}
}

// TestBindingConditionDevicesLast: two equally good PCIe roots, one whose
// GPUs have binding conditions. Like the stock allocator, topodra takes
// the plain devices while they fit as well.
func TestBindingConditionDevicesLast(t *testing.T) {
	const nodeName = "worker"
	var devs []resourceapi.Device
	for i := range 4 {
		d := device("gpu-"+string(rune('0'+i)), attrs{topology.AttrPCIeRoot: str("r" + string(rune('0'+i/2)))})
		if i < 2 {
			d.BindsToNode = ptrTo(true)
			d.BindingConditions = []string{"attached"}
			d.BindingFailureConditions = []string{"failed"}
		}
		devs = append(devs, d)
	}
	ctx := context.Background()
	a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, nodeName), ClassLister: defaultClasses,
		Slices: []*resourceapi.ResourceSlice{slice(nodeName, gpuDriver, devs...)}, CELCache: newCELCache()})
	if err != nil {
		t.Fatal(err)
	}
	claims := []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", 2).obj()}
	res, err := a.Allocate(ctx, node(nodeName), claims)
	if err != nil || res.Allocations == nil {
		t.Fatalf("Allocate: %v, %v", res, err)
	}
	if res, err = a.Verify(ctx, node(nodeName), claims, res); err != nil {
		t.Fatal(err)
	}
	if got := deviceNames(res.Allocations); !slices.Equal(got, []string{"gpu-2", "gpu-3"}) {
		t.Errorf("allocated %v, want the plain gpu-2, gpu-3", got)
	}
}

// onlyAllocated returns copies of slices with only the allocated devices.
func onlyAllocated(in []*resourceapi.ResourceSlice, allocations []resourceapi.AllocationResult) []*resourceapi.ResourceSlice {
	keep := map[[3]string]bool{}
	for _, alloc := range allocations {
		for _, r := range alloc.Devices.Results {
			keep[[3]string{r.Driver, r.Pool, r.Device}] = true
		}
	}
	out := make([]*resourceapi.ResourceSlice, 0, len(in))
	for _, slice := range in {
		c := slice.DeepCopy()
		c.Spec.Devices = slices.DeleteFunc(c.Spec.Devices, func(d resourceapi.Device) bool {
			return !keep[[3]string{slice.Spec.Driver, slice.Spec.Pool.Name, d.Name}]
		})
		out = append(out, c)
	}
	return out
}
