package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/events"
	kubeletdra "k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/test/utils/ktesting"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/driverroot"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// fakeDriverInstall writes versioned driver libraries with their .so.1
// links and nvidia-smi below root, as a driver installation has them.
func fakeDriverInstall(tCtx ktesting.TContext, root, version string) {
	tCtx.Helper()
	libDir := filepath.Join(root, "usr/lib/x86_64-linux-gnu")
	for _, dir := range []string{libDir, filepath.Join(root, "usr/bin")} {
		tCtx.ExpectNoError(os.MkdirAll(dir, 0o755))
	}
	for _, lib := range []string{"libnvidia-ml.so", "libcuda.so"} {
		tCtx.ExpectNoError(os.WriteFile(filepath.Join(libDir, lib+"."+version), []byte("fake"), 0o755))
		tCtx.ExpectNoError(os.Symlink("/usr/lib/x86_64-linux-gnu/"+lib+"."+version, filepath.Join(libDir, lib+".1")))
	}
	tCtx.ExpectNoError(os.WriteFile(filepath.Join(root, "usr/bin/nvidia-smi"), []byte("fake"), 0o755))
}

// TestKubeletDRAManagerPrepares runs one node the way a cluster does, on
// the real API server: the kubelet's own DRA manager and plugin manager
// start first; the node agent (mock DGX H100, CDI specs from nvcdi over a
// fake driver root, the owned taint as shipped) registers through the
// registration socket and publishes its pool; topodra-scheduler allocates
// a pod's claim from that pool, reserves it and binds the pod. The kubelet
// then prepares the bound pod as it comes from the API: the CDI ids it
// hands to the runtime must name the allocated GPU and resolve in a CDI
// cache to a spec with that GPU's UUID and the driver's libraries and
// nvidia-smi. The GPU's health reaches the kubelet over the agent's health
// stream: Healthy, then Unhealthy after a critical XID. Unpreparing removes
// the spec again.
func TestKubeletDRAManagerPrepares(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "kubelet")
	nodeName := e.ns + "-node"
	_, err := framework.CreateReadyNode(tCtx, cp.Client, nodeName, map[string]string{"test": e.ns, "group": "kubelet"})
	tCtx.ExpectNoError(err)

	dirs := shortDirs(tCtx, "tk", "p", "r", "k")
	pluginDir, registryDir, kubeletState := dirs[0], dirs[1], dirs[2]

	// 1. The kubelet: DRA manager plus plugin manager on the registry
	// directory. It starts before the agent, as on a node, so that its
	// startup wipe of the node's ResourceSlices runs against no slices.
	manager := startKubeletDRA(tCtx, nodeName, registryDir, kubeletState)

	// 2. The agent, with CDI specs from nvcdi over a fake driver root that
	// holds the driver version the (mock) NVML reports and the machine's
	// device nodes.
	machine, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: nodeName})
	tCtx.ExpectNoError(err)
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: machine.NVML(), Sysfs: machine.Sysfs()})
	tCtx.ExpectNoError(err)
	driverVersion, ret := machine.NVML().SystemGetDriverVersion()
	if ret != nvml.SUCCESS {
		tCtx.Fatalf("driver version: %v", ret)
	}
	rootDir := tCtx.TempDir()
	fakeDriverInstall(tCtx, rootDir, driverVersion)
	_, err = machine.WriteDeviceNodes(rootDir)
	tCtx.ExpectNoError(err)
	root, err := driverroot.New("/run/nvidia/driver", rootDir)
	tCtx.ExpectNoError(err)
	gen, err := cdi.NewNVCDI(cdi.NVCDIOptions{Root: root, NVML: func() nvml.Interface { return machine.NVML() }})
	tCtx.ExpectNoError(err)
	cdiDir := tCtx.TempDir()
	startNodeAgent(tCtx, nodeName, disc, gen, pluginDir, registryDir, cdiDir)
	waitForSlice(tCtx, t, cp.Client, topology.DriverName, nodeName, "8 devices", func(s *resourceapi.ResourceSlice) bool {
		return len(s.Spec.Devices) == 8
	})

	// 3. topodra schedules a pod with a one-GPU claim from a template onto
	// the node: the claim is allocated from the agent's pool and reserved
	// for the pod.
	startTopodra(tCtx)
	e.pod("trainer", topodraName, "kubelet", e.template(1, nil))
	pod := e.waitScheduled("trainer")
	if pod.Spec.NodeName != nodeName {
		tCtx.Fatalf("pod bound to %s, want %s", pod.Spec.NodeName, nodeName)
	}
	devices := e.devicesOf(pod)
	if len(devices) != 1 {
		tCtx.Fatalf("topodra allocated %v, want one GPU", devices)
	}
	claims, err := framework.PodClaims(tCtx, cp.Client, pod)
	tCtx.ExpectNoError(err)
	claim, device := claims[0], devices[0]
	if r := claim.Status.Allocation.Devices.Results[0]; r.Driver != topology.DriverName {
		tCtx.Fatalf("claim %s allocated from driver %s, want %s", claim.Name, r.Driver, topology.DriverName)
	}
	tCtx.Logf("topodra allocated %s of %s to claim %s", device, nodeName, claim.Name)

	// 4. The kubelet prepares the pod as the API has it.
	wantID := cdi.DeviceID(claim.UID, device)
	prepareOnKubelet(tCtx, manager, pod, wantID)

	// 5. What the runtime does with the id.
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(cdiDir), cdiapi.WithAutoRefresh(false))
	tCtx.ExpectNoError(err)
	resolved := cache.GetDevice(wantID)
	if resolved == nil {
		tCtx.Fatalf("CDI cache cannot resolve %s: %v", wantID, cache.GetErrors())
	}
	wantEnv := cdi.DeviceEnv(device) + "=" + machine.UUID(dgxIndex(device))
	if !slices.Contains(resolved.ContainerEdits.Env, wantEnv) {
		tCtx.Errorf("device %s sets %v, want %s (the allocated GPU's UUID)", wantID, resolved.ContainerEdits.Env, wantEnv)
	}
	var mounts []string
	for _, m := range resolved.GetSpec().ContainerEdits.Mounts {
		mounts = append(mounts, m.HostPath)
	}
	for _, want := range []string{
		"/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + driverVersion,
		"/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so." + driverVersion,
		"/run/nvidia/driver/usr/bin/nvidia-smi",
	} {
		if !slices.Contains(mounts, want) {
			tCtx.Errorf("spec mounts %v, want %s", mounts, want)
		}
	}
	specPath := resolved.GetSpec().GetPath()

	// 6. Device health reaches the kubelet through the agent's health
	// stream: the GPU is Healthy in the container's status, and Unhealthy
	// after NVML reports a critical XID on it.
	waitHealth(tCtx, manager, pod, wantID, v1.ResourceHealthStatusHealthy)
	tCtx.ExpectNoError(machine.InjectXID(dgxIndex(device), 79))
	waitHealth(tCtx, manager, pod, wantID, v1.ResourceHealthStatusUnhealthy)

	// 7. Unprepare removes the spec.
	unprepareOnKubelet(tCtx, manager, pod, specPath)

	// 8. A pod that asks for the GPU as an extended resource (the class's
	// implicit name; the node's allocatable lacks it, so DRA serves it):
	// topodra creates the scheduler's claim, and the kubelet prepares it
	// from the pod's status and hands its GPU to the container.
	extended := framework.PodWithClaims(e.ns, "extended", topodraName)
	extended.Spec.NodeSelector = map[string]string{"test": e.ns, "group": "kubelet"}
	extended.Spec.Containers[0].Resources.Limits = v1.ResourceList{v1.ResourceName(resourceapi.ResourceDeviceClassPrefix + e.class): resource.MustParse("1")}
	_, err = cp.Client.CoreV1().Pods(e.ns).Create(tCtx, extended, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	extended = e.waitScheduled("extended")
	status := extended.Status.ExtendedResourceClaimStatus
	if status == nil {
		tCtx.Fatalf("pod %s has no extended resource claim in its status", extended.Name)
	}
	extClaim, err := cp.Client.ResourceV1().ResourceClaims(e.ns).Get(tCtx, status.ResourceClaimName, metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	extDevices := framework.AllocatedDevices(extClaim)
	if len(extDevices) != 1 {
		tCtx.Fatalf("extended resource claim %s allocated %v, want one GPU", extClaim.Name, extDevices)
	}
	prepareOnKubelet(tCtx, manager, extended, cdi.DeviceID(extClaim.UID, extDevices[0]))
}

// startNodeAgent starts the node agent of nodeName on the shared control
// plane with the kubelet's plugin and registration directories, the owned
// taint as shipped and no rescans; it stops when the test ends.
func startNodeAgent(tCtx ktesting.TContext, nodeName string, disc discovery.Interface, gen cdi.Generator, pluginDir, registryDir, cdiDir string) {
	tCtx.Helper()
	a, err := agent.New(tCtx, agent.Options{
		NodeName:       nodeName,
		KubeClient:     cp.Client,
		Discovery:      disc,
		CDIGenerator:   gen,
		PluginDataDir:  pluginDir,
		RegistrarDir:   registryDir,
		StateDir:       tCtx.TempDir(),
		CDIDir:         cdiDir,
		OwnedTaint:     agent.DefaultOwnedTaint,
		RescanInterval: -1,
	})
	tCtx.ExpectNoError(err, "start agent")
	tCtx.Cleanup(a.Stop)
}

// prepareOnKubelet has the kubelet's DRA manager prepare pod as the API has
// it, and checks that the pod's first container gets exactly the CDI
// device wantID. Registration is asynchronous (the plugin watcher notices
// the socket): it prepares until the kubelet knows the driver.
func prepareOnKubelet(tCtx ktesting.TContext, manager *kubeletdra.Manager, pod *v1.Pod, wantID string) {
	tCtx.Helper()
	var lastErr error
	err := wait.PollUntilContextTimeout(tCtx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		lastErr = manager.PrepareResources(ctx, pod)
		return lastErr == nil, nil
	})
	if err != nil {
		tCtx.Fatalf("kubelet could not prepare the pod's claim: %v", lastErr)
	}
	info, err := manager.GetResources(pod, &pod.Spec.Containers[0])
	tCtx.ExpectNoError(err)
	if len(info.CDIDevices) != 1 || info.CDIDevices[0].Name != wantID {
		tCtx.Fatalf("kubelet hands the runtime %v, want [%s]", info.CDIDevices, wantID)
	}
}

