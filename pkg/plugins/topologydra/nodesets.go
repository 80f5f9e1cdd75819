package topologydra

import (
	"hash/maphash"
	"sync"

	"k8s.io/apimachinery/pkg/util/sets"
)

// nodeSets interns the sets of node names that PreFilter records for a
// pending pod until its next attempt (pendingPod.unfit, and heldBack's
// nodes on which a narrow headroom's requests match nothing). Those sets
// depend on the pod's requests and the nodes' devices, not on what is
// allocated, so the pods of one workload get equal sets: on a large
// cluster with nodes their requests cannot use (nodes without GPUs,
// another GPU model), thousands of waiting pods would otherwise each hold
// a copy of thousands of names. It remembers the recentNodeSets sets it
// returned last; a set it returns is shared and must not be changed.
// The zero value is ready; safe for concurrent use.
type nodeSets struct {
	mu sync.Mutex
	// recent holds the sets returned last, the most recent last.
	recent []internedNodes
}

// internedNodes is a set with its size and sum (nodeSetSum).
type internedNodes struct {
	len int
	sum uint64
	set sets.Set[string]
}

// recentNodeSets is how many distinct sets nodeSets remembers: a few
// workloads waiting at once, each with its own requests.
const recentNodeSets = 16

// nodeSetSeed seeds nodeSetSum for the life of the process.
var nodeSetSeed = maphash.MakeSeed()

// nodeSetSum sums the hashes of the names: equal sets have equal sums,
// whatever the order their names are visited in.
func nodeSetSum(s sets.Set[string]) uint64 {
	var sum uint64
	for name := range s {
		sum += maphash.String(nodeSetSeed, name)
	}
	return sum
}

// intern returns a set equal to s that it returned before, where it
// remembers one, and otherwise s, which it then remembers (nil stays
// nil). The caller must not change s afterwards.
func (n *nodeSets) intern(s sets.Set[string]) sets.Set[string] {
	if s == nil {
		return nil
	}
	e := internedNodes{len: s.Len(), sum: nodeSetSum(s), set: s}
	n.mu.Lock()
	defer n.mu.Unlock()
	for i := len(n.recent) - 1; i >= 0; i-- {
		r := n.recent[i]
		if r.len == e.len && r.sum == e.sum && r.set.Equal(s) {
			// The most recent last, so that sets in use stay.
			copy(n.recent[i:], n.recent[i+1:])
			n.recent[len(n.recent)-1] = r
			return r.set
		}
	}
	if len(n.recent) == recentNodeSets {
		copy(n.recent, n.recent[1:])
		n.recent = n.recent[:len(n.recent)-1]
	}
	n.recent = append(n.recent, e)
	return s
}
