package topologydra

import (
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/queuesort"
	"k8s.io/utils/ptr"
)

func TestDeviceCountSortOrdersByPriorityThenDevicesThenTime(t *testing.T) {
	claims := map[string]*resourceapi.ResourceClaim{
		"eight": testClaim("eight", 8),
		"four":  testClaim("four", 4),
		"one":   testClaim("one", 1),
		"one-b": testClaim("one-b", 1),
		"two":   testClaim("two", 2),
		// One GPU and one NIC: one device of each class.
		"gpu-nic": withRequest(testClaim("gpu-nic", 1), "nic", "nic-class", 1),
	}
	get := func(_, name string) (*resourceapi.ResourceClaim, error) {
		if c, ok := claims[name]; ok {
			return c, nil
		}
		return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "resourceclaims"}, name)
	}
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	queued := func(name string, priority int32, age int, claimNames ...string) fwk.QueuedEntityInfo {
		pod := testPod(name, claimNames...)
		pod.Spec.Priority = ptr.To(priority)
		pi, err := framework.NewPodInfo(pod)
		if err != nil {
			t.Fatal(err)
		}
		q := &framework.QueuedPodInfo{PodInfo: pi}
		q.Timestamp = start.Add(-time.Duration(age) * time.Second)
		return q
	}
	entities := []fwk.QueuedEntityInfo{
		queued("eight-oldest", 0, 100, "eight"),
		queued("four-old", 0, 50, "four"),
		queued("split-four", 0, 60, "one", "one-b", "missing"), // 2 known, 1 not in the cache
		queued("one-new", 0, 1, "one"),
		queued("gpu-and-nic", 0, 2, "gpu-nic"),
		queued("two-older", 0, 70, "two"),
		queued("no-claims", 0, 0),
		queued("eight-urgent", 10, 0, "eight"),
	}
	sorter := &DeviceCountSort{claims: get}
	slices.SortStableFunc(entities, func(a, b fwk.QueuedEntityInfo) int {
		switch {
		case sorter.Less(a, b):
			return -1
		case sorter.Less(b, a):
			return 1
		}
		return 0
	})
	var got []string
	for _, e := range entities {
		got = append(got, e.(interface{ GetPodInfo() fwk.PodInfo }).GetPodInfo().GetPod().Name)
	}
	want := []string{"eight-urgent", "no-claims", "gpu-and-nic", "one-new", "two-older", "split-four", "four-old", "eight-oldest"}
	if !slices.Equal(got, want) {
		t.Errorf("queue order %s\nwant        %s", strings.Join(got, " "), strings.Join(want, " "))
	}
	// Equal priority and devices: the earlier timestamp first, as PrioritySort.
	a, b := queued("a", 0, 5, "four"), queued("b", 0, 3, "four")
	if !sorter.Less(a, b) || sorter.Less(b, a) {
		t.Error("pods with equal priority and devices: want the one queued first first")
	}
}

// withRequest adds an exact request for n devices of class to claim.
func withRequest(claim *resourceapi.ResourceClaim, name, class string, n int64) *resourceapi.ResourceClaim {
	claim.Spec.Devices.Requests = append(claim.Spec.Devices.Requests, resourceapi.DeviceRequest{
		Name:    name,
		Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: n},
	})
	return claim
}

// BenchmarkQueueSortLess compares one Less call of DeviceCountSort (two
// pods with one claim each, looked up in a map as in the claim cache) with
// PrioritySort's.
func BenchmarkQueueSortLess(b *testing.B) {
	claims := map[string]*resourceapi.ResourceClaim{"four": testClaim("four", 4), "eight": testClaim("eight", 8)}
	get := func(namespace, name string) (*resourceapi.ResourceClaim, error) {
		if c, ok := claims[name]; ok {
			return c, nil
		}
		return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "resourceclaims"}, namespace+"/"+name)
	}
	queued := func(name, claim string) fwk.QueuedEntityInfo {
		pi, err := framework.NewPodInfo(testPod(name, claim))
		if err != nil {
			b.Fatal(err)
		}
		return &framework.QueuedPodInfo{PodInfo: pi}
	}
	x, y := queued("x", "eight"), queued("y", "four")
	for name, less := range map[string]func(a, b fwk.QueuedEntityInfo) bool{
		"DeviceCountSort": (&DeviceCountSort{claims: get}).Less,
		"PrioritySort":    (&queuesort.PrioritySort{}).Less,
	} {
		b.Run(name, func(b *testing.B) {
			for b.Loop() {
				less(x, y)
			}
		})
	}
}

