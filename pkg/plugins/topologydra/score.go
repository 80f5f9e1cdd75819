package topologydra

import (
	"cmp"
	"context"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/resourceclaim"

	"github.com/topodra/topodra/pkg/allocator"
	"github.com/topodra/topodra/pkg/topology"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
)

// PreScore skips scoring for pods with nothing to allocate, and chooses
// how the nodes are ranked: with WholeNodeTradeWhileWaiting while a pod
// that needs a whole node is pending, and, for a pod smaller than a whole
// node, which nodes are draining (see drainingNodes): Score ranks them
// with allocator.Policy.ScoreOn (room 0, DrainTrade ranks less, none for
// a pod that asks for devices of several classes). With
// AgeWeight it also measures how long each node's pods have run (see
// agesOf), and with NICReservePercent how many GPUs beside free NICs are
// kept for the pods that need both (see nicReserveOf).
func (pl *TopologyDRA) PreScore(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, nodes []fwk.NodeInfo) *fwk.Status {
	s, err := getState(cs)
	if err != nil {
		// No state: PreFilter skipped this pod.
		return fwk.NewStatus(fwk.Skip)
	}
	if s.allocator == nil {
		return fwk.NewStatus(fwk.Skip)
	}
	s.scorePolicy = pl.policy
	s.draining = nil
	s.ages = nodeAges{}
	if pl.policy.Packing && pl.policy.AgeWeight > 0 {
		s.ages = agesOf(nodes, pod, time.Now(), pl.bindClock)
	}
	var own []classDevices
	for _, c := range s.allocClaims {
		own = addClaimDevices(own, c)
	}
	wholeNode := mostOfOneClass(own) >= pl.wholeNode()
	if pl.pending != nil {
		if waiting, admitted := pl.pending.wholeNodePods(pod, pl.claimWithInFlight, nodes); waiting > 0 {
			s.scorePolicy = pl.waitingPolicy
			if !wholeNode {
				s.draining = drainingNodes(s, nodes, waiting, s.ages, admitted, pl.wholeNode())
				// A pod of several devices of one class whose every
				// node is draining has nowhere else to go: the marks
				// would only level its alignment ranks (the trade
				// stops at rank 1) and its room (0 on all), and it
				// would take a looser placement for nothing. A pod of
				// one device has the same rank everywhere; it keeps
				// the marks (the draining nodes come last).
				if mostOfOneClass(own) > 1 && drainsAll(s, nodes, s.draining) {
					s.draining = sets.New[string]()
				}
			}
		}
	}
	if len(own) > 1 {
		// A pod that asks for devices of several classes (a GPU and the
		// NIC beside it) gives up no rank on a draining node: the
		// looser placement elsewhere would split its devices across
		// PCIe roots, the one alignment it asked for. The draining
		// node still comes last within its rank.
		s.scorePolicy.DrainTrade = 0
	}
	s.sparesNICs = wholeNode && pl.policy.Packing && pl.policy.NICRootTrade > 0 && pl.rootPairsWanted()
	s.nicReserve = nicReserve{}
	if pl.policy.Packing && pl.nicReservePercent > 0 {
		s.nicReserve = nicReserveOf(s, nodes, pl.nicReservePercent)
	}
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
	if logger := klog.FromContext(ctx).V(5); logger.Enabled() {
		logger.Info("Scoring policy chosen", "pod", klog.KObj(pod), "wholeNodeTrade", s.scorePolicy.WholeNodeTrade, "draining", sets.List(s.draining), "sparesNICs", s.sparesNICs)
	}
	return nil
}

// nicRootPairsWanted reports whether some claim needs devices of two or
// more device classes on one PCIe root: a matchAttribute constraint on
// resource.kubernetes.io/pcieRoot over requests (all of the claim's, where
// it names none) of different classes, such as a GPU and the NIC beside
// it. Claims live as long as their pods, so this says that such pods run
// or wait. A list error counts as no.
func nicRootPairsWanted(list func() ([]*resourceapi.ResourceClaim, error)) bool {
	claims, err := list()
	if err != nil {
		return false
	}
	return slices.ContainsFunc(claims, wantsRootPair)
}

