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
func (p *planner) fittingDomains(g *group, avail []bool) []candidate {
	union := map[int]bool{}
	for _, u := range g.units {
		for _, i := range u.free {
			if avail[i] {
				union[i] = true
			}
		}
	}
	sizeAt := make([]map[string]int, p.levels)
	for l := range p.levels {
		sizeAt[l] = map[string]int{}
	}
	for i := range union {
		for l, v := range p.ns.devices[i].coords {
			if v != "" {
				sizeAt[l][v]++
			}
		}
	}
	var result []candidate
	for l := range p.levels {
		var atLevel []candidate
		for v, size := range sizeAt[l] {
			if size < g.need {
				continue
			}
			fits := true
			for _, u := range g.units {
				n := 0
				for _, i := range u.free {
					if avail[i] && p.ns.devices[i].coords[l] == v {
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
			c := candidate{domainRef: domainRef{level: l, value: v}, slack: size - g.need}
			// Enclosing sizes, from the first device of the domain in
			// upstream order.
			first := -1
			for i := range union {
				if p.ns.devices[i].coords[l] == v && (first < 0 || i < first) {
					first = i
				}
			}
			for k := range p.levels {
				if k == l {
					continue
				}
				if ev := p.ns.devices[first].coords[k]; ev != "" {
					c.enclosing = append(c.enclosing, sizeAt[k][ev])
				} else {
					c.enclosing = append(c.enclosing, math.MaxInt32)
				}
			}
			atLevel = append(atLevel, c)
		}
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
		result = append(result, atLevel...)
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
	byValue := map[string][]int{}
	var missing []int
	var values []string
	for _, i := range devs {
		v := p.ns.devices[i].coords[l]
		if v == "" {
			missing = append(missing, i)
			continue
		}
		if _, ok := byValue[v]; !ok {
			values = append(values, v)
		}
		byValue[v] = append(byValue[v], i)
	}
	var result []int
	remaining := n
	for remaining > 0 && len(values) > 0 {
		// Best fit among the domains that hold the remainder.
		best := ""
		for _, v := range values {
			size := len(byValue[v])
			if size < remaining {
				continue
			}
			if best == "" || (p.pack && size < len(byValue[best])) || (!p.pack && size > len(byValue[best])) {
				best = v
			}
		}
		if best != "" {
			result = append(result, p.fill(byValue[best], remaining, levels[1:])...)
			return result
		}
		// None holds it: take the largest domain whole.
		largest := values[0]
		for _, v := range values[1:] {
			if len(byValue[v]) > len(byValue[largest]) {
				largest = v
			}
		}
		result = append(result, p.fill(byValue[largest], len(byValue[largest]), levels[1:])...)
		remaining -= len(byValue[largest])
		values = slices.DeleteFunc(values, func(v string) bool { return v == largest })
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
			if d != nil && p.ns.devices[i].coords[d.level] != d.value {
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
			domains := p.fittingDomains(g, avail)
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
				if m && rank[i] >= others && ns.devices[i].coords[d.level] == d.value {
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

	// Group device indices per slice.
	perSlice := map[int][]int{}
	for i := range ns.devices {
		si := ns.devices[i].sliceIndex
		perSlice[si] = append(perSlice[si], i)
	}
	view := slices.Clone(ns.slices)
	changed := map[poolKey]int{}
	for si, devs := range perSlice {
		slice := ns.slices[si]
		ordered := slices.Clone(devs)
		slices.SortStableFunc(ordered, func(x, y int) int { return cmp.Compare(rank[x], rank[y]) })
		onNode := map[int]bool{}
		for _, i := range devs {
			onNode[ns.devices[i].deviceIndex] = true
		}
		newDevices := make([]resourceapi.Device, 0, len(slice.Spec.Devices))
		for _, i := range ordered {
			if excluded != nil && excluded[i] {
				continue
			}
			newDevices = append(newDevices, *ns.devices[i].device)
		}
		for j := range slice.Spec.Devices {
			if !onNode[j] {
				newDevices = append(newDevices, slice.Spec.Devices[j])
			}
		}
		c := *slice
		c.Spec.Devices = newDevices
		view[si] = &c
		changed[poolKey{slice.Spec.Driver, slice.Spec.Pool.Name}]++
	}
	// Upstream walks the slices of a pool by name. Where a pool has several
	// slices with devices for this node, rename them in the view so that the
	// slice holding the most preferred device comes first. Names never
	// leave the view: allocation results only name driver, pool and device.
	for key, n := range changed {
		if n < 2 {
			continue
		}
		for si, slice := range view {
			if slice.Spec.Driver != key.driver || slice.Spec.Pool.Name != key.pool {
				continue
			}
			best := int64(1<<50) + int64(si)
			for _, i := range perSlice[si] {
				best = min(best, rank[i])
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
				if ns.devices[i].coords[d.level] == d.value {
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
