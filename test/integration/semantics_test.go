package integration

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apiresource "k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/kubernetes/test/utils/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// TestFilterTimeout: a claim whose distinctAttribute constraint makes the
// upstream search exponential (nine devices with distinct slots, where
// each node has 64 devices in only eight slots) on 100 nodes. With
// filterTimeout 1s, each attempt ends with upstream's timeout reason, and
// the pod retries with backoff instead of holding the scheduler: other
// pods keep scheduling meanwhile.
func TestFilterTimeout(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "ftimeout")
	const slowNodes, devicesPerNode, slots = 100, 64, 8
	for i := range slowNodes {
		name := fmt.Sprintf("%s-slow-%d", e.ns, i)
		_, err := framework.CreateReadyNodeWithCPU(tCtx, cp.Client, name, map[string]string{"test": e.ns, "group": "slow"}, "256")
		tCtx.ExpectNoError(err)
		var devices []framework.Device
		for d := range devicesPerNode {
			devices = append(devices, framework.Device{
				Name:       fmt.Sprintf("gpu-%d", d),
				Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"slot": framework.IntAttr(int64(d % slots))},
			})
		}
		_, err = cp.Client.ResourceV1().ResourceSlices().Create(tCtx, framework.SliceForNode(name, topology.DriverName, devices), metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
	}
	e.dgxNodes("ok", 2, "256")

	slow := framework.ClaimTemplate(e.ns, "distinct-slots", e.class, slots+1)
	slow.Spec.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{DistinctAttribute: ptr.To(resourceapi.FullyQualifiedName(topology.DriverName + "/slot"))}}
	_, err := cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(tCtx, slow, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)

	startTopodraEdited(tCtx, "topodra-timeout", "filterTimeout: 10s", "filterTimeout: 1s")

	e.pod("slow", topodraName, "slow", "distinct-slots")
	const reason = "timed out trying to allocate devices"
	timedOut := func(p *v1.Pod) (bool, error) {
		if p.Spec.NodeName != "" {
			return false, fmt.Errorf("pod was scheduled to %s", p.Spec.NodeName)
		}
		c := framework.PodScheduledCondition(p)
		return c != nil && c.Status == v1.ConditionFalse && strings.Contains(c.Message, reason), nil
	}
	pod, err := framework.WaitForPod(tCtx, cp.Client, e.ns, "slow", 2*waitTimeout, "timed out", timedOut)
	tCtx.ExpectNoError(err)
	tCtx.Logf("slow pod: %s: %s", framework.PodScheduledCondition(pod).Reason, framework.PodScheduledCondition(pod).Message)

	// Other pods schedule while the slow one keeps retrying.
	one := e.template(1, nil)
	start := time.Now()
	for i := range 8 {
		e.pod(fmt.Sprintf("quick-%d", i), topodraName, "ok", one)
	}
	for i := range 8 {
		e.waitScheduled(fmt.Sprintf("quick-%d", i))
	}
	tCtx.Logf("8 other pods scheduled in %v", time.Since(start).Round(time.Millisecond))
	pod, err = cp.Client.CoreV1().Pods(e.ns).Get(tCtx, "slow", metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	if ok, err := timedOut(pod); !ok || err != nil {
		tCtx.Errorf("slow pod after the others: node %q, condition %+v, err %v", pod.Spec.NodeName, framework.PodScheduledCondition(pod), err)
	}
}

