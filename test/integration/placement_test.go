package integration

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/component-base/metrics/legacyregistry"
	"k8s.io/kubernetes/test/utils/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/config"
	"github.com/topodra/topodra/pkg/measure"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// pcieNVLinkPairsGPUs is a PCIe box: eight GPUs, each on its own PCIe
// root, NVLink bridges joining pairs (0+1, 2+3, ...), NUMA nodes 0-3 and
// 4-7.
func pcieNVLinkPairsGPUs(node string) []framework.Device {
	var devices []framework.Device
	for i := range 8 {
		devices = append(devices, framework.Device{
			Name: fmt.Sprintf("gpu-%d", i),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				topology.AttrPCIeRoot: framework.StringAttr(fmt.Sprintf("pci0000:%02x", i)),
				topology.AttrNUMANode: framework.IntAttr(int64(i / 4)),
				"nvlinkClique":        framework.StringAttr(fmt.Sprintf("%s-pair-%d", node, i/2)),
				"index":               framework.IntAttr(int64(i)),
			},
		})
	}
	return devices
}

// node creates one node in group with the given devices and the named
// devices already allocated, and returns its name.
func (e *env) node(group, suffix string, devices func(string) []framework.Device, taken ...string) string {
	name := fmt.Sprintf("%s-%s-%s", e.ns, group, suffix)
	_, err := framework.CreateReadyNodeWithCPU(e.tCtx, cp.Client, name, map[string]string{"test": e.ns, "group": group}, "256")
	e.tCtx.ExpectNoError(err)
	_, err = cp.Client.ResourceV1().ResourceSlices().Create(e.tCtx, framework.SliceForNode(name, topology.DriverName, devices(name)), metav1.CreateOptions{})
	e.tCtx.ExpectNoError(err)
	for _, d := range taken {
		e.preallocate("taken-"+group+"-"+suffix+"-"+d, name, d)
	}
	return name
}

// schedule creates a topodra pod in group and waits until it is bound.
func (e *env) schedule(name, group string, templates ...string) (node string, devices []string) {
	e.pod(name, topodraName, group, templates...)
	pod := e.waitScheduled(name)
	return pod.Spec.NodeName, e.devicesOf(pod)
}

// hostRequests is what a pod with gpus GPUs requests besides them, at
// cpu CPUs and gib GiB of memory per GPU.
func hostRequests(gpus, cpu, gib int64) v1.ResourceList {
	return v1.ResourceList{
		v1.ResourceCPU:    *resource.NewQuantity(cpu*gpus, resource.DecimalSI),
		v1.ResourceMemory: *resource.NewQuantity(gib*gpus<<30, resource.BinarySI),
	}
}

// boundPod creates a pod without claims already bound to node, holding
// only the given CPU and memory there.
func (e *env) boundPod(name, node string, requests v1.ResourceList) {
	e.tCtx.Helper()
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns},
		Spec: v1.PodSpec{NodeName: node, Containers: []v1.Container{{
			Name: "c", Image: "registry.k8s.io/pause:3.10", Resources: v1.ResourceRequirements{Requests: requests},
		}}},
	}
	_, err := cp.Client.CoreV1().Pods(e.ns).Create(e.tCtx, pod, metav1.CreateOptions{})
	e.tCtx.ExpectNoError(err, "create pod "+name)
}

// TestLargeJobKeepsRoom: a 4-GPU pod goes to the used DGX that has a whole
// free NUMA node, not to the empty DGX, so that an 8-GPU pod still fits.
func TestLargeJobKeepsRoom(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "room")
	empty := e.node("a", "empty", framework.DGXLikeGPUs)
	used := e.node("a", "used", framework.DGXLikeGPUs, "gpu-0", "gpu-1")
	four, eight := e.template(4, nil), e.template(8, nil)
	startTopodra(tCtx)

	node, devices := e.schedule("four", "a", four)
	if node != used || len(devices) != 4 || !sharedDomain(devices, 4) {
		t.Fatalf("4-GPU pod got %v on %s, want the free NUMA node of %s (not the empty %s)", devices, node, used, empty)
	}
	node, devices = e.schedule("eight", "a", eight)
	if node != empty || len(devices) != 8 {
		t.Fatalf("8-GPU pod got %v on %s, want all of %s", devices, node, empty)
	}
}

// TestSmallPodsConsolidate: 1-GPU pods fill a used node, of either
// profile, before they open an empty one; also when each pod requests CPU
// and memory as GPU pods do, which NodeResourcesFit's LeastAllocated score
// (on in topodra's profile) holds against the fuller node.
func TestSmallPodsConsolidate(t *testing.T) {
	profiles := map[string]func(string) []framework.Device{
		"dgx":               framework.DGXLikeGPUs,
		"pcie-nvlink-pairs": pcieNVLinkPairsGPUs,
	}
	for name, usedProfile := range profiles {
		for _, withRequests := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/host-requests=%v", name, withRequests), func(t *testing.T) {
				tCtx := ktesting.Init(t)
				e := newEnv(tCtx, "consolidate")
				e.node("a", "empty-dgx", framework.DGXLikeGPUs)
				e.node("a", "empty-pcie", pcieNVLinkPairsGPUs)
				used := e.node("a", "used", usedProfile, "gpu-5")
				one := e.template(1, nil)
				startTopodra(tCtx)

				// Seven pods fill the used node's seven free GPUs.
				for i := range 7 {
					podName := fmt.Sprintf("one-%d", i)
					pod := framework.PodWithClaims(e.ns, podName, topodraName, one)
					pod.Spec.NodeSelector = map[string]string{"test": e.ns, "group": "a"}
					if withRequests {
						// Per GPU, as in the simulator's workloads:
						// eight GPUs' worth is three quarters of the
						// node's 256 CPUs and 2 TiB.
						pod.Spec.Containers[0].Resources.Requests = hostRequests(1, 24, 192)
					}
					_, err := cp.Client.CoreV1().Pods(e.ns).Create(tCtx, pod, metav1.CreateOptions{})
					tCtx.ExpectNoError(err, "create pod "+podName)
					bound := e.waitScheduled(podName)
					if node := bound.Spec.NodeName; node != used {
						t.Fatalf("pod %s went to %s (%v) while the used node %s had %d free GPUs", podName, node, e.devicesOf(bound), used, 7-i)
					}
				}
			})
		}
	}
}

