package topologydra

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/component-helpers/nodedeclaredfeatures/features/draoptionalnodeoperations"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/topodra/topodra/pkg/allocator"
)

// Filter checks that the pod's allocated claims are usable on the node and
// finds the best allocation of the others there. The result is kept per
// node for Score and Reserve.
func (pl *TopologyDRA) Filter(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, nodeInfo fwk.NodeInfo) *fwk.Status {
	s, err := getState(cs)
	if err != nil {
		return internalError(klog.FromContext(ctx), err)
	}
	node := nodeInfo.Node()
	// Every claim the node cannot use is marked, so that PostFilter may
	// deallocate one that no other pod uses even where an earlier claim
	// is shared; the first one's reason is the node's.
	var unavailable *fwk.Status
	for i, sel := range s.availableOnNodes {
		var msg string
		switch {
		case sel != nil && !sel.Match(node):
			// Only deallocating the claim (PostFilter, or its owner)
			// changes this.
			msg = fmt.Sprintf("resource claim %s is allocated on devices that this node cannot use", s.claims[i].Name)
		case s.needsNodeOperations[i] && !slices.Contains(node.Status.DeclaredFeatures, draoptionalnodeoperations.DRAOptionalNodeOperationsFeatureGate):
			// Names no node, so that the pod's message counts the nodes
			// that fail alike once.
			msg = fmt.Sprintf("resource claim %s is allocated on devices that skip node operations, which need nodes that declare the %s feature; where no other pod uses the claim, it is deallocated and allocated again", s.claims[i].Name, draoptionalnodeoperations.DRAOptionalNodeOperationsFeatureGate)
		case s.unusable[i] != nil:
			// PostFilter deallocates the claim; the next attempt
			// allocates afresh.
			msg = fmt.Sprintf("resource claim %s cannot be used: %v", s.claims[i].Name, s.unusable[i])
		default:
			continue
		}
		s.markUnavailable(i)
		if unavailable == nil {
			unavailable = unresolvable(msg)
		}
	}
	if unavailable != nil {
		s.rejected.add(rejectClaimUnusable)
		return unavailable
	}
	if s.allocator == nil {
		return nil
	}
	var variant *extendedVariant
	if s.extended != nil {
		variant = pl.extendedForNode(s.extended, s.claims[s.extended.index], nodeInfo)
	}
	if s.extended != nil && variant == nil {
		if msg := earlierStatusMessage(pod.Status.ExtendedResourceClaimStatus); msg != "" {
			// The status stays; no later attempt changes this.
			s.rejected.add(rejectClaimUnusable)
			return unresolvable(msg)
		}
	}
	_, claims := s.claimsWith(variant)
	if len(claims) == 0 {
		// Only extended resources, all offered by a device plugin here:
		// NodeResourcesFit counts them.
		return nil
	}

	allocCtx, cancel := pl.withFilterTimeout(ctx)
	defer cancel()
	start := time.Now()
	a, trial, freed := s.allocator, trialOf(cs, false), false
	if trial != nil {
		var waiting *v1.Pod
		a, freed, waiting = pl.trialAllocator(allocCtx, s, trial, node)
		if waiting != nil {
			// Names no node, so that the pod's message counts the nodes
			// that fail alike once.
			s.rejected.add(rejectNominated)
			return unschedulable("node(s) keep devices for a pod of the same or higher priority nominated to them")
		}
	}
	res, err := a.Allocate(allocCtx, node, claims)
	allocationDuration.Observe(time.Since(start).Seconds())
	if err != nil {
		var inputErr *allocator.InputError
		if !errors.As(err, &inputErr) {
			if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
				// Possibly transient (the node's slices): an error, so
				// the pod retries with backoff, as with the stock plugin.
				return fwk.AsStatus(fmt.Errorf("node %s: timed out trying to allocate devices", node.Name))
			}
			if ctx.Err() != nil {
				// The framework stopped the cycle (another node failed
				// it, or it was cancelled); this node is not at fault.
				return unresolvable(fmt.Sprintf("asked by caller to stop allocating devices: %v", context.Cause(ctx)))
			}
			return internalError(klog.FromContext(ctx), err, "pod", klog.KObj(pod), "node", klog.KObj(node))
		}
		// Bad input, e.g. a CEL selector that fails at run time on this
		// node's devices. The message names the claim, request and
		// expression; the claim gets a warning event, once per cycle.
		s.reportOnce.Do(func() {
			pl.countAttempt(rejectInvalidClaim)
			pl.claimsInvalid(pod, true)
			for _, index := range s.toAllocate {
				if s.isExtendedInMemory(index) {
					continue // not in the API (yet): the pod's status says it
				}
				claim := s.claims[index]
				if claim.Namespace+"/"+claim.Name == inputErr.Claim {
					pl.event(claim, v1.EventTypeWarning, "InvalidClaim", "Scheduling", "%s", err.Error())
				}
			}
		})
		return inputError(klog.FromContext(ctx), err, "pod", klog.KObj(pod), "node", klog.KObj(node))
	}
	if res.DevicesConsidered > 0 {
		devicesConsidered.Observe(float64(res.DevicesConsidered))
	}
	if res.Allocations == nil {
		s.rejected.add(causeRejection(res.Explanation.Cause()))
		msg := "cannot allocate all claims"
		if res.Explanation != nil {
			if e := res.Explanation.String(); e != "" {
				// The framework puts the number of nodes that fail
				// alike before it: "3 node(s) cannot allocate claim …".
				msg = "node(s) cannot allocate " + e
			}
			// The message names no pool, so that it reads the same on
			// every node; the log says which pools were left out.
			// One line per cycle at V(2), not one per node: while a
			// driver's pools are incomplete on many nodes, each attempt of
			// each pending pod would log every node.
			for _, r := range res.Explanation.Requests {
				if r.UnusablePools == "" {
					continue
				}
				logger := klog.FromContext(ctx)
				first := false
				s.poolsOnce.Do(func() { first = true })
				if first {
					logger.V(2).Info("Resource pools left out (other nodes of this attempt at V(5))", "pod", klog.KObj(pod), "node", klog.KObj(node), "pools", r.UnusablePools)
				} else {
					logger.V(5).Info("Resource pools left out", "pod", klog.KObj(pod), "node", klog.KObj(node), "pools", r.UnusablePools)
				}
				break
			}
		}
		// More devices may become free or appear (claim and slice events
		// requeue the pod). Where devices the pod could use are in use
		// and a pod of lower priority on the node holds claims,
		// preemption may free some: its trials run Filter with
		// lower-priority pods removed (see trialData). The stock plugin
		// says unresolvable here, so it never preempts for devices.
		if res.Explanation.Freeable() && mayPreempt(pod, nodeInfo) {
			s.preemptible.Store(true)
			return unschedulable(msg)
		}
		return unresolvable(msg)
	}
	if freed && len(trial.added) == 0 {
		// Only in the pass without nominated pods that take devices, the
		// framework's last: with them added, a fit may be less aligned
		// for their sake.
		keeps := trial.keepsAlignment(res.Quality, func() bool { return pl.protected(trial.reprieved) })
		trial.reprieved = nil
		if !keeps {
			return unschedulable("node(s) would give the pod less aligned devices with the pods preemption removed given back")
		}
		// Once a second at most: preemption's dry runs run in parallel,
		// one Filter per candidate node and victim given back.
		if now := time.Now().UnixNano(); now-pl.lastTrialFit.Load() > int64(time.Second) {
			pl.lastTrialFit.Store(now)
		}
	}
	if s.headroom.drivers != nil && !(preemptionAllowed(pod) && pod.Status.NominatedNodeName == node.Name) {
		// PreFilter counted no headroom for a pod that may preempt a
		// pod holding claims, so this is a pod that does not (its
		// preemption's trials, for other resources, free no devices).
		// On the node a preemptor is nominated to it is not held back
		// either, even where no pod of lower priority holds claims any
		// more (it evicted the last ones): the room it made would stay
		// kept for it and unused. Until the scheduler's write of the
		// nomination comes back, its own record says so.
		if why := checkHeadroom(pl.headroomPercent, pl.wholeNode(), s.headroom, node.Name, res.Allocations); why != "" && !pl.nominatedByRecord(pod, node.Name) {
			// Not this node's doing, and evicting pods would not help:
			// the pod is retried when devices are given back.
			if !freed {
				pl.heldBack.hold(pod)
				s.heldOnce.Do(headroomHolds.Inc)
				s.rejected.add(rejectHeldBack)
			}
			return unresolvable("node(s) fit but are held back: " + why)
		}
	}
	if !freed {
		s.setResult(node.Name, res, trial != nil)
	}
	return nil
}

// withFilterTimeout bounds one allocation by filterTimeout, if set.
func (pl *TopologyDRA) withFilterTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	if pl.filterTimeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, pl.filterTimeout)
}
