package allocator

import (
	"context"
	"errors"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
)

// MatchCount counts a driver's devices on one node that a pod's requests
// could take (Matching) and how many of them have no allocation (Free).
type MatchCount struct{ Matching, Free int }

// MatchingDevices counts, per driver, the devices of the node's own pools
// (slices with spec.nodeName; not network-attached devices) that match the
// class and selectors of some request of claims, counting every
// subrequest of a firstAvailable request, and how many of them have no
// allocation. A device on which a selector failed at run time counts as
// matching. ok is false where the claims use fields this package does not
// interpret: only upstream's allocation can tell then. Like Allocate, it
// returns an error only for input problems that make the claims
// unallocatable on every node (an *InputError) and cancellation. Safe for
// concurrent use.
func (a *Allocator) MatchingDevices(ctx context.Context, node *v1.Node, claims []*resourceapi.ResourceClaim) (counts map[string]MatchCount, ok bool, err error) {
	if node == nil {
		return nil, false, errors.New("matching devices: node is nil")
	}
	p := &podNode{a: a, node: node, claims: claims}
	_, passthrough, err := p.analysis(ctx)
	if err != nil || passthrough {
		return nil, false, err
	}
	if err := ctx.Err(); err != nil {
		return nil, false, err
	}
	counts = map[string]MatchCount{}
	for i := range p.ns.devices {
		d := &p.ns.devices[i]
		if d.slice.Spec.NodeName == nil {
			continue
		}
		for _, u := range p.units {
			if !u.matching[i] {
				continue
			}
			c := counts[d.driver]
			c.Matching++
			if !p.ns.inUse[i] {
				c.Free++
			}
			counts[d.driver] = c
			break
		}
	}
	return counts, true, nil
}