// TestHostRequestsDoNotOverrideRoom: pods request CPU and memory in
// proportion to their GPUs (30 CPUs and 240 GiB per GPU here). A 2-GPU pod
// can take the last free pair of a busy DGX or break up the whole free
// NUMA node of a less busy one. It takes the busy DGX's pair, keeping the
// NUMA node for a 4-GPU pod; with NodeResourcesFit's LeastAllocated score
// in the profile, the emptier node (23 points more there) would win.
func TestHostRequestsDoNotOverrideRoom(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "hostrequests")
	perGPU := func(gpus int64) v1.ResourceList { return hostRequests(gpus, 30, 240) }
	// The pods that hold the taken GPUs, by their CPU and memory only.
	filler := func(node string, gpus int64) { e.boundPod("filler-"+node, node, perGPU(gpus)) }
	busy := e.node("a", "busy", framework.DGXLikeGPUs, "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5")
	filler(busy, 6)
	fresh := e.node("a", "fresh", framework.DGXLikeGPUs, "gpu-0", "gpu-1", "gpu-2", "gpu-3")
	filler(fresh, 4)
	two := e.template(2, nil)
	startTopodra(tCtx)

	pod := framework.PodWithClaims(e.ns, "two", topodraName, two)
	pod.Spec.NodeSelector = map[string]string{"test": e.ns, "group": "a"}
	pod.Spec.Containers[0].Resources.Requests = perGPU(2)
	_, err := cp.Client.CoreV1().Pods(e.ns).Create(tCtx, pod, metav1.CreateOptions{})
	tCtx.ExpectNoError(err, "create pod")
	bound := e.waitScheduled("two")
	if devices := e.devicesOf(bound); bound.Spec.NodeName != busy {
		t.Fatalf("2-GPU pod got %v on %s, want the last pair of the busy %s (not the free NUMA node of %s)", devices, bound.Spec.NodeName, busy, fresh)
	}
}

// TestUserPreferenceStillCounts: two nodes where the pod's device
// placement is equally good (one GPU whose pair partner is taken, nothing
// free is broken) and which differ only in how full they are. Without a
// preference topodra packs onto the fuller node; a preferred node affinity
// for the other node wins, because node scores are proportional and not
// stretched to the full range.
func TestUserPreferenceStillCounts(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "preference")
	one := e.template(1, nil)
	nodes := map[string][2]string{}
	for _, group := range []string{"control", "preferred"} {
		emptier := e.node(group, "emptier", framework.DGXLikeGPUs, "gpu-0")
		fuller := e.node(group, "fuller", framework.DGXLikeGPUs, "gpu-0", "gpu-2")
		nodes[group] = [2]string{emptier, fuller}
	}
	startTopodra(tCtx)

	node, devices := e.schedule("control", "control", one)
	if node != nodes["control"][1] {
		t.Fatalf("without a preference the pod went to %s (%v), want the fuller node %s", node, devices, nodes["control"][1])
	}

	pod := framework.PodWithClaims(e.ns, "preferred", topodraName, one)
	pod.Spec.NodeSelector = map[string]string{"test": e.ns, "group": "preferred"}
	pod.Spec.Affinity = &v1.Affinity{NodeAffinity: &v1.NodeAffinity{
		PreferredDuringSchedulingIgnoredDuringExecution: []v1.PreferredSchedulingTerm{{
			Weight: 100,
			Preference: v1.NodeSelectorTerm{MatchExpressions: []v1.NodeSelectorRequirement{{
				Key: v1.LabelHostname, Operator: v1.NodeSelectorOpIn, Values: []string{nodes["preferred"][0]},
			}}},
		}},
	}}
	_, err := cp.Client.CoreV1().Pods(e.ns).Create(tCtx, pod, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	scheduled := e.waitScheduled("preferred")
	devices = e.devicesOf(scheduled)
	if scheduled.Spec.NodeName != nodes["preferred"][0] {
		t.Fatalf("with a preferred node affinity for %s the pod went to %s (%v)", nodes["preferred"][0], scheduled.Spec.NodeName, devices)
	}
	if len(devices) != 1 || devices[0] != "gpu-1" {
		t.Errorf("pod got %v, want gpu-1 (the pair partner of the taken gpu-0)", devices)
	}
}

