package topologydra

import (
	"context"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
)

// PostFilter runs when no node fits. If that is because one of the pod's
// claims is allocated on devices no node can use (e.g. a previous attempt
// allocated it and the node is gone) and no other pod uses that claim, the
// allocation is removed so the next attempt can allocate afresh. One claim
// per attempt, like the stock plugin. Otherwise, for a pod nominated to a
// node (see nominatedTo) where it fits once the claims of pods that are
// gone or terminating by preemption give their devices back (its
// preemption's victims, see trialData and freeing), it keeps the
// nomination and ends PostFilter, so that DefaultPreemption does not look
// for more victims while those devices are given back. It does not wait
// on a node that another plugin found unschedulable in a way preemption
// cannot resolve (cordoned, unreachable, no longer matching the pod's
// affinity): DefaultPreemption preempts elsewhere then. A pod nominated
// nowhere that preemption might help (Filter found lower-priority pods
// holding devices it could use) and that fits on a node once the claims of
// pods that no longer exist give their devices back waits for them too,
// without a nomination, rather than evict pods elsewhere.
func (pl *TopologyDRA) PostFilter(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, statuses fwk.NodeToStatusReader) (*fwk.PostFilterResult, *fwk.Status) {
	logger := klog.FromContext(ctx)
	s, err := getState(cs)
	if err != nil {
		return nil, fwk.NewStatus(fwk.Unschedulable)
	}
	if r, ok := s.rejected.most(); ok {
		pl.countAttempt(r)
	}
	s.mu.Lock()
	unavailable := s.unavailableClaims.UnsortedList()
	s.mu.Unlock()
	for _, index := range unavailable {
		claim := s.claims[index]
		reserved := claim.Status.ReservedFor
		if len(reserved) > 1 || (len(reserved) == 1 && reserved[0].UID != pod.UID) {
			continue // in use by another pod: leave it
		}
		logger.V(2).Info("Deallocating claim that no node can use", "pod", klog.KObj(pod), "claim", klog.KObj(claim))
		if _, err := pl.deallocate(ctx, claim); err != nil {
			return nil, internalError(logger, err, "claim", klog.KObj(claim))
		}
		return nil, fwk.NewStatus(fwk.Unschedulable, "deallocated resource claim "+claim.Name+" so that it can be allocated again")
	}
	if s.allocator == nil || pl.handle == nil {
		return nil, fwk.NewStatus(fwk.Unschedulable)
	}
	if pl.mayBeNominated(pod) {
		freeing := pl.freeing(ctx, s, s.leaving(pl).preempted)
		if nominated := pl.nominatedTo(pod, freeing, s); nominated != "" {
			if !ruledOut(statuses, nominated) && pl.fitsOnceGone(ctx, s, freeing, nominated) {
				// The pod's victims are gone or terminating and their
				// claims not given back yet: it waits for them on its
				// node, and DefaultPreemption, which a success ends,
				// evicts nobody more meanwhile. The victims' deletion
				// and claim events requeue the pod.
				logger.V(2).Info("Waiting for the devices of preempted pods to be given back on the nominated node", "pod", klog.KObj(pod), "node", nominated)
				return &fwk.PostFilterResult{NominatingInfo: &fwk.NominatingInfo{NominatedNodeName: nominated, NominatingMode: fwk.ModeOverride}},
					fwk.NewStatus(fwk.Success, "waiting on node "+nominated+" for the devices of preempted pods to be given back")
			}
			return nil, fwk.NewStatus(fwk.Unschedulable)
		}
	}
	if s.preemptible.Load() {
		// Preemption's trials count the devices of pods that are gone
		// as free (see trialData), so on a node where those let the pod
		// fit a trial gives every victim back, and DefaultPreemption
		// leaves the node out and evicts pods elsewhere. The pod waits
		// for those devices instead; the claim events of their release
		// requeue it, and where it still does not fit then, it preempts.
		freeing := pl.freeing(ctx, s, s.leaving(pl).gone)
		for _, node := range sets.List(s.allocator.NodesOf(freeing)) {
			if !ruledOut(statuses, node) && pl.fitsOnceGone(ctx, s, freeing, node) {
				logger.V(2).Info("Not preempting: the pod fits once the devices of pods that are gone are given back", "pod", klog.KObj(pod), "node", node)
				return nil, fwk.NewStatus(fwk.Success, "node "+node+" fits once the devices of pods that are gone are given back: not preempting")
			}
		}
	}
	return nil, fwk.NewStatus(fwk.Unschedulable)
}

