package invariant

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

const driver = "gpu.example.com"

func slice(pool string, generation int64, devices ...resourceapi.Device) *resourceapi.ResourceSlice {
	return &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: pool + "-slice"},
		Spec: resourceapi.ResourceSliceSpec{
			Driver:   driver,
			Pool:     resourceapi.ResourcePool{Name: pool, Generation: generation, ResourceSliceCount: 1},
			NodeName: ptr.To(pool),
			Devices:  devices,
		},
	}
}

func devices(names ...string) []resourceapi.Device {
	var out []resourceapi.Device
	for _, n := range names {
		out = append(out, resourceapi.Device{Name: n})
	}
	return out
}

// claim returns an allocated claim with the devices of pool, reserved for
// the pod with UID podUID (none if empty). Its spec has one request "req"
// of class "gpu" for as many devices.
func claim(name, pool string, podUID types.UID, deviceNames ...string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, CreationTimestamp: claimCreated}}
	c.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "req", Exactly: &resourceapi.ExactDeviceRequest{
		DeviceClassName: "gpu", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: int64(max(len(deviceNames), 1)),
	}}}
	if len(deviceNames) == 0 {
		return c
	}
	alloc := &resourceapi.AllocationResult{}
	for _, d := range deviceNames {
		alloc.Devices.Results = append(alloc.Devices.Results, resourceapi.DeviceRequestAllocationResult{Request: "req", Driver: driver, Pool: pool, Device: d})
	}
	c.Status.Allocation = alloc
	if podUID != "" {
		c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: string(podUID), UID: podUID}}
	}
	return c
}

// onNode gives c's allocation the node selector that the upstream
// allocator writes for devices of a node's own slices.
func onNode(c *resourceapi.ResourceClaim, node string) *resourceapi.ResourceClaim {
	c.Status.Allocation.NodeSelector = &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{
		MatchFields: []v1.NodeSelectorRequirement{{Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{node}}},
	}}}
	return c
}

// adminAccess has every request of c's spec ask for admin access and
// gives every result of its allocation admin access, as the upstream
// allocator writes it.
func adminAccess(c *resourceapi.ResourceClaim) *resourceapi.ResourceClaim {
	for i := range c.Spec.Devices.Requests {
		if e := c.Spec.Devices.Requests[i].Exactly; e != nil {
			e.AdminAccess = ptr.To(true)
		}
	}
	for i := range c.Status.Allocation.Devices.Results {
		c.Status.Allocation.Devices.Results[i].AdminAccess = ptr.To(true)
	}
	return c
}

// pod returns a pod bound to node (unbound if empty) using the named
// claims directly.
func pod(name string, uid types.UID, node string, claimNames ...string) *v1.Pod {
	p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, UID: uid}, Spec: v1.PodSpec{NodeName: node}}
	for _, c := range claimNames {
		p.Spec.ResourceClaims = append(p.Spec.ResourceClaims, v1.PodResourceClaim{Name: "c-" + c, ResourceClaimName: ptr.To(c)})
	}
	return p
}

// reservedForPodGroup reserves c for the PodGroup named podGroup.
func reservedForPodGroup(c *resourceapi.ResourceClaim, podGroup string) *resourceapi.ResourceClaim {
	c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{APIGroup: "scheduling.k8s.io", Resource: "podgroups", Name: podGroup, UID: types.UID(podGroup + "-uid")}}
	return c
}

// inPodGroup makes p a member of the PodGroup named podGroup.
func inPodGroup(p *v1.Pod, podGroup string) *v1.Pod {
	p.Spec.SchedulingGroup = &v1.PodSchedulingGroup{PodGroupName: ptr.To(podGroup)}
	return p
}

