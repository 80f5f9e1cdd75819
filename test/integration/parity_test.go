package integration

import (
	"fmt"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/kubernetes/test/utils/ktesting"

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
