package topologydra

import (
	"sync"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/tools/cache"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/topodra/topodra/pkg/allocator"
)

// pendingIndex holds the pending pods with claims, by scheduler name, fed
// by the scheduler's pod informer: PreScore asks it how many pods that
// need a whole node wait, at a cost that grows with the pending pods of
// one scheduler, not with the cluster. A pod is pending while it is not
// bound, not being deleted and not held back by scheduling gates (a queue
// manager may hold a pod for days). Safe for concurrent use.
type pendingIndex struct {
	mu sync.Mutex
	// pods maps scheduler name, then pod UID, to the pod's entry.
	pods map[string]map[types.UID]*pendingPod
	// taintOps is the TaintTolerationComparisonOperators feature, for
	// matching tolerations (see podMayUseNode); set before use.
	taintOps bool
	// wholeNode is how many devices of one class make a whole node
	// (wholeNodeDevices); newPendingIndex sets allocator.WholeNodeBlock.
	wholeNode int
	// profile, where set, is the only scheduler name whose pods the
	// index keeps: the others are never asked about.
	profile string
}

// pendingPod is an index entry.
type pendingPod struct {
	pod *v1.Pod
	// devices is the most devices of one class that the pod's claims ask
	// for, allocated or not (podDevices), once every claim was found in
	// the claim cache; -1 until then. Claim specs do not change, so a known
	// count stays valid.
	devices int
	// unfit names the nodes on which the pod's requests match fewer
	// devices of every driver than it needs, as its latest PreFilter
	// found them among the nodes it could use then (setUnfit): it cannot
	// run there however many devices are free. Nodes it did not look at
	// (cordoned or tainted then) are judged when asked. Shared with other
	// pods (nodeSets.intern): never changed.
	unfit sets.Set[string]
	// invalid is set where the pod's latest attempt found one of its
	// claims invalid (a missing device class, a selector that does not
	// compile or fails at run time, a bad annotation, more devices than
	// an allocation may hold): it cannot run anywhere until the claim or
	// class is fixed, and no node drains for it. The next attempt that
	// finds its claims valid clears it (setInvalid).
	invalid bool
}

func newPendingIndex() *pendingIndex {
	return &pendingIndex{pods: map[string]map[types.UID]*pendingPod{}, wholeNode: allocator.WholeNodeBlock}
}

// handler is the pod informer's event handler that keeps the index.
func (ix *pendingIndex) handler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { ix.update(obj) },
		UpdateFunc: func(oldObj, obj any) {
			if old, ok := replacedPod(oldObj, obj); ok {
				ix.remove(old)
			}
			ix.update(obj)
		},
		DeleteFunc: func(obj any) {
			if pod, ok := deletedPod(obj); ok {
				ix.remove(pod)
			}
		},
	}
}

// replacedPod returns the old pod of an informer's update event where the
// new object is another pod of the same name (a different UID): a pod
// deleted and created again while the informer listed anew comes as an
// update, and the old pod's state must go as on its deletion.
func replacedPod(oldObj, newObj any) (*v1.Pod, bool) {
	old, ok1 := oldObj.(*v1.Pod)
	pod, ok2 := newObj.(*v1.Pod)
	if !ok1 || !ok2 || old.UID == pod.UID {
		return nil, false
	}
	return old, true
}

// deletedPod is the pod of a pod informer's delete event, whether it
// comes as the pod or as a tombstone.
func deletedPod(obj any) (*v1.Pod, bool) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	pod, ok := obj.(*v1.Pod)
	return pod, ok
}

func (ix *pendingIndex) update(obj any) {
	pod, ok := obj.(*v1.Pod)
	if !ok {
		return
	}
	if ix.profile != "" && pod.Spec.SchedulerName != ix.profile {
		return
	}
	if pod.Spec.NodeName != "" || pod.DeletionTimestamp != nil || len(pod.Spec.ResourceClaims) == 0 || len(pod.Spec.SchedulingGates) > 0 {
		ix.remove(pod)
		return
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	bySched := ix.pods[pod.Spec.SchedulerName]
	if bySched == nil {
		bySched = map[types.UID]*pendingPod{}
		ix.pods[pod.Spec.SchedulerName] = bySched
	}
	if e := bySched[pod.UID]; e != nil {
		// The claims' names may have arrived in the pod's status, and a
		// gated pod's node affinity may have changed.
		e.pod = pod
		return
	}
	bySched[pod.UID] = &pendingPod{pod: pod, devices: -1}
}

// setUnfit records for a pending pod the nodes on which it cannot run
// (unfitNodes); nil forgets them.
func (ix *pendingIndex) setUnfit(pod *v1.Pod, nodes sets.Set[string]) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if e := ix.pods[pod.Spec.SchedulerName][pod.UID]; e != nil {
		e.unfit = nodes
	}
}

// setInvalid records whether the pod's latest attempt found one of its
// claims invalid (pendingPod.invalid).
func (ix *pendingIndex) setInvalid(pod *v1.Pod, invalid bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if e := ix.pods[pod.Spec.SchedulerName][pod.UID]; e != nil {
		e.invalid = invalid
	}
}

// unfitNodes names the nodes of examined on which no driver has need or
// more devices that the pod's requests match (byNode, from
// allocator.CountDevices over examined).
func unfitNodes(examined sets.Set[string], byNode map[string]map[string]allocator.DeviceCount, need int) sets.Set[string] {
	out := sets.New[string]()
	for node := range examined {
		fits := false
		for _, c := range byNode[node] {
			if c.Matching >= need {
				fits = true
				break
			}
		}
		if !fits {
			out.Insert(node)
		}
	}
	return out
}

