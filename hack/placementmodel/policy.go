package main

import (
	"math"
	"slices"
)

// stock is kube-scheduler 1.37 with the stock DRA plugin on these nodes:
// every node scores the same, and without extenders equal scores are not
// shuffled, so the pod goes to the first feasible node in the order the
// parallel filters finished: mostly the node order, now and then a later
// node (15 % here). Devices are taken first-fit.
func stock(s *state, p *pod, ps []placement) placement {
	first := ps[0]
	if s.rng.IntN(100) < 15 {
		for _, c := range ps {
			if c.node != first.node {
				return c
			}
		}
	}
	return first
}

// leastAllocated is stock when pods request CPU and memory in proportion
// to their GPUs: NodeResourcesFit's default LeastAllocated score prefers
// the node with the most free (ties: the first), devices first-fit.
func leastAllocated(s *state, p *pod, ps []placement) placement {
	best := ps[0]
	for _, c := range ps {
		if s.nodes[c.node].free() > s.nodes[best.node].free() {
			best = c
		}
	}
	return best
}

// mostAllocated is stock with the bin-packing profile that admins of GPU
// clusters configure (NodeResourcesFit MostAllocated) when pods request
// CPU and memory in proportion to their GPUs: the node with the fewest
// free GPUs (ties: the first), devices first-fit.
func mostAllocated(s *state, p *pod, ps []placement) placement {
	best := ps[0]
	for _, c := range ps {
		if s.nodes[c.node].free() < s.nodes[best.node].free() {
			best = c
		}
	}
	return best
}

// spread is a random feasible node, devices first-fit: what "random
// spreading" would be.
func spread(s *state, p *pod, ps []placement) placement {
	var firsts []placement
	for _, c := range ps {
		if len(firsts) == 0 || firsts[len(firsts)-1].node != c.node {
			firsts = append(firsts, c)
		}
	}
	return firsts[s.rng.IntN(len(firsts))]
}

