package allocator

import (
	"cmp"
	"fmt"
	"math"
	"slices"

	resourceapi "k8s.io/api/resource/v1"
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
	sizes := make([]int, 2*total)
	sizeAt := make([][]int, p.levels)
	firstAt := make([][]int, p.levels)
	off := 0
	for l := range p.levels {
		n := len(ns.domVals[l])
		sizeAt[l] = sizes[off : off+n]
		firstAt[l] = sizes[total+off : total+off+n]
		off += n
		for v := range firstAt[l] {
			firstAt[l][v] = math.MaxInt
		}
	}
	for _, i := range union {
		for l := range p.levels {
			if v := ns.dom[l][i]; v >= 0 {
				sizeAt[l][v]++
				firstAt[l][v] = min(firstAt[l][v], i)
			}
		}
	}
	// Domain sizes: how many devices matching the group's requests (free
	// or not) each domain has. Levels are tried smallest domain first, so
	// that the tightest domain wins whatever the attribute: on a DGX four
	// GPUs go to a NUMA node before the NVSwitch clique of all eight.
	totalAt := make([][]int, p.levels)
	for l := range p.levels {
		totalAt[l] = make([]int, len(ns.domVals[l]))
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
				totalAt[l][v]++
			}
		}
	}
	type levelRank struct{ level, minTotal int }
	var ranked []levelRank
	for l := range p.levels {
		best := math.MaxInt
		for v, size := range sizeAt[l] {
			if size >= g.need {
				best = min(best, totalAt[l][v])
			}
		}
		if best < math.MaxInt {
			ranked = append(ranked, levelRank{l, best})
		}
	}
	slices.SortStableFunc(ranked, func(x, y levelRank) int { return cmp.Compare(x.minTotal, y.minTotal) })

	var result []candidate
	var enclosing []int // backing array of all candidates' enclosing sizes
	for _, rank := range ranked {
		l := rank.level
		if !allLevels && len(result) > 0 {
			break
		}
		start := len(result)
		for v, size := range sizeAt[l] {
			if size < g.need {
				continue
			}
			fits := true
			for _, u := range g.units {
				n := 0
				for _, i := range u.free {
					if avail[i] && ns.dom[l][i] == int32(v) {
						n++
					}
				}
				if n < u.count {
					fits = false
					break
				}
			}
			if !fits {
				continue
			}
			c := candidate{domainRef: domainRef{level: l, value: ns.domVals[l][v], id: int32(v)}, slack: size - g.need}
			first := firstAt[l][v]
			if enclosing == nil {
				enclosing = make([]int, 0, len(ns.domVals[l])*(p.levels-1))
			}
			from := len(enclosing)
			for k := range p.levels {
				if k == l {
					continue
				}
				if ev := ns.dom[k][first]; ev >= 0 {
					enclosing = append(enclosing, sizeAt[k][ev])
				} else {
					enclosing = append(enclosing, math.MaxInt32)
				}
			}
			c.enclosing = enclosing[from:len(enclosing):len(enclosing)]
			result = append(result, c)
		}
		atLevel := result[start:]
		slices.SortFunc(atLevel, func(x, y candidate) int {
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
	return result
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
// domain, in claim order, each group using what earlier groups left. Later
// plans try the next domains of the first multi-device group.
func (p *planner) plans(maxPlans int) []plan {
	var result []plan
	first := -1
	for gi, g := range p.groups {
		if g.need > 1 {
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
		for gi, g := range p.groups {
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

// viewKind selects which devices a view shows.
type viewKind int

const (
	// viewAll shows every device, preferred ones first.
	viewAll viewKind = iota
	// viewDomains hides the devices that only multi-device aligned groups
	// could use and that are outside their chosen domains.
	viewDomains
	// viewPicks shows only the picked devices and the devices that
	// requests outside the groups can use.
	viewPicks
)

// viewFor builds the slices that upstream gets for a plan: picked devices
// first (in pick order), then the rest of the chosen domains, then all other
// devices in upstream's order, minus what kind hides. Devices that consume
// counters, and pools with duplicate device names, are never hidden, so that
// no invalid pool turns valid in a view; neither are slices, so that pools
// stay complete.
func (p *planner) viewFor(pl *plan, kind viewKind) []*resourceapi.ResourceSlice {
	ns := p.ns
	const others = 1 << 40
	rank := make([]int64, len(ns.devices))
	for i := range rank {
		rank[i] = others + int64(i)
	}
	next := int64(0)
	for _, picks := range pl.picks {
		for _, i := range picks {
			if rank[i] >= others {
				rank[i] = next
				next++
			}
		}
	}
	for gi, d := range pl.domains {
		if d == nil {
			continue
		}
		for _, u := range p.groups[gi].units {
			for i, m := range u.matching {
				if m && rank[i] >= others && ns.dom[d.level][i] == d.id {
					rank[i] = others/2 + int64(i)
				}
			}
		}
	}
	var excluded []bool
	switch kind {
	case viewDomains:
		excluded = p.exclusions(pl)
	case viewPicks:
		excluded = p.picksOnly(pl, rank, others)
	}

	// Devices of one slice are contiguous in ns.devices.
	view := slices.Clone(ns.slices)
	type run struct{ si, from, to int }
	var runs []run
	for i := range ns.devices {
		si := ns.devices[i].sliceIndex
		if len(runs) == 0 || runs[len(runs)-1].si != si {
			runs = append(runs, run{si: si, from: i})
		}
		runs[len(runs)-1].to = i + 1
	}
	var changed []poolKey
	ordered := make([]int, 0, len(ns.devices))
	for _, r := range runs {
		slice := ns.slices[r.si]
		ordered = ordered[:0]
		for i := r.from; i < r.to; i++ {
			if excluded == nil || !excluded[i] {
				ordered = append(ordered, i)
			}
		}
		slices.SortStableFunc(ordered, func(x, y int) int { return cmp.Compare(rank[x], rank[y]) })
		newDevices := make([]resourceapi.Device, 0, len(ordered))
		for _, i := range ordered {
			newDevices = append(newDevices, *ns.devices[i].device)
		}
		if r.to-r.from < len(slice.Spec.Devices) {
			// Devices for other nodes (per-device node selection) stay,
			// after this node's.
			onNode := make([]bool, len(slice.Spec.Devices))
			for i := r.from; i < r.to; i++ {
				onNode[ns.devices[i].deviceIndex] = true
			}
			for j := range slice.Spec.Devices {
				if !onNode[j] {
					newDevices = append(newDevices, slice.Spec.Devices[j])
				}
			}
		}
		c := *slice
		c.Spec.Devices = newDevices
		view[r.si] = &c
		changed = append(changed, poolKey{slice.Spec.Driver, slice.Spec.Pool.Name})
	}
	slices.SortFunc(changed, func(x, y poolKey) int {
		return cmp.Or(cmp.Compare(x.driver, y.driver), cmp.Compare(x.pool, y.pool))
	})
	var renamePools []poolKey
	for k := 1; k < len(changed); k++ {
		if changed[k] == changed[k-1] && !slices.Contains(renamePools, changed[k]) {
			renamePools = append(renamePools, changed[k])
		}
	}
	for _, key := range renamePools {
		for si, slice := range view {
			if slice.Spec.Driver != key.driver || slice.Spec.Pool.Name != key.pool {
				continue
			}
			best := int64(1<<50) + int64(si)
			for _, r := range runs {
				if r.si == si {
					for i := r.from; i < r.to; i++ {
						best = min(best, rank[i])
					}
				}
			}
			c := *slice
			c.Name = fmt.Sprintf("%016x-%s", best, slice.Name)
			view[si] = &c
		}
	}
	return view
}

// keeper reports whether device i must stay in every view.
func (p *planner) keeper(i int) bool {
	d := &p.ns.devices[i]
	return len(d.device.ConsumesCounters) > 0 || p.ns.dupPools[d.slice.Spec.Driver+"/"+d.slice.Spec.Pool.Name]
}

// picksOnly marks all devices except the picked ones, those that requests
// outside the groups may use, and keepers.
func (p *planner) picksOnly(pl *plan, rank []int64, others int64) []bool {
	excluded := make([]bool, len(p.ns.devices))
	grouped := map[*unit]bool{}
	for _, g := range p.groups {
		for _, u := range g.units {
			grouped[u] = true
		}
	}
	var open []*unit
	for _, u := range p.allUnits {
		if !grouped[u] {
			open = append(open, u)
		}
	}
	for i := range excluded {
		if rank[i] < others/2 || p.keeper(i) {
			continue
		}
		used := false
		for _, u := range open {
			if u.matching[i] {
				used = true
				break
			}
		}
		excluded[i] = !used
	}
	return excluded
}

// exclusions marks the devices that a filtered view leaves out.
func (p *planner) exclusions(pl *plan) []bool {
	ns := p.ns
	excluded := make([]bool, len(ns.devices))
	inGroup := make([]bool, len(ns.devices)) // matched by an aligned multi-device group
	allowed := make([]bool, len(ns.devices)) // inside the domain of such a group
	for gi, d := range pl.domains {
		g := p.groups[gi]
		if d == nil || g.need < 2 {
			continue
		}
		for _, u := range g.units {
			for i, m := range u.matching {
				if !m {
					continue
				}
				inGroup[i] = true
				if ns.dom[d.level][i] == d.id {
					allowed[i] = true
				}
			}
		}
	}
	// Units outside those groups keep all their devices.
	aligned := map[*unit]bool{}
	for gi, d := range pl.domains {
		if d != nil && p.groups[gi].need >= 2 {
			for _, u := range p.groups[gi].units {
				aligned[u] = true
			}
		}
	}
	for _, u := range p.allUnits {
		if aligned[u] {
			continue
		}
		for i, m := range u.matching {
			if m {
				allowed[i] = true
			}
		}
	}
	for i := range excluded {
		if !inGroup[i] || allowed[i] || p.keeper(i) {
			continue
		}
		excluded[i] = true
	}
	return excluded
}
