package integration

import (
	"fmt"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	apiresource "k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/kubernetes/test/utils/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// waitFailed waits until the scheduler has given up on the pod for now
// (PodScheduled false, for any reason: Unschedulable, or SchedulerError when
// the cycle failed) and returns it.
func (e *env) waitFailed(name string) *v1.Pod {
	e.tCtx.Helper()
	pod, err := framework.WaitForPod(e.tCtx, cp.Client, e.ns, name, waitTimeout, "not scheduled", func(p *v1.Pod) (bool, error) {
		if p.Spec.NodeName != "" {
			return false, fmt.Errorf("pod was scheduled to %s", p.Spec.NodeName)
		}
		c := framework.PodScheduledCondition(p)
		return c != nil && c.Status == v1.ConditionFalse, nil
	})
	e.tCtx.ExpectNoError(err)
	return pod
}

// TestCELRuntimeErrorFailsPod: a selector that fails at run time on the
// devices of one node and matches on another. The stock plugin fails the
// pod's whole cycle rather than placing it where the selector happens not
// to fail; topodra must do the same, and say why on the pod.
func TestCELRuntimeErrorFailsPod(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "celfail")
	const selector = `device.attributes["gpu.topodra.io"].special == "yes"`
	for _, group := range []string{"topodra", "stock"} {
		e.dgxNodes(group, 1, "256") // no "special" attribute: the selector errors
		name := fmt.Sprintf("%s-%s-special", e.ns, group)
		_, err := framework.CreateReadyNodeWithCPU(tCtx, cp.Client, name, map[string]string{"test": e.ns, "group": group}, "256")
		tCtx.ExpectNoError(err)
		special := []framework.Device{{Name: "gpu-0", Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"special": framework.StringAttr("yes")}}}
		_, err = cp.Client.ResourceV1().ResourceSlices().Create(tCtx, framework.SliceForNode(name, topology.DriverName, special), metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
	}
	tmpl := framework.ClaimTemplate(e.ns, "special", e.class, 1)
	tmpl.Spec.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: selector}}}
	_, err := cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(tCtx, tmpl, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	startTopodra(tCtx)
	startStock(tCtx)

	e.pod("topodra", topodraName, "topodra", "special")
	e.pod("stock", stockName, "stock", "special")
	for _, name := range []string{"stock", "topodra"} {
		pod := e.waitFailed(name)
		c := framework.PodScheduledCondition(pod)
		t.Logf("%s: %s: %s", name, c.Reason, c.Message)
		if name == "topodra" && !strings.Contains(c.Message, selector) {
			t.Errorf("topodra's pod condition %q does not name the expression", c.Message)
		}
	}
}

// TestBindingFailureReallocates: the devices have binding conditions. The
// "driver" reports a binding failure on the device topodra chose and taints
// it. The allocation must be released (Filter marks the claim unavailable,
// PostFilter deallocates it) and the pod must end up on another device,
// instead of retrying the failed one until the timeout.
func TestBindingFailureReallocates(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "bindfail")
	node := fmt.Sprintf("%s-a-0", e.ns)
	_, err := framework.CreateReadyNode(tCtx, cp.Client, node, map[string]string{"test": e.ns, "group": "a"})
	tCtx.ExpectNoError(err)
	slice := framework.SliceForNode(node, topology.DriverName, framework.DGXLikeGPUs(node))
	for i := range slice.Spec.Devices {
		slice.Spec.Devices[i].BindsToNode = ptr.To(true)
		slice.Spec.Devices[i].BindingConditions = []string{"Attached"}
		slice.Spec.Devices[i].BindingFailureConditions = []string{"AttachFailed"}
	}
	slice, err = cp.Client.ResourceV1().ResourceSlices().Create(tCtx, slice, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	one := e.template(1, nil)
	startTopodra(tCtx)
	e.pod("job", topodraName, "a", one)

	// waitAllocated waits until the pod's claim is allocated and reserved
	// (the scheduler waits in PreBind) on a device other than avoid.
	waitAllocated := func(avoid string) *resourceapi.ResourceClaim {
		return e.waitReserved("job", func(c *resourceapi.ResourceClaim) bool { return framework.AllocatedDevices(c)[0] != avoid })
	}
	setCondition := func(claim *resourceapi.ResourceClaim, condition string) {
		r := claim.Status.Allocation.Devices.Results[0]
		st := resourceapi.AllocatedDeviceStatus{Driver: r.Driver, Pool: r.Pool, Device: r.Device}
		apimeta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: condition, Status: metav1.ConditionTrue, Reason: condition, ObservedGeneration: claim.Generation})
		claim.Status.Devices = []resourceapi.AllocatedDeviceStatus{st}
		_, err := cp.Client.ResourceV1().ResourceClaims(e.ns).UpdateStatus(tCtx, claim, metav1.UpdateOptions{})
		tCtx.ExpectNoError(err)
	}

	claim := waitAllocated("")
	failed := framework.AllocatedDevices(claim)[0]
	t.Logf("first allocation: %s; the driver reports AttachFailed and taints it", failed)
	for i := range slice.Spec.Devices {
		if slice.Spec.Devices[i].Name == failed {
			slice.Spec.Devices[i].Taints = []resourceapi.DeviceTaint{{Key: "example.com/attach-failed", Effect: resourceapi.DeviceTaintEffectNoSchedule}}
		}
	}
	_, err = cp.Client.ResourceV1().ResourceSlices().Update(tCtx, slice, metav1.UpdateOptions{})
	tCtx.ExpectNoError(err)
	setCondition(claim, "AttachFailed")

	claim = waitAllocated(failed)
	second := framework.AllocatedDevices(claim)[0]
	t.Logf("reallocated to %s; the driver confirms it", second)
	setCondition(claim, "Attached")
	pod := e.waitScheduled("job")
	if got := e.devicesOf(pod); len(got) != 1 || got[0] != second {
		t.Errorf("pod runs with %v, want [%s]", got, second)
	}
	events, err := cp.Client.EventsV1().Events(e.ns).List(tCtx, metav1.ListOptions{FieldSelector: "regarding.name=job"})
	tCtx.ExpectNoError(err)
	pending := false
	for _, ev := range events.Items {
		pending = pending || ev.Reason == "BindingConditionsPending"
	}
	if !pending {
		t.Error("no BindingConditionsPending event on the pod")
	}
}