func TestInvariantChecker(t *testing.T) {
	multi := resourceapi.Device{Name: "shared", AllowMultipleAllocations: ptr.To(true)}
	nodeA := slice("node-a", 1, append(devices("gpu-0", "gpu-1", "gpu-2"), multi)...)
	tests := map[string]struct {
		state State
		want  []Violation
	}{
		"clean": {
			state: State{
				Slices: []*resourceapi.ResourceSlice{nodeA},
				Claims: []*resourceapi.ResourceClaim{
					claim("a", "node-a", "uid-a", "gpu-0"),
					share(claim("b", "node-a", "uid-b", "gpu-1", "shared"), "shared", nil),
					share(claim("c", "node-a", "", "shared"), "shared", nil), // multiple allocations allowed
					adminAccess(claim("admin", "node-a", "", "gpu-0")),       // admin access shares
					claim("pending", "", ""),
				},
				Pods: []*v1.Pod{
					pod("a", "uid-a", "node-a", "a"),
					pod("b", "uid-b", "node-a", "b"),
					pod("unbound", "uid-u", "", "pending"),
					func() *v1.Pod {
						p := pod("done", "uid-d", "node-a", "pending")
						p.Status.Phase = v1.PodSucceeded
						return p
					}(),
					func() *v1.Pod {
						p := pod("failed", "uid-f", "node-a", "pending")
						p.Status.Phase = v1.PodFailed
						return p
					}(),
				},
			},
		},
		"double allocation": {
			state: State{
				Slices: []*resourceapi.ResourceSlice{nodeA},
				Claims: []*resourceapi.ResourceClaim{claim("b", "node-a", "", "gpu-1"), claim("a", "node-a", "", "gpu-0", "gpu-1")},
			},
			want: []Violation{{Kind: DoubleAllocation, Device: &Device{driver, "node-a", "gpu-1"}, Claims: []string{"ns/a", "ns/b"}}},
		},
		"vanished device": {
			state: State{
				// Generation 2 no longer has gpu-2; generation 1 is stale.
				Slices: []*resourceapi.ResourceSlice{nodeA, slice("node-a", 2, devices("gpu-0", "gpu-1")...)},
				Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-2"), claim("gone", "node-gone", "", "gpu-0")},
			},
			want: []Violation{
				// Find reports a pool without slices too, under its own
				// kind.
				{Kind: UnpublishedPool, Pool: driver + "/node-gone", Claims: []string{"ns/gone"}},
				{Kind: VanishedDevice, Device: &Device{driver, "node-a", "gpu-2"}, Claims: []string{"ns/a"}},
			},
		},
		"vanished device in an incomplete generation": {
			state: State{
				// The driver republishes the pool: the slice with gpu-2 is
				// still at generation 1, which no longer counts.
				Slices: []*resourceapi.ResourceSlice{
					func() *resourceapi.ResourceSlice {
						s := slice("node-a", 2, devices("gpu-0", "gpu-1")...)
						s.Spec.Pool.ResourceSliceCount = 2
						return s
					}(),
					func() *resourceapi.ResourceSlice {
						s := slice("node-a", 1, devices("gpu-2")...)
						s.Name = "node-a-slice-2"
						s.Spec.Pool.ResourceSliceCount = 2
						return s
					}(),
				},
				Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-2")},
			},
			want: []Violation{{Kind: VanishedDevice, Device: &Device{driver, "node-a", "gpu-2"}, Claims: []string{"ns/a"}}},
		},
		"pod bound with unallocated claims": {
			state: State{
				Slices: []*resourceapi.ResourceSlice{nodeA},
				Claims: []*resourceapi.ResourceClaim{claim("pending", "", "")},
				Pods: []*v1.Pod{
					pod("p", "uid-p", "node-a", "pending"),
					pod("q", "uid-q", "node-a", "missing"),
					func() *v1.Pod {
						p := pod("t", "uid-t", "node-a")
						p.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To("tmpl")}}
						return p
					}(),
					// Its status says no claim was needed: not judged.
					func() *v1.Pod {
						p := pod("u", "uid-u", "node-a")
						p.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To("tmpl")}}
						p.Status.ResourceClaimStatuses = []v1.PodResourceClaimStatus{{Name: "gpu"}}
						return p
					}(),
					// The claim of DRA-backed extended resources.
					func() *v1.Pod {
						p := pod("x", "uid-x", "node-a")
						p.Status.ExtendedResourceClaimStatus = &v1.PodExtendedResourceClaimStatus{ResourceClaimName: "pending"}
						return p
					}(),
				},
			},
			want: []Violation{
				{Kind: PodClaimUnallocated, Pod: "ns/p", Claims: []string{"ns/pending"}},
				{Kind: PodClaimUnallocated, Pod: "ns/q", Claims: []string{"ns/missing"}},
				{Kind: PodClaimUnallocated, Pod: "ns/t"},
				{Kind: PodClaimUnallocated, Pod: "ns/x", Claims: []string{"ns/pending"}},
			},
		},
		"pods bound with a claim reserved for their pod group": {
			state: State{
				Slices: []*resourceapi.ResourceSlice{nodeA},
				Claims: []*resourceapi.ResourceClaim{reservedForPodGroup(claim("g", "node-a", "", "gpu-0"), "workers")},
				Pods:   []*v1.Pod{inPodGroup(pod("worker-0", "uid-0", "node-a", "g"), "workers"), inPodGroup(pod("worker-1", "uid-1", "node-a", "g"), "workers")},
			},
		},
		"pod bound with a claim reserved for another pod group": {
			state: State{
				Slices: []*resourceapi.ResourceSlice{nodeA},
				Claims: []*resourceapi.ResourceClaim{reservedForPodGroup(claim("g", "node-a", "", "gpu-0"), "workers")},
				Pods: []*v1.Pod{
					inPodGroup(pod("other", "uid-o", "node-a", "g"), "others"),
					pod("alone", "uid-a", "node-a", "g"),
				},
			},
			want: []Violation{
				{Kind: PodClaimNotReserved, Pod: "ns/alone", Claims: []string{"ns/g"}},
				{Kind: PodClaimNotReserved, Pod: "ns/other", Claims: []string{"ns/g"}},
			},
		},
		"pod bound with a claim reserved for another pod": {
			state: State{
				Slices: []*resourceapi.ResourceSlice{nodeA},
				Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "uid-other", "gpu-0")},
				Pods:   []*v1.Pod{pod("p", "uid-p", "node-a", "a")},
			},
			want: []Violation{
				{Kind: PodClaimNotReserved, Pod: "ns/p", Claims: []string{"ns/a"}},
				// No pod has the UID of the reservation.
				{Kind: StaleReservation, Claims: []string{"ns/a"}},
			},
		},
		"pods bound where their claims' devices are not": {
			state: State{
				Slices: []*resourceapi.ResourceSlice{nodeA},
				Claims: []*resourceapi.ResourceClaim{
					onNode(claim("here", "node-a", "uid-here", "gpu-0"), "node-a"),
					onNode(claim("there", "node-a", "uid-there", "gpu-1"), "node-a"),
					onNode(claim("gone-node", "node-a", "uid-gone-node", "gpu-2"), "node-a"),
					// Network-attached: a node selector on a label.
					func() *resourceapi.ResourceClaim {
						c := claim("by-label", "node-a", "uid-by-label", "shared")
						c.Status.Allocation.NodeSelector = &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{{Key: "rack", Operator: v1.NodeSelectorOpIn, Values: []string{"r1"}}}}}}
						return share(c, "shared", nil)
					}(),
				},
				Pods: []*v1.Pod{
					pod("here", "uid-here", "node-a", "here"),
					pod("there", "uid-there", "node-b", "there"),
					// Its node is gone: not judged.
					pod("gone-node", "uid-gone-node", "node-gone", "gone-node"),
					pod("by-label", "uid-by-label", "node-b", "by-label"),
				},
				Nodes: []*v1.Node{
					{ObjectMeta: metav1.ObjectMeta{Name: "node-a", Labels: map[string]string{"rack": "r1"}}},
					{ObjectMeta: metav1.ObjectMeta{Name: "node-b", Labels: map[string]string{"rack": "r2"}}},
				},
			},
			want: []Violation{
				{Kind: PodClaimOnOtherNode, Pod: "ns/by-label", Claims: []string{"ns/by-label"}},
				{Kind: PodClaimOnOtherNode, Pod: "ns/there", Claims: []string{"ns/there"}},
			},
		},
		"pods bound where their devices are not published for, without an allocation node selector": {
			state: State{
				Slices: []*resourceapi.ResourceSlice{nodeA, func() *resourceapi.ResourceSlice {
					// Network-attached devices, each with its own nodes.
					net := slice("net", 1,
						resourceapi.Device{Name: "net-0", NodeName: ptr.To("node-a")},
						resourceapi.Device{Name: "net-1", AllNodes: ptr.To(true)},
						resourceapi.Device{Name: "net-2", NodeSelector: rack("r2")},
						resourceapi.Device{Name: "net-3", NodeSelector: rack("r1")})
					net.Spec.NodeName = nil
					net.Spec.PerDeviceNodeSelection = ptr.To(true)
					return net
				}()},
				Claims: []*resourceapi.ResourceClaim{
					claim("local-here", "node-a", "uid-local-here", "gpu-1"),
					claim("local-elsewhere", "node-a", "uid-local-elsewhere", "gpu-0"),
					claim("net-elsewhere", "net", "uid-net-elsewhere", "net-0"),
					claim("net-all", "net", "uid-net-all", "net-1"),
					claim("net-rack", "net", "uid-net-rack", "net-2"),
					claim("net-other-rack", "net", "uid-net-other-rack", "net-3"),
				},
				Pods: []*v1.Pod{
					pod("local-here", "uid-local-here", "node-a", "local-here"),
					pod("local-elsewhere", "uid-local-elsewhere", "node-b", "local-elsewhere"),
					pod("net-elsewhere", "uid-net-elsewhere", "node-b", "net-elsewhere"),
					pod("net-all", "uid-net-all", "node-b", "net-all"),
					pod("net-rack", "uid-net-rack", "node-b", "net-rack"),
					pod("net-other-rack", "uid-net-other-rack", "node-b", "net-other-rack"),
				},
				Nodes: []*v1.Node{
					{ObjectMeta: metav1.ObjectMeta{Name: "node-a", Labels: map[string]string{"rack": "r1"}}},
					{ObjectMeta: metav1.ObjectMeta{Name: "node-b", Labels: map[string]string{"rack": "r2"}}},
				},
			},
			want: []Violation{
				{Kind: PodClaimOnOtherNode, Pod: "ns/local-elsewhere", Claims: []string{"ns/local-elsewhere"}},
				{Kind: PodClaimOnOtherNode, Pod: "ns/net-elsewhere", Claims: []string{"ns/net-elsewhere"}},
				{Kind: PodClaimOnOtherNode, Pod: "ns/net-other-rack", Claims: []string{"ns/net-other-rack"}},
			},
		},
		"claims reserved only for pods that will not run": {
			state: State{
				Slices: []*resourceapi.ResourceSlice{nodeA},
				Claims: []*resourceapi.ResourceClaim{
					claim("deleted", "node-a", "uid-deleted", "gpu-0"),
					claim("done", "node-a", "uid-done", "gpu-1"),
					claim("unbound-deleted", "node-a", "uid-unbound", "gpu-2"),
					// A pod of another namespace with the UID does not
					// hold the reservation.
					claim("elsewhere", "node-a", "uid-elsewhere", "shared"),
				},
				Pods: []*v1.Pod{
					func() *v1.Pod {
						p := pod("done", "uid-done", "node-a", "done")
						p.Status.Phase = v1.PodSucceeded
						return p
					}(),
					func() *v1.Pod {
						p := pod("unbound", "uid-unbound", "", "unbound-deleted")
						p.DeletionTimestamp = &metav1.Time{}
						return p
					}(),
					func() *v1.Pod {
						p := pod("elsewhere", "uid-elsewhere", "node-a")
						p.Namespace = "other"
						return p
					}(),
				},
			},
			want: []Violation{
				{Kind: StaleReservation, Claims: []string{"ns/deleted"}},
				{Kind: StaleReservation, Claims: []string{"ns/done"}},
				{Kind: StaleReservation, Claims: []string{"ns/elsewhere"}},
				{Kind: StaleReservation, Claims: []string{"ns/unbound-deleted"}},
			},
		},
		"claims with a reservation that still counts": {
			state: State{
				Slices: []*resourceapi.ResourceSlice{nodeA},
				Claims: []*resourceapi.ResourceClaim{
					// One of two pods sharing the claim is gone.
					func() *resourceapi.ResourceClaim {
						c := claim("shared", "node-a", "uid-gone", "gpu-0")
						c.Status.ReservedFor = append(c.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{Resource: "pods", Name: "live", UID: "uid-live"})
						return c
					}(),
					// A PodGroup that no listed object shows is not judged.
					reservedForPodGroup(claim("group", "node-a", "", "gpu-1"), "workers"),
					// A pod being deleted on its node still runs.
					claim("terminating", "node-a", "uid-terminating", "gpu-2"),
					// Allocated, reserved for no one: the controller
					// leaves such claims allocated too.
					claim("unreserved", "node-a", "", "shared"),
				},
				Pods: []*v1.Pod{
					pod("live", "uid-live", "node-a", "shared"),
					func() *v1.Pod {
						p := pod("terminating", "uid-terminating", "node-a", "terminating")
						p.DeletionTimestamp = &metav1.Time{}
						return p
					}(),
				},
			},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) { expectViolations(t, Find(tc.state), tc.want) })
	}
}

