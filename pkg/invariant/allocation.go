package invariant

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/utils/ptr"
)

// celCacheSize is how many compiled selectors a [judge] keeps.
const celCacheSize = 1000

// judge is what one [Find] or [CheckWith] needs beside the objects: the
// context of CEL evaluations and the compiled selectors, kept for all
// its reads.
type judge struct {
	ctx context.Context
	cel *cel.Cache
}

func newJudge(ctx context.Context) judge {
	// The features that widen what the API server may have stored:
	// selectors are compiled as stored expressions, which the API server
	// has validated already.
	return judge{ctx: ctx, cel: cel.NewCache(celCacheSize, cel.Features{EnableConsumableCapacity: true, EnableListTypeAttributes: true})}
}

// requestSpec is a request of a claim's spec, or a subrequest of one of
// its firstAvailable requests, as its results name it: "req" or
// "req/sub".
type requestSpec struct {
	class     string
	selectors []resourceapi.DeviceSelector
	mode      resourceapi.DeviceAllocationMode
	count     int64
	capacity  *resourceapi.CapacityRequirements
	// derived are the names of the attributes the request derives
	// (DRADerivedAttributes).
	derived []resourceapi.FullyQualifiedName
}

// unjudged gathers why claims, or parts of them, were not judged for a
// kind of violation, claims by reason (on one line: a CEL compile error
// spans several).
type unjudged map[string][]string

func (u unjudged) add(reason, claim string) {
	reason = strings.Join(strings.Fields(reason), " ")
	if !slices.Contains(u[reason], claim) {
		u[reason] = append(u[reason], claim)
	}
}

// notes returns one line per reason, naming up to five of its claims,
// each line beginning with prefix.
func (u unjudged) notes(prefix string) []string {
	var out []string
	for _, reason := range slices.Sorted(maps.Keys(u)) {
		claims := u[reason]
		slices.Sort(claims)
		named := strings.Join(claims[:min(len(claims), 5)], ", ")
		if len(claims) > 5 {
			named += fmt.Sprintf(" and %d more", len(claims)-5)
		}
		out = append(out, fmt.Sprintf("%s for %s: %s", prefix, named, reason))
	}
	return out
}

// allocationMismatches judges every allocated claim whose devices the
// newest generations of their pools all publish against its spec, as the
// upstream allocator allocates: every result names a request of the spec
// (or a subrequest of a firstAvailable request, as "req/sub"), the results
// of an ExactCount request (or of the one subrequest chosen) are as many
// as its count, those of an All request at least one, every device
// matches the selectors of its request's DeviceClass and of its request,
// the devices of the requests of a matchAttribute constraint have the
// attribute with one type and value, and a result has admin access only
// where its request asks for it (see [grantsAdminAccess]). Admin access
// changes nothing else of this.
//
// classes are the DeviceClasses by name; nil where they could not be
// read, and then class selectors are not judged. A class selector is
// judged only where the class was last changed (its creation or its
// latest managed-fields entry) before the claim was created: a class
// changed since may not be the one the allocation was made with. Parts
// not judged (a selector that does not compile or evaluate, a missing or
// changed class, a list-valued attribute of a constraint) come back as
// notes, not violations.
//
// Devices are judged as published now, not as they were when they were
// allocated, which nothing records: a driver may change a device's
// attributes or capacity while it is allocated (topodra's agent changes
// or drops gpu.topodra.io/nvlinkClique when an NVLink fails). A mismatch
// that rests on the published attributes or capacity of a device whose
// ResourceSlice changed after the devices were chosen (see
// [allocationView] and [changedSince]) is still reported, and its
// message says so and where to look; the others are reported as they
// are.
func allocationMismatches(j judge, claims []*resourceapi.ResourceClaim, classes map[string]*resourceapi.DeviceClass, published pools) ([]finding, []string) {
	var out []finding
	skipped := unjudged{}
	for _, c := range claims {
		alloc := c.Status.Allocation
		if alloc == nil || len(alloc.Devices.Results) == 0 {
			continue
		}
		results := alloc.Devices.Results
		devs := make([]*resourceapi.Device, len(results))
		allPublished := true
		for i, r := range results {
			devs[i] = published.devices[Device{r.Driver, r.Pool, r.Device}]
			allPublished = allPublished && devs[i] != nil
		}
		if !allPublished {
			// The device kinds judge a device that is not published.
			continue
		}
		name := c.Namespace + "/" + c.Name
		problems := claimMismatches(j, c, devs, classes, func(reason string) { skipped.add(reason, name) })
		if len(problems) == 0 {
			continue
		}
		out = append(out, finding{identity: name + "|" + string(c.UID) + "|" + allocatedDevices(c), Violation: Violation{
			Kind: AllocationMismatch, Claims: []string{name},
			Message: mismatchMessage(c, problems, published),
		}})
	}
	return out, skipped.notes(string(AllocationMismatch) + " not judged in part")
}

