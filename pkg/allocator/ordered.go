package allocator

import (
	"context"
	"errors"
	"math"
	"slices"
	"sync"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/topology"
)

// The ordered view serves pods whose claims each need one device: for them
// the preference does not depend on the claim, only on which devices are in
// use. Once per cycle, every pool's devices are sorted best-fit (devices in
// the fullest domains first, tightest attribute first) and one upstream
// allocator is built over all slices, exactly as the stock plugin builds
// its own. Allocate then costs what upstream's costs: first-fit over the
// sorted devices picks the best-fitting device, and since only the order
// differs, it allocates exactly when upstream does.

// orderedState is the lazily built ordered view of a cycle.
type orderedState struct {
	once  sync.Once
	alloc structured.Allocator
	err   error
	// stats per pool and infos per device slice; written inside once,
	// read-only afterwards.
	stats map[poolKey]*poolStats
	infos map[*resourceapi.ResourceSlice]*sliceInfo
}

// allocateOrdered allocates a simple pod on the ordered view.
func (a *Allocator) allocateOrdered(ctx context.Context, node *v1.Node, claims []*resourceapi.ResourceClaim) (*Result, error) {
	up, err := a.orderedUpstream(ctx)
	if err != nil {
		return nil, err
	}
	results, err := up.Allocate(ctx, node, claims)
	if err != nil {
		if ctx.Err() == nil && errors.Is(err, structured.ErrFailedAllocationOnNode) {
			return &Result{Explanation: nodeFailure(claims, err)}, nil
		}
		return nil, a.explainFatal(ctx, node, claims, err)
	}
	if results != nil {
		if q, ok := a.orderedQuality(results); ok {
			if logger := klog.FromContext(ctx); logger.V(4).Enabled() {
				logger.V(4).Info("Allocated", "node", klog.KObj(node), "view", "ordered", "devices", q.Devices, "level", q.LevelName, "score", q.Score)
			}
			return &Result{Allocations: results, Quality: q}, nil
		}
	}
	ns, err := a.gatherNode(node)
	if err != nil {
		return nil, err
	}
	infos, _, err := a.analyze(ctx, ns, claims)
	if err != nil {
		return nil, err
	}
	if results == nil {
		return &Result{Explanation: a.explain(infos, ns, nil, false)}, nil
	}
	var allUnits []*unit
	for _, info := range infos {
		for _, r := range info.requests {
			allUnits = append(allUnits, r.alts...)
		}
	}
	return &Result{Allocations: results, Quality: a.quality(ns, infos, allUnits, results)}, nil
}

// orderedUpstream returns the upstream allocator over the ordered view.
func (a *Allocator) orderedUpstream(ctx context.Context) (structured.Allocator, error) {
	a.ordered.once.Do(func() {
		a.ordered.stats = make(map[poolKey]*poolStats, len(a.byPool))
		a.ordered.infos = make(map[*resourceapi.ResourceSlice]*sliceInfo, a.numSlices)
		view := make([]*resourceapi.ResourceSlice, 0, a.numSlices)
		var sc orderScratch
		for key, poolSlices := range a.byPool {
			view = a.appendOrderedPool(view, key, poolSlices, &sc)
		}
		a.ordered.alloc, a.ordered.err = structured.NewAllocator(ctx, a.features, a.state, a.classLister, view, a.celCache)
	})
	return a.ordered.alloc, a.ordered.err
}

// orderScratch holds buffers reused while ordering the pools of a cycle.
type orderScratch struct {
	inUse []bool
	keys  []int
	perm  []int
}

// poolStats describes a pool's devices per domain in this cycle; the ordered
// view sorts by it and quality reads it.
type poolStats struct {
	total, used int
	// vals[l] are the values of attribute l in the pool (shared with the
	// slice's sliceInfo when the pool has one device slice).
	vals [][]string
	// counts holds, per level l and value id, the pool's devices with that
	// value (size) and those free, at counts[2*(off(l)+id)] and +1.
	counts []int
	// remap[slice][l][local id] is the pool-level id of a slice-local
	// domain id (sliceInfo.dom); nil when the pool has one device slice.
	remap map[*resourceapi.ResourceSlice][][]int32
}

func (st *poolStats) off(l int) int {
	o := 0
	for k := range l {
		o += len(st.vals[k])
	}
	return o
}

func (st *poolStats) size(l int, id int32) int { return st.counts[2*(st.off(l)+int(id))] }
func (st *poolStats) free(l int, id int32) int { return st.counts[2*(st.off(l)+int(id))+1] }

