package topologydra

import (
	"context"
	"slices"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/client-go/tools/cache"
	corev1helpers "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/topodra/topodra/pkg/topology"
)

// EventsToRegister lists the cluster events that can make a pod that this
// plugin rejected schedulable, with hints that filter out the many events
// that cannot.
func (pl *TopologyDRA) EventsToRegister(context.Context) ([]fwk.ClusterEventWithHint, error) {
	return []fwk.ClusterEventWithHint{
		// Node labels feed allocation node selectors and slice node
		// selectors; labels, taints and cordons decide which nodes keep a
		// headroom for the pod (podMayUseNode); a declared feature lets a
		// node use devices that skip node operations.
		{Event: fwk.ClusterEvent{Resource: fwk.Node, ActionType: fwk.Add | fwk.UpdateNodeLabel | fwk.UpdateNodeAllocatable | fwk.UpdateNodeTaint | fwk.UpdateNodeDeclaredFeature}, QueueingHintFn: pl.isSchedulableAfterNodeChange},
		// Claims: the pod's own claim created or changed, or devices freed.
		{Event: fwk.ClusterEvent{Resource: fwk.ResourceClaim, ActionType: fwk.Add | fwk.Update | fwk.Delete}, QueueingHintFn: pl.isSchedulableAfterClaimChange},
		// The claim controller names generated claims in the pod status.
		{Event: fwk.ClusterEvent{Resource: fwk.TargetPod, ActionType: fwk.UpdatePodGeneratedResourceClaim}, QueueingHintFn: pl.isSchedulableAfterPodUpdate},
		// A missing or broken class may be created or fixed.
		{Event: fwk.ClusterEvent{Resource: fwk.DeviceClass, ActionType: fwk.Add | fwk.Update}},
		// New or changed slices bring devices.
		{Event: fwk.ClusterEvent{Resource: fwk.ResourceSlice, ActionType: fwk.Add | fwk.Update}, QueueingHintFn: pl.isSchedulableAfterSliceChange},
		// A pod that fails its binding cycle is reported as an assigned
		// pod deleted: the devices its in-flight allocation held are free
		// again, with no claim event where nothing reached the API.
		{Event: fwk.ClusterEvent{Resource: fwk.AssignedPod, ActionType: fwk.Delete}, QueueingHintFn: pl.isSchedulableAfterAssignedPodDelete},
		// A pod of lower priority that holds claims bound to a node: a
		// pod the headroom held back may preempt it now.
		{Event: fwk.ClusterEvent{Resource: fwk.AssignedPod, ActionType: fwk.Add}, QueueingHintFn: pl.isSchedulableAfterAssignedPodAdd},
		// Nodes and slices that go away lower the headroom kept for the
		// pods it held back.
		{Event: fwk.ClusterEvent{Resource: fwk.Node, ActionType: fwk.Delete}, QueueingHintFn: pl.isSchedulableAfterRemoval},
		{Event: fwk.ClusterEvent{Resource: fwk.ResourceSlice, ActionType: fwk.Delete}, QueueingHintFn: pl.isSchedulableAfterRemoval},
	}, nil
}

// isSchedulableAfterAssignedPodDelete: requeue when the pod is one whose
// in-flight allocation Unreserve just dropped (a binding failure), in
// this profile (released) or in another profile of the scheduler, which
// shares the claims in flight but not this plugin's state: there, a pod
// that may hold devices (claims, or extended resources that a DRA driver
// may back) and still exists unbound failed its binding cycle. A pod
// really deleted gives its devices back through claim events, which have
// hints of their own, except to a preemptor: a pod nominated to the
// deleted pod's node is requeued too. While its preemption runs, the
// scheduling queue looks only at pod deletions for it (DefaultPreemption's
// PreEnqueue gates it), so claim events that come before the preemption
// ends do not requeue it; its next attempt waits for the victims'
// devices where they are not given back yet (see PostFilter), and claim
// events requeue it from then on. The scheduler also sends this event
// with the old object of a pending pod that was nominated to a node and
// is deleted, or whose nomination moves or is cleared (to pods of the same
// or lower priority, as the pods kept off the node for it are): Filter
// kept devices there for such a pod where it holds claims
// (trialAllocator), so it requeues the pod.
func (pl *TopologyDRA) isSchedulableAfterAssignedPodDelete(logger klog.Logger, pod *v1.Pod, oldObj, newObj any) (fwk.QueueingHint, error) {
	if tomb, ok := oldObj.(cache.DeletedFinalStateUnknown); ok {
		oldObj = tomb.Obj
	}
	gone, ok := oldObj.(*v1.Pod)
	if !ok {
		return fwk.QueueSkip, nil
	}
	if pl.released.has(gone.UID) {
		return fwk.Queue, nil
	}
	if gone.Spec.NodeName == "" && gone.Status.NominatedNodeName != "" && usesClaims(gone) {
		logger.V(5).Info("Pod nominated to a node deleted or nominated elsewhere: the devices kept for it there are free for others", "pod", klog.KObj(pod), "nominated", klog.KObj(gone), "node", gone.Status.NominatedNodeName)
		return fwk.Queue, nil
	}
	if nominated := pod.Status.NominatedNodeName; nominated != "" && gone.Spec.NodeName == nominated && mayHoldDevices(gone) {
		logger.V(5).Info("Pod on the node the pod is nominated to deleted: requeued", "pod", klog.KObj(pod), "deleted", klog.KObj(gone))
		return fwk.Queue, nil
	}
	if pl.pods != nil && mayHoldDevices(gone) && pl.podDeleteMemo.get(gone, gone, func() bool {
		now, err := pl.pods.Pods(gone.Namespace).Get(gone.Name)
		return err == nil && now.UID == gone.UID && now.Spec.NodeName == "" && now.DeletionTimestamp == nil
	}) {
		logger.V(5).Info("Pod failed its binding cycle in another profile; its devices in flight are free again", "pod", klog.KObj(pod), "failed", klog.KObj(gone))
		return fwk.Queue, nil
	}
	return fwk.QueueSkip, nil
}