// unprepareOnKubelet has the kubelet unprepare pod and checks that the
// CDI spec at specPath is gone.
func unprepareOnKubelet(tCtx ktesting.TContext, manager *kubeletdra.Manager, pod *v1.Pod, specPath string) {
	tCtx.Helper()
	tCtx.ExpectNoError(manager.UnprepareResources(tCtx, pod), "unprepare")
	if _, err := os.Stat(specPath); !os.IsNotExist(err) {
		tCtx.Errorf("CDI spec %s still there after unprepare: %v", specPath, err)
	}
}

// waitHealth polls the health the kubelet would put into the status of the
// pod's first container until the device with CDI id resourceID has want.
func waitHealth(tCtx ktesting.TContext, manager *kubeletdra.Manager, pod *v1.Pod, resourceID string, want v1.ResourceHealthStatus) {
	tCtx.Helper()
	var last []v1.ResourceStatus
	err := wait.PollUntilContextTimeout(tCtx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		status := &v1.PodStatus{ContainerStatuses: []v1.ContainerStatus{{Name: pod.Spec.Containers[0].Name}}}
		manager.UpdateAllocatedResourcesStatus(tCtx.Logger(), pod, status)
		last = status.ContainerStatuses[0].AllocatedResourcesStatus
		for _, rs := range last {
			for _, r := range rs.Resources {
				if string(r.ResourceID) == resourceID && r.Health == want {
					return true, nil
				}
			}
		}
		return false, nil
	})
	tCtx.ExpectNoError(err, fmt.Sprintf("kubelet's health of %s is not %s; last: %+v", resourceID, want, last))
}