// poolID returns the pool-level id of device j of slice at level l, or -1.
func (st *poolStats) poolID(slice *resourceapi.ResourceSlice, info *sliceInfo, levels, j, l int) int32 {
	local := info.dom[j*levels+l]
	if local < 0 || st.remap == nil {
		return local
	}
	return st.remap[slice][l][local]
}

// appendOrderedPool appends the pool's slices, with devices sorted, to view.
func (a *Allocator) appendOrderedPool(view []*resourceapi.ResourceSlice, key poolKey, poolSlices []*resourceapi.ResourceSlice, sc *orderScratch) []*resourceapi.ResourceSlice {
	generation := a.poolGen[key]
	levels := len(a.policy.Attributes)
	if levels == 0 {
		return append(view, poolSlices...)
	}
	st := &poolStats{}
	var deviceSlices []*resourceapi.ResourceSlice
	var infos []*sliceInfo
	for _, slice := range poolSlices {
		if slice.Spec.Pool.Generation == generation && len(slice.Spec.SharedCounters) == 0 && len(slice.Spec.Devices) > 0 {
			deviceSlices = append(deviceSlices, slice)
			info := a.sliceInfo(slice)
			infos = append(infos, info)
			a.ordered.infos[slice] = info
		}
	}
	// Domain values of the pool.
	if len(deviceSlices) == 1 {
		st.vals = infos[0].domVals
	} else {
		st.vals = make([][]string, levels)
		st.remap = make(map[*resourceapi.ResourceSlice][][]int32, len(deviceSlices))
		for s, slice := range deviceSlices {
			info := infos[s]
			remap := make([][]int32, levels)
			for l := range levels {
				remap[l] = make([]int32, len(info.domVals[l]))
				for local, v := range info.domVals[l] {
					id := slices.Index(st.vals[l], v)
					if id < 0 {
						id = len(st.vals[l])
						st.vals[l] = append(st.vals[l], v)
					}
					remap[l][local] = int32(id)
				}
			}
			st.remap[slice] = remap
		}
	}
	st.counts = make([]int, 2*st.off(levels))
	// Count per domain over the pool's current device slices.
	sc.inUse = sc.inUse[:0]
	for s, slice := range deviceSlices {
		info := infos[s]
		for j := range slice.Spec.Devices {
			inUse := a.deviceInUse(info.ids[j])
			sc.inUse = append(sc.inUse, inUse)
			st.total++
			if inUse {
				st.used++
			}
			for l := range levels {
				if id := st.poolID(slice, info, levels, j, l); id >= 0 {
					k := 2 * (st.off(l) + int(id))
					st.counts[k]++
					if !inUse {
						st.counts[k+1]++
					}
				}
			}
		}
	}
	a.ordered.stats[key] = st
	offset := 0
	for _, slice := range poolSlices {
		s := slices.Index(deviceSlices, slice)
		if s < 0 {
			view = append(view, slice)
			continue
		}
		n := len(slice.Spec.Devices)
		inUse := sc.inUse[offset : offset+n]
		offset += n
		if n < 2 {
			view = append(view, slice)
			continue
		}
		info := infos[s]
		// keys[j*levels+l]: the free count of device j's domain at level l,
		// negated when spreading; MaxInt for in-use devices and missing
		// attributes, which go last.
		sc.keys = slices.Grow(sc.keys[:0], n*levels)[:n*levels]
		for j := range n {
			for l := range levels {
				k := math.MaxInt
				if id := st.poolID(slice, info, levels, j, l); !inUse[j] && id >= 0 {
					k = st.free(l, id)
					if !a.policy.Packing {
						k = -k
					}
				}
				sc.keys[j*levels+l] = k
			}
		}
		sc.perm = slices.Grow(sc.perm[:0], n)[:n]
		for j := range sc.perm {
			sc.perm[j] = j
		}
		keys := sc.keys
		slices.SortStableFunc(sc.perm, func(x, y int) int {
			return slices.Compare(keys[x*levels:(x+1)*levels], keys[y*levels:(y+1)*levels])
		})
		identity := true
		for j, p := range sc.perm {
			if j != p {
				identity = false
				break
			}
		}
		if identity {
			view = append(view, slice)
			continue
		}
		view = append(view, a.permutedSlice(slice, sc.perm))
	}
	return view
}

