package topologydra

import (
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"
)

// The clock times bindings it sees to the nanosecond, where the API's
// PodScheduled condition has whole seconds, and ages use it.
func TestBindClockAges(t *testing.T) {
	start := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	now := start
	clock := newBindClock()
	clock.now = func() time.Time { return now }
	h := clock.handler()

	pod := func(name, node string) *v1.Pod {
		p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID(name), CreationTimestamp: metav1.NewTime(start.Add(-time.Hour))}}
		p.Spec.NodeName = node
		p.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "c"}}
		if node != "" {
			// As the API keeps it: whole seconds.
			p.Status.Conditions = []v1.PodCondition{{Type: v1.PodScheduled, Status: v1.ConditionTrue, LastTransitionTime: metav1.NewTime(start)}}
		}
		return p
	}
	// a is bound 100 ms after start, b 600 ms after: one second in the
	// API, 500 ms apart on the clock.
	now = start.Add(100 * time.Millisecond)
	h.OnUpdate(pod("a", ""), pod("a", "n1"))
	now = start.Add(600 * time.Millisecond)
	h.OnUpdate(pod("b", ""), pod("b", "n2"))
	// Seen bound from the start (a restarted scheduler): no entry.
	h.OnAdd(pod("c", "n3"), true)
	// An update of a pod that was already bound does not move its time.
	now = start.Add(900 * time.Millisecond)
	h.OnUpdate(pod("a", "n1"), pod("a", "n1"))

	if at, ok := clock.boundAt(pod("a", "n1")); !ok || !at.Equal(start.Add(100*time.Millisecond)) {
		t.Errorf("a bound at %v (%v), want start+100ms", at, ok)
	}
	if _, ok := clock.boundAt(pod("c", "n3")); ok {
		t.Error("a pod seen bound from the start has a clock entry")
	}

	now = start.Add(time.Second)
	var nodes []fwk.NodeInfo
	for _, p := range []*v1.Pod{pod("a", "n1"), pod("b", "n2")} {
		info := framework.NewNodeInfo(p)
		info.SetNode(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: p.Spec.NodeName}})
		nodes = append(nodes, info)
	}
	self := pod("self", "")
	withClock := agesOf(nodes, self, now, clock)
	if got, want := withClock.byNode["n1"], 900*time.Millisecond; got != want {
		t.Errorf("age of n1 = %v, want %v", got, want)
	}
	if got, want := withClock.byNode["n2"], 400*time.Millisecond; got != want {
		t.Errorf("age of n2 = %v, want %v", got, want)
	}
	if withClock.settled("n2") >= withClock.settled("n1") {
		t.Error("the node bound later should be less settled")
	}
	// Without the clock both count from the condition's second: a tie.
	noClock := agesOf(nodes, self, now, nil)
	if noClock.byNode["n1"] != noClock.byNode["n2"] {
		t.Errorf("without the clock: ages %v and %v, want equal", noClock.byNode["n1"], noClock.byNode["n2"])
	}

	h.OnDelete(cache.DeletedFinalStateUnknown{Key: "ns/a", Obj: pod("a", "n1")})
	if _, ok := clock.boundAt(pod("a", "n1")); ok {
		t.Error("a deleted pod keeps its entry")
	}
	var nilClock *bindClock
	if _, ok := nilClock.boundAt(pod("b", "n2")); ok {
		t.Error("a nil clock has entries")
	}
}
