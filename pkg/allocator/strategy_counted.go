package allocator

import (
	"context"
	"slices"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/utils/ptr"
)

// countedStrategy decides pods whose claims ask for ExactCount devices of
// one class per request, without constraints other than matchAttribute
// (see match.go), admin access, shared or counter-consuming devices: for
// them the free devices that match (cached CEL results, taints, devices in
// use) are exactly what upstream could allocate. Filter then needs no
// upstream call per node: allocate returns the best devices, marked
// Unverified, and Verify asks upstream once, on the chosen node only, with
// just those devices visible. Upstream stays the judge; a node counting got
// wrong costs a retry, never an invalid allocation. Where counting cannot
// be exact on the node, it declines.
type countedStrategy struct{}

// applies is the static part of the test: every claim has only ExactCount
// requests of one class, no constraints but matchAttribute ones over the
// same requests, no capacity requests, derived attributes or admin access,
// and is not alignment=none.
func (countedStrategy) applies(p *podNode) bool {
	a := p.a
	if len(a.policy.Attributes) == 0 {
		return false
	}
	for _, claim := range p.claims {
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

func (countedStrategy) allocate(ctx context.Context, p *podNode) (*Result, error) {
	// Counting does not look at ctx while it works; a cancelled or expired
	// context is an error here, as for every other strategy.
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	a := p.a
	ns, err := p.devices()
	if err != nil {
		return nil, err
	}
	if len(ns.incomplete) > 0 || len(ns.invalid) > 0 {
		return nil, nil
	}
	infos, passthrough, err := p.analysis(ctx)
	if err != nil || passthrough {
		return nil, err
	}
	units, constrained, ok := exactUnits(ns, p.claims, infos)
	if !ok {
		return nil, nil
	}
	if expl := a.countCheck(ctx, ns, infos); expl != nil {
		return &Result{Explanation: expl, DevicesConsidered: len(ns.devices)}, nil
	}
	// Pods whose claims each take one device are served device by device;
	// others (several devices, several requests in a claim, align-with=pod
	// groups, matchAttribute constraints) by the planner.
	var res *Result
	if len(constrained) > 0 || !a.simplePod(p.claims) {
		res = a.countedPlanned(ctx, ns, infos, units, constrained)
	} else {
		res = a.countedSingles(ns, infos, units)
	}
	if res == nil || res.Allocations == nil {
		return res, nil
	}
	res.Unverified = true
	res.DevicesConsidered = len(ns.devices)
	logAllocated(ctx, p, "counted", res.Quality)
	return res, nil
}

// exactUnits returns the units of the pod and the claims with
// matchAttribute constraints; ok is false where counting is not exact:
// All mode, several alternatives, capacity requests, derived attributes,
// admin access, CEL runtime errors, or matching devices that counting
// cannot judge (uncountable).
func exactUnits(ns *nodeState, claims []*resourceapi.ResourceClaim, infos []*claimInfo) (units []*unit, constrained []int, ok bool) {
	for ci, info := range infos {
		if info.hasAll {
			return nil, nil, false
		}
		if len(claims[ci].Spec.Devices.Constraints) > 0 {
			constrained = append(constrained, ci)
		}
		for _, req := range claims[ci].Spec.Devices.Requests {
			// Capacity requests and derived attributes are decided by
			// upstream alone.
			if req.Exactly == nil || req.Exactly.Capacity != nil || len(req.Exactly.DerivedAttributes) > 0 {
				return nil, nil, false
			}
		}
		for _, r := range info.requests {
			if len(r.alts) != 1 {
				return nil, nil, false
			}
			u := r.alts[0]
			if u.uncertn || u.admin || u.all || u.count < 1 {
				return nil, nil, false
			}
			units = append(units, u)
		}
	}
	for _, u := range units {
		for i, m := range u.matching {
			if !m {
				continue
			}
			if ns.devices[i].uncountable {
				return nil, nil, false
			}
			// Devices of slices that skip node operations are allocatable
			// only as the node declares (upstream decides).
			if len(ns.devices[i].slice.Spec.SkipNodeOperations) > 0 {
				return nil, nil, false
			}
		}
	}
	return units, constrained, true
}

// matchChoice is a claim with matchAttribute constraints and its options:
// the claim restricted to each class of equal values that can serve it.
type matchChoice struct {
	ci      int
	options []*claimInfo
}

// matchChoices returns the options of each constrained claim. A claim
// without options makes the pod infeasible (other claims only take devices
// away): then the Result explains it. ok is false where counting cannot
// decide (list values, too many combinations).
func (a *Allocator) matchChoices(ns *nodeState, infos []*claimInfo, constrained []int) (choices []matchChoice, res *Result, ok bool) {
	var expl *Explanation
	combinations := 1
	for _, ci := range constrained {
		classOf, names, ok := matchClasses(ns, infos[ci])
		if !ok {
			return nil, nil, false
		}
		ch := matchChoice{ci: ci}
		for c := range names {
			if r := restrictTo(infos[ci], classOf, c); canServe(r) {
				ch.options = append(ch.options, r)
			}
		}
		if len(ch.options) == 0 {
			if expl == nil {
				expl = &Explanation{}
			}
			expl.Requests = append(expl.Requests, a.matchExplanation(ns, infos[ci], classOf, names))
			continue
		}
		combinations *= len(ch.options)
		if combinations > maxMatchCombinations {
			return nil, nil, false
		}
		choices = append(choices, ch)
	}
	if expl != nil {
		return nil, &Result{Explanation: expl, DevicesConsidered: len(ns.devices)}, true
	}
	return choices, nil, true
}

// countedPlanned lets the planner choose each claim's (or align-with=pod
// group's) domain and devices, as for the views; with several classes for
// constrained claims, the combination whose plan scores best. It returns
// nil where the planner cannot place every request.
func (a *Allocator) countedPlanned(ctx context.Context, ns *nodeState, infos []*claimInfo, units []*unit, constrained []int) *Result {
	choices, res, ok := a.matchChoices(ns, infos, constrained)
	if !ok || res != nil {
		return res
	}
	p := &planner{ns: ns, levels: len(a.policy.Attributes), pack: a.policy.Packing, allUnits: units}
	var best *Result
	var bestGroups []*group
	bestLeft := 0
	pick := make([]int, len(choices))
	current := slices.Clone(infos)
	for {
		for k, ch := range choices {
			current[ch.ci] = ch.options[pick[k]]
		}
		if results, groups, ok := countedPlan(p, current, len(units)); ok {
			q := a.quality(ns, infos, units, results)
			var left int
			if len(choices) > 0 {
				left = leftover(ns, units, results)
			}
			// Equal scores: best fit (or spread) of the enclosing domains
			// decides, as the planner does within one class.
			if best == nil || q.Score > best.Quality.Score ||
				(q.Score == best.Quality.Score && ((a.policy.Packing && left < bestLeft) || (!a.policy.Packing && left > bestLeft))) {
				best, bestGroups, bestLeft = &Result{Allocations: results, Quality: q}, groups, left
			}
		}
		if !nextCombination(pick, choices) {
			break
		}
	}
	if best != nil && !best.Quality.Aligned {
		best.Explanation = a.explainSpan(ctx, ns, bestGroups, best.Allocations)
	}
	return best
}

// nextCombination advances pick (mixed radix over the choices' options)
// and reports false after the last combination.
func nextCombination(pick []int, choices []matchChoice) bool {
	for k := range choices {
		pick[k]++
		if pick[k] < len(choices[k].options) {
			return true
		}
		pick[k] = 0
	}
	return false
}

// countedSingles picks the best free device for each one-device claim in
// turn. It returns nil where two claims compete for the last device:
// upstream decides that.
func (a *Allocator) countedSingles(ns *nodeState, infos []*claimInfo, units []*unit) *Result {
	p := &planner{ns: ns, levels: len(a.policy.Attributes), pack: a.policy.Packing, allUnits: units}
	results := make([]resourceapi.AllocationResult, len(infos))
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
				return nil
			}
			taken[picked[0]] = true
			ns.addResult(&results[ci], r.name, picked[0])
		}
	}
	return &Result{Allocations: results, Quality: a.quality(ns, infos, units, results)}
}

