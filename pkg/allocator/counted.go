package allocator

import (
	"context"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

// Counting decides pods whose claims ask for ExactCount devices of one class
// per request, without constraints, admin access, shared or
// counter-consuming devices:
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
	// Pods whose claims each take one device (simplePod) are served
	// device by device; others (several devices, several requests in a
	// claim, align-with=pod groups) by the planner.
	multi := !a.simplePod(claims)
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
			if u.uncertn || u.admin || u.all || u.count < 1 {
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
	results := make([]resourceapi.AllocationResult, len(claims))
	add := func(ci int, request string, i int) {
		d := &ns.devices[i]
		results[ci].Devices.Results = append(results[ci].Devices.Results, resourceapi.DeviceRequestAllocationResult{
			Request: request,
			Driver:  d.driver,
			Pool:    d.slice.Spec.Pool.Name,
			Device:  d.device.Name,
		})
	}
	if multi {
		// The planner chooses each claim's (or align-with=pod group's)
		// domain and devices, exactly as for the views.
		p.groups = buildGroups(infos)
		picksFor := map[*unit][]int{}
		plans := p.plans(1)
		if len(plans) == 0 {
			return nil, false, nil
		}
		inGroup := 0
		for gi, g := range p.groups {
			if g.mode == AlignmentRequire && g.need > 1 && plans[0].domains[gi] == nil {
				return nil, false, nil // the views path explains require
			}
			picks := plans[0].picks[gi]
			if len(picks) != g.need {
				return nil, false, nil
			}
			for _, u := range g.units {
				picksFor[u], picks = picks[:u.count], picks[u.count:]
				inGroup++
			}
		}
		if inGroup != len(units) {
			return nil, false, nil
		}
		for ci, info := range infos {
			for _, r := range info.requests {
				for _, i := range picksFor[r.alts[0]] {
					add(ci, r.name, i)
				}
			}
		}
	} else {
		levels := p.coarseToFine(-1)
		taken := make(map[int]bool, len(units))
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
					// Two claims competing for the last device: let
					// upstream decide.
					return nil, false, nil
				}
				taken[picked[0]] = true
				add(ci, r.name, picked[0])
			}
		}
	}
	q := a.quality(ns, infos, allUnits, results)
	var expl *Explanation
	if multi && !q.Aligned {
		expl = a.explainSpan(ns, p.groups, results)
	}
	if logger := klog.FromContext(ctx); logger.V(4).Enabled() {
		logger.V(4).Info("Allocated by counting", "node", klog.KObj(node), "devices", q.Devices, "level", q.LevelName, "score", q.Score)
	}
	return &Result{Allocations: results, Quality: q, Explanation: expl, Unverified: true, DevicesConsidered: len(ns.devices)}, true, nil
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
		return &Result{Allocations: results, Quality: res.Quality, Explanation: res.Explanation, DevicesConsidered: res.DevicesConsidered}, nil
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	klog.FromContext(ctx).V(4).Info("Counted allocation not confirmed by upstream, allocating again", "node", klog.KObj(node), "err", err)
	if a.simplePod(claims) {
		return a.allocateOrdered(ctx, node, claims)
	}
	return a.allocateViews(ctx, node, claims)
}

// countablePod is the static part of allocateCounted's test: every claim
// has only ExactCount requests of one class, without constraints, capacity
// requests, derived attributes or admin access, and is not alignment=none.
func (a *Allocator) countablePod(claims []*resourceapi.ResourceClaim) bool {
	if len(a.policy.Attributes) == 0 {
		return false
	}
	for _, claim := range claims {
		if len(claim.Spec.Devices.Constraints) > 0 {
			return false
		}
		for _, req := range claim.Spec.Devices.Requests {
			e := req.Exactly
			if e == nil || e.AllocationMode == resourceapi.DeviceAllocationModeAll || e.Capacity != nil || len(e.DerivedAttributes) > 0 || ptr.Deref(e.AdminAccess, false) {
				return false
			}
		}
		st := a.claimStatic(claim)
		if st.err != nil || st.passthrough || st.mode == AlignmentNone {
			return false
		}
	}
	return true
}
