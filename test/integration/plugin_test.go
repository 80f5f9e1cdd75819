package integration

import (
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/component-base/metrics/legacyregistry"
	"k8s.io/kubernetes/test/utils/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

func TestAlignedPlacement(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "aligned")
	e.dgxNodes("a", 2, "256")
	two, four := e.template(2, nil), e.template(4, nil)
	startTopodra(tCtx)

	// Several pods of each size, so later ones land next to earlier ones.
	for i := range 3 {
		e.pod(fmt.Sprintf("two-%d", i), topodraName, "a", two)
		e.waitScheduled(fmt.Sprintf("two-%d", i))
	}
	for i := range 2 {
		e.pod(fmt.Sprintf("four-%d", i), topodraName, "a", four)
		e.waitScheduled(fmt.Sprintf("four-%d", i))
	}
	for _, name := range []string{"two-0", "two-1", "two-2", "four-0", "four-1"} {
		pod, err := cp.Client.CoreV1().Pods(e.ns).Get(tCtx, name, metav1.GetOptions{})
		tCtx.ExpectNoError(err)
		devices := e.devicesOf(pod)
		switch {
		case strings.HasPrefix(name, "two"):
			if len(devices) != 2 || !sharedDomain(devices, 2) {
				t.Errorf("pod %s got %v on %s, want 2 GPUs sharing one PCIe root", name, devices, pod.Spec.NodeName)
			}
		default:
			if len(devices) != 4 || !sharedDomain(devices, 4) {
				t.Errorf("pod %s got %v on %s, want 4 GPUs in one NUMA node", name, devices, pod.Spec.NodeName)
			}
		}
		t.Logf("pod %s: node %s devices %v", name, pod.Spec.NodeName, devices)
	}
	// The plugin's metrics saw the placements.
	families, err := legacyregistry.DefaultGatherer.Gather()
	tCtx.ExpectNoError(err)
	seen := map[string]bool{}
	for _, mf := range families {
		for _, m := range mf.GetMetric() {
			if (m.GetCounter() != nil && m.GetCounter().GetValue() > 0) || (m.GetHistogram() != nil && m.GetHistogram().GetSampleCount() > 0) {
				seen[mf.GetName()] = true
			}
		}
	}
	for _, name := range []string{"topodra_placements_total", "topodra_allocation_duration_seconds", "topodra_devices_considered", "topodra_devices_per_placement"} {
		if !seen[name] {
			t.Errorf("metric %s has no samples", name)
		}
	}

	// The scheduled pod has an event naming its devices.
	events, err := cp.Client.EventsV1().Events(e.ns).List(tCtx, metav1.ListOptions{FieldSelector: "regarding.name=two-0"})
	tCtx.ExpectNoError(err)
	found := false
	for _, ev := range events.Items {
		if ev.Reason == "DevicesAllocated" && strings.Contains(ev.Note, string(topology.AttrPCIeRoot)) {
			found = true
		}
	}
	if !found {
		t.Errorf("no DevicesAllocated event naming the shared PCIe root on pod two-0; events: %d", len(events.Items))
	}
}

// TestFirstFitTrap: gpu-0 is taken. First-fit gives a 2-GPU claim gpu-1 and
// gpu-2 (two PCIe roots); topodra gives gpu-2,gpu-3 (one root, and in the
// NUMA node that is already in use, keeping NUMA node 1 whole).
func TestFirstFitTrap(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "trap")
	e.twinNodes("gpu-0")
	two := e.template(2, nil)
	startTopodra(tCtx)
	startStock(tCtx)

	got, stock := e.sideBySide(two)
	if strings.Join(got, ",") != "gpu-2,gpu-3" {
		t.Errorf("topodra allocated %v, want gpu-2,gpu-3", got)
	}
	if strings.Join(stock, ",") != "gpu-1,gpu-2" {
		t.Errorf("stock allocated %v; this test documents first-fit choosing gpu-1,gpu-2", stock)
	}
}

