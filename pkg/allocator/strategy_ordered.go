package allocator

import (
	"context"
	"math"
	"slices"
	"sync"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
)

// orderedStrategy serves pods whose claims each need one device: for them
// the preference does not depend on the claim, only on which devices are in
// use. Once per cycle, every pool's devices are sorted best-fit (devices in
// the fullest domains first, tightest attribute first) and one upstream
// allocator is built over all slices, exactly as the stock plugin builds
// its own. Allocate then costs what upstream's costs: first-fit over the
// sorted devices picks the best-fitting device, and since only the order
// differs, it allocates exactly when upstream does. It decides unless a
// selector fails at run time on a device of the node (podNode.uncertain),
// or a firstAvailable request got a later subrequest than counting
// expects (first-fit in the sorted order gave a device its first choice
// needed to another claim): then the views strategy decides, with
// upstream's own order as its last view.
type orderedStrategy struct{}

// An adjusted Allocator's trial runs leave it out: its view spans every
// pool of the cluster, built once per Allocator.
func (orderedStrategy) applies(p *podNode) bool { return !p.a.adjusted() && p.a.simplePod(p.claims) }

func (orderedStrategy) allocate(ctx context.Context, p *podNode) (*Result, error) {
	a := p.a
	ns, err := p.devices()
	if err != nil {
		return nil, err
	}
	infos, _, err := p.analysis(ctx)
	if err != nil {
		return nil, err
	}
	if p.uncertain() {
		return nil, nil
	}
	up, err := a.orderedUpstream(ctx)
	if err != nil {
		return nil, err
	}
	results, err := up.Allocate(ctx, p.node, p.claims)
	if err != nil {
		return a.upstreamFailure(ctx, p, err)
	}
	if results == nil {
		return &Result{Explanation: a.explain(ctx, infos, ns, nil, false)}, nil
	}
	if ok, _ := a.accept(ns, infos, nil, results, false); !ok {
		// First-fit over the best-fit order handed a device that a
		// firstAvailable request's first choice needed to another claim:
		// the views strategy decides with upstream's own order as its last
		// view.
		klog.FromContext(ctx).V(5).Info("Ordered allocation takes a later subrequest than counting expects, trying views", "node", klog.KObj(p.node))
		return nil, nil
	}
	q := a.quality(ns, infos, p.units, results)
	logAllocated(ctx, p, "ordered", q)
	return &Result{Allocations: results, Quality: q}, nil
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

// orderedState is the lazily built ordered view of a cycle.
type orderedState struct {
	once  sync.Once
	alloc structured.Allocator
	err   error
}

// orderedUpstream returns the upstream allocator over the ordered view.
func (a *Allocator) orderedUpstream(ctx context.Context) (structured.Allocator, error) {
	a.ordered.once.Do(func() {
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

// poolStats counts a pool's free devices per domain in this cycle; the
// ordered view sorts by it.
type poolStats struct {
	// vals[l] are the values of attribute l in the pool (shared with the
	// slice's sliceInfo when the pool has one device slice).
	vals [][]string
	// free holds, per level l and value id, the pool's free devices with
	// that value at free[off(l)+id].
	free []int
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

// poolID returns the pool-level id of device j of slice at level l, or -1.
func (st *poolStats) poolID(slice *resourceapi.ResourceSlice, info *sliceInfo, j, l int) int32 {
	local := info.dom[l][j]
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
	var deviceSlices []*resourceapi.ResourceSlice
	var infos []*sliceInfo
	for _, slice := range poolSlices {
		if slice.Spec.Pool.Generation == generation && len(slice.Spec.SharedCounters) == 0 && len(slice.Spec.Devices) > 0 {
			deviceSlices = append(deviceSlices, slice)
			infos = append(infos, a.sliceInfo(slice))
		}
	}
	st := a.countPool(deviceSlices, infos, sc)
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
		if n < 2 || a.unsureNodeSelection(slice) {
			view = append(view, slice)
			continue
		}
		view = append(view, a.sortedSlice(slice, infos[s], st, inUse, sc))
	}
	return view
}

// countPool numbers the domains of a pool's current device slices and
// counts their free devices; sc.inUse gets the in-use state of every
// device, slice after slice.
func (a *Allocator) countPool(deviceSlices []*resourceapi.ResourceSlice, infos []*sliceInfo, sc *orderScratch) *poolStats {
	levels := len(a.policy.Attributes)
	st := &poolStats{}
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
				st.vals[l] = numberDomains(len(info.domVals[l]), func(k int) string { return info.domVals[l][k] }, st.vals[l], remap[l])
			}
			st.remap[slice] = remap
		}
	}
	st.free = make([]int, st.off(levels))
	sc.inUse = sc.inUse[:0]
	for s, slice := range deviceSlices {
		info := infos[s]
		for j := range slice.Spec.Devices {
			inUse := a.deviceInUse(info.ids[j])
			sc.inUse = append(sc.inUse, inUse)
			if inUse {
				continue
			}
			for l := range levels {
				if id := st.poolID(slice, info, j, l); id >= 0 {
					st.free[st.off(l)+int(id)]++
				}
			}
		}
	}
	return st
}

// sortedSlice returns slice, or a copy with its devices sorted best-fit.
func (a *Allocator) sortedSlice(slice *resourceapi.ResourceSlice, info *sliceInfo, st *poolStats, inUse []bool, sc *orderScratch) *resourceapi.ResourceSlice {
	levels := len(a.policy.Attributes)
	n := len(slice.Spec.Devices)
	// keys[j*levels+l]: the free count of device j's domain at level l,
	// negated when spreading; MaxInt for in-use devices and missing
	// attributes, which go last.
	sc.keys = slices.Grow(sc.keys[:0], n*levels)[:n*levels]
	for j := range n {
		for l := range levels {
			k := math.MaxInt
			if id := st.poolID(slice, info, j, l); !inUse[j] && id >= 0 {
				k = st.free[st.off(l)+int(id)]
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
	devices := slice.Spec.Devices
	slices.SortStableFunc(sc.perm, func(x, y int) int {
		// Devices with binding conditions go after all others, as the
		// stock allocator tries them last (they delay binding and can
		// fail); then the topology order.
		if bx, by := len(devices[x].BindingConditions) > 0, len(devices[y].BindingConditions) > 0; bx != by {
			if bx {
				return 1
			}
			return -1
		}
		return slices.Compare(keys[x*levels:(x+1)*levels], keys[y*levels:(y+1)*levels])
	})
	for j, p := range sc.perm {
		if j != p {
			return a.permutedSlice(slice, sc.perm)
		}
	}
	return slice
}

// permutedSlice returns a copy of slice with devices in perm order, reusing
// the copy of an earlier cycle when the order is the same.
func (a *Allocator) permutedSlice(slice *resourceapi.ResourceSlice, perm []int) *resourceapi.ResourceSlice {
	memo := a.cache.forSlice(slice.UID, slice.Generation, a.features.ListTypeAttributes)
	if memo != nil {
		// Only for the same object: a patched copy (DeviceTaintRules) has
		// the same UID and generation but other taints.
		if cached, ok := memo.permuted.Load(a.orderKey); ok {
			if c := cached.(*permutedSlice); c.src == slice && slices.Equal(c.perm, perm) {
				return c.slice
			}
		}
	}
	c := *slice
	c.Spec.Devices = make([]resourceapi.Device, len(perm))
	for j, p := range perm {
		c.Spec.Devices[j] = slice.Spec.Devices[p]
	}
	if memo != nil {
		memo.permuted.Store(a.orderKey, &permutedSlice{src: slice, perm: slices.Clone(perm), slice: &c})
	}
	return &c
}
