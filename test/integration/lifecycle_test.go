package integration

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/kubernetes/test/utils/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/config"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// TestTwoProfilesNoDoubleAllocation: one binary, the stock profile and the
// topodra profile, 200 one- and two-GPU pods split between them on 10
// eight-GPU nodes (80 GPUs). No device may end up in two claims.
func TestTwoProfilesNoDoubleAllocation(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "twoprof")
	e.dgxNodes("a", 10, "256")
	one, two := e.template(1, nil), e.template(2, nil)
	stop, err := cp.StartScheduler(tCtx, framework.SchedulerOptions{Name: "multi", Config: config.MultiProfileConfig})
	tCtx.ExpectNoError(err)
	tCtx.Cleanup(stop)

	const pods = 200
	for i := range pods {
		sched := topodraName
		if i%2 == 1 {
			sched = stockName
		}
		tmpl := one
		if i%3 == 0 {
			tmpl = two
		}
		e.pod(fmt.Sprintf("p-%03d", i), sched, "a", tmpl)
	}

	// Wait until every pod is either bound or rejected by its scheduler
	// and the number bound no longer changes.
	var bound []v1.Pod
	err = wait.PollUntilContextTimeout(tCtx, 500*time.Millisecond, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := cp.Client.CoreV1().Pods(e.ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		bound = bound[:0]
		settled := 0
		for _, p := range list.Items {
			c := framework.PodScheduledCondition(&p)
			switch {
			case p.Spec.NodeName != "":
				bound = append(bound, p)
				settled++
			case c != nil && c.Reason == v1.PodReasonUnschedulable:
				settled++
			}
		}
		return settled == pods, nil
	})
	tCtx.ExpectNoError(err, "pods did not settle")

	owner := map[string]string{} // pool/device -> claim
	gpus, perProfile := 0, map[string]int{}
	claims, err := cp.Client.ResourceV1().ResourceClaims(e.ns).List(tCtx, metav1.ListOptions{})
	tCtx.ExpectNoError(err)
	for _, c := range claims.Items {
		if c.Status.Allocation == nil {
			continue
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			key := r.Pool + "/" + r.Device
			if other, ok := owner[key]; ok {
				t.Errorf("device %s allocated to both %s and %s", key, other, c.Name)
			}
			owner[key] = c.Name
			gpus++
		}
	}
	for _, p := range bound {
		perProfile[p.Spec.SchedulerName]++
		e.devicesOf(&p) // checks allocation, reservation and node
	}
	t.Logf("%d pods bound (%v), %d GPUs allocated of 80", len(bound), perProfile, gpus)
	if gpus > 80 {
		t.Errorf("%d GPUs allocated, but only 80 exist", gpus)
	}
	if perProfile[topodraName] == 0 || perProfile[stockName] == 0 {
		t.Errorf("both profiles should have bound pods: %v", perProfile)
	}
	// 1- and 2-GPU pods fill 80 GPUs at least up to 79 (one GPU can be
	// stranded only if every remaining pod needs two).
	if gpus < 79 {
		t.Errorf("only %d of 80 GPUs allocated with %d pods waiting", gpus, pods-len(bound))
	}
}

// TestRestartBetweenReserveAndBind stops topodra-scheduler while a pod is
// in PreBind (its devices have binding conditions that the "driver" has not
// confirmed yet: the claim is allocated and reserved, the pod not bound),
// starts a new instance, and then confirms the conditions. The pod must end
// up bound to the node of its claim's allocation, with nothing written twice.
func TestRestartBetweenReserveAndBind(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "restart")
	node := fmt.Sprintf("%s-a-0", e.ns)
	_, err := framework.CreateReadyNode(tCtx, cp.Client, node, map[string]string{"test": e.ns, "group": "a"})
	tCtx.ExpectNoError(err)
	devices := framework.DGXLikeGPUs(node)
	slice := framework.SliceForNode(node, topology.DriverName, devices)
	for i := range slice.Spec.Devices {
		slice.Spec.Devices[i].BindsToNode = ptr.To(true)
		slice.Spec.Devices[i].BindingConditions = []string{"Attached"}
		slice.Spec.Devices[i].BindingFailureConditions = []string{"AttachFailed"}
	}
	_, err = cp.Client.ResourceV1().ResourceSlices().Create(tCtx, slice, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	two := e.template(2, nil)

	stop1, err := cp.StartScheduler(tCtx, framework.SchedulerOptions{Name: "topodra-1", Config: config.SchedulerConfig})
	tCtx.ExpectNoError(err)
	e.pod("job", topodraName, "a", two)

	// Wait for PreBind to have written allocation + reservation.
	claim := e.waitReserved("job", nil)
	stop1()
	pod, err := cp.Client.CoreV1().Pods(e.ns).Get(tCtx, "job", metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	if pod.Spec.NodeName != "" {
		t.Fatalf("pod bound before the binding conditions were met")
	}
	first := framework.AllocatedDevices(claim)
	t.Logf("scheduler stopped in PreBind; claim %s holds %v", claim.Name, first)

	stop2, err := cp.StartScheduler(tCtx, framework.SchedulerOptions{Name: "topodra-2", Config: config.SchedulerConfig})
	tCtx.ExpectNoError(err)
	tCtx.Cleanup(stop2)

	// The driver confirms the devices.
	claim, err = cp.Client.ResourceV1().ResourceClaims(e.ns).Get(tCtx, claim.Name, metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	for _, r := range claim.Status.Allocation.Devices.Results {
		st := resourceapi.AllocatedDeviceStatus{Driver: r.Driver, Pool: r.Pool, Device: r.Device}
		apimeta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: "Attached", Status: metav1.ConditionTrue, Reason: "Attached", ObservedGeneration: claim.Generation})
		claim.Status.Devices = append(claim.Status.Devices, st)
	}
	_, err = cp.Client.ResourceV1().ResourceClaims(e.ns).UpdateStatus(tCtx, claim, metav1.UpdateOptions{})
	tCtx.ExpectNoError(err)

	pod = e.waitScheduled("job")
	if pod.Spec.NodeName != node {
		t.Errorf("pod bound to %s, want %s", pod.Spec.NodeName, node)
	}
	final := e.devicesOf(pod) // one reservation, allocation on the pod's node
	if fmt.Sprint(final) != fmt.Sprint(first) {
		t.Errorf("allocation changed across the restart: %v, then %v", first, final)
	}
}