// TestPresence: a device missing from the newest generation of its pool is
// gone only once that generation is complete (as many slices as its
// resourceSliceCount) or the pool has no slices; while the driver
// republishes the pool slice by slice, it is pending.
func TestPresence(t *testing.T) {
	// poolSlice is slice name of pool "node-a", at generation, one of count.
	poolSlice := func(name string, generation, count int64, deviceNames ...string) *resourceapi.ResourceSlice {
		s := slice("node-a", generation, devices(deviceNames...)...)
		s.Name = name
		s.Spec.Pool.ResourceSliceCount = count
		return s
	}
	gpu2 := Device{driver, "node-a", "gpu-2"}
	tests := map[string]struct {
		slices []*resourceapi.ResourceSlice
		want   Presence
	}{
		"published": {
			slices: []*resourceapi.ResourceSlice{poolSlice("a", 1, 2, "gpu-0", "gpu-1"), poolSlice("b", 1, 2, "gpu-2")},
			want:   DevicePublished,
		},
		"published by an incomplete generation": {
			slices: []*resourceapi.ResourceSlice{poolSlice("a", 2, 2, "gpu-2"), poolSlice("b", 1, 2, "gpu-0")},
			want:   DevicePublished,
		},
		"pool republished slice by slice": {
			slices: []*resourceapi.ResourceSlice{poolSlice("a", 2, 2, "gpu-0", "gpu-1"), poolSlice("b", 1, 2, "gpu-2")},
			want:   DevicePending,
		},
		"first slices of a new pool": {
			slices: []*resourceapi.ResourceSlice{poolSlice("a", 1, 2, "gpu-0", "gpu-1")},
			want:   DevicePending,
		},
		"complete generation without it": {
			slices: []*resourceapi.ResourceSlice{poolSlice("a", 2, 2, "gpu-0", "gpu-1"), poolSlice("b", 2, 2, "gpu-3")},
			want:   DeviceGone,
		},
		"only a stale slice has it": {
			slices: []*resourceapi.ResourceSlice{poolSlice("a", 2, 1, "gpu-0", "gpu-1"), poolSlice("b", 1, 2, "gpu-2")},
			want:   DeviceGone,
		},
		"pool without slices": {
			slices: []*resourceapi.ResourceSlice{slice("node-b", 1, devices("gpu-2")...)},
			want:   DeviceGone,
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			if got := Publish(tc.slices).Presence(gpu2); got != tc.want {
				t.Errorf("presence of %s: got %d, want %d", gpu2, got, tc.want)
			}
		})
	}
}

// partitioned is a pool of one physical GPU with 40Gi of memory in four
// memory slices: the whole GPU consumes all four, each of its 1g
// partitions one, and a device that allows multiple allocations shares
// 10 of its "bandwidth" among its claims.
func partitioned(pool string, generation int64) *resourceapi.ResourceSlice {
	consumes := func(slices int64) []resourceapi.DeviceCounterConsumption {
		return []resourceapi.DeviceCounterConsumption{{CounterSet: "gpu-0", Counters: map[string]resourceapi.Counter{
			"memory": {Value: resource.MustParse(fmt.Sprintf("%dGi", 10*slices))},
			"slices": {Value: *resource.NewQuantity(slices, resource.DecimalSI)},
		}}}
	}
	s := slice(pool, generation,
		resourceapi.Device{Name: "gpu-0", ConsumesCounters: consumes(4)},
		resourceapi.Device{Name: "gpu-0-1g-0", ConsumesCounters: consumes(1)},
		resourceapi.Device{Name: "gpu-0-1g-1", ConsumesCounters: consumes(1)},
		resourceapi.Device{Name: "gpu-0-2g-0", ConsumesCounters: consumes(2)},
		resourceapi.Device{Name: "link", AllowMultipleAllocations: ptr.To(true), Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
			"bandwidth": {Value: resource.MustParse("10")},
			"ports":     {Value: resource.MustParse("4")},
		}},
	)
	s.Spec.SharedCounters = []resourceapi.CounterSet{{Name: "gpu-0", Counters: map[string]resourceapi.Counter{
		"memory": {Value: resource.MustParse("40Gi")},
		"slices": {Value: *resource.NewQuantity(4, resource.DecimalSI)},
	}}}
	return s
}

// share returns claim with a share of consumed capacity of device.
func share(c *resourceapi.ResourceClaim, device string, consumed map[resourceapi.QualifiedName]string) *resourceapi.ResourceClaim {
	for i, r := range c.Status.Allocation.Devices.Results {
		if r.Device != device {
			continue
		}
		r.ShareID = ptr.To(types.UID(c.Name + "-share"))
		r.ConsumedCapacity = map[resourceapi.QualifiedName]resource.Quantity{}
		for name, q := range consumed {
			r.ConsumedCapacity[name] = resource.MustParse(q)
		}
		c.Status.Allocation.Devices.Results[i] = r
	}
	return c
}

