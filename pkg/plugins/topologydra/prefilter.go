package topologydra

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/wait"
	resourcehelper "k8s.io/component-helpers/resource"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/topodra/topodra/pkg/allocator"
)

// PreEnqueue keeps a pod out of the active queue until all of its claims
// exist (claims from templates are created by the ResourceClaim controller
// and named in pod.status.resourceClaimStatuses).
//
// The queue keeps such a pod without a scheduling attempt, so no condition
// or event says why it waits: where the wait is not the claim
// controller's usual short one (a claim the pod names directly that does
// not exist, a claim being deleted, a claim of another pod), the pod gets
// a warning event.
func (pl *TopologyDRA) PreEnqueue(ctx context.Context, pod *v1.Pod) *fwk.Status {
	if _, err := pl.podClaims(pod); err != nil {
		var wait *claimWaitError
		if errors.As(err, &wait) && wait.tellUser {
			// An action of its own: the events of one object, type,
			// reason and action form one series, which keeps the note of
			// its first event, and the scheduler's FailedScheduling for
			// an earlier attempt would hide this one.
			pl.event(pod, v1.EventTypeWarning, "FailedScheduling", "WaitForResourceClaims", "%s", err.Error())
		}
		return unschedulable(err.Error())
	}
	return nil
}

// claimWaitError says why a pod's claims are not ready for scheduling,
// and whether the user should be told (see PreEnqueue).
type claimWaitError struct {
	err      error
	tellUser bool
}

func (e *claimWaitError) Error() string { return e.err.Error() }
func (e *claimWaitError) Unwrap() error { return e.err }

// podClaims returns the pod's claims from the scheduler's claim cache, in
// pod.spec.resourceClaims order, or an error saying which one is missing.
func (pl *TopologyDRA) podClaims(pod *v1.Pod) ([]*resourceapi.ResourceClaim, error) {
	claims := make([]*resourceapi.ResourceClaim, 0, len(pod.Spec.ResourceClaims))
	for i := range pod.Spec.ResourceClaims {
		podClaim := &pod.Spec.ResourceClaims[i]
		name, mustCheckOwner, err := resourceclaim.Name(pod, podClaim)
		if err != nil {
			return nil, err
		}
		if name == nil {
			// A template claim that the controller decided is not
			// needed; nothing to allocate.
			continue
		}
		claim, err := pl.draManager.ResourceClaims().Get(pod.Namespace, *name)
		if err != nil {
			// A claim of a template is created by the claim controller
			// just after the pod; one the pod names must exist already.
			return nil, &claimWaitError{err: fmt.Errorf("waiting for resource claim %s/%s: %w", pod.Namespace, *name, err), tellUser: podClaim.ResourceClaimName != nil}
		}
		if claim.DeletionTimestamp != nil {
			return nil, &claimWaitError{err: fmt.Errorf("resource claim %s/%s is being deleted", pod.Namespace, *name), tellUser: true}
		}
		if mustCheckOwner {
			if err := resourceclaim.IsForPod(pod, claim, false); err != nil {
				return nil, &claimWaitError{err: err, tellUser: true}
			}
		}
		claims = append(claims, claim)
	}
	return claims, nil
}

