package integration

import (
	"context"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/events"
	"k8s.io/kubernetes/test/utils/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// TestDeviceLostGetsNoAllocations: the agent's GPU reports an XID while a
// prepared claim holds it. The device gets a health taint; the claim and
// the node get a warning event that says so (the pods using the claim may
// fail); once the claim is released, the device gets no new allocation:
// an 8-GPU pod stays pending, a 7-GPU pod binds to the healthy GPUs.
func TestDeviceLostGetsNoAllocations(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "lost")
	broadcaster := events.NewEventBroadcasterAdapterWithContext(tCtx, cp.Client)
	broadcaster.StartRecordingToSink(tCtx.Done())
	defer broadcaster.Shutdown()
	node := startAgentNode(tCtx, t, e, agent.SimulatedOptions{Recorder: broadcaster.NewRecorder("topodra-node-agent")})
	defer node.sim.Stop()
	startTopodra(tCtx)

	// A running pod with one GPU, prepared by the agent.
	e.pod("running", topodraName, "g", e.template(1, nil))
	claims, lost := node.prepare(tCtx, e.waitScheduled("running"))

	// The GPU fails.
	node.fail(tCtx, t, lost, resourceapi.DeviceTaintEffectNoSchedule)
	waitEvent := func(kind, name string) {
		t.Helper()
		err := wait.PollUntilContextTimeout(tCtx, framework.PollInterval, waitTimeout, true, func(ctx context.Context) (bool, error) {
			list, err := cp.Client.EventsV1().Events(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, nil
			}
			for _, ev := range list.Items {
				if ev.Reason == agent.ReasonDeviceUnhealthy && ev.Regarding.Kind == kind && ev.Regarding.Name == name && strings.Contains(ev.Note, lost) {
					t.Logf("%s %s: %s", kind, name, ev.Note)
					return true, nil
				}
			}
			return false, nil
		})
		tCtx.ExpectNoError(err, "no %s event on %s %s", agent.ReasonDeviceUnhealthy, kind, name)
	}
	waitEvent("ResourceClaim", claims[0].Name)
	waitEvent("Node", node.name)

	// The claim is released (deallocated by the claim controller; the
	// test cluster runs no garbage collector to delete it); the failed GPU
	// is not handed out again.
	tCtx.ExpectNoError(cp.Client.CoreV1().Pods(e.ns).Delete(tCtx, "running", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	var left []resourceapi.ResourceClaim
	if err := wait.PollUntilContextTimeout(tCtx, framework.PollInterval, waitTimeout, true, func(ctx context.Context) (bool, error) {
		list, err := cp.Client.ResourceV1().ResourceClaims(e.ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		left = left[:0]
		for _, c := range list.Items {
			if c.Status.Allocation != nil {
				left = append(left, c)
			}
		}
		return len(left) == 0, nil
	}); err != nil {
		for _, c := range left {
			t.Logf("claim %s: finalizers %v, deletion %v, reserved %v, allocated %v", c.Name, c.Finalizers, c.DeletionTimestamp, c.Status.ReservedFor, c.Status.Allocation != nil)
		}
		tCtx.Fatalf("the running pod's claim was not deallocated: %v", err)
	}
	e.pod("eight", topodraName, "g", e.template(8, nil))
	pod := e.waitFailed("eight")
	if msg := framework.PodScheduledCondition(pod).Message; !strings.Contains(msg, agent.HealthTaintKey) {
		t.Errorf("the 8-GPU pod's condition %q does not name the health taint %s", msg, agent.HealthTaintKey)
	}
	e.pod("seven", topodraName, "g", e.template(7, nil))
	seven := e.devicesOf(e.waitScheduled("seven"))
	for _, d := range seven {
		if strings.HasSuffix(d, "/"+lost) || d == lost {
			t.Errorf("the 7-GPU pod got the failed GPU %s: %v", lost, seven)
		}
	}
	e.expectClean()
}

// TestUnhealthyNoExecuteEvicts: with --unhealthy-taint-effect=NoExecute
// the health taint of a GPU that reports an XID has kube-controller-
// manager's device taint eviction controller evict the pod whose claim
// holds it (whether the agent prepared it or not); a pod on another GPU
// of the node stays.
func TestUnhealthyNoExecuteEvicts(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "evict")
	node := startAgentNode(tCtx, t, e, agent.SimulatedOptions{UnhealthyTaintEffect: resourceapi.DeviceTaintEffectNoExecute})
	defer node.sim.Stop()
	startTopodra(tCtx)
	defer cp.StartDeviceTaintEvictionController(tCtx)()

	e.pod("failing", topodraName, "g", e.template(1, nil))
	e.pod("other", topodraName, "g", e.template(1, nil))
	failing := e.waitScheduled("failing")
	e.waitScheduled("other")
	_, device := node.prepare(tCtx, failing)
	node.fail(tCtx, t, device, resourceapi.DeviceTaintEffectNoExecute)

	// Without a kubelet an evicted pod stays Terminating: the eviction
	// is its deletion with the DisruptionTarget condition.
	var evicted *v1.Pod
	err := wait.PollUntilContextTimeout(tCtx, framework.PollInterval, waitTimeout, true, func(ctx context.Context) (bool, error) {
		pod, err := cp.Client.CoreV1().Pods(e.ns).Get(ctx, "failing", metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		if err != nil || pod.DeletionTimestamp == nil {
			return false, nil
		}
		evicted = pod
		return true, nil
	})
	tCtx.ExpectNoError(err, "the pod on the failed GPU was not evicted")
	if evicted != nil {
		found := false
		for _, c := range evicted.Status.Conditions {
			if c.Type == v1.DisruptionTarget && c.Status == v1.ConditionTrue && c.Reason == "DeletionByDeviceTaintManager" {
				t.Logf("pod failing: %s: %s", c.Reason, c.Message)
				found = true
			}
		}
		if !found {
			t.Errorf("the evicted pod has no DisruptionTarget condition of the device taint eviction controller: %+v", evicted.Status.Conditions)
		}
	}
	other, err := cp.Client.CoreV1().Pods(e.ns).Get(tCtx, "other", metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	if other.DeletionTimestamp != nil {
		t.Errorf("the pod on a healthy GPU was evicted too")
	}
	for _, name := range []string{"failing", "other"} {
		err := cp.Client.CoreV1().Pods(e.ns).Delete(tCtx, name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)})
		if err != nil && !apierrors.IsNotFound(err) {
			tCtx.Fatalf("delete pod %s: %v", name, err)
		}
	}
}

// agentNode is a node of group "g" of an env with a simulated DGX H100
// whose agent publishes its 8 GPUs (owned taint on) and can prepare claims.
type agentNode struct {
	name    string
	machine *mockgpu.Machine
	sim     *agent.Simulated
}

// startAgentNode creates the node and starts its agent with opts (node
// name, machine, client, owned taint and directories filled in), and
// waits for its slice. The caller stops the agent (sim.Stop).
func startAgentNode(tCtx ktesting.TContext, t *testing.T, e *env, opts agent.SimulatedOptions) *agentNode {
	t.Helper()
	name := e.ns + "-g-0"
	_, err := framework.CreateReadyNodeWithCPU(tCtx, cp.Client, name, map[string]string{"test": e.ns, "group": "g"}, "256")
	tCtx.ExpectNoError(err)
	machine, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: name})
	tCtx.ExpectNoError(err)
	opts.NodeName, opts.Machine, opts.KubeClient, opts.OwnedTaint = name, machine, cp.Client, true
	opts.StateDir, opts.CDIDir = t.TempDir(), t.TempDir()
	sim, err := agent.StartSimulated(tCtx, opts)
	tCtx.ExpectNoError(err)
	waitForSlice(tCtx, t, cp.Client, topology.DriverName, name, "8 devices", func(s *resourceapi.ResourceSlice) bool { return len(s.Spec.Devices) == 8 })
	return &agentNode{name: name, machine: machine, sim: sim}
}

