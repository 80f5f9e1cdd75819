package integration

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	schedulingv1 "k8s.io/api/scheduling/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/kubernetes/test/utils/ktesting"

	"github.com/topodra/topodra/config"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

const (
	topodraName = "topodra-scheduler"
	stockName   = "default-scheduler"
	waitTimeout = 60 * time.Second
)

// env is one test's slice of the shared cluster: a namespace, a GPU class
// and nodes labelled test=<namespace> that only its pods select.
type env struct {
	tCtx  ktesting.TContext
	ns    string
	class string
}

func newEnv(tCtx ktesting.TContext, prefix string) *env {
	ns, err := framework.CreateNamespace(tCtx, cp.Client, prefix)
	tCtx.ExpectNoError(err)
	e := &env{tCtx: tCtx, ns: ns, class: ns + "-gpu"}
	_, err = cp.Client.ResourceV1().DeviceClasses().Create(tCtx, framework.DeviceClass(e.class, topology.DriverName), metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	return e
}

// dgxNodes creates n DGX-like nodes (see framework.DGXLikeGPUs) in group
// (a label value pods select) and returns their names.
func (e *env) dgxNodes(group string, n int, cpu string) []string {
	var names []string
	for i := range n {
		name := fmt.Sprintf("%s-%s-%d", e.ns, group, i)
		_, err := framework.CreateReadyNodeWithCPU(e.tCtx, cp.Client, name, map[string]string{"test": e.ns, "group": group}, cpu)
		e.tCtx.ExpectNoError(err)
		_, err = cp.Client.ResourceV1().ResourceSlices().Create(e.tCtx, framework.SliceForNode(name, topology.DriverName, framework.DGXLikeGPUs(name)), metav1.CreateOptions{})
		e.tCtx.ExpectNoError(err)
		names = append(names, name)
	}
	return names
}

// template creates a ResourceClaimTemplate named gpus-<count> with one
// request for count GPUs, once.
func (e *env) template(count int64, annotations map[string]string) string {
	name := fmt.Sprintf("gpus-%d", count)
	if annotations != nil {
		name += "-annotated"
	}
	tmpl := framework.ClaimTemplate(e.ns, name, e.class, count)
	tmpl.Spec.ObjectMeta.Annotations = annotations
	_, err := cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(e.tCtx, tmpl, metav1.CreateOptions{})
	if err != nil && !strings.Contains(err.Error(), "already exists") {
		e.tCtx.ExpectNoError(err)
	}
	return name
}

// createTemplate creates tmpl in the test's namespace and returns its name.
func (e *env) createTemplate(tmpl *resourceapi.ResourceClaimTemplate) string {
	e.tCtx.Helper()
	_, err := cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(e.tCtx, tmpl, metav1.CreateOptions{})
	e.tCtx.ExpectNoError(err, "create claim template "+tmpl.Name)
	return tmpl.Name
}

// pod creates a pod for the scheduler, pinned to the node group, with one
// claim per template.
func (e *env) pod(name, scheduler, group string, templates ...string) *v1.Pod {
	return e.podEdited(name, scheduler, group, nil, templates...)
}

// podEdited is pod, with edit (if not nil) applied before the pod is
// created.
func (e *env) podEdited(name, scheduler, group string, edit func(*v1.Pod), templates ...string) *v1.Pod {
	pod := framework.PodWithClaims(e.ns, name, scheduler, templates...)
	pod.Spec.NodeSelector = map[string]string{"test": e.ns, "group": group}
	if edit != nil {
		edit(pod)
	}
	created, err := cp.Client.CoreV1().Pods(e.ns).Create(e.tCtx, pod, metav1.CreateOptions{})
	e.tCtx.ExpectNoError(err, "create pod "+name)
	return created
}

// twinNodes creates one DGX-like node in group topodra and one in group
// stock, each with the named device already allocated.
func (e *env) twinNodes(taken string) {
	for _, group := range []string{"topodra", "stock"} {
		node := e.dgxNodes(group, 1, "256")[0]
		e.preallocate("taken-"+group, node, taken)
	}
}

// sideBySide creates pod "topodra" in node group topodra and pod "stock"
// in group stock, both with a claim from template, and returns the devices
// each scheduler allocated.
func (e *env) sideBySide(template string) (topodra, stock []string) {
	e.pod("topodra", topodraName, "topodra", template)
	e.pod("stock", stockName, "stock", template)
	topodra = e.devicesOf(e.waitScheduled("topodra"))
	stock = e.devicesOf(e.waitScheduled("stock"))
	e.tCtx.Logf("topodra chose %v, stock chose %v", topodra, stock)
	return topodra, stock
}

func (e *env) waitScheduled(name string) *v1.Pod {
	pod, err := framework.WaitForPodScheduled(e.tCtx, cp.Client, e.ns, name, waitTimeout)
	e.tCtx.ExpectNoError(err)
	return pod
}

// devicesOf returns the sorted devices allocated to a scheduled pod's
// claims, after checking that each claim is allocated and reserved for it.
func (e *env) devicesOf(pod *v1.Pod) []string {
	e.tCtx.Helper()
	claims, err := framework.PodClaims(e.tCtx, cp.Client, pod)
	e.tCtx.ExpectNoError(err)
	var devices []string
	for _, c := range claims {
		if c.Status.Allocation == nil {
			e.tCtx.Fatalf("claim %s of scheduled pod %s is not allocated", c.Name, pod.Name)
		}
		if len(c.Status.ReservedFor) != 1 || c.Status.ReservedFor[0].UID != pod.UID {
			e.tCtx.Fatalf("claim %s reservedFor = %+v, want pod %s", c.Name, c.Status.ReservedFor, pod.Name)
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			if r.Pool != pod.Spec.NodeName {
				e.tCtx.Fatalf("claim %s got device %s/%s, but the pod runs on %s", c.Name, r.Pool, r.Device, pod.Spec.NodeName)
			}
		}
		devices = append(devices, framework.AllocatedDevices(c)...)
	}
	slices.Sort(devices)
	return devices
}

// dgxIndex parses "gpu-N".
func dgxIndex(device string) int {
	i, _ := strconv.Atoi(strings.TrimPrefix(device, "gpu-"))
	return i
}

// sharedDomain says whether all devices share a PCIe root / NUMA node in
// the DGX-like layout.
func sharedDomain(devices []string, groupSize int) bool {
	for _, d := range devices {
		if dgxIndex(d)/groupSize != dgxIndex(devices[0])/groupSize {
			return false
		}
	}
	return true
}

func startTopodra(tCtx ktesting.TContext) {
	stop, err := cp.StartScheduler(tCtx, framework.SchedulerOptions{Name: "topodra", Config: config.SchedulerConfig})
	tCtx.ExpectNoError(err)
	tCtx.Cleanup(stop)
}

// startTopodraEdited starts a topodra scheduler named name on the shipped
// config with its first old replaced by new; it fails the test where
// the config has no old.
func startTopodraEdited(tCtx ktesting.TContext, name, old, new string) {
	cfg := strings.Replace(string(config.SchedulerConfig), old, new, 1)
	if cfg == string(config.SchedulerConfig) {
		tCtx.Fatalf("config/scheduler-config.yaml has no %q to replace", old)
	}
	stop, err := cp.StartScheduler(tCtx, framework.SchedulerOptions{Name: name, Config: []byte(cfg)})
	tCtx.ExpectNoError(err)
	tCtx.Cleanup(stop)
}

func startStock(tCtx ktesting.TContext) {
	stop, err := cp.StartScheduler(tCtx, framework.SchedulerOptions{Name: "stock", Stock: true})
	tCtx.ExpectNoError(err)
	tCtx.Cleanup(stop)
}

// preallocate creates a claim that already holds the given devices of the
// node, as if an earlier pod had them.
func (e *env) preallocate(name, node string, devices ...string) {
	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name:    "req-0",
			Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: e.class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: int64(len(devices))},
		}}}},
	}
	created, err := cp.Client.ResourceV1().ResourceClaims(e.ns).Create(e.tCtx, claim, metav1.CreateOptions{})
	e.tCtx.ExpectNoError(err)
	var results []resourceapi.DeviceRequestAllocationResult
	for _, d := range devices {
		results = append(results, resourceapi.DeviceRequestAllocationResult{Request: "req-0", Driver: topology.DriverName, Pool: node, Device: d})
	}
	created.Status.Allocation = &resourceapi.AllocationResult{
		Devices: resourceapi.DeviceAllocationResult{Results: results},
		NodeSelector: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{
			MatchFields: []v1.NodeSelectorRequirement{{Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{node}}},
		}}},
	}
	_, err = cp.Client.ResourceV1().ResourceClaims(e.ns).UpdateStatus(e.tCtx, created, metav1.UpdateOptions{})
	e.tCtx.ExpectNoError(err)
}