// orderedQuality describes a result of the ordered view from the pool
// statistics, without looking at the node's devices. It reports false if
// a device cannot be found (then the caller computes it the long way).
func (a *Allocator) orderedQuality(results []resourceapi.AllocationResult) (Quality, bool) {
	levels := len(a.policy.Attributes)
	type chosen struct {
		stats  *poolStats
		ids    []int32
		coords topology.Coordinates
	}
	var devs []chosen
	var q Quality
	for ci := range results {
		for k := range results[ci].Devices.Results {
			r := &results[ci].Devices.Results[k]
			key := poolKey{r.Driver, r.Pool}
			st := a.ordered.stats[key]
			if st == nil {
				return q, false
			}
			found := false
			for _, slice := range a.byPool[key] {
				if slice.Spec.Pool.Generation != a.poolGen[key] || len(slice.Spec.SharedCounters) > 0 {
					continue
				}
				for j := range slice.Spec.Devices {
					if slice.Spec.Devices[j].Name != r.Device {
						continue
					}
					info := a.ordered.infos[slice]
					if info == nil {
						return q, false
					}
					c := chosen{stats: st, coords: info.coords[j], ids: make([]int32, levels)}
					for l := range levels {
						c.ids[l] = st.poolID(slice, info, levels, j, l)
					}
					devs = append(devs, c)
					q.Devices = append(q.Devices, info.names[j])
					found = true
					break
				}
				if found {
					break
				}
			}
			if !found {
				return q, false
			}
		}
	}
	coords := make([]topology.Coordinates, len(devs))
	for i := range devs {
		coords[i] = devs[i].coords
	}
	q.Level, q.LevelName, q.Domain, q.DomainsSpanned = a.levelOf(coords)
	// Every claim has one device, the align-with=pod group at most one.
	q.Aligned = true

	total, used := 0, 0
	var seen []*poolStats
	for _, d := range devs {
		if !slices.Contains(seen, d.stats) {
			seen = append(seen, d.stats)
			total += d.stats.total
			used += d.stats.used
		}
	}
	used += len(devs)
	nodeUtil := 1.0
	if total > 0 {
		nodeUtil = min(1, float64(used)/float64(total))
	}
	// Fullness of the domains shared by all devices, over all levels (as
	// in quality).
	var full fullness
	if len(devs) > 0 {
		first := devs[0]
		for l := range levels {
			id := first.ids[l]
			if id < 0 {
				continue
			}
			busy, all := 0, true
			for _, d := range devs {
				if d.stats != first.stats || d.ids[l] != id {
					all = false
					break
				}
				busy++
			}
			if all {
				size := first.stats.size(l, id)
				full.add(busy+size-first.stats.free(l, id), size)
			}
		}
	}
	q.Packing = full.packing(nodeUtil)
	q.Tightness = 1 // one device per claim
	q.Score = a.score(q, len(devs), nodeUtil)
	return q, true
}

// permutedSlice returns a copy of slice with devices in perm order, reusing
// the copy of an earlier cycle when the order is the same.
func (a *Allocator) permutedSlice(slice *resourceapi.ResourceSlice, perm []int) *resourceapi.ResourceSlice {
	memo := globalMemo.forSlice(slice.UID, slice.Generation, a.listTypes)
	if memo != nil {
		// Only for the same object: a patched copy (DeviceTaintRules) has
		// the same UID and generation but other taints.
		if cached := memo.permuted.Load(); cached != nil && cached.src == slice && slices.Equal(cached.perm, perm) {
			return cached.slice
		}
	}
	c := *slice
	c.Spec.Devices = make([]resourceapi.Device, len(perm))
	for j, p := range perm {
		c.Spec.Devices[j] = slice.Spec.Devices[p]
	}
	if memo != nil {
		memo.permuted.Store(&permutedSlice{src: slice, perm: slices.Clone(perm), slice: &c})
	}
	return &c
}

// deviceInUse reports whether a device has a committed or in-flight allocation.
func (a *Allocator) deviceInUse(id structured.DeviceID) bool {
	return a.state.AllocatedDevices.Has(id) || (len(a.inUse) > 0 && a.inUse.Has(id))
}

// simplePod reports whether every claim of the pod needs exactly one device
// per claim (or per align-with=pod group), prefers alignment and has no
// input this package leaves to upstream: then the ordered view gives the
// preferred allocation.
func (a *Allocator) simplePod(claims []*resourceapi.ResourceClaim) bool {
	if len(a.policy.Attributes) == 0 {
		return false
	}
	podGroup := 0
	for _, claim := range claims {
		st := a.claimStatic(claim)
		if st.err != nil || st.passthrough || st.mode == AlignmentNone {
			return false
		}
		need := 0
		for _, r := range st.requests {
			for _, u := range r.alts {
				if u.all || u.count != 1 {
					return false
				}
			}
			need++
		}
		if need > 1 {
			return false
		}
		if st.alignPod {
			podGroup += need
			if podGroup > 1 {
				return false
			}
		}
	}
	return true
}

// permutedSlice is a slice copy with its devices reordered.
type permutedSlice struct {
	src   *resourceapi.ResourceSlice
	perm  []int
	slice *resourceapi.ResourceSlice
}
