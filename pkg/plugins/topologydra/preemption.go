package topologydra

import (
	"context"
	"maps"
	"slices"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	corev1helpers "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework/preemption"

	"github.com/topodra/topodra/pkg/allocator"
)

// Preemption's trial runs.
//
// DefaultPreemption asks, per candidate node, whether the pod would fit
// with lower-priority pods gone: it removes them from a copy of the cycle
// state (RemovePod), runs Filter, and gives them back one at a time
// (AddPod) while the pod still fits. The framework also adds pods
// nominated to a node, of the pod's priority or higher, before Filter
// (AddPod), so that a pod does not take the room that preemption made for
// another. The stock plugin ignores both, so evicting pods never frees
// devices in its trials and a pod waiting for devices never preempts.
//
// TopologyDRA records the pods a trial removed and added in trialData,
// under its own key of the cycle state (the copies the framework makes
// are the trials'), and Filter then allocates with an Allocator adjusted
// to them (see trialAllocator):
//   - A removed pod frees the devices its claims take whole, where every
//     consumer of the claim is removed too and the pod being scheduled
//     does not use the claim. In preemption's trials, also after every
//     victim was given back, so do the claims whose pods are all gone
//     but which are not deallocated yet (see leaving): the victims of an
//     earlier preemption, whose devices the claim controller is about to
//     give back. Without them, the preemptor's next attempt, after the
//     victims are gone and before their devices are, would evict more
//     pods (PostFilter also keeps such a preemptor's nomination).
//   - An added pod that is not bound takes the devices that its claims not
//     yet allocated get on the node first, with the devices of pods that
//     are leaving (terminating or gone) counted as free; where they do not
//     fit even so, the node is kept for it.
//   - A victim is given back only where the pod's devices stay as aligned
//     as at the trial's first fit, with every candidate victim removed:
//     the victims chosen free an aligned placement where the node has
//     one, as topodra would place the pod on free devices, which may take
//     a victim more than the fewest that make the pod fit. A victim whose
//     eviction would violate a PodDisruptionBudget is never evicted for
//     alignment alone (see keepsAlignment).
//
// Results of preemption's trials are never kept for Reserve. A
// result with only nominated pods added is a valid allocation, and wins
// over the framework's second Filter pass on the same node, which runs
// without the nominated pods: otherwise Reserve would give this pod the
// devices kept for them.

// trialKey is the key of a trial's record in the cycle state.
const trialKey fwk.StateKey = Name + "/trial"

// trialData is what a trial removed from and added to the node.
type trialData struct {
	// removed are the pods removed, by UID.
	removed map[types.UID]*v1.Pod
	// added are the pods added that were not removed before: nominated
	// pods, in the order they were added.
	added []*v1.Pod
	// preempting is set once a pod was removed: the trial is
	// preemption's, also after every pod removed was given back.
	preempting bool
	// aligned is the alignment that preemption's trial keeps for the pod
	// (keepsAlignment); never changed in place, so copies may share it.
	aligned *allocator.Quality
	// reprieved are the pods with claims that AddPod gave back since the
	// last RemovePod or check of keepsAlignment (the pods of one victim:
	// a pod group's are given back together).
	reprieved []*v1.Pod
}

// keepsAlignment reports whether a fit of quality q in preemption's trial,
// without nominated pods added, is as aligned as the trial keeps: its
// devices share as many of the policy's attributes (Quality.Shared) and,
// where they share as many, span no more domains. The first such fit sets
// it: DefaultPreemption removes every candidate victim before its first
// Filter and then gives them back one at a time, keeping each whose
// return still lets the pod pass, so the first fit is the best the node
// can give the pod. Where a pod given back is protected (its eviction would
// violate a PodDisruptionBudget; asked only for a less aligned fit), a
// less aligned fit is accepted and becomes what the trial keeps:
// preemption would otherwise evict that pod for alignment alone.
// DefaultPreemption gives such pods back before the others, so what the
// trial keeps is lowered before it judges them.
func (t *trialData) keepsAlignment(q allocator.Quality, protected func() bool) bool {
	if t.aligned == nil {
		t.aligned = &q
		return true
	}
	if q.Shared > t.aligned.Shared || q.Shared == t.aligned.Shared && q.DomainsSpanned <= t.aligned.DomainsSpanned {
		return true
	}
	if !protected() {
		return false
	}
	t.aligned = &q
	return true
}

