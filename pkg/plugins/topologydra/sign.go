package topologydra

import (
	"context"

	v1 "k8s.io/api/core/v1"
	fwk "k8s.io/kube-scheduler/framework"
)

var _ fwk.SignPlugin = &TopologyDRA{}

// SignPod lets the scheduler batch equal pods (opportunistic batching):
// without a signer in every plugin of a profile the framework turns
// batching off for the whole profile. Pods without claims are signed with
// no fragment: this plugin does not look at them. Pods with claims are not
// signed, like the stock plugin does, because the devices a pod gets
// depend on its claims' contents and on the allocations made for the pods
// before it; no fragment short of the claims themselves covers that.
func (pl *TopologyDRA) SignPod(ctx context.Context, pod *v1.Pod) ([]fwk.SignFragment, *fwk.Status) {
	if len(pod.Spec.ResourceClaims) > 0 {
		return nil, fwk.NewStatus(fwk.Unschedulable, "pods with resource claims are not signable")
	}
	extended, err := pl.draExtendedResources(pod)
	if err != nil {
		return nil, fwk.AsStatus(err)
	}
	if len(extended) > 0 {
		return nil, fwk.NewStatus(fwk.Unschedulable, "pods with extended resources backed by DRA are not signable")
	}
	return nil, nil
}
