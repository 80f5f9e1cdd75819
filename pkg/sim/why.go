package sim

import (
	"fmt"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/labels"

	"github.com/topodra/topodra/pkg/measure"
	"github.com/topodra/topodra/pkg/plugins/topologydra"
)

// Why a pod waited, judged by the cluster at the end of the tick in which
// it arrived (pods of that tick scheduled after it may have taken what it
// failed on). WaitCauses lists them in the order ClassifyWait tries them.
const (
	CauseClusterFull = "cluster full"                        // no GPU free
	CauseTooFewFree  = "fewer GPUs free than it asks"        // some free, fewer than it asks
	CauseScattered   = "free GPUs only scattered"            // enough free, no node with enough
	CauseNoNodeNICs  = "no node with its GPUs and NICs"      // a node with the GPUs, none that also has the NICs
	CauseNoRootNICs  = "no PCIe root with its GPUs and NICs" // a node with both, none on one root (pods that need one root)
	CauseHeadroom    = "kept free by the headroom"           // fits by count, not with the headroom kept (pods of half a node or more)
	CauseFitsByCount = "fits by count on a node"             // alignment, matchAttribute, or the order in the tick
	// CauseOther: the pod's claims ask for more than GPU and NIC counts
	// (selectors, other classes, several constrained claims), which free
	// counts cannot judge.
	CauseOther = "not judged by counts"
)

// WaitCauses lists the causes in the order they are printed.
var WaitCauses = []string{CauseClusterFull, CauseTooFewFree, CauseScattered, CauseNoNodeNICs, CauseNoRootNICs, CauseHeadroom, CauseFitsByCount, CauseOther}

// WaitWant is what a waiting pod asks for, as free counts can judge it.
type WaitWant struct {
	GPUs, NICs int
	// SameRoot: all its devices must be on one PCIe root.
	SameRoot bool
}

// WaitSize names a pod's size the way wait causes are reported: "2 GPU",
// "1 GPU + 1 NIC".
func WaitSize(gpus, nics int) string {
	if nics > 0 {
		return fmt.Sprintf("%d GPU + %d NIC", gpus, nics)
	}
	return fmt.Sprintf("%d GPU", gpus)
}

// ClassifyWait says why a pod that asks for want waited, given the free
// GPUs and NICs of each node it may use (nodes) and of each PCIe root of
// those nodes (roots; read only for a pod that needs one root).
// heldBack reports whether the pod fits by count on some node but not with
// the scheduler's headroom kept; it is asked only once the counts fit.
func ClassifyWait(want WaitWant, nodes, roots []measure.Count, heldBack func() bool) string {
	total, gpuNode, both, root := 0, false, false, false
	for _, n := range nodes {
		total += n.GPUs
		if n.GPUs >= want.GPUs {
			gpuNode = true
			both = both || n.NICs >= want.NICs
		}
	}
	for _, r := range roots {
		root = root || r.Covers(measure.Count{GPUs: want.GPUs, NICs: want.NICs})
	}
	switch {
	case total == 0:
		return CauseClusterFull
	case total < want.GPUs:
		return CauseTooFewFree
	case !gpuNode:
		return CauseScattered
	case !both:
		return CauseNoNodeNICs
	case want.SameRoot && !root:
		return CauseNoRootNICs
	case heldBack != nil && heldBack():
		return CauseHeadroom
	}
	return CauseFitsByCount
}

// WaitedBy counts pods that waited: [size][cause] (see WaitSize and
// WaitCauses).
type WaitedBy map[string]map[string]int

// Add counts n pods of size that waited for cause.
func (w WaitedBy) Add(size, cause string, n int) {
	if w[size] == nil {
		w[size] = map[string]int{}
	}
	w[size][cause] += n
}