// TestSharedResourcesChecker: partitions of one device and shares of a
// device's capacity are judged as the upstream allocator counts them; an
// allocation without a share ID holds the whole device, even one that
// allows multiple allocations.
func TestSharedResourcesChecker(t *testing.T) {
	pool := partitioned("node-p", 1)
	// layouts is a pool whose partitions of counter set gpu-0 declare
	// compatibility groups (a layout each, or both, or none).
	layouts := func() *resourceapi.ResourceSlice {
		part := func(name string, groups ...string) resourceapi.Device {
			return resourceapi.Device{Name: name, ConsumesCounters: []resourceapi.DeviceCounterConsumption{{
				CounterSet: "gpu-0", CompatibilityGroups: groups,
				Counters: map[string]resourceapi.Counter{"memory": {Value: resource.MustParse("10Gi")}},
			}}}
		}
		s := slice("node-g", 1, part("p-a", "layout-a"), part("p-a2", "layout-a"), part("p-b", "layout-b"),
			part("p-ab", "layout-a", "layout-b"), part("p-none"), part("p-none2"))
		s.Spec.SharedCounters = []resourceapi.CounterSet{{Name: "gpu-0", Counters: map[string]resourceapi.Counter{"memory": {Value: resource.MustParse("80Gi")}}}}
		return s
	}()
	incompatible := func(claims ...string) Violation {
		return Violation{Kind: IncompatiblePartitions, Counter: driver + "/node-g/gpu-0", Claims: claims}
	}
	bandwidth := func(q string) map[resourceapi.QualifiedName]string {
		return map[resourceapi.QualifiedName]string{"bandwidth": q, "ports": "1"}
	}
	tests := map[string]struct {
		state State
		want  []Violation
	}{
		"partitions that fit together": {
			state: State{Slices: []*resourceapi.ResourceSlice{pool}, Claims: []*resourceapi.ResourceClaim{
				claim("a", "node-p", "", "gpu-0-1g-0"),
				claim("b", "node-p", "", "gpu-0-1g-1", "gpu-0-2g-0"),
				adminAccess(claim("admin", "node-p", "", "gpu-0")), // admin access consumes nothing
			}},
		},
		"the whole device beside one of its partitions": {
			state: State{Slices: []*resourceapi.ResourceSlice{pool}, Claims: []*resourceapi.ResourceClaim{
				claim("whole", "node-p", "", "gpu-0"),
				claim("part", "node-p", "", "gpu-0-1g-1"),
			}},
			want: []Violation{
				{Kind: CounterExceeded, Counter: driver + "/node-p/gpu-0/memory", Claims: []string{"ns/part", "ns/whole"}},
				{Kind: CounterExceeded, Counter: driver + "/node-p/gpu-0/slices", Claims: []string{"ns/part", "ns/whole"}},
			},
		},
		"counters of the newest generation": {
			// Generation 2 has only half the memory: 1g-0 and 2g-0 no
			// longer fit together; generation 1 does not count.
			state: State{
				Slices: []*resourceapi.ResourceSlice{pool, func() *resourceapi.ResourceSlice {
					s := partitioned("node-p", 2)
					s.Spec.SharedCounters[0].Counters["memory"] = resourceapi.Counter{Value: resource.MustParse("20Gi")}
					return s
				}()},
				Claims: []*resourceapi.ResourceClaim{claim("a", "node-p", "", "gpu-0-1g-0"), claim("b", "node-p", "", "gpu-0-2g-0")},
			},
			want: []Violation{{Kind: CounterExceeded, Counter: driver + "/node-p/gpu-0/memory", Claims: []string{"ns/a", "ns/b"}}},
		},
		"partitions of one layout": {
			state: State{Slices: []*resourceapi.ResourceSlice{layouts}, Claims: []*resourceapi.ResourceClaim{
				claim("a", "node-g", "", "p-a"), claim("b", "node-g", "", "p-a2", "p-ab"),
			}},
		},
		"partitions without groups": {
			state: State{Slices: []*resourceapi.ResourceSlice{layouts}, Claims: []*resourceapi.ResourceClaim{
				claim("a", "node-g", "", "p-none"), claim("b", "node-g", "", "p-none2"),
			}},
		},
		"partitions of two layouts": {
			state: State{Slices: []*resourceapi.ResourceSlice{layouts}, Claims: []*resourceapi.ResourceClaim{
				claim("a", "node-g", "", "p-a"), claim("b", "node-g", "", "p-b"),
			}},
			want: []Violation{incompatible("ns/a", "ns/b")},
		},
		"a partition without groups beside one with": {
			state: State{Slices: []*resourceapi.ResourceSlice{layouts}, Claims: []*resourceapi.ResourceClaim{
				claim("a", "node-g", "", "p-none", "p-ab"),
			}},
			want: []Violation{incompatible("ns/a")},
		},
		"partitions each compatible with the next, with no group common to all": {
			state: State{Slices: []*resourceapi.ResourceSlice{layouts}, Claims: []*resourceapi.ResourceClaim{
				claim("a", "node-g", "", "p-a"), claim("b", "node-g", "", "p-ab"), claim("c", "node-g", "", "p-b"),
			}},
			want: []Violation{incompatible("ns/a", "ns/b", "ns/c")},
		},
		"partitions of another layout with admin access": {
			state: State{Slices: []*resourceapi.ResourceSlice{layouts}, Claims: []*resourceapi.ResourceClaim{
				claim("a", "node-g", "", "p-a"), adminAccess(claim("admin", "node-g", "", "p-b")),
			}},
		},
		"shares within the capacity": {
			state: State{Slices: []*resourceapi.ResourceSlice{pool}, Claims: []*resourceapi.ResourceClaim{
				share(claim("a", "node-p", "", "link"), "link", bandwidth("4")),
				share(claim("b", "node-p", "", "link"), "link", bandwidth("6")),
				adminAccess(share(claim("admin", "node-p", "", "link"), "link", bandwidth("10"))),
			}},
		},
		"a whole-device allocation of a shareable device": {
			state: State{Slices: []*resourceapi.ResourceSlice{pool}, Claims: []*resourceapi.ResourceClaim{
				claim("whole", "node-p", "", "link"),
				adminAccess(share(claim("admin", "node-p", "", "link"), "link", bandwidth("10"))),
			}},
		},
		"a whole-device allocation beside a share": {
			state: State{Slices: []*resourceapi.ResourceSlice{pool}, Claims: []*resourceapi.ResourceClaim{
				claim("whole", "node-p", "", "link"),
				share(claim("part", "node-p", "", "link"), "link", bandwidth("10")),
			}},
			want: []Violation{{Kind: DoubleAllocation, Device: &Device{driver, "node-p", "link"}, Claims: []string{"ns/part", "ns/whole"}}},
		},
		"two whole-device allocations of a shareable device": {
			state: State{Slices: []*resourceapi.ResourceSlice{pool}, Claims: []*resourceapi.ResourceClaim{
				claim("a", "node-p", "", "link"),
				claim("b", "node-p", "", "link"),
			}},
			want: []Violation{{Kind: DoubleAllocation, Device: &Device{driver, "node-p", "link"}, Claims: []string{"ns/a", "ns/b"}}},
		},
		"shares over the capacity": {
			state: State{Slices: []*resourceapi.ResourceSlice{pool}, Claims: []*resourceapi.ResourceClaim{
				share(claim("a", "node-p", "", "link"), "link", bandwidth("4")),
				share(claim("b", "node-p", "", "link"), "link", bandwidth("4")),
				share(claim("c", "node-p", "", "link"), "link", bandwidth("2500m")),
			}},
			want: []Violation{{Kind: CapacityExceeded, Device: &Device{driver, "node-p", "link"}, Claims: []string{"ns/a", "ns/b", "ns/c"}}},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) { expectViolations(t, Find(tc.state), tc.want) })
	}
}

// expectViolations compares violations by kind, device, counter, pool, pod
// and claims, and checks that each has a message.
func expectViolations(t *testing.T, got, want []Violation) {
	t.Helper()
	for _, v := range got {
		t.Log(v)
		if v.Message == "" {
			t.Errorf("violation %s has no message", v.Kind)
		}
	}
	if len(got) != len(want) {
		t.Fatalf("got %d violations, want %d: %v", len(got), len(want), got)
	}
	for i, w := range want {
		g := got[i]
		if g.Kind != w.Kind || deviceKey(g.Device) != deviceKey(w.Device) || g.Counter != w.Counter || g.Pool != w.Pool || g.Pod != w.Pod || !slices.Equal(g.Claims, w.Claims) {
			t.Errorf("violation %d: got %s %s %s %s pod %q claims %v, want %s %s %s %s pod %q claims %v",
				i, g.Kind, deviceKey(g.Device), g.Counter, g.Pool, g.Pod, g.Claims, w.Kind, deviceKey(w.Device), w.Counter, w.Pool, w.Pod, w.Claims)
		}
	}
}

