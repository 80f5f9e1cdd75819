package allocator

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

// This file turns what the strategies found into what users read:
// Explanations of why claims do not fit on a node, and fatal errors that
// name the claim, request and expression to fix.

// nodeFailure explains an upstream failure that only concerns this node
// (structured.ErrFailedAllocationOnNode, e.g. an invalid pool).
func nodeFailure(claims []*resourceapi.ResourceClaim, err error) *Explanation {
	name := "*"
	if len(claims) > 0 {
		name = claims[0].Name
	}
	return &Explanation{Requests: []RequestExplanation{{Claim: name, Request: "*", Reason: strings.TrimSpace(err.Error()), Cause: CausePools}}}
}

// countCheck returns an explanation if some request cannot fit by counting
// alone (an upper bound of what upstream can allocate), nil otherwise.
func (a *Allocator) countCheck(ctx context.Context, ns *nodeState, infos []*claimInfo) *Explanation {
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
			expl.Requests = append(expl.Requests, a.alternativesExplanation(ctx, r, ns))
		}
	}
	return expl
}

// alternativesExplanation describes a request none of whose alternatives
// fits: the one alternative of an exact request, or every subrequest of
// a prioritized list (the pod would run with any of them).
func (a *Allocator) alternativesExplanation(ctx context.Context, r *request, ns *nodeState) RequestExplanation {
	first := a.requestExplanation(ctx, r.alts[0], ns, "")
	if len(r.alts) == 1 {
		return first
	}
	parts := make([]string, 0, len(r.alts))
	for _, u := range r.alts {
		re := a.requestExplanation(ctx, u, ns, "")
		reason, _, _ := strings.Cut(re.Reason, "; ") // the pools' suffix once, below
		parts = append(parts, u.subName+": "+reason)
	}
	first.Request = r.name
	first.Reason = "no subrequest fits (" + strings.Join(parts, "; ") + ")" + unusablePools(ns)
	return first
}

// requestExplanation describes one unit; ns may be nil (no domain info).
func (a *Allocator) requestExplanation(ctx context.Context, u *unit, ns *nodeState, reason string) RequestExplanation {
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
	unusable := ns != nil && (len(ns.incomplete) > 0 || len(ns.invalid) > 0)
	if reason == "" {
		re.Cause = requestCause(u, re.Needed, unusable)
		switch {
		case u.nMatch == 0:
			where := "the node has"
			if unusable {
				where = "the node's usable resource pools have"
			}
			if n := a.classDevices(ctx, ns, u); n > 0 {
				reason = fmt.Sprintf("%s %s of class %s but none matches the request's selectors", where, plural(n, "device"), u.class.Name)
			} else {
				reason = fmt.Sprintf("%s no device of class %s", where, u.class.Name)
			}
		case u.nMatch < re.Needed:
			reason = fmt.Sprintf("the node has only %s (needs %d)", plural(u.nMatch, "matching device"), re.Needed)
		case u.upper == 0:
			reason = fmt.Sprintf("all %s in use (needs %d)", plural(u.nMatch, "matching device")+" are", re.Needed)
		case u.upper < re.Needed && len(u.free) < u.upper:
			// Fewer free than it needs even with the tainted ones: the
			// taints are named too, since they keep devices from the
			// request once others are given back.
			reason = fmt.Sprintf("%s (needs %d); %d of them tainted: %s", onlyMatch(u.upper), re.Needed, u.upper-len(u.free), taintPhrase(untoleratedKeys(ns, u)))
		case u.upper < re.Needed:
			reason = fmt.Sprintf("%s (needs %d)", onlyMatch(u.upper), re.Needed)
		case len(u.free) < re.Needed:
			reason = fmt.Sprintf("%s once tainted devices are left out (needs %d); taints: %s", onlyMatch(len(u.free)), re.Needed, taintPhrase(untoleratedKeys(ns, u)))
		case unusable:
			reason = matchPhrase(len(u.free))
		default:
			reason = fmt.Sprintf("%s, but no combination satisfies the constraints, counters and other requests of the pod's claims together", matchPhrase(len(u.free)))
		}
		reason += unusablePools(ns)
	}
	re.Reason = reason
	re.UnusablePools = unusablePoolNames(ns)
	return re
}

