package integration

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
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
// see the GPU Healthy; unprepare removes the spec. In between, a container
// of that CDI device must run nvidia-smi and CUDA on the GPU
// (containerSeesGPU). Where there is no NVML library or no GPU (CI) it
// skips and says why.
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
	for _, want := range []string{cdi.DeviceEnv(gpu.Name) + "=" + gpu.UUID, cdi.VisibleDevicesEnv + "=void"} {
		if !slices.Contains(spec.Process.Env, want) {
			tCtx.Errorf("container environment %v lacks %s", spec.Process.Env, want)
		}
	}
	if !slices.ContainsFunc(spec.Mounts, func(m oci.Mount) bool { return path.Base(m.Source) == "libnvidia-ml.so."+driverVersion }) {
		tCtx.Errorf("container mounts lack libnvidia-ml.so.%s: %v", driverVersion, spec.Mounts)
	}

	tCtx.Run("container", func(tCtx ktesting.TContext) {
		containerSeesGPU(tCtx, spec, gpu.UUID, fmt.Sprintf("/dev/nvidia%d", gpu.Minor))
	})

	waitHealth(tCtx, manager, pod, wantID, v1.ResourceHealthStatusHealthy)
	unprepareOnKubelet(tCtx, manager, pod, cache.GetDevice(wantID).GetSpec().GetPath())
}

// containerSeesGPU runs nvidia-smi, and a CUDA program where there is a C
// compiler, in a container of spec (see runContainer): nvidia-smi, mounted
// by the spec, must list exactly the GPU of uuid, and the CUDA program
// must create a context on it and move memory to and from it. As controls,
// the same container without the GPU's device node (node) must list no
// GPU, and without /dev/nvidia-uvm CUDA must not start: the checks pass
// on what the spec gives the container, not on what the machine has.
func containerSeesGPU(tCtx ktesting.TContext, spec *oci.Spec, uuid, node string) {
	if why := containerUnsupported(tCtx); why != "" {
		tCtx.Skipf("no container here: %s", why)
	}
	smi := ""
	for _, m := range spec.Mounts {
		if path.Base(m.Destination) == "nvidia-smi" {
			smi = m.Destination
		}
	}
	if smi == "" {
		tCtx.Fatalf("the container gets no nvidia-smi: %v", spec.Mounts)
	}
	out, err := runContainer(tCtx, spec, nil, smi, "--query-gpu=uuid,name", "--format=csv,noheader")
	tCtx.Logf("nvidia-smi in the container:\n%s", out)
	if err != nil {
		tCtx.Fatalf("nvidia-smi in the container: %v", err)
	}
	if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 1 || !strings.HasPrefix(lines[0], uuid+",") {
		tCtx.Errorf("nvidia-smi in the container lists %q, want the one GPU %s", lines, uuid)
	}
	out, err = runContainer(tCtx, withoutDevices(spec, node), nil, smi, "--query-gpu=uuid,name", "--format=csv,noheader")
	tCtx.Logf("nvidia-smi in the container without %s (%v):\n%s", node, err, out)
	if err == nil || strings.Contains(out, uuid) {
		tCtx.Errorf("nvidia-smi in a container without %s still works and lists %q", node, out)
	}

	cc, err := exec.LookPath("cc")
	if err != nil {
		tCtx.Logf("no C compiler here (%v): CUDA not checked in the container", err)
		return
	}
	bin := path.Join(tCtx.TempDir(), "cudacheck")
	if out, err := exec.CommandContext(tCtx, cc, "-O2", "-o", bin, "testdata/cudacheck.c", "-ldl").CombinedOutput(); err != nil {
		tCtx.Fatalf("build testdata/cudacheck.c: %v\n%s", err, out)
	}
	out, err = runContainer(tCtx, spec, map[string]string{"/usr/local/bin/cudacheck": bin}, "/usr/local/bin/cudacheck")
	tCtx.Logf("cudacheck in the container:\n%s", out)
	if err != nil {
		tCtx.Fatalf("cudacheck in the container: %v", err)
	}
	if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 1 || !strings.HasPrefix(lines[0], uuid+" ") {
		tCtx.Errorf("CUDA in the container sees %q, want the one GPU %s", lines, uuid)
	}
	out, err = runContainer(tCtx, withoutDevices(spec, "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"), map[string]string{"/usr/local/bin/cudacheck": bin}, "/usr/local/bin/cudacheck")
	tCtx.Logf("cudacheck in the container without /dev/nvidia-uvm (%v):\n%s", err, out)
	if err == nil {
		tCtx.Errorf("CUDA in a container without /dev/nvidia-uvm still works: %s", out)
	}
}

// withoutDevices returns a copy of spec without the device nodes paths.
func withoutDevices(spec *oci.Spec, paths ...string) *oci.Spec {
	linux := *spec.Linux
	linux.Devices = slices.DeleteFunc(slices.Clone(linux.Devices), func(d oci.LinuxDevice) bool { return slices.Contains(paths, d.Path) })
	out := *spec
	out.Linux = &linux
	return &out
}