// TestWaitingWholeNodePodProtectsNodes: a used DGX has one GPU taken under
// every PCIe root, so a 2-GPU pod finds a root pair only on the empty DGX.
// While an 8-GPU pod is pending, the pair goes into one NUMA node of the
// used DGX and the empty one stays whole (wholeNodeTradeWhileWaiting);
// with nothing waiting, alignment comes first and the pair takes a PCIe
// root of the empty DGX (wholeNodeTrade 0).
func TestWaitingWholeNodePodProtectsNodes(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "demand")
	empty := e.node("a", "empty", framework.DGXLikeGPUs)
	used := e.node("a", "used", framework.DGXLikeGPUs, "gpu-0", "gpu-2", "gpu-4", "gpu-6")
	two, eight := e.template(2, nil), e.template(8, nil)
	startTopodra(tCtx)

	e.waitingWholeNodePod("waiting", "a", eight)
	node, devices := e.schedule("while-waiting", "a", two)
	if node != used || !sharedDomain(devices, 4) {
		t.Fatalf("with an 8-GPU pod pending the pair got %v on %s, want one NUMA node of the used %s (not the empty %s)", devices, node, used, empty)
	}

	tCtx.ExpectNoError(cp.Client.CoreV1().Pods(e.ns).Delete(tCtx, "waiting", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	tCtx.ExpectNoError(wait.PollUntilContextTimeout(tCtx, 50*time.Millisecond, waitTimeout, true, func(ctx context.Context) (bool, error) {
		_, err := cp.Client.CoreV1().Pods(e.ns).Get(ctx, "waiting", metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}))
	node, devices = e.schedule("nothing-waiting", "a", two)
	if node != empty || !sharedDomain(devices, 2) {
		t.Fatalf("with nothing pending the pair got %v on %s, want a PCIe root of the empty %s", devices, node, empty)
	}
}

// waitingWholeNodePod creates a pod of group's nodes with a claim from
// template that stays pending: it also asks for more CPU than any node
// has. Its claim stays unallocated, so it counts as a pod that waits for
// a whole node there.
func (e *env) waitingWholeNodePod(name, group, template string) {
	e.tCtx.Helper()
	pod := framework.PodWithClaims(e.ns, name, topodraName, template)
	pod.Spec.NodeSelector = map[string]string{"test": e.ns, "group": group}
	pod.Spec.Containers[0].Resources.Requests = v1.ResourceList{v1.ResourceCPU: resource.MustParse("100000")}
	_, err := cp.Client.CoreV1().Pods(e.ns).Create(e.tCtx, pod, metav1.CreateOptions{})
	e.tCtx.ExpectNoError(err)
	_, err = framework.WaitForPodUnschedulable(e.tCtx, cp.Client, e.ns, name, waitTimeout)
	e.tCtx.ExpectNoError(err)
}

// TestDrainingNodeIsLeftToEmpty: while an 8-GPU pod waits, the used DGX
// closest to free is draining, and a 2-GPU pod leaves it alone: it takes
// a NUMA node pair on a busier DGX instead of a PCIe-root pair on the
// draining one. With nothing waiting it takes the PCIe-root pair. Each
// case has nodes of its own, with devices held by claims and no pods, so
// that no node's pods are older than another's (age ranks nodes too).
func TestDrainingNodeIsLeftToEmpty(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "drain")
	nodes := map[string][2]string{}
	for _, group := range []string{"a", "b"} {
		almost := e.node(group, "almost", framework.DGXLikeGPUs, "gpu-0")
		busy := e.node(group, "busy", framework.DGXLikeGPUs, "gpu-0", "gpu-2", "gpu-4", "gpu-6")
		nodes[group] = [2]string{almost, busy}
	}
	two, eight := e.template(2, nil), e.template(8, nil)
	startTopodra(tCtx)

	almost, busy := nodes["a"][0], nodes["a"][1]
	node, devices := e.schedule("nothing-waiting", "a", two)
	if node != almost || !sharedDomain(devices, 2) {
		t.Fatalf("with nothing pending the pair got %v on %s, want a PCIe root of %s (one GPU in use; %s has four)", devices, node, almost, busy)
	}

	almost, busy = nodes["b"][0], nodes["b"][1]
	e.waitingWholeNodePod("waiting", "b", eight)
	node, devices = e.schedule("while-waiting", "b", two)
	if node != busy || !sharedDomain(devices, 4) {
		t.Fatalf("with an 8-GPU pod pending the pair got %v on %s, want one NUMA node of %s, leaving %s (closest to free) to drain", devices, node, busy, almost)
	}
}

// TestAllDrainingNodesKeepAlignment: where every node a pod can go to
// would be draining (as many whole-node pods wait as there are such
// nodes), none is. Marked, both DGXs would drop to rank 1 with room 0,
// and the 4-GPU pod would span the NUMA nodes of the fuller one; it takes
// the free NUMA node of the other instead.
func TestAllDrainingNodesKeepAlignment(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "alldrain")
	// A free NUMA node (GPUs 4-7) and two more free GPUs.
	roomy := e.node("a", "roomy", framework.DGXLikeGPUs, "gpu-0", "gpu-1")
	// Four free GPUs, two in each NUMA node: only the clique holds them.
	split := e.node("a", "split", framework.DGXLikeGPUs, "gpu-0", "gpu-1", "gpu-4", "gpu-5")
	four, eight := e.template(4, nil), e.template(8, nil)
	startTopodra(tCtx)

	e.waitingWholeNodePod("waiting-0", "a", eight)
	e.waitingWholeNodePod("waiting-1", "a", eight)
	node, devices := e.schedule("four", "a", four)
	if node != roomy || !sharedDomain(devices, 4) {
		t.Fatalf("with two 8-GPU pods pending for two DGXs the 4-GPU pod got %v on %s, want the free NUMA node of %s (on %s its GPUs would span the NUMA nodes)", devices, node, roomy, split)
	}
}

// TestSmallPodsGoBesideLongRunners: of two used DGX nodes, a 1-GPU pod
// goes to the one whose pod has run longer, although the other is fuller
// (packing alone would choose it) and neither placement breaks up a free
// block: pods that have run long tend to run on, and the node of young
// pods is left to empty out.
func TestSmallPodsGoBesideLongRunners(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "age")
	old := e.node("a", "old", framework.DGXLikeGPUs)
	one := e.template(1, nil)
	startTopodra(tCtx)
	if node, devices := e.schedule("long-runner", "a", one); node != old {
		t.Fatalf("the first pod went to %s (%v), the only node is %s", node, devices, old)
	}
	// Creation times have whole seconds: make the long runner clearly
	// older than anything on the other node.
	time.Sleep(2 * time.Second)
	// Three GPUs in use, by claims without pods: the free GPU left in
	// the first NUMA node is the partner of a used one, so taking it
	// breaks nothing, as next to the long runner.
	fuller := e.node("a", "fuller", framework.DGXLikeGPUs, "gpu-0", "gpu-1", "gpu-2")
	node, devices := e.schedule("small", "a", one)
	if node != old {
		t.Fatalf("the 1-GPU pod went to %s (%v), want %s beside the pod that has run longest, not the fuller %s", node, devices, old, fuller)
	}
}