// topodraOptions are the knobs of the TopologyDRA model.
type topodraOptions struct {
	// wholeNodeTrade, wholeNodeTradeWhileWaiting, drainTrade and the
	// weights as in TopologyDRAArgs.
	wholeNodeTrade, wholeNodeTradeWhileWaiting, drainTrade int
	room, packing, age                                     float64
	// ticksPerSecond: ages are whole seconds of wall time; a simulator
	// tick takes about 0.2 s. 0 means ages in ticks.
	ticksPerSecond int
	// remaining replaces the age by the pod's remaining lifetime (an
	// oracle: the scheduler cannot know it).
	remaining bool
	// reserve keeps, while a whole-node pod waits, the node that frees
	// up first (by the pods' true ends, an oracle) for it, and lets
	// other pods onto it only if they end before then (EASY backfill).
	reserve bool
	// lifetimeError makes the reservation see estimated lifetimes: each
	// pod's true lifetime times a factor drawn once per pod, uniformly in
	// [1-lifetimeError, 1+lifetimeError] (as if users annotated pods with
	// an expected runtime that is off by up to that much).
	lifetimeError float64
	// upperBound makes the reservation see bounds instead: each pod's
	// true lifetime times a factor drawn once per pod, uniformly in
	// [1, 1+upperBound] (as a pod's activeDeadlineSeconds would be: never
	// shorter than the run, often longer).
	upperBound float64
	// soft keeps other pods off the reserved node only where they fit on
	// another node; a pod that fits nowhere else still takes it.
	soft bool
	// headroom keeps GPUs for smaller pods: a pod that needs a whole
	// node starts only if at least this many GPUs of the cluster stay
	// free after it. headroomShare gives the number as a share of the
	// cluster's GPUs instead; a whole-node pod that has waited
	// headroomFor ticks (0: never) starts regardless.
	headroom      int
	headroomShare float64
	headroomFor   int
	// services: the pods that run to the end are known as such (as
	// restartPolicy Always tells the scheduler): a node that holds one
	// counts as the oldest and is never draining.
	services bool
	// drainClosedFrom keeps pods of at least this many GPUs (0: none)
	// off the draining nodes while a whole-node pod waits, unless no
	// other node can take them.
	drainClosedFrom int
	// drainClosedHard keeps them off even then.
	drainClosedHard bool
	// reserveFrom applies the reservation only to pods of at least this
	// many GPUs (0: all).
	reserveFrom int
	// drainSmallest chooses the draining nodes by the largest pod on
	// them first (smaller first: larger pods run longer), then by age.
	drainSmallest bool
	// learned replaces the age by the remaining lifetime expected from
	// the lifetimes of the pods of the same size that have ended:
	// the mean of (lifetime - age) over those that ran longer than
	// this pod has (in tenths of a tick); with none of its size, over
	// all sizes; with none at all, the age.
	learned bool
	// headroomAsShipped applies headroomShare as the scheduler does
	// (leavesSpare) instead of leavesHeadroom.
	headroomAsShipped bool
	// wholeNodeHeadroom scales the headroom of pods of 8 GPUs (0: 1);
	// wholeNodeSpareFrom counts, for them, nodes left with at least this
	// many free (0: 2).
	wholeNodeHeadroom  float64
	wholeNodeSpareFrom int
	// halfNodeShare is the share of the headroom that pods of 4 to 7 GPUs
	// keep (0: a quarter).
	halfNodeShare float64
	// drainAmongAll chooses the draining nodes among all nodes, not only
	// among those the pod being placed can go to: a full node can be the
	// one a waiting whole-node pod gets first.
	drainAmongAll bool
	// drainMoot drops the draining nodes where every node the pod can go
	// to is one of them: there is nowhere else to steer it.
	drainMoot bool
	// relaxFrom scales the headroom of pods of 8 GPUs by relaxShare
	// while at least relaxFrom other pods of 8 GPUs wait (0: never).
	relaxFrom  int
	relaxShare float64
	// like weighs, beside room, packing and age, the share of a node's
	// GPUs in use that pods of the placed pod's size class hold (1-2, 4-7
	// or 8 GPUs; 0 on an empty node), for pods of up to likeUpTo GPUs.
	like     float64
	likeUpTo int
}

var defaultTopodra = topodraOptions{wholeNodeTradeWhileWaiting: 2, drainTrade: 1, room: 70, packing: 30, age: 30, ticksPerSecond: 5}