// wantsRootPair reports whether the claim needs devices of two or more
// device classes on one PCIe root (see nicRootPairsWanted).
func wantsRootPair(c *resourceapi.ResourceClaim) bool {
	for _, con := range c.Spec.Devices.Constraints {
		if con.MatchAttribute == nil || *con.MatchAttribute != resourceapi.FullyQualifiedName(topology.AttrPCIeRoot) {
			continue
		}
		var class string
		for _, r := range c.Spec.Devices.Requests {
			if len(con.Requests) > 0 && !slices.Contains(con.Requests, r.Name) {
				continue
			}
			var classes []string
			if r.Exactly != nil {
				classes = append(classes, r.Exactly.DeviceClassName)
			}
			for _, sub := range r.FirstAvailable {
				classes = append(classes, sub.DeviceClassName)
			}
			for _, cl := range classes {
				if class == "" {
					class = cl
				} else if cl != class {
					return true
				}
			}
		}
	}
	return false
}

// rootPairClaims is the set of claims that need devices of several
// classes on one PCIe root (wantsRootPair), kept by the claim informer's
// events, so that PreScore need not list every claim of the cluster to
// know whether there is one. A claim's spec does not change. Safe for
// concurrent use.
type rootPairClaims struct {
	mu   sync.Mutex
	uids sets.Set[types.UID]
}

func newRootPairClaims() *rootPairClaims { return &rootPairClaims{uids: sets.New[types.UID]()} }

// any reports whether there is such a claim.
func (r *rootPairClaims) any() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.uids.Len() > 0
}

func (r *rootPairClaims) handler() cache.ResourceEventHandler {
	add := func(obj any) {
		if c, ok := obj.(*resourceapi.ResourceClaim); ok && wantsRootPair(c) {
			r.mu.Lock()
			r.uids.Insert(c.UID)
			r.mu.Unlock()
		}
	}
	remove := func(obj any) {
		if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = tomb.Obj
		}
		if c, ok := obj.(*resourceapi.ResourceClaim); ok {
			r.mu.Lock()
			r.uids.Delete(c.UID)
			r.mu.Unlock()
		}
	}
	return cache.ResourceEventHandlerFuncs{
		AddFunc: add,
		UpdateFunc: func(oldObj, obj any) {
			// Another claim under the name: deleted and created again
			// while the informer listed anew.
			if old, ok := oldObj.(*resourceapi.ResourceClaim); ok {
				if c, ok := obj.(*resourceapi.ResourceClaim); ok && c.UID != old.UID {
					remove(old)
				}
			}
			add(obj)
		},
		DeleteFunc: remove,
	}
}

// rootPairsWanted reports whether some claim needs devices of several
// classes on one PCIe root: from the claim informer's events where the
// plugin has them, else from the claim cache.
func (pl *TopologyDRA) rootPairsWanted() bool {
	if pl.rootPairs != nil {
		return pl.rootPairs.any()
	}
	return nicRootPairsWanted(pl.draManager.ResourceClaims().List)
}

// nicReserve is, for one pod, how many of the devices of the pod's own
// drivers (GPUs) stay free for pods that also need a node's other devices
// (NICs), and how many are free on the nodes where such devices are free.
type nicReserve struct {
	keep, free int
}

// nicReserveOf counts, over the nodes the pod passed Filter on that have
// devices of a driver the pod does not ask for (allocator.Quality's
// OtherDevices), the devices matching the pod's requests, and keeps
// percent of them (rounded up); free counts those not in use on the nodes
// where such other devices are free (Quality.OtherFree). Where the pod's
// allocation on every node it passed Filter on would take the reserve,
// nothing is kept: there is nowhere else to send the pod, and the marks
// would only hide how well aligned each of those allocations is.
func nicReserveOf(s *stateData, nodes []fwk.NodeInfo, percent int32) nicReserve {
	var r nicReserve
	total := 0
	for _, n := range nodes {
		res := s.getResult(n.Node().Name)
		if res == nil || res.Quality.OtherDevices == 0 {
			continue
		}
		total += res.Quality.NodeDevices
		if res.Quality.OtherFree > 0 {
			r.free += res.Quality.NodeDevices - res.Quality.NodeInUse
		}
	}
	r.keep = (total*int(percent) + 99) / 100
	if r.keep == 0 {
		return r
	}
	for _, n := range nodes {
		if res := s.getResult(n.Node().Name); res != nil && !r.takes(res.Quality) {
			return r
		}
	}
	return nicReserve{}
}