// requestCause classifies a request of u that needs needed devices, as
// requestExplanation's reasons do; unusable says that a pool of the node
// is incomplete or invalid.
func requestCause(u *unit, needed int, unusable bool) Cause {
	switch {
	case u.nMatch < needed || u.nMatch == 0:
		return CauseNoMatch
	case u.upper < needed:
		return CauseInUse
	case len(u.free) < needed:
		return CauseTainted
	case unusable:
		return CausePools
	default:
		return CauseConstraints
	}
}

// classDevices counts the node's devices that u's class selectors match
// (the request's own selectors aside), as evaluate does; ns nil counts
// none. Only explanations call it: evaluate has filled the slices' memos
// for these selectors.
func (a *Allocator) classDevices(ctx context.Context, ns *nodeState, u *unit) int {
	if ns == nil {
		return 0
	}
	selectors := u.selectors[:len(u.class.Spec.Selectors)]
	n := 0
	var memo *sliceMemo
	var memoSlice *resourceapi.ResourceSlice
	for i := range ns.devices {
		d := &ns.devices[i]
		if d.slice != memoSlice {
			memoSlice = d.slice
			memo = a.cache.forSlice(d.slice.UID, d.slice.Generation, a.features.ListTypeAttributes)
		}
		if matches, _ := selectorsMatch(ctx, memo, d.slice, d.deviceIndex, d.device, selectors); matches {
			n++
		}
	}
	return n
}

// untoleratedKeys names, sorted, the keys of the taints that keep u's
// matching devices that are not in use from it: for the user, the device
// taints to look up (a health taint, the owned key of another scheduler,
// a device plugin beside the agent).
func untoleratedKeys(ns *nodeState, u *unit) []string {
	if ns == nil {
		return nil
	}
	keys := sets.New[string]()
	for i := range ns.devices {
		if !u.matching[i] || ns.inUse[i] && !ptr.Deref(ns.devices[i].device.AllowMultipleAllocations, false) && !u.admin {
			continue
		}
		if t := UntoleratedTaint(ns.devices[i].device, u.tolerations); t != nil {
			keys.Insert(t.Key)
		}
	}
	return sets.List(keys)
}

// taintPhrase names the taints that keep devices from a request, keys as
// untoleratedKeys gives them: the node agent's own with what they mean and
// who must act (topology.TaintExplanation; a toleration is not the fix),
// the others as untolerated. Without commas, as every reason.
func taintPhrase(keys []string) string {
	var other, parts []string
	for _, key := range keys {
		if e := topology.TaintExplanation(key); e != "" {
			parts = append(parts, key+" ("+e+")")
		} else {
			other = append(other, key)
		}
	}
	if len(other) > 0 {
		parts = append([]string{"untolerated " + strings.Join(other, " and ")}, parts...)
	}
	return strings.Join(parts, "; ")
}

// unusablePools says, as a suffix for a reason, that the node has pools
// that upstream allocates nothing from; "" if there are none. It names
// none of them, so that the reason reads the same on every node and the
// scheduler's message for the pod, which counts the nodes of each reason,
// stays short (unusablePoolNames are for the log).
func unusablePools(ns *nodeState) string {
	if ns == nil {
		return ""
	}
	var b strings.Builder
	if len(ns.incomplete) > 0 {
		b.WriteString("; some of the node's resource pools are incomplete (being updated, or published in a form this scheduler cannot use)")
	}
	if len(ns.invalid) > 0 {
		b.WriteString("; invalid resource pools were encountered")
	}
	return b.String()
}

