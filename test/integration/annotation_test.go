package integration

import (
	"fmt"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/kubernetes/test/utils/ktesting"

	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// TestAlignmentRequireAnnotation: one GPU of every PCIe root is taken, so 4
// GPUs are free but no NUMA node has four. A claim whose template says
// topodra.io/alignment: require stays pending with a message saying so; the
// same request with the default (prefer) is placed across NUMA nodes.
func TestAlignmentRequireAnnotation(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "require")
	// A PCIe box without NVLink: on a DGX all eight GPUs share the NVSwitch
	// clique, which satisfies require by itself.
	node := fmt.Sprintf("%s-a-0", e.ns)
	_, err := framework.CreateReadyNode(tCtx, cp.Client, node, map[string]string{"test": e.ns, "group": "a"})
	tCtx.ExpectNoError(err)
	gpus := framework.DGXLikeGPUs(node)
	for _, g := range gpus {
		delete(g.Attributes, "nvlinkClique")
	}
	_, err = cp.Client.ResourceV1().ResourceSlices().Create(tCtx, framework.SliceForNode(node, topology.DriverName, gpus), metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	for _, d := range []string{"gpu-0", "gpu-2", "gpu-4", "gpu-6"} {
		e.preallocate("taken-"+d, node, d)
	}
	require := e.template(4, map[string]string{topology.AnnotationAlignment: "require"})
	prefer := e.template(4, nil)
	startTopodra(tCtx)

	e.pod("strict", topodraName, "a", require)
	var pod *v1.Pod
	pod, err = framework.WaitForPodUnschedulable(tCtx, cp.Client, e.ns, "strict", waitTimeout)
	tCtx.ExpectNoError(err)
	msg := framework.PodScheduledCondition(pod).Message
	t.Logf("require: %s", msg)
	if !strings.Contains(msg, "require") {
		t.Errorf("unschedulable message %q does not mention alignment=require", msg)
	}

	e.pod("relaxed", topodraName, "a", prefer)
	devices := e.devicesOf(e.waitScheduled("relaxed"))
	if fmt.Sprint(devices) != "[gpu-1 gpu-3 gpu-5 gpu-7]" {
		t.Errorf("prefer got %v, want the four free GPUs", devices)
	}
}
