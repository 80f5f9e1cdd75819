package allocator

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

// matchClaim is a claim of n one-GPU requests with matchAttribute on attr.
func matchClaim(name string, n int, attr resourceapi.FullyQualifiedName) *resourceapi.ResourceClaim {
	b := claim(name)
	for i := range n {
		b.request(fmt.Sprintf("gpu-%d", i), "gpu", 1)
	}
	b.c.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{MatchAttribute: ptr.To(attr)}}
	return b.obj()
}

// partialMatchClaim is matchClaim with the constraint naming only the first
// constrained of the n requests.
func partialMatchClaim(name string, n, constrained int, attr resourceapi.FullyQualifiedName) *resourceapi.ResourceClaim {
	c := matchClaim(name, n, attr)
	for i := range constrained {
		c.Spec.Devices.Constraints[0].Requests = append(c.Spec.Devices.Constraints[0].Requests, fmt.Sprintf("gpu-%d", i))
	}
	return c
}

// gpuNICClaim is a claim of one GPU and one NIC with matchAttribute on
// attr.
func gpuNICClaim(name string, attr resourceapi.FullyQualifiedName) *resourceapi.ResourceClaim {
	c := claim(name).request("gpu", "gpu", 1).request("nic", "nic", 1).obj()
	c.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{MatchAttribute: ptr.To(attr)}}
	return c
}

// withDevices adds the named devices of a pool of driver to state.
func withDevices(state *structured.AllocatedState, driver, pool string, names ...string) *structured.AllocatedState {
	for _, n := range names {
		state.AllocatedDevices.Insert(structured.MakeDeviceID(driver, pool, n))
	}
	return state
}

// TestMatchExplanationFreeable: a constrained claim that no value serves
// is freeable (preemption may help) exactly where one value could serve
// all its requests once the devices in use are given back; a device that
// a taint keeps from the claim does not count.
func TestMatchExplanationFreeable(t *testing.T) {
	const nodeName = "worker"
	pcieRoot := resourceapi.FullyQualifiedName(topology.AttrPCIeRoot)
	root := func(r string) attrs { return attrs{topology.AttrPCIeRoot: str(r)} }
	tainted := func(d resourceapi.Device) resourceapi.Device {
		d.Taints = []resourceapi.DeviceTaint{{Key: "example.com/broken", Effect: resourceapi.DeviceTaintEffectNoSchedule}}
		return d
	}
	gpus := func() *resourceapi.ResourceSlice {
		return slice(nodeName, gpuDriver, device("gpu-0", root("a")), device("gpu-1", root("a")), device("gpu-2", root("a")))
	}
	for name, tc := range map[string]struct {
		slices    []*resourceapi.ResourceSlice
		allocated *structured.AllocatedState
		freeable  bool
	}{
		"nic-in-use-beside-free-gpus": {
			slices:    gpuNIC(nodeName),
			allocated: withDevices(allocated(gpuDriver, nodeName, "gpu-2", "gpu-3"), nicDriver, nodeName, "nic-1"),
			freeable:  true,
		},
		"nic-on-a-root-without-gpus": {
			slices:    []*resourceapi.ResourceSlice{gpus(), slice(nodeName, nicDriver, device("nic-0", root("b")))},
			allocated: allocated(gpuDriver, nodeName, "gpu-0", "gpu-1"),
			freeable:  false,
		},
		"nic-beside-the-gpus-tainted": {
			slices:    []*resourceapi.ResourceSlice{gpus(), slice(nodeName, nicDriver, tainted(device("nic-0", root("a"))), device("nic-1", root("b")))},
			allocated: allocated(gpuDriver, nodeName, "gpu-0"),
			freeable:  false,
		},
	} {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			_, res, upResult := allocateBoth(ctx, t, nodeName, tc.slices, tc.allocated, DefaultPolicy(), []*resourceapi.ResourceClaim{gpuNICClaim("c", pcieRoot)})
			if res.Allocations != nil || upResult != nil || res.Explanation == nil {
				t.Fatalf("allocates %v (upstream %v); want neither, with an explanation", deviceNames(res.Allocations), deviceNames(upResult))
			}
			if !strings.Contains(res.Explanation.String(), "no single value of") {
				t.Fatalf("explanation %q is not the constraint's", res.Explanation)
			}
			if got := res.Explanation.Freeable(); got != tc.freeable {
				t.Errorf("Freeable() = %v, want %v (%+v)", got, tc.freeable, res.Explanation.Requests)
			}
		})
	}
}

