package allocator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/topology"
)

// podNode is what Allocate learns about one pod on one node: the node's
// devices, the analysis of the pod's claims on them and upstream's answer
// on the node's slices as they are. Each is built on first use and then
// shared by every strategy and fallback of one call. A podNode belongs to
// one goroutine.
type podNode struct {
	a      *Allocator
	node   *v1.Node
	claims []*resourceapi.ResourceClaim

	ns    *nodeState
	nsErr error

	analyzed    bool
	infos       []*claimInfo
	passthrough bool
	infosErr    error
	units       []*unit

	ownAsked bool
	own      []resourceapi.AllocationResult
	ownErr   error
}

// devices returns the node's devices, gathering them on first use.
func (p *podNode) devices() (*nodeState, error) {
	if p.ns == nil && p.nsErr == nil {
		p.ns, p.nsErr = p.a.gatherNode(p.node)
	}
	return p.ns, p.nsErr
}

// analysis returns the claims evaluated on the node's devices (see
// Allocator.analyze), analysing them on first use.
func (p *podNode) analysis(ctx context.Context) ([]*claimInfo, bool, error) {
	if p.analyzed {
		return p.infos, p.passthrough, p.infosErr
	}
	ns, err := p.devices()
	if err != nil {
		return nil, false, err
	}
	p.analyzed = true
	p.infos, p.passthrough, p.infosErr = p.a.analyze(ctx, ns, p.claims)
	for _, info := range p.infos {
		for _, r := range info.requests {
			p.units = append(p.units, r.alts...)
		}
	}
	return p.infos, p.passthrough, p.infosErr
}

// ownAnswer returns upstream's answer on the node's slices as they are,
// which is the stock plugin's answer, asking upstream on first use.
func (p *podNode) ownAnswer(ctx context.Context) ([]resourceapi.AllocationResult, error) {
	if !p.ownAsked {
		ns, err := p.devices()
		if err != nil {
			return nil, err
		}
		p.ownAsked = true
		p.own, p.ownErr = p.a.upstream(ctx, p.node, p.claims, ns.slices)
	}
	return p.own, p.ownErr
}

// uncertain reports whether a selector of the pod's claims failed at run
// time on a device of the node, or on another node's device that upstream
// looks at on this node (nodeState.offNode), after analysis. Upstream
// reports such an error when its search reaches that device, so only
// upstream's own order on the node answers as the stock plugin does: an
// order that reaches the device sooner or later, or a view without it,
// could turn the error into an allocation or the reverse.
func (p *podNode) uncertain() bool {
	for _, u := range p.units {
		if u.uncertn {
			return true
		}
	}
	return false
}

// strategy is one way to allocate a pod on a node. Strategies never call
// each other: Allocate tries them in order and gives every one the same
// podNode.
type strategy interface {
	// applies reports from the claims alone whether the strategy may
	// serve the pod.
	applies(p *podNode) bool
	// allocate returns the Result, or nil (and no error) where the
	// strategy cannot decide exactly on this node: the next strategy then
	// decides. Errors are fatal, as for Allocate.
	allocate(ctx context.Context, p *podNode) (*Result, error)
}

var (
	// exactStrategies return results that upstream has allocated; the
	// last one applies to every pod and always decides.
	exactStrategies = []strategy{orderedStrategy{}, viewsStrategy{}}
	// allStrategies are tried by Allocate, in order.
	allStrategies = append([]strategy{countedStrategy{}}, exactStrategies...)
)

// Allocate finds the best allocation of claims (the pod's claims that still
// need one) on node. It is safe for concurrent use.
//
// It returns (nil, err) only for problems that make the claims unallocatable
// on every node: an unknown DeviceClass, an invalid topodra annotation, a
// CEL selector that does not compile or fails at run time where upstream's
// search on the node evaluates it (these are *InputError, which wraps
// ErrInvalidInput and names the claim, request and expression or class),
// whatever upstream considers fatal, and cancellation of ctx. Otherwise the
// Result is non-nil; Result.Allocations is nil when the claims do not fit
// on this node, and Result.Explanation then says why.
func (a *Allocator) Allocate(ctx context.Context, node *v1.Node, claims []*resourceapi.ResourceClaim) (*Result, error) {
	if node == nil {
		return nil, errors.New("allocate: node is nil")
	}
	strategies := allStrategies
	if a.skipCounting != nil && a.skipCounting(node.Name) {
		strategies = exactStrategies
	}
	return a.run(ctx, &podNode{a: a, node: node, claims: claims}, strategies)
}