// mayHoldDevices reports whether pod may have devices allocated for it:
// it has claims, or requests extended resources, which a DeviceClass may
// back.
func mayHoldDevices(pod *v1.Pod) bool {
	if len(pod.Spec.ResourceClaims) > 0 {
		return true
	}
	for _, containers := range [][]v1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for _, c := range containers {
			for name := range c.Resources.Requests {
				if isDRAExtendedName(name) {
					return true
				}
			}
		}
	}
	return false
}

// isSchedulableAfterRemoval: a node or slice that goes away brings no
// devices, but it lowers the headroom (a share of the cluster's devices),
// so the pods the headroom held back may fit now.
func (pl *TopologyDRA) isSchedulableAfterRemoval(logger klog.Logger, pod *v1.Pod, oldObj, newObj any) (fwk.QueueingHint, error) {
	if pl.heldBack.held(pod.UID) {
		return fwk.Queue, nil
	}
	return fwk.QueueSkip, nil
}

// isSchedulableAfterClaimChange: requeue when one of the pod's claims
// appears or its status changes, or when a claim gives devices back
// (deallocated or deleted while allocated) and they may let the pod fit
// (hintForFreed).
func (pl *TopologyDRA) isSchedulableAfterClaimChange(logger klog.Logger, pod *v1.Pod, oldObj, newObj any) (fwk.QueueingHint, error) {
	if _, ok := oldObj.(cache.DeletedFinalStateUnknown); ok && newObj == nil {
		return fwk.Queue, nil
	}
	oldClaim, _ := oldObj.(*resourceapi.ResourceClaim)
	newClaim, _ := newObj.(*resourceapi.ResourceClaim)
	if newClaim == nil {
		if oldClaim != nil && oldClaim.Status.Allocation != nil {
			return pl.hintForFreed(logger, pod, oldClaim), nil
		}
		return fwk.QueueSkip, nil
	}
	if oldClaim != nil && oldClaim.Status.Allocation != nil && newClaim.Status.Allocation == nil {
		return pl.hintForFreed(logger, pod, oldClaim), nil
	}
	if !pl.usesClaim(pod, newClaim) {
		return fwk.QueueSkip, nil
	}
	if oldClaim == nil || !apiequality.Semantic.DeepEqual(&oldClaim.Status, &newClaim.Status) || topodraAnnotationsChanged(oldClaim, newClaim) {
		return fwk.Queue, nil
	}
	return fwk.QueueSkip, nil
}

// isSchedulableAfterNodeChange: a new node, or new labels or allocatable
// resources, may make any pod schedulable. A cordon or taint lifted so
// that the pod may now use the node (podMayUseNode) requeues it: devices
// given back there while the node was out of its reach did not
// (freedEnough), and the plugins that reject a pod for a cordon or taint
// were not asked where the node was cordoned after the pod's latest
// attempt. Any other cordon or taint change only changes which nodes keep
// a headroom for a pod: it requeues only the pods the headroom held back,
// so that the many taint changes of a large cluster do not renew every
// waiting pod's backoff.
func (pl *TopologyDRA) isSchedulableAfterNodeChange(logger klog.Logger, pod *v1.Pod, oldObj, newObj any) (fwk.QueueingHint, error) {
	oldNode, _ := oldObj.(*v1.Node)
	newNode, _ := newObj.(*v1.Node)
	if oldNode == nil || newNode == nil {
		return fwk.Queue, nil
	}
	if pl.nodeEventMemo.get(oldNode, newNode, func() bool {
		return !apiequality.Semantic.DeepEqual(oldNode.Labels, newNode.Labels) || !apiequality.Semantic.DeepEqual(oldNode.Status.Allocatable, newNode.Status.Allocatable) ||
			!slices.Equal(oldNode.Status.DeclaredFeatures, newNode.Status.DeclaredFeatures)
	}) {
		return fwk.Queue, nil
	}
	if pl.heldBack.held(pod.UID) {
		return fwk.Queue, nil
	}
	affinity := nodeaffinity.GetRequiredNodeAffinity(pod)
	if !podMayUseNode(logger, pod, affinity, oldNode, pl.taintOps) && podMayUseNode(logger, pod, affinity, newNode, pl.taintOps) {
		logger.V(5).Info("Node cordon or taint lifted for the pod", "pod", klog.KObj(pod), "node", klog.KObj(newNode))
		return fwk.Queue, nil
	}
	logger.V(6).Info("Node taints or cordon changed; the pod was not held back by the headroom", "pod", klog.KObj(pod), "node", klog.KObj(newNode))
	return fwk.QueueSkip, nil
}