func TestRunReportsUnreadableCluster(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := Run(context.Background(), []string{"--kubeconfig", t.TempDir() + "/missing"}, &stdout, &stderr)
	if code != ExitError {
		t.Errorf("exit code %d, want %d (stderr %q)", code, ExitError, stderr.String())
	}
	if stderr.Len() == 0 {
		t.Error("no reason on stderr")
	}
	if code := Run(context.Background(), []string{"-o", "yaml"}, &stdout, &stderr); code != ExitError {
		t.Errorf("bad --output: exit code %d, want %d", code, ExitError)
	}
}

// TestRunRejectsBadCommandLine: a wrong flag or a positional argument exits
// with ExitError before the cluster is read, and says why on stderr (a
// positional argument would otherwise check $KUBECONFIG's cluster instead
// of the file named).
func TestRunRejectsBadCommandLine(t *testing.T) {
	// $KUBECONFIG names a missing file: reading the cluster fails with
	// another message, so the messages below come from the command line
	// alone, and no test reaches a real cluster.
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	t.Setenv("KUBECONFIG", kubeconfig)
	tests := map[string]struct {
		args []string
		want []string
	}{
		"unknown flag":               {args: []string{"--kubeconfg", "x"}, want: []string{"unknown flag: --kubeconfg", "--help"}},
		"flag without value":         {args: []string{"--context"}, want: []string{"--context", "--help"}},
		"positional argument":        {args: []string{"other.yaml"}, want: []string{`"other.yaml"`, "--kubeconfig other.yaml"}},
		"argument after flag":        {args: []string{"-o", "json", "other.yaml"}, want: []string{"--kubeconfig other.yaml"}},
		"one read":                   {args: []string{"--reads", "1"}, want: []string{"--reads must be at least 2", "not 1"}},
		"no interval":                {args: []string{"--interval", "0s"}, want: []string{"--interval must be more than 0", "not 0s"}},
		"negative stale-after":       {args: []string{"--stale-after", "-1m"}, want: []string{"--stale-after must not be negative", "not -1m0s"}},
		"negative unpublished-after": {args: []string{"--unpublished-after", "-1m"}, want: []string{"--unpublished-after must not be negative", "not -1m0s"}},
		"interval not a time":        {args: []string{"--interval", "5"}, want: []string{"--interval", "--help"}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := Run(context.Background(), tc.args, &stdout, &stderr)
			if code != ExitError {
				t.Errorf("exit code %d, want %d", code, ExitError)
			}
			for _, w := range tc.want {
				if !strings.Contains(stderr.String(), w) {
					t.Errorf("stderr %q does not contain %q", stderr.String(), w)
				}
			}
			if stdout.Len() > 0 {
				t.Errorf("stdout %q, want nothing", stdout.String())
			}
		})
	}
}

func TestWriteJSON(t *testing.T) {
	var out bytes.Buffer
	if err := write(&out, "json", nil, nil, true); err != nil {
		t.Fatal(err)
	}
	var got []Violation
	if err := json.Unmarshal(out.Bytes(), &got); err != nil || got == nil || len(got) != 0 {
		t.Errorf("no violations as JSON: %q (%v), want []", out.String(), err)
	}
}

// Creation times of gpuClass and of the claims of claim(): the class
// predates the claims, so its selectors are judged.
var (
	classCreated = metav1.NewTime(time.Date(2020, 1, 1, 0, 0, 0, 0, time.UTC))
	claimCreated = metav1.NewTime(time.Date(2021, 1, 1, 0, 0, 0, 0, time.UTC))
)

// deviceClass returns a class created at classCreated with the selectors.
func deviceClass(name string, selectors ...string) *resourceapi.DeviceClass {
	c := &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: name, CreationTimestamp: classCreated}}
	for _, s := range selectors {
		c.Spec.Selectors = append(c.Spec.Selectors, resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: s}})
	}
	return c
}

// gpuClass is the class "gpu" of the claims of claim(), which every
// device of driver matches.
func gpuClass() *resourceapi.DeviceClass {
	return deviceClass("gpu", `device.driver == "`+driver+`"`)
}

// gpu returns a device with a type and a clique attribute; a clique that
// is not a string is published as an int.
func gpu(name, typ string, clique any) resourceapi.Device {
	d := resourceapi.Device{Name: name, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		"type": {StringValue: ptr.To(typ)},
	}}
	switch c := clique.(type) {
	case string:
		d.Attributes[driver+"/clique"] = resourceapi.DeviceAttribute{StringValue: ptr.To(c)}
	case int:
		d.Attributes["clique"] = resourceapi.DeviceAttribute{IntValue: ptr.To(int64(c))}
	}
	return d
}

// withCapacity gives d the capacity name of amount.
func withCapacity(d resourceapi.Device, name, amount string) resourceapi.Device {
	if d.Capacity == nil {
		d.Capacity = map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{}
	}
	d.Capacity[resourceapi.QualifiedName(name)] = resourceapi.DeviceCapacity{Value: resource.MustParse(amount)}
	return d
}

// exactly is a request of class for count devices, with the selectors.
func exactly(name, class string, count int64, selectors ...string) resourceapi.DeviceRequest {
	r := resourceapi.DeviceRequest{Name: name, Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count}}
	for _, s := range selectors {
		r.Exactly.Selectors = append(r.Exactly.Selectors, resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: s}})
	}
	return r
}

// sameClique is a matchAttribute constraint on the clique attribute over
// the requests (all if none).
func sameClique(requests ...string) resourceapi.DeviceConstraint {
	return resourceapi.DeviceConstraint{Requests: requests, MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(driver + "/clique"))}
}

// specClaim returns claim name with the requests and constraints,
// allocated the devices of pool "node-c" as "request=device" pairs.
func specClaim(name string, requests []resourceapi.DeviceRequest, constraints []resourceapi.DeviceConstraint, results ...string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, UID: types.UID(name + "-uid"), CreationTimestamp: claimCreated}}
	c.Spec.Devices.Requests = requests
	c.Spec.Devices.Constraints = constraints
	c.Status.Allocation = &resourceapi.AllocationResult{}
	for _, r := range results {
		request, device, _ := strings.Cut(r, "=")
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results, resourceapi.DeviceRequestAllocationResult{Request: request, Driver: driver, Pool: "node-c", Device: device})
	}
	return c
}

