package main

import (
	"math"
	"math/rand/v2"
	"slices"
	"strings"

	"github.com/topodra/topodra/pkg/sim"
)

// The model: the simulator's workloads and ticks, without an API server or
// a scheduler. Each node has eight GPUs in four pairs and two NUMA nodes
// (0-3, 4-7). A DGX node has one NVLink clique, a PCIe root per pair and
// one NIC per pair's root; the PCIe box has an NVLink clique per pair, a
// PCIe root per GPU and no NICs. Each tick: pods whose lifetime is over
// leave, waiting pods are retried in queue order, then the tick's new pods
// are tried in arrival order.

const gpus = 8

// never is the end tick of a pod that runs to the end of the run.
const never = math.MaxInt32

type node struct {
	dgx bool
	gpu [gpus]int // pod index, or -1 when free
	nic [4]int
}

func (n *node) free() int {
	c := 0
	for _, p := range n.gpu {
		if p < 0 {
			c++
		}
	}
	return c
}

type pod struct {
	gpus, nics int
	// match: the GPUs and the NIC must share a PCIe root.
	match         bool
	arrival, life int
	placed        bool
	start, end    int
	node, nic     int
	slots         []int
	// id is the pod's index in its workload.
	id int
}

// endIfStarted is when the pod would leave if it started at now.
func (p *pod) endIfStarted(now int) int {
	if p.life == 0 {
		return never
	}
	return now + p.life
}

// placement is one way to place a pod.
type placement struct {
	node  int
	slots []int
	nic   int
	// shared is topodra's alignment rank: how many of NVLink clique,
	// PCIe root and NUMA node all devices share.
	shared int
}

var combinations = map[int][][]int{}

func init() {
	for _, k := range []int{1, 2, 4, 8} {
		var rec func(from int, cur []int)
		rec = func(from int, cur []int) {
			if len(cur) == k {
				combinations[k] = append(combinations[k], slices.Clone(cur))
				return
			}
			for i := from; i < gpus; i++ {
				rec(i+1, append(cur, i))
			}
		}
		rec(0, nil)
	}
}

func sharedRank(dgx bool, slots []int, nic int) int {
	same := func(f func(int) int) bool {
		v := f(slots[0])
		for _, s := range slots {
			if f(s) != v {
				return false
			}
		}
		return nic < 0 || f(-1-nic) == v
	}
	n := 0
	if nic < 0 && (dgx || same(func(s int) int { return s / 2 })) {
		n++ // NICs have no clique
	}
	if same(func(s int) int {
		switch {
		case s < 0:
			return -1 - s
		case dgx:
			return s / 2
		}
		return s
	}) {
		n++
	}
	if same(func(s int) int {
		if s < 0 {
			return (-1 - s) / 2
		}
		return s / 4
	}) {
		n++
	}
	return n
}

// placements lists every way to place p, nodes in order, devices in
// first-fit order within a node.
func placements(nodes []*node, p *pod) []placement {
	var out []placement
	for i, n := range nodes {
		if p.nics > 0 && !n.dgx || n.free() < p.gpus {
			continue
		}
		for _, c := range combinations[p.gpus] {
			if slices.ContainsFunc(c, func(s int) bool { return n.gpu[s] >= 0 }) {
				continue
			}
			if p.nics == 0 {
				out = append(out, placement{node: i, slots: c, nic: -1, shared: sharedRank(n.dgx, c, -1)})
				continue
			}
			for k := range n.nic {
				if n.nic[k] >= 0 || p.match && slices.ContainsFunc(c, func(s int) bool { return s/2 != k }) {
					continue
				}
				out = append(out, placement{node: i, slots: c, nic: k, shared: sharedRank(n.dgx, c, k)})
			}
		}
	}
	return out
}

// state is what a policy sees.
type state struct {
	nodes   []*node
	pods    []*pod
	now     int
	waiting []*pod // in queue order, the pod being placed excluded
	rng     *rand.Rand
}

// policy picks one of the placements (never empty), or none (-1 node)
// to leave the pod waiting.
type policy func(s *state, p *pod, ps []placement) placement

// result sums up one run.
type result struct {
	waits       map[int][2]int // by GPUs (0: GPU+NIC pods): pods, ticks
	neverPlaced int
	fit8        int
	gpuTicks    int
	gpuTicks8   int // of gpuTicks, those of pods of 8 GPUs (without NICs)
	idle        int
	aligned     [2]int // aligned, possible
	// wait8 splits the pod-ticks that pods of 8 GPUs (without NICs) wait,
	// counted at the end of each tick, by what the cluster had free then
	// (causes8).
	wait8 [len(causes8)]int
}

