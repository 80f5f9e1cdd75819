package allocator

import (
	"math"
	"slices"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/topodra/topodra/pkg/topology"
)

// quality measures an allocation on the node: the one Quality computation
// of this package, whichever strategy found the allocation. units are all
// requests and subrequests of the pod: their matching devices are the
// population that packing and domain sizes count.
func (a *Allocator) quality(ns *nodeState, infos []*claimInfo, units []*unit, results []resourceapi.AllocationResult) Quality {
	L := len(a.policy.Attributes)
	var q Quality
	seen := make([]bool, len(ns.devices))
	var devs []int
	perClaim := make([][]int, len(results))
	for ci := range results {
		for k := range results[ci].Devices.Results {
			i := ns.lookup(&results[ci].Devices.Results[k])
			if i < 0 {
				continue
			}
			perClaim[ci] = append(perClaim[ci], i)
			if !seen[i] {
				seen[i] = true
				devs = append(devs, i)
				q.Devices = append(q.Devices, ns.devices[i].name)
			}
		}
	}
	matching, nodeUtil := usage(ns, units, seen)
	for i, m := range matching {
		if m {
			q.NodeDevices++
			if ns.busy[i] {
				q.NodeInUse++
			}
		}
	}
	domains := sharedDomains(ns, L, devs, matching, seen)

	coords := make([]topology.Coordinates, len(devs))
	for k, i := range devs {
		coords[k] = ns.devices[i].coords
	}
	q.Level, q.LevelName, q.Domain, q.DomainsSpanned = a.levelOf(coords)
	if len(devs) > 1 && q.Level < L {
		// Of the domains the devices share, report the smallest (ties:
		// the attribute listed first). On a DGX the NVSwitch clique holds
		// all eight GPUs, so four GPUs in one NUMA node are better aligned
		// than four GPUs that only share the clique.
		best := q.Level
		for l, d := range domains {
			if d != nil && d.size < domains[best].size {
				best = l
			}
		}
		q.Level, q.LevelName = best, string(a.policy.Attributes[best])
		q.Domain = topology.FormatDomain(a.policy.Attributes[best], domains[best].value)
	}
	q.Aligned = a.aligned(ns, infos, perClaim)

	// Packing: node usage and the fullness of the domains the devices
	// share, all levels (a single device shares each of its domains): a
	// GPU goes into a half-used NUMA node before it breaks up a whole one,
	// even where both sit in one NVLink clique.
	var full fullness
	for _, d := range domains {
		if d != nil {
			full.add(d.busy, d.size)
		}
	}
	q.Packing = full.packing(nodeUtil)
	q.Room, q.BreaksNode = room(ns, matching, devs, a.policy.WholeNode)
	if len(devs) >= a.policy.WholeNode {
		q.StrandedRoots = a.strandedRoots(ns, matching, seen)
	}
	q.Shared = L
	if len(devs) > 1 {
		q.Shared = 0
		for _, d := range domains {
			if d != nil {
				q.Shared++
			}
		}
	}

	// Tightness: every domain the devices share counts, by how little of
	// it is left over: a DGX pair under one PCIe root (which also shares a
	// NUMA node and the NVSwitch clique) beats an NVLink-bridged pair of a
	// PCIe box, which beats two GPUs behind one PCIe switch.
	q.Tightness = 1
	if len(devs) > 1 && L > 0 {
		sum := 0.0
		for _, d := range domains {
			if d != nil && d.size > 0 {
				sum += min(1, float64(len(devs))/float64(d.size))
			}
		}
		q.Tightness = sum / float64(L)
	}
	q.Score = a.policy.Score(q)
	return q
}