// TestSchedulerRestartAtEachPoint stops topodra-scheduler at the points of
// a pod's binding cycle where it has written part of its decision, starts a
// new instance, and checks that the pod is finished or its allocation
// undone, that no allocation is left without its pod, and that the
// invariant checker finds nothing. (Stopped while the pod waits in PreBind
// with its allocation written: TestRestartBetweenReserveAndBind.)
func TestSchedulerRestartAtEachPoint(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newFaultEnv(tCtx, "restartpoints")
	e.dgxNodes("a", 1, "256")
	e.bindingConditionNode("b")

	// The first scheduler's status write (allocation and reservation) is
	// held by the webhook until that scheduler is stopped, then refused:
	// Reserve has run, the claim may carry the finalizer, nothing else is
	// written.
	var held atomic.Bool
	release := make(chan struct{})
	w := &concurrentWriter{e: e, targets: []string{"held"}}
	w.write = func(ctx context.Context, _ *resourceapi.ResourceClaim) bool {
		held.Store(true)
		select {
		case <-release:
		case <-ctx.Done():
		}
		return false
	}
	w.start()

	t.Run("status write in flight", func(t *testing.T) {
		tCtx := ktesting.Init(t)
		e.standaloneClaim("held", 2)
		stop1, err := cp.StartScheduler(tCtx, framework.SchedulerOptions{Name: "topodra-1", Config: config.SchedulerConfig})
		tCtx.ExpectNoError(err)
		e.podWithClaim("held", "a", "held")
		err = wait.PollUntilContextTimeout(tCtx, framework.PollInterval, waitTimeout, true, func(context.Context) (bool, error) { return held.Load(), nil })
		tCtx.ExpectNoError(err, "scheduler's status write reaches the webhook")
		stop1()
		close(release)
		claim, err := cp.Client.ResourceV1().ResourceClaims(e.ns).Get(tCtx, "held", metav1.GetOptions{})
		tCtx.ExpectNoError(err)
		if claim.Status.Allocation != nil || len(claim.Status.ReservedFor) != 0 {
			t.Fatalf("the refused write landed: allocation %v, reservedFor %v", claim.Status.Allocation, claim.Status.ReservedFor)
		}
		t.Logf("scheduler stopped with the write in flight; claim finalizers %v", claim.Finalizers)

		stop2, err := cp.StartScheduler(tCtx, framework.SchedulerOptions{Name: "topodra-2", Config: config.SchedulerConfig})
		tCtx.ExpectNoError(err)
		tCtx.Cleanup(stop2)
		if devices := e.devicesOf(e.waitScheduled("held")); len(devices) != 2 {
			t.Errorf("pod got %v, want 2 GPUs", devices)
		}
		e.expectClean()
	})

	t.Run("allocation written, pod deleted while no scheduler runs", func(t *testing.T) {
		tCtx := ktesting.Init(t)
		e.standaloneClaim("orphan", 8)
		stop1, err := cp.StartScheduler(tCtx, framework.SchedulerOptions{Name: "topodra-3", Config: config.SchedulerConfig})
		tCtx.ExpectNoError(err)
		e.podWithClaim("gone", "b", "orphan")
		claim := e.waitReserved("gone", nil)
		stop1()
		t.Logf("scheduler stopped in PreBind; claim %s holds %v; deleting the pod", claim.Name, framework.AllocatedDevices(claim))
		tCtx.ExpectNoError(cp.Client.CoreV1().Pods(e.ns).Delete(tCtx, "gone", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
		err = wait.PollUntilContextTimeout(tCtx, framework.PollInterval, waitTimeout, true, func(ctx context.Context) (bool, error) {
			c, err := cp.Client.ResourceV1().ResourceClaims(e.ns).Get(ctx, "orphan", metav1.GetOptions{})
			return err == nil && c.Status.Allocation == nil && len(c.Status.ReservedFor) == 0, nil
		})
		tCtx.ExpectNoError(err, "claim of the deleted pod deallocated")

		stop2, err := cp.StartScheduler(tCtx, framework.SchedulerOptions{Name: "topodra-4", Config: config.SchedulerConfig})
		tCtx.ExpectNoError(err)
		tCtx.Cleanup(stop2)
		// All eight devices are free again.
		e.standaloneClaim("after", 8)
		e.podWithClaim("after", "b", "after")
		e.attach(e.waitReserved("after", nil).Name)
		e.expectScheduledAll("after")
		e.expectClean()
	})
}