// PreFilter gathers the pod's claims, validates them, and builds the
// per-cycle allocator. Pods without claims are skipped, and so are bound
// pods whose resize is deferred (queued only to find room by preemption,
// where that feature is on): their claims are allocated and in use, so
// nothing here may allocate, deallocate or delete them, and Filter and
// PostFilter, which find no state, leave them alone too.
func (pl *TopologyDRA) PreFilter(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, nodes []fwk.NodeInfo) (*fwk.PreFilterResult, *fwk.Status) {
	if pl.skipResizeDeferred && resourcehelper.IsPodResizeDeferred(pod) {
		return nil, fwk.NewStatus(fwk.Skip)
	}
	if pl.headroomPercent > 0 {
		// Held back is what the pod's latest attempt found; this one may
		// end before it gets to the headroom.
		pl.heldBack.forget(pod.UID)
	}
	logger := klog.FromContext(ctx)
	extended, err := pl.draExtendedResources(pod)
	if err != nil {
		return nil, internalError(logger, err)
	}
	var claims []*resourceapi.ResourceClaim
	if len(pod.Spec.ResourceClaims) > 0 {
		claims, err = pl.podClaims(pod)
		if err != nil {
			// The claim cache may be behind; a claim event requeues the pod.
			// Unresolvable, as with the stock plugin: no node can take the
			// pod, and preempting pods would not change that.
			pl.countAttempt(rejectClaimNotReady)
			return nil, unresolvable(err.Error())
		}
	}
	if err := checkExtendedCounts(pod, extended); err != nil {
		pl.countAttempt(rejectInvalidClaim)
		return nil, unresolvable(err.Error())
	}
	var ext *extendedClaim
	extClaim := pl.extendedClaimOf(pod, extended)
	if extClaim != nil {
		apiCtx, cancel := context.WithTimeout(ctx, preFilterAPITimeout)
		leftover, err := pl.deleteLeftoverExtendedClaims(apiCtx, pod)
		cancel()
		if err != nil {
			return nil, internalError(klog.FromContext(ctx), err, "pod", klog.KObj(pod))
		}
		earlier := leftover || pod.Status.ExtendedResourceClaimStatus != nil
		ext = &extendedClaim{index: len(claims), resources: extended, pendingUID: extClaim.UID, pod: pod, earlier: earlier,
			variants: map[string]*extendedVariant{}, nodes: map[string]*extendedVariant{}}
		claims = append(claims, extClaim)
	}
	if len(claims) == 0 {
		return nil, fwk.NewStatus(fwk.Skip)
	}
	s := &stateData{
		extended:            ext,
		claims:              claims,
		availableOnNodes:    make([]*nodeaffinity.NodeSelector, len(claims)),
		unusable:            make([]error, len(claims)),
		needsNodeOperations: make([]bool, len(claims)),
		results:             map[string]*allocator.Result{},
		unavailableClaims:   sets.New[int](),
		allocations:         make([]*resourceapi.AllocationResult, len(claims)),
	}
	cs.Write(stateKey, s)

	published := pl.newPublishedLookup()
	for i, claim := range claims {
		if pl.uncertain.has(claim.UID) {
			apiCtx, cancel := context.WithTimeout(ctx, preFilterAPITimeout)
			claim, err = pl.settleUncertain(apiCtx, claim)
			cancel()
			if err != nil {
				// An error, not unschedulable: the pod retries after its
				// backoff, and reads the claim again.
				return nil, fwk.AsStatus(err)
			}
			claims[i] = claim
		}
		if claim.Status.Allocation != nil {
			if !resourceclaim.CanBeReserved(claim) && !resourceclaim.IsReservedForPod(pod, claim, false) {
				// Shared claim with a full reservedFor list; a claim
				// update (a consumer leaving) requeues the pod.
				pl.countAttempt(rejectClaimInUse)
				return nil, unresolvable(fmt.Sprintf("resource claim %s is in use by %d pods, the most a claim can be reserved for", claim.Name, len(claim.Status.ReservedFor)))
			}
			if sel := claim.Status.Allocation.NodeSelector; sel != nil {
				ns, err := nodeaffinity.NewNodeSelector(sel)
				if err != nil {
					return nil, internalError(logger, fmt.Errorf("claim %s: node selector of allocation: %w", claim.Name, err))
				}
				s.availableOnNodes[i] = ns
			}
			s.unusable[i] = pl.bindingFailed(claim, published)
			if s.unusable[i] == nil {
				s.unusable[i] = pl.taintedAllocation(pod, claim, published)
			}
			s.needsNodeOperations[i] = skipsNodeOperations(claim.Status.Allocation)
			continue
		}
		if pl.draManager.ResourceClaims().GetPendingAllocation(claim.UID) != nil {
			// Another pod's cycle is allocating this shared claim right
			// now; its claim update requeues us.
			pl.countAttempt(rejectClaimInUse)
			return nil, unresolvable(fmt.Sprintf("resource claim %s is being allocated for another pod", claim.Name))
		}
		if ext == nil || i != ext.index {
			// The in-memory claim's requests name the classes that the
			// class resolver found; Filter reports what they match.
			if st := pl.validateClaim(ctx, claim); st != nil {
				pl.countAttempt(rejectInvalidClaim)
				pl.claimsInvalid(pod, true)
				return nil, st
			}
		}
		s.toAllocate = append(s.toAllocate, i)
		s.allocClaims = append(s.allocClaims, pl.withOwnedToleration(claim))
	}
	if len(s.toAllocate) == 0 {
		// Held back before, its claims allocated since (a claim it
		// shares with a pod that was placed): the headroom holds it no
		// longer.
		pl.heldBack.done(pod.UID)
		return nil, nil
	}
	// The headroom and the drain rule count the devices of the pod's own
	// claims: the extended resource claim's requests depend on the node.
	headroomClaims := s.allocClaims
	if ext != nil {
		headroomClaims = s.allocClaims[:len(s.allocClaims)-1]
	}

	allocatedState, err := pl.gatherAllocatedState(ctx)
	if err != nil {
		return nil, internalError(logger, fmt.Errorf("gather allocated devices: %w", err))
	}
	slices, err := pl.draManager.ResourceSlices().ListWithDeviceTaintRules()
	if err != nil {
		return nil, internalError(logger, fmt.Errorf("list resource slices: %w", err))
	}
	var counts []classDevices
	for _, claim := range headroomClaims {
		counts = addClaimDevices(counts, claim)
	}
	need := mostOfOneClass(counts)
	keepHeadroom := pl.headroomPercent > 0 && need >= pl.halfNode()
	a, err := allocator.New(ctx, allocator.Options{
		Features:       pl.features,
		AllocatedState: allocatedState,
		ClassLister:    pl.draManager.DeviceClasses(),
		Slices:         slices,
		CELCache:       pl.celCache,
		Cache:          pl.cache,
		Policy:         pl.policy,
		SkipCounting:   pl.countingSkipped,
		Parallelize:    pl.parallelize,
	})
	if err != nil {
		pl.countAttempt(rejectOther)
		return nil, unresolvable(err.Error())
	}
	s.allocator = a
	// A whole-node pod's fit is recorded for the drain rule, where the
	// profile has one (pl.pending).
	wholeNode := pl.pending != nil && need >= pl.wholeNode()
	if !keepHeadroom && !wholeNode {
		return nil, nil
	}
	admit := admittedNodes(pod, nodes, pl.taintOps)
	if keepHeadroom {
		// The headroom keeps devices free for smaller pods that may
		// come. A pod that may preempt a pod of lower priority holding
		// claims on a node it may use is not held back for them: it
		// would take devices by evicting pods instead, so free devices
		// would turn into evictions, and where none are free the
		// headroom would keep it from preempting at all.
		outranks := outranksHolder(pod, nodes, admit)
		pl.heldBack.setOutranks(pod, outranks)
		keepHeadroom = !outranks
		if !keepHeadroom && !wholeNode {
			return nil, nil
		}
	}
	// The devices on the nodes the pod may use, and those its requests
	// match: its headroom is kept among the latter, and the drain rule
	// counts it as waiting only for the nodes where they make up what it
	// needs.
	devices, matched, err := a.CountDevices(ctx, headroomClaims, admit)
	if err != nil || !matched {
		logger.V(4).Info("Not known which devices the pod's requests match: the headroom counts all of each driver's devices, the drain rule every node the pod may use", "err", err)
	}
	if wholeNode {
		var unfit sets.Set[string]
		if matched {
			unfit = pl.nodeSets.intern(unfitNodes(admit, devices, need))
		}
		pl.pending.setUnfit(pod, unfit)
		// More devices than an allocation may hold, say: no node can
		// take the pod until its claim changes.
		var inputErr *allocator.InputError
		pl.claimsInvalid(pod, errors.As(err, &inputErr))
	}
	if keepHeadroom && err == nil {
		local := localPools(slices)
		s.headroom = headroomOf(devices, false, local)
		var barren sets.Set[string]
		if narrow := headroomOf(devices, true, local); matched && narrow.fewerThan(s.headroom) {
			s.headroom = narrow
			barren = sets.New[string]()
			for node := range admit {
				if !matchesOn(devices[node]) {
					barren.Insert(node)
				}
			}
			barren = pl.nodeSets.intern(barren)
		}
		pl.heldBack.setNarrow(pod, barren != nil, barren)
	}
	return nil, nil
}

