package discovery

import (
	"crypto/sha256"
	"encoding/hex"
	"math/bits"
	"slices"
	"strings"
)

// Link is one active NVLink seen from a GPU.
type Link struct {
	// GPU is the canonical PCI bus id of the GPU that reports the link.
	GPU string
	// Remote is the canonical PCI bus id of the far end: another GPU, or
	// an NVSwitch (NVSwitchFabric where NVML says the far end is a switch).
	Remote string
	// RemoteIsGPU is set where NVML says the far end is a GPU: one that
	// is not published (it could not be read) joins nothing.
	RemoteIsGPU bool
}

// maxCliqueGPUs bounds the GPUs of one node that NVLinkCliques considers;
// machines have at most 16.
const maxCliqueGPUs = 64

// NVLinkCliques groups GPUs into cliques: sets in which every two GPUs are
// joined by an active NVLink, directly or through a switch both link to
// (the node's NVSwitch fabric, or an endpoint that is not a GPU). Where
// the GPUs that links join are not all joined pairwise (the hybrid cube
// mesh of a DGX-1 or a p3 instance, a chain of NVLink bridges), they are
// split: the largest clique first (between cliques of one size, the one
// of the smallest bus ids), then the largest among the GPUs left, and so
// on. A GPU in no clique of two or more gets no id. A link to a GPU that
// is not among gpus joins nothing.
//
// The id depends only on the member GPUs (a hash of their sorted bus ids),
// so it is stable across restarts and independent of NVML's enumeration
// order, and it changes when a link failure splits or shrinks a clique.
func NVLinkCliques(gpus []string, links []Link) map[string]string {
	sorted := slices.Sorted(slices.Values(gpus))
	sorted = slices.Compact(sorted)
	if len(sorted) > maxCliqueGPUs {
		sorted = sorted[:maxCliqueGPUs]
	}
	index := make(map[string]int, len(sorted))
	for i, gpu := range sorted {
		index[gpu] = i
	}
	// Direct links, and the GPUs behind each other endpoint.
	adj := make([]uint64, len(sorted))
	behind := map[string]uint64{}
	for _, link := range links {
		i, ok := index[link.GPU]
		if !ok || link.Remote == "" || link.Remote == link.GPU {
			continue
		}
		if j, ok := index[link.Remote]; ok {
			adj[i] |= 1 << j
			adj[j] |= 1 << i
			continue
		}
		if !link.RemoteIsGPU {
			behind[link.Remote] |= 1 << i
		}
	}
	for _, set := range behind {
		for rest := set; rest != 0; rest &= rest - 1 {
			i := bits.TrailingZeros64(rest)
			adj[i] |= set &^ (1 << i)
		}
	}

	cliques := map[string]string{}
	left := uint64(0)
	for i := range sorted {
		left |= 1 << i
	}
	for {
		best := largestClique(adj, left)
		if bits.OnesCount64(best) < 2 {
			return cliques
		}
		var members []string
		for rest := best; rest != 0; rest &= rest - 1 {
			members = append(members, sorted[bits.TrailingZeros64(rest)])
		}
		id := cliqueID(members)
		for _, gpu := range members {
			cliques[gpu] = id
		}
		left &^= best
	}
}

// largestClique returns the largest clique among the GPUs in left (a bit
// per GPU, by sorted bus id; adj the neighbours of each), by Bron-Kerbosch
// with pivoting; between cliques of one size, the one whose sorted members
// come first (the smallest bus ids).
func largestClique(adj []uint64, left uint64) uint64 {
	var best uint64
	better := func(c uint64) bool {
		nc, nb := bits.OnesCount64(c), bits.OnesCount64(best)
		if nc != nb {
			return nc > nb
		}
		// Same size: compare the members in order; the first that differs
		// decides, the lower bus id winning.
		diff := c ^ best
		low := diff & -diff
		return c&low != 0
	}
	var expand func(r, p, x uint64)
	expand = func(r, p, x uint64) {
		if p == 0 && x == 0 {
			if better(r) {
				best = r
			}
			return
		}
		if bits.OnesCount64(r)+bits.OnesCount64(p) < bits.OnesCount64(best) {
			return // cannot beat best
		}
		pivot := bits.TrailingZeros64(p | x)
		for cand := p &^ adj[pivot]; cand != 0; cand &= cand - 1 {
			v := bits.TrailingZeros64(cand)
			bit := uint64(1) << v
			expand(r|bit, p&adj[v], x&adj[v])
			p &^= bit
			x |= bit
		}
	}
	expand(0, left, 0)
	return best
}

func cliqueID(sortedBusIDs []string) string {
	sum := sha256.Sum256([]byte(strings.Join(sortedBusIDs, ",")))
	return "nvl-" + hex.EncodeToString(sum[:6])
}
