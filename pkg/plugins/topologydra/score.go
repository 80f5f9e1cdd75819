package topologydra

import (
	"context"
	"math"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/dynamic-resource-allocation/resourceclaim"

	"github.com/topodra/topodra/pkg/allocator"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
)

// PreScore skips scoring for pods with nothing to allocate, and chooses
// the policy that ranks the nodes: with WholeNodeTradeWhileWaiting while a
// pod that needs a whole node is pending.
func (pl *TopologyDRA) PreScore(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, nodes []fwk.NodeInfo) *fwk.Status {
	s, err := getState(cs)
	if err != nil {
		// No state: PreFilter skipped this pod.
		return fwk.NewStatus(fwk.Skip)
	}
	if s.allocator == nil {
		return fwk.NewStatus(fwk.Skip)
	}
	s.scorePolicy = pl.scorePolicy(pod)
	s.choiceLevels = 0
	if pl.features.PrioritizedList {
		for _, c := range s.allocClaims {
			for _, r := range c.Spec.Devices.Requests {
				if len(r.FirstAvailable) > 1 {
					s.choiceLevels += len(r.FirstAvailable) - 1
				}
			}
		}
	}
	if logger := klog.FromContext(ctx); logger.V(5).Enabled() {
		logger.V(5).Info("Scoring policy chosen", "pod", klog.KObj(pod), "wholeNodeTrade", s.scorePolicy.WholeNodeTrade)
	}
	return nil
}

// wholeNodePodWaiting reports whether a pod other than pod, of the same
// scheduler, is pending (not bound, not being deleted) and asks, in its
// claims that are not allocated yet, for allocator.WholeNodeBlock devices
// or more (exact counts; the first subrequest of a firstAvailable
// request). It reads the informer caches only; a claim not in the cache
// yet counts as nothing. It walks all pods of the cluster, once per
// scheduling cycle of a pod with claims.
func (pl *TopologyDRA) wholeNodePodWaiting(pod *v1.Pod) bool {
	all, err := pl.pods.List(labels.Everything())
	if err != nil {
		return false
	}
	for _, p := range all {
		if p.UID == pod.UID || p.Spec.NodeName != "" || p.DeletionTimestamp != nil ||
			p.Spec.SchedulerName != pod.Spec.SchedulerName || len(p.Spec.ResourceClaims) == 0 {
			continue
		}
		if pl.requestedDevices(p) >= allocator.WholeNodeBlock {
			return true
		}
	}
	return false
}

// requestedDevices counts the devices that pod's unallocated claims ask
// for, as far as the claim cache knows them.
func (pl *TopologyDRA) requestedDevices(pod *v1.Pod) int {
	n := 0
	for i := range pod.Spec.ResourceClaims {
		name, _, err := resourceclaim.Name(pod, &pod.Spec.ResourceClaims[i])
		if err != nil || name == nil {
			continue
		}
		claim, err := pl.draManager.ResourceClaims().Get(pod.Namespace, *name)
		if err != nil || claim.Status.Allocation != nil {
			continue
		}
		for _, r := range claim.Spec.Devices.Requests {
			switch {
			case r.Exactly != nil && r.Exactly.AllocationMode != resourceapi.DeviceAllocationModeAll:
				n += int(r.Exactly.Count)
			case len(r.FirstAvailable) > 0 && r.FirstAvailable[0].AllocationMode != resourceapi.DeviceAllocationModeAll:
				n += int(r.FirstAvailable[0].Count)
			}
		}
	}
	return n
}

// Score returns the score of the allocation Filter found on the node:
// Policy.Score of its quality (alignment rank, room, packing) under the
// policy PreScore chose (see policyFromArgs and scorePolicy).
func (pl *TopologyDRA) Score(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, nodeInfo fwk.NodeInfo) (int64, *fwk.Status) {
	s, err := getState(cs)
	if err != nil {
		return 0, internalError(klog.FromContext(ctx), err)
	}
	res := s.getResult(nodeInfo.Node().Name)
	if res == nil {
		return 0, nil
	}
	score := s.scorePolicy.Score(res.Quality)
	if s.choiceLevels > 0 {
		// Like the stock plugin, a node where the pod gets earlier
		// (preferred) subrequests of its prioritized lists wins; topology
		// ranks nodes that give the same choices. Each choice level gets
		// an equal band of 0..100, Policy.Score places a node within it.
		band := float64(fwk.MaxNodeScore) / float64(s.choiceLevels+1)
		level := s.choiceLevels - choicePenalty(s.allocClaims, res.Allocations)
		score = int64(math.Round(float64(level)*band + float64(score)*band/float64(fwk.MaxNodeScore)))
	}
	return score, nil
}

// choicePenalty sums, over the prioritized-list requests of claims, the
// index of the subrequest that allocations chose (0: every first choice).
func choicePenalty(claims []*resourceapi.ResourceClaim, allocations []resourceapi.AllocationResult) int {
	penalty := 0
	for i, c := range claims {
		if i >= len(allocations) {
			break
		}
		chosen := map[string]bool{}
		for _, r := range allocations[i].Devices.Results {
			chosen[r.Request] = true
		}
		for _, req := range c.Spec.Devices.Requests {
			for j, sub := range req.FirstAvailable {
				if chosen[resourceclaim.CreateSubRequestRef(req.Name, sub.Name)] {
					penalty += j
					break
				}
			}
		}
	}
	return penalty
}

// ScoreExtensions implements fwk.ScorePlugin. There is no normalisation:
// Policy.Score is proportional (0..100 on the same scale for every node),
// so the profile's plugin weight alone sets how much placement counts
// against the profile's other scores, users' preferred affinities among
// them. Stretching the feasible nodes' scores to 0..100 would turn a
// 1-point difference into the full range and override them.
func (pl *TopologyDRA) ScoreExtensions() fwk.ScoreExtensions { return nil }