// mismatch is one way in which an allocation breaks its claim's spec.
type mismatch struct {
	text string
	// devices are the allocated devices on whose published attributes
	// or capacity the mismatch rests; none where it rests on the
	// allocation and the spec alone.
	devices []Device
}

// mismatchMessage words the AllocationMismatch of claim c with problems.
// Each problem that rests on a device whose ResourceSlice changed since
// the devices were chosen (see [allocationView] and [changedSince]) names
// the slice; where some do, the message ends by saying what that means
// and where to look, and where not all do, that the others cannot be
// explained so.
func mismatchMessage(c *resourceapi.ResourceClaim, problems []mismatch, published pools) string {
	name := c.Namespace + "/" + c.Name
	since, allocated := allocationView(c)
	texts := make([]string, len(problems))
	changed := 0
	for i, p := range problems {
		texts[i] = p.text
		var changes []string
		for _, d := range p.devices {
			if src, ok := published.sources[d]; ok && changedSince(src.changed, since) {
				changes = append(changes, fmt.Sprintf("%s changed at %s", src.name, src.changed.UTC().Format(time.RFC3339)))
			}
		}
		if len(changes) > 0 {
			changed++
			texts[i] += fmt.Sprintf(" (ResourceSlice %s)", strings.Join(slices.Compact(changes), ", "))
		}
	}
	message := fmt.Sprintf("claim %s is allocated %s, which its spec does not allow (its devices as published now): %s", name, allocatedDevices(c), strings.Join(texts, "; "))
	if changed == 0 {
		return message
	}
	const hint = "for GPUs of gpu.topodra.io: an NVLink that failed, which changes or drops nvlinkClique, or a driver upgrade; the node's events and its agent's log, \"Devices changed\""
	if changed == len(problems) {
		return message + fmt.Sprintf("; every one of these rests on a device whose ResourceSlice changed after the devices were chosen (%s), so the devices may have been as the spec asks then: look first for a change to them (%s), and report the allocation only where none explains it", allocated, hint)
	}
	return message + fmt.Sprintf("; %d of these %d (those that name a ResourceSlice) rest on devices whose ResourceSlice changed after the devices were chosen (%s) and may come of a change to them (%s); the others cannot", changed, len(problems), allocated, hint)
}

// allocationView is the earliest time at which the devices of c's
// allocation may have been chosen, and how that is known (in words): a
// scheduler chooses them from a view that may be up to AllocationLag
// older than the allocationTimestamp it writes, and never before the
// claim was created. Where the allocation records no allocationTimestamp,
// the claim's creation. Zero where c records neither.
func allocationView(c *resourceapi.ResourceClaim) (time.Time, string) {
	created := c.CreationTimestamp.Time
	if ts := c.Status.Allocation.AllocationTimestamp; ts != nil {
		return latest(ts.Add(-AllocationLag), created), fmt.Sprintf("at most %s before the allocation's timestamp %s", AllocationLag, ts.UTC().Format(time.RFC3339))
	}
	return created, fmt.Sprintf("the allocation records no time; the claim was created at %s", created.UTC().Format(time.RFC3339))
}

