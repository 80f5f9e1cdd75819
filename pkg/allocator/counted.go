package allocator

import (
	"context"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

// Counting decides pods whose claims each need one device of one class,
// without constraints, admin access, shared or counter-consuming devices:
// for them the free devices that match (memoised CEL results, taints,
// devices in use) are exactly what upstream could allocate. Filter then
// needs no upstream call per node (architecture decision 2): Allocate
// returns the best device per claim, marked Unverified, and Verify asks
// upstream once, on the chosen node only, with just those devices visible.
// Upstream stays the judge; a node counting got wrong costs a retry, never
// an invalid allocation. Where counting cannot be exact, Allocate takes the
// ordered view (one upstream call per node) as before.

// allocateCounted returns ok=false where counting is not exact.
func (a *Allocator) allocateCounted(ctx context.Context, node *v1.Node, claims []*resourceapi.ResourceClaim) (*Result, bool, error) {
	ns, err := a.gatherNode(node)
	if err != nil {
		return nil, false, err
	}
	if len(ns.incomplete) > 0 || len(ns.dupPools) > 0 {
		return nil, false, nil
	}
	infos, passthrough, err := a.analyze(ctx, ns, claims)
	if err != nil || passthrough {
		return nil, false, err
	}
	var units []*unit
	var allUnits []*unit
	for ci, info := range infos {
		if info.hasAll || len(claims[ci].Spec.Devices.Constraints) > 0 {
			return nil, false, nil
		}
		for _, req := range claims[ci].Spec.Devices.Requests {
			// Capacity requests and derived attributes are decided by
			// upstream alone.
			if req.Exactly == nil || req.Exactly.Capacity != nil || len(req.Exactly.DerivedAttributes) > 0 {
				return nil, false, nil
			}
		}
		for _, r := range info.requests {
			if len(r.alts) != 1 {
				return nil, false, nil
			}
			u := r.alts[0]
			if u.uncertn || u.admin || u.count != 1 {
				return nil, false, nil
			}
			units = append(units, u)
			allUnits = append(allUnits, u)
		}
	}
	// Exact only if no matching device shares or consumes counters.
	for _, u := range units {
		for i, m := range u.matching {
			if !m {
				continue
			}
			d := ns.devices[i].device
			if len(d.ConsumesCounters) > 0 || ptr.Deref(d.AllowMultipleAllocations, false) || len(d.BindingConditions) > 0 {
				return nil, false, nil
			}
		}
	}
	if expl := a.countCheck(infos); expl != nil {
		return &Result{Explanation: expl, DevicesConsidered: len(ns.devices)}, true, nil
	}

	p := &planner{ns: ns, levels: len(a.policy.Attributes), pack: a.policy.Packing, allUnits: allUnits}
	levels := p.coarseToFine(-1)
	taken := make(map[int]bool, len(units))
	results := make([]resourceapi.AllocationResult, len(claims))
	for ci, info := range infos {
		for _, r := range info.requests {
			u := r.alts[0]
			var candidates []int
			for _, i := range u.free {
				if !taken[i] {
					candidates = append(candidates, i)
				}
			}
			picked := p.fill(candidates, 1, levels)
			if len(picked) == 0 {
				// Two claims competing for the last device: let the
				// ordered view decide.
				return nil, false, nil
			}
			i := picked[0]
			taken[i] = true
			d := &ns.devices[i]
			results[ci].Devices.Results = append(results[ci].Devices.Results, resourceapi.DeviceRequestAllocationResult{
				Request: r.name,
				Driver:  d.driver,
				Pool:    d.slice.Spec.Pool.Name,
				Device:  d.device.Name,
			})
		}
	}
	q := a.quality(ns, infos, allUnits, results)
	if logger := klog.FromContext(ctx); logger.V(4).Enabled() {
		logger.V(4).Info("Allocated by counting", "node", klog.KObj(node), "devices", q.Devices, "level", q.LevelName, "score", q.Score)
	}
	return &Result{Allocations: results, Quality: q, Unverified: true, DevicesConsidered: len(ns.devices)}, true, nil
}

// Verify turns an Unverified result of Allocate into upstream's allocation
// of the same devices: upstream allocates the claims on a view of the node
// in which only the chosen devices are visible (slices and pools stay
// complete). If that fails — the state changed, or counting was wrong —
// the node gets a full Allocate. A verified result is returned as is.
// Like Allocate, it returns an error only for fatal input problems and
// cancellation; Result.Allocations is nil if nothing fits any more.
func (a *Allocator) Verify(ctx context.Context, node *v1.Node, claims []*resourceapi.ResourceClaim, res *Result) (*Result, error) {
	if res == nil || !res.Unverified || res.Allocations == nil {
		return res, nil
	}
	ns, err := a.gatherNode(node)
	if err != nil {
		return nil, err
	}
	chosen := map[[3]string]bool{}
	for _, alloc := range res.Allocations {
		for _, r := range alloc.Devices.Results {
			chosen[[3]string{r.Driver, r.Pool, r.Device}] = true
		}
	}
	view := make([]*resourceapi.ResourceSlice, 0, len(ns.slices))
	for _, slice := range ns.slices {
		keep := slice
		filtered := make([]resourceapi.Device, 0, 1)
		for _, d := range slice.Spec.Devices {
			if chosen[[3]string{slice.Spec.Driver, slice.Spec.Pool.Name, d.Name}] {
				filtered = append(filtered, d)
			}
		}
		if len(filtered) != len(slice.Spec.Devices) {
			keep = slice.DeepCopy()
			keep.Spec.Devices = filtered
		}
		view = append(view, keep)
	}
	results, err := a.upstream(ctx, node, claims, view)
	if err == nil && results != nil {
		return &Result{Allocations: results, Quality: res.Quality}, nil
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	klog.FromContext(ctx).V(4).Info("Counted allocation not confirmed by upstream, allocating again", "node", klog.KObj(node), "err", err)
	return a.allocateOrdered(ctx, node, claims)
}