// Clone implements fwk.StateData: each copy of the cycle state is a trial
// of its own.
func (t *trialData) Clone() fwk.StateData {
	return &trialData{removed: maps.Clone(t.removed), added: slices.Clone(t.added), preempting: t.preempting, aligned: t.aligned, reprieved: slices.Clone(t.reprieved)}
}

// trialOf returns the trial recorded in cs, creating it where create is
// set; nil where there is none (or nothing in it).
func trialOf(cs fwk.CycleState, create bool) *trialData {
	if data, err := cs.Read(trialKey); err == nil {
		if t, ok := data.(*trialData); ok {
			if !create && !t.preempting && len(t.added) == 0 {
				return nil
			}
			return t
		}
	}
	if !create {
		return nil
	}
	t := &trialData{removed: map[types.UID]*v1.Pod{}}
	cs.Write(trialKey, t)
	return t
}

// PreFilterExtensions implements fwk.PreFilterPlugin.
func (pl *TopologyDRA) PreFilterExtensions() fwk.PreFilterExtensions { return pl }

// AddPod implements fwk.PreFilterExtensions: a pod given back by a trial,
// or a nominated pod added.
func (pl *TopologyDRA) AddPod(_ context.Context, cs fwk.CycleState, _ *v1.Pod, podInfoToAdd fwk.PodInfo, _ fwk.NodeInfo) *fwk.Status {
	pod := podInfoToAdd.GetPod()
	if !usesClaims(pod) {
		return nil
	}
	t := trialOf(cs, true)
	if _, ok := t.removed[pod.UID]; ok {
		delete(t.removed, pod.UID)
		t.reprieved = append(t.reprieved, pod)
		return nil
	}
	if pod.Spec.NodeName != "" {
		// Bound: its claims are allocated, their devices counted.
		return nil
	}
	t.added = append(t.added, pod)
	return nil
}

// RemovePod implements fwk.PreFilterExtensions: a pod taken off by a trial.
func (pl *TopologyDRA) RemovePod(_ context.Context, cs fwk.CycleState, _ *v1.Pod, podInfoToRemove fwk.PodInfo, _ fwk.NodeInfo) *fwk.Status {
	pod := podInfoToRemove.GetPod()
	if !usesClaims(pod) {
		return nil
	}
	t := trialOf(cs, true)
	t.reprieved = nil
	if i := slices.IndexFunc(t.added, func(p *v1.Pod) bool { return p.UID == pod.UID }); i >= 0 {
		t.added = slices.Delete(t.added, i, i+1)
		return nil
	}
	t.removed[pod.UID] = pod
	t.preempting = true
	return nil
}

// usesClaims reports whether a pod has ResourceClaims or an extended
// resource claim.
func usesClaims(pod *v1.Pod) bool {
	return len(pod.Spec.ResourceClaims) > 0 || pod.Status.ExtendedResourceClaimStatus != nil
}