// unusablePoolNames names the node's pools that upstream allocates nothing
// from, with why; "" if there are none.
func unusablePoolNames(ns *nodeState) string {
	if ns == nil {
		return ""
	}
	var parts []string
	for _, pool := range ns.incomplete {
		parts = append(parts, pool+" (incomplete)")
	}
	for _, pool := range slices.Sorted(maps.Keys(ns.invalid)) {
		parts = append(parts, fmt.Sprintf("%s (%s)", pool, ns.invalid[pool]))
	}
	return strings.Join(parts, ", ")
}

// onlyMatch says "no free device matches", "only 1 free device matches"
// or "only 3 free devices match".
func onlyMatch(n int) string {
	if n == 0 {
		return "no free device matches"
	}
	return "only " + matchPhrase(n)
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
func (a *Allocator) explain(ctx context.Context, infos []*claimInfo, ns *nodeState, requireGroup *group, require bool) *Explanation {
	expl := &Explanation{}
	if require && requireGroup != nil {
		if len(requireGroup.units) > 1 {
			// Name the requests that are short by themselves; if none
			// is, the group as a whole.
			for _, u := range requireGroup.units {
				if len(u.free) < u.count {
					expl.Requests = append(expl.Requests, a.requestExplanation(ctx, u, ns, ""))
				}
			}
			if len(expl.Requests) == 0 {
				expl.Requests = append(expl.Requests, a.groupExplanation(ns, infos, requireGroup))
			}
			return expl
		}
		u := requireGroup.units[0]
		reason := fmt.Sprintf("%s but not within one %s (alignment=require)", plural(len(u.free), "device")+" free", a.domainKinds())
		if len(u.free) < u.count {
			reason = ""
		}
		expl.Requests = append(expl.Requests, a.requestExplanation(ctx, u, ns, reason))
		return expl
	}
	// Name the requests that are short of devices; if none is, the
	// combination failed: name the first request.
	var first *unit
	for _, info := range infos {
		for _, r := range info.requests {
			u := r.chosen()
			if u == nil && len(r.alts) > 0 {
				if first == nil {
					first = r.alts[0]
				}
				expl.Requests = append(expl.Requests, a.alternativesExplanation(ctx, r, ns))
				continue
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
				expl.Requests = append(expl.Requests, a.requestExplanation(ctx, u, ns, ""))
			}
		}
	}
	if len(expl.Requests) == 0 && first != nil {
		expl.Requests = append(expl.Requests, a.requestExplanation(ctx, first, ns, ""))
	}
	if len(expl.Requests) == 0 {
		expl.Requests = append(expl.Requests, RequestExplanation{Claim: "*", Request: "*", Reason: "the claims cannot be allocated on this node", Cause: CauseConstraints})
	}
	return expl
}

// domainKinds names the policy's topology attributes for users:
// "nvlinkClique or pcieRoot or numaNode".
func (a *Allocator) domainKinds() string {
	names := make([]string, 0, len(a.policy.Attributes))
	for _, attr := range a.policy.Attributes {
		names = append(names, topology.ShortName(attr))
	}
	return strings.Join(names, " or ")
}

// groupExplanation says why an alignment=require group of several
// requests (of one claim, or of the claims with align-with=pod) fits in no
// domain although each request has enough free devices: the domain that
// serves most of them at once, and which requests it is short of. Free
// is what that domain serves, Matching the most that a domain could serve
// once every device in use is given back (see Explanation.Freeable);
// where counting cannot tell (the domain has enough free devices, or the
// requests have other subrequests), Matching makes it freeable as soon as
// any of the requests' matching devices is in use.
func (a *Allocator) groupExplanation(ns *nodeState, infos []*claimInfo, g *group) RequestExplanation {
	several := len(g.claims) > 1
	bestName, served, short := "", 0, ""
	servable := 0
	usable := a.usableLists(ns, g.units)
	restrict := make([]bool, len(g.units))
	for k := range restrict {
		restrict[k] = true
	}
	for l, attr := range a.policy.Attributes {
		valueOf := func(i int) string { return ns.devices[i].coords[l] }
		v, n, sh := bestShare(g.units, valueOf, several)
		if n > served {
			bestName, served, short = topology.FormatDomain(attr, v), n, sh
		}
		n, _ = mostFilled(g.units, usable, restrict, func(i int) (string, bool) { return valueOf(i), true })
		servable = max(servable, n)
	}
	re := RequestExplanation{
		Matching:       servable,
		Free:           served,
		Needed:         g.need,
		BestDomain:     bestName,
		BestDomainFree: served,
		Cause:          CauseConstraints,
	}
	var reqs []string
	for _, u := range g.units {
		reqs = append(reqs, u.displayName())
	}
	what, mode := "all requests", "alignment=require"
	if several {
		var claims []string
		for _, ci := range g.claims {
			claims = append(claims, infos[ci].claim.Name)
		}
		re.Claim = strings.Join(claims, " and ")
		what, mode = "all their requests", "align-with=pod and alignment=require"
	} else {
		re.Claim = g.units[0].claim.Name
		re.Request = strings.Join(reqs, ",")
	}
	switch {
	case served >= g.need:
		// Counting does not see why (the devices' counters, the pod's
		// other requests): upstream found no such allocation.
		re.Reason = fmt.Sprintf("no %s has free devices for %s that can be allocated together (%s; needs %d)", a.domainKinds(), what, mode, g.need)
	case served > 0:
		re.Reason = fmt.Sprintf("no %s has free devices for %s (%s; needs %d; the best has %d%s)", a.domainKinds(), what, mode, g.need, served, short)
	default:
		re.Reason = fmt.Sprintf("no %s has free devices for %s (%s; needs %d)", a.domainKinds(), what, mode, g.need)
	}
	re.Reason += unusablePools(ns)
	exact := true
	for _, u := range g.units {
		exact = exact && u.subName == ""
	}
	if served >= g.need || !exact {
		// Counting cannot tell whether giving devices back helps (or
		// another subrequest might fit then): freeable where any
		// request's matching devices are in use.
		re.Matching = served
		for _, u := range g.units {
			if len(u.free) < u.nMatch {
				re.Matching = max(served+1, g.need)
			}
		}
	}
	re.UnusablePools = unusablePoolNames(ns)
	return re
}

// bestShare finds the value (valueOf of a device; "" for none) where
// distinct free devices fill the most request slots of units at once
// (ties: the smaller value), how many, and which of units have fewer
// free devices there than they need, as ": 0 of 1 nic free there" ("" if
// none is short; requests as "claim/request" with several claims).
func bestShare(units []*unit, valueOf func(i int) string, several bool) (best string, served int, short string) {
	values := sets.New[string]()
	for _, u := range units {
		for _, i := range u.free {
			if v := valueOf(i); v != "" {
				values.Insert(v)
			}
		}
	}
	in := func(u *unit, v string) []int {
		var out []int
		for _, i := range u.free {
			if valueOf(i) == v {
				out = append(out, i)
			}
		}
		return out
	}
	for _, v := range sets.List(values) {
		var slots [][]int
		for _, u := range units {
			devs := in(u, v)
			for range u.count {
				slots = append(slots, devs)
			}
		}
		if n := fillSlots(slots, false); n > served {
			best, served = v, n
		}
	}
	if served == 0 {
		return "", 0, ""
	}
	var parts []string
	for _, u := range units {
		if n := len(in(u, best)); n < u.count {
			name := u.displayName()
			if several {
				name = u.claim.Name + "/" + name
			}
			parts = append(parts, fmt.Sprintf("%d of %d %s", n, u.count, name))
		}
	}
	if len(parts) > 0 {
		short = ": " + strings.Join(parts, " and ") + " free there"
	}
	return best, served, short
}

// mostFilled is the most request slots of units that distinct devices of
// one value (valueOf; "" for none) fill at once: unit k takes devices of
// devs[k], of that value only where restrict[k]. ok is false where valueOf
// cannot tell the value of such a device.
func mostFilled(units []*unit, devs [][]int, restrict []bool, valueOf func(i int) (string, bool)) (most int, ok bool) {
	values := sets.New[string]()
	for k := range units {
		if !restrict[k] {
			continue
		}
		for _, i := range devs[k] {
			v, ok := valueOf(i)
			if !ok {
				return 0, false
			}
			if v != "" {
				values.Insert(v)
			}
		}
	}
	for v := range values {
		var slots [][]int
		for k, u := range units {
			in := devs[k]
			if restrict[k] {
				in = slices.DeleteFunc(slices.Clone(in), func(i int) bool { w, _ := valueOf(i); return w != v })
			}
			for range u.count {
				slots = append(slots, in)
			}
		}
		most = max(most, fillSlots(slots, false))
	}
	return most, true
}

// freeLists gives the free devices of each unit.
func freeLists(units []*unit) [][]int {
	out := make([][]int, len(units))
	for k, u := range units {
		out[k] = u.free
	}
	return out
}

// usableLists gives, per unit, the devices it could have once every
// device in use is given back: those that match it and that no taint
// keeps from it.
func (a *Allocator) usableLists(ns *nodeState, units []*unit) [][]int {
	out := make([][]int, len(units))
	for k, u := range units {
		for i, m := range u.matching {
			if m && !(a.features.DeviceTaints && taintPrevents(ns.devices[i].device, u.tolerations)) {
				out[k] = append(out[k], i)
			}
		}
	}
	return out
}

// explainSpan explains why alignment=prefer groups had to span domains.
func (a *Allocator) explainSpan(ctx context.Context, ns *nodeState, groups []*group, results []resourceapi.AllocationResult) *Explanation {
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
			re := a.requestExplanation(ctx, u, ns, "")
			re.Reason = fmt.Sprintf("devices span domains: the best domain %s has %d of %d needed free devices (alignment=prefer)", re.BestDomain, re.BestDomainFree, g.need)
			if re.BestDomain == "" {
				re.Reason = "devices span domains: the matching devices publish no topology attributes (alignment=prefer)"
			}
			expl.Requests = append(expl.Requests, re)
		}
	}
	return expl
}

