package allocator

import (
	"context"
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"
)

// viewsStrategy serves every pod: it plans the preferred devices and asks
// upstream on views of the node, most preferred first, one upstream call
// per view until one works; the node's slices as they are come last, so it
// allocates exactly when upstream does (except for alignment=require). It
// always decides. Where a selector fails at run time on a device of the
// node, only the node's own slices are tried (see podNode.uncertain).
// Where a claim has an All request and constraints, the node's own slices
// are tried first (see ownOrderDecides), and views only when upstream
// allocates there.
type viewsStrategy struct{}

func (viewsStrategy) applies(*podNode) bool { return true }

// preferredViewsBudget bounds the time spent on preferred views per node.
// A view usually takes tens of microseconds.
const preferredViewsBudget = 20 * time.Millisecond

// viewAttempt builds one view of the node for upstream.
type viewAttempt func() []*resourceapi.ResourceSlice

func (viewsStrategy) allocate(ctx context.Context, p *podNode) (*Result, error) {
	a := p.a
	ns, err := p.devices()
	if err != nil {
		return nil, err
	}
	infos, passthrough, err := p.analysis(ctx)
	if err != nil {
		return nil, err
	}
	if !passthrough {
		if expl := a.countCheck(ctx, ns, infos); expl != nil {
			klog.FromContext(ctx).V(5).Info("Claims do not fit by counting", "node", klog.KObj(p.node), "reason", expl.String())
			return &Result{Explanation: expl, DevicesConsidered: len(ns.devices)}, nil
		}
	}
	var groups []*group
	var attempts []viewAttempt
	if !passthrough && len(a.policy.Attributes) > 0 {
		groups = buildGroups(infos)
		if !p.uncertain() {
			if ownOrderDecides(infos) {
				if results, err := p.ownAnswer(ctx); err != nil || results == nil {
					// No view can allocate where upstream's order fails
					// without an error, and its error is the answer.
					return a.tryViews(ctx, p, groups, nil)
				}
			}
			var res *Result
			attempts, res = a.preferredViews(ctx, ns, infos, groups, p.units)
			if res != nil {
				return res, nil
			}
		}
	}
	return a.tryViews(ctx, p, groups, attempts)
}

// ownOrderDecides reports whether upstream may fail with an error on the
// node's slices as they are where it allocates on a view with the same
// devices in another order. That is the case for a claim with an All
// request and constraints: every device of the All request must satisfy
// the claim's constraints, and upstream reports an error where one does
// not, so the devices it picked before for the claim's other requests,
// that is the order, decide between an error and an allocation.
func ownOrderDecides(infos []*claimInfo) bool {
	for _, info := range infos {
		if info.hasAll && len(info.claim.Spec.Devices.Constraints) > 0 {
			return true
		}
	}
	return false
}

// preferredViews returns the preferred views for the planned groups, most
// preferred first, or a Result when an alignment=require group fits in no
// domain with any choice of its firstAvailable subrequests.
func (a *Allocator) preferredViews(ctx context.Context, ns *nodeState, infos []*claimInfo, groups []*group, units []*unit) ([]viewAttempt, *Result) {
	p := &planner{ns: ns, levels: len(a.policy.Attributes), pack: a.policy.Packing, groups: groups, allUnits: units}
	maxPlans := 2
	for _, g := range groups {
		if g.mode == AlignmentRequire && g.need > 1 {
			maxPlans = 8
			avail := make([]bool, len(ns.devices))
			for i := range avail {
				avail[i] = true
			}
			if len(p.fittingDomains(g, avail, false)) == 0 && !p.alignedAlternative(infos, g, avail) {
				return nil, &Result{Explanation: a.explain(ctx, infos, ns, g, true), DevicesConsidered: len(ns.devices)}
			}
		}
	}
	if len(groups) == 0 {
		return nil, nil
	}
	podHasAll := false
	for _, info := range infos {
		podHasAll = podHasAll || info.hasAll
	}
	var attempts []viewAttempt
	plans := p.plans(maxPlans)
	for i := range plans {
		pl := &plans[i]
		if podHasAll {
			// "All" means all devices: never hide any.
			break
		}
		// Only the picked devices (and what other claims may use):
		// upstream merely confirms the choice, and has few devices to
		// look at.
		attempts = append(attempts, func() []*resourceapi.ResourceSlice { return p.viewFor(pl, viewPicks) })
		for gi, d := range pl.domains {
			if d != nil && groups[gi].need > 1 {
				// The chosen domains, picks first.
				attempts = append(attempts, func() []*resourceapi.ResourceSlice { return p.viewFor(pl, viewDomains) })
				break
			}
		}
	}
	if len(plans) > 0 {
		// Reordered but complete: as feasible as the node.
		attempts = append(attempts, func() []*resourceapi.ResourceSlice { return p.viewFor(&plans[0], viewAll) })
	}
	return attempts, nil
}

