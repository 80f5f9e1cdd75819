package allocator

import (
	"cmp"
	"math"
	"slices"
)

// group is a set of requests whose devices should share one domain: the
// requests of one claim, or of all claims of the pod that carry
// topodra.io/align-with=pod.
type group struct {
	claims []int
	mode   AlignmentMode
	units  []*unit
	need   int
}

// domainRef identifies one domain: a level (attribute index) and value.
type domainRef struct {
	level int
	value string
	id    int32 // index of value in nodeState.domVals[level]
}

// candidate is a domain that can hold a group, with its ranking data.
type candidate struct {
	domainRef
	// binding is set when the domain can hold the group only with devices
	// that have binding conditions.
	binding bool
	// slack is how many free devices of the group's requests the domain
	// has beyond what the group needs.
	slack int
	// enclosing are the group's free devices in the domains that contain
	// this domain's first device at the other levels (priority order).
	enclosing []int
}

// plan assigns each group a domain (or none: spanning) and the devices
// that upstream should try first, in order.
type plan struct {
	domains []*domainRef // per group; nil = spanning
	picks   [][]int      // per group, node device indices
}

// planner holds what is needed to rank devices on one node for one pod.
type planner struct {
	ns     *nodeState
	levels int
	pack   bool
	groups []*group
	// allUnits are all requests and subrequests of the pod.
	allUnits []*unit
	// passed are the subrequests that a claim requiring alignment gave up
	// for a later one (alignedAlternative): views hide their devices as
	// they hide a group's, so that upstream gets to the later one.
	passed map[*unit]bool
}

// buildGroups forms the groups of a pod. Claims with alignment none, with
// All-mode requests, or whose requests cannot fit by counting, stay out.
func buildGroups(infos []*claimInfo) []*group {
	var groups []*group
	var podGroup *group
	for ci, info := range infos {
		if info.mode == AlignmentNone || info.hasAll {
			continue
		}
		var units []*unit
		need := 0
		ok := true
		for _, r := range info.requests {
			u := r.chosen()
			if u == nil {
				ok = false
				break
			}
			units = append(units, u)
			need += u.count
		}
		if !ok || len(units) == 0 {
			continue
		}
		g := &group{claims: []int{ci}, mode: info.mode, units: units, need: need}
		if info.alignPod {
			if podGroup == nil {
				podGroup = g
				groups = append(groups, g)
				continue
			}
			podGroup.claims = append(podGroup.claims, ci)
			podGroup.units = append(podGroup.units, units...)
			podGroup.need += need
			if info.mode == AlignmentRequire {
				podGroup.mode = AlignmentRequire
			}
			continue
		}
		groups = append(groups, g)
	}
	return groups
}

// fittingDomains lists the domains that can hold g given the available
// devices, best first: tightest level, then best fit (least slack; most
// slack when spreading), then the tightest enclosing domains, then value.
// Unless allLevels is set, it stops after the first level that has any.
func (p *planner) fittingDomains(g *group, avail []bool, allLevels bool) []candidate {
	ns := p.ns
	dc := p.countDomains(g, avail)
	bindingDevs := p.bindingDevices(g)
	var result []candidate
	var enclosing []int // backing array of all candidates' enclosing sizes
	for _, l := range p.rankLevels(g, dc) {
		if !allLevels && len(result) > 0 {
			break
		}
		start := len(result)
		for v, size := range dc.free[l] {
			if size < g.need || !p.fitsIn(g, avail, l, int32(v)) {
				continue
			}
			c := candidate{domainRef: domainRef{level: l, value: ns.domVals[l][v], id: int32(v)}, slack: size - g.need}
			if bindingDevs != nil {
				c.binding = p.plainFree(g, avail, bindingDevs, l, int32(v)) < g.need
			}
			first := dc.first[l][v]
			if enclosing == nil {
				enclosing = make([]int, 0, len(ns.domVals[l])*(p.levels-1))
			}
			from := len(enclosing)
			for k := range p.levels {
				if k == l {
					continue
				}
				if ev := ns.dom[k][first]; ev >= 0 {
					enclosing = append(enclosing, dc.free[k][ev])
				} else {
					enclosing = append(enclosing, math.MaxInt32)
				}
			}
			c.enclosing = enclosing[from:len(enclosing):len(enclosing)]
			result = append(result, c)
		}
		p.sortCandidates(result[start:])
	}
	return result
}

// domainCounts counts a group's devices per level and domain id.
type domainCounts struct {
	// free[l][v]: available free devices of the group's requests;
	// first[l][v]: the first of them (node device index);
	// total[l][v]: devices matching the group's requests, free or not.
	free, first, total [][]int
}

