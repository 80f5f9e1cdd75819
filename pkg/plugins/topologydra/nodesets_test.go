package topologydra

import (
	"fmt"
	"reflect"
	"runtime"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/sets"
)

// sameSet reports whether a and b are one map, not only equal.
func sameSet(a, b sets.Set[string]) bool {
	return reflect.ValueOf(a).UnsafePointer() == reflect.ValueOf(b).UnsafePointer()
}

func TestNodeSetsIntern(t *testing.T) {
	var n nodeSets
	if got := n.intern(nil); got != nil {
		t.Errorf("intern(nil) = %v, want nil", got)
	}
	first := n.intern(sets.New("a", "b", "c"))
	if again := n.intern(sets.New("c", "a", "b")); !sameSet(again, first) {
		t.Errorf("an equal set built in another order is not the one interned first")
	}
	other := n.intern(sets.New("a", "b", "d"))
	if sameSet(other, first) || !other.Equal(sets.New("a", "b", "d")) {
		t.Errorf("a set of the same size with another name: got %v, want its own set", sets.List(other))
	}
	empty := n.intern(sets.New[string]())
	if again := n.intern(sets.New[string]()); empty == nil || !sameSet(again, empty) {
		t.Errorf("empty sets are not interned to one non-nil set")
	}
	// first stays while it is used; sets not asked for again are
	// forgotten once recentNodeSets others came after them.
	for i := range recentNodeSets {
		n.intern(sets.New(fmt.Sprintf("node-%d", i)))
		if i == recentNodeSets/2 {
			if again := n.intern(sets.New("a", "b", "c")); !sameSet(again, first) {
				t.Fatalf("a set used again was forgotten")
			}
		}
	}
	if again := n.intern(sets.New("a", "b", "c")); !sameSet(again, first) {
		t.Errorf("a set used within the last %d was forgotten", recentNodeSets)
	}
	fresh := sets.New("a", "b", "d")
	if got := n.intern(fresh); !sameSet(got, fresh) {
		t.Errorf("a set not used within the last %d is still remembered", recentNodeSets)
	}
	if len(n.recent) > recentNodeSets {
		t.Errorf("remembers %d sets, want at most %d", len(n.recent), recentNodeSets)
	}
}

// TestUnfitNodesShared: whole-node pods of one workload find the same
// nodes unfit (nodes without GPUs); their pending-index entries hold one
// set, not a copy each.
func TestUnfitNodesShared(t *testing.T) {
	nodes := []*v1.Node{testNode("gpu-1"), testNode("gpu-2"), testNode("cpu-1"), testNode("cpu-2"), testNode("cpu-3")}
	h := newHarness(t, nodes, testDeviceClass(), testSlice("gpu-1", 8), testSlice("gpu-2", 8), testClaim("a", 8), testClaim("b", 8))
	h.waitForClaim("b", func(*resourceapi.ResourceClaim) bool { return true })
	var unfit []sets.Set[string]
	for _, claim := range []string{"a", "b"} {
		pod := testPod("whole-"+claim, claim)
		h.pl.pending.handler().OnAdd(pod, false)
		h.cycle(pod)
		h.pl.pending.mu.Lock()
		e := h.pl.pending.pods[pod.Spec.SchedulerName][pod.UID]
		h.pl.pending.mu.Unlock()
		if e == nil {
			t.Fatalf("pod %s not in the pending index", pod.Name)
		}
		unfit = append(unfit, e.unfit)
	}
	if want := sets.New("cpu-1", "cpu-2", "cpu-3"); !unfit[0].Equal(want) || !unfit[1].Equal(want) {
		t.Fatalf("unfit nodes %v and %v, want %v", sets.List(unfit[0]), sets.List(unfit[1]), sets.List(want))
	}
	if !sameSet(unfit[0], unfit[1]) {
		t.Errorf("the two pods' unfit nodes are two sets, want one shared")
	}
}

// BenchmarkUnfitNodesMemory reports the heap that whole-node pods waiting
// on a cluster with nodes without GPUs keep in the pending index
// (pendingPod.unfit) after their PreFilter: 1,000 nodes, half of them
// without GPUs, 200 pods of one workload.
func BenchmarkUnfitNodesMemory(b *testing.B) {
	const nodeCount, pods = 1000, 200
	var nodes []*v1.Node
	objs := []k8sruntime.Object{testDeviceClass(), testClaim("eight", 8)}
	for i := range nodeCount {
		name := fmt.Sprintf("node-%d", i)
		nodes = append(nodes, testNode(name))
		if i%2 == 0 {
			objs = append(objs, testSlice(name, 8))
		}
	}
	h := newHarness(b, nodes, objs...)
	h.waitForClaim("eight", func(*resourceapi.ResourceClaim) bool { return true })
	var waiting []*v1.Pod
	for i := range pods {
		pod := testPod(fmt.Sprintf("whole-%d", i), "eight")
		h.pl.pending.handler().OnAdd(pod, false)
		waiting = append(waiting, pod)
	}
	var retained float64
	for b.Loop() {
		b.StopTimer()
		for _, pod := range waiting {
			h.pl.pending.setUnfit(pod, nil)
		}
		h.pl.nodeSets = nodeSets{}
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		b.StartTimer()
		for _, pod := range waiting {
			h.cycle(pod)
		}
		b.StopTimer()
		runtime.GC()
		runtime.ReadMemStats(&after)
		retained += float64(after.HeapAlloc) - float64(before.HeapAlloc)
		b.StartTimer()
	}
	b.ReportMetric(retained/float64(b.N)/pods, "B-kept/pod")
}
