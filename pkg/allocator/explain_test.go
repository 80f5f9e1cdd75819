package allocator

import (
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"

	"github.com/topodra/topodra/pkg/topology"
)

// TestRequireGroupExplanation: a GPU and a NIC that must share a domain
// (alignment=require, in one claim or in two with align-with=pod), each
// with a free device of its own but none in one domain: the explanation
// describes the group (the domain that has most of it, and which request
// it lacks), not one device that is "not within one domain", and it is
// freeable only where a domain could hold both once the devices in use
// are given back.
func TestRequireGroupExplanation(t *testing.T) {
	const nodeName = "n"
	at := func(root string, numa int64) attrs {
		return attrs{topology.AttrPCIeRoot: str(root), topology.AttrNUMANode: num(numa)}
	}
	// gpu-0 and gpu-1 on root a, gpu-2 on root b with the only NIC;
	// without gpu-2, no GPU shares a domain with the NIC.
	nodeSlices := func(withGPU2 bool) []*resourceapi.ResourceSlice {
		gpus := []resourceapi.Device{device("gpu-0", at("a", 0)), device("gpu-1", at("a", 0))}
		if withGPU2 {
			gpus = append(gpus, device("gpu-2", at("b", 1)))
		}
		return []*resourceapi.ResourceSlice{slice(nodeName, gpuDriver, gpus...), slice(nodeName, nicDriver, device("nic-0", at("b", 1)))}
	}
	require := func(b *claimBuilder) *claimBuilder { return b.annotate(topology.AnnotationAlignment, "require") }
	pod := func(b *claimBuilder) *claimBuilder { return require(b).annotate(topology.AnnotationAlignWith, "pod") }
	oneClaim := []*resourceapi.ResourceClaim{require(claim("c").request("gpu", "gpu", 1).request("nic", "nic", 1)).obj()}
	twoClaims := []*resourceapi.ResourceClaim{pod(claim("g").request("gpu", "gpu", 1)).obj(), pod(claim("n").request("nic", "nic", 1)).obj()}
	for name, tc := range map[string]struct {
		claims   []*resourceapi.ResourceClaim
		noGPU2   bool
		inUse    []string
		want     string
		freeable bool
	}{
		"one claim": {
			claims:   oneClaim,
			inUse:    []string{"gpu-2"},
			want:     "claim c request gpu,nic: no nvlinkClique or pcieRoot or numaNode has free devices for all requests (alignment=require; needs 2; the best has 1: 0 of 1 nic free there)",
			freeable: true,
		},
		"two claims": {
			claims:   twoClaims,
			inUse:    []string{"gpu-2"},
			want:     "claims g and n: no nvlinkClique or pcieRoot or numaNode has free devices for all their requests (align-with=pod and alignment=require; needs 2; the best has 1: 0 of 1 n/nic free there)",
			freeable: true,
		},
		"two claims, a GPU in use where no NIC is": {
			// gpu-2 is free beside the NIC: the pod fits.
			claims: twoClaims,
			inUse:  []string{"gpu-0"},
		},
		"no GPU beside the NIC": {
			// Giving back gpu-0 does not help.
			claims:   twoClaims,
			noGPU2:   true,
			inUse:    []string{"gpu-0"},
			want:     "claims g and n: no nvlinkClique or pcieRoot or numaNode has free devices for all their requests (align-with=pod and alignment=require; needs 2; the best has 1: 0 of 1 n/nic free there)",
			freeable: false,
		},
	} {
		t.Run(name, func(t *testing.T) {
			ctx := quietContext(t)
			state := allocated(gpuDriver, nodeName)
			for _, d := range tc.inUse {
				state.AllocatedDevices.Insert(structured.MakeDeviceID(gpuDriver, nodeName, d))
			}
			a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: nodeSlices(!tc.noGPU2), Policy: DefaultPolicy()})
			if err != nil {
				t.Fatal(err)
			}
			res, err := a.Allocate(ctx, node(nodeName), tc.claims)
			if err != nil {
				t.Fatal(err)
			}
			if tc.want == "" {
				if res.Allocations == nil {
					t.Fatalf("no allocation: %s", res.Explanation)
				}
				return
			}
			if res.Allocations != nil || res.Explanation == nil {
				t.Fatalf("allocates %v; want none, with an explanation", deviceNames(res.Allocations))
			}
			if got := res.Explanation.String(); got != tc.want {
				t.Errorf("explanation\n%q, want\n%q", got, tc.want)
			}
			if got := res.Explanation.Freeable(); got != tc.freeable {
				t.Errorf("Freeable() = %v, want %v (%+v)", got, tc.freeable, res.Explanation.Requests)
			}
		})
	}
}

// TestMissingKey: the run-time errors of selectors that look up a key the
// device lacks are told apart from others, which get no list of domains.
func TestMissingKey(t *testing.T) {
	d := device("gpu-0", attrs{"model": str("H100")})
	for expr, want := range map[string]bool{
		`device.attributes["gpu.nvidia.com"].productName == "H100"`:               true,
		`device.attributes["gpu.topodra.io"].memory > 3`:                          true,
		`device.capacity["gpu.topodra.io"].memory.isGreaterThan(quantity("1Gi"))`: true,
		`device.attributes["gpu.topodra.io"].model > 3`:                           false,
	} {
		compiled := newCELCache().GetOrCompile(expr)
		if compiled.Error != nil {
			t.Fatalf("%s: %v", expr, compiled.Error)
		}
		_, _, err := compiled.DeviceMatches(t.Context(), cel.Device{Driver: gpuDriver, Attributes: d.Attributes})
		if err == nil {
			t.Fatalf("%s: no error", expr)
		}
		if got := missingKey(err); got != want {
			t.Errorf("%s: missingKey(%v) = %v, want %v", expr, err, got, want)
		}
	}
}
