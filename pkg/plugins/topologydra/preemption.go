package topologydra

import (
	"context"
	"maps"
	"slices"
	"sync"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/tools/cache"
	corev1helpers "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

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
//     consumer of the claim is removed too. In preemption's trials, also
//     after every victim was given back, so do the claims whose
//     consumers are all gone from the API but which are not deallocated
//     yet (see releasedDevices): the victims of an earlier preemption,
//     whose devices the claim controller is about to give back. Without
//     them, the preemptor's next attempt, after the victims are gone and
//     before their devices are, would evict more pods.
//   - An added pod that is not bound takes the devices that its claims not
//     yet allocated would get on the node first.
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
}

// Clone implements fwk.StateData: each copy of the cycle state is a trial
// of its own.
func (t *trialData) Clone() fwk.StateData {
	return &trialData{removed: maps.Clone(t.removed), added: slices.Clone(t.added), preempting: t.preempting}
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
// devices: they are not valid allocations).
func (pl *TopologyDRA) trialAllocator(ctx context.Context, s *stateData, t *trialData, node *v1.Node) (*allocator.Allocator, bool) {
	var freed sets.Set[structured.DeviceID]
	if t.preempting {
		freed = sets.New[structured.DeviceID]()
		for _, pod := range t.removed {
			for _, name := range claimNames(pod) {
				claim, err := pl.draManager.ResourceClaims().Get(pod.Namespace, name)
				if err != nil || claim.Status.Allocation == nil || !reservedOnlyFor(claim, t.removed) {
					continue
				}
				pl.addTaken(freed, claim.Status.Allocation)
			}
		}
		freed = freed.Union(s.releasedDevices(pl))
	}
	taken := sets.New[structured.DeviceID]()
	a := s.allocator.Adjusted(freed, taken)
	own := sets.New[types.UID]()
	for _, claim := range s.claims {
		own.Insert(claim.UID)
	}
	for _, pod := range t.added {
		claims := pl.unallocatedClaims(pod, own)
		if len(claims) == 0 {
			continue
		}
		// The adjusted Allocator looks taken up per call, so each added
		// pod sees the devices of those before it as allocated.
		res, err := a.Allocate(ctx, node, claims)
		if err != nil || res.Allocations == nil {
			klog.FromContext(ctx).V(5).Info("Nominated pod's claims do not fit the node in this trial", "pod", klog.KObj(pod), "node", klog.KObj(node), "err", err)
			continue
		}
		for i := range res.Allocations {
			pl.addTaken(taken, &res.Allocations[i])
		}
	}
	return a, freed != nil
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

// releasedDevices returns the devices taken whole by allocated claims that
// no pod uses any more, read once per cycle (see trialData).
func (s *stateData) releasedDevices(pl *TopologyDRA) sets.Set[structured.DeviceID] {
	s.releasedOnce.Do(func() {
		s.released = sets.New[structured.DeviceID]()
		if pl.pods == nil {
			return
		}
		claims, err := pl.draManager.ResourceClaims().List()
		if err != nil {
			return
		}
		for _, claim := range claims {
			if claim.Status.Allocation != nil && pl.unused(claim) {
				pl.addTaken(s.released, claim.Status.Allocation)
			}
		}
	})
	return s.released
}

// unused reports whether an allocated claim waits only to be
// deallocated or deleted by the claim controller: it is reserved only for
// pods that no longer exist, or for no pod while the pod it was made for
// no longer exists.
func (pl *TopologyDRA) unused(claim *resourceapi.ResourceClaim) bool {
	gone := func(name string, uid types.UID) bool {
		pod, err := pl.pods.Pods(claim.Namespace).Get(name)
		return err != nil || pod.UID != uid
	}
	for _, c := range claim.Status.ReservedFor {
		if c.APIGroup != "" || c.Resource != "pods" || !gone(c.Name, c.UID) {
			return false
		}
	}
	if len(claim.Status.ReservedFor) > 0 {
		return true
	}
	owner := metav1.GetControllerOf(claim)
	return owner != nil && owner.APIVersion == "v1" && owner.Kind == "Pod" && gone(owner.Name, owner.UID)
}

// claimPriorities counts the bound pods with claims per priority.
// Preemption finds victims for a pod only among pods of lower priority,
// and each of its tries costs a copy of the cycle state and of the node
// per candidate node: Filter lets it try only for a pod that such a pod
// could make room for (see mayPreempt).
type claimPriorities struct {
	mu    sync.Mutex
	pods  map[types.UID]int32
	count map[int32]int
}

func newClaimPriorities() *claimPriorities {
	return &claimPriorities{pods: map[types.UID]int32{}, count: map[int32]int{}}
}

// set records pod, or forgets it where it is not bound, is done or has no
// claims (deleted: forget).
func (c *claimPriorities) set(pod *v1.Pod, deleted bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.pods[pod.UID]; ok {
		delete(c.pods, pod.UID)
		if c.count[old]--; c.count[old] == 0 {
			delete(c.count, old)
		}
	}
	if deleted || pod.Spec.NodeName == "" || !usesClaims(pod) || pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed {
		return
	}
	prio := corev1helpers.PodPriority(pod)
	c.pods[pod.UID] = prio
	c.count[prio]++
}

// lowerThan reports whether a bound pod with claims has a priority lower
// than prio; true for a nil tracker (no informer: let preemption try).
func (c *claimPriorities) lowerThan(prio int32) bool {
	if c == nil {
		return true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for p := range c.count {
		if p < prio {
			return true
		}
	}
	return false
}

func (c *claimPriorities) handler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { c.update(obj, false) },
		UpdateFunc: func(_, obj any) { c.update(obj, false) },
		DeleteFunc: func(obj any) { c.update(obj, true) },
	}
}

func (c *claimPriorities) update(obj any, deleted bool) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	if pod, ok := obj.(*v1.Pod); ok {
		c.set(pod, deleted)
	}
}

// mayPreempt reports whether preemption could make room for pod's
// devices: it may preempt, and a pod of lower priority holds claims.
func (pl *TopologyDRA) mayPreempt(pod *v1.Pod) bool {
	if pod.Spec.PreemptionPolicy != nil && *pod.Spec.PreemptionPolicy == v1.PreemptNever {
		return false
	}
	return pl.priorities.lowerThan(corev1helpers.PodPriority(pod))
}