// isSchedulableAfterAssignedPodAdd: requeue a pod that the headroom held
// back at its latest attempt because it could preempt no pod holding
// claims then (see PreFilter and outranksHolder), when a pod of lower
// priority that holds claims is bound to a node the pod may use (its node
// affinity, taints and cordon): the headroom no longer holds it back, so
// its next attempt may preempt. The bound pod is in the scheduler's cache
// when this event comes, whichever scheduler placed it, as PreFilter's
// look for a lower holder needs. Any other pod's binding is skipped after
// one lookup of the pod's record.
func (pl *TopologyDRA) isSchedulableAfterAssignedPodAdd(logger klog.Logger, pod *v1.Pod, oldObj, newObj any) (fwk.QueueingHint, error) {
	if !pl.heldBack.held(pod.UID) || pl.heldBack.outranks(pod.UID) || !canPreempt(pod) {
		return fwk.QueueSkip, nil
	}
	holder, ok := newObj.(*v1.Pod)
	if !ok || holder.Spec.NodeName == "" || !holdsBelow(corev1helpers.PodPriority(pod), holder) {
		return fwk.QueueSkip, nil
	}
	if !pl.mayUse(logger, pod, nodeaffinity.GetRequiredNodeAffinity(pod), holder.Spec.NodeName) {
		return fwk.QueueSkip, nil
	}
	logger.V(5).Info("Pod of lower priority with claims bound, which the pod held back by the headroom may preempt", "pod", klog.KObj(pod), "holder", klog.KObj(holder), "node", holder.Spec.NodeName)
	return fwk.Queue, nil
}

// topodraAnnotationsChanged reports whether the annotations through which
// a claim asks for an alignment differ: an invalid value fixed with
// `kubectl annotate` makes the pod schedulable.
func topodraAnnotationsChanged(oldClaim, newClaim *resourceapi.ResourceClaim) bool {
	for _, key := range []string{topology.AnnotationAlignment, topology.AnnotationAlignWith} {
		o, oldOK := oldClaim.Annotations[key]
		n, newOK := newClaim.Annotations[key]
		if o != n || oldOK != newOK {
			return true
		}
	}
	return false
}

// hintForFreed: devices given back by another pod's claim help pod only
// where they leave enough free devices together (see freedEnough); a
// change of the pod's own claim always requeues it.
func (pl *TopologyDRA) hintForFreed(logger klog.Logger, pod *v1.Pod, claim *resourceapi.ResourceClaim) fwk.QueueingHint {
	if pl.usesClaim(pod, claim) || pl.freedEnough(logger, pod, claim) {
		return fwk.Queue
	}
	logger.V(6).Info("Devices given back leave too few free for the pod", "pod", klog.KObj(pod), "claim", klog.KObj(claim))
	return fwk.QueueSkip
}

func (pl *TopologyDRA) usesClaim(pod *v1.Pod, claim *resourceapi.ResourceClaim) bool {
	if claim.Namespace != pod.Namespace {
		return false
	}
	for i := range pod.Spec.ResourceClaims {
		name, _, err := resourceclaim.Name(pod, &pod.Spec.ResourceClaims[i])
		if err == nil && name != nil && *name == claim.Name {
			return true
		}
	}
	return false
}

// isSchedulableAfterPodUpdate: requeue once all of the pod's claims exist.
func (pl *TopologyDRA) isSchedulableAfterPodUpdate(logger klog.Logger, pod *v1.Pod, oldObj, newObj any) (fwk.QueueingHint, error) {
	modified, ok := newObj.(*v1.Pod)
	if !ok {
		return fwk.Queue, nil
	}
	if _, err := pl.podClaims(modified); err != nil {
		return fwk.QueueSkip, nil
	}
	return fwk.Queue, nil
}

// isSchedulableAfterSliceChange: a slice update that only touches metadata
// (e.g. a resync by the driver) brings no devices.
func (pl *TopologyDRA) isSchedulableAfterSliceChange(logger klog.Logger, pod *v1.Pod, oldObj, newObj any) (fwk.QueueingHint, error) {
	oldSlice, _ := oldObj.(*resourceapi.ResourceSlice)
	newSlice, _ := newObj.(*resourceapi.ResourceSlice)
	if oldSlice != nil && newSlice != nil && pl.sliceEventMemo.get(oldSlice, newSlice, func() bool {
		return apiequality.Semantic.DeepEqual(&oldSlice.Spec, &newSlice.Spec)
	}) {
		return fwk.QueueSkip, nil
	}
	return fwk.Queue, nil
}