// TestFragmentationVsStock runs one sequence of 1/2/4/8-GPU pods, one at a
// time, through both schedulers on identical 4-node clusters.
func TestFragmentationVsStock(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "frag")
	// Small CPU capacity: the stock profile's default-request spreading
	// (NodeResourcesFit LeastAllocated) then decides its placement
	// deterministically.
	e.dgxNodes("topodra", 4, "8")
	e.dgxNodes("stock", 4, "8")
	startTopodra(tCtx)
	startStock(tCtx)

	// The crafted sequence: a burst of small jobs, then big ones that
	// together exactly fill the 32 GPUs, then one more that cannot fit
	// if they all did.
	var sizes []int64
	for range 12 {
		sizes = append(sizes, 1)
	}
	sizes = append(sizes, 8, 8, 2, 2, 4)
	for _, s := range []int64{1, 2, 4, 8} {
		e.template(s, nil)
	}
	type outcome struct{ placed, placed8 int }
	results := map[string]*outcome{"topodra": {}, "stock": {}}
	for i, size := range sizes {
		for group, sched := range map[string]string{"topodra": topodraName, "stock": stockName} {
			name := fmt.Sprintf("%s-%02d-%dgpu", group, i, size)
			e.pod(name, sched, group, fmt.Sprintf("gpus-%d", size))
			pod, err := framework.WaitForPod(tCtx, cp.Client, e.ns, name, waitTimeout, "scheduled or unschedulable", func(p *v1.Pod) (bool, error) {
				c := framework.PodScheduledCondition(p)
				return p.Spec.NodeName != "" || (c != nil && c.Reason == v1.PodReasonUnschedulable), nil
			})
			tCtx.ExpectNoError(err)
			if pod.Spec.NodeName != "" {
				results[group].placed++
				if size == 8 {
					results[group].placed8++
				}
			} else {
				// Leave no pending pod behind to take devices later.
				tCtx.ExpectNoError(cp.Client.CoreV1().Pods(e.ns).Delete(tCtx, name, metav1.DeleteOptions{}))
			}
		}
	}
	topo, stock := results["topodra"], results["stock"]
	t.Logf("of %d pods: topodra placed %d (8-GPU: %d), stock placed %d (8-GPU: %d)", len(sizes), topo.placed, topo.placed8, stock.placed, stock.placed8)
	fmt.Printf("TestFragmentationVsStock: of %d pods topodra placed %d (8-GPU: %d), stock placed %d (8-GPU: %d)\n", len(sizes), topo.placed, topo.placed8, stock.placed, stock.placed8)
	if topo.placed < stock.placed {
		t.Errorf("topodra placed fewer pods (%d) than stock (%d)", topo.placed, stock.placed)
	}
	if topo.placed8 <= stock.placed8 {
		t.Errorf("topodra placed %d 8-GPU pods, stock %d: want strictly more", topo.placed8, stock.placed8)
	}
}

func TestRequeueOnNewSlice(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "requeue")
	node := fmt.Sprintf("%s-a-0", e.ns)
	_, err := framework.CreateReadyNode(tCtx, cp.Client, node, map[string]string{"test": e.ns, "group": "a"})
	tCtx.ExpectNoError(err)
	four := e.template(4, nil)
	startTopodra(tCtx)

	e.pod("waiting", topodraName, "a", four)
	pod, err := framework.WaitForPodUnschedulable(tCtx, cp.Client, e.ns, "waiting", waitTimeout)
	tCtx.ExpectNoError(err)
	t.Logf("before the slice: %s", framework.PodScheduledCondition(pod).Message)

	_, err = cp.Client.ResourceV1().ResourceSlices().Create(tCtx, framework.SliceForNode(node, topology.DriverName, framework.DGXLikeGPUs(node)), metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	devices := e.devicesOf(e.waitScheduled("waiting"))
	if len(devices) != 4 || !sharedDomain(devices, 4) {
		t.Errorf("got %v, want 4 GPUs of one NUMA node", devices)
	}
}