// trialAllocator returns the cycle's Allocator adjusted to the trial on
// node, and whether it is preemption's trial (its results may use freed
// devices: they are not valid allocations). Where a pod nominated to the
// node does not fit on it even with the devices of pods that are leaving
// counted as free, it names that pod instead: the room it waits for is
// kept, as the scheduler keeps a nominated pod's CPU and memory where
// they exceed what the node has free.
func (pl *TopologyDRA) trialAllocator(ctx context.Context, s *stateData, t *trialData, node *v1.Node) (*allocator.Allocator, bool, *v1.Pod) {
	// The pod's own claims are never freed: a claim that it shares with
	// a victim stays allocated, and its other claims cannot have its
	// devices.
	own := s.claimUIDs()
	leaving := s.leaving(pl)
	var freed sets.Set[structured.DeviceID]
	if t.preempting {
		freed = sets.New[structured.DeviceID]()
		for _, pod := range t.removed {
			for _, name := range claimNames(pod) {
				claim, err := pl.draManager.ResourceClaims().Get(pod.Namespace, name)
				if err != nil || claim.Status.Allocation == nil || own.Has(claim.UID) || !reservedOnlyFor(claim, t.removed) {
					continue
				}
				pl.addTaken(freed, claim.Status.Allocation)
			}
		}
		addAllBut(freed, leaving.gone, own)
	}
	taken := sets.New[structured.DeviceID]()
	a := s.allocator.Adjusted(freed, taken)
	if len(t.added) == 0 {
		return a, t.preempting, nil
	}
	// Nominated pods are placed first, on what is free once the pods that
	// are leaving (preemption's victims, terminating or gone) are gone.
	// Both Allocators look taken up per call, so each pod sees the
	// devices of those before it as allocated.
	nominatedFreed := sets.New[structured.DeviceID]().Union(freed)
	addAllBut(nominatedFreed, leaving.leaving, own)
	nominated := s.allocator.Adjusted(nominatedFreed, taken)
	for _, pod := range t.added {
		claims := pl.unallocatedClaims(pod, own)
		if len(claims) == 0 {
			continue
		}
		res, err := nominated.Allocate(ctx, node, claims)
		if err != nil {
			klog.FromContext(ctx).V(5).Info("Nominated pod's claims cannot be allocated, not keeping room for them", "pod", klog.KObj(pod), "node", klog.KObj(node), "err", err)
			continue
		}
		if res.Allocations == nil {
			return a, t.preempting, pod
		}
		for i := range res.Allocations {
			pl.addTaken(taken, &res.Allocations[i])
		}
	}
	return a, t.preempting, nil
}

// addTaken adds the devices that an allocation takes whole to set.
func (pl *TopologyDRA) addTaken(set sets.Set[structured.DeviceID], allocation *resourceapi.AllocationResult) {
	for _, r := range allocation.Devices.Results {
		if takesDevice(r, pl.features.ConsumableCapacity) {
			set.Insert(structured.MakeDeviceID(r.Driver, r.Pool, r.Device))
		}
	}
}

// claimNames lists the names of a pod's claims that exist: those it names,
// those made from its templates, and its extended resource claim.
func claimNames(pod *v1.Pod) []string {
	var names []string
	for i := range pod.Spec.ResourceClaims {
		name, _, err := resourceclaim.Name(pod, &pod.Spec.ResourceClaims[i])
		if err == nil && name != nil {
			names = append(names, *name)
		}
	}
	if st := pod.Status.ExtendedResourceClaimStatus; st != nil && st.ResourceClaimName != "" {
		names = append(names, st.ResourceClaimName)
	}
	return names
}

// reservedOnlyFor reports whether every consumer of the claim is one of
// pods: then removing them frees it.
func reservedOnlyFor(claim *resourceapi.ResourceClaim, pods map[types.UID]*v1.Pod) bool {
	if len(claim.Status.ReservedFor) == 0 {
		return false
	}
	for _, c := range claim.Status.ReservedFor {
		if c.APIGroup != "" || c.Resource != "pods" {
			return false
		}
		if _, ok := pods[c.UID]; !ok {
			return false
		}
	}
	return true
}

// unallocatedClaims returns the claims of a nominated pod that still need
// an allocation, as the allocator sees them, leaving out those in own (the
// scheduled pod's: it allocates them itself) and those being allocated
// (their devices are counted); nil where the claims cannot be read.
func (pl *TopologyDRA) unallocatedClaims(pod *v1.Pod, own sets.Set[types.UID]) []*resourceapi.ResourceClaim {
	claims, err := pl.podClaims(pod)
	if err != nil {
		return nil
	}
	var out []*resourceapi.ResourceClaim
	for _, claim := range claims {
		if claim.Status.Allocation != nil || own.Has(claim.UID) || pl.draManager.ResourceClaims().GetPendingAllocation(claim.UID) != nil {
			continue
		}
		out = append(out, pl.withOwnedToleration(claim))
	}
	return out
}

