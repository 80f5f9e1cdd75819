package agent_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2/ktesting"
	pluginregistrationv1 "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	kubeletdra "k8s.io/kubernetes/pkg/kubelet/cm/dra"
	kubeletconfig "k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/driverroot"
)

// fakeDriverInstall writes versioned driver libraries with their .so.1
// links and nvidia-smi below root, as a driver installation has them.
func fakeDriverInstall(t *testing.T, root, version string) {
	t.Helper()
	libDir := filepath.Join(root, "usr/lib/x86_64-linux-gnu")
	for _, dir := range []string{libDir, filepath.Join(root, "usr/bin")} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, lib := range []string{"libnvidia-ml.so", "libcuda.so"} {
		if err := os.WriteFile(filepath.Join(libDir, lib+"."+version), []byte("fake"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink("/usr/lib/x86_64-linux-gnu/"+lib+"."+version, filepath.Join(libDir, lib+".1")); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "usr/bin/nvidia-smi"), []byte("fake"), 0o755); err != nil {
		t.Fatal(err)
	}
}

// TestKubeletDRAManagerPrepares runs the kubelet's own DRA code as the
// agent's client: the kubelet plugin manager finds the agent through its
// registration socket, the kubelet DRA manager prepares a pod's claim,
// the CDI ids it hands to the runtime resolve in a CDI cache to a spec with
// the driver's libraries and nvidia-smi from the driver root, and
// unpreparing removes the spec again.
func TestKubeletDRAManagerPrepares(t *testing.T) {
	logger, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	e := newEnv(t)

	// Unix socket paths are limited to ~108 bytes; t.TempDir can be longer.
	base, err := os.MkdirTemp("", "tk")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(base) })
	pluginDir, registryDir, kubeletState := filepath.Join(base, "p"), filepath.Join(base, "r"), filepath.Join(base, "k")
	for _, dir := range []string{pluginDir, registryDir, kubeletState} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			t.Fatal(err)
		}
	}

	// The kubelet side: DRA manager plus plugin manager on the registry.
	node, err := e.client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	manager, err := kubeletdra.NewManager(logger, e.client, kubeletState)
	if err != nil {
		t.Fatal(err)
	}
	sourcesReady := kubeletconfig.NewSourcesReady(func(sets.Set[string]) bool { return true })
	if err := manager.Start(ctx, func() []*v1.Pod { return nil }, func(context.Context) (*v1.Node, error) { return node, nil }, sourcesReady); err != nil {
		t.Fatal(err)
	}
	defer manager.Stop()
	plugins := pluginmanager.NewPluginManager(registryDir, record.NewFakeRecorder(10))
	plugins.AddHandler(pluginregistrationv1.DRAPlugin, manager.GetWatcherHandler())
	go plugins.Run(ctx, sourcesReady, ctx.Done())

	// The agent, with CDI specs from nvcdi over a fake driver root that
	// holds the driver version the (mock) NVML reports.
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: e.machine.NVML(), Sysfs: e.machine.Sysfs()})
	if err != nil {
		t.Fatal(err)
	}
	driverVersion, ret := e.machine.NVML().SystemGetDriverVersion()
	if ret != nvml.SUCCESS {
		t.Fatalf("driver version: %v", ret)
	}
	rootDir := t.TempDir()
	fakeDriverInstall(t, rootDir, driverVersion)
	root, err := driverroot.New("/run/nvidia/driver", rootDir)
	if err != nil {
		t.Fatal(err)
	}
	gen, err := cdi.NewNVCDI(cdi.NVCDIOptions{Root: root, NVML: func() nvml.Interface { return e.machine.NVML() }})
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(ctx, agent.Options{
		NodeName:       nodeName,
		KubeClient:     e.client,
		Discovery:      disc,
		CDIGenerator:   gen,
		PluginDataDir:  pluginDir,
		RegistrarDir:   registryDir,
		StateDir:       e.stateDir,
		CDIDir:         e.cdiDir,
		BootIDPath:     e.bootIDFile,
		RescanInterval: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Stop()

	// A pod with a claim allocated gpu-3 of this node and reserved for it.
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "trainer", UID: "pod-uid"},
		Spec: v1.PodSpec{
			NodeName:       nodeName,
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: ptrTo("kubelet-dra")}},
			Containers: []v1.Container{{
				Name:      "main",
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
			}},
		},
	}
	c := claim("kubelet-dra", gpus("gpus", "gpu-3")...)
	c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: pod.Name, UID: pod.UID}}
	if _, err := e.client.ResourceV1().ResourceClaims(c.Namespace).Create(ctx, c, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	// Registration is asynchronous (the plugin watcher polls the
	// directory): prepare until the kubelet knows the driver.
	var lastErr error
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		lastErr = manager.PrepareResources(ctx, pod)
		return lastErr == nil, nil
	}); err != nil {
		t.Fatalf("kubelet could not prepare the pod's claim: %v", lastErr)
	}
	info, err := manager.GetResources(pod, &pod.Spec.Containers[0])
	if err != nil {
		t.Fatal(err)
	}
	if len(info.CDIDevices) != 1 || info.CDIDevices[0].Name != cdi.DeviceID(c.UID, "gpu-3") {
		t.Fatalf("kubelet hands the runtime %v, want [%s]", info.CDIDevices, cdi.DeviceID(c.UID, "gpu-3"))
	}

	// What the runtime does with the id.
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(e.cdiDir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	device := cache.GetDevice(info.CDIDevices[0].Name)
	if device == nil {
		t.Fatalf("CDI cache cannot resolve %s: %v", info.CDIDevices[0].Name, cache.GetErrors())
	}
	var mounts []string
	for _, m := range device.GetSpec().ContainerEdits.Mounts {
		mounts = append(mounts, m.HostPath)
	}
	for _, want := range []string{
		"/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + driverVersion,
		"/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so." + driverVersion,
		"/run/nvidia/driver/usr/bin/nvidia-smi",
	} {
		if !containsString(mounts, want) {
			t.Errorf("spec mounts %v, want %s", mounts, want)
		}
	}
	specPath := device.GetSpec().GetPath()

	if err := manager.UnprepareResources(ctx, pod); err != nil {
		t.Fatalf("unprepare: %v", err)
	}
	if _, err := os.Stat(specPath); !os.IsNotExist(err) {
		t.Errorf("CDI spec %s still there after unprepare: %v", specPath, err)
	}
}

func ptrTo[T any](v T) *T { return &v }

func containsString(list []string, s string) bool {
	for _, l := range list {
		if strings.EqualFold(l, s) {
			return true
		}
	}
	return false
}
