package topologydra

import (
	"fmt"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"
)

// BenchmarkFreedDevicesHint measures the queueing hint for a claim that
// gives devices back, on a cluster of 8-GPU nodes with 7 of every node's
// GPUs allocated (one claim each): per event (the first pending pod asks
// and the free devices are counted) and per further pending pod (the
// counts are reused), without and with the headroom, and per event for a
// pod of one GPU, which the headroom does not concern; and with the GPU
// nodes tainted (the pod tolerating it), where the headroom counts only
// the nodes the pod may use.
func BenchmarkFreedDevicesHint(b *testing.B) {
	for _, tc := range []struct {
		nodes   int
		tainted bool
	}{{100, false}, {1000, false}, {1000, true}} {
		nodes := tc.nodes
		var nodeObjs []*v1.Node
		objs := []runtime.Object{testDeviceClass(), testClaim("big", 8), testClaim("small", 1)}
		var held []string
		for n := range nodes {
			name := fmt.Sprintf("node-%d", n)
			node := testNode(name)
			if tc.tainted {
				node.Spec.Taints = []v1.Taint{{Key: "nvidia.com/gpu", Effect: v1.TaintEffectNoSchedule}}
			}
			nodeObjs = append(nodeObjs, node)
			objs = append(objs, testSlice(name, 8))
			for g := range 7 {
				claim := fmt.Sprintf("c-%d-%d", n, g)
				objs = append(objs, allocatedOn(testClaim(claim, 1), name, fmt.Sprintf("gpu-%d", g)))
				held = append(held, claim)
			}
		}
		h := newHarness(b, nodeObjs, objs...)
		h.waitForClaim("big", func(*resourceapi.ResourceClaim) bool { return true })
		h.waitForClaim(held[len(held)-1], func(*resourceapi.ResourceClaim) bool { return true })
		// One claim per node gives devices back, again and again: the
		// hint counts devices given back as free while the claim cache
		// still shows them held, as it does here throughout.
		var claims []*resourceapi.ResourceClaim
		for i := 0; i < len(held); i += 7 {
			claims = append(claims, h.apiClaim(held[i]))
		}
		pod := testPod("big", "big")
		pod.Spec.Tolerations = []v1.Toleration{{Key: "nvidia.com/gpu", Operator: v1.TolerationOpExists}}
		name := fmt.Sprintf("nodes=%d", nodes)
		if tc.tainted {
			name += "/tainted"
		}
		hint := func(old *resourceapi.ResourceClaim, event int) {
			gone := old.DeepCopy()
			gone.Status.Allocation = nil
			// A new resourceVersion per event: the counts are kept per event.
			old = old.DeepCopy()
			old.ResourceVersion = fmt.Sprintf("%s-%d-%d", old.ResourceVersion, h.pl.headroomPercent, event)
			got, err := h.pl.isSchedulableAfterClaimChange(klog.Background(), pod, old, gone)
			if err != nil || h.pl.headroomPercent == 0 && got != fwk.QueueSkip {
				b.Fatalf("hint = %v, %v; want QueueSkip (6 of 8 GPUs in use)", got, err)
			}
		}
		// With smallPodHeadroomPercent (the default) every event also
		// counts every node's devices; the pod is then held back by the
		// headroom until the devices given back reach it.
		for _, percent := range []int32{0, 12} {
			h.pl.headroomPercent = percent
			b.Run(fmt.Sprintf("%s/headroom=%d/event", name, percent), func(b *testing.B) {
				for i := 0; b.Loop(); i++ {
					hint(claims[i%len(claims)], i)
				}
			})
			b.Run(fmt.Sprintf("%s/headroom=%d/pod", name, percent), func(b *testing.B) {
				old := claims[0]
				for b.Loop() {
					hint(old, -1)
				}
			})
			// A pod the headroom does not concern (one GPU): the
			// per-node counts are not needed.
			b.Run(fmt.Sprintf("%s/headroom=%d/event/small-pod", name, percent), func(b *testing.B) {
				small := testPod("small", "small")
				small.Spec.Tolerations = pod.Spec.Tolerations
				for i := 0; b.Loop(); i++ {
					old := claims[i%len(claims)]
					gone := old.DeepCopy()
					gone.Status.Allocation = nil
					old = old.DeepCopy()
					old.ResourceVersion = fmt.Sprintf("%s-small-%d-%d", old.ResourceVersion, h.pl.headroomPercent, i)
					if got, err := h.pl.isSchedulableAfterClaimChange(klog.Background(), small, old, gone); err != nil || got != fwk.Queue {
						b.Fatalf("hint = %v, %v; want Queue (2 of 8 GPUs free)", got, err)
					}
				}
			})
		}
	}
}

// BenchmarkWholeNodePods measures PreScore's count of the waiting pods
// that need a whole node (pendingIndex.wholeNodePods): 2,000 pending pods
// of which 200 ask for 8 GPUs, over 500 nodes, each of them tainted (a GPU
// node taint the pods tolerate), as PreScore asks it for every attempt.
func BenchmarkWholeNodePods(b *testing.B) {
	ix := newPendingIndex()
	big, small := testClaim("big", 8), testClaim("small", 1)
	claims := func(_, name string) (*resourceapi.ResourceClaim, error) {
		if name == "big" {
			return big, nil
		}
		return small, nil
	}
	toleration := []v1.Toleration{{Key: "nvidia.com/gpu", Operator: v1.TolerationOpExists}}
	for i := range 2000 {
		claim := "small"
		if i%10 == 0 {
			claim = "big"
		}
		pod := testPod(fmt.Sprintf("p-%d", i), claim)
		pod.Spec.Tolerations = toleration
		ix.update(pod)
	}
	var nodes []fwk.NodeInfo
	for n := range 500 {
		node := testNode(fmt.Sprintf("node-%d", n))
		node.Spec.Taints = []v1.Taint{{Key: "nvidia.com/gpu", Effect: v1.TaintEffectNoSchedule}}
		info := framework.NewNodeInfo()
		info.SetNode(node)
		nodes = append(nodes, info)
	}
	asking := testPod("asking", "small")
	b.ResetTimer()
	for range b.N {
		if n, admitted := ix.wholeNodePods(asking, claims, nodes); n != 200 || admitted.Len() != 500 {
			b.Fatalf("%d waiting whole-node pods on %d nodes, want 200 on 500", n, admitted.Len())
		}
	}
}

// BenchmarkOutranksHolder measures PreFilter's look for a pod of lower
// priority holding claims (outranksHolder) where it finds none, the case
// in which it reads every pod: 5,000 nodes with four pods each, all of
// one priority, each with a claim.
func BenchmarkOutranksHolder(b *testing.B) {
	var nodes []fwk.NodeInfo
	admit := sets.New[string]()
	for n := range 5000 {
		node := testNode(fmt.Sprintf("node-%d", n))
		info := framework.NewNodeInfo()
		info.SetNode(node)
		for p := range 4 {
			pod := testPod(fmt.Sprintf("p-%d-%d", n, p), "c")
			pod.Spec.NodeName = node.Name
			info.AddPod(pod)
		}
		nodes = append(nodes, info)
		admit.Insert(node.Name)
	}
	asking := testPod("asking", "big")
	b.ResetTimer()
	for range b.N {
		if outranksHolder(asking, nodes, admit) {
			b.Fatal("a pod of one priority outranks another")
		}
	}
}
