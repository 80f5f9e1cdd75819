package allocator

import (
	"slices"
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/topodra/topodra/pkg/topology"
)

// Counting claims with matchAttribute constraints.
//
// matchAttribute constraints (all of a claim's over the same requests: all
// of them, or the same named ones) split the node's devices into classes:
// devices with the same (typed) value of every constrained attribute.
// Upstream allocates such a claim exactly when, for one class, the class's
// free matching devices serve the constrained requests and any free
// matching devices the others, all at once; devices without the attribute
// serve no constrained request. So the claim is
// decided by counting per class, and the planner chooses the devices inside
// the best class. Values that are lists (ListTypeAttributes: upstream
// intersects them) or of an unknown type are left to upstream.

// maxMatchCombinations bounds how many combinations of classes (one per
// constrained claim) counting plans before leaving the pod to upstream.
const maxMatchCombinations = 32

// matchCountable reports whether the claim's constraints can be decided by
// counting: matchAttribute only, all constraints over the same requests
// (all of them, or the same named ones).
func matchCountable(claim *resourceapi.ResourceClaim) bool {
	var first []string
	for k, c := range claim.Spec.Devices.Constraints {
		if c.MatchAttribute == nil || c.DistinctAttribute != nil {
			return false
		}
		names := constrainedRequests(claim, c)
		if names == nil {
			return false
		}
		if k == 0 {
			first = names
		} else if !slices.Equal(first, names) {
			return false
		}
	}
	return true
}

// constrainedRequests lists, in claim order, the requests a constraint
// applies to; nil if it names something that is not a request of the
// claim (a subrequest, say: left to upstream).
func constrainedRequests(claim *resourceapi.ResourceClaim, c resourceapi.DeviceConstraint) []string {
	names := make([]string, 0, len(claim.Spec.Devices.Requests))
	for _, req := range claim.Spec.Devices.Requests {
		if len(c.Requests) == 0 || slices.Contains(c.Requests, req.Name) {
			names = append(names, req.Name)
		}
	}
	for _, name := range c.Requests {
		if !slices.Contains(names, name) {
			return nil
		}
	}
	return names
}

// constrained reports whether request name of info's claim is under its
// matchAttribute constraints (matchCountable holds: they all cover the
// same requests).
func constrained(info *claimInfo, name string) bool {
	cs := info.claim.Spec.Devices.Constraints
	return len(cs) > 0 && (len(cs[0].Requests) == 0 || slices.Contains(cs[0].Requests, name))
}

// lookupAttribute finds a device's attribute as upstream's constraints do:
// topology.LookupAttribute, except that a name without a domain (invalid in
// a constraint) names no attribute.
func lookupAttribute(driver string, device *resourceapi.Device, name resourceapi.FullyQualifiedName) (resourceapi.DeviceAttribute, bool) {
	if !strings.Contains(string(name), "/") {
		return resourceapi.DeviceAttribute{}, false
	}
	return topology.LookupAttribute(driver, device.Attributes, resourceapi.QualifiedName(name))
}

// typedValue renders a scalar attribute so that values of different types
// never compare equal; ok is false for lists and unknown types.
func typedValue(attr resourceapi.DeviceAttribute) (string, bool) {
	switch {
	case attr.StringValue != nil:
		return "s:" + *attr.StringValue, true
	case attr.IntValue != nil:
		return "i:" + strconv.FormatInt(*attr.IntValue, 10), true
	case attr.BoolValue != nil:
		return "b:" + strconv.FormatBool(*attr.BoolValue), true
	case attr.VersionValue != nil:
		return "v:" + *attr.VersionValue, true
	}
	return "", false
}

// matchClasses groups the devices of info's units by the values of the
// claim's constrained attributes. classOf[i] is the class of device i, -1
// for devices that lack an attribute (or are not used by the claim).
// ok is false if a device has a list or unknown value.
func matchClasses(ns *nodeState, info *claimInfo) (classOf []int, names []string, ok bool) {
	classOf = make([]int, len(ns.devices))
	for i := range classOf {
		classOf[i] = -2 // not evaluated
	}
	index := map[string]int{}
	var key strings.Builder
	for _, r := range info.requests {
		if !constrained(info, r.name) {
			continue
		}
		for _, i := range r.alts[0].free {
			if classOf[i] != -2 {
				continue
			}
			found, scalar := classKey(&key, ns, info, i)
			if !scalar {
				return nil, nil, false
			}
			if !found {
				classOf[i] = -1
				continue
			}
			id, seen := index[key.String()]
			if !seen {
				id = len(names)
				index[key.String()] = id
				names = append(names, key.String())
			}
			classOf[i] = id
		}
	}
	return classOf, names, true
}

// classKey writes into key (reset first) the class name of device i: the
// typed values of info's constrained attributes, separated by NUL. found
// is false where the device lacks one of them, scalar false where one is
// a list or of an unknown type.
func classKey(key *strings.Builder, ns *nodeState, info *claimInfo, i int) (found, scalar bool) {
	key.Reset()
	d := &ns.devices[i]
	for k, c := range info.claim.Spec.Devices.Constraints {
		attr, ok := lookupAttribute(d.driver, d.device, *c.MatchAttribute)
		if !ok {
			return false, true
		}
		v, ok := typedValue(attr)
		if !ok {
			return true, false
		}
		if k > 0 {
			key.WriteByte(0)
		}
		key.WriteString(v)
	}
	return true, true
}

// restrictTo returns a copy of info whose constrained (single-alternative)
// requests only have the free devices of class c.
func restrictTo(info *claimInfo, classOf []int, c int) *claimInfo {
	out := *info
	out.requests = make([]*request, len(info.requests))
	for k, r := range info.requests {
		if !constrained(info, r.name) {
			out.requests[k] = r
			continue
		}
		u := *r.alts[0]
		u.free = nil
		for _, i := range r.alts[0].free {
			if classOf[i] == c {
				u.free = append(u.free, i)
			}
		}
		nr := *r
		nr.alts = []*unit{&u}
		nr.target = 0
		out.requests[k] = &nr
	}
	return &out
}

// canServe reports whether distinct free devices can serve all requests of
// info at once (a bipartite matching of request slots to devices).
func canServe(info *claimInfo) bool {
	var slots [][]int
	for _, r := range info.requests {
		u := r.alts[0]
		if len(u.free) < u.count {
			return false
		}
		for range u.count {
			slots = append(slots, u.free)
		}
	}
	return fillSlots(slots, true) == len(slots)
}

// fillSlots gives request slots distinct devices, slot s any device of
// slots[s], and returns how many slots a maximum matching fills. With
// stopEarly it returns at the first slot that stays empty (a count below
// len(slots), not necessarily the maximum).
func fillSlots(slots [][]int, stopEarly bool) int {
	owner := map[int]int{} // device -> slot
	filled := 0
	for s := range slots {
		seen := map[int]bool{}
		var augment func(s int) bool
		augment = func(s int) bool {
			for _, i := range slots[s] {
				if seen[i] {
					continue
				}
				seen[i] = true
				o, taken := owner[i]
				if !taken || augment(o) {
					owner[i] = s
					return true
				}
			}
			return false
		}
		switch {
		case augment(s):
			filled++
		case stopEarly:
			return filled
		}
	}
	return filled
}
