package main

import (
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/topodra/topodra/pkg/sim"
)

func emptyNode(dgx bool) *node {
	n := &node{dgx: dgx}
	for i := range n.gpu {
		n.gpu[i] = -1
	}
	for i := range n.nic {
		n.nic[i] = -1
	}
	return n
}

// TestTopodraFollowsTheRules: the model's TopologyDRA takes a PCIe-root
// pair on the empty DGX when nothing waits, and a pair in one NUMA node of
// the busy DGX while an 8-GPU pod waits (rules 1-3 of docs/placement.md).
func TestTopodraFollowsTheRules(t *testing.T) {
	busy := emptyNode(true)
	running := &pod{gpus: 1, placed: true, end: never}
	for _, g := range []int{0, 2, 4, 6} {
		busy.gpu[g] = 0
	}
	nodes := []*node{busy, emptyNode(true)}
	pair := &pod{gpus: 2}
	pick := topodra(defaultTopodra)
	s := &state{nodes: nodes, pods: []*pod{running}, rng: rand.New(rand.NewPCG(1, 1))}

	c := pick(s, pair, placements(nodes, pair))
	if c.node != 1 || c.shared != 3 {
		t.Errorf("nothing waiting: got node %d slots %v (rank %d), want a PCIe-root pair on the empty node 1", c.node, c.slots, c.shared)
	}
	s.waiting = []*pod{{gpus: 8}}
	c = pick(s, pair, placements(nodes, pair))
	if c.node != 0 || c.slots[0]/4 != c.slots[1]/4 {
		t.Errorf("8-GPU pod waiting: got node %d slots %v, want one NUMA node of the busy node 0", c.node, c.slots)
	}
}

// TestRunsKeepDevicesApart: in every run of every policy no GPU or NIC is
// held by two pods at once, and every pod is counted once in the waits.
func TestRunsKeepDevicesApart(t *testing.T) {
	for _, sc := range sim.DefaultScenarios() {
		specs, err := sim.PlanNodes(sc.Profile, sc.Nodes)
		if err != nil {
			t.Fatal(err)
		}
		w, err := sim.GenerateTrace(sc.Trace, 1, sc.Pods, specs)
		if err != nil {
			t.Fatal(err)
		}
		for name, pick := range policies {
			checked := func(s *state, p *pod, ps []placement) placement {
				c := pick(s, p, ps)
				if c.node < 0 {
					return c
				}
				n := s.nodes[c.node]
				for _, g := range c.slots {
					if n.gpu[g] >= 0 {
						t.Fatalf("%s/%s: GPU %d of node %d given twice at tick %d", sc.Name, name, g, c.node, s.now)
					}
				}
				if c.nic >= 0 && n.nic[c.nic] >= 0 {
					t.Fatalf("%s/%s: NIC %d of node %d given twice at tick %d", sc.Name, name, c.nic, c.node, s.now)
				}
				return c
			}
			r := run(w, specs, checked, fifo, rand.New(rand.NewPCG(1, 1)))
			counted := 0
			for _, v := range r.waits {
				counted += v[0]
			}
			if counted != len(w.Jobs) {
				t.Errorf("%s/%s: %d pods in the waits, want %d", sc.Name, name, counted, len(w.Jobs))
			}
		}
	}
}

// TestReservation: while an 8-GPU pod waits, a pod that would outlast
// the node that frees first stays off it; the hard reservation leaves it
// waiting when only that node fits, the soft one lets it in.
func TestReservation(t *testing.T) {
	setup := func(fullSecond bool) (*state, []*node) {
		first, second := emptyNode(true), emptyNode(true)
		pods := []*pod{
			{gpus: 1, placed: true, start: 0, life: 5, end: 5},
			{gpus: 1, placed: true, start: 0, life: 50, end: 50},
		}
		first.gpu[0], second.gpu[0] = 0, 1
		if fullSecond {
			for g := range second.gpu {
				second.gpu[g] = 1
			}
		}
		nodes := []*node{first, second}
		return &state{nodes: nodes, pods: pods, now: 1, waiting: []*pod{{gpus: 8}}, rng: rand.New(rand.NewPCG(1, 1))}, nodes
	}
	pair := &pod{gpus: 2, life: 20, id: 7}
	for _, name := range []string{"topodra-oracle-reserve", "topodra-reserve-deadline", "topodra-oracle-reserve-soft"} {
		s, nodes := setup(false)
		if c := policies[name](s, pair, placements(nodes, pair)); c.node != 1 {
			t.Errorf("%s: pair placed on node %d, want node 1 (node 0 frees first)", name, c.node)
		}
		s, nodes = setup(true)
		want := -1
		if name == "topodra-oracle-reserve-soft" {
			want = 0
		}
		if c := policies[name](s, pair, placements(nodes, pair)); c.node != want {
			t.Errorf("%s, only node 0 fits: pair placed on node %d, want %d", name, c.node, want)
		}
	}
}