// matchExplanation says why no class can serve a constrained claim
// (classOf and names as matchClasses gives them). Its reason names the
// constrained requests that the best value (the one that serves most of
// them at once) is short of; its counts are for the whole claim: Free is
// the most of the claim's requests one value serves now, Matching the most
// once every device in use is given back (see Explanation.Freeable).
func (a *Allocator) matchExplanation(ns *nodeState, info *claimInfo, classOf []int, names []string) RequestExplanation {
	var reqNames []string
	var cons, all []*unit
	var restrict []bool
	needC, need := 0, 0
	without := sets.New[int]()
	for _, r := range info.requests {
		u := r.alts[0]
		all = append(all, u)
		need += u.count
		restrict = append(restrict, constrained(info, r.name))
		if !constrained(info, r.name) {
			continue
		}
		cons = append(cons, u)
		reqNames = append(reqNames, u.displayName())
		needC += u.count
		for _, i := range u.free {
			if classOf[i] == -1 {
				without.Insert(i)
			}
		}
	}
	valueOf := func(i int) string {
		if classOf[i] < 0 {
			return ""
		}
		return names[classOf[i]]
	}
	best, served, short := bestShare(cons, valueOf, false)
	// The claim's unconstrained requests take devices of any value.
	free, _ := mostFilled(all, freeLists(all), restrict, func(i int) (string, bool) { return valueOf(i), true })
	var attrs []string
	for _, c := range info.claim.Spec.Devices.Constraints {
		attrs = append(attrs, string(*c.MatchAttribute))
	}
	which := "all requests"
	if len(reqNames) < len(info.requests) {
		which = "requests " + strings.Join(reqNames, " and ")
	}
	var reason string
	if served == needC {
		// The constrained requests fit in one value; the claim's others
		// do not fit beside them.
		reason = fmt.Sprintf("no single value of %s leaves free devices for the claim's other requests (needs %d in all)", strings.Join(attrs, " and "), need)
	} else {
		reason = fmt.Sprintf("no single value of %s has free devices for %s (needs %d", strings.Join(attrs, " and "), which, needC)
		if served > 0 {
			reason += fmt.Sprintf("; the best has %d%s", served, short)
		}
		reason += ")"
	}
	if without.Len() > 0 {
		verb := " lack"
		if without.Len() == 1 {
			verb = " lacks"
		}
		reason += "; " + plural(without.Len(), "free device") + verb + " the attribute"
	}
	// Every device's class, in use or not: where one is a list value,
	// counting cannot tell, and the claim may fit once devices are given
	// back.
	var key strings.Builder
	servable, ok := mostFilled(all, a.usableLists(ns, all), restrict, func(i int) (string, bool) {
		found, scalar := classKey(&key, ns, info, i)
		if !found {
			return "", scalar
		}
		return key.String(), scalar
	})
	if !ok {
		servable = need
	}
	return RequestExplanation{
		Claim:          info.claim.Name,
		Request:        strings.Join(reqNames, ","),
		Matching:       servable,
		Free:           free,
		Needed:         need,
		BestDomain:     displayValue(best),
		BestDomainFree: served,
		Reason:         reason,
		Cause:          CauseConstraints,
	}
}