// causes8 name the columns of result.wait8: fewer than 8 GPUs free in
// all; 8-15 free, or 16 or more, but no node with 8; a node with 8 free
// (held back by the headroom, or arrived after the tick's retries).
var causes8 = [...]string{"fewer than 8 free", "8-15 free, no whole node", "16+ free, no whole node", "a whole node free"}

// oneByOne retries the waiting pods after each departure instead of after
// all departures of a tick: in a cluster pods rarely end together, and
// each freed device is offered to the waiting pods at once.
var oneByOne bool

// sortArrivals tries a tick's new pods in queue order, not arrival order.
var sortArrivals bool

// queueOrder sorts the waiting pods before their retry at tick now.
type queueOrder func(now int, waiting []*pod)

// fifo retries the pods that arrived first first.
func fifo(int, []*pod) {}

// smallFirst retries the smaller pods first: what kube-scheduler's queue
// does when every freed device requeues every waiting pod (a large pod
// fails most often, and each failure puts it at the back), and what
// TopologyDRA's profile does with DeviceCountSort.
func smallFirst(_ int, w []*pod) {
	slices.SortStableFunc(w, func(a, b *pod) int { return a.gpus - b.gpus })
}

// wholeThenSmall retries the pods that need a whole node first, then the
// others, smaller first.
func wholeThenSmall(_ int, w []*pod) {
	key := func(p *pod) int {
		if p.gpus >= gpus {
			return 0
		}
		return p.gpus
	}
	slices.SortStableFunc(w, func(a, b *pod) int { return key(a) - key(b) })
}

// smallFirstAged retries the smaller pods first, except that pods that
// have waited at least the given number of ticks go before all others,
// the longest-waiting first (a queue sort with aging against starvation).
func smallFirstAged(after int) queueOrder {
	return func(now int, w []*pod) {
		key := func(p *pod) int {
			if now-p.arrival >= after {
				return -1000 + p.arrival
			}
			return p.gpus
		}
		slices.SortStableFunc(w, func(a, b *pod) int { return key(a) - key(b) })
	}
}

// largeFirst retries the larger pods first: what kube-scheduler's queue
// does when a freed device requeues a waiting pod only if it may now fit
// (TopologyDRA's hint): a pod that needs a whole node is retried rarely,
// so its last failure is the oldest, and the queue tries it first.
func largeFirst(_ int, w []*pod) {
	slices.SortStableFunc(w, func(a, b *pod) int { return b.gpus - a.gpus })
}

func podsOf(w *sim.Workload) []*pod {
	var out []*pod
	for _, j := range w.Jobs {
		t := *j.Pod.Spec.ResourceClaims[0].ResourceClaimTemplateName
		p := &pod{arrival: j.Arrival, life: j.Lifetime, node: -1, nic: -1, id: len(out)}
		rest, _ := strings.CutPrefix(t, "gpu-")
		p.gpus = int(rest[0] - '0')
		if strings.Contains(t, "-nic-") {
			p.nics = 1
			p.match = strings.HasSuffix(t, "-match")
		}
		out = append(out, p)
	}
	return out
}