func TestInvalidCELIsReported(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "badcel")
	e.dgxNodes("a", 1, "256")
	// The apiserver rejects selectors that do not compile, so the error a
	// scheduler sees is a runtime one: an attribute that no device has.
	const broken = `device.attributes["gpu.topodra.io"].noSuchAttribute > 3`
	tmpl := framework.ClaimTemplate(e.ns, "broken", e.class, 1)
	tmpl.Spec.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: broken}}}
	_, err := cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(tCtx, tmpl, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	one := e.template(1, nil)
	startTopodra(tCtx)

	e.pod("broken", topodraName, "a", "broken")
	e.pod("fine", topodraName, "a", one)
	pod := e.waitFailed("broken")
	msg := framework.PodScheduledCondition(pod).Message
	if !strings.Contains(msg, broken) || !strings.Contains(msg, "req-0") {
		t.Errorf("pod condition %q does not name the request and the expression %q", msg, broken)
	}
	e.waitScheduled("fine")
	// The claim carries a warning event too.
	claims, err := cp.Client.ResourceV1().ResourceClaims(e.ns).List(tCtx, metav1.ListOptions{})
	tCtx.ExpectNoError(err)
	var brokenClaim string
	for _, c := range claims.Items {
		if strings.HasPrefix(c.Name, "broken-") {
			brokenClaim = c.Name
		}
	}
	deadline := time.Now().Add(waitTimeout)
	for {
		events, err := cp.Client.EventsV1().Events(e.ns).List(tCtx, metav1.ListOptions{FieldSelector: "regarding.name=" + brokenClaim})
		tCtx.ExpectNoError(err)
		if len(events.Items) > 0 && events.Items[0].Reason == "InvalidClaim" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no InvalidClaim event on claim %s", brokenClaim)
		}
		time.Sleep(framework.PollInterval)
	}
}

// TestMatchAttributeConstraint: claims with matchAttribute on the PCIe
// root are decided by counting per root in Filter and verified by upstream
// in Reserve. topodra fills the fuller NUMA node where stock takes the
// first root; a claim no root can hold is reported on the pod.
func TestMatchAttributeConstraint(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "match")
	e.twinNodes("gpu-4")
	sameRoot := func(name string, n int) string {
		tmpl := framework.ClaimTemplate(e.ns, name, e.class, 1)
		req := tmpl.Spec.Spec.Devices.Requests[0]
		tmpl.Spec.Spec.Devices.Requests = nil
		for i := range n {
			r := *req.DeepCopy()
			r.Name = fmt.Sprintf("gpu-%d", i)
			tmpl.Spec.Spec.Devices.Requests = append(tmpl.Spec.Spec.Devices.Requests, r)
		}
		tmpl.Spec.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(topology.AttrPCIeRoot))}}
		_, err := cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(tCtx, tmpl, metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
		return name
	}
	two := sameRoot("same-root-2", 2)
	three := sameRoot("same-root-3", 3)
	startTopodra(tCtx)
	startStock(tCtx)

	got, stock := e.sideBySide(two)
	if strings.Join(got, ",") != "gpu-6,gpu-7" {
		t.Errorf("topodra allocated %v, want gpu-6,gpu-7 (the free root of the fuller NUMA node)", got)
	}
	if !sharedDomain(stock, 2) {
		t.Errorf("stock allocated %v, which violates the constraint", stock)
	}

	e.pod("too-big", topodraName, "topodra", three)
	pod, err := framework.WaitForPodUnschedulable(tCtx, cp.Client, e.ns, "too-big", waitTimeout)
	tCtx.ExpectNoError(err)
	msg := framework.PodScheduledCondition(pod).Message
	if !strings.Contains(msg, "no single value of resource.kubernetes.io/pcieRoot has free devices for all requests") {
		t.Errorf("pod condition %q does not explain the constraint", msg)
	}
}