// displayValue drops the type tags of a class name.
func displayValue(key string) string {
	parts := strings.Split(key, "\x00")
	for k, p := range parts {
		if len(p) >= 2 && p[1] == ':' {
			parts[k] = p[2:]
		}
	}
	return strings.Join(parts, ",")
}

// explainFatal turns a fatal error of the upstream allocator into one that
// names what the user has to fix. Upstream reports a CEL error with the
// claim (or class) and the index of the selector only; this finds the
// request and the expression (of the request or of its class), with a
// device of the node it fails on for a runtime error, and returns an
// *InputError. It runs only on the error path. Errors it cannot
// attribute, failures of this node only and cancellation are returned as
// they are.
func (a *Allocator) explainFatal(ctx context.Context, p *podNode, err error) error {
	if err == nil || ctx.Err() != nil || errors.Is(err, structured.ErrFailedAllocationOnNode) {
		return err
	}
	ns, gerr := p.devices()
	if gerr != nil {
		return err
	}
	// Upstream's words for a selector that does not compile.
	compile := strings.Contains(err.Error(), "CEL compile error")
	for _, claim := range p.claims {
		for _, req := range claim.Spec.Devices.Requests {
			if req.Exactly != nil {
				if e := a.failingSelector(ctx, ns, claim, req.Name, req.Exactly.DeviceClassName, req.Exactly.Selectors, compile, err); e != nil {
					return e
				}
			}
			for _, sub := range req.FirstAvailable {
				if e := a.failingSelector(ctx, ns, claim, resourceclaim.CreateSubRequestRef(req.Name, sub.Name), sub.DeviceClassName, sub.Selectors, compile, err); e != nil {
					return e
				}
			}
		}
	}
	return err
}