// TestAllocationMismatch: an allocation is judged against its claim's
// spec (requests, counts, class and request selectors, matchAttribute and
// distinctAttribute constraints) as the upstream allocator allocates; what cannot be judged
// is no violation.
func TestAllocationMismatch(t *testing.T) {
	nodeC := slice("node-c", 1,
		gpu("gpu-0", "gpu", "a"), gpu("gpu-1", "gpu", "a"), gpu("gpu-2", "gpu", "b"),
		gpu("gpu-3", "gpu", 1), gpu("gpu-4", "gpu", 1), gpu("gpu-5", "gpu", "1"),
		gpu("cpu-0", "cpu", "a"), gpu("gpu-6", "gpu", nil), withCapacity(gpu("gpu-7", "gpu", "c"), "memory", "40Gi"),
		func() resourceapi.Device {
			d := withCapacity(gpu("link-0", "gpu", "c"), "bandwidth", "10")
			d.AllowMultipleAllocations = ptr.To(true)
			return d
		}())
	typed := deviceClass("typed", `device.attributes["`+driver+`"].type == "gpu"`)
	classes := []*resourceapi.DeviceClass{gpuClass(), typed}
	two := []resourceapi.DeviceRequest{exactly("gpus", "gpu", 2)}
	cliques := []resourceapi.DeviceConstraint{sameClique()}
	distinctCliques := []resourceapi.DeviceConstraint{{DistinctAttribute: ptr.To(resourceapi.FullyQualifiedName(driver + "/clique"))}}
	firstAvailable := []resourceapi.DeviceRequest{{Name: "r", FirstAvailable: []resourceapi.DeviceSubRequest{
		{Name: "big", DeviceClassName: "gpu", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 2},
		{Name: "small", DeviceClassName: "gpu", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
	}}}
	mismatch := func(claim string) Violation {
		return Violation{Kind: AllocationMismatch, Claims: []string{"ns/" + claim}}
	}
	// asking is one request for a GPU with capacity name: amount.
	asking := func(name, amount string) []resourceapi.DeviceRequest {
		r := exactly("gpus", "gpu", 1)
		r.Exactly.Capacity = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{resourceapi.QualifiedName(name): resource.MustParse(amount)}}
		return []resourceapi.DeviceRequest{r}
	}
	// share is claim c allocated a share of link-0 that records consumed
	// of its bandwidth (none where empty).
	share := func(c *resourceapi.ResourceClaim, consumed string) *resourceapi.ResourceClaim {
		r := &c.Status.Allocation.Devices.Results[0]
		r.ShareID = ptr.To(types.UID("share-1"))
		if consumed != "" {
			r.ConsumedCapacity = map[resourceapi.QualifiedName]resource.Quantity{"bandwidth": resource.MustParse(consumed)}
		}
		return c
	}
	// derivedClique is two GPUs whose request derives the clique
	// attribute that the constraint names.
	derivedClique := func() []resourceapi.DeviceRequest {
		r := slices.Clone(two)
		r[0].Exactly = r[0].Exactly.DeepCopy()
		r[0].Exactly.DerivedAttributes = []resourceapi.DeviceDerivedAttribute{{Name: driver + "/clique", Expression: `"same"`}}
		return r
	}
	tests := map[string]struct {
		claims  []*resourceapi.ResourceClaim
		classes []*resourceapi.DeviceClass
		want    []Violation
		// wantIn are words the message of the only violation has.
		wantIn []string
		// wantNote are words of the only note of what was not judged.
		wantNote string
	}{
		"same clique": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", two, cliques, "gpus=gpu-0", "gpus=gpu-1")},
		},
		"two cliques under matchAttribute": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", two, cliques, "gpus=gpu-0", "gpus=gpu-2")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{"constraint #0 matchAttribute " + driver + "/clique", `has string "a"`, `has string "b"`},
		},
		"same clique, published without the domain": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", two, cliques, "gpus=gpu-3", "gpus=gpu-4")},
		},
		"same value, another type": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", two, cliques, "gpus=gpu-3", "gpus=gpu-5")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{"has int 1", `has string "1"`},
		},
		"a device without the attribute": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", two, cliques, "gpus=gpu-0", "gpus=gpu-6")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{"gpu-6 does not have the attribute"},
		},
		"a constraint on other requests": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", append(slices.Clone(two), exactly("other", "gpu", 1)), []resourceapi.DeviceConstraint{sameClique("other")}, "gpus=gpu-0", "gpus=gpu-2", "other=gpu-1")},
		},
		"three devices for a count of two": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", two, nil, "gpus=gpu-0", "gpus=gpu-1", "gpus=gpu-2")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{`request "gpus" has 3 devices, want its count 2`},
		},
		"a device for a request the spec does not have": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", two, nil, "gpus=gpu-0", "gpus=gpu-1", "extra=gpu-2")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{`request "extra", which the spec does not have`},
		},
		"a device the class does not select": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", []resourceapi.DeviceRequest{exactly("gpus", "typed", 2)}, nil, "gpus=gpu-0", "gpus=cpu-0")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{"cpu-0 does not match selector #0 of DeviceClass typed"},
		},
		"a device the class does not select, with admin access": {
			claims: []*resourceapi.ResourceClaim{adminAccess(specClaim("c", []resourceapi.DeviceRequest{exactly("gpus", "typed", 1)}, nil, "gpus=cpu-0"))},
			want:   []Violation{mismatch("c")},
		},
		"a device the request does not select": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", []resourceapi.DeviceRequest{exactly("gpus", "gpu", 1, `device.attributes["`+driver+`"].clique == "b"`)}, nil, "gpus=gpu-0")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{`does not match selector #0 of request "gpus"`},
		},
		"a class changed since the claim was created": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", []resourceapi.DeviceRequest{exactly("gpus", "typed", 1)}, nil, "gpus=cpu-0")},
			classes: []*resourceapi.DeviceClass{gpuClass(), func() *resourceapi.DeviceClass {
				c := typed.DeepCopy()
				c.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "kubectl", Time: ptr.To(metav1.NewTime(claimCreated.Add(time.Hour)))}}
				return c
			}()},
			wantNote: "for ns/c: DeviceClass typed was changed after the claim was created",
		},
		"a missing class": {
			claims:   []*resourceapi.ResourceClaim{specClaim("c", []resourceapi.DeviceRequest{exactly("gpus", "deleted", 1)}, nil, "gpus=cpu-0")},
			wantNote: "DeviceClass deleted does not exist",
		},
		"a selector that fails to evaluate": {
			claims:   []*resourceapi.ResourceClaim{specClaim("c", []resourceapi.DeviceRequest{exactly("gpus", "gpu", 1, `device.attributes["`+driver+`"].missing == "x"`)}, nil, "gpus=gpu-0")},
			wantNote: `selector #0 of request "gpus" fails on device ` + driver + "/node-c/gpu-0",
		},
		"a selector that does not compile": {
			claims:   []*resourceapi.ResourceClaim{specClaim("c", []resourceapi.DeviceRequest{exactly("gpus", "gpu", 1, `device.nosuchfield`)}, nil, "gpus=gpu-0")},
			wantNote: `selector #0 of request "gpus" does not compile here`,
		},
		"a device of a pool without slices": {
			claims: []*resourceapi.ResourceClaim{func() *resourceapi.ResourceClaim {
				c := specClaim("c", two, nil, "gpus=gpu-0")
				c.Status.Allocation.Devices.Results[0].Pool = "node-gone"
				return c
			}()},
			want: []Violation{{Kind: UnpublishedPool, Pool: driver + "/node-gone", Claims: []string{"ns/c"}}},
		},
		"first available, one subrequest": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", firstAvailable, nil, "r/small=gpu-0")},
		},
		"first available, a subrequest short of its count": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", firstAvailable, nil, "r/big=gpu-0")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{`request "r/big" has 1 devices, want its count 2`},
		},
		"first available, two subrequests": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", firstAvailable, nil, "r/big=gpu-0", "r/big=gpu-1", "r/small=gpu-2")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{`request "r" has devices of 2 of its subrequests`},
		},
		"distinct cliques under distinctAttribute": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", two, distinctCliques, "gpus=gpu-0", "gpus=gpu-2")},
		},
		"one clique twice under distinctAttribute": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", two, distinctCliques, "gpus=gpu-0", "gpus=gpu-1")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{"constraint #0 distinctAttribute " + driver + "/clique", "gpu-0 and " + driver + "/node-c/gpu-1 both have string \"a\""},
		},
		"the same value of two types under distinctAttribute": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", two, distinctCliques, "gpus=gpu-3", "gpus=gpu-5")},
		},
		"a device without the attribute under distinctAttribute": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", two, distinctCliques, "gpus=gpu-0", "gpus=gpu-6")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{"distinctAttribute", "gpu-6 does not have the attribute"},
		},
		"capacity the device has": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", asking("memory", "40Gi"), nil, "gpus=gpu-7")},
		},
		"more capacity than the device has": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", asking("memory", "80Gi"), nil, "gpus=gpu-7")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{"gpu-7 has 40Gi of capacity memory, request \"gpus\" asks for 80Gi"},
		},
		"a capacity the device does not have": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", asking("memory", "1Gi"), nil, "gpus=gpu-0")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{"gpu-0 has no capacity memory"},
		},
		"a share that records what it asks": {
			claims: []*resourceapi.ResourceClaim{share(specClaim("c", asking("bandwidth", "4"), nil, "gpus=link-0"), "4")},
		},
		"a share that records less than it asks": {
			claims: []*resourceapi.ResourceClaim{share(specClaim("c", asking("bandwidth", "4"), nil, "gpus=link-0"), "2")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{"the share share-1 of device " + driver + "/node-c/link-0 records 2 of capacity bandwidth consumed, request \"gpus\" asks for 4"},
		},
		"a share that records nothing of what it asks": {
			claims: []*resourceapi.ResourceClaim{share(specClaim("c", asking("bandwidth", "4"), nil, "gpus=link-0"), "")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{"records none of capacity bandwidth"},
		},
		"a constraint on an attribute the request derives": {
			claims:   []*resourceapi.ResourceClaim{specClaim("c", derivedClique(), cliques, "gpus=gpu-0", "gpus=gpu-2")},
			wantNote: "constraint #0 is on " + driver + "/clique, which a request derives",
		},
		"first available under a constraint on the parent": {
			claims: []*resourceapi.ResourceClaim{specClaim("c", firstAvailable, []resourceapi.DeviceConstraint{sameClique("r")}, "r/big=gpu-0", "r/big=gpu-2")},
			want:   []Violation{mismatch("c")},
			wantIn: []string{"matchAttribute"},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			state := State{Slices: []*resourceapi.ResourceSlice{nodeC}, Claims: tc.claims, DeviceClasses: classes}
			if tc.classes != nil {
				state.DeviceClasses = tc.classes
			}
			got := Find(state)
			expectViolations(t, got, tc.want)
			_, notes := find(newJudge(context.Background()), state)
			t.Logf("not judged: %q", notes)
			switch {
			case tc.wantNote == "" && len(notes) > 0:
				t.Errorf("not judged: %q, want all judged", notes)
			case tc.wantNote != "" && (len(notes) != 1 || !strings.Contains(notes[0], tc.wantNote)):
				t.Errorf("not judged: %q, want one note with %q", notes, tc.wantNote)
			}
			for _, w := range tc.wantIn {
				if len(got) != 1 || !strings.Contains(got[0].Message, w) {
					t.Errorf("message does not contain %q", w)
				}
			}
		})
	}
}