// prepare has the agent prepare the claims of a scheduled pod that holds
// one GPU, and returns them and the GPU.
func (n *agentNode) prepare(tCtx ktesting.TContext, pod *v1.Pod) ([]*resourceapi.ResourceClaim, string) {
	claims, err := framework.PodClaims(tCtx, cp.Client, pod)
	tCtx.ExpectNoError(err)
	if _, err := n.sim.Agent.PrepareResourceClaims(tCtx, claims); err != nil {
		tCtx.Fatalf("prepare: %v", err)
	}
	devices := framework.AllocatedDevices(claims[0])
	if len(devices) != 1 {
		tCtx.Fatalf("pod %s has devices %v, want one", pod.Name, devices)
	}
	return claims, devices[0]
}

// fail makes the GPU published as device report XID 79 and waits until
// its slice shows the health taint with effect.
func (n *agentNode) fail(tCtx ktesting.TContext, t *testing.T, device string, effect resourceapi.DeviceTaintEffect) {
	t.Helper()
	slice := waitForSlice(tCtx, t, cp.Client, topology.DriverName, n.name, "8 devices", func(*resourceapi.ResourceSlice) bool { return true })
	index := -1
	for _, d := range slice.Spec.Devices {
		if d.Name == device && d.Attributes["index"].IntValue != nil {
			index = int(*d.Attributes["index"].IntValue)
		}
	}
	if index < 0 {
		tCtx.Fatalf("device %s has no index attribute", device)
	}
	tCtx.ExpectNoError(n.machine.InjectXID(index, 79))
	waitForSlice(tCtx, t, cp.Client, topology.DriverName, n.name, string(effect)+" health taint on "+device, func(s *resourceapi.ResourceSlice) bool {
		for _, d := range s.Spec.Devices {
			for _, taint := range d.Taints {
				if d.Name == device && taint.Key == agent.HealthTaintKey && taint.Effect == effect {
					return true
				}
			}
		}
		return false
	})
}