// changedSince tells whether a ResourceSlice last changed at changed (see
// specChanged) may have changed after a view of the devices taken no
// earlier than since (see allocationView): where either time is
// unknown (zero), it cannot be told, and the slice counts as unchanged.
func changedSince(changed, since time.Time) bool {
	return !changed.IsZero() && !since.IsZero() && !changed.Before(since)
}

// grantsAdminAccess tells whether result r of claim c has admin access
// that its request asks for, as the upstream allocator writes it: the
// result says so and names a request of c's spec whose adminAccess is
// set (a subrequest of a firstAvailable request cannot ask for it). Only
// such a result leaves its device to other claims; a result that says so
// without its request asking is an exclusive use of its device.
func grantsAdminAccess(c *resourceapi.ResourceClaim, r resourceapi.DeviceRequestAllocationResult) bool {
	if !ptr.Deref(r.AdminAccess, false) {
		return false
	}
	for _, req := range c.Spec.Devices.Requests {
		if req.Name == r.Request {
			return req.Exactly != nil && ptr.Deref(req.Exactly.AdminAccess, false)
		}
	}
	return false
}

// claimMismatches returns what in the allocation of c breaks its spec;
// devs are the published devices of its results, in order. skip is told
// why a part was not judged.
func claimMismatches(j judge, c *resourceapi.ResourceClaim, devs []*resourceapi.Device, classes map[string]*resourceapi.DeviceClass, skip func(reason string)) []mismatch {
	results := c.Status.Allocation.Devices.Results
	specs := map[string]requestSpec{}
	for _, r := range c.Spec.Devices.Requests {
		if e := r.Exactly; e != nil {
			specs[r.Name] = requestSpec{class: e.DeviceClassName, selectors: e.Selectors, mode: e.AllocationMode, count: e.Count,
				capacity: e.Capacity, derived: derivedNames(e.DerivedAttributes)}
		}
		for _, sub := range r.FirstAvailable {
			specs[r.Name+"/"+sub.Name] = requestSpec{class: sub.DeviceClassName, selectors: sub.Selectors, mode: sub.AllocationMode, count: sub.Count,
				capacity: sub.Capacity, derived: derivedNames(sub.DerivedAttributes)}
		}
	}
	var problems []mismatch
	// structural adds a problem that rests on the allocation and the
	// spec alone.
	structural := func(texts ...string) {
		for _, t := range texts {
			problems = append(problems, mismatch{text: t})
		}
	}
	byRequest := map[string]int{}
	for i, r := range results {
		if _, ok := specs[r.Request]; !ok {
			structural(fmt.Sprintf("device %s is allocated for request %q, which the spec does not have", deviceOf(r), r.Request))
			continue
		}
		if ptr.Deref(r.AdminAccess, false) && !grantsAdminAccess(c, r) {
			structural(fmt.Sprintf("device %s is allocated with admin access for request %q, which does not ask for admin access (the allocation counts as an exclusive use of the device)", deviceOf(r), r.Request))
		}
		byRequest[r.Request]++
		for _, t := range selectorMismatches(j, c, r, devs[i], specs[r.Request], classes, skip) {
			problems = append(problems, mismatch{text: t, devices: []Device{resultDevice(r)}})
		}
		problems = append(problems, capacityMismatches(r, devs[i], specs[r.Request].capacity)...)
	}
	for _, r := range c.Spec.Devices.Requests {
		if r.Exactly != nil {
			structural(countMismatch(r.Name, specs[r.Name], byRequest[r.Name])...)
			continue
		}
		var chosen []string
		for _, sub := range r.FirstAvailable {
			if byRequest[r.Name+"/"+sub.Name] > 0 {
				chosen = append(chosen, r.Name+"/"+sub.Name)
			}
		}
		switch len(chosen) {
		case 0:
			structural(fmt.Sprintf("request %q has no device", r.Name))
		case 1:
			structural(countMismatch(chosen[0], specs[chosen[0]], byRequest[chosen[0]])...)
		default:
			structural(fmt.Sprintf("request %q has devices of %d of its subrequests (%s), want those of one", r.Name, len(chosen), strings.Join(chosen, ", ")))
		}
	}
	for i, constraint := range c.Spec.Devices.Constraints {
		if name, ok := derivedIn(constraint, specs); ok {
			skip(fmt.Sprintf("constraint #%d is on %s, which a request derives (DRADerivedAttributes), not checked", i, name))
			continue
		}
		switch {
		case constraint.MatchAttribute != nil:
			problems = append(problems, matchAttributeMismatch(i, constraint, results, devs, skip)...)
		case constraint.DistinctAttribute != nil:
			problems = append(problems, distinctAttributeMismatch(i, constraint, results, devs, skip)...)
		}
	}
	return problems
}