// shortDirs creates directories named names below a new temporary
// directory with a short path (unix socket paths are limited to about 108
// bytes; t.TempDir can be longer), removed when the test ends.
func shortDirs(tCtx ktesting.TContext, prefix string, names ...string) []string {
	base, err := os.MkdirTemp("", prefix)
	tCtx.ExpectNoError(err)
	tCtx.Cleanup(func() { _ = os.RemoveAll(base) })
	var dirs []string
	for _, name := range names {
		dir := filepath.Join(base, name)
		tCtx.ExpectNoError(os.MkdirAll(dir, 0o750))
		dirs = append(dirs, dir)
	}
	return dirs
}

// TestAgentReadyOnceKubeletRegisters: a node agent that starts before the
// kubelet watches its registration directory is not ready and, after
// its registration timeout, warns on the Node; once the kubelet's own
// plugin manager and DRA manager register it, it is ready and says so.
func TestAgentReadyOnceKubeletRegisters(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "register")
	nodeName := e.ns + "-node"
	_, err := framework.CreateReadyNode(tCtx, cp.Client, nodeName, map[string]string{"test": e.ns})
	tCtx.ExpectNoError(err)
	dirs := shortDirs(tCtx, "tr", "p", "r", "k")
	pluginDir, registryDir, kubeletState := dirs[0], dirs[1], dirs[2]

	recorder := events.NewFakeRecorder(20)
	a, _ := startMockAgent(tCtx, nodeName, agent.Options{
		PluginDataDir:       pluginDir,
		RegistrarDir:        registryDir,
		StateDir:            tCtx.TempDir(),
		CDIDir:              tCtx.TempDir(),
		RescanInterval:      -1,
		RegistrationTimeout: 300 * time.Millisecond,
		Recorder:            recorder,
	})
	tCtx.Cleanup(a.Stop)
	if err := a.Ready(); err == nil {
		tCtx.Fatal("ready before the kubelet registered the plugin")
	}
	waitForEvent(tCtx, recorder, "Warning "+agent.ReasonNotRegistered)

	startKubeletDRA(tCtx, nodeName, registryDir, kubeletState)
	err = wait.PollUntilContextTimeout(tCtx, 50*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return a.Ready() == nil, nil
	})
	if err != nil {
		tCtx.Fatalf("not ready after the kubelet started: %v", a.Ready())
	}
	waitForEvent(tCtx, recorder, "Normal "+agent.ReasonRegistered)
}

// waitForEvent waits for an event of r that starts with prefix.
func waitForEvent(tCtx ktesting.TContext, r *events.FakeRecorder, prefix string) {
	tCtx.Helper()
	deadline := time.After(30 * time.Second)
	var seen []string
	for {
		select {
		case ev := <-r.Events:
			if strings.HasPrefix(ev, prefix) {
				return
			}
			seen = append(seen, ev)
		case <-deadline:
			tCtx.Fatalf("no event %q; got %q", prefix, seen)
		}
	}
}