// TestMatchAttributeByCounting checks claims with matchAttribute
// constraints that Allocate decides by counting per attribute value: the
// devices chosen, that the result is counted (Unverified) where it should
// be, that Verify confirms it with upstream, and that infeasible claims
// are explained, always agreeing with upstream on feasibility.
func TestMatchAttributeByCounting(t *testing.T) {
	const nodeName = "worker"
	pcieRoot := resourceapi.FullyQualifiedName(topology.AttrPCIeRoot)
	odd := func() []*resourceapi.ResourceSlice {
		// gpu-0 and gpu-1: pcieRoot "1" as a string and as an int;
		// gpu-2 lacks it; gpu-3 publishes the driver-domain "rail"
		// attribute by its short name.
		one := int64(1)
		s := "1"
		return []*resourceapi.ResourceSlice{slice(nodeName, gpuDriver,
			device("gpu-0", attrs{topology.AttrPCIeRoot: {StringValue: &s}, "rail": str("r0")}),
			device("gpu-1", attrs{topology.AttrPCIeRoot: {IntValue: &one}, "rail": str("r0")}),
			device("gpu-2", attrs{"rail": str("r1")}),
			device("gpu-3", attrs{topology.AttrPCIeRoot: str("1"), gpuDriver + "/rail": str("r1")}),
		)}
	}
	testcases := map[string]struct {
		slices    []*resourceapi.ResourceSlice
		allocated *structured.AllocatedState
		claims    []*resourceapi.ResourceClaim
		want      []string // sorted; nil = infeasible
		counted   bool     // decided without upstream in Allocate
		explain   string
	}{
		"empty-box-one-root": {
			slices:  pcieBox(nodeName),
			claims:  []*resourceapi.ResourceClaim{matchClaim("c", 4, pcieRoot)},
			want:    []string{"gpu-0", "gpu-1", "gpu-2", "gpu-3"},
			counted: true,
		},
		"best-fit-root": {
			// Root 1 has gpu-4 in use: three GPUs fill it (upstream
			// takes gpu-0..2 and breaks up the free root).
			slices:    pcieBox(nodeName),
			allocated: allocated(gpuDriver, nodeName, "gpu-4"),
			claims:    []*resourceapi.ResourceClaim{matchClaim("c", 3, pcieRoot)},
			want:      []string{"gpu-5", "gpu-6", "gpu-7"},
			counted:   true,
		},
		"pair-inside-root": {
			// Two GPUs within one root: the NVLink-bridged pair of the
			// fuller root.
			slices:    pcieBox(nodeName),
			allocated: allocated(gpuDriver, nodeName, "gpu-0"),
			claims:    []*resourceapi.ResourceClaim{matchClaim("c", 2, pcieRoot)},
			want:      []string{"gpu-2", "gpu-3"},
			counted:   true,
		},
		"fuller-numa-node-breaks-the-tie": {
			// Three DGX roots have both GPUs free; the one in NUMA node 1
			// (gpu-4 in use) keeps NUMA node 0 whole.
			slices:    dgx(nodeName),
			allocated: allocated(gpuDriver, nodeName, "gpu-4"),
			claims:    []*resourceapi.ResourceClaim{matchClaim("c", 2, pcieRoot)},
			want:      []string{"gpu-6", "gpu-7"},
			counted:   true,
		},
		"two-of-three-requests-constrained": {
			// gpu-0 and gpu-1 must share a root, gpu-2 may go anywhere:
			// root 0 has one free GPU, root 1 two.
			slices:    pcieBox(nodeName),
			allocated: allocated(gpuDriver, nodeName, "gpu-0", "gpu-1", "gpu-2", "gpu-6", "gpu-7"),
			claims:    []*resourceapi.ResourceClaim{partialMatchClaim("c", 3, 2, pcieRoot)},
			want:      []string{"gpu-3", "gpu-4", "gpu-5"},
			counted:   true,
		},
		"two-of-three-requests-constrained-infeasible": {
			slices:    pcieBox(nodeName),
			allocated: allocated(gpuDriver, nodeName, "gpu-0", "gpu-1", "gpu-2", "gpu-5", "gpu-6", "gpu-7"),
			claims:    []*resourceapi.ResourceClaim{partialMatchClaim("c", 3, 2, pcieRoot)},
			want:      nil,
			counted:   true,
			explain:   "no single value of resource.kubernetes.io/pcieRoot has free devices for requests gpu-0 and gpu-1 (needs 2; the best has 1)",
		},
		"constrained-fit-the-other-does-not": {
			// gpu-0 and gpu-1 fit in root 0, the only free GPUs; gpu-2
			// gets none.
			slices:    pcieBox(nodeName),
			allocated: allocated(gpuDriver, nodeName, "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6", "gpu-7"),
			claims:    []*resourceapi.ResourceClaim{partialMatchClaim("c", 3, 2, pcieRoot)},
			want:      nil,
			counted:   true,
			explain:   "no single value of resource.kubernetes.io/pcieRoot leaves free devices for the claim's other requests (needs 3 in all)",
		},
		"no-root-has-enough": {
			slices:    pcieBox(nodeName),
			allocated: allocated(gpuDriver, nodeName, "gpu-0", "gpu-4"),
			claims:    []*resourceapi.ResourceClaim{matchClaim("c", 4, pcieRoot)},
			want:      nil,
			counted:   true,
			explain:   "no single value of resource.kubernetes.io/pcieRoot has free devices for all requests (needs 4; the best has 3)",
		},
		"gpu-and-nic-on-no-root": {
			// Root 0 has two free GPUs and its NIC in use, root 1 its
			// NIC and no free GPU: the GPUs of root 0 count once, for
			// the GPU request.
			slices:    gpuNIC(nodeName),
			allocated: withDevices(allocated(gpuDriver, nodeName, "gpu-2", "gpu-3"), nicDriver, nodeName, "nic-1"),
			claims:    []*resourceapi.ResourceClaim{gpuNICClaim("c", pcieRoot)},
			want:      nil,
			counted:   true,
			explain:   "claim c request gpu,nic: no single value of resource.kubernetes.io/pcieRoot has free devices for all requests (needs 2; the best has 1: 0 of 1 nic free there)",
		},
		"two-claims-two-roots": {
			slices: pcieBox(nodeName),
			claims: []*resourceapi.ResourceClaim{matchClaim("a", 4, pcieRoot), matchClaim("b", 4, pcieRoot)},
			want: []string{"gpu-0", "gpu-1", "gpu-2", "gpu-3",
				"gpu-4", "gpu-5", "gpu-6", "gpu-7"},
			counted: true,
		},
		"types-differ-and-missing-attribute": {
			// Only gpu-0 and gpu-3 share the string "1".
			slices:  odd(),
			claims:  []*resourceapi.ResourceClaim{matchClaim("c", 2, pcieRoot)},
			want:    []string{"gpu-0", "gpu-3"},
			counted: true,
		},
		"types-differ-infeasible": {
			slices:    odd(),
			allocated: allocated(gpuDriver, nodeName, "gpu-3"),
			claims:    []*resourceapi.ResourceClaim{matchClaim("c", 2, pcieRoot)},
			want:      nil,
			counted:   true,
			explain:   "(needs 2; the best has 1); 1 free device lacks the attribute",
		},
		"short-name-of-the-driver-domain": {
			slices:  odd(),
			claims:  []*resourceapi.ResourceClaim{matchClaim("c", 2, resourceapi.FullyQualifiedName(gpuDriver+"/rail"))},
			want:    []string{"gpu-0", "gpu-1"},
			counted: true,
		},
		"overlapping-selectors": {
			// Request a takes any GPU, request b only the free one of
			// bridge-0 (gpu-1 is in use): a's first choice, gpu-0, must
			// go to b, and a takes another GPU of the same root.
			slices:    pcieBox(nodeName),
			allocated: allocated(gpuDriver, nodeName, "gpu-1"),
			claims: []*resourceapi.ResourceClaim{func() *resourceapi.ResourceClaim {
				c := claim("c").request("a", "gpu", 1).
					request("b", "gpu", 1, fmt.Sprintf(`device.attributes[%q].nvlinkClique == "bridge-0"`, topology.DriverName)).obj()
				c.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{MatchAttribute: ptr.To(pcieRoot)}}
				return c
			}()},
			want:    []string{"gpu-0", "gpu-2"},
			counted: false,
		},
		"list-values-left-to-upstream": {
			slices: []*resourceapi.ResourceSlice{slice(nodeName, gpuDriver,
				device("gpu-0", attrs{topology.AttrNUMANode: nums(0, 1)}),
				device("gpu-1", attrs{topology.AttrNUMANode: nums(1)}),
			)},
			claims:  []*resourceapi.ResourceClaim{matchClaim("c", 2, resourceapi.FullyQualifiedName(topology.AttrNUMANode))},
			want:    []string{"gpu-0", "gpu-1"},
			counted: false,
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			a, res, upResult := allocateBoth(ctx, t, nodeName, tc.slices, tc.allocated, DefaultPolicy(), tc.claims)
			if got := deviceNames(res.Allocations); !slices.Equal(got, tc.want) {
				t.Fatalf("devices: got %v, want %v (explanation: %s)", got, tc.want, res.Explanation)
			}
			if tc.want != nil && res.Unverified != tc.counted {
				t.Errorf("decided by counting: %v, want %v", res.Unverified, tc.counted)
			}
			if tc.explain != "" && !strings.Contains(res.Explanation.String(), tc.explain) {
				t.Errorf("explanation %q does not contain %q", res.Explanation, tc.explain)
			}

			// Upstream agrees on feasibility, and accepts the devices.
			if (upResult == nil) != (tc.want == nil) {
				t.Fatalf("upstream allocates %v, topodra %v", deviceNames(upResult), tc.want)
			}
			if tc.want == nil {
				return
			}
			verified, err := a.Verify(ctx, node(nodeName), tc.claims, res)
			if err != nil {
				t.Fatalf("Verify: %v", err)
			}
			if verified.Unverified || !slices.Equal(deviceNames(verified.Allocations), tc.want) {
				t.Errorf("Verify: got %v (unverified %v), want %v", deviceNames(verified.Allocations), verified.Unverified, tc.want)
			}
			for ci, alloc := range verified.Allocations {
				if !tc.counted {
					break // list values: upstream intersects them
				}
				if !sharesDomainOf(tc.slices, alloc, tc.claims[ci]) {
					t.Errorf("claim %s: devices %v do not share the constrained attribute", tc.claims[ci].Name, deviceNames(verified.Allocations[ci:ci+1]))
				}
			}
		})
	}
}