// TestAdminAccessItsRequestAsksFor: a result with admin access leaves its
// device to other claims only where its request asks for admin access; one
// whose request does not (a plain request, or a subrequest of a
// firstAvailable request, which cannot ask) is an AllocationMismatch and
// an exclusive use of the device for the device kinds.
func TestAdminAccessItsRequestAsksFor(t *testing.T) {
	nodeA := slice("node-a", 1, devices("gpu-0", "gpu-1")...)
	pool := partitioned("node-p", 1)
	gpu0 := &Device{driver, "node-a", "gpu-0"}
	// unasked is claim name with its results marked admin access, which
	// its plain request does not ask for.
	unasked := func(c *resourceapi.ResourceClaim) *resourceapi.ResourceClaim {
		for i := range c.Status.Allocation.Devices.Results {
			c.Status.Allocation.Devices.Results[i].AdminAccess = ptr.To(true)
		}
		return c
	}
	// subrequest is claim name allocated gpu-0 of node-a with admin
	// access for a subrequest of a firstAvailable request.
	subrequest := func(name string) *resourceapi.ResourceClaim {
		c := claim(name, "node-a", "", "gpu-0")
		c.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "req", FirstAvailable: []resourceapi.DeviceSubRequest{
			{Name: "one", DeviceClassName: "gpu", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
		}}}
		c.Status.Allocation.Devices.Results[0].Request = "req/one"
		return unasked(c)
	}
	tests := map[string]struct {
		state State
		want  []Violation
		// wantIn are words of the message of the AllocationMismatch.
		wantIn []string
	}{
		"admin access its request asks for, beside a running pod": {
			state: State{Slices: []*resourceapi.ResourceSlice{nodeA}, Claims: []*resourceapi.ResourceClaim{
				claim("a", "node-a", "uid-a", "gpu-0"), adminAccess(claim("b", "node-a", "uid-b", "gpu-0")),
			}, Pods: []*v1.Pod{pod("pa", "uid-a", "node-a", "a"), pod("pb", "uid-b", "node-a", "b")}},
		},
		"admin access its request does not ask for, beside a running pod": {
			state: State{Slices: []*resourceapi.ResourceSlice{nodeA}, Claims: []*resourceapi.ResourceClaim{
				claim("a", "node-a", "uid-a", "gpu-0"), unasked(claim("b", "node-a", "uid-b", "gpu-0")),
			}, Pods: []*v1.Pod{pod("pa", "uid-a", "node-a", "a"), pod("pb", "uid-b", "node-a", "b")}},
			want: []Violation{
				{Kind: AllocationMismatch, Claims: []string{"ns/b"}},
				{Kind: DoubleAllocation, Device: gpu0, Claims: []string{"ns/a", "ns/b"}},
			},
			wantIn: []string{"device " + driver + `/node-a/gpu-0 is allocated with admin access for request "req", which does not ask for admin access`, "exclusive use"},
		},
		"admin access its request does not ask for, alone": {
			state: State{Slices: []*resourceapi.ResourceSlice{nodeA}, Claims: []*resourceapi.ResourceClaim{unasked(claim("b", "node-a", "", "gpu-0"))}},
			want:  []Violation{{Kind: AllocationMismatch, Claims: []string{"ns/b"}}},
		},
		"admin access for a subrequest": {
			state: State{Slices: []*resourceapi.ResourceSlice{nodeA}, Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-0"), subrequest("b")}},
			want: []Violation{
				{Kind: AllocationMismatch, Claims: []string{"ns/b"}},
				{Kind: DoubleAllocation, Device: gpu0, Claims: []string{"ns/a", "ns/b"}},
			},
			wantIn: []string{`request "req/one", which does not ask for admin access`},
		},
		"admin access its request does not ask for consumes counters": {
			state: State{Slices: []*resourceapi.ResourceSlice{pool}, Claims: []*resourceapi.ResourceClaim{
				claim("a", "node-p", "", "gpu-0-1g-0"), unasked(claim("admin", "node-p", "", "gpu-0")),
			}},
			want: []Violation{
				{Kind: AllocationMismatch, Claims: []string{"ns/admin"}},
				{Kind: CounterExceeded, Counter: driver + "/node-p/gpu-0/memory", Claims: []string{"ns/a", "ns/admin"}},
				{Kind: CounterExceeded, Counter: driver + "/node-p/gpu-0/slices", Claims: []string{"ns/a", "ns/admin"}},
			},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			tc.state.DeviceClasses = []*resourceapi.DeviceClass{gpuClass()}
			got := Find(tc.state)
			expectViolations(t, got, tc.want)
			for _, w := range tc.wantIn {
				if len(got) == 0 || got[0].Kind != AllocationMismatch || !strings.Contains(got[0].Message, w) {
					t.Errorf("AllocationMismatch message does not contain %q", w)
				}
			}
		})
	}
}