func (p *planner) countDomains(g *group, avail []bool) domainCounts {
	ns := p.ns
	inUnion := make([]bool, len(ns.devices))
	var union []int
	for _, u := range g.units {
		for _, i := range u.free {
			if avail[i] && !inUnion[i] {
				inUnion[i] = true
				union = append(union, i)
			}
		}
	}
	total := 0
	for l := range p.levels {
		total += len(ns.domVals[l])
	}
	counts := make([]int, 2*total)
	dc := domainCounts{free: make([][]int, p.levels), first: make([][]int, p.levels), total: make([][]int, p.levels)}
	off := 0
	for l := range p.levels {
		n := len(ns.domVals[l])
		dc.free[l] = counts[off : off+n]
		dc.first[l] = counts[total+off : total+off+n]
		dc.total[l] = make([]int, n)
		off += n
		for v := range dc.first[l] {
			dc.first[l][v] = math.MaxInt
		}
	}
	for _, i := range union {
		for l := range p.levels {
			if v := ns.dom[l][i]; v >= 0 {
				dc.free[l][v]++
				dc.first[l][v] = min(dc.first[l][v], i)
			}
		}
	}
	for i := range ns.devices {
		m := false
		for _, u := range g.units {
			if u.matching != nil && u.matching[i] {
				m = true
				break
			}
		}
		if !m {
			continue
		}
		for l := range p.levels {
			if v := ns.dom[l][i]; v >= 0 {
				dc.total[l][v]++
			}
		}
	}
	return dc
}

// rankLevels returns the levels that have a domain with enough free
// devices for g, smallest such domain (by devices matching g's requests,
// free or not) first, so that the tightest domain wins whatever the
// attribute: on a DGX four GPUs go to a NUMA node before the NVSwitch
// clique of all eight. Ties keep priority order.
func (p *planner) rankLevels(g *group, dc domainCounts) []int {
	type levelRank struct{ level, minTotal int }
	var ranked []levelRank
	for l := range p.levels {
		best := math.MaxInt
		for v, size := range dc.free[l] {
			if size >= g.need {
				best = min(best, dc.total[l][v])
			}
		}
		if best < math.MaxInt {
			ranked = append(ranked, levelRank{l, best})
		}
	}
	slices.SortStableFunc(ranked, func(x, y levelRank) int { return cmp.Compare(x.minTotal, y.minTotal) })
	levels := make([]int, len(ranked))
	for k, r := range ranked {
		levels[k] = r.level
	}
	return levels
}

// fitsIn reports whether every request of g has enough available free
// devices in domain v of level l.
func (p *planner) fitsIn(g *group, avail []bool, l int, v int32) bool {
	for _, u := range g.units {
		n := 0
		for _, i := range u.free {
			if avail[i] && p.ns.dom[l][i] == v {
				n++
			}
		}
		if n < u.count {
			return false
		}
	}
	return true
}

// bindingDevices marks the group's free devices that have binding
// conditions; nil if none has.
func (p *planner) bindingDevices(g *group) []bool {
	var marks []bool
	for _, u := range g.units {
		for _, i := range u.free {
			if len(p.ns.devices[i].device.BindingConditions) == 0 {
				continue
			}
			if marks == nil {
				marks = make([]bool, len(p.ns.devices))
			}
			marks[i] = true
		}
	}
	return marks
}

// plainFree counts the available devices of the group's requests in domain
// (l, v) that have no binding conditions.
func (p *planner) plainFree(g *group, avail, binding []bool, l int, v int32) int {
	seen := make(map[int]bool)
	for _, u := range g.units {
		for _, i := range u.free {
			if avail[i] && !binding[i] && p.ns.dom[l][i] == v {
				seen[i] = true
			}
		}
	}
	return len(seen)
}

// sortCandidates sorts the candidates of one level: domains that hold the
// group without devices that have binding conditions first (the stock
// allocator tries those last: they delay binding and can fail), then best
// fit (least slack; most when spreading), then the enclosing domains, then
// value.
func (p *planner) sortCandidates(atLevel []candidate) {
	slices.SortFunc(atLevel, func(x, y candidate) int {
		if x.binding != y.binding {
			if x.binding {
				return 1
			}
			return -1
		}
		if x.slack != y.slack {
			if p.pack {
				return cmp.Compare(x.slack, y.slack)
			}
			return cmp.Compare(y.slack, x.slack)
		}
		for k := range x.enclosing {
			if x.enclosing[k] != y.enclosing[k] {
				if p.pack {
					return cmp.Compare(x.enclosing[k], y.enclosing[k])
				}
				return cmp.Compare(y.enclosing[k], x.enclosing[k])
			}
		}
		return cmp.Compare(x.value, y.value)
	})
}