// run hands p to the first of strategies that applies and decides.
func (a *Allocator) run(ctx context.Context, p *podNode, strategies []strategy) (*Result, error) {
	for _, s := range strategies {
		if !s.applies(p) {
			continue
		}
		if res, err := s.allocate(ctx, p); res != nil || err != nil {
			if res != nil && res.Allocations != nil && p.ns != nil {
				if expl := cmp.Or(nodeAllocatableMapped(p.ns, p.claims, res.Allocations), a.requireBroken(p.ns, p.infos, res.Allocations)); expl != nil {
					return &Result{Explanation: expl, DevicesConsidered: res.DevicesConsidered}, nil
				}
				res.Quality.OtherDevices, res.Quality.OtherFree = a.otherDevices(p.ns, p.units)
			}
			return res, err
		}
	}
	// viewsStrategy applies to every pod and always decides.
	return nil, errors.New("allocate: no strategy decided")
}

// Verify turns an Unverified result of Allocate into upstream's allocation
// of the same devices: upstream allocates the claims on a view of the node
// in which only the chosen devices are visible (slices and pools stay
// complete). Allocate and Verify of one Allocator see the same snapshot, so
// if that fails, counting and upstream disagree: the node is allocated
// again by a strategy whose results upstream made, and the Result says
// CountingRefused.
// A verified result is returned as is. Like Allocate, it returns an error
// only for fatal input problems and cancellation; Result.Allocations is nil
// if nothing fits any more.
func (a *Allocator) Verify(ctx context.Context, node *v1.Node, claims []*resourceapi.ResourceClaim, res *Result) (*Result, error) {
	if res == nil || !res.Unverified || res.Allocations == nil {
		return res, nil
	}
	p := &podNode{a: a, node: node, claims: claims}
	ns, err := p.devices()
	if err != nil {
		return nil, err
	}
	results, err := a.upstream(ctx, node, claims, chosenOnly(ns, res.Allocations))
	if err == nil && results != nil {
		if samePerClaim(results, res.Allocations) {
			return &Result{Allocations: results, Quality: res.Quality, Explanation: res.Explanation, DevicesConsidered: res.DevicesConsidered}, nil
		}
		// Upstream handed the chosen devices to other claims than planned
		// (possible where a claim's devices span slices), which can break
		// a claim's required alignment: allocate with upstream's own
		// results instead.
		klog.FromContext(ctx).V(4).Info("Counted allocation assigned to other claims by upstream, allocating again", "node", klog.KObj(node))
		return a.run(ctx, p, exactStrategies)
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	klog.FromContext(ctx).V(4).Info("Counted allocation not confirmed by upstream, allocating again", "node", klog.KObj(node), "err", err)
	again, err := a.run(ctx, p, exactStrategies)
	if again != nil {
		again.CountingRefused = true
	}
	return again, err
}

// upstream runs the upstream allocator on a view of the node.
func (a *Allocator) upstream(ctx context.Context, node *v1.Node, claims []*resourceapi.ResourceClaim, view []*resourceapi.ResourceSlice) ([]resourceapi.AllocationResult, error) {
	alloc, err := structured.NewAllocator(ctx, a.features, a.stateFor(view), a.classLister, view, a.celCache)
	if err != nil {
		return nil, err
	}
	return alloc.Allocate(ctx, node, claims)
}

// upstreamFailure turns an error of the upstream allocator into
// Allocate's answer: a Result that explains a failure of this node only
// (structured.ErrFailedAllocationOnNode), or a fatal error that names what
// the user has to fix.
func (a *Allocator) upstreamFailure(ctx context.Context, p *podNode, err error) (*Result, error) {
	if ctx.Err() == nil && errors.Is(err, structured.ErrFailedAllocationOnNode) {
		return &Result{Explanation: nodeFailure(p.claims, err)}, nil
	}
	if ctx.Err() == nil && refusesAllForPool(err) {
		// Upstream refuses an All request while a pool of the node is
		// incomplete or invalid without marking it as this node's
		// failure; it is one (the pool is this node's), and the other
		// nodes are still to be tried.
		ns, _ := p.devices()
		return &Result{Explanation: allRequestsRefused(p.claims, ns, err)}, nil
	}
	return nil, a.explainFatal(ctx, p, err)
}

// refusesAllForPool reports whether err is upstream's refusal of an
// allocationMode All request because a resource pool it gathered for the
// node is being updated (incomplete) or invalid.
func refusesAllForPool(err error) bool {
	return err != nil && strings.Contains(err.Error(), "asks for all devices, but resource pool")
}

// allRequestsRefused explains the refusal of the claims' All requests on a
// node with incomplete or invalid pools in words that read the same on
// every such node (the pools are named for the log only); err is
// upstream's answer, used where the claims have no All request.
func allRequestsRefused(claims []*resourceapi.ResourceClaim, ns *nodeState, err error) *Explanation {
	pools := unusablePools(ns)
	if pools == "" {
		pools = "; one of the node's resource pools is incomplete or invalid"
	}
	var expl Explanation
	add := func(claim, request string) {
		expl.Requests = append(expl.Requests, RequestExplanation{
			Claim: claim, Request: request,
			Reason:        "asks for all matching devices, which cannot be told while a pool is incomplete or invalid" + pools,
			UnusablePools: unusablePoolNames(ns),
			Cause:         CausePools,
		})
	}
	for _, claim := range claims {
		for _, req := range claim.Spec.Devices.Requests {
			if req.Exactly != nil && req.Exactly.AllocationMode == resourceapi.DeviceAllocationModeAll {
				add(claim.Name, req.Name)
			}
			for _, sub := range req.FirstAvailable {
				if sub.AllocationMode == resourceapi.DeviceAllocationModeAll {
					add(claim.Name, resourceclaim.CreateSubRequestRef(req.Name, sub.Name))
				}
			}
		}
	}
	if len(expl.Requests) == 0 {
		return nodeFailure(claims, err)
	}
	return &expl
}

// logAllocated logs a chosen allocation.
func logAllocated(ctx context.Context, p *podNode, how string, q Quality) {
	if logger := klog.FromContext(ctx).V(4); logger.Enabled() {
		logger.Info("Allocated", "node", klog.KObj(p.node), "strategy", how, "devices", q.Devices, "level", q.LevelName, "score", q.Score)
	}
}

// samePerClaim reports whether every claim got the same devices in both
// allocations (in any order).
func samePerClaim(a, b []resourceapi.AllocationResult) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if len(a[i].Devices.Results) != len(b[i].Devices.Results) {
			return false
		}
		want := map[[3]string]int{}
		for _, r := range b[i].Devices.Results {
			want[[3]string{r.Driver, r.Pool, r.Device}]++
		}
		for _, r := range a[i].Devices.Results {
			k := [3]string{r.Driver, r.Pool, r.Device}
			if want[k] == 0 {
				return false
			}
			want[k]--
		}
	}
	return true
}

