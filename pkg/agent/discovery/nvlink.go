package discovery

import (
	"crypto/sha256"
	"encoding/hex"
	"slices"
	"strings"
)

// Link is one active NVLink seen from a GPU.
type Link struct {
	// GPU is the canonical PCI bus id of the GPU that reports the link.
	GPU string
	// Remote is the canonical PCI bus id of the far end: another GPU, or
	// an NVSwitch (all GPUs behind the same switch fabric are joined).
	Remote string
}

// NVLinkCliques groups GPUs into cliques: connected components of the graph
// whose nodes are GPUs and link endpoints (NVSwitches, bridges) and whose
// edges are active NVLinks. It returns the clique id of every GPU that
// shares a component with at least one other GPU; GPUs without an NVLink
// peer get no clique.
//
// The id depends only on the member GPUs (a hash of their sorted bus ids),
// so it is stable across restarts and independent of NVML's enumeration
// order, and it changes when a link failure splits or shrinks a clique.
func NVLinkCliques(gpus []string, links []Link) map[string]string {
	parent := map[string]string{}
	var find func(string) string
	find = func(x string) string {
		p, ok := parent[x]
		if !ok {
			parent[x] = x
			return x
		}
		if p == x {
			return x
		}
		root := find(p)
		parent[x] = root
		return root
	}
	union := func(a, b string) {
		ra, rb := find(a), find(b)
		if ra == rb {
			return
		}
		// Deterministic: the smaller id becomes the root.
		if rb < ra {
			ra, rb = rb, ra
		}
		parent[rb] = ra
	}

	isGPU := make(map[string]bool, len(gpus))
	for _, gpu := range gpus {
		isGPU[gpu] = true
		find(gpu)
	}
	for _, link := range links {
		if !isGPU[link.GPU] || link.Remote == "" || link.Remote == link.GPU {
			continue
		}
		union(link.GPU, link.Remote)
	}

	members := map[string][]string{}
	for _, gpu := range gpus {
		root := find(gpu)
		members[root] = append(members[root], gpu)
	}
	cliques := map[string]string{}
	for _, group := range members {
		if len(group) < 2 {
			continue
		}
		slices.Sort(group)
		id := cliqueID(group)
		for _, gpu := range group {
			cliques[gpu] = id
		}
	}
	return cliques
}

func cliqueID(sortedBusIDs []string) string {
	sum := sha256.Sum256([]byte(strings.Join(sortedBusIDs, ",")))
	return "nvl-" + hex.EncodeToString(sum[:6])
}