// derivedNames lists the names of derived attributes.
func derivedNames(attrs []resourceapi.DeviceDerivedAttribute) []resourceapi.FullyQualifiedName {
	var names []resourceapi.FullyQualifiedName
	for _, a := range attrs {
		names = append(names, resourceapi.FullyQualifiedName(a.Name))
	}
	return names
}

// derivedIn reports the attribute of constraint where one of the requests
// it covers derives an attribute of that name: the upstream allocator
// then compares the values the request's expression computes, which the
// checker does not evaluate.
func derivedIn(constraint resourceapi.DeviceConstraint, specs map[string]requestSpec) (resourceapi.FullyQualifiedName, bool) {
	var name resourceapi.FullyQualifiedName
	switch {
	case constraint.MatchAttribute != nil:
		name = *constraint.MatchAttribute
	case constraint.DistinctAttribute != nil:
		name = *constraint.DistinctAttribute
	default:
		return "", false
	}
	applies := constraintApplies(constraint)
	for request, spec := range specs {
		if applies(request) && slices.Contains(spec.derived, name) {
			return name, true
		}
	}
	return "", false
}

// capacityMismatches says where device d of result r cannot give what its
// request asks of its capacity (DRAConsumableCapacity): the device lacks a
// capacity asked for, has less of it than asked, or, for a share of a
// device that allows multiple allocations, the share records less
// consumed than asked. Like the upstream allocator it takes a request's
// amount as the least that is consumed (a request policy may round it
// up, never down).
func capacityMismatches(r resourceapi.DeviceRequestAllocationResult, d *resourceapi.Device, asked *resourceapi.CapacityRequirements) []mismatch {
	if asked == nil {
		return nil
	}
	var problems []mismatch
	onDevice := []Device{resultDevice(r)}
	for _, name := range slices.Sorted(maps.Keys(asked.Requests)) {
		want := asked.Requests[name]
		has, ok := d.Capacity[name]
		switch {
		case !ok:
			problems = append(problems, mismatch{text: fmt.Sprintf("device %s has no capacity %s, which request %q asks for", deviceOf(r), name, r.Request), devices: onDevice})
			continue
		case has.Value.Cmp(want) < 0:
			problems = append(problems, mismatch{text: fmt.Sprintf("device %s has %s of capacity %s, request %q asks for %s", deviceOf(r), has.Value.String(), name, r.Request, want.String()), devices: onDevice})
			continue
		}
		if r.ShareID == nil {
			continue
		}
		if consumed, ok := r.ConsumedCapacity[name]; !ok || consumed.Cmp(want) < 0 {
			recorded := "none"
			if ok {
				recorded = consumed.String()
			}
			// What a share records rests on the allocation alone.
			problems = append(problems, mismatch{text: fmt.Sprintf("the share %s of device %s records %s of capacity %s consumed, request %q asks for %s", *r.ShareID, deviceOf(r), recorded, name, r.Request, want.String())})
		}
	}
	return problems
}