// TestDeviceCountSortKeyStaysWhileQueued: a queued pod's device count,
// once its claims were found, stays while its claim is deleted (its key
// in the queue's heap must not move), and goes when the pod is bound or
// deleted.
func TestDeviceCountSortKeyStaysWhileQueued(t *testing.T) {
	claims := map[string]*resourceapi.ResourceClaim{"eight": testClaim("eight", 8), "four": testClaim("four", 4)}
	get := func(_, name string) (*resourceapi.ResourceClaim, error) {
		if c, ok := claims[name]; ok {
			return c, nil
		}
		return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "resourceclaims"}, name)
	}
	queued := func(pod *v1.Pod) fwk.QueuedEntityInfo {
		pi, err := framework.NewPodInfo(pod)
		if err != nil {
			t.Fatal(err)
		}
		return &framework.QueuedPodInfo{PodInfo: pi}
	}
	big, small := testPod("big", "eight"), testPod("small", "four")
	sorter := &DeviceCountSort{claims: get, known: &sync.Map{}}
	if !sorter.Less(queued(small), queued(big)) {
		t.Fatal("the 4-GPU pod does not go before the 8-GPU pod")
	}
	delete(claims, "eight")
	if !sorter.Less(queued(small), queued(big)) {
		t.Error("the 8-GPU pod's claim went and it moved before the 4-GPU pod")
	}
	bound := big.DeepCopy()
	bound.Spec.NodeName = "node-a"
	sorter.forgetHandler().OnUpdate(big, bound)
	if _, ok := sorter.known.Load(big.UID); ok {
		t.Error("a bound pod's count is kept")
	}
	sorter.forgetHandler().OnDelete(cache.DeletedFinalStateUnknown{Obj: small})
	if _, ok := sorter.known.Load(small.UID); ok {
		t.Error("a deleted pod's count is kept")
	}
}

// TestDeviceCountSortForgetsPodsGoneBeforeTheirCount: the queue compares a
// pod until its own handler removes it, which may run after the plugin's
// handler saw the pod deleted. A count taken then is dropped again, as it
// is for a pod replaced by one of the same name or bound meanwhile; the
// counts of pods still waiting are kept.
func TestDeviceCountSortForgetsPodsGoneBeforeTheirCount(t *testing.T) {
	claim := testClaim("two", 2)
	get := func(_, name string) (*resourceapi.ResourceClaim, error) {
		if name == claim.Name {
			return claim, nil
		}
		return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "resourceclaims"}, name)
	}
	indexer := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	sorter := &DeviceCountSort{claims: get, known: &sync.Map{}, pods: corelisters.NewPodLister(indexer)}
	queued := func(pod *v1.Pod) fwk.QueuedEntityInfo {
		pi, err := framework.NewPodInfo(pod)
		if err != nil {
			t.Fatal(err)
		}
		return &framework.QueuedPodInfo{PodInfo: pi}
	}
	waiting, deleted, replaced, bound := testPod("waiting", "two"), testPod("deleted", "two"), testPod("replaced", "two"), testPod("bound", "two")
	successor := testPod("replaced", "two")
	successor.UID += "-new"
	boundNow := bound.DeepCopy()
	boundNow.Spec.NodeName = "node-a"
	for _, pod := range []*v1.Pod{waiting, successor, boundNow} {
		if err := indexer.Add(pod); err != nil {
			t.Fatal(err)
		}
	}
	// The plugin's handler already saw these go; the queue compares them
	// once more before its own handler removes them.
	for _, pod := range []*v1.Pod{deleted, replaced, bound} {
		sorter.forgetHandler().OnDelete(pod)
		sorter.Less(queued(waiting), queued(pod))
		if _, ok := sorter.known.Load(pod.UID); ok {
			t.Errorf("pod %s: its count was kept after the lister stopped having it unbound", pod.Name)
		}
	}
	if _, ok := sorter.known.Load(waiting.UID); !ok {
		t.Error("the count of a pod still waiting was not kept")
	}
}
