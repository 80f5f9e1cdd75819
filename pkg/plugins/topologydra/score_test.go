package topologydra

import (
	"testing"

	"github.com/topodra/topodra/pkg/allocator"
	"github.com/topodra/topodra/pkg/plugins/topologydra/apis/config"
)

func TestPolicyScore(t *testing.T) {
	args := *DefaultArgs() // 50/35/15, MostAllocated, 3 levels
	score := policyFromArgs(args).Score
	two := []string{"a", "b"}
	tests := map[string]struct {
		q    allocator.Quality
		want int64
	}{
		"single device, empty node":           {q: allocator.Quality{Devices: []string{"a"}, Room: 0, Packing: 0}, want: 50},
		"single device, busy node, no break":  {q: allocator.Quality{Devices: []string{"a"}, Room: 1, Packing: 0.5}, want: 93},
		"single device, full node":            {q: allocator.Quality{Devices: []string{"a"}, Room: 1, Packing: 1}, want: 100},
		"pair sharing every domain fully":     {q: allocator.Quality{Devices: two, Level: 1, Tightness: 1, Room: 1, Packing: 0}, want: 85},
		"pair in a domain of eight":           {q: allocator.Quality{Devices: two, Level: 0, Tightness: 0.25, Room: 1, Packing: 0}, want: 48},
		"pair spanning two domains":           {q: allocator.Quality{Devices: two, Level: 3, DomainsSpanned: 2, Room: 1, Packing: 0}, want: 36},
		"pair spanning two domains, packed":   {q: allocator.Quality{Devices: two, Level: 3, DomainsSpanned: 2, Room: 1, Packing: 1}, want: 51},
		"pair breaking a whole node, aligned": {q: allocator.Quality{Devices: two, Level: 1, Tightness: 1, Room: 0, Packing: 0}, want: 50},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			if got := score(tc.q); got != tc.want {
				t.Errorf("score = %d, want %d", got, tc.want)
			}
		})
	}
	// Tighter always beats looser at equal packing, and more packed beats
	// less packed at equal alignment.
	if score(allocator.Quality{Devices: two, Level: 2, Tightness: 1, Packing: 0.5}) <= score(allocator.Quality{Devices: two, Level: 0, Tightness: 0.5, Packing: 0.5}) {
		t.Error("a domain the devices fill should beat a bigger one")
	}
	args.ScoringStrategy = config.LeastAllocated
	spread := policyFromArgs(args).Score
	if spread(allocator.Quality{Devices: two, Tightness: 1, Packing: 0.2}) <= spread(allocator.Quality{Devices: two, Tightness: 1, Packing: 0.8}) {
		t.Error("LeastAllocated should prefer the emptier node")
	}
}

func TestScoreIsProportional(t *testing.T) {
	if ext := (&TopologyDRA{}).ScoreExtensions(); ext != nil {
		t.Error("scores must not be normalised: a stretched 1-point difference would override users' preferred affinities")
	}
}