// fill orders up to n of devs (node device indices in upstream order) the
// way they should be taken: at each level (coarse to fine), the best-fitting
// domain that holds all that is still needed; if none does, whole domains,
// largest first, and the remainder best-fit. That fills as few domains as
// possible and keeps large blocks free.
func (p *planner) fill(devs []int, n int, levels []int) []int {
	if n <= 0 {
		return nil
	}
	if len(devs) <= n || len(levels) == 0 {
		return devs[:min(n, len(devs))]
	}
	l := levels[0]
	ids := p.ns.dom[l]
	// Devices per value, in order of first appearance.
	var values []int32
	var members [][]int
	var missing []int
	for _, i := range devs {
		v := ids[i]
		if v < 0 {
			missing = append(missing, i)
			continue
		}
		k := slices.Index(values, v)
		if k < 0 {
			k = len(values)
			values = append(values, v)
			members = append(members, nil)
		}
		members[k] = append(members[k], i)
	}
	var result []int
	remaining := n
	for remaining > 0 && len(members) > 0 {
		// Best fit among the domains that hold the remainder.
		best := -1
		for k, m := range members {
			if len(m) < remaining {
				continue
			}
			if best < 0 || (p.pack && len(m) < len(members[best])) || (!p.pack && len(m) > len(members[best])) {
				best = k
			}
		}
		if best >= 0 {
			return append(result, p.fill(members[best], remaining, levels[1:])...)
		}
		// None holds it: take the largest domain whole.
		largest := 0
		for k, m := range members {
			if len(m) > len(members[largest]) {
				largest = k
			}
		}
		result = append(result, p.fill(members[largest], len(members[largest]), levels[1:])...)
		remaining -= len(members[largest])
		members = slices.Delete(members, largest, largest+1)
	}
	if remaining > 0 {
		result = append(result, missing[:min(remaining, len(missing))]...)
	}
	return result
}

// coarseToFine returns the levels in reverse priority order, without skip.
func (p *planner) coarseToFine(skip int) []int {
	levels := make([]int, 0, p.levels)
	for l := p.levels - 1; l >= 0; l-- {
		if l != skip {
			levels = append(levels, l)
		}
	}
	return levels
}

// pickIn chooses g's devices, within domain d when d is not nil.
func (p *planner) pickIn(g *group, d *domainRef, avail []bool) []int {
	taken := map[int]bool{}
	var picks []int
	skip := -1
	if d != nil {
		skip = d.level
	}
	levels := p.coarseToFine(skip)
	for _, u := range g.units {
		var devs []int
		for _, i := range u.free {
			if !avail[i] || taken[i] {
				continue
			}
			if d != nil && p.ns.dom[d.level][i] != d.id {
				continue
			}
			devs = append(devs, i)
		}
		chosen := p.fill(devs, u.count, levels)
		for _, i := range chosen {
			taken[i] = true
		}
		picks = append(picks, chosen...)
	}
	return picks
}

// plans returns up to maxPlans plans. Plan 0 gives every group its best
// domain, groups with alignment require first and otherwise in claim
// order, each group using what earlier groups left: a required group is
// never crowded out of its domain by a group that only prefers alignment.
// Later plans try the next domains of the first multi-device group in that
// order.
func (p *planner) plans(maxPlans int) []plan {
	var result []plan
	order := make([]int, 0, len(p.groups))
	for gi, g := range p.groups {
		if g.mode == AlignmentRequire {
			order = append(order, gi)
		}
	}
	for gi, g := range p.groups {
		if g.mode != AlignmentRequire {
			order = append(order, gi)
		}
	}
	first := -1
	for _, gi := range order {
		if p.groups[gi].need > 1 {
			first = gi
			break
		}
	}
	var firstDomains []candidate
	for attempt := 0; attempt < maxPlans; attempt++ {
		avail := make([]bool, len(p.ns.devices))
		for i := range avail {
			avail[i] = true
		}
		pl := plan{domains: make([]*domainRef, len(p.groups)), picks: make([][]int, len(p.groups))}
		for _, gi := range order {
			g := p.groups[gi]
			domains := p.fittingDomains(g, avail, gi == first && maxPlans > 2)
			if gi == first && attempt == 0 {
				firstDomains = domains
			}
			var d *domainRef
			switch {
			case gi == first && attempt < len(firstDomains):
				d = &firstDomains[attempt].domainRef
			case gi == first && attempt > 0:
				// No further domains for the first group.
				return result
			case len(domains) > 0:
				d = &domains[0].domainRef
			}
			pl.domains[gi] = d
			pl.picks[gi] = p.pickIn(g, d, avail)
			for _, i := range pl.picks[gi] {
				avail[i] = false
			}
		}
		result = append(result, pl)
		if first < 0 {
			break
		}
	}
	return result
}
