package topologydra

import (
	"fmt"
	"sync"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	v1helper "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/topodra/topodra/pkg/allocator"
)

// wholeNode is how many devices of one class make a whole node
// (allocator.Policy.WholeNode, from the wholeNodeDevices arg; its default
// where the policy has none).
func (pl *TopologyDRA) wholeNode() int {
	return pl.policy.WholeNodeSize()
}

// halfNode is the smallest allocation, in devices of one driver, that
// leaves a headroom: half a whole node, rounded up (of a node of five,
// three).
func (pl *TopologyDRA) halfNode() int { return (pl.wholeNode() + 1) / 2 }

// driverDevices counts one driver's node-local devices on the nodes a pod
// may use: all of them, the free ones, and the free ones on nodes with at
// least SpareOnNode free (see Spare).
type driverDevices struct{ total, free, spare int }

// SpareOnNode is the fewest free devices of one driver on a node for them
// to count towards the headroom: a single free device can serve only a
// 1-device pod, so single devices left free on many nodes are no room for
// the 2-device pods the headroom is kept for.
const SpareOnNode = 2

// Spare is how many of free devices of one driver on one node count
// towards the headroom: all of them from SpareOnNode, else none.
func Spare(free int) int {
	if free >= SpareOnNode {
		return free
	}
	return 0
}

// headroomOf is the headroom of the nodes in byNode (from
// allocator.CountDevices over the nodes the pod may use), per driver:
// their node-local devices or, with matching, those that the pod's
// requests match (the headroom of a pod that asks for one GPU model among
// several that one driver publishes is kept among the GPUs of that model);
// all of them, the free ones, and those free on nodes with SpareOnNode or
// more. local holds the node-local pools (localPools).
func headroomOf(byNode map[string]map[string]allocator.DeviceCount, matching bool, local sets.Set[poolKey]) headroom {
	out := headroom{drivers: map[string]driverDevices{}, free: map[deviceGroup]int{}, matched: matching, local: local}
	for node, counts := range byNode {
		for driver, n := range counts {
			total, free := n.Devices, n.Free
			if matching {
				total, free = n.Matching, n.MatchingFree
			}
			if total == 0 {
				continue
			}
			c := out.drivers[driver]
			c.total += total
			c.free += free
			c.spare += Spare(free)
			out.drivers[driver] = c
			out.free[deviceGroup{node: node, driver: driver}] = free
		}
	}
	return out
}

// localPools names the pools of slices that are local to a node.
func localPools(slices []*resourceapi.ResourceSlice) sets.Set[poolKey] {
	out := sets.New[poolKey]()
	for _, s := range slices {
		if s.Spec.NodeName != nil {
			out.Insert(poolKey{driver: s.Spec.Driver, pool: s.Spec.Pool.Name})
		}
	}
	return out
}

// fewerThan reports whether h counts fewer devices than all for some
// driver that h counts.
func (h headroom) fewerThan(all headroom) bool {
	for driver, c := range h.drivers {
		if c.total < all.drivers[driver].total {
			return true
		}
	}
	return false
}

// headroom is what Filter checks an allocation against: per driver, the
// devices of the nodes the pod may use (driverDevices), and the free ones
// per node and driver.
type headroom struct {
	drivers map[string]driverDevices
	free    map[deviceGroup]int
	// matched: the counts are of the devices the pod's requests match,
	// not all of each driver's (headroomOf).
	matched bool
	// local holds the node-local pools: an allocation's devices of other
	// pools (network-attached) take nothing the headroom counts.
	local sets.Set[poolKey]
}

// spareAfter is how many devices of driver would count towards the
// headroom (see Spare) after an allocation that takes n of them on node.
func (h headroom) spareAfter(driver, node string, n int) int {
	g := deviceGroup{node: node, driver: driver}
	f := h.free[g]
	return h.drivers[driver].spare - Spare(f) + Spare(f-n)
}

// admittedNodes names the nodes that the pod may use (see podMayUseNode): the
// part of the cluster whose headroom the pod keeps (other pods may run
// elsewhere). taintOps is the TaintTolerationComparisonOperators feature.
func admittedNodes(pod *v1.Pod, nodes []fwk.NodeInfo, taintOps bool) sets.Set[string] {
	out := sets.New[string]()
	admitNodes(pod, nodes, out, taintOps, nil)
	return out
}

