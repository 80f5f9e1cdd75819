package allocator

import (
	"cmp"
	"fmt"
	"slices"

	resourceapi "k8s.io/api/resource/v1"
)

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
// counters are never hidden, nor are slices, so that no pool turns valid or
// complete in a view (devices of incomplete and invalid pools are not node
// devices: their slices stay as they are).
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

	view := slices.Clone(ns.slices)
	runs := ns.sliceRuns()
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
			// after this node's; those whose node selection fails do not
			// (nodeState.unsure), since upstream never allocates them
			// and would report their error where it finds no device of
			// the node before them.
			onNode := make([]bool, len(slice.Spec.Devices))
			for i := r.from; i < r.to; i++ {
				onNode[ns.devices[i].deviceIndex] = true
			}
			for j := range slice.Spec.Devices {
				if !onNode[j] && !ns.isUnsure(slice, j) {
					newDevices = append(newDevices, slice.Spec.Devices[j])
				}
			}
		}
		c := *slice
		c.Spec.Devices = newDevices
		view[r.si] = &c
		changed = append(changed, poolKey{slice.Spec.Driver, slice.Spec.Pool.Name})
	}
	renameReordered(view, changed, runs, rank)
	return view
}

// sliceRun is the devices of one slice in nodeState.devices: si is the
// index in nodeState.slices, [from, to) the device range.
type sliceRun struct{ si, from, to int }

// sliceRuns splits the node's devices by slice (the devices of one slice
// are contiguous).
func (ns *nodeState) sliceRuns() []sliceRun {
	var runs []sliceRun
	for i := range ns.devices {
		si := ns.devices[i].sliceIndex
		if len(runs) == 0 || runs[len(runs)-1].si != si {
			runs = append(runs, sliceRun{si: si, from: i})
		}
		runs[len(runs)-1].to = i + 1
	}
	return runs
}

// renameReordered renames the slices of pools that have several changed
// slices (changed lists the pool of every changed slice), so that upstream,
// which walks a pool's slices in name order, reaches the slice with the
// best-ranked device first.
func renameReordered(view []*resourceapi.ResourceSlice, changed []poolKey, runs []sliceRun, rank []int64) {
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
}

// keeper reports whether device i must stay in every view.
func (p *planner) keeper(i int) bool {
	d := &p.ns.devices[i]
	return len(d.device.ConsumesCounters) > 0
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
		if !grouped[u] && !p.passed[u] {
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
		if aligned[u] || p.passed[u] {
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

// chosenOnly returns the node's view with only the devices of allocations
// visible among the devices upstream may allocate on the node: each
// claim's devices in claim order, since upstream assigns visible devices
// first-fit in claim order. Everything else stays as it is (slices, so
// that pools stay complete; devices that consume counters; devices of
// incomplete or invalid pools, of other generations and of other nodes,
// which upstream does not allocate), so that no pool turns valid or
// complete in the view; devices whose node selection fails
// (nodeState.unsure) are hidden too.
func chosenOnly(ns *nodeState, allocations []resourceapi.AllocationResult) []*resourceapi.ResourceSlice {
	rank := map[[3]string]int{}
	for _, alloc := range allocations {
		for _, r := range alloc.Devices.Results {
			rank[[3]string{r.Driver, r.Pool, r.Device}] = len(rank)
		}
	}
	const others = 1 << 30
	view := slices.Clone(ns.slices)
	var hidden []bool
	for _, r := range ns.sliceRuns() {
		slice := ns.slices[r.si]
		hidden = append(hidden[:0], make([]bool, len(slice.Spec.Devices))...)
		for i := r.from; i < r.to; i++ {
			d := &ns.devices[i]
			_, chosen := rank[[3]string{d.driver, slice.Spec.Pool.Name, d.device.Name}]
			hidden[d.deviceIndex] = !chosen && len(d.device.ConsumesCounters) == 0
		}
		for _, u := range ns.unsure {
			if u.slice == slice {
				hidden[u.index] = true
			}
		}
		devices := make([]resourceapi.Device, 0, len(slice.Spec.Devices))
		for j := range slice.Spec.Devices {
			if !hidden[j] {
				devices = append(devices, slice.Spec.Devices[j])
			}
		}
		pos := func(d resourceapi.Device) int {
			if r, ok := rank[[3]string{slice.Spec.Driver, slice.Spec.Pool.Name, d.Name}]; ok {
				return r
			}
			return others
		}
		slices.SortStableFunc(devices, func(a, b resourceapi.Device) int { return cmp.Compare(pos(a), pos(b)) })
		if len(devices) != len(slice.Spec.Devices) || !sameOrder(devices, slice.Spec.Devices) {
			c := *slice
			c.Spec.Devices = devices
			view[r.si] = &c
		}
	}
	return view
}

func sameOrder(a, b []resourceapi.Device) bool {
	for i := range a {
		if a[i].Name != b[i].Name {
			return false
		}
	}
	return true
}
