package topologydra

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	cgotesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"

	"github.com/topodra/topodra/pkg/topology"
)

// stockFailed is pod as another scheduler leaves it when the stock
// DynamicResources plugin found no allocation.
func stockFailed(pod *v1.Pod, scheduler string) *v1.Pod {
	pod.UID = ""
	pod.Spec.SchedulerName = scheduler
	pod.Status.Conditions = []v1.PodCondition{{
		Type: v1.PodScheduled, Status: v1.ConditionFalse, Reason: v1.PodReasonUnschedulable,
		Message: "0/2 nodes are available: 2 cannot allocate all claims. preemption: 0/2 nodes are available: 2 Preemption is not helpful for scheduling.",
	}}
	return pod
}

// TestOwnedNoticeForPodsOfOtherSchedulers: a pod of another scheduler
// whose claim asks for devices that all carry the owned taint, and that
// the stock plugin failed to place, gets one Warning event naming the
// claim and request and saying to set spec.schedulerName; a second
// replica writes no second one. Pods whose requests other devices could
// serve, that tolerate the taint, that match no device at all, that this
// profile schedules, or that failed for something else, get none.
func TestOwnedNoticeForPodsOfOtherSchedulers(t *testing.T) {
	free := testSlice("node-1", 2)
	free.Spec.Driver = "nic.example.com"
	free.Spec.Pool.Name = "node-1-nics"
	free.Name = "node-1-nics"
	nicClass := &resourceapi.DeviceClass{
		ObjectMeta: metav1.ObjectMeta{Name: "nic"},
		Spec: resourceapi.DeviceClassSpec{Selectors: []resourceapi.DeviceSelector{{
			CEL: &resourceapi.CELDeviceSelector{Expression: `device.driver == "nic.example.com"`},
		}}},
	}
	tolerating := testClaim("tolerating", 1)
	tolerating.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{Key: topology.DefaultTaintKey, Operator: resourceapi.DeviceTolerationOpExists}}
	nic := testClaim("nic", 1)
	nic.Spec.Devices.Requests[0].Exactly.DeviceClassName = "nic"
	gpuNIC := testClaim("gpu-nic", 1)
	nicReq := nic.Spec.Devices.Requests[0]
	nicReq.Name = "nic"
	gpuNIC.Spec.Devices.Requests = append(gpuNIC.Spec.Devices.Requests, nicReq)
	h := newHarness(t, []*v1.Node{testNode("node-0"), testNode("node-1")},
		testDeviceClass(), nicClass, ownedSlice("node-0", 4), free,
		testClaim("owned", 2), tolerating, testClaim("nowhere", 1, `device.attributes["resource.kubernetes.io"].pcieRoot == "pci-none"`), nic, gpuNIC)
	for _, c := range []string{"owned", "tolerating", "nowhere", "nic", "gpu-nic"} {
		h.waitForClaim(c, func(*resourceapi.ResourceClaim) bool { return true })
	}

	// Another profile of this process that runs TopologyDRA, whose pod
	// failed with the bare message (TopologyDRA's where it has no
	// explanation): not another scheduler's pod.
	topologyProfiles.Store("second-topodra", true)
	t.Cleanup(func() { topologyProfiles.Delete("second-topodra") })
	otherReason := stockFailed(testPod("cpu", "owned"), "default-scheduler")
	otherReason.Status.Conditions[0].Message = "0/2 nodes are available: 2 Insufficient cpu."
	for _, pod := range []*v1.Pod{
		stockFailed(testPod("wants-owned", "owned"), "default-scheduler"),
		stockFailed(testPod("gpu-and-nic", "gpu-nic"), "default-scheduler"),
		stockFailed(testPod("tolerates", "tolerating"), "default-scheduler"),
		stockFailed(testPod("matches-nothing", "nowhere"), "default-scheduler"),
		stockFailed(testPod("unowned", "nic"), "default-scheduler"),
		stockFailed(testPod("ours", "owned"), h.pl.handle.ProfileName()),
		stockFailed(testPod("second-profile", "owned"), "second-topodra"),
		otherReason,
	} {
		// The checks below read the plugin's pod lister.
		h.createSeen(pod)
	}
	notices := func() map[string]string {
		list, err := h.client.EventsV1().Events(testNS).List(h.tCtx, metav1.ListOptions{})
		h.tCtx.ExpectNoError(err, "list events")
		out := map[string]string{}
		for _, ev := range list.Items {
			if ev.Reason == OwnedNoticeReason {
				if _, dup := out[ev.Regarding.Name]; dup {
					t.Errorf("pod %s got a second notice: %s", ev.Regarding.Name, ev.Note)
				}
				out[ev.Regarding.Name] = ev.Note
			}
		}
		return out
	}
	var got map[string]string
	err := wait.PollUntilContextTimeout(h.tCtx, 20*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		got = notices()
		return len(got) >= 2, nil
	})
	h.tCtx.ExpectNoError(err, "notices written: %v", got)
	for pod, want := range map[string]string{
		"wants-owned": "default-scheduler cannot allocate the devices of claim owned request gpu: every device it matches carries the taint " + topology.DefaultTaintKey,
		"gpu-and-nic": "default-scheduler cannot allocate the devices of claim gpu-nic request gpu: every device",
	} {
		if !strings.Contains(got[pod], want) || !strings.Contains(got[pod], "Create the pod again with spec.schedulerName: "+h.pl.handle.ProfileName()) {
			t.Errorf("notice of pod %s = %q, want it to contain %q and say which scheduler to set", pod, got[pod], want)
		}
	}
	if strings.Contains(got["gpu-and-nic"], "request nic") {
		t.Errorf("notice of pod gpu-and-nic names the NIC request, which unowned devices serve: %q", got["gpu-and-nic"])
	}

	// A second replica watching the same pods writes no second notice.
	second := newOwnedNotices(h.pl, h.pl.handle.ProfileName())
	for _, name := range []string{"wants-owned", "gpu-and-nic", "tolerates"} {
		pod, err := h.pl.pods.Pods(testNS).Get(name)
		h.tCtx.ExpectNoError(err)
		second.consider(pod)
		if !second.next(h.tCtx) {
			t.Fatal("the second replica's queue shut down")
		}
	}
	// The other pods get none: their requests are served without the
	// owned taint, tolerate it or match nothing, or the pod is not one
	// that another scheduler failed to place for its claims.
	for _, name := range []string{"tolerates", "matches-nothing", "unowned"} {
		pod, err := h.pl.pods.Pods(testNS).Get(name)
		h.tCtx.ExpectNoError(err)
		if blocked, err := h.pl.ownedOnly(h.tCtx, pod, nil); err != nil || len(blocked) > 0 {
			t.Errorf("pod %s: requests needing the owned taint %v, %v; want none", name, blocked, err)
		}
	}
	for _, name := range []string{"ours", "second-profile", "cpu"} {
		pod, err := h.pl.pods.Pods(testNS).Get(name)
		h.tCtx.ExpectNoError(err)
		if second.candidate(pod) {
			t.Errorf("pod %s is taken for one another scheduler failed to place for its claims", name)
		}
	}
	if got = notices(); len(got) != 2 {
		t.Errorf("notices on %d pods, want 2 (wants-owned, gpu-and-nic): %v", len(got), got)
	}
}