// TestSmallPodsGoBesideServices: a node that holds a pod with
// restartPolicy Always (a service: the kubelet restarts it whenever it
// exits, so it ends only when deleted) will not empty out, so a 1-GPU
// Job pod goes beside the service rather than beside an older Job pod:
// the Job's node is left to drain for whole-node pods.
func TestSmallPodsGoBesideServices(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "service")
	jobs := e.node("j", "jobs", framework.DGXLikeGPUs)
	service := e.node("s", "service", framework.DGXLikeGPUs)
	one := e.template(1, nil)
	startTopodra(tCtx)
	run := func(name string, restart v1.RestartPolicy, selector map[string]string) string {
		pod := framework.PodWithClaims(e.ns, name, topodraName, one)
		pod.Spec.NodeSelector = selector
		pod.Spec.RestartPolicy = restart
		_, err := cp.Client.CoreV1().Pods(e.ns).Create(tCtx, pod, metav1.CreateOptions{})
		tCtx.ExpectNoError(err, "create pod "+name)
		return e.waitScheduled(name).Spec.NodeName
	}
	if node := run("old-job", v1.RestartPolicyNever, map[string]string{"group": "j", "test": e.ns}); node != jobs {
		t.Fatalf("old-job went to %s, want %s", node, jobs)
	}
	// Bindings are timed in whole seconds where the scheduler did not
	// see them: make the Job's pod clearly older than the service.
	time.Sleep(2 * time.Second)
	if node := run("server", v1.RestartPolicyAlways, map[string]string{"group": "s", "test": e.ns}); node != service {
		t.Fatalf("server went to %s, want %s", node, service)
	}
	if node := run("small-job", v1.RestartPolicyNever, map[string]string{"test": e.ns}); node != service {
		t.Fatalf("the 1-GPU Job pod went to %s, want %s beside the service (restartPolicy Always), leaving %s with its older Job pod to drain", node, service, jobs)
	}
}

