package main

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/klog/v2/ktesting"
	"sigs.k8s.io/yaml"

	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/driverroot"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
)

// lastDocs splits --dry-run output and returns its last two documents:
// with --show-cdi, the prepared claim's CDI spec and the container view.
func lastDocs(t *testing.T, out string) (spec, view string) {
	t.Helper()
	docs := strings.Split(out, "---\n")
	if len(docs) < 3 {
		t.Fatalf("want the slice, the CDI spec and the container view, got:\n%s", out)
	}
	return docs[len(docs)-2], docs[len(docs)-1]
}

// TestDryRunShowCDI prepares, after the slice, a claim for all mock GPUs
// and prints its CDI spec and what a container gets: environment only, no
// device nodes.
func TestDryRunShowCDI(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	var stdout, stderr bytes.Buffer
	if err := run(ctx, &options{nvml: "mock:workstation-2gpu", dryRun: true, showCDI: true, nodeName: "node-1"}, &stdout, &stderr); err != nil {
		t.Fatal(err)
	}
	spec, view := lastDocs(t, stdout.String())
	for _, want := range []string{"kind: gpu.topodra.io/gpu", "name: dry-run-gpu-0", "name: dry-run-gpu-1"} {
		if !strings.Contains(spec, want) {
			t.Errorf("CDI spec lacks %q:\n%s", want, spec)
		}
	}
	var got containerView
	if err := yaml.Unmarshal([]byte(view), &got); err != nil {
		t.Fatalf("container view: %v\n%s", err, view)
	}
	if want := []string{"gpu.topodra.io/gpu=dry-run-gpu-0", "gpu.topodra.io/gpu=dry-run-gpu-1"}; !slices.Equal(got.CDIDevices, want) {
		t.Errorf("CDI devices %v, want %v", got.CDIDevices, want)
	}
	for _, prefix := range []string{"NVIDIA_VISIBLE_DEVICES=GPU-", "TOPODRA_GPU_0=GPU-", "TOPODRA_GPU_1=GPU-"} {
		if !slices.ContainsFunc(got.Env, func(e string) bool { return strings.HasPrefix(e, prefix) }) {
			t.Errorf("container env %v lacks %s...", got.Env, prefix)
		}
	}
	if len(got.Devices) != 0 {
		t.Errorf("mock GPUs must not get device nodes: %v", got.Devices)
	}
}

// TestShowPreparedNVCDI prepares a claim with CDI edits from nvcdi over a
// fake driver root mounted at a temporary directory that is
// /run/nvidia/driver on the node, with no device nodes of its own, as a
// driver directory has it: the device nodes come from the device root. The
// container gets the GPUs' UUIDs, their device nodes and the driver's
// libraries and nvidia-smi from the node's path, and the temporary state is
// gone afterwards. Without device nodes, preparing fails and says which
// GPU lacks which node.
func TestShowPreparedNVCDI(t *testing.T) {
	testcases := map[string]struct {
		deviceNodes bool
		wantErr     []string
	}{
		"device nodes in the device root": {deviceNodes: true},
		"no device nodes":                 {wantErr: []string{"prepare claim", "gpu-0", "device node missing: /dev/nvidiactl"}},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			testShowPreparedNVCDI(t, tc.deviceNodes, tc.wantErr)
		})
	}
}

func testShowPreparedNVCDI(t *testing.T, deviceNodes bool, wantErr []string) {
	_, ctx := ktesting.NewTestContext(t)
	m, err := mockgpu.New(mockgpu.ProfileWorkstation2GPU, mockgpu.Options{NodeName: "node-1"})
	if err != nil {
		t.Fatal(err)
	}
	version, ret := m.NVML().SystemGetDriverVersion()
	if ret != nvml.SUCCESS {
		t.Fatalf("driver version: %v", ret)
	}
	mountPoint := t.TempDir()
	libDir := filepath.Join(mountPoint, "usr/lib/x86_64-linux-gnu")
	for _, dir := range []string{libDir, filepath.Join(mountPoint, "usr/bin")} {
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
	if err := os.WriteFile(filepath.Join(mountPoint, "usr/bin/nvidia-smi"), []byte("fake"), 0o755); err != nil {
		t.Fatal(err)
	}
	// The device root stands for the node's /dev; the runtime's side of
	// showPrepared reads the nodes' types from the host paths in the
	// spec, so here the node's path is the temporary directory too.
	devRoot := t.TempDir()
	if deviceNodes {
		if _, err := m.WriteDeviceNodes(devRoot); err != nil {
			t.Fatal(err)
		}
	}
	root, err := driverroot.New(driverroot.GPUOperatorHostPath, mountPoint)
	if err != nil {
		t.Fatal(err)
	}
	if root, err = root.WithDevRoot(devRoot, devRoot); err != nil {
		t.Fatal(err)
	}
	gen, err := cdi.NewNVCDI(cdi.NVCDIOptions{Root: root, NVML: func() nvml.Interface { return m.NVML() }})
	if err != nil {
		t.Fatal(err)
	}
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: m.NVML(), Sysfs: m.Sysfs()})
	if err != nil {
		t.Fatal(err)
	}
	inv, err := disc.Discover(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("TMPDIR", t.TempDir())

	var out bytes.Buffer
	err = showPrepared(ctx, &source{discovery: disc, cdi: gen}, "node-1", inv, &out)
	if left, _ := filepath.Glob(filepath.Join(os.Getenv("TMPDIR"), "*")); len(left) != 0 {
		t.Errorf("temporary state left behind: %v", left)
	}
	if wantErr != nil {
		if err == nil {
			t.Fatalf("prepared without device nodes:\n%s", out.String())
		}
		for _, want := range wantErr {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not say %q", err, want)
			}
		}
		return
	}
	if err != nil {
		t.Fatalf("prepare: %v\n%s", err, out.String())
	}
	var got containerView
	docs := strings.Split(out.String(), "---\n")
	if err := yaml.Unmarshal([]byte(docs[len(docs)-1]), &got); err != nil {
		t.Fatalf("container view: %v\n%s", err, out.String())
	}
	for _, want := range []string{"TOPODRA_GPU_1=" + m.UUID(1), "NVIDIA_VISIBLE_DEVICES=void"} {
		if !slices.Contains(got.Env, want) {
			t.Errorf("container env %v lacks %s", got.Env, want)
		}
	}
	var nodes []string
	for _, d := range got.Devices {
		nodes = append(nodes, d.Path)
	}
	for _, want := range []string{"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"} {
		if !slices.Contains(nodes, want) {
			t.Errorf("container device nodes %v lack %s", nodes, want)
		}
	}
	mounts := map[string]string{}
	for _, mnt := range got.Mounts {
		mounts[mnt.Destination] = mnt.Source
	}
	for container, host := range map[string]string{
		"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + version: "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + version,
		"/usr/lib/x86_64-linux-gnu/libcuda.so." + version:      "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so." + version,
		"/usr/bin/nvidia-smi":                                  "/run/nvidia/driver/usr/bin/nvidia-smi",
	} {
		if got := mounts[container]; got != host {
			t.Errorf("container path %s mounts %q, want %q (all mounts: %v)", container, got, host, mounts)
		}
	}
}
