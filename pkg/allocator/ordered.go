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
		return nil, err
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
	q := a.quality(ns, infos, allUnits, results)
	if logger := klog.FromContext(ctx); logger.V(4).Enabled() {
		logger.V(4).Info("Allocated", "node", klog.KObj(node), "view", "ordered", "devices", q.Devices, "level", q.LevelName, "score", q.Score)
	}
	return &Result{Allocations: results, Quality: q}, nil
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
	count [][]int
}

// appendOrderedPool appends the pool's slices, with devices sorted, to view.
func (a *Allocator) appendOrderedPool(view []*resourceapi.ResourceSlice, key poolKey, poolSlices []*resourceapi.ResourceSlice, sc *orderScratch) []*resourceapi.ResourceSlice {
	generation := a.poolGen[key]
	levels := len(a.policy.Attributes)
	if levels == 0 {
		return append(view, poolSlices...)
	}
	// The common case: one slice with devices per pool (one node, one
	// driver). Other pools count free devices per domain by value.
	var deviceSlices []*resourceapi.ResourceSlice
	for _, slice := range poolSlices {
		if slice.Spec.Pool.Generation == generation && len(slice.Spec.SharedCounters) == 0 && len(slice.Spec.Devices) > 0 {
			deviceSlices = append(deviceSlices, slice)
		}
	}
	var byValue map[domainRef]int
	if len(deviceSlices) > 1 {
		byValue = map[domainRef]int{}
		for _, slice := range deviceSlices {
			info := a.sliceInfo(slice)
			for j := range slice.Spec.Devices {
				if a.deviceInUse(info.ids[j]) {
					continue
				}
				for l, v := range info.coords[j] {
					if v != "" {
						byValue[domainRef{level: l, value: v}]++
					}
				}
			}
		}
	}
	for _, slice := range poolSlices {
		if len(slice.Spec.Devices) < 2 || !slices.Contains(deviceSlices, slice) {
			view = append(view, slice)
			continue
		}
		info := a.sliceInfo(slice)
		n := len(slice.Spec.Devices)
		sc.inUse = slices.Grow(sc.inUse[:0], n)[:n]
		for j := range n {
			sc.inUse[j] = a.deviceInUse(info.ids[j])
		}
		// Free devices per domain of this slice.
		if byValue == nil {
			sc.count = slices.Grow(sc.count[:0], levels)[:levels]
			for l := range levels {
				sc.count[l] = slices.Grow(sc.count[l][:0], len(info.domVals[l]))[:len(info.domVals[l])]
				clear(sc.count[l])
			}
			for j := range n {
				if sc.inUse[j] {
					continue
				}
				for l := range levels {
					if id := info.dom[j*levels+l]; id >= 0 {
						sc.count[l][id]++
					}
				}
			}
		}
		// keys[j*levels+l]: the free count of device j's domain at level l,
		// negated when spreading; MaxInt for in-use devices and missing
		// attributes, which go last.
		sc.keys = slices.Grow(sc.keys[:0], n*levels)[:n*levels]
		for j := range n {
			for l := range levels {
				k := math.MaxInt
				if id := info.dom[j*levels+l]; !sc.inUse[j] && id >= 0 {
					if byValue != nil {
						k = byValue[domainRef{level: l, value: info.domVals[l][id]}]
					} else {
						k = sc.count[l][id]
					}
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