// TestWholeNodePodRetriedOnlyWhenItCanFit: a pod that needs all eight GPUs
// of a node is not retried while the devices given back leave fewer than
// eight free there, and is scheduled when the last one is given back.
// Every retry that cannot succeed renews the pod's place at the back of the
// scheduling queue and its backoff, so that pods which arrived later would
// be tried first when the node frees up. With host requests the GPUs are
// held by pods that request CPU and memory in proportion, and the waiting
// pod asks for eight GPUs' worth: TopologyDRA filters before
// NodeResourcesFit, so the pod is rejected for its devices and retried by
// TopologyDRA's rule, not on every pod that leaves the node.
func TestWholeNodePodRetriedOnlyWhenItCanFit(t *testing.T) {
	perGPU := func(gpus int64) v1.ResourceList { return hostRequests(gpus, 24, 192) }
	for _, withRequests := range []bool{false, true} {
		t.Run(fmt.Sprintf("host-requests=%v", withRequests), func(t *testing.T) {
			tCtx := ktesting.Init(t)
			e := newEnv(tCtx, "retry")
			var all []string
			for i := range 8 {
				all = append(all, fmt.Sprintf("gpu-%d", i))
			}
			node := e.node("a", "full", framework.DGXLikeGPUs, all...)
			holder := func(device string) string { return "holder-" + device }
			if withRequests {
				for _, d := range all {
					e.boundPod(holder(d), node, perGPU(1))
				}
			}
			eight := e.template(8, nil)
			// A profile of its own: the attempt metric is per profile, and
			// pods that other tests left pending belong to
			// topodra-scheduler.
			profile := fmt.Sprintf("topodra-retry-test-%v", withRequests)
			cfg := bytes.Replace(config.SchedulerConfig, []byte("- schedulerName: "+topodraName), []byte("- schedulerName: "+profile), 1)
			if bytes.Equal(cfg, config.SchedulerConfig) {
				t.Fatalf("config/scheduler-config.yaml has no profile %s to rename", topodraName)
			}
			stop, err := cp.StartScheduler(tCtx, framework.SchedulerOptions{Name: profile, Config: cfg})
			tCtx.ExpectNoError(err)
			tCtx.Cleanup(stop)

			whole := framework.PodWithClaims(e.ns, "whole", profile, eight)
			whole.Spec.NodeSelector = map[string]string{"test": e.ns, "group": "a"}
			if withRequests {
				whole.Spec.Containers[0].Resources.Requests = perGPU(8)
			}
			_, err = cp.Client.CoreV1().Pods(e.ns).Create(tCtx, whole, metav1.CreateOptions{})
			tCtx.ExpectNoError(err, "create pod whole")
			_, err = framework.WaitForPodUnschedulable(tCtx, cp.Client, e.ns, "whole", waitTimeout)
			tCtx.ExpectNoError(err)
			before := unschedulableAttempts(tCtx, profile)
			giveBack := func(device string) {
				if withRequests {
					tCtx.ExpectNoError(cp.Client.CoreV1().Pods(e.ns).Delete(tCtx, holder(device), metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
				}
				tCtx.ExpectNoError(cp.Client.ResourceV1().ResourceClaims(e.ns).Delete(tCtx, "taken-a-full-"+device, metav1.DeleteOptions{}))
			}
			for _, d := range all[:7] {
				giveBack(d)
			}
			// Long enough for a retry after the scheduler's initial backoff (1 s).
			time.Sleep(3 * time.Second)
			if n := unschedulableAttempts(tCtx, profile) - before; n != 0 {
				t.Errorf("the 8-GPU pod was retried %d times while at most 7 GPUs of %s were free, want 0", n, node)
			}
			giveBack(all[7])
			pod := e.waitScheduled("whole")
			if pod.Spec.NodeName != node {
				t.Fatalf("the 8-GPU pod went to %s, want %s", pod.Spec.NodeName, node)
			}
		})
	}
}

// unschedulableAttempts counts the profile's scheduling attempts that
// ended unschedulable, from the process-wide metrics registry.
func unschedulableAttempts(tCtx ktesting.TContext, profile string) uint64 {
	tCtx.Helper()
	by, err := measure.GatherBy(legacyregistry.DefaultGatherer, "scheduler_scheduling_attempt_duration_seconds", map[string]string{"profile": profile}, "result")
	tCtx.ExpectNoError(err)
	return uint64(by["unschedulable"].Count())
}

// TestSmallerPodsAreTriedFirst: of the pods of one priority that wait
// together, the shipped profile tries those that ask for fewest devices
// first (DeviceCountSort). A DGX whose eight GPUs one claim holds; an
// 8-GPU, a 4-GPU and a 1-GPU pod fail in that order, then the claim gives
// all eight back in one event, which requeues all three. The 1- and 4-GPU
// pods start and the 8-GPU pod waits. PrioritySort would try the 8-GPU pod
// first (it failed first, so it has the oldest queue timestamp) and leave
// both others waiting.
func TestSmallerPodsAreTriedFirst(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "queue-order")
	var all []string
	for i := range 8 {
		all = append(all, fmt.Sprintf("gpu-%d", i))
	}
	node := e.node("a", "held", framework.DGXLikeGPUs)
	e.preallocate("holder", node, all...)
	// A pod's backoff doubles with every failed attempt (a pod tried once
	// before its claim exists fails twice); capped at 1 s here. The queue
	// rounds a backoff's end down to its 1 s ordering window and counts a
	// pod as backing off until that window is over, so a backoff ends at
	// most 2 s after the failure. Once that has passed for all three, the
	// deletion event moves them straight to the active queue, which tries
	// them in DeviceCountSort's order. Sooner, a pod still backing off
	// waits in the backoff queue, ordered by when its backoff ends, while
	// the 8-GPU pod, which failed first and is past its own, is tried
	// first and takes the node.
	startTopodraEdited(tCtx, "topodra", "kind: KubeSchedulerConfiguration\n", "kind: KubeSchedulerConfiguration\npodMaxBackoffSeconds: 1\n")
	for _, p := range []struct {
		name string
		gpus int64
	}{{"eight", 8}, {"four", 4}, {"one", 1}} {
		e.pod(p.name, topodraName, "a", e.template(p.gpus, nil))
		// Failed for the devices, not for a claim not created yet.
		_, err := framework.WaitForPod(tCtx, cp.Client, e.ns, p.name, waitTimeout, "unschedulable for its devices", func(pod *v1.Pod) (bool, error) {
			c := framework.PodScheduledCondition(pod)
			return c != nil && c.Status == v1.ConditionFalse && strings.Contains(c.Message, "in use"), nil
		})
		tCtx.ExpectNoError(err)
	}
	time.Sleep(2500 * time.Millisecond)
	tCtx.ExpectNoError(cp.Client.ResourceV1().ResourceClaims(e.ns).Delete(tCtx, "holder", metav1.DeleteOptions{}))

	// Where the three pods are: on failure it says which pod took the node.
	state := func() (map[string]string, string) {
		nodes, desc := map[string]string{}, ""
		for _, name := range []string{"one", "four", "eight"} {
			pod, err := cp.Client.CoreV1().Pods(e.ns).Get(tCtx, name, metav1.GetOptions{})
			if err != nil {
				desc += fmt.Sprintf(" %s: %v;", name, err)
				continue
			}
			nodes[name] = pod.Spec.NodeName
			msg := ""
			if c := framework.PodScheduledCondition(pod); c != nil {
				msg = c.Message
			}
			desc += fmt.Sprintf(" %s: node %q, %q;", name, pod.Spec.NodeName, msg)
		}
		return nodes, desc
	}
	err := wait.PollUntilContextTimeout(tCtx, framework.PollInterval, waitTimeout, true, func(context.Context) (bool, error) {
		nodes, _ := state()
		return nodes["four"] != "" && nodes["one"] != "", nil
	})
	if nodes, desc := state(); err != nil || nodes["four"] != node || nodes["one"] != node {
		t.Fatalf("after the holder claim went, want the 1- and 4-GPU pods on %s:%s", node, desc)
	}
}

// TestWholeNodePodLeavesHeadroom: on eight DGX nodes (64 GPUs, headroom 8
// at the shipped smallPodHeadroomPercent of 12), an 8-GPU pod does not take
// the empty node while that would leave fewer than 8 GPUs free, and says
// so in its PodScheduled condition. When a claim on another node gives 4
// GPUs back (that node still has fewer than 8 free, so only the headroom
// can make the pod fit), the pod is retried and starts on the empty node.
func TestWholeNodePodLeavesHeadroom(t *testing.T) {
	heldByHeadroom(t, "headroom", []heldGPUs{{"low-1", 1, 0, 4}, {"low-2", 2, 0, 4}, {"high-2", 2, 4, 8}},
		"keeping 8 of the 64", "low-2")
}

// TestHeadroomCountsNodesWithRoom: on eight DGX nodes (headroom 8 of 64),
// one empty, one with 7 GPUs free and one with a single GPU free, 16 GPUs
// are free, so an 8-GPU pod on the empty node would leave 8; but the single
// GPU is no room for a 2-GPU pod, so only 7 count and the pod waits. When
// a claim gives back a second GPU beside the single one (that node still
// has far fewer than 8 free), the pod is retried and starts.
func TestHeadroomCountsNodesWithRoom(t *testing.T) {
	heldByHeadroom(t, "headroom-room", []heldGPUs{{"one-1", 1, 0, 1}, {"six-2", 2, 0, 6}, {"one-2", 2, 6, 7}},
		"16 are free (15 of them on nodes with 2 or more free) and this pod needs 8 (that would leave fewer than 8)", "one-2")
}

// gpuRange names the GPUs gpu-from to gpu-(to-1) of a DGX-like node.
func gpuRange(from, to int) []string {
	var out []string
	for i := from; i < to; i++ {
		out = append(out, fmt.Sprintf("gpu-%d", i))
	}
	return out
}

// heldGPUs is a claim holding GPUs from..to-1 of the node with that index.
type heldGPUs struct {
	claim          string
	node, from, to int
}

// heldByHeadroom runs topodra on eight DGX nodes, node 0 empty, nodes 1
// and 2 holding held, every GPU of nodes 3-7 held: an 8-GPU pod must wait
// with message in its PodScheduled condition, then start on node 0 once
// the claim giveBack is deleted.
func heldByHeadroom(t *testing.T, ns string, held []heldGPUs, message, giveBack string) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, ns)
	nodes := e.dgxNodes("h", 8, "256")
	for _, h := range held {
		e.preallocate(h.claim, nodes[h.node], gpuRange(h.from, h.to)...)
	}
	for _, n := range nodes[3:] {
		e.preallocate("all-"+n, n, gpuRange(0, 8)...)
	}
	startTopodra(tCtx)

	e.pod("whole", topodraName, "h", e.template(8, nil))
	pod, err := framework.WaitForPodUnschedulable(tCtx, cp.Client, e.ns, "whole", waitTimeout)
	tCtx.ExpectNoError(err)
	if msg := framework.PodScheduledCondition(pod).Message; !strings.Contains(msg, message) {
		t.Errorf("PodScheduled message %q does not say %q", msg, message)
	}
	// Past the scheduler's initial backoff (1 s).
	time.Sleep(1500 * time.Millisecond)
	tCtx.ExpectNoError(cp.Client.ResourceV1().ResourceClaims(e.ns).Delete(tCtx, giveBack, metav1.DeleteOptions{}))
	if got := e.waitScheduled("whole").Spec.NodeName; got != nodes[0] {
		t.Errorf("the 8-GPU pod went to %s, want the empty %s", got, nodes[0])
	}
}

