package topologydra

import (
	"context"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
// node (see nominatedTo) where it fits once claims of pods that are gone
// give their devices back (its preemption's victims, see trialData), it
// keeps the nomination and ends PostFilter, so that DefaultPreemption does
// not look for more victims while those devices are given back.
func (pl *TopologyDRA) PostFilter(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, _ fwk.NodeToStatusReader) (*fwk.PostFilterResult, *fwk.Status) {
	logger := klog.FromContext(ctx)
	s, err := getState(cs)
	if err != nil {
		return nil, fwk.NewStatus(fwk.Unschedulable)
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
		claim = claim.DeepCopy()
		claim.Status.ReservedFor = nil
		claim.Status.Allocation = nil
		claim.Status.Devices = nil
		logger.V(2).Info("Deallocating claim that no node can use", "pod", klog.KObj(pod), "claim", klog.KObj(claim))
		if _, err := pl.client.ResourceV1().ResourceClaims(claim.Namespace).UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
			return nil, internalError(logger, err, "claim", klog.KObj(claim))
		}
		return nil, fwk.NewStatus(fwk.Unschedulable, "deallocated resource claim "+claim.Name+" so that it can be allocated again")
	}
	if nominated := pl.nominatedTo(pod, s); nominated != "" && pl.fitsOnceGone(ctx, s, nominated) {
		// The pod's victims are gone and their claims not given back
		// yet: it waits for them on its node, and DefaultPreemption,
		// which a success ends, evicts nobody more meanwhile. A claim
		// event requeues the pod.
		logger.V(2).Info("Waiting for the devices of pods that are gone to be given back on the nominated node", "pod", klog.KObj(pod), "node", nominated)
		return &fwk.PostFilterResult{NominatingInfo: &fwk.NominatingInfo{NominatedNodeName: nominated, NominatingMode: fwk.ModeOverride}},
			fwk.NewStatus(fwk.Success, "waiting on node "+nominated+" for devices of pods that are gone to be given back")
	}
	return nil, fwk.NewStatus(fwk.Unschedulable)
}

// nominatedTo returns the node the pod is nominated to: its status says,
// or, until the scheduler's write of that comes back, the scheduler's own
// record of nominations does. A preemptor is retried as soon as its last
// victim is deleted, which may come first; without this it would evict
// more pods elsewhere meanwhile. The record is looked up only on the nodes
// where claims of pods that are gone hold devices, the only nodes where
// PostFilter waits.
func (pl *TopologyDRA) nominatedTo(pod *v1.Pod, s *stateData) string {
	if pod.Status.NominatedNodeName != "" || !preemptionAllowed(pod) || s.allocator == nil || pl.handle == nil {
		return pod.Status.NominatedNodeName
	}
	gone := sets.New[structured.DeviceID]()
	addAllBut(gone, s.leaving(pl).gone, s.claimUIDs())
	for node := range s.allocator.NodesOf(gone) {
		for _, pi := range pl.handle.NominatedPodsForNode(node) {
			if pi.GetPod().UID == pod.UID {
				return node
			}
		}
	}
	return ""
}

// fitsOnceGone reports whether the pod's claims fit on the node once the
// claims of pods that no longer exist are given back there, and not as
// the node is.
func (pl *TopologyDRA) fitsOnceGone(ctx context.Context, s *stateData, nodeName string) bool {
	if s.allocator == nil || pl.handle == nil || pl.handle.SnapshotSharedLister() == nil {
		return false
	}
	gone := sets.New[structured.DeviceID]()
	addAllBut(gone, s.leaving(pl).gone, s.claimUIDs())
	if !s.allocator.AnyOnNode(nodeName, gone) {
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
	res, err := s.allocator.Adjusted(gone, nil).Allocate(ctx, nodeInfo.Node(), claims)
	return err == nil && res.Allocations != nil
}