func (ix *pendingIndex) remove(pod *v1.Pod) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if bySched := ix.pods[pod.Spec.SchedulerName]; bySched != nil {
		delete(bySched, pod.UID)
		if len(bySched) == 0 {
			delete(ix.pods, pod.Spec.SchedulerName)
		}
	}
}

// wholeNodePods counts the pending pods of pod's scheduler, other than pod,
// whose claims that are not allocated yet ask for a whole node's devices
// (wholeNode) or more of one device class (podDevices) and that may use at
// least one of nodes (podMayUseNode) on which, where their latest
// PreFilter found it out, their requests match as many devices as they
// need (not pendingPod.unfit): a pod pinned elsewhere, or one that asks for
// a GPU model these nodes do not have, waits for other nodes. A pod whose
// latest attempt found a claim invalid (pendingPod.invalid) waits for
// nothing here. admitted
// holds the names of the nodes of nodes that at least one of them may use. claims
// looks claims up (the scheduler's claim cache); a claim it does not know
// yet counts as nothing.
func (ix *pendingIndex) wholeNodePods(pod *v1.Pod, claims claimGetter, nodes []fwk.NodeInfo) (n int, admitted sets.Set[string]) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	admitted = sets.New[string]()
	for uid, e := range ix.pods[pod.Spec.SchedulerName] {
		if uid == pod.UID || e.invalid {
			continue
		}
		if e.devices < 0 {
			if total, ok := podDevices(e.pod, claims, false); ok {
				e.devices = total
			}
		}
		if e.devices >= 0 && e.devices < ix.wholeNode {
			continue
		}
		// Few pods ask for whole nodes: only theirs are looked up again,
		// to leave out claims allocated in the meantime.
		if unallocated, _ := podDevices(e.pod, claims, true); unallocated >= ix.wholeNode && admitNodes(e.pod, nodes, admitted, ix.taintOps, e.unfit) {
			n++
		}
	}
	return n, admitted
}

// admitNodes adds to admitted the names of the nodes that the pod may use
// (podMayUseNode) and that are not in except, and reports whether there
// was one. Once it found one, it judges only the nodes not admitted yet:
// the pods that wait for whole nodes mostly may use the same ones, and
// PreScore asks about each of them on every attempt.
func admitNodes(pod *v1.Pod, nodes []fwk.NodeInfo, admitted sets.Set[string], taintOps bool, except sets.Set[string]) bool {
	affinity := nodeaffinity.GetRequiredNodeAffinity(pod)
	logger := klog.Background()
	found := false
	for _, node := range nodes {
		if found && admitted.Len() == len(nodes) {
			break
		}
		name := node.Node().Name
		if except.Has(name) || found && admitted.Has(name) {
			continue
		}
		if podMayUseNode(logger, pod, affinity, node.Node(), taintOps) {
			admitted.Insert(name)
			found = true
		}
	}
	return found
}

// claimGetter looks up a claim by namespace and name.
type claimGetter func(namespace, name string) (*resourceapi.ResourceClaim, error)

// podDevices returns the most devices of one device class that the pod's
// claims ask for together (with unallocatedOnly: its claims that are not
// allocated), and reports whether every claim was found. A pod that asks
// for one GPU and one NIC asks for one device of each class: as a pod that
// asks for one GPU, it takes one of the node's GPUs, not two; two claims
// for four GPUs each ask for eight.
func podDevices(pod *v1.Pod, claims claimGetter, unallocatedOnly bool) (int, bool) {
	var buf [4]classDevices
	counts, all := buf[:0], true
	for i := range pod.Spec.ResourceClaims {
		name, _, err := resourceclaim.Name(pod, &pod.Spec.ResourceClaims[i])
		if err != nil || name == nil {
			all = all && err == nil
			continue
		}
		claim, err := claims(pod.Namespace, *name)
		if err != nil {
			all = false
			continue
		}
		if unallocatedOnly && claim.Status.Allocation != nil {
			continue
		}
		counts = addClaimDevices(counts, claim)
	}
	return mostOfOneClass(counts), all
}

// classDevices is a number of devices of one device class.
type classDevices struct {
	class string
	n     int
}

// addClaimDevices adds the devices a claim asks for to counts, per device
// class: exact counts, and the first subrequest of a firstAvailable
// request; requests for all matching devices count as none.
func addClaimDevices(counts []classDevices, claim *resourceapi.ResourceClaim) []classDevices {
	for _, r := range claim.Spec.Devices.Requests {
		var class string
		var n int
		switch {
		case r.Exactly != nil && r.Exactly.AllocationMode != resourceapi.DeviceAllocationModeAll:
			class, n = r.Exactly.DeviceClassName, int(r.Exactly.Count)
		case len(r.FirstAvailable) > 0 && r.FirstAvailable[0].AllocationMode != resourceapi.DeviceAllocationModeAll:
			class, n = r.FirstAvailable[0].DeviceClassName, int(r.FirstAvailable[0].Count)
		default:
			continue
		}
		found := false
		for k := range counts {
			if counts[k].class == class {
				counts[k].n += n
				found = true
				break
			}
		}
		if !found {
			counts = append(counts, classDevices{class: class, n: n})
		}
	}
	return counts
}

// mostOfOneClass is the largest count in counts (0 if none).
func mostOfOneClass(counts []classDevices) int {
	most := 0
	for _, c := range counts {
		most = max(most, c.n)
	}
	return most
}