// sharesDomainOf checks the first matchAttribute constraint of claim on
// the allocated devices with the upstream-exact lookup.
func sharesDomainOf(pool []*resourceapi.ResourceSlice, alloc resourceapi.AllocationResult, claim *resourceapi.ResourceClaim) bool {
	constraint := claim.Spec.Devices.Constraints[0]
	attr := *constraint.MatchAttribute
	var first string
	k := -1
	for _, r := range alloc.Devices.Results {
		if len(constraint.Requests) > 0 && !slices.Contains(constraint.Requests, r.Request) {
			continue
		}
		k++
		var value string
		var ok bool
		for _, s := range pool {
			for i := range s.Spec.Devices {
				d := &s.Spec.Devices[i]
				if s.Spec.Driver == r.Driver && s.Spec.Pool.Name == r.Pool && d.Name == r.Device {
					if a, found := lookupAttribute(s.Spec.Driver, d, attr); found {
						value, ok = typedValue(a)
					}
				}
			}
		}
		if !ok || (k > 0 && value != first) {
			return false
		}
		first = value
	}
	return true
}

// TestFillSlots: a maximum matching of request slots to distinct devices
// moves a device to another slot where that fills both.
func TestFillSlots(t *testing.T) {
	for name, tc := range map[string]struct {
		slots     [][]int
		stopEarly bool
		want      int
	}{
		"disjoint":                 {slots: [][]int{{0}, {1}}, want: 2},
		"first takes the second's": {slots: [][]int{{0, 1}, {0}}, want: 2},
		"chain of moves":           {slots: [][]int{{0, 1}, {1, 2}, {0}}, want: 3},
		"one device, two slots":    {slots: [][]int{{0}, {0}, {1}}, want: 2},
		"stop at the first empty":  {slots: [][]int{{0}, {0}, {1}}, stopEarly: true, want: 1},
		"none":                     {slots: [][]int{{}, {}}, want: 0},
	} {
		if got := fillSlots(tc.slots, tc.stopEarly); got != tc.want {
			t.Errorf("%s: fillSlots(%v, %v) = %d, want %d", name, tc.slots, tc.stopEarly, got, tc.want)
		}
	}
}
