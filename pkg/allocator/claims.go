package allocator

import (
	"context"
	"fmt"
	"math"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

// unitSpec is one request, or one subrequest of a firstAvailable request,
// as the claim and its class define it.
type unitSpec struct {
	// request is the request name; subName the subrequest name or "".
	request, subName string
	subIndex         int
	all              bool
	count            int
	admin            bool
	class            *resourceapi.DeviceClass
	// selectors are the class's selectors, then the request's, compiled;
	// one that does not compile keeps its error (see selectorsMatch).
	selectors []cel.CompilationResult
	// uncompiled is set where one of selectors does not compile.
	uncompiled  bool
	tolerations []resourceapi.DeviceToleration
	// capacity is what the request asks of each device's consumable
	// capacity; nil if nothing.
	capacity *resourceapi.CapacityRequirements
}

// unit is a unitSpec evaluated on one node.
type unit struct {
	*unitSpec
	claimIndex int
	claim      *resourceapi.ResourceClaim

	// matching[i] is true if device i matches class and selectors.
	matching []bool
	// free lists the matching devices that are usable: not in use (or
	// shareable / admin access), taints tolerated.
	free []int
	// upper counts matching devices that are not in use (or may be shared);
	// an upper bound for what upstream can allocate.
	upper  int
	nMatch int
	// uncertn is true where upstream may report an error when its search
	// reaches a device that the unit may match: a selector that fails at
	// run time or does not compile, on a device of the node or on a device
	// of another node that upstream looks at on this node
	// (nodeState.offNode); a device whose node selection upstream cannot
	// evaluate (nodeState.unsure); a device whose capacity upstream's
	// capacity check rejects with an error (capacityCheckFails).
	uncertn bool
}

func (u *unitSpec) displayName() string {
	if u.subName != "" {
		return u.request + "/" + u.subName
	}
	return u.request
}

// request is one request of a claim with its alternatives (one for
// ExactCount, several for firstAvailable).
type request struct {
	claimIndex int
	name       string
	alts       []*unit
	// target is the index in alts that counting expects upstream to choose:
	// the first alternative that can fit. -1 if none can.
	target int
}

func (r *request) chosen() *unit {
	if r.target < 0 {
		return nil
	}
	return r.alts[r.target]
}

// claimInfo is what Allocate derives from one claim on one node.
type claimInfo struct {
	claim    *resourceapi.ResourceClaim
	mode     AlignmentMode
	alignPod bool
	requests []*request
	hasAll   bool
}

// claimStatic is what a claim alone determines; computed once per claim
// object and cycle.
type claimStatic struct {
	// err is a fatal input error (*InputError).
	err         error
	mode        AlignmentMode
	alignPod    bool
	passthrough bool
	requests    []requestStatic
}

type requestStatic struct {
	name string
	alts []*unitSpec
}

// analyze validates claims and evaluates selectors on the node's devices.
// passthrough is true for inputs this package does not interpret (future
// fields, disabled features): upstream alone decides and reports them.
func (a *Allocator) analyze(ctx context.Context, ns *nodeState, claims []*resourceapi.ResourceClaim) (infos []*claimInfo, passthrough bool, err error) {
	infos = make([]*claimInfo, 0, len(claims))
	for ci, claim := range claims {
		st := a.claimStatic(claim)
		if st.err != nil {
			return nil, false, st.err
		}
		passthrough = passthrough || st.passthrough
		info := &claimInfo{claim: claim, mode: st.mode, alignPod: st.alignPod}
		for _, rs := range st.requests {
			r := &request{claimIndex: ci, name: rs.name, target: -1}
			for _, spec := range rs.alts {
				u := &unit{unitSpec: spec, claimIndex: ci, claim: claim}
				a.evaluate(ctx, ns, u)
				r.alts = append(r.alts, u)
				if u.all {
					info.hasAll = true
				}
				if r.target < 0 && (u.all || u.upper >= u.count) {
					r.target = len(r.alts) - 1
				}
			}
			info.requests = append(info.requests, r)
		}
		infos = append(infos, info)
	}
	return infos, passthrough, nil
}

// ClaimAnnotations reads the claim's topodra annotations: the alignment
// mode it asks for (empty where it names none: the policy's applies) and
// whether its devices align with the pod's other claims. An invalid value
// is an *InputError naming the claim and the annotation.
func ClaimAnnotations(claim *resourceapi.ResourceClaim) (mode AlignmentMode, alignPod bool, err error) {
	if value, ok := claim.Annotations[topology.AnnotationAlignment]; ok {
		m, err := ParseAlignmentMode(value)
		if err != nil {
			return "", false, &InputError{Claim: klog.KObj(claim).String(), Detail: "annotation " + topology.AnnotationAlignment, Err: err}
		}
		mode = m
	}
	if value, ok := claim.Annotations[topology.AnnotationAlignWith]; ok {
		if value != "pod" {
			return "", false, &InputError{Claim: klog.KObj(claim).String(), Detail: fmt.Sprintf("annotation %s: invalid value %q (want pod)", topology.AnnotationAlignWith, value)}
		}
		alignPod = true
	}
	return mode, alignPod, nil
}

// claimStatic returns the cached analysis of a claim.
func (a *Allocator) claimStatic(claim *resourceapi.ResourceClaim) *claimStatic {
	if st, ok := a.static.Load(claim); ok {
		return st.(*claimStatic)
	}
	st := a.analyzeClaim(claim)
	a.static.Store(claim, st)
	return st
}

func (a *Allocator) analyzeClaim(claim *resourceapi.ResourceClaim) *claimStatic {
	st := &claimStatic{mode: a.policy.Alignment}
	mode, alignPod, err := ClaimAnnotations(claim)
	if err != nil {
		st.err = err
		return st
	}
	if mode != "" {
		st.mode = mode
	}
	if mode == AlignmentRequire && len(a.policy.Attributes) == 0 {
		st.err = &InputError{Claim: klog.KObj(claim).String(), Detail: fmt.Sprintf("annotation %s: %s needs topology attributes, and the scheduler profile's topologyAttributes are empty", topology.AnnotationAlignment, AlignmentRequire)}
		return st
	}
	st.alignPod = alignPod
	for _, c := range claim.Spec.Devices.Constraints {
		if c.MatchAttribute == nil && c.DistinctAttribute == nil {
			st.passthrough = true
		}
	}
	claimMin := 0
	for ri := range claim.Spec.Devices.Requests {
		req := &claim.Spec.Devices.Requests[ri]
		rs := requestStatic{name: req.Name}
		oversized := math.MaxInt
		switch {
		case req.Exactly != nil:
			e := req.Exactly
			if len(e.DerivedAttributes) > 0 || (e.Capacity != nil && !a.features.ConsumableCapacity) ||
				(e.AdminAccess != nil && !a.features.AdminAccess) {
				// With the feature off, upstream refuses a request that
				// sets adminAccess at all, false included.
				st.passthrough = true
			}
			spec, err := a.newUnitSpec(claim, req.Name, "", 0, e.DeviceClassName, e.Selectors, e.AllocationMode, e.Count, ptr.Deref(e.AdminAccess, false), e.Tolerations, e.Capacity)
			if err != nil {
				st.err = err
				return st
			}
			if spec == nil {
				st.passthrough = true
				continue
			}
			rs.alts = []*unitSpec{spec}
		case len(req.FirstAvailable) > 0:
			if !a.features.PrioritizedList {
				st.passthrough = true
			}
			for si := range req.FirstAvailable {
				sub := &req.FirstAvailable[si]
				if len(sub.DerivedAttributes) > 0 || (sub.Capacity != nil && !a.features.ConsumableCapacity) {
					st.passthrough = true
				}
				if sub.AllocationMode == resourceapi.DeviceAllocationModeExactCount && sub.Count > resourceapi.AllocationResultsMaxSize {
					// No allocation can hold it: upstream passes over it to
					// the next subrequest, and refuses the claim only where
					// every subrequest asks for too many (claimMin).
					oversized = min(oversized, resourceapi.AllocationResultsMaxSize+1)
					continue
				}
				spec, err := a.newUnitSpec(claim, req.Name, sub.Name, si, sub.DeviceClassName, sub.Selectors, sub.AllocationMode, sub.Count, false, sub.Tolerations, sub.Capacity)
				if err != nil {
					st.err = err
					return st
				}
				if spec == nil {
					st.passthrough = true
					continue
				}
				rs.alts = append(rs.alts, spec)
			}
		default:
			st.passthrough = true
			continue
		}
		minCount := oversized
		for _, u := range rs.alts {
			minCount = min(minCount, u.count)
		}
		if minCount < math.MaxInt {
			claimMin += minCount
		}
		st.requests = append(st.requests, rs)
	}
	if claimMin > resourceapi.AllocationResultsMaxSize {
		// Upstream refuses such claims on every node.
		st.err = &InputError{Claim: klog.KObj(claim).String(),
			Detail: fmt.Sprintf("its requests ask for at least %d devices, which exceeds the claim limit of %d", claimMin, resourceapi.AllocationResultsMaxSize)}
	}
	return st
}

// UnknownSelector describes a selector without a CEL expression: one of a
// type added to the API after this package was built. Upstream's allocator
// refuses such a request selector with an error and dereferences the nil
// CEL of such a class selector.
const UnknownSelector = "is of a type this scheduler does not know (it supports cel)"

// newUnitSpec resolves the class and compiles selectors. It returns nil (and
// no error) for requests it does not understand (an allocation mode other
// than ExactCount and All, unset included: upstream refuses those), and an
// *InputError for those no node can satisfy: a missing class, a selector
// of an unknown type, more devices than a claim can hold. A selector that
// does not compile is kept with its error: upstream compiles a selector
// when its search first evaluates it on a device, and a subrequest it never
// gets to cannot fail (see selectorsMatch and explainFatal).
func (a *Allocator) newUnitSpec(claim *resourceapi.ResourceClaim,
	requestName, subName string, subIndex int, className string, selectors []resourceapi.DeviceSelector,
	mode resourceapi.DeviceAllocationMode, count int64, admin bool, tolerations []resourceapi.DeviceToleration,
	capacity *resourceapi.CapacityRequirements) (*unitSpec, error) {
	u := &unitSpec{
		request:     requestName,
		subName:     subName,
		subIndex:    subIndex,
		admin:       admin,
		tolerations: tolerations,
		capacity:    capacity,
	}
	display := u.displayName()
	if className == "" {
		return nil, nil
	}
	switch mode {
	case resourceapi.DeviceAllocationModeAll:
		u.all = true
	case resourceapi.DeviceAllocationModeExactCount:
		if count > resourceapi.AllocationResultsMaxSize {
			return nil, &InputError{Claim: klog.KObj(claim).String(), Request: display,
				Detail: fmt.Sprintf("asks for %d devices, which exceeds the claim limit of %d", count, resourceapi.AllocationResultsMaxSize)}
		}
		if count < 0 {
			return nil, nil
		}
		u.count = int(count)
	default:
		return nil, nil
	}
	class, err := a.classLister.Get(className)
	if err != nil {
		return nil, &InputError{Claim: klog.KObj(claim).String(), Request: display, Detail: "device class " + className, Err: err}
	}
	u.class = class
	for i, sel := range class.Spec.Selectors {
		if sel.CEL == nil {
			return nil, &InputError{Claim: klog.KObj(claim).String(), Request: display,
				Detail: fmt.Sprintf("device class %s: selector #%d %s", className, i, UnknownSelector)}
		}
		u.selectors = append(u.selectors, a.celCache.GetOrCompile(sel.CEL.Expression))
	}
	for i, sel := range selectors {
		if sel.CEL == nil {
			return nil, &InputError{Claim: klog.KObj(claim).String(), Request: display,
				Detail: fmt.Sprintf("selector #%d %s", i, UnknownSelector)}
		}
		u.selectors = append(u.selectors, a.celCache.GetOrCompile(sel.CEL.Expression))
	}
	for _, expr := range u.selectors {
		u.uncompiled = u.uncompiled || expr.Error != nil
	}
	return u, nil
}

// evaluate fills in matching, free, upper and uncertn for u.
func (a *Allocator) evaluate(ctx context.Context, ns *nodeState, u *unit) {
	u.matching = make([]bool, len(ns.devices))
	var memo *sliceMemo
	var memoSlice *resourceapi.ResourceSlice
	for i := range ns.devices {
		d := &ns.devices[i]
		if d.slice != memoSlice {
			memoSlice = d.slice
			memo = a.cache.forSlice(d.slice.UID, d.slice.Generation, a.features.ListTypeAttributes)
		}
		matches, uncertain := selectorsMatch(ctx, memo, d.slice, d.deviceIndex, d.device, u.selectors)
		if uncertain {
			u.uncertn = true
		}
		if !matches {
			continue
		}
		if a.features.ConsumableCapacity {
			fails := d.capacityFails
			if u.capacity != nil {
				fails = len(d.device.Capacity) > 0 && capacityCheckFails(u.capacity, d.device.Capacity)
			}
			u.uncertn = u.uncertn || fails
		}
		u.matching[i] = true
		u.nMatch++
		shareable := ptr.Deref(d.device.AllowMultipleAllocations, false)
		if ns.inUse[i] && !u.admin && !shareable {
			continue
		}
		u.upper++
		if a.features.DeviceTaints && taintPrevents(d.device, u.tolerations) {
			continue
		}
		u.free = append(u.free, i)
	}
	if !u.uncertn && (len(ns.offNode) > 0 || len(ns.unsure) > 0) {
		u.uncertn = a.failsOffNode(ctx, ns, u.selectors)
	}
}

// failsOffNode reports whether selectors fail (at run time, or to compile)
// on a device of ns.offNode, or may match a device of ns.unsure: upstream's
// search evaluates the selectors on such a device when it gets to it, and
// then the device's node selection, and reports the error of either.
func (a *Allocator) failsOffNode(ctx context.Context, ns *nodeState, selectors []cel.CompilationResult) bool {
	var memo *sliceMemo
	var memoSlice *resourceapi.ResourceSlice
	fails := func(r deviceRef, unsure bool) bool {
		if r.slice != memoSlice {
			memoSlice = r.slice
			memo = a.cache.forSlice(r.slice.UID, r.slice.Generation, a.features.ListTypeAttributes)
		}
		matches, uncertain := selectorsMatch(ctx, memo, r.slice, r.index, &r.slice.Spec.Devices[r.index], selectors)
		return uncertain || unsure && matches
	}
	for _, r := range ns.offNode {
		if fails(r, false) {
			return true
		}
	}
	for _, r := range ns.unsure {
		if fails(r, true) {
			return true
		}
	}
	return false
}

// selectorsMatch evaluates selectors on the device at deviceIndex of
// slice, in order, through memo (the slice's cached results; nil evaluates
// every time). A selector that fails at run time or does not compile
// counts as matching and makes uncertain true: upstream reports either
// error when it gets to the device, so counting never rules out what
// upstream would do.
func selectorsMatch(ctx context.Context, memo *sliceMemo, slice *resourceapi.ResourceSlice, deviceIndex int, device *resourceapi.Device, selectors []cel.CompilationResult) (matches, uncertain bool) {
	for _, expr := range selectors {
		if expr.Error != nil {
			uncertain = true
			continue
		}
		state := memoUnknown
		if memo != nil {
			state = memo.get(expr.Expression, deviceIndex)
		}
		if state == memoUnknown {
			ok, _, err := expr.DeviceMatches(ctx, cel.Device{
				Driver:                   slice.Spec.Driver,
				AllowMultipleAllocations: device.AllowMultipleAllocations,
				Attributes:               device.Attributes,
				Capacity:                 device.Capacity,
			})
			switch {
			case err != nil:
				state = memoError
			case ok:
				state = memoTrue
			default:
				state = memoFalse
			}
			if memo != nil && (err == nil || ctx.Err() == nil) {
				memo.set(expr.Expression, deviceIndex, len(slice.Spec.Devices), state)
			}
		}
		switch state {
		case memoError:
			uncertain = true
		case memoFalse:
			return false, uncertain
		}
	}
	return true, uncertain
}

// taintPrevents reports whether a NoSchedule or NoExecute taint on the
// device is not tolerated.
func taintPrevents(device *resourceapi.Device, tolerations []resourceapi.DeviceToleration) bool {
	return UntoleratedTaint(device, tolerations) != nil
}

// UntoleratedTaint returns the device's first NoSchedule or NoExecute
// taint that tolerations do not tolerate, nil if there is none.
func UntoleratedTaint(device *resourceapi.Device, tolerations []resourceapi.DeviceToleration) *resourceapi.DeviceTaint {
	for i := range device.Taints {
		taint := &device.Taints[i]
		if taint.Effect != resourceapi.DeviceTaintEffectNoSchedule && taint.Effect != resourceapi.DeviceTaintEffectNoExecute {
			continue
		}
		tolerated := false
		for _, t := range tolerations {
			if resourceclaim.ToleratesTaint(t, *taint) {
				tolerated = true
				break
			}
		}
		if !tolerated {
			return taint
		}
	}
	return nil
}

// capacityCheckFails reports whether upstream's capacity check, which runs
// with consumable capacity enabled on every device that its search selects
// for a request, may reject the device with an error instead of passing
// over it: where the capacity the device would give the request is
// negative (a stored value from before stricter validation), or where a
// request rounded up to a capacity's valid range may not be representable.
// It errs towards true for values far beyond any real capacity; false means
// the check returns without an error.
func capacityCheckFails(request *resourceapi.CapacityRequirements, capacity map[resourceapi.QualifiedName]resourceapi.DeviceCapacity) bool {
	if request != nil {
		for name := range request.Requests {
			if _, ok := capacity[name]; !ok {
				// Upstream passes over a device that lacks a requested
				// capacity before it computes any.
				return false
			}
		}
	}
	for name, c := range capacity {
		requested, ok := resource.Quantity{}, false
		if request != nil {
			requested, ok = request.Requests[name]
		}
		if !ok {
			given := c.Value
			if c.RequestPolicy != nil && c.RequestPolicy.Default != nil {
				given = *c.RequestPolicy.Default
			}
			if given.Sign() < 0 {
				return true
			}
			continue
		}
		if requested.Sign() < 0 {
			return true
		}
		// Rounded up to a valid value, or to a step of a valid range: no
		// less than requested, so only the arithmetic of a range with a
		// step can fail.
		if c.RequestPolicy == nil || c.RequestPolicy.ValidRange == nil || c.RequestPolicy.ValidRange.Min == nil {
			continue
		}
		r := c.RequestPolicy.ValidRange
		if r.Min.Sign() < 0 {
			return true
		}
		if r.Step != nil && requested.Cmp(*r.Min) >= 0 &&
			(!rangeSafe(requested) || !rangeSafe(*r.Min) || !rangeSafe(*r.Step) || r.Step.Sign() <= 0 ||
				requested.Cmp(*resource.NewMilliQuantity(requested.MilliValue(), requested.Format)) != 0) {
			return true
		}
	}
	return false
}

// rangeSafe reports whether q is a quantity with which rounding up to a
// step of a valid range stays far within int64, in units or thousandths.
func rangeSafe(q resource.Quantity) bool {
	return q.Sign() >= 0 && q.CmpInt64(1<<40) <= 0
}