// TestWholeNodePodLeavesNICsToMatchedPods: an 8-GPU pod ranks a DGX (one
// NVSwitch clique) above a PCIe box and takes it; once a pod whose claim
// needs a GPU and a NIC on one PCIe root runs, the next 8-GPU pod takes a
// free PCIe box, which has no NICs, and leaves the free DGX's GPUs beside
// its NICs to such pods (nicRootTrade).
// nicDriver is the driver of the NICs of nicClass and withNICs.
const nicDriver = "nic.test.topodra.io"

// nicClass creates the test's device class for NICs.
func (e *env) nicClass() string {
	name := e.ns + "-nic"
	_, err := cp.Client.ResourceV1().DeviceClasses().Create(e.tCtx, framework.DeviceClass(name, nicDriver), metav1.CreateOptions{})
	e.tCtx.ExpectNoError(err)
	return name
}

// withNICs publishes four NICs on node, one on each PCIe root of a
// DGX-like node's GPU pairs (see nicsOn), and returns the node.
func (e *env) withNICs(node string) string { return e.nicsOn(node, 0, 1, 2, 3) }

// gpuNICTemplate creates a claim template asking for one GPU and one NIC,
// with the given constraints.
func (e *env) gpuNICTemplate(name, nicClass string, constraints ...resourceapi.DeviceConstraint) string {
	tmpl := framework.ClaimTemplate(e.ns, name, e.class, 1)
	tmpl.Spec.Spec.Devices.Requests = append(tmpl.Spec.Spec.Devices.Requests, resourceapi.DeviceRequest{
		Name:    "nic",
		Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: nicClass, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
	})
	tmpl.Spec.Spec.Devices.Constraints = constraints
	return e.createTemplate(tmpl)
}

// TestGPUsBesideNICsLeftForNICPods: with nicReservePercent (default 5),
// a 1-GPU pod leaves the last free GPU of a DGX whose NICs are free and
// opens the empty PCIe box instead (without it, the fuller DGX wins);
// then a pod that needs a GPU and a NIC still starts there.
func TestGPUsBesideNICsLeftForNICPods(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "nicreserve")
	nicClass := e.nicClass()
	dgx := e.withNICs(e.node("a", "dgx", framework.DGXLikeGPUs, "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6"))
	pcie := e.node("a", "pcie", pcieNVLinkPairsGPUs)
	one := e.template(1, nil)
	gpuNIC := e.gpuNICTemplate("gpu-nic", nicClass)
	startTopodra(tCtx)

	if node, devices := e.schedule("one", "a", one); node != pcie {
		t.Fatalf("the 1-GPU pod got %v on %s, want a GPU of the PCIe box %s: the DGX's last free GPU is kept for pods that need its NICs too", devices, node, pcie)
	}
	if node, devices := e.schedule("gpu-nic", "a", gpuNIC); node != dgx || len(devices) != 2 {
		t.Fatalf("the GPU+NIC pod got %v on %s, want a GPU and a NIC of %s", devices, node, dgx)
	}
}