// requireBroken explains why results break a claim's alignment=require, or
// returns nil where they do not: the devices of every claim that requires
// alignment (with align-with=pod: of all the pod's claims that align with
// each other, where one of them requires it), two or more, must share a
// value of one of the policy's topology attributes. The strategies plan
// for it where they plan a claim; this also holds the claims they leave
// to upstream as they are (requests for all matching devices, inputs this
// package does not interpret), whose node is rejected where upstream's
// devices share no domain.
func (a *Allocator) requireBroken(ns *nodeState, infos []*claimInfo, results []resourceapi.AllocationResult) *Explanation {
	var groups [][]int
	podGroup, podRequires := -1, false
	for ci, info := range infos {
		switch {
		case info.alignPod:
			if podGroup < 0 {
				podGroup = len(groups)
				groups = append(groups, nil)
			}
			groups[podGroup] = append(groups[podGroup], ci)
			podRequires = podRequires || info.mode == AlignmentRequire
		case info.mode == AlignmentRequire:
			groups = append(groups, []int{ci})
		}
	}
	for gi, claims := range groups {
		if gi == podGroup && !podRequires {
			continue
		}
		devs := ns.claimDevices(results, claims)
		if len(devs) < 2 {
			continue
		}
		if level, _ := a.sharedLevel(ns, devs); level < len(a.policy.Attributes) {
			continue
		}
		names := make([]string, 0, len(a.policy.Attributes))
		for _, attr := range a.policy.Attributes {
			names = append(names, topology.ShortName(attr))
		}
		expl := &Explanation{}
		for _, ci := range claims {
			expl.Requests = append(expl.Requests, RequestExplanation{
				Claim: infos[ci].claim.Name, Request: "*",
				Reason: fmt.Sprintf("the devices it can get are not within one %s (alignment=require)", strings.Join(names, " or ")),
				Cause:  CauseConstraints,
			})
		}
		return expl
	}
	return nil
}

// nodeAllocatableMapped explains why results cannot be used where they
// hold a device that maps node allocatable resources (CPU, memory: the
// DRANodeAllocatableResources feature), or returns nil. Such an
// allocation must be counted against the node's allocatable resources
// and recorded in the pod's status, which the stock DynamicResources
// plugin does and this package does not, so the node is rejected rather
// than overcommitted.
func nodeAllocatableMapped(ns *nodeState, claims []*resourceapi.ResourceClaim, results []resourceapi.AllocationResult) *Explanation {
	mapped := false
	for i := range ns.devices {
		mapped = mapped || len(ns.devices[i].device.NodeAllocatableResources) > 0
	}
	if !mapped {
		return nil
	}
	for ci := range results {
		for k := range results[ci].Devices.Results {
			r := &results[ci].Devices.Results[k]
			i := ns.lookup(r)
			if i < 0 || len(ns.devices[i].device.NodeAllocatableResources) == 0 {
				continue
			}
			return &Explanation{Requests: []RequestExplanation{{
				Claim: claims[ci].Name, Request: r.Request,
				Reason: fmt.Sprintf("device %s maps node allocatable resources, which this profile does not account for: schedule the pod with a profile that runs the DynamicResources plugin", r.Device),
			}}}
		}
	}
	return nil
}