func run(w *sim.Workload, specs []sim.NodeSpec, pick policy, order queueOrder, rng *rand.Rand) result {
	var nodes []*node
	for _, spec := range specs {
		n := &node{dgx: strings.HasPrefix(spec.Profile, "dgx")}
		for i := range n.gpu {
			n.gpu[i] = -1
		}
		for i := range n.nic {
			n.nic[i] = -1
		}
		nodes = append(nodes, n)
	}
	pods := podsOf(w)
	res := result{waits: map[int][2]int{}}
	s := &state{nodes: nodes, pods: pods, rng: rng}
	var waiting []*pod
	try := func(i int, p *pod) bool {
		ps := placements(nodes, p)
		if len(ps) == 0 {
			return false
		}
		s.waiting = slices.DeleteFunc(slices.Clone(waiting), func(q *pod) bool { return q == p })
		c := pick(s, p, ps)
		if c.node < 0 {
			return false
		}
		res.measure(nodes, p, c)
		p.placed, p.start, p.end, p.node, p.slots, p.nic = true, s.now, p.endIfStarted(s.now), c.node, c.slots, c.nic
		for _, g := range c.slots {
			nodes[c.node].gpu[g] = i
		}
		if c.nic >= 0 {
			nodes[c.node].nic[c.nic] = i
		}
		return true
	}
	index := map[*pod]int{}
	for i, p := range pods {
		index[p] = i
	}
	ticks := w.Ticks()
	retry := func() {
		order(s.now, waiting)
		for _, p := range slices.Clone(waiting) {
			if try(index[p], p) {
				waiting = slices.DeleteFunc(waiting, func(q *pod) bool { return q == p })
			}
		}
	}
	for s.now = 0; s.now < ticks; s.now++ {
		for _, p := range pods {
			if p.placed && p.end == s.now {
				for _, g := range p.slots {
					nodes[p.node].gpu[g] = -1
				}
				if p.nic >= 0 {
					nodes[p.node].nic[p.nic] = -1
				}
				if oneByOne {
					retry()
				}
			}
		}
		retry()
		var arrivals []*pod
		for _, p := range pods {
			if p.arrival == s.now {
				arrivals = append(arrivals, p)
			}
		}
		if sortArrivals {
			order(s.now, arrivals)
		}
		for k, p := range arrivals {
			// Pods of this tick not tried yet wait too, as far as the
			// scheduler can tell.
			waiting = append(waiting, arrivals[k:]...)
			placed := try(index[p], p)
			waiting = waiting[:len(waiting)-len(arrivals[k:])]
			if !placed {
				waiting = append(waiting, p)
			}
		}
		if len(waiting) > 0 {
			for _, n := range nodes {
				res.idle += n.free()
			}
		}
		res.countWait8(nodes, waiting)
	}
	for _, p := range pods {
		until := ticks
		if p.placed {
			until = p.start
		} else {
			res.neverPlaced++
		}
		k := p.gpus
		if p.nics > 0 {
			k = 0
		}
		w := res.waits[k]
		res.waits[k] = [2]int{w[0] + 1, w[1] + until - p.arrival}
		res.gpuTicks += (until - p.arrival) * p.gpus
		if k == gpus {
			res.gpuTicks8 += (until - p.arrival) * p.gpus
		}
	}
	for _, n := range nodes {
		if n.free() == gpus {
			res.fit8++
		}
	}
	return res
}

// countWait8 adds the pods of 8 GPUs (without NICs) that wait at the end
// of a tick to result.wait8, by what the cluster has free.
func (r *result) countWait8(nodes []*node, waiting []*pod) {
	free, whole := 0, false
	for _, n := range nodes {
		free += n.free()
		whole = whole || n.free() == gpus
	}
	cause := 0
	switch {
	case whole:
		cause = 3
	case free >= 2*gpus:
		cause = 2
	case free >= gpus:
		cause = 1
	}
	for _, p := range waiting {
		if p.gpus == gpus && p.nics == 0 {
			r.wait8[cause]++
		}
	}
}

// measure rates a placement as the simulator does (Placement's In* and
// *Possible fields): for pods with two or more GPUs whether they share a
// clique, a PCIe root, a NUMA node where some node had that many free in
// one; for GPU+NIC pods whether they share a root where some root had
// room.
func (r *result) measure(nodes []*node, p *pod, c placement) {
	add := func(aligned, possible bool) {
		if aligned || possible {
			r.aligned[1]++
		}
		if aligned {
			r.aligned[0]++
		}
	}
	n := nodes[c.node]
	if g := p.gpus; g >= 2 {
		clique := n.dgx || g == 2 && c.slots[0]/2 == c.slots[1]/2
		root := n.dgx && g == 2 && c.slots[0]/2 == c.slots[1]/2
		numa := g <= 4 && c.slots[0]/4 == c.slots[g-1]/4
		var cliquePossible, rootPossible, numaPossible bool
		for _, m := range nodes {
			if p.nics > 0 && !m.dgx || m.free() < g {
				continue
			}
			freePair := false
			for k := range 4 {
				freePair = freePair || m.gpu[2*k] < 0 && m.gpu[2*k+1] < 0
			}
			cliquePossible = cliquePossible || m.dgx || g == 2 && freePair
			rootPossible = rootPossible || m.dgx && g == 2 && freePair
			for h := range 2 {
				f := 0
				for s := 4 * h; s < 4*h+4; s++ {
					if m.gpu[s] < 0 {
						f++
					}
				}
				numaPossible = numaPossible || g <= 4 && f >= g
			}
		}
		add(clique, cliquePossible)
		add(root, rootPossible)
		add(numa, numaPossible)
	}
	if p.nics > 0 {
		aligned := !slices.ContainsFunc(c.slots, func(s int) bool { return s/2 != c.nic })
		possible := false
		for _, m := range nodes {
			for k := range 4 {
				if !m.dgx || m.nic[k] >= 0 {
					continue
				}
				f := 0
				for _, s := range []int{2 * k, 2*k + 1} {
					if m.gpu[s] < 0 {
						f++
					}
				}
				possible = possible || f >= p.gpus
			}
		}
		add(aligned, possible)
	}
}