// TestDRAExtendedResource: a pod that asks for an extended resource backed
// by a DeviceClass (DRAExtendedResource) gets, on a node where only DRA
// provides it, a claim that the scheduler creates: owned by the pod,
// marked by the extended resource claim annotation, allocated with
// topology in mind (two GPUs on one PCIe root or NUMA node), and named in
// the pod's status with the container's request. The implicit name of
// the class works the same. A node that offers the resource through a
// device plugin takes the pod without a claim.
func TestDRAExtendedResource(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "extres")
	resourceName := v1.ResourceName("example.com/" + e.ns)
	class := framework.DeviceClass(e.ns+"-extended", topology.DriverName)
	class.Spec.ExtendedResourceName = ptr.To(string(resourceName))
	_, err := cp.Client.ResourceV1().DeviceClasses().Create(tCtx, class, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	draNodes := e.dgxNodes("dra", 1, "256")
	startTopodra(tCtx)

	withResource := func(name, group string, resourceName v1.ResourceName, n int64) {
		pod := framework.PodWithClaims(e.ns, name, topodraName)
		pod.Spec.NodeSelector = map[string]string{"test": e.ns, "group": group}
		pod.Spec.Containers[0].Resources.Limits = v1.ResourceList{resourceName: *resource.NewQuantity(n, resource.DecimalSI)}
		_, err := cp.Client.CoreV1().Pods(e.ns).Create(tCtx, pod, metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
	}
	// The class's extendedResourceName, and the implicit name every class has.
	implicit := v1.ResourceName(resourceapi.ResourceDeviceClassPrefix + class.Name)
	for podName, name := range map[string]v1.ResourceName{"dra-only": resourceName, "implicit-name": implicit} {
		withResource(podName, "dra", name, 2)
		pod := e.waitScheduled(podName)
		if pod.Spec.NodeName != draNodes[0] {
			t.Errorf("pod %s scheduled on %s, want %s", podName, pod.Spec.NodeName, draNodes[0])
		}
		// PreBind names the claim in the pod's status before binding.
		status := pod.Status.ExtendedResourceClaimStatus
		if status == nil || status.ResourceClaimName == "" {
			t.Errorf("pod %s: no status.extendedResourceClaimStatus", podName)
			continue
		}
		claim, err := cp.Client.ResourceV1().ResourceClaims(e.ns).Get(tCtx, status.ResourceClaimName, metav1.GetOptions{})
		tCtx.ExpectNoError(err)
		if claim.Annotations[resourceapi.ExtendedResourceClaimAnnotation] != "true" {
			t.Errorf("pod %s: claim %s annotations %v", podName, claim.Name, claim.Annotations)
		}
		owner := metav1.GetControllerOf(claim)
		if owner == nil || owner.Kind != "Pod" || owner.UID != pod.UID {
			t.Errorf("pod %s: claim %s controller %+v, want the pod", podName, claim.Name, owner)
		}
		if len(claim.Status.ReservedFor) != 1 || claim.Status.ReservedFor[0].UID != pod.UID {
			t.Errorf("pod %s: claim %s reservedFor %v", podName, claim.Name, claim.Status.ReservedFor)
		}
		devices := framework.AllocatedDevices(claim)
		// DGX-like GPUs: two per PCIe root, four per NUMA node.
		if len(devices) != 2 || !sharedDomain(devices, 4) {
			t.Errorf("pod %s: claim %s allocated %v, want two GPUs of one NUMA node", podName, claim.Name, devices)
		}
		if len(claim.Spec.Devices.Requests) != 1 {
			t.Fatalf("pod %s: claim %s requests %+v, want one", podName, claim.Name, claim.Spec.Devices.Requests)
		}
		req := claim.Spec.Devices.Requests[0]
		if req.Exactly == nil || req.Exactly.DeviceClassName != class.Name || req.Exactly.Count != 2 {
			t.Errorf("pod %s: claim %s request %+v, want 2 devices of class %s", podName, claim.Name, req, class.Name)
		}
		want := []v1.ContainerExtendedResourceRequest{{ContainerName: pod.Spec.Containers[0].Name, ResourceName: string(name), RequestName: req.Name}}
		if fmt.Sprint(status.RequestMappings) != fmt.Sprint(want) {
			t.Errorf("pod %s: request mappings %+v, want %+v", podName, status.RequestMappings, want)
		}
	}

	// A device-plugin node: the resource is in its allocatable.
	name := e.ns + "-device-plugin"
	node, err := framework.CreateReadyNode(tCtx, cp.Client, name, map[string]string{"test": e.ns, "group": "device-plugin"})
	tCtx.ExpectNoError(err)
	node.Status.Capacity[resourceName] = resource.MustParse("2")
	node.Status.Allocatable[resourceName] = resource.MustParse("2")
	_, err = cp.Client.CoreV1().Nodes().UpdateStatus(tCtx, node, metav1.UpdateOptions{})
	tCtx.ExpectNoError(err)
	withResource("device-plugin", "device-plugin", resourceName, 1)
	pod := e.waitScheduled("device-plugin")
	if pod.Spec.NodeName != name {
		t.Errorf("pod scheduled on %s, want %s", pod.Spec.NodeName, name)
	}
	if pod.Status.ExtendedResourceClaimStatus != nil {
		t.Errorf("pod on the device-plugin node has an extended resource claim: %+v", pod.Status.ExtendedResourceClaimStatus)
	}

	// A pod whose status names the claim of an earlier attempt, which the
	// API server keeps once written, cannot use the device-plugin node: the
	// kubelet would look for that claim. It waits, and says why.
	earlier := framework.PodWithClaims(e.ns, "earlier-status", topodraName)
	earlier.Spec.NodeSelector = map[string]string{"test": e.ns, "group": "device-plugin"}
	earlier.Spec.Containers[0].Resources.Limits = v1.ResourceList{resourceName: resource.MustParse("1")}
	earlier.Spec.SchedulingGates = []v1.PodSchedulingGate{{Name: "test.topodra.io/hold"}}
	earlier, err = cp.Client.CoreV1().Pods(e.ns).Create(tCtx, earlier, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	gone := "earlier-status-extended-resources-gone"
	earlier.Status.ExtendedResourceClaimStatus = &v1.PodExtendedResourceClaimStatus{ResourceClaimName: gone, RequestMappings: []v1.ContainerExtendedResourceRequest{
		{ContainerName: earlier.Spec.Containers[0].Name, ResourceName: string(resourceName), RequestName: "container-0-request-0"}}}
	_, err = cp.Client.CoreV1().Pods(e.ns).UpdateStatus(tCtx, earlier, metav1.UpdateOptions{})
	tCtx.ExpectNoError(err)
	kept, err := cp.Client.CoreV1().Pods(e.ns).Patch(tCtx, earlier.Name, types.MergePatchType, []byte(`{"status":{"extendedResourceClaimStatus":null}}`), metav1.PatchOptions{}, "status")
	tCtx.ExpectNoError(err)
	if kept.Status.ExtendedResourceClaimStatus == nil {
		t.Errorf("the API server cleared status.extendedResourceClaimStatus; such pods could then use device plugins")
	}
	_, err = cp.Client.CoreV1().Pods(e.ns).Patch(tCtx, earlier.Name, types.JSONPatchType, []byte(`[{"op":"remove","path":"/spec/schedulingGates"}]`), metav1.PatchOptions{})
	tCtx.ExpectNoError(err)
	pod, err = framework.WaitForPodUnschedulable(tCtx, cp.Client, e.ns, earlier.Name, waitTimeout)
	tCtx.ExpectNoError(err)
	if c := framework.PodScheduledCondition(pod); !strings.Contains(c.Message, gone) {
		t.Errorf("pod %s: PodScheduled message %q, want it to name claim %s", pod.Name, c.Message, gone)
	}
}