// parallelize runs work for every piece with the scheduler's parallelism
// (its configuration's parallelism field), one after another without a
// framework handle.
func (pl *TopologyDRA) parallelize(ctx context.Context, pieces int, work func(piece int)) {
	if pl.handle == nil || pl.handle.Parallelizer() == nil {
		for i := range pieces {
			work(i)
		}
		return
	}
	pl.handle.Parallelizer().Until(ctx, pieces, work, Name)
}

// matchesOn reports whether the pod's requests match a device of one
// node's counts (allocator.CountDevices).
func matchesOn(counts map[string]allocator.DeviceCount) bool {
	for _, c := range counts {
		if c.Matching > 0 {
			return true
		}
	}
	return false
}

// claimsInvalid records in the pending index, where the profile has one,
// whether the pod's latest attempt found one of its claims invalid: the
// drain rule leaves such a pod out (pendingPod.invalid).
func (pl *TopologyDRA) claimsInvalid(pod *v1.Pod, invalid bool) {
	if pl.pending != nil {
		pl.pending.setInvalid(pod, invalid)
	}
}

// validateClaim checks what no node can fix: request types, device classes
// and CEL selectors that do not compile. Problems are reported on the pod
// (the returned status) and as a warning event on the claim.
func (pl *TopologyDRA) validateClaim(ctx context.Context, claim *resourceapi.ResourceClaim) *fwk.Status {
	var problems []string
	// compile: a selector that does not compile is a problem of the
	// claim. For subrequests it is not: upstream compiles a selector only
	// when its search gets to it, so a claim may be allocated by an
	// earlier subrequest, and the allocator reports the error where the
	// search does get there.
	checkSelectors := func(request string, selectors []resourceapi.DeviceSelector, compile bool) {
		for i, sel := range selectors {
			if sel.CEL == nil {
				// A selector of a type added to the API after this
				// scheduler was built (an API server newer than it).
				problems = append(problems, fmt.Sprintf("request %s: selector #%d %s", request, i, allocator.UnknownSelector))
				continue
			}
			if !compile {
				continue
			}
			if res := pl.celCache.GetOrCompile(sel.CEL.Expression); res.Error != nil {
				problems = append(problems, fmt.Sprintf("request %s: invalid CEL selector %q: %v", request, sel.CEL.Expression, res.Error))
			}
		}
	}
	checkClass := func(request, className string, compile bool) {
		class, err := pl.draManager.DeviceClasses().Get(className)
		if err != nil {
			problems = append(problems, fmt.Sprintf("request %s: device class %s does not exist", request, className))
			return
		}
		checkSelectors(request+" (class "+className+")", class.Spec.Selectors, compile)
	}
	var annotationErr *allocator.InputError
	if _, _, err := allocator.ClaimAnnotations(claim); errors.As(err, &annotationErr) {
		problem := annotationErr.Detail
		if annotationErr.Err != nil {
			problem += ": " + annotationErr.Err.Error()
		}
		problems = append(problems, problem)
	}
	for _, req := range claim.Spec.Devices.Requests {
		switch {
		case req.Exactly != nil:
			checkClass(req.Name, req.Exactly.DeviceClassName, true)
			checkSelectors(req.Name, req.Exactly.Selectors, true)
		case len(req.FirstAvailable) > 0:
			if !pl.features.PrioritizedList {
				problems = append(problems, fmt.Sprintf("request %s: has subrequests, but the DRAPrioritizedList feature is disabled", req.Name))
			}
			for _, sub := range req.FirstAvailable {
				name := resourceclaim.CreateSubRequestRef(req.Name, sub.Name)
				checkClass(name, sub.DeviceClassName, false)
				checkSelectors(name, sub.Selectors, false)
			}
		default:
			problems = append(problems, fmt.Sprintf("request %s: unknown request type", req.Name))
		}
	}
	if len(problems) == 0 {
		return nil
	}
	msg := fmt.Sprintf("resource claim %s: %s", claim.Name, strings.Join(problems, "; "))
	pl.event(claim, v1.EventTypeWarning, "InvalidClaim", "Scheduling", "%s", msg)
	// A missing class may be created, a broken class fixed: DeviceClass
	// events requeue the pod, and so does a change of the claim's topodra
	// annotations (see isSchedulableAfterClaimChange). A broken spec
	// needs a new claim.
	return unresolvable(msg)
}

