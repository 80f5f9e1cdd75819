package topologydra

import (
	"context"
	"fmt"
	"sync"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	fwk "k8s.io/kube-scheduler/framework"
)

// SortName is the name of the DeviceCountSort plugin in the registry and
// in configurations.
const SortName = "DeviceCountSort"

// DeviceCountSort is a QueueSort plugin. It orders the scheduling queue by
// pod priority (higher first), then by the number of devices of one
// device class the pod's claims ask for (fewer first), then by the time
// the pod entered the queue, as PrioritySort does. So, of the pods of one
// priority that wait together, those that need fewest devices are tried
// first, and a pod that needs a whole node is tried once the smaller pods
// have taken what they fit in.
//
// Device counts are as in the pending-pod index: per device class, the
// exact counts and the first subrequest of a firstAvailable request of
// all the pod's claims, allocated or not, and of those the largest: a
// pod that asks for a GPU and a NIC counts one, as a pod that asks for a
// GPU does. A pod without claims asks for none. A claim not in the
// scheduler's claim cache counts as none; PreEnqueue keeps such a pod out
// of the active queue until the claim is there. A pod's count, once all
// its claims were found, is kept until the pod is bound or deleted, so
// that its place in the queue's heap does not move while it waits (a
// claim deleted and created again meanwhile would move it); a count taken
// after the pod's deletion was handled (the queue compares a pod until its
// own handler, on another listener, removes it) is dropped again where the
// pod lister no longer has the pod. Entities that
// are not single pods (pod groups) count as asking for none.
//
// All profiles of a scheduler share one queue, so every profile must
// name the same QueueSort plugin.
type DeviceCountSort struct {
	claims claimGetter
	// known holds the counts of pods whose claims were all found, by pod
	// UID; nil where the scheduler has no informer factory to tell when
	// pods go (then counts are taken afresh at every comparison).
	known *sync.Map
	// pods is the lister of the informer whose events drop counts from
	// known; set with known.
	pods corelisters.PodLister
}

var _ fwk.QueueSortPlugin = &DeviceCountSort{}

// NewSort builds the plugin; it takes no args.
func NewSort(_ context.Context, _ runtime.Object, h fwk.Handle) (fwk.Plugin, error) {
	m := h.SharedDRAManager()
	if m == nil {
		return nil, fmt.Errorf("%s needs the scheduler's DRA manager (DynamicResourceAllocation feature disabled?)", SortName)
	}
	s := &DeviceCountSort{claims: m.ResourceClaims().Get}
	if f := h.SharedInformerFactory(); f != nil {
		s.known = &sync.Map{}
		s.pods = f.Core().V1().Pods().Lister()
		if _, err := f.Core().V1().Pods().Informer().AddEventHandler(s.forgetHandler()); err != nil {
			return nil, fmt.Errorf("%s: watch pods: %w", SortName, err)
		}
	}
	return s, nil
}

// forgetHandler drops the kept counts of pods that are bound, deleted or
// replaced by a pod of the same name.
func (s *DeviceCountSort) forgetHandler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(oldObj, newObj any) {
			if old, ok := replacedPod(oldObj, newObj); ok {
				s.known.Delete(old.UID)
			}
			if pod, ok := newObj.(*v1.Pod); ok && pod.Spec.NodeName != "" {
				s.known.Delete(pod.UID)
			}
		},
		DeleteFunc: func(obj any) {
			if pod, ok := deletedPod(obj); ok {
				s.known.Delete(pod.UID)
			}
		},
	}
}

// Name returns the plugin's name.
func (s *DeviceCountSort) Name() string { return SortName }

// Less reports whether a goes before b in the queue.
func (s *DeviceCountSort) Less(a, b fwk.QueuedEntityInfo) bool {
	if pa, pb := a.GetPriority(), b.GetPriority(); pa != pb {
		return pa > pb
	}
	if da, db := s.devices(a), s.devices(b); da != db {
		return da < db
	}
	return a.GetTimestamp().Before(b.GetTimestamp())
}

// devices is what a queued pod's claims ask for.
func (s *DeviceCountSort) devices(e fwk.QueuedEntityInfo) int {
	p, ok := e.(interface{ GetPodInfo() fwk.PodInfo })
	if !ok {
		return 0
	}
	pod := p.GetPodInfo().GetPod()
	if s.known != nil {
		if n, ok := s.known.Load(pod.UID); ok {
			return n.(int)
		}
	}
	n, all := podDevices(pod, s.claims, false)
	if all && s.known != nil {
		s.known.Store(pod.UID, n)
		if s.gone(pod) {
			s.known.Delete(pod.UID)
		}
	}
	return n
}

// gone reports whether the pod lister has no unbound pod of pod's name and
// UID any more: its deletion, replacement or binding was handled, maybe
// before the count was stored, and no later event will drop it.
func (s *DeviceCountSort) gone(pod *v1.Pod) bool {
	if s.pods == nil {
		return false
	}
	p, err := s.pods.Pods(pod.Namespace).Get(pod.Name)
	return apierrors.IsNotFound(err) || err == nil && (p.UID != pod.UID || p.Spec.NodeName != "")
}