// Sizes lists w's sizes by GPUs, then NICs.
func (w WaitedBy) Sizes() []string {
	out := make([]string, 0, len(w))
	for size := range w {
		out = append(out, size)
	}
	slices.SortFunc(out, func(a, b string) int {
		var ga, na, gb, nb int
		fmt.Sscanf(a, "%d GPU + %d NIC", &ga, &na)
		fmt.Sscanf(b, "%d GPU + %d NIC", &gb, &nb)
		if ga != gb {
			return ga - gb
		}
		return na - nb
	})
	return out
}

// Line prints one size's causes: "cluster full 2, fewer GPUs free than it
// asks 1"; runs, where not nil, adds in how many runs each occurred.
func (w WaitedBy) Line(size string, runs WaitedBy) string {
	var parts []string
	for _, c := range WaitCauses {
		n := w[size][c]
		if n == 0 {
			continue
		}
		if runs != nil {
			unit := "runs"
			if runs[size][c] == 1 {
				unit = "run"
			}
			parts = append(parts, fmt.Sprintf("%s %d (%d %s)", c, n, runs[size][c], unit))
		} else {
			parts = append(parts, fmt.Sprintf("%s %d", c, n))
		}
	}
	return strings.Join(parts, ", ")
}

// judgeWaits records on each of the named pods that is not bound yet why
// it is not (podState.WaitSize, WaitCause), by the devices free now on the
// nodes its node selector admits. fill counts the pods that then waited.
func (t *tracker) judgeWaits(names []string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, name := range names {
		ps := t.pods[name]
		if ps == nil || ps.Bound {
			continue
		}
		if ps.Demand == nil {
			ps.WaitSize, ps.WaitCause = WaitSize(ps.GPUs, 0), CauseOther
			continue
		}
		selector := labels.SelectorFromSet(ps.NodeSelector)
		scope := measure.Scope{Node: func(node string) bool { return selector.Matches(t.nodeLabels[node]) }}
		// Nodes and roots without a free device are not in the counts;
		// they change nothing.
		var nodes, roots []measure.Count
		for _, c := range t.inv.Free(measure.LevelNode, scope) {
			nodes = append(nodes, c)
		}
		if ps.Demand.SameRoot {
			for _, c := range t.inv.Free(measure.LevelPCIeRoot, scope) {
				roots = append(roots, c)
			}
		}
		want := WaitWant{GPUs: ps.Demand.GPUs, NICs: ps.Demand.NICs, SameRoot: ps.Demand.SameRoot}
		heldBack := func() bool { return !t.fitsWithHeadroom(selector, ps.Demand.GPUs) }
		ps.WaitSize, ps.WaitCause = WaitSize(ps.Demand.GPUs, ps.Demand.NICs), ClassifyWait(want, nodes, roots, heldBack)
	}
}

// fitsWithHeadroom reports whether some node the selector admits has gpus
// free GPUs and leaves the scheduler's headroom free once they are taken
// (see topologydra.HeadroomFor); true where no headroom applies. The
// caller holds t.mu.
func (t *tracker) fitsWithHeadroom(selector labels.Selector, gpus int) bool {
	if t.headroomPercent <= 0 || gpus < t.wholeNode/2 {
		return true
	}
	type count struct{ free, all int }
	perNode := map[string]count{}
	total, spare := 0, 0
	for node, devs := range t.nodeDevices {
		if !selector.Matches(t.nodeLabels[node]) {
			continue
		}
		var c count
		for _, d := range devs {
			if !d.GPU {
				continue
			}
			c.all++
			if t.inv.Available(d.Key) {
				c.free++
			}
		}
		perNode[node] = c
		total += c.all
		spare += topologydra.Spare(c.free)
	}
	h := topologydra.HeadroomFor(t.headroomPercent, total, gpus, t.wholeNode)
	for _, c := range perNode {
		if c.free >= gpus && spare-topologydra.Spare(c.free)+topologydra.Spare(c.free-gpus) >= h {
			return true
		}
	}
	return false
}