// TestCPUDevicesAreNotNICs: devices of another DRA driver that sit on no
// PCIe root (a CPU driver's, which publish NUMA nodes) are not kept GPUs
// for GPU+NIC pods: the 1-GPU pod takes the last free GPU of the DGX that
// has them, the fullest node, and leaves the PCIe box empty.
func TestCPUDevicesAreNotNICs(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "cpudevices")
	dgx := e.node("a", "dgx", framework.DGXLikeGPUs, "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6")
	var cpus []framework.Device
	for i := range 4 {
		cpus = append(cpus, framework.Device{Name: fmt.Sprintf("cpu-%d", i), Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			topology.AttrNUMANode: framework.IntAttr(int64(i / 2)),
		}})
	}
	_, err := cp.Client.ResourceV1().ResourceSlices().Create(tCtx, framework.SliceForNode(dgx, "cpu.example.com", cpus), metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	pcie := e.node("a", "pcie", pcieNVLinkPairsGPUs)
	one := e.template(1, nil)
	startTopodra(tCtx)

	if node, devices := e.schedule("one", "a", one); node != dgx {
		t.Fatalf("the 1-GPU pod got %v on %s, want the DGX's last free GPU on %s (its CPU devices are no NICs), not the empty PCIe box %s", devices, node, dgx, pcie)
	}
}

func TestWholeNodePodLeavesNICsToMatchedPods(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "nicroot")
	nicClass := e.nicClass()
	dgxWithNICs := func(suffix string) string { return e.withNICs(e.node("a", suffix, framework.DGXLikeGPUs)) }
	dgxs := []string{dgxWithNICs("dgx-0"), dgxWithNICs("dgx-1"), dgxWithNICs("dgx-2")}
	pcie := e.node("a", "pcie", pcieNVLinkPairsGPUs)
	eight := e.template(8, nil)
	matched := e.gpuNICTemplate("gpu-nic-same-root", nicClass, resourceapi.DeviceConstraint{MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(topology.AttrPCIeRoot))})
	startTopodra(tCtx)

	node, _ := e.schedule("eight-0", "a", eight)
	if !slices.Contains(dgxs, node) {
		t.Fatalf("with no pod asking for a GPU and a NIC on one root, the 8-GPU pod went to %s, want a DGX %v", node, dgxs)
	}
	node, devices := e.schedule("gpu-nic", "a", matched)
	if !slices.Contains(dgxs, node) || len(devices) != 2 {
		t.Fatalf("GPU+NIC pod got %v on %s, want a GPU and a NIC of a DGX", devices, node)
	}
	// Rule 9 looks at every claim: this one must not outlive the test (a
	// second run with -count, or a later test, would see it while its
	// first 8-GPU pod is placed). Without a garbage collector here the
	// generated claim stays after its pod: delete both.
	claim := e.claimOf("gpu-nic")
	tCtx.Cleanup(func() {
		err := cp.Client.CoreV1().Pods(e.ns).Delete(tCtx, "gpu-nic", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)})
		tCtx.ExpectNoError(err)
		err = cp.Client.ResourceV1().ResourceClaims(e.ns).Delete(tCtx, claim, metav1.DeleteOptions{})
		tCtx.ExpectNoError(err)
		e.waitClaimGone(claim)
	})
	node, _ = e.schedule("eight-1", "a", eight)
	if node != pcie {
		t.Fatalf("with a GPU+NIC pod running, the 8-GPU pod went to %s, want the PCIe box %s (a DGX stays free for GPU+NIC pods)", node, pcie)
	}
}

// nicsOn publishes one NIC on each of the given PCIe roots of a DGX-like
// node ("nic-<root>", with the root's pcieRoot and NUMA node, as the
// node agent publishes them), and returns the node.
func (e *env) nicsOn(node string, roots ...int) string {
	var nics []framework.Device
	for _, r := range roots {
		nics = append(nics, framework.Device{Name: fmt.Sprintf("nic-%d", r), Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			topology.AttrPCIeRoot: framework.StringAttr(fmt.Sprintf("pci0000:%02x", r)),
			topology.AttrNUMANode: framework.IntAttr(int64(r / 2)),
		}})
	}
	_, err := cp.Client.ResourceV1().ResourceSlices().Create(e.tCtx, framework.SliceForNode(node, nicDriver, nics), metav1.CreateOptions{})
	e.tCtx.ExpectNoError(err)
	return node
}

// TestGPUNICPodKeepsItsRootOnDrainingNode: while an 8-GPU pod waits, a pod
// that asks for a GPU and a NIC still takes them on one PCIe root of the
// draining DGX, rather than a GPU and a NIC on different roots of a busy
// one: the drain trade costs a rank only to pods of one device class.
func TestGPUNICPodKeepsItsRootOnDrainingNode(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "drainnic")
	nicClass := e.nicClass()
	// Closest to free, so draining: one GPU in use, a NIC on every root.
	almost := e.nicsOn(e.node("a", "almost", framework.DGXLikeGPUs, "gpu-0"), 0, 1, 2, 3)
	// Busy: its free GPUs (root 3) and its only NIC (root 2) share a NUMA
	// node, not a root.
	busy := e.nicsOn(e.node("a", "busy", framework.DGXLikeGPUs, "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5"), 2)
	eight := e.template(8, nil)
	gpuNIC := e.gpuNICTemplate("gpu-nic", nicClass)
	startTopodra(tCtx)

	e.waitingWholeNodePod("waiting", "a", eight)
	node, devices := e.schedule("gpu-nic", "a", gpuNIC)
	var gpu, nic = -1, -1
	for _, d := range devices {
		if _, err := fmt.Sscanf(d, "gpu-%d", &gpu); err == nil {
			continue
		}
		_, _ = fmt.Sscanf(d, "nic-%d", &nic)
	}
	if node != almost || gpu < 0 || gpu/2 != nic {
		t.Fatalf("with an 8-GPU pod pending the GPU+NIC pod got %v on %s, want a GPU and the NIC of one PCIe root of the draining %s (on %s they would share only a NUMA node)", devices, node, almost, busy)
	}
}

