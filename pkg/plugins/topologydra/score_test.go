package topologydra

import (
	"testing"

	fwk "k8s.io/kube-scheduler/framework"

	"github.com/topodra/topodra/pkg/allocator"
	"github.com/topodra/topodra/pkg/plugins/topologydra/apis/config"
)

func TestPolicyScore(t *testing.T) {
	args := *DefaultArgs() // 70/30, MostAllocated, 3 levels
	score := policyFromArgs(args).Score
	two := []string{"a", "b"}
	tests := map[string]struct {
		q    allocator.Quality
		want int64
	}{
		"single device, empty node":         {q: allocator.Quality{Devices: []string{"a"}, Packing: 0}, want: 70},
		"single device, full node":          {q: allocator.Quality{Devices: []string{"a"}, Packing: 1}, want: 100},
		"pair sharing every domain fully":   {q: allocator.Quality{Devices: two, Level: 1, Tightness: 1, Packing: 0}, want: 70},
		"pair in a domain of eight":         {q: allocator.Quality{Devices: two, Level: 0, Tightness: 0.25, Packing: 0}, want: 18},
		"pair spanning two domains":         {q: allocator.Quality{Devices: two, Level: 3, DomainsSpanned: 2, Packing: 0}, want: 2},
		"pair spanning two domains, packed": {q: allocator.Quality{Devices: two, Level: 3, DomainsSpanned: 2, Packing: 1}, want: 32},
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

func TestNormalizeScore(t *testing.T) {
	pl := &TopologyDRA{}
	tests := map[string]struct {
		in, want []int64
	}{
		"stretch":   {in: []int64{70, 71, 100}, want: []int64{0, 3, 100}},
		"all equal": {in: []int64{42, 42}, want: []int64{42, 42}},
		"empty":     {in: nil, want: nil},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var scores fwk.NodeScoreList
			for i, s := range tc.in {
				scores = append(scores, fwk.NodeScore{Name: string(rune('a' + i)), Score: s})
			}
			if st := pl.NormalizeScore(t.Context(), nil, nil, scores); st != nil {
				t.Fatal(st)
			}
			for i := range scores {
				if scores[i].Score != tc.want[i] {
					t.Errorf("node %d: %d, want %d", i, scores[i].Score, tc.want[i])
				}
			}
		})
	}
}