// room computes Quality.Room and Quality.BreaksNode for the chosen devices
// devs: the whole node and each domain that holds one of them count as a
// block of the devices that match the pod's requests; whole devices make
// a whole node (Policy.WholeNode).
func room(ns *nodeState, matching []bool, devs []int, whole int) (float64, bool) {
	if len(devs) == 0 {
		return 1, false
	}
	breaksNode := false
	type block struct{ size, first int }
	var broken []block
	cost := 0.0
	// free reports the size and first device of the block of matching
	// devices for which in(i) holds, and whether none of them is in use.
	free := func(in func(i int) bool) (block, bool) {
		b := block{first: -1}
		ok := true
		for i := range ns.devices {
			if !matching[i] || !in(i) {
				continue
			}
			if b.first < 0 {
				b.first = i
			}
			b.size++
			ok = ok && !ns.busy[i]
		}
		return b, ok && b.size > 0
	}
	if b, ok := free(func(int) bool { return true }); ok {
		broken = append(broken, b)
		cost += BlockCost(b.size, whole)
		breaksNode = b.size >= whole
	}
	for l := range ns.dom {
		var seen []int32
		for _, d := range devs {
			v := ns.dom[l][d]
			if v < 0 || slices.Contains(seen, v) {
				continue
			}
			seen = append(seen, v)
			b, ok := free(func(i int) bool { return ns.dom[l][i] == v })
			// Nested blocks of one size are the same devices (a DGX's
			// NVSwitch clique is the whole node): count them once.
			if ok && !slices.Contains(broken, b) {
				broken = append(broken, b)
				cost += BlockCost(b.size, whole)
				breaksNode = breaksNode || b.size >= whole
			}
		}
	}
	return max(0, 1-cost), breaksNode
}

// usage returns which devices match some unit, and the share of them that
// is in use or chosen (1 if none matches).
func usage(ns *nodeState, units []*unit, chosen []bool) ([]bool, float64) {
	matching := make([]bool, len(ns.devices))
	total, used := 0, 0
	for _, u := range units {
		for i, m := range u.matching {
			if m && !matching[i] {
				matching[i] = true
				total++
				if ns.busy[i] || chosen[i] {
					used++
				}
			}
		}
	}
	if total == 0 {
		return matching, 1
	}
	return matching, float64(used) / float64(total)
}

// sharedDomain is a domain that all chosen devices share, with its matching
// devices (size) and those in use or chosen (busy).
type sharedDomain struct {
	value      string
	size, busy int
}

// sharedDomains returns, per level, the domain all devs share, or nil.
func sharedDomains(ns *nodeState, levels int, devs []int, matching, chosen []bool) []*sharedDomain {
	domains := make([]*sharedDomain, levels)
	for l := range levels {
		v, ok := sharedValue(ns, l, devs)
		if !ok {
			continue
		}
		d := &sharedDomain{value: v}
		for i := range ns.devices {
			if matching[i] && ns.devices[i].coords[l] == v {
				d.size++
				if ns.busy[i] || chosen[i] {
					d.busy++
				}
			}
		}
		domains[l] = d
	}
	return domains
}

// aligned reports whether every multi-device claim and the align-with=pod
// group share a domain; perClaim are the devices of each claim.
func (a *Allocator) aligned(ns *nodeState, infos []*claimInfo, perClaim [][]int) bool {
	L := len(a.policy.Attributes)
	if L == 0 {
		return true
	}
	var podDevs []int
	for ci, info := range infos {
		if len(perClaim[ci]) > 1 {
			if level, _ := a.sharedLevel(ns, perClaim[ci]); level >= L {
				return false
			}
		}
		if info.alignPod {
			podDevs = append(podDevs, perClaim[ci]...)
		}
	}
	if len(podDevs) > 1 {
		if level, _ := a.sharedLevel(ns, podDevs); level >= L {
			return false
		}
	}
	return true
}

// fullness averages how full the domains shared by an allocation's
// devices are afterwards.
type fullness struct {
	sum float64
	n   int
}

func (f *fullness) add(busy, size int) {
	if size > 0 {
		f.sum += min(1, float64(busy)/float64(size))
		f.n++
	}
}

// packing is Quality.Packing: the mean of node usage and the shared
// domains' mean fullness (node usage where the devices share none).
func (f fullness) packing(nodeUtil float64) float64 {
	mean := nodeUtil
	if f.n > 0 {
		mean = f.sum / float64(f.n)
	}
	return (nodeUtil + mean) / 2
}

// levelOf computes Quality.Level, LevelName, Domain and DomainsSpanned for
// the coordinates of the chosen devices.
func (a *Allocator) levelOf(coords []topology.Coordinates) (level int, name, domain string, spanned int) {
	L := len(a.policy.Attributes)
	switch {
	case L == 0:
		return 0, "node", "", 1
	case len(coords) <= 1:
		for l := range L {
			if len(coords) == 1 && coords[0][l] != "" {
				domain = topology.FormatDomain(a.policy.Attributes[l], coords[0][l])
				break
			}
		}
		// A single device is aligned by definition.
		return 0, "device", domain, 1
	}
	for l := range L {
		v := coords[0][l]
		shared := v != ""
		for _, c := range coords[1:] {
			if c[l] != v {
				shared = false
				break
			}
		}
		if shared {
			return l, string(a.policy.Attributes[l]), topology.FormatDomain(a.policy.Attributes[l], v), 1
		}
	}
	spanned = math.MaxInt
	for l := range L {
		var values []string
		n := 0
		for _, c := range coords {
			switch {
			case c[l] == "":
				n++
			case !slices.Contains(values, c[l]):
				values = append(values, c[l])
				n++
			}
		}
		spanned = min(spanned, n)
	}
	return L, "node", "", spanned
}

