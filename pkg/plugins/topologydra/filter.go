package topologydra

import (
	"context"
	"errors"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
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
	if st := checkExtended(s.extended, nodeInfo); st != nil {
		return st
	}
	node := nodeInfo.Node()
	for i, sel := range s.availableOnNodes {
		if sel != nil && !sel.Match(node) {
			s.markUnavailable(i)
			// Only deallocating the claim (PostFilter, or its owner)
			// changes this.
			return unresolvable(fmt.Sprintf("resource claim %s is allocated on devices that this node cannot use", s.claims[i].Name))
		}
	}
	if s.allocator == nil {
		return nil
	}

	start := time.Now()
	res, err := s.allocator.Allocate(ctx, node, s.allocClaims)
	allocationDuration.Observe(time.Since(start).Seconds())
	if err != nil {
		// Bad input, e.g. a CEL runtime error on this node's devices. The
		// message names the claim, request and expression; other pods
		// keep scheduling. The claim gets a warning event, once per cycle.
		var inputErr *allocator.InputError
		if errors.As(err, &inputErr) {
			s.reportOnce.Do(func() {
				for _, index := range s.toAllocate {
					claim := s.claims[index]
					if claim.Namespace+"/"+claim.Name == inputErr.Claim {
						pl.handle.EventRecorder().Eventf(claim, nil, v1.EventTypeWarning, "InvalidClaim", "Scheduling", "%s", err.Error())
					}
				}
			})
		}
		return unresolvable(err.Error())
	}
	if res.DevicesConsidered > 0 {
		devicesConsidered.Observe(float64(res.DevicesConsidered))
	}
	if res.Allocations == nil {
		msg := "cannot allocate all claims"
		if res.Explanation != nil {
			if e := res.Explanation.String(); e != "" {
				msg = e
			}
		}
		// More devices may become free or appear (claim and slice events).
		return unschedulable(msg)
	}
	s.setResult(node.Name, res)
	return nil
}