// leavingSets are the devices taken whole by allocated claims whose pods
// are leaving, per claim UID: gone, where every pod of the claim no
// longer exists (the claim controller is about to give it back);
// preempted, where every pod of the claim is gone or terminating because
// the scheduler preempted it; and leaving, where every pod of the claim is
// gone or terminating.
type leavingSets struct {
	gone, preempted, leaving map[types.UID]sets.Set[structured.DeviceID]
}

// leaving returns the claims whose pods are leaving, read once per cycle
// (see trialData); empty without a pod lister.
func (s *stateData) leaving(pl *TopologyDRA) leavingSets {
	s.leavingOnce.Do(func() {
		s.leavingSets = leavingSets{
			gone:      map[types.UID]sets.Set[structured.DeviceID]{},
			preempted: map[types.UID]sets.Set[structured.DeviceID]{},
			leaving:   map[types.UID]sets.Set[structured.DeviceID]{},
		}
		if pl.pods == nil {
			return
		}
		claims, err := pl.draManager.ResourceClaims().List()
		if err != nil {
			return
		}
		for _, claim := range claims {
			if claim.Status.Allocation == nil {
				continue
			}
			how := pl.podsLeaving(claim)
			if !how.leaving {
				continue
			}
			devices := sets.New[structured.DeviceID]()
			pl.addTaken(devices, claim.Status.Allocation)
			s.leavingSets.leaving[claim.UID] = devices
			if how.preempted {
				s.leavingSets.preempted[claim.UID] = devices
			}
			if how.gone {
				s.leavingSets.gone[claim.UID] = devices
			}
		}
	})
	return s.leavingSets
}

// addAllBut adds to set the devices of every claim of perClaim but those
// in own.
func addAllBut(set sets.Set[structured.DeviceID], perClaim map[types.UID]sets.Set[structured.DeviceID], own sets.Set[types.UID]) {
	for uid, devices := range perClaim {
		if !own.Has(uid) {
			for id := range devices {
				set.Insert(id)
			}
		}
	}
}

// claimUIDs returns the UIDs of the pod's claims.
func (s *stateData) claimUIDs() sets.Set[types.UID] {
	own := sets.New[types.UID]()
	for _, claim := range s.claims {
		own.Insert(claim.UID)
	}
	return own
}

// claimLeaving says how the pods of an allocated claim are leaving (see
// podsLeaving): each is gone; each is gone or terminating because the
// scheduler preempted it; each is gone or terminating.
type claimLeaving struct {
	gone, preempted, leaving bool
}

// podsLeaving reports how the pods of an allocated claim are leaving. The
// pods of a claim are those it is reserved for, or, reserved for none,
// the pod it was made for; a claim with neither is in use by nobody that
// leaves. A pod terminates because the scheduler preempted it where it
// has a deletion timestamp and a DisruptionTarget condition of reason
// PreemptionByScheduler, as DefaultPreemption tells its victims.
func (pl *TopologyDRA) podsLeaving(claim *resourceapi.ResourceClaim) claimLeaving {
	var refs []metav1.OwnerReference
	for _, c := range claim.Status.ReservedFor {
		if c.APIGroup != "" || c.Resource != "pods" {
			return claimLeaving{}
		}
		refs = append(refs, metav1.OwnerReference{Name: c.Name, UID: c.UID})
	}
	if len(refs) == 0 {
		owner := metav1.GetControllerOf(claim)
		if owner == nil || owner.APIVersion != "v1" || owner.Kind != "Pod" {
			return claimLeaving{}
		}
		refs = append(refs, *owner)
	}
	how := claimLeaving{gone: true, preempted: true, leaving: true}
	for _, ref := range refs {
		pod, err := pl.pods.Pods(claim.Namespace).Get(ref.Name)
		switch {
		case err != nil || pod.UID != ref.UID:
		case pod.DeletionTimestamp != nil:
			how.gone = false
			how.preempted = how.preempted && preemption.PodTerminatingByPreemption(pod)
		default:
			return claimLeaving{}
		}
	}
	return how
}