// leftover sums, over the topology levels, the free matching devices that
// the domains of the chosen devices keep after the allocation: lower is a
// tighter fit.
func leftover(ns *nodeState, allUnits []*unit, results []resourceapi.AllocationResult) int {
	chosen := make([]bool, len(ns.devices))
	var devs []int
	for ci := range results {
		for k := range results[ci].Devices.Results {
			if i := ns.lookup(&results[ci].Devices.Results[k]); i >= 0 && !chosen[i] {
				chosen[i] = true
				devs = append(devs, i)
			}
		}
	}
	matching := make([]bool, len(ns.devices))
	for _, u := range allUnits {
		for i, m := range u.matching {
			matching[i] = matching[i] || m
		}
	}
	sum := 0
	for l := range ns.dom {
		var values []int32
		for _, i := range devs {
			if v := ns.dom[l][i]; v >= 0 && !slices.Contains(values, v) {
				values = append(values, v)
			}
		}
		for i := range ns.devices {
			if matching[i] && !chosen[i] && !ns.busy[i] && slices.Contains(values, ns.dom[l][i]) {
				sum++
			}
		}
	}
	return sum
}

// strandedRoots computes Quality.StrandedRoots. chosen marks the devices
// of the allocation; ns.inUse does not include them yet.
func (a *Allocator) strandedRoots(ns *nodeState, matching, chosen []bool) int {
	l := slices.Index(a.policy.Attributes, topology.AttrPCIeRoot)
	if l < 0 || l >= len(ns.dom) || len(ns.domVals[l]) == 0 {
		return 0
	}
	var drivers []string
	for i := range ns.devices {
		if matching[i] && !slices.Contains(drivers, ns.devices[i].driver) {
			drivers = append(drivers, ns.devices[i].driver)
		}
	}
	type root struct {
		free, taken int
		otherFree   bool
	}
	roots := make([]root, len(ns.domVals[l]))
	for i := range ns.devices {
		v := ns.dom[l][i]
		if v < 0 || ns.busy[i] {
			continue
		}
		r := &roots[v]
		switch {
		case matching[i]:
			r.free++
			if chosen[i] {
				r.taken++
			}
		case !slices.Contains(drivers, ns.devices[i].driver):
			r.otherFree = true
		}
	}
	n := 0
	for _, r := range roots {
		if r.otherFree && r.free > 0 && r.taken == r.free {
			n++
		}
	}
	return n
}

// otherDevices counts Quality.OtherDevices and Quality.OtherFree: the
// node's own devices (not network-attached ones, which are not the node's
// to pair with its GPUs) of drivers that no device matching units has,
// that sit on a PCIe root (pcieRoot must be one of Policy.Attributes)
// shared with a device matching units, and the free ones among them. So
// a GPU-only pod sees the NICs beside the node's GPUs, not the devices of
// a CPU or memory driver, which have no PCIe root. Without units (nothing
// analysed) or without pcieRoot both are 0.
func (a *Allocator) otherDevices(ns *nodeState, units []*unit) (all, free int) {
	l := slices.Index(a.policy.Attributes, topology.AttrPCIeRoot)
	if len(units) == 0 || l < 0 || l >= len(ns.dom) || len(ns.domVals[l]) == 0 {
		return 0, 0
	}
	var drivers []string
	roots := make([]bool, len(ns.domVals[l]))
	for _, u := range units {
		for i, m := range u.matching {
			if !m {
				continue
			}
			if !slices.Contains(drivers, ns.devices[i].driver) {
				drivers = append(drivers, ns.devices[i].driver)
			}
			if v := ns.dom[l][i]; v >= 0 {
				roots[v] = true
			}
		}
	}
	for i := range ns.devices {
		d := &ns.devices[i]
		v := ns.dom[l][i]
		if d.slice.Spec.NodeName == nil || v < 0 || !roots[v] || slices.Contains(drivers, d.driver) {
			continue
		}
		all++
		if !ns.busy[i] {
			free++
		}
	}
	return all, free
}