// BenchmarkOwnedNotice measures what the notices cost per pod of another
// scheduler on 1,000 nodes of 8 owned GPUs: building the view of the

// TestOwnedNoticeForgetsPodDeletedWhileWritten: a pod of another scheduler
// is deleted while its notice is written, and the informer delivers the
// deletion before the write returns. The pod is not kept as noticed: no
// later event would drop it.
func TestOwnedNoticeForgetsPodDeletedWhileWritten(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("node-0")}, testDeviceClass(), ownedSlice("node-0", 4), testClaim("owned", 2))
	h.waitForClaim("owned", func(*resourceapi.ResourceClaim) bool { return true })
	n := newOwnedNotices(h.pl, h.pl.handle.ProfileName())
	deleted := make(chan struct{})
	var once sync.Once
	_, err := h.pl.handle.SharedInformerFactory().Core().V1().Pods().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		DeleteFunc: func(obj any) {
			n.handler().OnDelete(obj)
			once.Do(func() { close(deleted) })
		},
	})
	h.tCtx.ExpectNoError(err)
	pod := h.createSeen(stockFailed(testPod("victim", "owned"), "default-scheduler"))
	events := fake.NewClientset()
	events.PrependReactor("create", "events", func(cgotesting.Action) (bool, runtime.Object, error) {
		if err := h.client.CoreV1().Pods(testNS).Delete(h.tCtx, pod.Name, metav1.DeleteOptions{}); err != nil {
			t.Errorf("delete pod: %v", err)
		}
		select {
		case <-deleted:
		case <-time.After(10 * time.Second):
			t.Error("the deletion was not delivered")
		}
		return false, nil, nil
	})
	n.client = events
	n.queue.Add(cache.MetaObjectToName(pod))
	if !n.next(h.tCtx) {
		t.Fatal("queue shut down")
	}
	if _, err := h.pl.pods.Pods(testNS).Get(pod.Name); !apierrors.IsNotFound(err) {
		t.Fatalf("pod still in the lister: %v", err)
	}
	n.mu.Lock()
	kept := n.sent.Has(pod.UID)
	n.mu.Unlock()
	if kept {
		t.Error("the pod deleted while its notice was written is kept as noticed")
	}
}

// devices (at most once per viewReuse) and judging one pod with a view.
func BenchmarkOwnedNotice(b *testing.B) {
	var nodes []*v1.Node
	objs := []runtime.Object{testDeviceClass(), testClaim("owned", 2)}
	for n := range 1000 {
		name := fmt.Sprintf("node-%d", n)
		nodes = append(nodes, testNode(name))
		objs = append(objs, ownedSlice(name, 8))
	}
	h := newHarness(b, nodes, objs...)
	h.waitForClaim("owned", func(*resourceapi.ResourceClaim) bool { return true })
	pod := stockFailed(testPod("wants-owned", "owned"), "default-scheduler")
	b.Run("view", func(b *testing.B) {
		for b.Loop() {
			if view, err := h.pl.newDevicesView(h.tCtx); err != nil || view == nil {
				b.Fatalf("view: %v", err)
			}
		}
	})
	b.Run("pod", func(b *testing.B) {
		view, err := h.pl.newDevicesView(h.tCtx)
		h.tCtx.ExpectNoError(err)
		for b.Loop() {
			if blocked, err := h.pl.ownedOnly(h.tCtx, pod, view); err != nil || len(blocked) != 1 {
				b.Fatalf("requests needing the owned taint %v, %v; want one", blocked, err)
			}
		}
	})
}