// takes reports whether an allocation of quality q uses the reserve: it is
// on a node with free other devices and leaves fewer than keep of the
// pod's own devices free on such nodes.
func (r nicReserve) takes(q allocator.Quality) bool {
	return r.keep > 0 && q.OtherFree > 0 && r.free-len(q.Devices) < r.keep
}

// drainingNodes picks, among the nodes that passed Filter and that a
// waiting whole-node pod may use (admitted), the waiting
// nodes (at most) with whole or more devices matching
// the pod's requests that have the fewest of them in use, ties broken by
// name: the nodes that pending whole-node pods are expected to get first,
// if the pods being placed now leave them alone. With ages (see
// agesOf), the nodes that hold no pod that runs until deleted come first
// (a node that holds one never drains), then those whose oldest pod with
// claims is youngest, then the fewest in use: pods that have run long
// tend to run on.
func drainingNodes(s *stateData, nodes []fwk.NodeInfo, waiting int, ages nodeAges, admitted sets.Set[string], whole int) sets.Set[string] {
	type candidate struct {
		name    string
		inUse   int
		lasting bool
		age     time.Duration
	}
	var cands []candidate
	for _, n := range nodes {
		name := n.Node().Name
		res := s.getResult(name)
		if res == nil || res.Quality.NodeDevices < whole || !admitted.Has(name) {
			continue
		}
		cands = append(cands, candidate{name: name, inUse: res.Quality.NodeInUse, lasting: ages.lasting.Has(name), age: ages.byNode[name]})
	}
	slices.SortFunc(cands, func(a, b candidate) int {
		return cmp.Or(cmpBool(a.lasting, b.lasting), cmp.Compare(a.age, b.age), cmp.Compare(a.inUse, b.inUse), strings.Compare(a.name, b.name))
	})
	out := sets.New[string]()
	for _, c := range cands[:min(waiting, len(cands))] {
		out.Insert(c.name)
	}
	return out
}

// drainsAll reports whether every node the pod can go to (every node with
// a result) is draining.
func drainsAll(s *stateData, nodes []fwk.NodeInfo, draining sets.Set[string]) bool {
	for _, n := range nodes {
		if name := n.Node().Name; s.getResult(name) != nil && !draining.Has(name) {
			return false
		}
	}
	return true
}

// cmpBool orders false before true.
func cmpBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

// nodeAges holds, per node, the age of the node's oldest pod with claims
// (0 for a node without such pods), and which nodes hold a pod with
// claims that runs until it is deleted (see runsUntilDeleted).
type nodeAges struct {
	byNode map[string]time.Duration
	// lasting: the nodes that hold a pod that runs until deleted.
	lasting sets.Set[string]
	// oldestLasting and oldestOther are the largest ages of the lasting
	// nodes and of the others; others: some node with pods with claims
	// is not lasting.
	oldestLasting, oldestOther time.Duration
	others                     bool
}

// settled is Quality.Settled of the node. Where every node with pods
// with claims is lasting, or none is, it is the node's age over the
// largest. Where both kinds exist, the lasting nodes come first: 1/2 plus
// 1/2 of the age over the largest among them; the others 1/2 of the age
// over the largest among them.
func (a nodeAges) settled(node string) float64 {
	frac := func(d, most time.Duration) float64 {
		if most <= 0 {
			return 0
		}
		return float64(d) / float64(most)
	}
	age := a.byNode[node]
	switch {
	case len(a.lasting) == 0:
		return frac(age, a.oldestOther)
	case a.lasting.Has(node) && !a.others:
		return frac(age, a.oldestLasting)
	case a.lasting.Has(node):
		return 0.5 + 0.5*frac(age, a.oldestLasting)
	}
	return 0.5 * frac(age, a.oldestOther)
}