// failingSelector returns an *InputError for a selector of a request
// (class selectors first) that explains err: with compile, the first that
// does not compile with the error that err quotes; otherwise the first
// that fails at run time on a device of the node, or on another device
// that upstream looks at on this node (nodeState.offNode,
// nodeState.unsure), where the selectors before it match the device. Nil
// if none does.
func (a *Allocator) failingSelector(ctx context.Context, ns *nodeState, claim *resourceapi.ResourceClaim, request, className string, selectors []resourceapi.DeviceSelector, compile bool, err error) error {
	var exprs, origins, indexed []string
	if class, cerr := a.classLister.Get(className); cerr == nil {
		for i, sel := range class.Spec.Selectors {
			if sel.CEL != nil {
				exprs = append(exprs, sel.CEL.Expression)
				origins = append(origins, "device class "+className+" selector")
				indexed = append(indexed, fmt.Sprintf("device class %s: selector #%d", className, i))
			}
		}
	}
	for i, sel := range selectors {
		if sel.CEL != nil {
			exprs = append(exprs, sel.CEL.Expression)
			origins = append(origins, "selector")
			indexed = append(indexed, fmt.Sprintf("selector #%d", i))
		}
	}
	if compile {
		for k, expr := range exprs {
			if compiled := a.celCache.GetOrCompile(expr); compiled.Error != nil && strings.Contains(err.Error(), compiled.Error.Error()) {
				return &InputError{Claim: klog.KObj(claim).String(), Request: request,
					Detail: fmt.Sprintf("%s: CEL expression `%s`", indexed[k], expr), Err: compiled.Error}
			}
		}
		return nil
	}
	// Upstream evaluates a device's selectors in order, up to the first
	// that does not match or fails.
	fails := func(driver, deviceName string, d *resourceapi.Device) error {
		for k, expr := range exprs {
			compiled := a.celCache.GetOrCompile(expr)
			if compiled.Error != nil {
				return nil
			}
			matches, _, derr := compiled.DeviceMatches(ctx, cel.Device{
				Driver:                   driver,
				AllowMultipleAllocations: d.AllowMultipleAllocations,
				Attributes:               d.Attributes,
				Capacity:                 d.Capacity,
			})
			if derr != nil {
				if missingKey(derr) {
					derr = fmt.Errorf("%w (%s)", derr, deviceDomains(driver, d))
				}
				return &InputError{Claim: klog.KObj(claim).String(), Request: request,
					Detail: fmt.Sprintf("%s `%s` fails on device %s", origins[k], expr, deviceName), Err: derr}
			}
			if !matches {
				return nil
			}
		}
		return nil
	}
	for i := range ns.devices {
		d := &ns.devices[i]
		if err := fails(d.driver, d.name, d.device); err != nil {
			return err
		}
	}
	for _, r := range slices.Concat(ns.offNode, ns.unsure) {
		d := &r.slice.Spec.Devices[r.index]
		if err := fails(r.slice.Spec.Driver, r.slice.Spec.Driver+"/"+r.slice.Spec.Pool.Name+"/"+d.Name, d); err != nil {
			return err
		}
	}
	return nil
}