// topodra models TopologyDRA's score (docs/placement.md, rules 1-5): the
// alignment rank after the whole-node and drain trades first, then room,
// packing and age, as an integer 0..100; equal scores go to the first node
// in node order.
func topodra(o topodraOptions) policy {
	return func(s *state, p *pod, ps []placement) placement {
		if !o.leavesHeadroom(s, p) {
			return placement{node: -1}
		}
		waiting := 0
		for _, q := range s.waiting {
			if q.gpus >= gpus {
				waiting++
			}
		}
		hasService := func(n int) bool {
			for _, i := range s.nodes[n].gpu {
				if i >= 0 && s.pods[i].life == 0 {
					return true
				}
			}
			return false
		}
		age := func(n int) int {
			if o.services && hasService(n) {
				return never
			}
			a := 0
			for _, i := range s.nodes[n].gpu {
				if i < 0 {
					continue
				}
				q := s.pods[i]
				if o.learned {
					a = max(a, learnedRemaining(s, q))
				} else if o.remaining {
					r := 1000
					if q.end != never {
						r = q.end - s.now
					}
					a = max(a, r)
				} else {
					a = max(a, s.now-q.start)
				}
			}
			if o.ticksPerSecond > 0 && !o.remaining && !o.learned {
				a /= o.ticksPerSecond
			}
			return a
		}
		var feasible []int
		for _, c := range ps {
			if !slices.Contains(feasible, c.node) {
				feasible = append(feasible, c.node)
			}
		}
		oldest := 0
		for _, n := range feasible {
			oldest = max(oldest, age(n))
		}
		trade := o.wholeNodeTrade
		draining := map[int]bool{}
		if waiting > 0 {
			trade = o.wholeNodeTradeWhileWaiting
			if p.gpus < gpus {
				byAge := slices.Clone(feasible)
				if o.drainAmongAll {
					byAge = byAge[:0]
					for n := range s.nodes {
						byAge = append(byAge, n)
					}
				}
				largest := func(n int) int {
					m := 0
					for _, i := range s.nodes[n].gpu {
						if i >= 0 {
							m = max(m, s.pods[i].gpus)
						}
					}
					return m
				}
				slices.SortStableFunc(byAge, func(a, b int) int {
					if o.drainSmallest {
						if d := largest(a) - largest(b); d != 0 {
							return d
						}
					}
					if d := age(a) - age(b); d != 0 {
						return d
					}
					return s.nodes[b].free() - s.nodes[a].free()
				})
				for _, n := range byAge[:min(waiting, len(byAge))] {
					draining[n] = true
				}
				if o.drainMoot && !slices.ContainsFunc(feasible, func(n int) bool { return !draining[n] }) {
					clear(draining)
				}
			}
		}
		// estimate is a pod's lifetime as the reservation sees it.
		estimate := func(q *pod) int {
			u := float64(uint32(q.id)*2654435761) / (1 << 32)
			switch {
			case o.upperBound > 0:
				return int(math.Ceil(float64(q.life) * (1 + o.upperBound*u)))
			case o.lifetimeError == 0:
				return q.life
			}
			return int(math.Round(float64(q.life) * (1 + o.lifetimeError*(2*u-1))))
		}
		reserved, until := -1, never
		if o.reserve && waiting > 0 && p.gpus < gpus {
			for n := range s.nodes {
				end := 0
				for _, i := range s.nodes[n].gpu {
					if i < 0 {
						continue
					}
					q := s.pods[i]
					if q.life == 0 {
						end = never
					} else {
						end = max(end, q.start+estimate(q))
					}
				}
				if end < until {
					reserved, until = n, end
				}
			}
		}
		if o.soft && !slices.ContainsFunc(ps, func(c placement) bool { return c.node != reserved }) {
			reserved = -1
		}
		closed := o.drainClosedFrom > 0 && p.gpus >= o.drainClosedFrom && len(draining) > 0
		if closed && !o.drainClosedHard && !slices.ContainsFunc(ps, func(c placement) bool { return !draining[c.node] }) {
			closed = false
		}
		best, bestScore := placement{node: -1}, int64(-1)
		for _, c := range ps {
			if closed && draining[c.node] {
				continue
			}
			if o.headroomAsShipped && !o.leavesSpare(s, p, c) {
				continue
			}
			if c.node == reserved && p.gpus >= o.reserveFrom && (p.life == 0 || s.now+estimate(p) > until) {
				continue
			}
			n := s.nodes[c.node]
			rank := c.shared
			if rank > 1 {
				t := 0
				if n.free() == gpus {
					t += trade
				}
				if draining[c.node] {
					t += o.drainTrade
				}
				rank = max(1, rank-t)
			}
			room := roomAfter(n, c.slots)
			if draining[c.node] {
				room = 0
			}
			packing := float64(gpus-n.free()+len(c.slots)) / gpus
			settled := 0.0
			if oldest > 0 {
				settled = float64(age(c.node)) / float64(oldest)
			}
			likeness := 0.0
			if o.like > 0 && p.gpus <= o.likeUpTo {
				likeness = sameClass(s, n, p.gpus)
			}
			tie := (o.room*room + o.packing*packing + o.age*settled + o.like*likeness) / (o.room + o.packing + o.age + o.like)
			score := int64(math.Round(25 * (float64(rank) + 0.96*tie)))
			if score > bestScore {
				best, bestScore = c, score
			}
		}
		return best
	}
}