// runsUntilDeleted reports whether the pod ends only when it is deleted:
// with restartPolicy Always (the default, as for the pods of Deployments
// and StatefulSets) the kubelet restarts its containers whenever they
// exit, so it never completes by itself; a Job's pods (Never,
// OnFailure) do.
func runsUntilDeleted(pod *v1.Pod) bool {
	return pod.Spec.RestartPolicy == v1.RestartPolicyAlways || pod.Spec.RestartPolicy == ""
}

// agesOf measures the ages of nodes, leaving pod out. A pod's age is
// counted from its binding: as the clock saw it where it did, else as
// runningSince says.
func agesOf(nodes []fwk.NodeInfo, pod *v1.Pod, now time.Time, clock *bindClock) nodeAges {
	ages := nodeAges{byNode: make(map[string]time.Duration, len(nodes)), lasting: sets.New[string]()}
	for _, n := range nodes {
		var age time.Duration
		lasting, withClaims := false, false
		for _, pi := range n.GetPods() {
			p := pi.GetPod()
			if p.UID == pod.UID || len(p.Spec.ResourceClaims) == 0 {
				continue
			}
			withClaims = true
			lasting = lasting || runsUntilDeleted(p)
			since, ok := clock.boundAt(p)
			if !ok {
				since = runningSince(p, now)
			}
			age = max(age, now.Sub(since))
		}
		name := n.Node().Name
		ages.byNode[name] = age
		switch {
		case lasting:
			ages.lasting.Insert(name)
			ages.oldestLasting = max(ages.oldestLasting, age)
		case withClaims:
			ages.others = true
			ages.oldestOther = max(ages.oldestOther, age)
		}
	}
	return ages
}

// runningSince is when the pod was bound to its node (its PodScheduled
// condition turned true), or now where that is not known yet: a pod this
// scheduler has just assumed, or whose binding waits in PreBind, has only
// just been placed, however long it waited before.
func runningSince(pod *v1.Pod, now time.Time) time.Time {
	for _, c := range pod.Status.Conditions {
		if c.Type == v1.PodScheduled && c.Status == v1.ConditionTrue && !c.LastTransitionTime.IsZero() {
			return c.LastTransitionTime.Time
		}
	}
	return now
}

// Score returns the score of the allocation Filter found on the node:
// Policy.Score of its quality (alignment rank, room, packing) under the
// policy PreScore chose, on a draining node or not (see policyFromArgs
// and PreScore).
func (pl *TopologyDRA) Score(ctx context.Context, cs fwk.CycleState, pod *v1.Pod, nodeInfo fwk.NodeInfo) (int64, *fwk.Status) {
	s, err := getState(cs)
	if err != nil {
		return 0, internalError(klog.FromContext(ctx), err)
	}
	res := s.getResult(nodeInfo.Node().Name)
	if res == nil {
		return 0, nil
	}
	q := res.Quality
	q.Settled = s.ages.settled(nodeInfo.Node().Name)
	q.StrandsNICs = s.sparesNICs && q.StrandedRoots > 0
	q.InNICReserve = s.nicReserve.takes(q)
	score := s.scorePolicy.ScoreOn(q, s.draining.Has(nodeInfo.Node().Name))
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

// claimWithInFlight looks a claim up in the claim cache, with the
// allocation a scheduling cycle has reserved for it and not written yet:
// a pod between Reserve and the end of PreBind is placed, not waiting.
func (pl *TopologyDRA) claimWithInFlight(namespace, name string) (*resourceapi.ResourceClaim, error) {
	claim, err := pl.draManager.ResourceClaims().Get(namespace, name)
	if err != nil || claim.Status.Allocation != nil {
		return claim, err
	}
	if allocation := pl.draManager.ResourceClaims().GetPendingAllocation(claim.UID); allocation != nil {
		claim = claim.DeepCopy()
		claim.Status.Allocation = allocation
	}
	return claim, nil
}