// waitReserved waits until the one claim of the pod is allocated and
// reserved for it (PreBind has written it) and cond, if set, holds for it.
func (e *env) waitReserved(podName string, cond func(*resourceapi.ResourceClaim) bool) *resourceapi.ResourceClaim {
	e.tCtx.Helper()
	var claim *resourceapi.ResourceClaim
	err := wait.PollUntilContextTimeout(e.tCtx, framework.PollInterval, waitTimeout, true, func(ctx context.Context) (bool, error) {
		pod, err := cp.Client.CoreV1().Pods(e.ns).Get(ctx, podName, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		claims, err := framework.PodClaims(ctx, cp.Client, pod)
		if err != nil || len(claims) != 1 {
			return false, nil
		}
		claim = claims[0]
		return claim.Status.Allocation != nil && len(claim.Status.ReservedFor) == 1 && (cond == nil || cond(claim)), nil
	})
	e.tCtx.ExpectNoError(err, "claim of pod "+podName+" allocated and reserved")
	return claim
}

// highPriority creates the PriorityClass <namespace>-high (value 1000),
// deleted when the test ends, and returns its name.
func (e *env) highPriority() string {
	e.tCtx.Helper()
	high := &schedulingv1.PriorityClass{ObjectMeta: metav1.ObjectMeta{Name: e.ns + "-high"}, Value: 1000}
	_, err := cp.Client.SchedulingV1().PriorityClasses().Create(e.tCtx, high, metav1.CreateOptions{})
	e.tCtx.ExpectNoError(err)
	e.tCtx.Cleanup(func() {
		_ = cp.Client.SchedulingV1().PriorityClasses().Delete(context.Background(), high.Name, metav1.DeleteOptions{})
	})
	// The API server's Priority admission reads classes from its own
	// informer: wait until it knows this one.
	probe := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "priority-probe", Namespace: e.ns},
		Spec:       v1.PodSpec{PriorityClassName: high.Name, Containers: []v1.Container{{Name: "c", Image: "probe"}}},
	}
	err = wait.PollUntilContextTimeout(e.tCtx, 50*time.Millisecond, waitTimeout, true, func(ctx context.Context) (bool, error) {
		_, err := cp.Client.CoreV1().Pods(e.ns).Create(ctx, probe, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err == nil, nil
	})
	e.tCtx.ExpectNoError(err, "the API server never admitted a pod of PriorityClass "+high.Name)
	return high.Name
}
