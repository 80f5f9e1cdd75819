package allocator

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/topology"
)

// Allocate finds the best allocation of claims (the pod's claims that still
// need one) on node. It is safe for concurrent use.
//
// It returns (nil, err) only for problems that make the claims unallocatable
// on every node: an invalid CEL expression, an unknown DeviceClass, an
// invalid topodra annotation (these wrap ErrInvalidInput and name the claim,
// request and expression or class), whatever upstream considers fatal, and
// cancellation of ctx. Otherwise the Result is non-nil; Result.Allocations
// is nil when the claims do not fit on this node, and Result.Explanation
// then says why.
func (a *Allocator) Allocate(ctx context.Context, node *v1.Node, claims []*resourceapi.ResourceClaim) (*Result, error) {
	if node == nil {
		return nil, errors.New("allocate: node is nil")
	}
	if a.countablePod(claims) {
		if res, ok, err := a.allocateCounted(ctx, node, claims); ok || err != nil {
			return res, err
		}
	}
	if a.simplePod(claims) {
		return a.allocateOrdered(ctx, node, claims)
	}
	return a.allocateViews(ctx, node, claims)
}

// allocateViews allocates on the preferred views of the node: one upstream
// call per view until one works, the whole node last.
func (a *Allocator) allocateViews(ctx context.Context, node *v1.Node, claims []*resourceapi.ResourceClaim) (*Result, error) {
	logger := klog.FromContext(ctx)
	ns, err := a.gatherNode(node)
	if err != nil {
		return nil, err
	}
	infos, passthrough, err := a.analyze(ctx, ns, claims)
	if err != nil {
		return nil, err
	}
	var allUnits []*unit
	for _, info := range infos {
		for _, r := range info.requests {
			allUnits = append(allUnits, r.alts...)
		}
	}

	if !passthrough {
		if expl := a.countCheck(infos); expl != nil {
			logger.V(5).Info("Claims do not fit by counting", "node", klog.KObj(node), "reason", expl.String())
			return &Result{Explanation: expl, DevicesConsidered: len(ns.devices)}, nil
		}
	}

	// The views to try, built lazily: most preferred first.
	var groups []*group
	var attempts []func() []*resourceapi.ResourceSlice
	if !passthrough && len(a.policy.Attributes) > 0 {
		groups = buildGroups(infos)
		p := &planner{ns: ns, levels: len(a.policy.Attributes), pack: a.policy.Packing, groups: groups, allUnits: allUnits}
		maxPlans := 2
		for _, g := range groups {
			if g.mode == AlignmentRequire && g.need > 1 {
				maxPlans = 8
				avail := make([]bool, len(ns.devices))
				for i := range avail {
					avail[i] = true
				}
				if len(p.fittingDomains(g, avail, false)) == 0 {
					return &Result{Explanation: a.explain(infos, ns, g, true), DevicesConsidered: len(ns.devices)}, nil
				}
			}
		}
		if len(groups) > 0 {
			podHasAll := false
			for _, info := range infos {
				podHasAll = podHasAll || info.hasAll
			}
			plans := p.plans(maxPlans)
			for i := range plans {
				pl := &plans[i]
				if podHasAll {
					// "All" means all devices: never hide any.
					break
				}
				// Only the picked devices (and what other claims may
				// use): upstream merely confirms the choice, and has
				// few devices to look at.
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
		}
	}
	// The node's slices as they are: upstream's own answer.
	attempts = append(attempts, func() []*resourceapi.ResourceSlice { return ns.slices })

	// Preferred views share a time budget: upstream's search can take
	// exponential time on some inputs, and then only its own answer
	// (the final view) is worth waiting for.
	prefCtx := ctx
	if len(attempts) > 1 {
		var cancel context.CancelFunc
		prefCtx, cancel = context.WithTimeout(ctx, preferredViewsBudget)
		defer cancel()
	}
	requireRejected := false
	for n, view := range attempts {
		final := n == len(attempts)-1
		callCtx := ctx
		if !final {
			if prefCtx.Err() != nil {
				continue
			}
			callCtx = prefCtx
		}
		results, err := a.upstream(callCtx, node, claims, view())
		if err != nil {
			if ctx.Err() != nil {
				return nil, err
			}
			if !final {
				logger.V(5).Info("Preferred view failed, trying the next", "node", klog.KObj(node), "attempt", n, "err", err)
				continue
			}
			if errors.Is(err, structured.ErrFailedAllocationOnNode) {
				return &Result{Explanation: nodeFailure(claims, err)}, nil
			}
			return nil, a.explainFatal(ctx, node, claims, err)
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
		q := a.quality(ns, infos, allUnits, results)
		res := &Result{Allocations: results, Quality: q, DevicesConsidered: len(ns.devices)}
		if !q.Aligned {
			res.Explanation = a.explainSpan(ns, groups, results)
		}
		if logger.V(4).Enabled() {
			logger.V(4).Info("Allocated", "node", klog.KObj(node), "attempt", n, "of", len(attempts), "devices", q.Devices, "level", q.LevelName, "score", q.Score)
		}
		return res, nil
	}
	var expl *Explanation
	if requireRejected {
		for _, g := range groups {
			if g.mode == AlignmentRequire && g.need > 1 {
				expl = a.explain(infos, ns, g, true)
				break
			}
		}
	}
	if expl == nil {
		expl = a.explain(infos, ns, nil, false)
	}
	return &Result{Explanation: expl, DevicesConsidered: len(ns.devices)}, nil
}

// nodeFailure explains an upstream failure that only concerns this node
// (structured.ErrFailedAllocationOnNode, e.g. an invalid pool).
func nodeFailure(claims []*resourceapi.ResourceClaim, err error) *Explanation {
	name := "*"
	if len(claims) > 0 {
		name = claims[0].Name
	}
	return &Explanation{Requests: []RequestExplanation{{Claim: name, Request: "*", Reason: strings.TrimSpace(err.Error())}}}
}

// preferredViewsBudget bounds the time spent on preferred views per node.
// A view usually takes tens of microseconds.
const preferredViewsBudget = 20 * time.Millisecond

func (a *Allocator) upstream(ctx context.Context, node *v1.Node, claims []*resourceapi.ResourceClaim, view []*resourceapi.ResourceSlice) ([]resourceapi.AllocationResult, error) {
	alloc, err := structured.NewAllocator(ctx, a.features, a.state, a.classLister, view, a.celCache)
	if err != nil {
		return nil, err
	}
	return alloc.Allocate(ctx, node, claims)
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

// lookup returns the node device index of a result entry, or -1.
func (ns *nodeState) lookup(r *resourceapi.DeviceRequestAllocationResult) int {
	for i := range ns.devices {
		d := &ns.devices[i]
		if d.device.Name == r.Device && d.slice.Spec.Pool.Name == r.Pool && d.driver == r.Driver {
			return i
		}
	}
	return -1
}

// claimDevices lists the node device indices allocated to the given claims.
func (ns *nodeState) claimDevices(results []resourceapi.AllocationResult, claims []int) []int {
	var devs []int
	for _, ci := range claims {
		for k := range results[ci].Devices.Results {
			if i := ns.lookup(&results[ci].Devices.Results[k]); i >= 0 {
				devs = append(devs, i)
			}
		}
	}
	return devs
}

// sharedLevel returns the first level at which all devs share one value,
// and that value; len(Attributes) if none.
func (a *Allocator) sharedLevel(ns *nodeState, devs []int) (int, string) {
	for l := range a.policy.Attributes {
		if v, ok := sharedValue(ns, l, devs); ok {
			return l, v
		}
	}
	return len(a.policy.Attributes), ""
}

// sharedValue returns the value of attribute level that all devs have, if
// there is one.
func sharedValue(ns *nodeState, level int, devs []int) (string, bool) {
	if len(devs) == 0 {
		return "", false
	}
	v := ns.devices[devs[0]].coords[level]
	if v == "" {
		return "", false
	}
	for _, i := range devs[1:] {
		if ns.devices[i].coords[level] != v {
			return "", false
		}
	}
	return v, true
}

// quality describes a result.
func (a *Allocator) quality(ns *nodeState, infos []*claimInfo, allUnits []*unit, results []resourceapi.AllocationResult) Quality {
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

	// The devices the pod's requests match: packing and domain sizes count
	// only those.
	matching := make([]bool, len(ns.devices))
	total, used := 0, 0
	for _, u := range allUnits {
		for i, m := range u.matching {
			if m && !matching[i] {
				matching[i] = true
				total++
				if ns.inUse[i] || seen[i] {
					used++
				}
			}
		}
	}
	nodeUtil := 1.0
	if total > 0 {
		nodeUtil = float64(used) / float64(total)
	}

	// The domains all devices share, with their size and busy devices
	// (after this allocation), in one pass per shared level.
	type shared struct {
		value      string
		size, busy int
	}
	domains := make([]*shared, L)
	for l := range L {
		v, ok := sharedValue(ns, l, devs)
		if !ok {
			continue
		}
		d := &shared{value: v}
		for i := range ns.devices {
			if matching[i] && ns.devices[i].coords[l] == v {
				d.size++
				if ns.inUse[i] || seen[i] {
					d.busy++
				}
			}
		}
		domains[l] = d
	}

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

	// Aligned: every multi-device claim and the align-with=pod group share a domain.
	q.Aligned = true
	var podDevs []int
	for ci, info := range infos {
		if len(perClaim[ci]) > 1 && L > 0 {
			if level, _ := a.sharedLevel(ns, perClaim[ci]); level >= L {
				q.Aligned = false
			}
		}
		if info.alignPod {
			podDevs = append(podDevs, perClaim[ci]...)
		}
	}
	if len(podDevs) > 1 && L > 0 {
		if level, _ := a.sharedLevel(ns, podDevs); level >= L {
			q.Aligned = false
		}
	}

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
	q.Score = a.score(q, len(devs), nodeUtil)
	return q
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

// score combines alignment and packing as documented on Quality.Score.
func (a *Allocator) score(q Quality, numDevices int, nodeUtil float64) int64 {
	align := q.Alignment(len(a.policy.Attributes), numDevices)
	pack := q.Packing
	if !a.policy.Packing {
		pack = 1 - nodeUtil
	}
	score := int64(math.Round(100 * (0.7*align + 0.3*pack)))
	return max(0, min(100, score))
}

// countCheck returns an explanation if some request cannot fit by counting
// alone (an upper bound of what upstream can allocate), nil otherwise.
func (a *Allocator) countCheck(infos []*claimInfo) *Explanation {
	var expl *Explanation
	for _, info := range infos {
		for _, r := range info.requests {
			for _, u := range r.alts {
				if u.uncertn || u.all {
					// Upstream may report an error instead (a CEL
					// runtime error; All mode on an incomplete or
					// invalid pool): let it decide.
					return nil
				}
			}
			if r.target >= 0 || len(r.alts) == 0 {
				continue
			}
			if expl == nil {
				expl = &Explanation{}
			}
			expl.Requests = append(expl.Requests, a.requestExplanation(r.alts[0], nil, ""))
		}
	}
	return expl
}

// requestExplanation describes one unit; ns may be nil (no domain info).
func (a *Allocator) requestExplanation(u *unit, ns *nodeState, reason string) RequestExplanation {
	re := RequestExplanation{
		Claim:    u.claim.Name,
		Request:  u.displayName(),
		Matching: u.nMatch,
		Free:     len(u.free),
		Needed:   u.count,
	}
	if u.all {
		re.Needed = u.nMatch
	}
	if ns != nil {
		re.BestDomain, re.BestDomainFree = a.bestDomain(ns, u.free)
	}
	if reason == "" {
		switch {
		case u.nMatch == 0:
			reason = fmt.Sprintf("no device matches class %s and the request's selectors", u.class.Name)
		case u.upper == 0:
			reason = fmt.Sprintf("all %s in use (needs %d)", plural(u.nMatch, "matching device")+" are", re.Needed)
		case u.upper < re.Needed:
			reason = fmt.Sprintf("only %s (needs %d)", matchPhrase(u.upper), re.Needed)
		case len(u.free) < re.Needed:
			reason = fmt.Sprintf("only %s when untolerated taints are excluded (needs %d)", matchPhrase(len(u.free)), re.Needed)
		case ns != nil && len(ns.incomplete) > 0:
			reason = fmt.Sprintf("%s, but resource pool %s is incomplete (being updated)", matchPhrase(len(u.free)), strings.Join(ns.incomplete, ", "))
		default:
			reason = fmt.Sprintf("%s, but no combination satisfies the constraints, counters and other requests of the pod's claims together", matchPhrase(len(u.free)))
		}
	}
	re.Reason = reason
	return re
}

// matchPhrase says "1 free device matches" or "3 free devices match".
func matchPhrase(n int) string {
	if n == 1 {
		return "1 free device matches"
	}
	return fmt.Sprintf("%d free devices match", n)
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

// bestDomain returns the domain with the most of devs, tightest first on ties.
func (a *Allocator) bestDomain(ns *nodeState, devs []int) (string, int) {
	best, bestN := "", 0
	for l, attr := range a.policy.Attributes {
		counts := map[string]int{}
		for _, i := range devs {
			if v := ns.devices[i].coords[l]; v != "" {
				counts[v]++
			}
		}
		for v, n := range counts {
			name := topology.FormatDomain(attr, v)
			if n > bestN || (n == bestN && n > 0 && strings.Compare(name, best) < 0 && strings.HasPrefix(best, string(attr)+"=")) {
				best, bestN = name, n
			}
		}
	}
	return best, bestN
}

// explain describes why nothing fit: for a failed alignment=require group
// (requireGroup != nil), or in general.
func (a *Allocator) explain(infos []*claimInfo, ns *nodeState, requireGroup *group, require bool) *Explanation {
	expl := &Explanation{}
	if require && requireGroup != nil {
		names := make([]string, 0, len(a.policy.Attributes))
		for _, attr := range a.policy.Attributes {
			names = append(names, topology.ShortName(attr))
		}
		for _, u := range requireGroup.units {
			reason := fmt.Sprintf("%s but not within one %s (alignment=require)", plural(len(u.free), "device")+" free", strings.Join(names, " or "))
			if len(u.free) < u.count {
				reason = ""
			}
			expl.Requests = append(expl.Requests, a.requestExplanation(u, ns, reason))
		}
		return expl
	}
	// Name the requests that are short of devices; if none is, the
	// combination failed: name the first request.
	var first *unit
	for _, info := range infos {
		for _, r := range info.requests {
			u := r.chosen()
			if u == nil && len(r.alts) > 0 {
				u = r.alts[0]
			}
			if u == nil {
				continue
			}
			if first == nil {
				first = u
			}
			needed := u.count
			if u.all {
				needed = u.nMatch
			}
			if len(u.free) < needed || u.nMatch == 0 {
				expl.Requests = append(expl.Requests, a.requestExplanation(u, ns, ""))
			}
		}
	}
	if len(expl.Requests) == 0 && first != nil {
		expl.Requests = append(expl.Requests, a.requestExplanation(first, ns, ""))
	}
	if len(expl.Requests) == 0 {
		expl.Requests = append(expl.Requests, RequestExplanation{Claim: "*", Request: "*", Reason: "the claims cannot be allocated on this node"})
	}
	return expl
}

// explainSpan explains why alignment=prefer groups had to span domains.
func (a *Allocator) explainSpan(ns *nodeState, groups []*group, results []resourceapi.AllocationResult) *Explanation {
	var expl *Explanation
	for _, g := range groups {
		if g.need < 2 || g.mode != AlignmentPrefer {
			continue
		}
		devs := ns.claimDevices(results, g.claims)
		if level, _ := a.sharedLevel(ns, devs); level < len(a.policy.Attributes) {
			continue
		}
		for _, u := range g.units {
			if expl == nil {
				expl = &Explanation{}
			}
			re := a.requestExplanation(u, ns, "")
			re.Reason = fmt.Sprintf("devices span domains: the best domain %s has %d of %d needed free devices (alignment=prefer)", re.BestDomain, re.BestDomainFree, g.need)
			if re.BestDomain == "" {
				re.Reason = "devices span domains: the matching devices publish no topology attributes (alignment=prefer)"
			}
			expl.Requests = append(expl.Requests, re)
		}
	}
	return expl
}
