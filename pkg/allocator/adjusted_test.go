package allocator

import (
	"fmt"
	"slices"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/kubernetes/test/utils/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

// TestAdjusted: an adjusted Allocator sees freed devices as free and taken
// ones as allocated, on every strategy's path (counting, and upstream's
// views for a claim with a constraint), and leaves the cycle's Allocator
// as it was.
func TestAdjusted(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	ids := func(names ...string) sets.Set[structured.DeviceID] {
		s := sets.New[structured.DeviceID]()
		for _, n := range names {
			s.Insert(structured.MakeDeviceID(gpuDriver, "n", n))
		}
		return s
	}
	var all []string
	for i := range 8 {
		all = append(all, fmt.Sprintf("gpu-%d", i))
	}
	four := claim("c").request("gpus", "gpu", 4).obj()
	constrained := claim("c").request("gpus", "gpu", 4).obj()
	constrained.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(topology.AttrNUMANode))}}

	for _, tc := range []struct {
		name     string
		c        *resourceapi.ResourceClaim
		upstream bool
	}{
		{"counted", four, false},
		{"constraint", constrained, false},
		{"upstream", four, true},
		{"upstream constraint", constrained, true},
	} {
		name, c := tc.name, tc.c
		t.Run(name, func(t *testing.T) {
			// Every GPU allocated. Without counting, the upstream
			// allocator decides on the node's views.
			opts := Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "n", all...), ClassLister: defaultClasses, Slices: dgx("n"), Policy: DefaultPolicy()}
			if tc.upstream {
				opts.SkipCounting = func(string) bool { return true }
			}
			a, err := New(ctx, opts)
			if err != nil {
				t.Fatal(err)
			}
			allocate := func(a *Allocator) []string {
				t.Helper()
				res, err := a.Allocate(ctx, node("n"), []*resourceapi.ResourceClaim{c})
				if err != nil {
					t.Fatal(err)
				}
				if res.Allocations == nil {
					return nil
				}
				return deviceNames(res.Allocations)
			}
			if got := allocate(a); got != nil {
				t.Fatalf("full node: got %v", got)
			}
			// Three of one NUMA node and one of the other freed: no
			// four fit in one NUMA node, but four fit on the node.
			split := a.Adjusted(ids("gpu-0", "gpu-1", "gpu-2", "gpu-4"), nil)
			got := allocate(split)
			if c == constrained && got != nil {
				t.Errorf("four GPUs of one NUMA node with three free there: got %v", got)
			}
			if c == four && !slices.Equal(got, []string{"gpu-0", "gpu-1", "gpu-2", "gpu-4"}) {
				t.Errorf("four freed GPUs: got %v", got)
			}
			// A NUMA node freed, one of its GPUs taken by a nominated
			// pod, the other NUMA node's freed too: the pod gets the
			// untouched NUMA node.
			taken := a.Adjusted(ids(all...), ids("gpu-1"))
			if got := allocate(taken); !slices.Equal(got, []string{"gpu-4", "gpu-5", "gpu-6", "gpu-7"}) {
				t.Errorf("gpu-1 taken, all freed: got %v", got)
			}
			if got := allocate(a); got != nil {
				t.Errorf("the cycle's Allocator changed: got %v", got)
			}
		})
	}
}
