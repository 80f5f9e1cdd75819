package topologydra

import (
	"sync/atomic"

	"k8s.io/component-base/metrics"

	"github.com/topodra/topodra/pkg/allocator"
)

// rejection is why TopologyDRA turned a pod down, in one attempt or on
// one node; its name is the reason label of
// topodra_unschedulable_attempts_total.
type rejection int

const (
	// Of the pod's claims, found before any node is looked at.
	rejectClaimNotReady rejection = iota // a claim missing or being deleted
	rejectClaimInUse                     // reserved by the most pods a claim can be, or being allocated for another pod
	rejectInvalidClaim                   // no node can serve what a claim says (class, selectors, counts)
	// Of a node.
	rejectClaimUnusable // an allocated claim's devices cannot be used on the node
	rejectNoMatch       // too few devices match the claims' classes and selectors
	rejectPools         // a resource pool is incomplete or invalid
	rejectTainted       // taints the claims do not tolerate keep devices from them
	rejectInUse         // matching devices are allocated to other claims
	rejectConstraints   // free devices do not meet the claims' constraints together
	rejectNominated     // devices are kept for a pod nominated to the node
	rejectHeldBack      // smallPodHeadroomPercent keeps the devices for smaller pods
	rejectOther
	numRejections
)

var rejectionNames = [numRejections]string{
	rejectClaimNotReady: "claim_not_ready",
	rejectClaimInUse:    "claim_in_use",
	rejectInvalidClaim:  "invalid_claim",
	rejectClaimUnusable: "claim_unusable",
	rejectNoMatch:       "no_matching_devices",
	rejectPools:         "pools_unusable",
	rejectTainted:       "devices_tainted",
	rejectInUse:         "devices_in_use",
	rejectConstraints:   "constraints",
	rejectNominated:     "nominated_pod",
	rejectHeldBack:      "held_back",
	rejectOther:         "other",
}

func (r rejection) String() string { return rejectionNames[r] }

// causeRejection maps the allocator's cause of a node's explanation.
func causeRejection(c allocator.Cause) rejection {
	switch c {
	case allocator.CauseNoMatch:
		return rejectNoMatch
	case allocator.CausePools:
		return rejectPools
	case allocator.CauseTainted:
		return rejectTainted
	case allocator.CauseInUse:
		return rejectInUse
	case allocator.CauseConstraints:
		return rejectConstraints
	default:
		return rejectOther
	}
}

// nodeRejections counts, per rejection, the nodes Filter turned a pod
// down on in one scheduling cycle; Filter runs for many nodes at once.
type nodeRejections [numRejections]atomic.Int32

func (n *nodeRejections) add(r rejection) { n[r].Add(1) }

// most returns the rejection of the most nodes, the first in rejection
// order among equals, and false where no node was turned down.
func (n *nodeRejections) most() (rejection, bool) {
	best, count := rejectOther, int32(0)
	for r := range numRejections {
		if c := n[r].Load(); c > count {
			best, count = r, c
		}
	}
	return best, count > 0
}

// attemptCounters are one profile's children of
// topodra_unschedulable_attempts_total, one per rejection.
type attemptCounters [numRejections]metrics.CounterMetric

func newAttemptCounters(profile string) attemptCounters {
	var c attemptCounters
	for r := range numRejections {
		c[r] = unschedulableAttempts.WithLabelValues(profile, r.String())
	}
	return c
}

// countAttempt counts one attempt that TopologyDRA turned the pod down in.
func (pl *TopologyDRA) countAttempt(r rejection) {
	if pl.attempts[r] != nil {
		pl.attempts[r].Inc()
	}
}