// mayPreempt reports whether preemption could make room for pod's devices
// on the node: the pod may preempt (canPreempt), and a pod of lower
// priority there holds claims. Each of preemption's tries costs a copy of
// the cycle state and of the node per candidate node, so Filter lets it
// try only there.
func mayPreempt(pod *v1.Pod, nodeInfo fwk.NodeInfo) bool {
	return canPreempt(pod) && lowerHolder(corev1helpers.PodPriority(pod), nodeInfo)
}

// canPreempt reports whether the pod may preempt pods for devices: its
// preemptionPolicy is not Never, and it is not in a scheduling group (the
// group's preemption removes its victims without RemovePod, so its trials
// would free no devices).
func canPreempt(pod *v1.Pod) bool {
	return preemptionAllowed(pod) && pod.Spec.SchedulingGroup == nil
}

// preemptionAllowed reports whether the pod's preemptionPolicy is not
// Never: it, or its scheduling group, may have preempted pods.
func preemptionAllowed(pod *v1.Pod) bool {
	return pod.Spec.PreemptionPolicy == nil || *pod.Spec.PreemptionPolicy != v1.PreemptNever
}

// protected reports whether evicting one of pods would violate a
// PodDisruptionBudget, as DefaultPreemption judges a victim: a budget of
// its namespace selects it (an empty selector selects nothing, and a pod
// without labels is never selected), allows no disruption, and has not
// counted the pod as disrupted already. Budgets that cannot be listed
// say no.
func (pl *TopologyDRA) protected(pods []*v1.Pod) bool {
	if pl.pdbs == nil {
		return false
	}
	for _, pod := range pods {
		if len(pod.Labels) == 0 {
			continue
		}
		pdbs, err := pl.pdbs.PodDisruptionBudgets(pod.Namespace).List(labels.Everything())
		if err != nil {
			continue
		}
		for _, pdb := range pdbs {
			selector, err := metav1.LabelSelectorAsSelector(pdb.Spec.Selector)
			if err != nil || selector.Empty() || !selector.Matches(labels.Set(pod.Labels)) {
				continue
			}
			if _, disrupted := pdb.Status.DisruptedPods[pod.Name]; pdb.Status.DisruptionsAllowed <= 0 && !disrupted {
				return true
			}
		}
	}
	return false
}

// lowerHolder reports whether a pod of priority below prio holds claims
// on the node.
func lowerHolder(prio int32, nodeInfo fwk.NodeInfo) bool {
	for _, pi := range nodeInfo.GetPods() {
		if holdsBelow(prio, pi.GetPod()) {
			return true
		}
	}
	return false
}

// holdsBelow reports whether p is of priority below prio and holds claims:
// a pod that a pod of priority prio may preempt for devices.
func holdsBelow(prio int32, p *v1.Pod) bool {
	return corev1helpers.PodPriority(p) < prio && usesClaims(p)
}

// outranksHolder reports whether the pod may preempt a pod that holds
// claims on one of nodes that admit has. It stops at the first such pod;
// where there is none it looks at every pod of those nodes.
func outranksHolder(pod *v1.Pod, nodes []fwk.NodeInfo, admit sets.Set[string]) bool {
	if !canPreempt(pod) {
		return false
	}
	prio := corev1helpers.PodPriority(pod)
	for _, n := range nodes {
		if node := n.Node(); node != nil && admit.Has(node.Name) && lowerHolder(prio, n) {
			return true
		}
	}
	return false
}