// podMayUseNode reports whether the node passes what the scheduler's
// NodeAffinity, NodeUnschedulable and TaintToleration filters check of the
// pod: its required node selector and affinity, a cordon, and taints with
// the effects NoSchedule and NoExecute that it does not tolerate. A node
// that fails any of them cannot take the pod however many devices it has
// free, so its devices neither keep a headroom for it nor drain for it.
func podMayUseNode(logger klog.Logger, pod *v1.Pod, affinity nodeaffinity.RequiredNodeAffinity, node *v1.Node, taintOps bool) bool {
	if ok, err := affinity.Match(node); !ok || err != nil {
		return false
	}
	if node.Spec.Unschedulable && !v1helper.TolerationsTolerateTaint(logger, pod.Spec.Tolerations,
		&v1.Taint{Key: v1.TaintNodeUnschedulable, Effect: v1.TaintEffectNoSchedule}, taintOps) {
		return false
	}
	_, untolerated := v1helper.FindMatchingUntoleratedTaint(logger, node.Spec.Taints, pod.Spec.Tolerations, func(t *v1.Taint) bool {
		return t.Effect == v1.TaintEffectNoSchedule || t.Effect == v1.TaintEffectNoExecute
	}, taintOps)
	return !untolerated
}

// HeadroomFor is how many of total devices of one driver must stay free
// after an allocation that takes n of them, where whole devices make a
// whole node (wholeNodeDevices). The full headroom is percent of total,
// rounded up; an allocation of whole or more leaves all of it, one of
// half of that or more a quarter of it (rounded up), a smaller one none.
// Where the full headroom is less than whole (a small cluster) nothing is
// kept.
func HeadroomFor(percent int32, total, n, whole int) int {
	h := (int(percent)*total + 99) / 100
	switch {
	case h < whole:
		return 0
	case n >= whole:
		return h
	case 2*n >= whole:
		return (h + 3) / 4
	}
	return 0
}

// checkHeadroom says why an allocation on node may not be used now: for
// a driver it takes node-local devices of, fewer than HeadroomFor of that driver's
// devices would stay free on the nodes the pod may use, counting only
// nodes left with SpareOnNode or more free. Empty when it may.
func checkHeadroom(percent int32, whole int, counts headroom, node string, allocations []resourceapi.AllocationResult) string {
	taken := map[string]int{}
	for _, a := range allocations {
		for _, r := range a.Devices.Results {
			if counts.local.Has(poolKey{driver: r.Driver, pool: r.Pool}) {
				taken[r.Driver]++
			}
		}
	}
	for driver, n := range taken {
		c := counts.drivers[driver]
		h := HeadroomFor(percent, c.total, n, whole)
		if h == 0 {
			continue
		}
		if spare := counts.spareAfter(driver, node, n); spare < h {
			// The same words on every node that fails, so that the
			// pod's message counts them once.
			which := "devices of the nodes this pod may use"
			if counts.matched {
				which = "devices that this pod's requests match on the nodes it may use"
			}
			// No commas: the framework joins the reasons of the
			// node groups with ", ".
			return fmt.Sprintf("keeping %d of the %d %s %s free for smaller pods (smallPodHeadroomPercent %d): %d are free (%d of them on nodes with %d or more free) and this pod needs %d (that would leave fewer than %d); the pod needs no change: it is retried when devices are given back",
				h, c.total, driver, which, percent, c.free, c.spare, SpareOnNode, n, h)
		}
	}
	return ""
}

