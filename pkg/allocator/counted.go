package allocator

import (
	"context"
	"slices"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

// Counting decides pods whose claims ask for ExactCount devices of one class
// per request, without constraints other than matchAttribute (see
// match.go), admin access, shared or
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
	// claim, align-with=pod groups, matchAttribute constraints) by the
	// planner.
	multi := !a.simplePod(claims)
	var constrained []int
	for ci, info := range infos {
		if info.hasAll {
			return nil, false, nil
		}
		if len(claims[ci].Spec.Devices.Constraints) > 0 {
			constrained = append(constrained, ci)
			multi = true
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

	// A claim with matchAttribute constraints takes its devices from one
	// class of equal values: the classes that can serve it alone are its
	// options. If it has none, the pod does not fit (other claims only
	// take devices away).
	type matchChoice struct {
		ci      int
		options []*claimInfo // the claim restricted to each feasible class
	}
	var choices []matchChoice
	var matchExpl *Explanation
	combinations := 1
	for _, ci := range constrained {
		classOf, names, ok := matchClasses(ns, infos[ci])
		if !ok {
			return nil, false, nil
		}
		ch := matchChoice{ci: ci}
		for c := range names {
			if r := restrictTo(infos[ci], classOf, c); canServe(r) {
				ch.options = append(ch.options, r)
			}
		}
		if len(ch.options) == 0 {
			if matchExpl == nil {
				matchExpl = &Explanation{}
			}
			matchExpl.Requests = append(matchExpl.Requests, a.matchExplanation(ns, infos[ci], classOf, names))
			continue
		}
		combinations *= len(ch.options)
		if combinations > maxMatchCombinations {
			return nil, false, nil
		}
		choices = append(choices, ch)
	}
	if matchExpl != nil {
		return &Result{Explanation: matchExpl, DevicesConsidered: len(ns.devices)}, true, nil
	}

	p := &planner{ns: ns, levels: len(a.policy.Attributes), pack: a.policy.Packing, allUnits: allUnits}
	var results []resourceapi.AllocationResult
	var q Quality
	if multi {
		// The planner chooses each claim's (or align-with=pod group's)
		// domain and devices, exactly as for the views; with several
		// classes for constrained claims, the combination whose plan
		// scores best.
		var bestGroups []*group
		bestLeft := 0
		pick := make([]int, len(choices))
		current := slices.Clone(infos)
		for {
			for k, ch := range choices {
				current[ch.ci] = ch.options[pick[k]]
			}
			if res, groups, ok := a.countedPlan(p, current, len(units)); ok {
				cq := a.quality(ns, infos, allUnits, res)
				var left int
				if len(choices) > 0 {
					left = leftover(ns, allUnits, res)
				}
				// Equal scores: best fit (or spread) of the enclosing
				// domains decides, as the planner does within one class.
				if results == nil || cq.Score > q.Score ||
					(cq.Score == q.Score && ((a.policy.Packing && left < bestLeft) || (!a.policy.Packing && left > bestLeft))) {
					results, q, bestGroups, bestLeft = res, cq, groups, left
				}
			}
			// Next combination (mixed radix).
			k := 0
			for ; k < len(choices); k++ {
				pick[k]++
				if pick[k] < len(choices[k].options) {
					break
				}
				pick[k] = 0
			}
			if k == len(choices) {
				break
			}
		}
		if results == nil {
			return nil, false, nil
		}
		p.groups = bestGroups
	} else {
		results = make([]resourceapi.AllocationResult, len(claims))
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
				ns.addResult(&results[ci], r.name, picked[0])
			}
		}
		q = a.quality(ns, infos, allUnits, results)
	}
	var expl *Explanation
	if multi && !q.Aligned {
		expl = a.explainSpan(ns, p.groups, results)
	}
	if logger := klog.FromContext(ctx); logger.V(4).Enabled() {
		logger.V(4).Info("Allocated by counting", "node", klog.KObj(node), "devices", q.Devices, "level", q.LevelName, "score", q.Score)
	}
	return &Result{Allocations: results, Quality: q, Explanation: expl, Unverified: true, DevicesConsidered: len(ns.devices)}, true, nil
}

// countedPlan runs the planner for infos (whose requests have one
// alternative each) and returns the picks as allocation results, with the
// groups it planned. ok is false where the planner cannot place every
// request; upstream then decides.
func (a *Allocator) countedPlan(p *planner, infos []*claimInfo, nUnits int) ([]resourceapi.AllocationResult, []*group, bool) {
	p.groups = buildGroups(infos)
	picksFor := map[*unit][]int{}
	plans := p.plans(1)
	if len(plans) == 0 {
		return nil, nil, false
	}
	inGroup := 0
	for gi, g := range p.groups {
		if g.mode == AlignmentRequire && g.need > 1 && plans[0].domains[gi] == nil {
			return nil, nil, false // the views path explains require
		}
		picks := plans[0].picks[gi]
		if len(picks) != g.need {
			return nil, nil, false
		}
		for _, u := range g.units {
			picksFor[u], picks = picks[:u.count], picks[u.count:]
			inGroup++
		}
	}
	if inGroup != nUnits {
		return nil, nil, false
	}
	results := make([]resourceapi.AllocationResult, len(infos))
	for ci, info := range infos {
		for _, r := range info.requests {
			for _, i := range picksFor[r.alts[0]] {
				p.ns.addResult(&results[ci], r.name, i)
			}
		}
	}
	return results, p.groups, true
}

// addResult appends device i to an allocation result for request.
func (ns *nodeState) addResult(res *resourceapi.AllocationResult, request string, i int) {
	d := &ns.devices[i]
	res.Devices.Results = append(res.Devices.Results, resourceapi.DeviceRequestAllocationResult{
		Request: request,
		Driver:  d.driver,
		Pool:    d.slice.Spec.Pool.Name,
		Device:  d.device.Name,
	})
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
// has only ExactCount requests of one class, no constraints but
// matchAttribute ones over the same requests, no capacity
// requests, derived attributes or admin access, and is not alignment=none.
func (a *Allocator) countablePod(claims []*resourceapi.ResourceClaim) bool {
	if len(a.policy.Attributes) == 0 {
		return false
	}
	for _, claim := range claims {
		if !matchCountable(claim) {
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