// countedPlan runs the planner for infos (whose requests have one
// alternative each) and returns the picks as allocation results, with the
// groups it planned. ok is false where the planner cannot place every
// request; upstream then decides.
func countedPlan(p *planner, infos []*claimInfo, nUnits int) ([]resourceapi.AllocationResult, []*group, bool) {
	p.groups = buildGroups(infos)
	picksFor := map[*unit][]int{}
	plans := p.plans(1)
	if len(plans) == 0 {
		return nil, nil, false
	}
	inGroup := 0
	for gi, g := range p.groups {
		if g.mode == AlignmentRequire && g.need > 1 && plans[0].domains[gi] == nil {
			return nil, nil, false // the views strategy explains require
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

// uncountable reports whether counting is not exact for a request that
// matches the device: it is shared, consumes counters, has binding
// conditions or has a capacity with a request policy (upstream's capacity
// check passes over a device whose policy the capacity it would consume
// breaks; API validation allows policies only on shared devices).
func uncountable(d *resourceapi.Device) bool {
	if len(d.ConsumesCounters) > 0 || ptr.Deref(d.AllowMultipleAllocations, false) || len(d.BindingConditions) > 0 {
		return true
	}
	for _, c := range d.Capacity {
		if c.RequestPolicy != nil {
			return true
		}
	}
	return false
}