// heldBack holds the UIDs of pods whose latest scheduling attempt had an
// allocation on some node turned down by the headroom alone. The freed-
// devices hint retries such a pod on any event after which the headroom
// is kept with the pod placed, not only on the event that brings the
// cluster up to it: the attempt the hint called for may have run before
// the claim tracker took in the devices given back, and no later event
// then brings the cluster up to a headroom it already has. PreFilter
// forgets a pod, Filter records it, Reserve and the pod's deletion forget
// it (and its narrow record). The gauge topodra_headroom_held_pods counts
// the pods held.
//
// It also holds the pods whose headroom PreFilter counted over fewer
// devices of a driver than the node-local devices of that driver on the
// nodes the pod may use (its requests match only some of them, say one
// GPU model of two; see headroomOf), with the nodes among those on
// which they match none: the hint's counts per driver do not tell such a
// pod's headroom (see freedEnough).
// The zero value is ready; safe for concurrent use.
type heldBack struct {
	pods, narrow sync.Map
	// outranking holds the pods that the headroom did not apply to at
	// their latest attempt because they may preempt a pod of lower
	// priority that holds claims (see PreFilter).
	outranking sync.Map
	// lister lists the scheduler's pods (nil: not known); hold checks that
	// the pod still exists, since its deletion may have been handled
	// while its attempt ran.
	lister corelisters.PodLister
}

func (h *heldBack) hold(pod *v1.Pod) {
	if _, loaded := h.pods.LoadOrStore(pod.UID, struct{}{}); loaded {
		return
	}
	headroomHeldPods.Inc()
	if h.gone(pod) {
		h.done(pod.UID)
	}
}

// gone reports whether the lister shows the pod deleted (not there, or
// its name taken by another pod).
func (h *heldBack) gone(pod *v1.Pod) bool {
	if h.lister == nil {
		return false
	}
	p, err := h.lister.Pods(pod.Namespace).Get(pod.Name)
	return apierrors.IsNotFound(err) || err == nil && p.UID != pod.UID
}

// done forgets everything recorded for the pod: it is placed or deleted.
func (h *heldBack) done(uid types.UID) {
	h.forget(uid)
	h.narrow.Delete(uid)
	h.outranking.Delete(uid)
}

// setOutranks records whether the headroom spared the pod at this attempt
// because it may preempt (see outranksHolder). Like hold, it drops the
// record again where the pod's deletion was handled while its attempt
// ran.
func (h *heldBack) setOutranks(pod *v1.Pod, outranks bool) {
	if !outranks {
		h.outranking.Delete(pod.UID)
		return
	}
	h.outranking.Store(pod.UID, struct{}{})
	if h.gone(pod) {
		h.outranking.Delete(pod.UID)
	}
}

// outranks reports what setOutranks recorded last.
func (h *heldBack) outranks(uid types.UID) bool {
	_, ok := h.outranking.Load(uid)
	return ok
}

func (h *heldBack) forget(uid types.UID) {
	if _, loaded := h.pods.LoadAndDelete(uid); loaded {
		headroomHeldPods.Dec()
	}
}

func (h *heldBack) held(uid types.UID) bool {
	_, ok := h.pods.Load(uid)
	return ok
}

// setNarrow records whether the pod's headroom was counted over only the
// devices its requests match, where those are fewer than its drivers',
// and if so the nodes it looked at on which its requests match no device
// (barren, shared with other pods by nodeSets.intern: never changed). Like
// hold, it drops the record again where the pod's deletion was handled
// while its attempt ran.
func (h *heldBack) setNarrow(pod *v1.Pod, narrow bool, barren sets.Set[string]) {
	if !narrow {
		h.narrow.Delete(pod.UID)
		return
	}
	h.narrow.Store(pod.UID, barren)
	if h.gone(pod) {
		h.narrow.Delete(pod.UID)
	}
}

// narrowed reports whether the pod's headroom was narrow (setNarrow), and
// the nodes on which its requests match no device.
func (h *heldBack) narrowed(uid types.UID) (barren sets.Set[string], narrow bool) {
	v, ok := h.narrow.Load(uid)
	if !ok {
		return nil, false
	}
	return v.(sets.Set[string]), true
}

// handler forgets pods when they are deleted (or replaced by a pod of the
// same name), for pods that were being held back when they went (Reserve
// never ran for them).
func (h *heldBack) handler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(oldObj, newObj any) {
			if old, ok := replacedPod(oldObj, newObj); ok {
				h.done(old.UID)
			}
		},
		DeleteFunc: func(obj any) {
			if pod, ok := deletedPod(obj); ok {
				h.done(pod.UID)
			}
		},
	}
}