// TestAllocationMismatchAfterSliceChange: devices are judged as published
// now. A mismatch that rests on the attributes or capacity of a device
// whose ResourceSlice changed after the devices were chosen (no earlier
// than AllocationLag before the allocation's timestamp, or than the
// claim's creation where the allocation records no time) is still an
// AllocationMismatch, whose message names the change and where to look; a
// mismatch on a slice that did not change since, or one that rests on the
// allocation and the spec alone, is worded as always.
func TestAllocationMismatchAfterSliceChange(t *testing.T) {
	// nodeC publishes gpu-1 in another clique than gpu-0 (an NVLink
	// failed), gpu-2 in none (its clique split up), gpu-3 with less
	// memory than its request asks; it was created at created and
	// changed at changed (no change where zero).
	nodeC := func(created, changed time.Time) *resourceapi.ResourceSlice {
		s := slice("node-c", 2, gpu("gpu-0", "gpu", "a"), gpu("gpu-1", "gpu", "b"), gpu("gpu-2", "gpu", nil), withCapacity(gpu("gpu-3", "gpu", "a"), "memory", "20Gi"))
		s.CreationTimestamp = metav1.NewTime(created)
		if !changed.IsZero() {
			s.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "topodra-node-agent", Operation: metav1.ManagedFieldsOperationUpdate, Time: ptr.To(metav1.NewTime(changed))}}
		}
		return s
	}
	two := []resourceapi.DeviceRequest{exactly("gpus", "gpu", 2)}
	cliques := []resourceapi.DeviceConstraint{sameClique()}
	memory := exactly("mem", "gpu", 1)
	memory.Exactly.Capacity = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{"memory": resource.MustParse("40Gi")}}
	// allocated is c allocated at allocatedAt, reserved for a running pod.
	allocated := func(c *resourceapi.ResourceClaim) *resourceapi.ResourceClaim {
		c.Status.Allocation.AllocationTimestamp = &metav1.Time{Time: allocatedAt}
		c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: "p", UID: "uid-p"}}
		return c
	}
	before := allocatedAt.Add(-time.Hour)
	after := allocatedAt.Add(time.Hour)
	// explained are words of a message whose every mismatch rests on a
	// slice changed since.
	explained := []string{"(ResourceSlice node-c-slice changed at " + after.Format(time.RFC3339) + ")",
		"every one of these rests on a device whose ResourceSlice changed after the devices were chosen",
		"nvlinkClique", "look first for a change to them"}
	tests := map[string]struct {
		slice *resourceapi.ResourceSlice
		claim *resourceapi.ResourceClaim
		// wantIn are words of the message; wantNotIn words it lacks.
		wantIn, wantNotIn []string
	}{
		"matchAttribute broken by a slice changed after the allocation": {
			slice:  nodeC(before, after),
			claim:  allocated(specClaim("c", two, cliques, "gpus=gpu-0", "gpus=gpu-1")),
			wantIn: append([]string{`device ` + driver + `/node-c/gpu-0 has string "a", device ` + driver + `/node-c/gpu-1 has string "b"`}, explained...),
		},
		"an attribute dropped by a slice recreated after the allocation": {
			slice:  nodeC(after, time.Time{}),
			claim:  allocated(specClaim("c", two, cliques, "gpus=gpu-0", "gpus=gpu-2")),
			wantIn: append([]string{"gpu-2 does not have the attribute"}, explained...),
		},
		"a selector unmatched after the slice changed": {
			slice:  nodeC(before, after),
			claim:  allocated(specClaim("c", []resourceapi.DeviceRequest{exactly("gpus", "gpu", 1, `device.attributes["`+driver+`"].clique == "a"`)}, nil, "gpus=gpu-1")),
			wantIn: explained,
		},
		"capacity short after the slice changed": {
			slice:  nodeC(before, after),
			claim:  allocated(specClaim("c", []resourceapi.DeviceRequest{memory}, nil, "mem=gpu-3")),
			wantIn: append([]string{"gpu-3 has 20Gi of capacity memory"}, explained...),
		},
		"a slice changed within the allocation lag before the timestamp": {
			slice:  nodeC(before, allocatedAt.Add(-AllocationLag/2)),
			claim:  allocated(specClaim("c", two, cliques, "gpus=gpu-0", "gpus=gpu-1")),
			wantIn: []string{"every one of these rests on a device whose ResourceSlice changed", "at most 30m0s before the allocation's timestamp " + allocatedAt.Format(time.RFC3339)},
		},
		"an allocation without a timestamp, the slice changed after the claim was created": {
			slice: nodeC(claimCreated.Add(-time.Hour), claimCreated.Add(time.Hour)),
			claim: func() *resourceapi.ResourceClaim {
				c := allocated(specClaim("c", two, cliques, "gpus=gpu-0", "gpus=gpu-1"))
				c.Status.Allocation.AllocationTimestamp = nil
				return c
			}(),
			wantIn: []string{"every one of these rests on a device whose ResourceSlice changed", "the allocation records no time; the claim was created at " + claimCreated.UTC().Format(time.RFC3339)},
		},
		"matchAttribute broken on a slice unchanged since the allocation": {
			slice:     nodeC(before.Add(-time.Hour), before),
			claim:     allocated(specClaim("c", two, cliques, "gpus=gpu-0", "gpus=gpu-1")),
			wantIn:    []string{`has string "a"`},
			wantNotIn: []string{"ResourceSlice", "nvlinkClique"},
		},
		"a slice that records no time": {
			slice:     nodeC(time.Time{}, time.Time{}),
			claim:     allocated(specClaim("c", two, cliques, "gpus=gpu-0", "gpus=gpu-1")),
			wantNotIn: []string{"ResourceSlice", "nvlinkClique"},
		},
		"a count mismatch beside a slice changed after the allocation": {
			slice:     nodeC(before, after),
			claim:     allocated(specClaim("c", two, nil, "gpus=gpu-0", "gpus=gpu-1", "gpus=gpu-2")),
			wantIn:    []string{`request "gpus" has 3 devices, want its count 2`},
			wantNotIn: []string{"ResourceSlice", "nvlinkClique"},
		},
		"a count mismatch and a changed attribute": {
			slice:     nodeC(before, after),
			claim:     allocated(specClaim("c", []resourceapi.DeviceRequest{exactly("gpus", "gpu", 3)}, cliques, "gpus=gpu-0", "gpus=gpu-1")),
			wantIn:    []string{`has 2 devices, want its count 3; constraint #0`, `has string "b" (ResourceSlice node-c-slice changed at`, "1 of these 2 (those that name a ResourceSlice) rest on devices whose ResourceSlice changed after the devices were chosen", "the others cannot"},
			wantNotIn: []string{"every one of these", "report the allocation only where"},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			state := State{Slices: []*resourceapi.ResourceSlice{tc.slice}, Claims: []*resourceapi.ResourceClaim{tc.claim},
				Pods: []*v1.Pod{pod("p", "uid-p", "node-c", "c")}, DeviceClasses: []*resourceapi.DeviceClass{gpuClass()}}
			got := Find(state)
			expectViolations(t, got, []Violation{{Kind: AllocationMismatch, Claims: []string{"ns/c"}}})
			for _, w := range tc.wantIn {
				if len(got) != 1 || !strings.Contains(got[0].Message, w) {
					t.Errorf("message does not contain %q", w)
				}
			}
			for _, w := range tc.wantNotIn {
				if len(got) == 1 && strings.Contains(got[0].Message, w) {
					t.Errorf("message contains %q", w)
				}
			}
			// It still needs a human: topodra-check fails, and says the
			// same of the slices it reads.
			var stdout, stderr bytes.Buffer
			if code := check(context.Background(), newFakeCluster(fakeRead{state: state}), CheckOptions{Interval: time.Millisecond}, "text", &stdout, &stderr); code != ExitViolations {
				t.Errorf("topodra-check: exit %d, want %d; stdout %q", code, ExitViolations, stdout.String())
			}
			for _, w := range tc.wantIn {
				if !strings.Contains(stdout.String(), w) {
					t.Errorf("topodra-check's output does not contain %q", w)
				}
			}
		})
	}
}

// rack selects the nodes labelled rack=name.
func rack(name string) *v1.NodeSelector {
	return &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{{Key: "rack", Operator: v1.NodeSelectorOpIn, Values: []string{name}}}}}}
}