// TestPrioritizedListPrefersFirstChoice: a claim prefers an H100 and takes
// any GPU otherwise. The node with H100s is small and the other large, so
// the resource scores lean to the large one. topodra, which scores the
// choice before topology, places the pod where it gets its first choice.
// The stock plugin scores the choice too, but with its default weight the
// resource scores can outweigh it; the test logs what stock chose.
func TestPrioritizedListPrefersFirstChoice(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "firstchoice")
	gpusOf := func(model string) []framework.Device {
		var out []framework.Device
		for i := range 2 {
			out = append(out, framework.Device{Name: fmt.Sprintf("gpu-%d", i), Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"model":               framework.StringAttr(model),
				topology.AttrPCIeRoot: framework.StringAttr("pci0"),
			}})
		}
		return out
	}
	for _, group := range []string{"topodra", "stock"} {
		for model, cpu := range map[string]string{"h100": "4", "a100": "256"} {
			name := fmt.Sprintf("%s-%s-%s", e.ns, group, model)
			_, err := framework.CreateReadyNodeWithCPU(tCtx, cp.Client, name, map[string]string{"test": e.ns, "group": group}, cpu)
			tCtx.ExpectNoError(err)
			_, err = cp.Client.ResourceV1().ResourceSlices().Create(tCtx, framework.SliceForNode(name, topology.DriverName, gpusOf(model)), metav1.CreateOptions{})
			tCtx.ExpectNoError(err)
		}
	}
	tmpl := framework.ClaimTemplate(e.ns, "prefer-h100", e.class)
	tmpl.Spec.Spec.Devices.Requests = []resourceapi.DeviceRequest{{
		Name: "gpu",
		FirstAvailable: []resourceapi.DeviceSubRequest{
			{Name: "h100", DeviceClassName: e.class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
				Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: `device.attributes["gpu.topodra.io"].model == "h100"`}}}},
			{Name: "any", DeviceClassName: e.class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
		},
	}}
	_, err := cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(tCtx, tmpl, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	startTopodra(tCtx)
	startStock(tCtx)

	for _, group := range []string{"topodra", "stock"} {
		pod := framework.PodWithClaims(e.ns, group, map[string]string{"topodra": topodraName, "stock": stockName}[group], "prefer-h100")
		pod.Spec.NodeSelector = map[string]string{"test": e.ns, "group": group}
		pod.Spec.Containers[0].Resources.Requests = v1.ResourceList{v1.ResourceCPU: apiresource.MustParse("2")}
		_, err := cp.Client.CoreV1().Pods(e.ns).Create(tCtx, pod, metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
	}
	for _, group := range []string{"stock", "topodra"} {
		pod := e.waitScheduled(group)
		claims, err := framework.PodClaims(tCtx, cp.Client, pod)
		tCtx.ExpectNoError(err)
		request := claims[0].Status.Allocation.Devices.Results[0].Request
		t.Logf("%s: node %s, request %s", group, pod.Spec.NodeName, request)
		if want := fmt.Sprintf("%s-%s-h100", e.ns, group); group == "topodra" && (pod.Spec.NodeName != want || request != "gpu/h100") {
			t.Errorf("%s placed the pod on %s with %s, want %s with gpu/h100 (its first choice)", group, pod.Spec.NodeName, request, want)
		}
	}
}
