package topologydra

import (
	"errors"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/allocator"
	"github.com/topodra/topodra/pkg/plugins/topologydra/apis/config"
	"github.com/topodra/topodra/pkg/topology"
)

func TestPolicyScore(t *testing.T) {
	args := *DefaultArgs() // room 70 / packing 30, MostAllocated, 3 levels: bands of 25
	args.WholeNodeTrade = 1
	args.AgeWeight = 0 // the table leaves age out (TestSettlednessAndDrainingByAge)
	score := policyFromArgs(args).Score
	one, two := []string{"a"}, []string{"a", "b"}
	tests := map[string]struct {
		q    allocator.Quality
		want int64
	}{
		"single device, empty node":              {q: allocator.Quality{Devices: one, Shared: 3, BreaksNode: true, Room: 0, Packing: 0.06}, want: 50},
		"single device, busy node, no break":     {q: allocator.Quality{Devices: one, Shared: 3, Room: 1, Packing: 0.5}, want: 95},
		"single device, fills the node":          {q: allocator.Quality{Devices: one, Shared: 3, Room: 1, Packing: 1}, want: 99},
		"root pair breaking a whole node":        {q: allocator.Quality{Devices: two, Shared: 3, BreaksNode: true, Room: 0, Packing: 0.2}, want: 51},
		"pair in one NUMA node of a busy node":   {q: allocator.Quality{Devices: two, Shared: 2, Room: 1, Packing: 0.5}, want: 70},
		"four in a free NUMA node of a busy one": {q: allocator.Quality{Devices: two, Shared: 2, Room: 0.6, Packing: 0.75}, want: 65},
		"four spanning NUMA nodes in a clique":   {q: allocator.Quality{Devices: two, Shared: 1, Room: 1, Packing: 1}, want: 49},
		"sharing no domain, packed":              {q: allocator.Quality{Devices: two, Shared: 0, Room: 1, Packing: 1}, want: 24},
		"clique only, breaking a whole node":     {q: allocator.Quality{Devices: two, Shared: 1, BreaksNode: true, Room: 0, Packing: 0}, want: 25},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			if got := score(tc.q); got != tc.want {
				t.Errorf("score = %d, want %d", got, tc.want)
			}
		})
	}
	// Alignment is lexicographically first: the best room and packing of a
	// looser placement lose to the worst of a tighter one.
	for shared := 1; shared <= 3; shared++ {
		worst := allocator.Quality{Devices: two, Shared: shared, Room: 0, Packing: 0}
		best := allocator.Quality{Devices: two, Shared: shared - 1, Room: 1, Packing: 1}
		if score(worst) <= score(best) {
			t.Errorf("rank %d at worst (%d) should beat rank %d at best (%d)", shared, score(worst), shared-1, score(best))
		}
	}
	// Breaking a whole free node costs one rank: a looser placement on a
	// busy node wins; with no trade, the tighter one keeps winning.
	tight := allocator.Quality{Devices: two, Shared: 2, BreaksNode: true, Room: 0, Packing: 0.25}
	loose := allocator.Quality{Devices: two, Shared: 1, Room: 0.6, Packing: 0.5}
	if score(tight) >= score(loose) {
		t.Errorf("trade 1: breaking a whole node (%d) should lose to one rank looser on a busy node (%d)", score(tight), score(loose))
	}
	args.WholeNodeTrade = 0
	if strict := policyFromArgs(args).Score; strict(tight) <= strict(loose) {
		t.Errorf("trade 0: the tighter placement (%d) should win (%d)", strict(tight), strict(loose))
	}
	args.ScoringStrategy = config.LeastAllocated
	spread := policyFromArgs(args).Score
	if spread(allocator.Quality{Devices: two, Shared: 3, Packing: 0.2}) <= spread(allocator.Quality{Devices: two, Shared: 3, Packing: 0.8}) {
		t.Error("LeastAllocated should prefer the emptier node")
	}
}

func TestScoreIsProportional(t *testing.T) {
	if ext := (&TopologyDRA{}).ScoreExtensions(); ext != nil {
		t.Error("scores must not be normalised: a stretched 1-point difference would override users' preferred affinities")
	}
}

// TestNICRootPairsWanted: only a pcieRoot matchAttribute over requests of
// two or more device classes (all requests where the constraint names
// none; firstAvailable subrequests count) turns nicRootTrade on.
func TestNICRootPairsWanted(t *testing.T) {
	root := ptr.To(resourceapi.FullyQualifiedName(topology.AttrPCIeRoot))
	numa := ptr.To(resourceapi.FullyQualifiedName(topology.AttrNUMANode))
	exact := func(name, class string) resourceapi.DeviceRequest {
		return resourceapi.DeviceRequest{Name: name, Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1}}
	}
	claim := func(constraints []resourceapi.DeviceConstraint, requests ...resourceapi.DeviceRequest) *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: requests, Constraints: constraints}}}
	}
	choice := resourceapi.DeviceRequest{Name: "gpu-or-nic", FirstAvailable: []resourceapi.DeviceSubRequest{
		{Name: "gpu", DeviceClassName: "gpu", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
		{Name: "nic", DeviceClassName: "nic", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
	}}
	for name, tc := range map[string]struct {
		claims []*resourceapi.ResourceClaim
		want   bool
	}{
		"none":                          {nil, false},
		"GPU and NIC, no constraint":    {[]*resourceapi.ResourceClaim{claim(nil, exact("gpu", "gpu"), exact("nic", "nic"))}, false},
		"GPU and NIC on one root":       {[]*resourceapi.ResourceClaim{claim([]resourceapi.DeviceConstraint{{MatchAttribute: root}}, exact("gpu", "gpu"), exact("nic", "nic"))}, true},
		"GPU and NIC on one NUMA node":  {[]*resourceapi.ResourceClaim{claim([]resourceapi.DeviceConstraint{{MatchAttribute: numa}}, exact("gpu", "gpu"), exact("nic", "nic"))}, false},
		"two GPUs on one root":          {[]*resourceapi.ResourceClaim{claim([]resourceapi.DeviceConstraint{{MatchAttribute: root}}, exact("a", "gpu"), exact("b", "gpu"))}, false},
		"root match over the GPUs only": {[]*resourceapi.ResourceClaim{claim([]resourceapi.DeviceConstraint{{MatchAttribute: root, Requests: []string{"a", "b"}}}, exact("a", "gpu"), exact("b", "gpu"), exact("nic", "nic"))}, false},
		"root match naming GPU and NIC": {[]*resourceapi.ResourceClaim{claim([]resourceapi.DeviceConstraint{{MatchAttribute: root, Requests: []string{"a", "nic"}}}, exact("a", "gpu"), exact("b", "gpu"), exact("nic", "nic"))}, true},
		"firstAvailable of two classes": {[]*resourceapi.ResourceClaim{claim([]resourceapi.DeviceConstraint{{MatchAttribute: root}}, choice)}, true},
	} {
		got := nicRootPairsWanted(func() ([]*resourceapi.ResourceClaim, error) { return tc.claims, nil })
		if got != tc.want {
			t.Errorf("%s: %v, want %v", name, got, tc.want)
		}
	}
	if nicRootPairsWanted(func() ([]*resourceapi.ResourceClaim, error) { return nil, errors.New("no cache") }) {
		t.Error("a list error turned the trade on")
	}
}
