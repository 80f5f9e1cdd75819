package topologydra

import (
	"context"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
)

// PreScore skips scoring for pods with nothing to allocate.
func (pl *TopologyDRA) PreScore(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, nodes []fwk.NodeInfo) *fwk.Status {
	s, err := getState(cs)
	if err != nil {
		// No state: PreFilter skipped this pod.
		return fwk.NewStatus(fwk.Skip)
	}
	if s.allocator == nil {
		return fwk.NewStatus(fwk.Skip)
	}
	return nil
}

// Score returns the score of the allocation Filter found on the node:
// allocator.Policy.Score of its quality (alignment, room, packing), with
// the weights and scoring strategy of the args (see policyFromArgs).
func (pl *TopologyDRA) Score(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, nodeInfo fwk.NodeInfo) (int64, *fwk.Status) {
	s, err := getState(cs)
	if err != nil {
		return 0, internalError(klog.FromContext(ctx), err)
	}
	res := s.getResult(nodeInfo.Node().Name)
	if res == nil {
		return 0, nil
	}
	return res.Quality.Score, nil
}

// ScoreExtensions implements fwk.ScorePlugin. There is no normalisation:
// Policy.Score is proportional (0..100 on the same scale for every node),
// so the profile's plugin weight alone sets how much placement counts
// against the profile's other scores, users' preferred affinities among
// them. Stretching the feasible nodes' scores to 0..100 would turn a
// 1-point difference into the full range and override them.
func (pl *TopologyDRA) ScoreExtensions() fwk.ScoreExtensions { return nil }