// ruledOut reports whether a plugin other than TopologyDRA found the node
// unschedulable in a way that preemption cannot resolve: DefaultPreemption
// then preempts again, elsewhere, as it does where the nominated node is
// ruled out.
func ruledOut(statuses fwk.NodeToStatusReader, node string) bool {
	if statuses == nil {
		return false
	}
	st := statuses.Get(node)
	return st.Code() == fwk.UnschedulableAndUnresolvable && st.Plugin() != Name
}

// nominationWindow is how long after a preemption trial in which a pod fit
// a pod whose status names no node may be nominated in the scheduler's
// record only (see nominatedTo): the time from a nomination to its
// write-back, with a wide margin.
const nominationWindow = 2 * time.Minute

// mayBeNominated reports whether the pod may be nominated to a node: its
// status says so, or it may preempt and a preemption trial found room for
// a pod within nominationWindow. Otherwise PostFilter skips counting the
// devices being given back, which costs a pass over the claims.
func (pl *TopologyDRA) mayBeNominated(pod *v1.Pod) bool {
	if pod.Status.NominatedNodeName != "" {
		return true
	}
	last := pl.lastTrialFit.Load()
	return preemptionAllowed(pod) && last != 0 && time.Since(time.Unix(0, last)) < nominationWindow
}

// nominatedTo returns the node the pod is nominated to: its status says,
// or, until the scheduler's write of that comes back, the scheduler's own
// record of nominations does. A preemptor is retried as soon as its last
// victim is deleted, which may come first; without this it would evict
// more pods elsewhere meanwhile. The record is looked up only on the nodes
// of freeing (see freeing), the only nodes where PostFilter waits.
func (pl *TopologyDRA) nominatedTo(pod *v1.Pod, freeing sets.Set[structured.DeviceID], s *stateData) string {
	if pod.Status.NominatedNodeName != "" || !preemptionAllowed(pod) {
		return pod.Status.NominatedNodeName
	}
	for node := range s.allocator.NodesOf(freeing) {
		if pl.inNominationRecord(pod, node) {
			return node
		}
	}
	return ""
}

// nominatedByRecord reports whether a pod whose status names no node is
// nominated to node in the scheduler's record only (see nominatedTo).
func (pl *TopologyDRA) nominatedByRecord(pod *v1.Pod, node string) bool {
	return pod.Status.NominatedNodeName == "" && pl.handle != nil && pl.mayBeNominated(pod) && pl.inNominationRecord(pod, node)
}

// inNominationRecord reports whether the scheduler's own record of
// nominations has the pod nominated to node. Never from a queueing hint:
// hints run under the scheduling queue's lock, which the record takes.
func (pl *TopologyDRA) inNominationRecord(pod *v1.Pod, node string) bool {
	for _, pi := range pl.handle.NominatedPodsForNode(node) {
		if pi.GetPod().UID == pod.UID {
			return true
		}
	}
	return false
}

// freeing returns the devices that are being given back: those of the
// claims of leaving (a leavingSets map: claims whose pods no longer exist,
// or also those whose pods terminate because the scheduler preempted
// them), not the pod's own claims, and those of claims given back since
// the cycle's allocator was built. The claim controller releases a
// preemption's victims' claims one by one, and the pod may be retried in
// between: counted as in use by the cycle, they are neither allocated now
// nor claims of pods that are gone. A victim that terminates counts as
// DefaultPreemption counts it (it does not preempt again while one is on
// the nominated node), but as the pod lister has it: the cycle's snapshot,
// which DefaultPreemption reads, may not show the victim terminating yet.
func (pl *TopologyDRA) freeing(ctx context.Context, s *stateData, leaving map[types.UID]sets.Set[structured.DeviceID]) sets.Set[structured.DeviceID] {
	freeing := sets.New[structured.DeviceID]()
	addAllBut(freeing, leaving, s.claimUIDs())
	if now, err := pl.gatherAllocatedState(ctx); err == nil {
		for id := range s.allocator.ReleasedSince(now.AllocatedDevices) {
			freeing.Insert(id)
		}
	}
	return freeing
}

// fitsOnceGone reports whether the pod's claims fit on the node once the
// devices of freeing are free there, and not as the node was when the
// cycle began.
func (pl *TopologyDRA) fitsOnceGone(ctx context.Context, s *stateData, freeing sets.Set[structured.DeviceID], nodeName string) bool {
	if pl.handle.SnapshotSharedLister() == nil || !s.allocator.AnyOnNode(nodeName, freeing) {
		return false
	}
	nodeInfo, err := pl.handle.SnapshotSharedLister().NodeInfos().Get(nodeName)
	if err != nil {
		return false
	}
	_, claims := s.claimsOn(nodeName)
	if len(claims) == 0 {
		return false
	}
	res, err := s.allocator.Adjusted(freeing, nil).Allocate(ctx, nodeInfo.Node(), claims)
	return err == nil && res.Allocations != nil
}
