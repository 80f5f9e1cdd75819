package integration

import (
	"errors"
	"fmt"
	"os"
	"path"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	oci "github.com/opencontainers/runtime-spec/specs-go"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/kubernetes/test/utils/ktesting"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/driverroot"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// TestKubeletPreparesRealGPU is TestKubeletDRAManagerPrepares on this
// machine's own GPUs: the agent discovers them with the real NVML library
// of the driver root that DRIVER_ROOT names (default "/") and generates CDI
// specs over that root; topodra-scheduler allocates one GPU to a pod; the
// kubelet's DRA manager prepares it. The CDI id the kubelet hands the
// runtime must give a container the allocated GPU's device node,
// /dev/nvidiactl, its UUID and the driver's libnvidia-ml; the kubelet must
// see the GPU Healthy; unprepare removes the spec. Where there is no NVML
// library or no GPU (CI) it skips and says why.
func TestKubeletPreparesRealGPU(t *testing.T) {
	tCtx := ktesting.Init(t)
	root, err := driverroot.New(os.Getenv("DRIVER_ROOT"), "")
	tCtx.ExpectNoError(err)
	disc := discovery.NewLazy(discovery.OpenFromRoot(root), discovery.NVMLOptions{})
	defer func() { _ = disc.Close() }()
	inv, err := disc.Discover(tCtx)
	if errors.Is(err, discovery.ErrNoGPU) {
		t.Skipf("no GPU here: %v", err)
	}
	tCtx.ExpectNoError(err, "discover GPUs")
	if len(inv.GPUs) == 0 {
		t.Skipf("no GPU to publish here (%d skipped)", len(inv.Skipped))
	}
	driverVersion, ret := disc.Lib().SystemGetDriverVersion()
	if ret != nvml.SUCCESS {
		tCtx.Fatalf("driver version: %v", ret)
	}

	e := newEnv(tCtx, "realgpu")
	nodeName := e.ns + "-node"
	_, err = framework.CreateReadyNode(tCtx, cp.Client, nodeName, map[string]string{"test": e.ns, "group": "realgpu"})
	tCtx.ExpectNoError(err)
	dirs := shortDirs(tCtx, "tg", "p", "r", "k")
	manager := startKubeletDRA(tCtx, nodeName, dirs[1], dirs[2])

	gen, err := cdi.NewNVCDI(cdi.NVCDIOptions{Root: root, NVML: disc.Lib})
	tCtx.ExpectNoError(err)
	cdiDir := tCtx.TempDir()
	startNodeAgent(tCtx, nodeName, disc, gen, dirs[0], dirs[1], cdiDir)
	waitForSlice(tCtx, t, cp.Client, topology.DriverName, nodeName, fmt.Sprintf("%d devices", len(inv.GPUs)), func(s *resourceapi.ResourceSlice) bool {
		return len(s.Spec.Devices) == len(inv.GPUs)
	})

	startTopodra(tCtx)
	e.pod("trainer", topodraName, "realgpu", e.template(1, nil))
	pod := e.waitScheduled("trainer")
	devices := e.devicesOf(pod)
	if pod.Spec.NodeName != nodeName || len(devices) != 1 {
		tCtx.Fatalf("pod bound to %s with %v, want one GPU of %s", pod.Spec.NodeName, devices, nodeName)
	}
	gpu := inv.GPU(devices[0])
	if gpu == nil {
		tCtx.Fatalf("topodra allocated %s, which discovery did not report", devices[0])
	}
	claims, err := framework.PodClaims(tCtx, cp.Client, pod)
	tCtx.ExpectNoError(err)
	claim := claims[0]
	tCtx.Logf("topodra allocated %s (%s, PCI %s) to claim %s", gpu.Name, gpu.UUID, gpu.PCIBusID, claim.Name)

	wantID := cdi.DeviceID(claim.UID, gpu.Name)
	prepareOnKubelet(tCtx, manager, pod, wantID)

	// What a runtime gives the container for that id.
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(cdiDir), cdiapi.WithAutoRefresh(false))
	tCtx.ExpectNoError(err)
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	if _, err := cache.InjectDevices(spec, wantID); err != nil {
		tCtx.Fatalf("apply CDI device %s: %v", wantID, err)
	}
	var nodes []string
	for _, d := range spec.Linux.Devices {
		nodes = append(nodes, d.Path)
	}
	for _, want := range []string{fmt.Sprintf("/dev/nvidia%d", gpu.Minor), driverroot.ControlDevice} {
		if !slices.Contains(nodes, want) {
			tCtx.Errorf("container gets device nodes %v, want %s", nodes, want)
		}
	}
	if !slices.ContainsFunc(spec.Process.Env, func(env string) bool {
		return strings.HasPrefix(env, "NVIDIA_VISIBLE_DEVICES=") && strings.Contains(env, gpu.UUID)
	}) {
		tCtx.Errorf("container environment %v lacks NVIDIA_VISIBLE_DEVICES with %s", spec.Process.Env, gpu.UUID)
	}
	if !slices.ContainsFunc(spec.Mounts, func(m oci.Mount) bool { return path.Base(m.Source) == "libnvidia-ml.so."+driverVersion }) {
		tCtx.Errorf("container mounts lack libnvidia-ml.so.%s: %v", driverVersion, spec.Mounts)
	}

	waitHealth(tCtx, manager, pod, wantID, v1.ResourceHealthStatusHealthy)
	unprepareOnKubelet(tCtx, manager, pod, cache.GetDevice(wantID).GetSpec().GetPath())
}