// TestAlignmentKeptWhereEveryNodeIsInNICReserve: where the pod's
// placement on every node it may go to would take the GPUs kept beside
// free NICs, nothing is kept for them, and alignment ranks the nodes as
// ever. Two DGXs with free NICs, four GPUs free on each: on the first a
// whole NUMA node, on the second two PCIe-root pairs in different NUMA
// nodes. With nicReservePercent 40 (7 of their 16 GPUs kept, 8 free) a
// 4-GPU pod takes the reserve on either; it takes the free NUMA node.
// Were both placements left in the reserve, each a rank lower (rank 1,
// where the trade stops), room would choose the second DGX (breaking two
// free pairs costs less than a free NUMA node).
func TestAlignmentKeptWhereEveryNodeIsInNICReserve(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "nicreserveall")
	e.nicClass()
	numa := e.withNICs(e.node("a", "numa", framework.DGXLikeGPUs, "gpu-0", "gpu-1", "gpu-2", "gpu-3"))
	pairs := e.withNICs(e.node("a", "pairs", framework.DGXLikeGPUs, "gpu-0", "gpu-1", "gpu-4", "gpu-5"))
	four := e.template(4, nil)
	startTopodraEdited(tCtx, "topodra", "nicReservePercent: 5 ", "nicReservePercent: 40 ")

	if node, devices := e.schedule("four", "a", four); node != numa || !sharedDomain(devices, 4) {
		t.Fatalf("the 4-GPU pod got %v on %s, want the free NUMA node of %s, not the pairs of %s", devices, node, numa, pairs)
	}
}

// TestPairLeavesNICReserve: the GPUs kept beside free NICs go to a
// GPU-only pod of fewer than half a node's GPUs only where no node outside
// them takes it at an alignment rank of 1 or more. A 2-GPU pod opens an
// empty PCIe box (an NVLink pair) rather than take the last free PCIe-root
// pair of a DGX whose NICs are free; a pod that asks for a GPU and a NIC
// then starts on the DGX.
func TestPairLeavesNICReserve(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "nicreserve2")
	nicClass := e.nicClass()
	dgx := e.withNICs(e.node("a", "dgx", framework.DGXLikeGPUs, "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5"))
	pcie := e.node("a", "pcie", pcieNVLinkPairsGPUs)
	two := e.template(2, nil)
	gpuNIC := e.gpuNICTemplate("gpu-nic", nicClass)
	startTopodra(tCtx)

	if node, devices := e.schedule("two", "a", two); node != pcie || !sharedDomain(devices, 2) {
		t.Fatalf("the 2-GPU pod got %v on %s, want an NVLink pair of the empty PCIe box %s: the free GPUs of %s are kept beside its free NICs", devices, node, pcie, dgx)
	}
	if node, devices := e.schedule("gpu-nic", "a", gpuNIC); node != dgx || len(devices) != 2 {
		t.Fatalf("the GPU+NIC pod got %v on %s, want a GPU and a NIC of %s", devices, node, dgx)
	}
}

// TestLargePodTakesNICReserveBeforeEmptyNode: the GPUs kept beside free
// NICs cost a pod of half a node's GPUs or more one alignment rank, not
// all of them. A 4-GPU pod takes the free NUMA node of a DGX whose NICs
// are free, although its GPUs there are the reserve, rather than break up
// an empty PCIe box: a rank lower there, it ties with the box's NUMA node
// (two NVLink pairs, one rank looser than the DGX's NUMA node inside the
// NVSwitch clique), and a free NUMA node costs less room than a whole free
// node.
func TestLargePodTakesNICReserveBeforeEmptyNode(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "nicreserve4")
	e.nicClass()
	dgx := e.withNICs(e.node("a", "dgx", framework.DGXLikeGPUs, "gpu-0", "gpu-1", "gpu-2", "gpu-3"))
	pcie := e.node("a", "pcie", pcieNVLinkPairsGPUs)
	four := e.template(4, nil)
	startTopodra(tCtx)

	if node, devices := e.schedule("four", "a", four); node != dgx || !sharedDomain(devices, 4) {
		t.Fatalf("the 4-GPU pod got %v on %s, want the free NUMA node of %s, not the empty PCIe box %s", devices, node, dgx, pcie)
	}
}

// TestWholeNodePodKeepsCliqueInNICReserve: the reserve never costs a
// whole-node pod's aligned placement its last rank. An 8-GPU pod takes the
// empty DGX, whose GPUs are all kept beside its free NICs, because there
// its eight GPUs share the NVSwitch clique; on any of the empty PCIe boxes
// they would share nothing. The DGX's NIC sits on a PCIe root of its own,
// so the pod strands no GPU+NIC root (rule 9 stays out of it whatever
// claims other tests leave behind).
func TestWholeNodePodKeepsCliqueInNICReserve(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "nicreserve8")
	e.nicClass()
	dgx := e.nicsOn(e.node("a", "dgx", framework.DGXLikeGPUs), 8)
	var boxes []string
	for i := range 5 {
		boxes = append(boxes, e.node("a", fmt.Sprintf("pcie-%d", i), pcieNVLinkPairsGPUs))
	}
	eight := e.template(8, nil)
	startTopodra(tCtx)

	if node, devices := e.schedule("eight", "a", eight); node != dgx {
		t.Fatalf("the 8-GPU pod got %v on %s, want the DGX %s (one clique), not a PCIe box %v (nothing shared)", devices, node, dgx, boxes)
	}
}
