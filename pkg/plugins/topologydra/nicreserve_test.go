package topologydra

import (
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"

	"github.com/topodra/topodra/pkg/allocator"
)

// TestNICReserve: the reserve is a share of the pod's devices on the nodes
// with other devices, free counts only nodes whose other devices are
// free, and a placement uses the reserve where it leaves fewer free than
// kept on a node with free other devices.
func TestNICReserve(t *testing.T) {
	n := newReserveNodes()
	// Two DGXs with NICs, one with all its NICs in use, and a box without.
	n.add("dgx-a", &allocator.Quality{NodeDevices: 8, NodeInUse: 6, OtherDevices: 4, OtherFree: 1})
	n.add("dgx-b", &allocator.Quality{NodeDevices: 8, NodeInUse: 2, OtherDevices: 4, OtherFree: 0})
	n.add("box", &allocator.Quality{NodeDevices: 8, NodeInUse: 0})
	n.add("no-result", nil)
	s, nodes := n.s, n.nodes

	res := nicReserveOf(s, nodes, 12)
	if res.keep != 2 || res.free != 2 {
		t.Fatalf("12 %% of 16: keep %d, free %d; want 2, 2", res.keep, res.free)
	}
	for _, tc := range []struct {
		name string
		q    allocator.Quality
		want bool
	}{
		{"last GPUs beside a free NIC", allocator.Quality{OtherFree: 1, Devices: []string{"g"}}, true},
		{"node without free NICs", allocator.Quality{OtherFree: 0, Devices: []string{"g"}}, false},
	} {
		if got := res.takes(tc.q); got != tc.want {
			t.Errorf("%s: takes %v, want %v", tc.name, got, tc.want)
		}
	}
	roomy := nicReserveOf(s, nodes, 5) // keep 1 of 16
	if roomy.takes(allocator.Quality{OtherFree: 1, Devices: []string{"g"}}) {
		t.Errorf("keeping 1 of 2 free: one GPU uses the reserve")
	}
	if !roomy.takes(allocator.Quality{OtherFree: 1, Devices: []string{"g", "h"}}) {
		t.Errorf("keeping 1 of 2 free: two GPUs do not use the reserve")
	}
	if off := nicReserveOf(s, nodes, 0); off.takes(allocator.Quality{OtherFree: 1, Devices: []string{"g", "h"}}) {
		t.Errorf("0 %%: the reserve is used")
	}
}

// TestNICReserveWhereEveryNodeTakesIt: where the pod's allocation on every
// node it passed Filter on would take the reserve, nothing is kept, so
// the allocations keep their ranks; one node outside the reserve is
// enough to keep it.
func TestNICReserveWhereEveryNodeTakesIt(t *testing.T) {
	n := newReserveNodes()
	s := n.s
	// Two DGXs with free NICs and 4 free GPUs each; the pod takes 4.
	four := []string{"g0", "g1", "g2", "g3"}
	n.add("dgx-a", &allocator.Quality{NodeDevices: 8, NodeInUse: 4, OtherDevices: 4, OtherFree: 4, Devices: four})
	n.add("dgx-b", &allocator.Quality{NodeDevices: 8, NodeInUse: 4, OtherDevices: 4, OtherFree: 4, Devices: four})
	// 40 % of 16: keep 7 of the 8 free; 4 would be left on either.
	if r := nicReserveOf(s, n.nodes, 40); r.keep != 0 || r.takes(s.results["dgx-a"].Quality) {
		t.Errorf("every node in the reserve: keep %d, want 0 (nothing kept)", r.keep)
	}
	// A PCIe box without NICs that can take the pod keeps the reserve.
	n.add("box", &allocator.Quality{NodeDevices: 8, NodeInUse: 0, Devices: four})
	r := nicReserveOf(s, n.nodes, 40)
	if r.keep != 7 || !r.takes(s.results["dgx-a"].Quality) || r.takes(s.results["box"].Quality) {
		t.Errorf("with a node outside the reserve: keep %d (want 7), DGX takes it %v (want true), box %v (want false)", r.keep, r.takes(s.results["dgx-a"].Quality), r.takes(s.results["box"].Quality))
	}
}

// reserveNodes holds the nodes of a reserve test and the pod's allocation
// on each (their results in s).
type reserveNodes struct {
	s     *stateData
	nodes []fwk.NodeInfo
}

func newReserveNodes() *reserveNodes {
	return &reserveNodes{s: &stateData{results: map[string]*allocator.Result{}}}
}

// add adds a node where the pod's allocation has quality q; nil: a node
// without a result (Filter rejected the pod there).
func (r *reserveNodes) add(name string, q *allocator.Quality) {
	if q != nil {
		r.s.results[name] = &allocator.Result{Quality: *q}
	}
	info := framework.NewNodeInfo()
	info.SetNode(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}})
	r.nodes = append(r.nodes, info)
}