// countMismatch says whether request (spec) has the wrong number n of
// results: its count for ExactCount (1 where unset), at least one for All.
func countMismatch(request string, spec requestSpec, n int) []string {
	switch spec.mode {
	case resourceapi.DeviceAllocationModeAll:
		if n == 0 {
			return []string{fmt.Sprintf("request %q (allocation mode All) has no device", request)}
		}
	default:
		want := max(spec.count, 1)
		if int64(n) != want {
			return []string{fmt.Sprintf("request %q has %d devices, want its count %d", request, n, want)}
		}
	}
	return nil
}

// selectorMismatches says which selectors of its request's class and of
// its request (spec) device d of result r does not match.
func selectorMismatches(j judge, c *resourceapi.ResourceClaim, r resourceapi.DeviceRequestAllocationResult, d *resourceapi.Device, spec requestSpec, classes map[string]*resourceapi.DeviceClass, skip func(string)) []string {
	var problems []string
	switch class := classes[spec.class]; {
	case classes == nil:
		// Not read; the report says so once.
	case class == nil:
		skip(fmt.Sprintf("DeviceClass %s does not exist (deleted since the allocation?), its selectors are not checked", spec.class))
	case !specChanged(class.ObjectMeta).Before(c.CreationTimestamp.Time):
		skip(fmt.Sprintf("DeviceClass %s was changed after the claim was created, its selectors are not checked (the allocation may have been made with the earlier ones)", spec.class))
	default:
		problems = append(problems, unmatched(j, r, d, "DeviceClass "+spec.class, class.Spec.Selectors, skip)...)
	}
	return append(problems, unmatched(j, r, d, fmt.Sprintf("request %q", r.Request), spec.selectors, skip)...)
}

// unmatched says which of selectors (of owner) device d of result r does
// not match, evaluated as the upstream allocator evaluates them.
func unmatched(j judge, r resourceapi.DeviceRequestAllocationResult, d *resourceapi.Device, owner string, selectors []resourceapi.DeviceSelector, skip func(string)) []string {
	var problems []string
	for i, selector := range selectors {
		if selector.CEL == nil {
			continue
		}
		expr := j.cel.GetOrCompile(selector.CEL.Expression)
		if expr.Error != nil {
			skip(fmt.Sprintf("selector #%d of %s does not compile here: %v", i, owner, expr.Error))
			continue
		}
		matches, _, err := expr.DeviceMatches(j.ctx, cel.Device{Driver: r.Driver, AllowMultipleAllocations: d.AllowMultipleAllocations, Attributes: d.Attributes, Capacity: d.Capacity})
		switch {
		case err != nil:
			skip(fmt.Sprintf("selector #%d of %s fails on device %s: %v", i, owner, deviceOf(r), cel.EnhanceRuntimeError(err)))
		case !matches:
			problems = append(problems, fmt.Sprintf("device %s does not match selector #%d of %s (%s)", deviceOf(r), i, owner, selector.CEL.Expression))
		}
	}
	return problems
}

// matchAttributeMismatch says whether the devices of the requests of
// constraint (the i-th of the claim) lack its attribute or differ in its
// type or value, judged as the upstream allocator judges it.
func matchAttributeMismatch(i int, constraint resourceapi.DeviceConstraint, results []resourceapi.DeviceRequestAllocationResult, devs []*resourceapi.Device, skip func(string)) []mismatch {
	attribute := *constraint.MatchAttribute
	applies := constraintApplies(constraint)
	var first *resourceapi.DeviceAttribute
	var firstResult resourceapi.DeviceRequestAllocationResult
	for k, r := range results {
		if !applies(r.Request) {
			continue
		}
		value := lookupAttribute(devs[k], r.Driver, attribute)
		switch {
		case value == nil:
			return []mismatch{{text: fmt.Sprintf("constraint #%d matchAttribute %s: device %s does not have the attribute", i, attribute, deviceOf(r)), devices: []Device{resultDevice(r)}}}
		case scalar(*value) == "":
			skip(fmt.Sprintf("constraint #%d matchAttribute %s has a list value or one of no known type, not checked", i, attribute))
			return nil
		case first == nil:
			first, firstResult = value, r
		case scalar(*value) != scalar(*first):
			return []mismatch{{text: fmt.Sprintf("constraint #%d matchAttribute %s: device %s has %s, device %s has %s", i, attribute, deviceOf(firstResult), scalar(*first), deviceOf(r), scalar(*value)),
				devices: []Device{resultDevice(firstResult), resultDevice(r)}}}
		}
	}
	return nil
}

