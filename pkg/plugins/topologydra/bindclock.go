package topologydra

import (
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
)

// bindClock records, from the scheduler's pod informer, when this
// process saw each pod become bound, on its own clock. The API keeps the
// time of a binding (the PodScheduled condition) in whole seconds, which
// cannot tell apart pods bound within a second of each other; the clock
// can. Pods bound before the informer started (a restarted scheduler)
// have no entry. Safe for concurrent use.
type bindClock struct {
	mu    sync.RWMutex
	bound map[types.UID]time.Time
	now   func() time.Time
}

func newBindClock() *bindClock {
	return &bindClock{bound: map[types.UID]time.Time{}, now: time.Now}
}

// handler is the pod informer's event handler that keeps the clock: an
// update that binds a pod records the time, a deletion forgets it.
func (c *bindClock) handler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(oldObj, newObj any) {
			if replaced, ok := replacedPod(oldObj, newObj); ok {
				c.mu.Lock()
				delete(c.bound, replaced.UID)
				c.mu.Unlock()
				// The new pod is seen for the first time, bound or not.
				oldObj = &v1.Pod{}
			}
			old, ok1 := oldObj.(*v1.Pod)
			pod, ok2 := newObj.(*v1.Pod)
			if !ok1 || !ok2 || old.Spec.NodeName != "" || pod.Spec.NodeName == "" || len(pod.Spec.ResourceClaims) == 0 {
				return
			}
			c.mu.Lock()
			c.bound[pod.UID] = c.now()
			c.mu.Unlock()
		},
		DeleteFunc: func(obj any) {
			if pod, ok := deletedPod(obj); ok {
				c.mu.Lock()
				delete(c.bound, pod.UID)
				c.mu.Unlock()
			}
		},
	}
}

// boundAt is when the clock saw pod bound; false where it did not.
func (c *bindClock) boundAt(pod *v1.Pod) (time.Time, bool) {
	if c == nil {
		return time.Time{}, false
	}
	c.mu.RLock()
	defer c.mu.RUnlock()
	t, ok := c.bound[pod.UID]
	return t, ok
}