// gatherAllocatedState reads allocated and in-flight devices, retrying
// while the claim tracker reports a concurrent modification.
func (pl *TopologyDRA) gatherAllocatedState(ctx context.Context) (*structured.AllocatedState, error) {
	var state *structured.AllocatedState
	var lastErr error
	err := wait.PollUntilContextTimeout(ctx, time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		s, err := pl.draManager.ResourceClaims().GatherAllocatedState()
		if err != nil {
			lastErr = err
			return false, nil
		}
		state = s
		return true, nil
	})
	if err == nil && pl.holders != nil {
		pl.holders.restore(state.AllocatedDevices, pl.draManager.ResourceClaims().Get)
	}
	if err != nil {
		if lastErr != nil {
			return nil, lastErr
		}
		return nil, err
	}
	return state, nil
}

// withOwnedToleration returns the claim as the allocator sees it: with a
// toleration for the owned device taint on every request, so that devices
// that only topodra may hand out are available to it. The copy's spec is
// never written to the API, but the allocator copies each request's
// tolerations, this one included, into the device results of the
// allocation, which PreBind writes to the claim's status (validation
// keeps ownedTaintKey a valid toleration key for that reason).
func (pl *TopologyDRA) withOwnedToleration(claim *resourceapi.ResourceClaim) *resourceapi.ResourceClaim {
	if pl.ownedToleration == nil {
		return claim
	}
	claim = claim.DeepCopy()
	for i := range claim.Spec.Devices.Requests {
		req := &claim.Spec.Devices.Requests[i]
		if req.Exactly != nil {
			req.Exactly.Tolerations = append(req.Exactly.Tolerations, *pl.ownedToleration)
		}
		for j := range req.FirstAvailable {
			req.FirstAvailable[j].Tolerations = append(req.FirstAvailable[j].Tolerations, *pl.ownedToleration)
		}
	}
	return claim
}

// skipsNodeOperations reports whether an allocation has a device result
// that skips node operations: the kubelet of a node that does not declare
// the DRAOptionalNodeOperations feature cannot handle it.
func skipsNodeOperations(allocation *resourceapi.AllocationResult) bool {
	for _, r := range allocation.Devices.Results {
		if len(r.SkipNodeOperations) > 0 {
			return true
		}
	}
	return false
}