// tryViews asks upstream on each preferred view in turn and then on the
// node as it is (p.ownAnswer), and returns the first acceptable
// allocation.
func (a *Allocator) tryViews(ctx context.Context, p *podNode, groups []*group, preferred []viewAttempt) (*Result, error) {
	logger := klog.FromContext(ctx)
	ns, infos := p.ns, p.infos
	// Preferred views share a time budget: upstream's search can take
	// exponential time on some inputs, and then only its own answer
	// (the final view) is worth waiting for.
	prefCtx := ctx
	if len(preferred) > 0 {
		var cancel context.CancelFunc
		prefCtx, cancel = context.WithTimeout(ctx, preferredViewsBudget)
		defer cancel()
	}
	requireRejected := false
	for n := range len(preferred) + 1 {
		final := n == len(preferred)
		var results []resourceapi.AllocationResult
		var err error
		if final {
			results, err = p.ownAnswer(ctx)
		} else {
			if prefCtx.Err() != nil {
				continue
			}
			results, err = a.upstream(prefCtx, p.node, p.claims, preferred[n]())
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil, err
			}
			if !final {
				logger.V(5).Info("Preferred view failed, trying the next", "node", klog.KObj(p.node), "attempt", n, "err", err)
				continue
			}
			return a.upstreamFailure(ctx, p, err)
		}
		if results == nil {
			continue
		}
		ok, requireOK := a.accept(ns, infos, groups, results, final)
		if !requireOK {
			requireRejected = true
		}
		if !ok {
			continue
		}
		q := a.quality(ns, infos, p.units, results)
		res := &Result{Allocations: results, Quality: q, DevicesConsidered: len(ns.devices)}
		if !q.Aligned {
			res.Explanation = a.explainSpan(ctx, ns, groups, results)
		}
		logger.V(5).Info("View accepted", "node", klog.KObj(p.node), "attempt", n, "of", len(preferred)+1)
		logAllocated(ctx, p, "views", q)
		return res, nil
	}
	var expl *Explanation
	if requireRejected {
		for _, g := range groups {
			if g.mode == AlignmentRequire && g.need > 1 {
				expl = a.explain(ctx, infos, ns, g, true)
				break
			}
		}
	}
	if expl == nil {
		expl = a.explain(ctx, infos, ns, nil, false)
	}
	return &Result{Explanation: expl, DevicesConsidered: len(ns.devices)}, nil
}

// accept checks a result of a preferred view: firstAvailable requests must
// not get a worse subrequest than counting expects (upstream would prefer
// the better one), and claims with alignment=require must be aligned. The
// final view is upstream's own answer, so only the second check applies.
func (a *Allocator) accept(ns *nodeState, infos []*claimInfo, groups []*group, results []resourceapi.AllocationResult, final bool) (ok, requireOK bool) {
	if !final {
		for ci, info := range infos {
			for _, r := range info.requests {
				if len(r.alts) < 2 || r.target < 0 {
					continue
				}
				prefix := r.name + "/"
				for _, d := range results[ci].Devices.Results {
					sub, found := strings.CutPrefix(d.Request, prefix)
					if !found {
						continue
					}
					for i, u := range r.alts {
						if u.subName == sub && i > r.target {
							return false, true
						}
					}
				}
			}
		}
	}
	for _, g := range groups {
		if g.mode != AlignmentRequire || g.need < 2 {
			continue
		}
		devs := ns.claimDevices(results, g.claims)
		if level, _ := a.sharedLevel(ns, devs); level >= len(a.policy.Attributes) {
			return false, false
		}
	}
	return true, true
}

// maxAlternatives bounds the combinations of firstAvailable subrequests
// that alignedAlternative tries for one group.
const maxAlternatives = 64

// alignedAlternative looks for later firstAvailable subrequests with which
// the alignment=require group g fits in one domain, where the subrequests
// counting chose do not: a claim that requires alignment takes the first
// choice (in upstream's order: the first request's subrequests vary
// slowest) that it can get aligned. On success it makes that choice the
// requests' targets (views accept it then) and g's units, and reports
// true. The subrequests given up are p.passed.
func (p *planner) alignedAlternative(infos []*claimInfo, g *group, avail []bool) bool {
	var reqs []*request
	for _, ci := range g.claims {
		reqs = append(reqs, infos[ci].requests...)
	}
	choice := make([]int, len(reqs))
	for i, r := range reqs {
		if r.target < 0 {
			return false
		}
		choice[i] = r.target
	}
	// next advances choice to the following combination, last request
	// fastest; false after the last one.
	next := func() bool {
		for i := len(reqs) - 1; i >= 0; i-- {
			if choice[i]+1 < len(reqs[i].alts) {
				choice[i]++
				for j := i + 1; j < len(reqs); j++ {
					choice[j] = reqs[j].target
				}
				return true
			}
		}
		return false
	}
	for tries := 0; tries < maxAlternatives && next(); tries++ {
		alt := &group{claims: g.claims, mode: g.mode}
		fits := true
		for i, r := range reqs {
			u := r.alts[choice[i]]
			if u.all || u.upper < u.count {
				fits = false
				break
			}
			alt.units = append(alt.units, u)
			alt.need += u.count
		}
		if !fits || len(p.fittingDomains(alt, avail, false)) == 0 {
			continue
		}
		for i, r := range reqs {
			for _, u := range r.alts[r.target:choice[i]] {
				if p.passed == nil {
					p.passed = map[*unit]bool{}
				}
				p.passed[u] = true
			}
			r.target = choice[i]
		}
		g.units, g.need = alt.units, alt.need
		return true
	}
	return false
}