// distinctAttributeMismatch says whether the devices of the requests of
// constraint (the i-th of the claim) lack its attribute or two of them
// have the same type and value, judged as the upstream allocator judges
// it.
func distinctAttributeMismatch(i int, constraint resourceapi.DeviceConstraint, results []resourceapi.DeviceRequestAllocationResult, devs []*resourceapi.Device, skip func(string)) []mismatch {
	attribute := *constraint.DistinctAttribute
	applies := constraintApplies(constraint)
	holder := map[string]resourceapi.DeviceRequestAllocationResult{}
	for k, r := range results {
		if !applies(r.Request) {
			continue
		}
		value := lookupAttribute(devs[k], r.Driver, attribute)
		if value == nil {
			return []mismatch{{text: fmt.Sprintf("constraint #%d distinctAttribute %s: device %s does not have the attribute", i, attribute, deviceOf(r)), devices: []Device{resultDevice(r)}}}
		}
		v := scalar(*value)
		if v == "" {
			skip(fmt.Sprintf("constraint #%d distinctAttribute %s has a list value or one of no known type, not checked", i, attribute))
			return nil
		}
		if other, ok := holder[v]; ok {
			return []mismatch{{text: fmt.Sprintf("constraint #%d distinctAttribute %s: devices %s and %s both have %s", i, attribute, deviceOf(other), deviceOf(r), v),
				devices: []Device{resultDevice(other), resultDevice(r)}}}
		}
		holder[v] = r
	}
	return nil
}

// constraintApplies returns whether constraint covers a result of a
// request (or of a subrequest, "parent/sub"): all where it names none,
// the requests it names and their subrequests, and the subrequests it
// names.
func constraintApplies(constraint resourceapi.DeviceConstraint) func(request string) bool {
	return func(request string) bool {
		if len(constraint.Requests) == 0 || slices.Contains(constraint.Requests, request) {
			return true
		}
		parent, _, sub := strings.Cut(request, "/")
		return sub && slices.Contains(constraint.Requests, parent)
	}
}

// scalar is a's type and value, as "string \"x\"", or "" where a holds a
// list or no value of a known type. Two attributes have the same type and
// value where their scalars are equal (a version compares as its string,
// which semver 2.0.0 keeps minimal).
func scalar(a resourceapi.DeviceAttribute) string {
	switch {
	case a.IntValue != nil:
		return fmt.Sprintf("int %d", *a.IntValue)
	case a.BoolValue != nil:
		return fmt.Sprintf("bool %t", *a.BoolValue)
	case a.StringValue != nil:
		return fmt.Sprintf("string %q", *a.StringValue)
	case a.VersionValue != nil:
		return fmt.Sprintf("version %q", *a.VersionValue)
	}
	return ""
}

// lookupAttribute finds the fully qualified attribute name of device d of
// driver: by its full name, or by its ID where its domain is the driver's
// name, as the upstream allocator looks it up.
func lookupAttribute(d *resourceapi.Device, driver string, name resourceapi.FullyQualifiedName) *resourceapi.DeviceAttribute {
	if a, ok := d.Attributes[resourceapi.QualifiedName(name)]; ok {
		return &a
	}
	domain, id, ok := strings.Cut(string(name), "/")
	if !ok || domain != driver {
		return nil
	}
	if a, ok := d.Attributes[resourceapi.QualifiedName(id)]; ok {
		return &a
	}
	return nil
}

func resultDevice(r resourceapi.DeviceRequestAllocationResult) Device {
	return Device{r.Driver, r.Pool, r.Device}
}

func deviceOf(r resourceapi.DeviceRequestAllocationResult) string {
	return resultDevice(r).String()
}