// TestPostFilterDeallocatesBeforePreemption: a high-priority pod whose
// claim is allocated (by an earlier attempt, not reserved) on a node that
// is full of low-priority work. No node fits: the other node cannot use
// the claim. TopologyDRA's PostFilter runs before DefaultPreemption, as
// the stock DynamicResources plugin does, so the idle allocation is
// removed in the same cycle in which preemption is considered, and before
// any victim is touched. With DefaultPreemption first, its success ends
// PostFilter and the claim is never deallocated.
func TestPostFilterDeallocatesBeforePreemption(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "postfilter")
	nodes := e.dgxNodes("g", 2, "4")
	full := nodes[0]

	high := e.highPriority()

	// Low-priority work that uses all of the first node's CPU.
	low := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "low"},
		Spec: v1.PodSpec{
			NodeName: full,
			Containers: []v1.Container{{Name: "c", Image: "busybox", Resources: v1.ResourceRequirements{
				Requests: v1.ResourceList{v1.ResourceCPU: apiresource.MustParse("4")},
			}}},
		},
	}
	_, err := cp.Client.CoreV1().Pods(e.ns).Create(tCtx, low, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)

	// The claim, allocated on the full node and reserved for nobody.
	e.preallocate("idle", full, "gpu-0")
	watcher, err := cp.Client.ResourceV1().ResourceClaims(e.ns).Watch(tCtx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", "idle").String()})
	tCtx.ExpectNoError(err)
	defer watcher.Stop()
	podWatcher, err := cp.Client.CoreV1().Pods(e.ns).Watch(tCtx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", "low").String()})
	tCtx.ExpectNoError(err)
	defer podWatcher.Stop()

	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "important"},
		Spec: v1.PodSpec{
			SchedulerName:     topodraName,
			PriorityClassName: high,
			NodeSelector:      map[string]string{"test": e.ns, "group": "g"},
			ResourceClaims:    []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: ptr.To("idle")}},
			Containers: []v1.Container{{Name: "c", Image: "busybox", Resources: v1.ResourceRequirements{
				Requests: v1.ResourceList{v1.ResourceCPU: apiresource.MustParse("1")},
				Claims:   []v1.ResourceClaim{{Name: "gpu"}},
			}}},
		},
	}
	_, err = cp.Client.CoreV1().Pods(e.ns).Create(tCtx, pod, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	startTopodra(tCtx)

	// The claim loses its allocation.
	var deallocatedAt int64
	err = wait.PollUntilContextTimeout(tCtx, framework.PollInterval, waitTimeout, true, func(context.Context) (bool, error) {
		for {
			select {
			case ev := <-watcher.ResultChan():
				c, ok := ev.Object.(*resourceapi.ResourceClaim)
				if ok && c.Status.Allocation == nil {
					deallocatedAt, _ = strconv.ParseInt(c.ResourceVersion, 10, 64)
					return true, nil
				}
			default:
				return false, nil
			}
		}
	})
	if err != nil {
		tCtx.Fatalf("the idle claim was never deallocated: %v", err)
	}
	// Preemption also evicts the victim in that cycle (upstream does the
	// same); without a kubelet its deletion does not finish by itself.
	victim, err := framework.WaitForPod(tCtx, cp.Client, e.ns, "low", waitTimeout, "terminating", func(p *v1.Pod) (bool, error) {
		return p.DeletionTimestamp != nil, nil
	})
	tCtx.ExpectNoError(err)
	tCtx.ExpectNoError(cp.Client.CoreV1().Pods(e.ns).Delete(tCtx, victim.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	scheduled := e.waitScheduled("important")
	claim, err := cp.Client.ResourceV1().ResourceClaims(e.ns).Get(tCtx, "idle", metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	tCtx.Logf("important pod on %s with %v (the full node is %s)", scheduled.Spec.NodeName, framework.AllocatedDevices(claim), full)

	// Every change preemption made to the victim comes after the
	// deallocation (resource versions of one etcd are ordered).
	for {
		select {
		case ev := <-podWatcher.ResultChan():
			p, ok := ev.Object.(*v1.Pod)
			if !ok {
				continue
			}
			rv, _ := strconv.ParseInt(p.ResourceVersion, 10, 64)
			if (p.DeletionTimestamp != nil || hasDisruptionTarget(p)) && rv < deallocatedAt {
				tCtx.Errorf("victim %s was preempted (resource version %d) before the claim was deallocated (%d)", p.Name, rv, deallocatedAt)
			}
			continue
		default:
		}
		break
	}
}

func hasDisruptionTarget(p *v1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == v1.DisruptionTarget {
			return true
		}
	}
	return false
}
