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
// allocator.Policy.Score of its quality, with the weights and scoring
// strategy of the args (see policyFromArgs).
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

// ScoreExtensions implements fwk.ScorePlugin.
func (pl *TopologyDRA) ScoreExtensions() fwk.ScoreExtensions { return pl }

// NormalizeScore stretches the scores of the feasible nodes to the full
// 0..100 range (min-max), so that the difference between a well and a
// poorly aligned or packed node outweighs the generic spreading plugins of
// the profile. Equal scores stay as they are.
func (pl *TopologyDRA) NormalizeScore(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, scores fwk.NodeScoreList) *fwk.Status {
	if len(scores) == 0 {
		return nil
	}
	lo, hi := scores[0].Score, scores[0].Score
	for _, s := range scores {
		lo = min(lo, s.Score)
		hi = max(hi, s.Score)
	}
	if hi == lo {
		return nil
	}
	for i := range scores {
		scores[i].Score = (scores[i].Score - lo) * fwk.MaxNodeScore / (hi - lo)
	}
	return nil
}