// sameClass is the share of n's GPUs in use held by pods of the size
// class of a pod of g GPUs (1-2, 4-7, 8 and more); 0 for an empty node.
func sameClass(s *state, n *node, g int) float64 {
	class := func(g int) int {
		switch {
		case g <= 2:
			return 0
		case g < gpus:
			return 1
		}
		return 2
	}
	used, same := 0, 0
	for _, i := range n.gpu {
		if i < 0 {
			continue
		}
		used++
		if class(s.pods[i].gpus) == class(g) {
			same++
		}
	}
	if used == 0 {
		return 0
	}
	return float64(same) / float64(used)
}

// leavesHeadroom says whether p may start now under the headroom rule.
func (o topodraOptions) leavesHeadroom(s *state, p *pod) bool {
	h := o.headroom
	if o.headroomShare > 0 {
		h = int(math.Round(o.headroomShare * float64(gpus*len(s.nodes))))
	}
	if h == 0 || p.gpus < gpus || o.headroomFor > 0 && s.now-p.arrival >= o.headroomFor || o.headroomAsShipped {
		return true
	}
	free := 0
	for _, n := range s.nodes {
		free += n.free()
	}
	return free-p.gpus >= h
}

// leavesSpare is the headroom as the scheduler applies it
// (smallPodHeadroomPercent): after placement c, a pod of 8 GPUs must leave
// the headroom free, one of 4 to 7 a quarter of it (rounded up), counting
// only the GPUs of nodes left with two or more free.
func (o topodraOptions) leavesSpare(s *state, p *pod, c placement) bool {
	h := int(math.Ceil(o.headroomShare * float64(gpus*len(s.nodes))))
	least := 2
	switch {
	case h < gpus || p.gpus < gpus/2:
		return true
	case p.gpus < gpus:
		if o.halfNodeShare > 0 {
			h = int(math.Ceil(o.halfNodeShare * float64(h)))
		} else {
			h = (h + 3) / 4
		}
	default:
		if o.wholeNodeHeadroom > 0 {
			h = int(math.Ceil(o.wholeNodeHeadroom * float64(h)))
		}
		if o.relaxFrom > 0 {
			w := 0
			for _, q := range s.waiting {
				if q.gpus >= gpus {
					w++
				}
			}
			if w >= o.relaxFrom {
				h = int(math.Ceil(o.relaxShare * float64(h)))
			}
		}
		if o.wholeNodeSpareFrom > 0 {
			least = o.wholeNodeSpareFrom
		}
	}
	spare := 0
	for i, n := range s.nodes {
		f := n.free()
		if i == c.node {
			f -= len(c.slots)
		}
		if f >= least {
			spare += f
		}
	}
	return spare >= h
}

// roomAfter is Quality.Room: 1 minus the cost of the free blocks that
// taking slots breaks up (whole node 1, NUMA node 0.3, pair 0.05).
func roomAfter(n *node, slots []int) float64 {
	cost := 0.0
	if n.free() == gpus {
		cost++
	}
	broken := func(from, size int) bool {
		hit := false
		for s := from; s < from+size; s++ {
			if n.gpu[s] >= 0 {
				return false
			}
			hit = hit || slices.Contains(slots, s)
		}
		return hit
	}
	for h := range 2 {
		if broken(4*h, 4) {
			cost += 0.3
		}
	}
	for k := range 4 {
		if broken(2*k, 2) {
			cost += 0.05
		}
	}
	return max(0, 1-cost)
}

// learnedRemaining is the remaining lifetime of q expected from the pods
// that have ended, in tenths of a tick.
func learnedRemaining(s *state, q *pod) int {
	if q.life == 0 {
		return never
	}
	age := s.now - q.start
	for _, sameSize := range []bool{true, false} {
		sum, n, ended := 0, 0, 0
		for _, e := range s.pods {
			if !e.placed || e.life == 0 || e.end > s.now || sameSize && e.gpus != q.gpus {
				continue
			}
			ended++
			if e.life > age {
				sum += e.life - age
				n++
			}
		}
		if n > 0 {
			return 10 * sum / n
		}
		if ended > 0 {
			return 5
		}
	}
	return 10 * age
}