// TestHeadroom: a whole-node pod waits while starting it would leave fewer
// free GPUs than the headroom, starts once enough are free or once it has
// waited long enough, and smaller pods are never held back.
func TestHeadroom(t *testing.T) {
	busy := emptyNode(true)
	for g := range 6 {
		busy.gpu[g] = 0
	}
	nodes := []*node{busy, emptyNode(true)}
	s := &state{nodes: nodes, pods: []*pod{{gpus: 6, placed: true, end: never}}, now: 3, rng: rand.New(rand.NewPCG(1, 1))}
	whole := &pod{gpus: 8, arrival: 2}
	pair := &pod{gpus: 2, arrival: 3}
	for _, tc := range []struct {
		name             string
		headroom, waited int
		share            float64
		wantWhole        int
	}{
		{"no headroom", 0, 0, 0, 1},
		{"2 GPUs, 2 free elsewhere", 2, 0, 0, 1},
		{"3 GPUs, 2 free elsewhere", 3, 0, 0, -1},
		{"share 1/4 of 16", 0, 0, 0.25, -1},
		{"share 1/8 of 16", 0, 0, 0.125, 1},
		{"3 GPUs, waited long enough", 3, 1, 0, 1},
		{"3 GPUs, not waited long enough", 3, 2, 0, -1},
	} {
		o := defaultTopodra
		o.headroom, o.headroomShare, o.headroomFor = tc.headroom, tc.share, tc.waited
		pick := topodra(o)
		if c := pick(s, whole, placements(nodes, whole)); c.node != tc.wantWhole {
			t.Errorf("%s: 8-GPU pod on node %d, want %d", tc.name, c.node, tc.wantWhole)
		}
		if c := pick(s, pair, placements(nodes, pair)); c.node < 0 {
			t.Errorf("%s: the 2-GPU pod was held back", tc.name)
		}
	}
}

// TestSmallFirstAged: pods that have waited the given ticks go first,
// the longest-waiting first; the others follow, smaller first.
func TestSmallFirstAged(t *testing.T) {
	old8, young8, old2, young1 := &pod{gpus: 8, arrival: 1}, &pod{gpus: 8, arrival: 9}, &pod{gpus: 2, arrival: 3}, &pod{gpus: 1, arrival: 9}
	w := []*pod{young8, young1, old2, old8}
	smallFirstAged(6)(10, w)
	want := []*pod{old8, old2, young1, young8}
	for i := range want {
		if w[i] != want[i] {
			t.Fatalf("position %d: got the pod of %d GPUs that arrived at %d, want %d GPUs at %d", i, w[i].gpus, w[i].arrival, want[i].gpus, want[i].arrival)
		}
	}
}

// TestCountWait8: waiting 8-GPU pods are counted under what the cluster
// has free; smaller pods and GPU+NIC pods are not counted.
func TestCountWait8(t *testing.T) {
	busy := func(free int) *node {
		n := emptyNode(true)
		for g := free; g < gpus; g++ {
			n.gpu[g] = 0
		}
		return n
	}
	waiting := []*pod{{gpus: 8}, {gpus: 8, nics: 1}, {gpus: 4}}
	for _, c := range []struct {
		nodes []*node
		want  int
	}{
		{[]*node{busy(3), busy(4)}, 0},
		{[]*node{busy(7), busy(4)}, 1},
		{[]*node{busy(7), busy(7), busy(2)}, 2},
		{[]*node{busy(8), busy(0)}, 3},
	} {
		var r result
		r.countWait8(c.nodes, waiting)
		for i, n := range r.wait8 {
			if want := map[bool]int{true: 1}[i == c.want]; n != want {
				t.Errorf("%d nodes: %q counted %d, want %d", len(c.nodes), causes8[i], n, want)
			}
		}
	}
}