// missingKey reports whether a selector's run-time error is a lookup of a
// key the device does not have (an attribute or capacity, or a domain
// with none): the errors that upstream's cel.EnhanceRuntimeError wraps
// with a hint, which it returns as they are otherwise.
func missingKey(err error) bool {
	return reflect.TypeOf(cel.EnhanceRuntimeError(err)) != reflect.TypeOf(err)
}

// maxDomains bounds how many domains deviceDomains names of each kind.
const maxDomains = 4

// deviceDomains names the domains of a device's attributes and capacities
// (a name without one is in the driver's), sorted, at most maxDomains of
// each: for a selector that looks in the wrong domain, e.g.
// "the device's attribute domains: gpu.topodra.io, resource.kubernetes.io;
// capacity domains: none".
func deviceDomains(driver string, d *resourceapi.Device) string {
	domains := func(names []resourceapi.QualifiedName) string {
		set := sets.New[string]()
		for _, name := range names {
			domain, _, ok := strings.Cut(string(name), "/")
			if !ok {
				domain = driver
			}
			set.Insert(domain)
		}
		list := sets.List(set)
		switch {
		case len(list) == 0:
			return "none"
		case len(list) > maxDomains:
			return strings.Join(list[:maxDomains], ", ") + fmt.Sprintf(" and %d more", len(list)-maxDomains)
		}
		return strings.Join(list, ", ")
	}
	return "the device's attribute domains: " + domains(slices.Collect(maps.Keys(d.Attributes))) +
		"; capacity domains: " + domains(slices.Collect(maps.Keys(d.Capacity)))
}