// TestLeavesSpare: the headroom as the scheduler applies it on 8 nodes
// (12 % of 64 rounded up: 8; 2 for 4-GPU pods), counting only nodes left
// with two or more free, or, with wholeNodeSpareFrom 1, every free GPU
// against an 8-GPU pod, or, with relaxFrom 1 and relaxShare 0.5, 4 while
// another 8-GPU pod waits.
func TestLeavesSpare(t *testing.T) {
	withFree := func(free ...int) *state {
		s := &state{}
		for i := range 8 {
			n := emptyNode(true)
			f := 0
			if i < len(free) {
				f = free[i]
			}
			for g := f; g < gpus; g++ {
				n.gpu[g] = 0
			}
			s.nodes = append(s.nodes, n)
		}
		return s
	}
	shipped := topodraOptions{headroomShare: 0.12, headroomAsShipped: true}
	singles := shipped
	singles.wholeNodeSpareFrom = 1
	relax := shipped
	relax.relaxFrom, relax.relaxShare = 1, 0.5
	queued := func(s *state, sizes ...int) *state {
		for _, g := range sizes {
			s.waiting = append(s.waiting, &pod{gpus: g})
		}
		return s
	}
	take := func(node, n int) placement {
		c := placement{node: node}
		for g := range n {
			c.slots = append(c.slots, g)
		}
		return c
	}
	for _, c := range []struct {
		name string
		o    topodraOptions
		s    *state
		p    *pod
		c    placement
		want bool
	}{
		{"8 GPUs, 8 free besides", shipped, withFree(8, 8), &pod{gpus: 8}, take(0, 8), true},
		{"8 GPUs, 7 and a single free besides", shipped, withFree(8, 7, 1), &pod{gpus: 8}, take(0, 8), false},
		{"8 GPUs, 7 and a single free besides, singles counted", singles, withFree(8, 7, 1), &pod{gpus: 8}, take(0, 8), true},
		{"4 GPUs leaving one on its node and one elsewhere", singles, withFree(5, 1), &pod{gpus: 4}, take(0, 4), false},
		{"4 GPUs leaving two on its node", shipped, withFree(6), &pod{gpus: 4}, take(0, 4), true},
		{"2 GPUs never held back", shipped, withFree(2), &pod{gpus: 2}, take(0, 2), true},
		{"8 GPUs, 4 free besides, none queued", relax, withFree(8, 4), &pod{gpus: 8}, take(0, 8), false},
		{"8 GPUs, 4 free besides, a 4-GPU pod queued", relax, queued(withFree(8, 4), 4), &pod{gpus: 8}, take(0, 8), false},
		{"8 GPUs, 4 free besides, an 8-GPU pod queued", relax, queued(withFree(8, 4), 8), &pod{gpus: 8}, take(0, 8), true},
		{"8 GPUs, 3 free besides, an 8-GPU pod queued", relax, queued(withFree(8, 3), 8), &pod{gpus: 8}, take(0, 8), false},
	} {
		if got := c.o.leavesSpare(c.s, c.p, c.c); got != c.want {
			t.Errorf("%s: leavesSpare = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestShareGrid: the grid's pair of shares that the scheduler ships runs
// exactly as topodra-shipped, and another pair does not.
func TestShareGrid(t *testing.T) {
	scenarios := sim.DefaultScenarios()[:1]
	seeds := []int64{1, 2}
	run := func(name string) summary {
		s, err := sweep(scenarios, seeds, policies[name], smallFirst, 1)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	shipped := run("topodra-shipped")
	if same := run("topodra-shipped-whole-1-half-0.25"); !reflect.DeepEqual(shipped, same) {
		t.Errorf("whole 1, half 0.25 ran differently from topodra-shipped:\n%+v\n%+v", same, shipped)
	}
	if other := run("topodra-shipped-whole-0.5-half-0.5"); reflect.DeepEqual(shipped, other) {
		t.Errorf("whole 0.5, half 0.5 ran exactly as topodra-shipped: the shares have no effect")
	}
}

// TestSameClass: the share of a node's GPUs in use held by pods of the
// placed pod's size class (1-2, 4-7, 8 GPUs).
func TestSameClass(t *testing.T) {
	s := &state{pods: []*pod{{gpus: 1}, {gpus: 2}, {gpus: 4}}}
	n := emptyNode(true)
	if got := sameClass(s, n, 1); got != 0 {
		t.Errorf("empty node: %v, want 0", got)
	}
	n.gpu[0], n.gpu[1], n.gpu[2] = 0, 1, 1
	for i := 4; i < 8; i++ {
		n.gpu[i] = 2
	}
	for _, c := range []struct {
		gpus int
		want float64
	}{{1, 3.0 / 7}, {2, 3.0 / 7}, {4, 4.0 / 7}, {8, 0}} {
		if got := sameClass(s, n, c.gpus); got != c.want {
			t.Errorf("pod of %d GPUs: %v, want %v", c.gpus, got, c.want)
		}
	}
}
