package cdi_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"golang.org/x/sys/unix"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/driverroot"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
)

// driverVersion is what the mock machine profiles report.
const driverVersion = "570.133.07"

// fakeDriverRoot lays out a driver installation as a GPU Operator driver
// container has it: versioned libraries with .so.1 links (absolute, as
// ldconfig makes them), nvidia-smi, and /dev with the GPU and control nodes
// but without nvidia-uvm (module not loaded). Device nodes need CAP_MKNOD;
// devNodes is false without it.
func fakeDriverRoot(t *testing.T) (root string, devNodes bool) {
	t.Helper()
	root = t.TempDir()
	libDir := "/usr/lib/x86_64-linux-gnu"
	write := func(rel string, mode os.FileMode) {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("fake "+filepath.Base(rel)), mode); err != nil {
			t.Fatal(err)
		}
	}
	for _, lib := range []string{"libnvidia-ml.so", "libcuda.so", "libnvidia-ptxjitcompiler.so"} {
		versioned := filepath.Join(libDir, lib+"."+driverVersion)
		write(versioned, 0o755)
		if err := os.Symlink(versioned, filepath.Join(root, libDir, lib+".1")); err != nil {
			t.Fatal(err)
		}
	}
	write("/usr/bin/nvidia-smi", 0o755)
	write("/usr/bin/nvidia-debugdump", 0o755)
	devNodes = true
	for name, minor := range map[string]uint32{"nvidiactl": 255, "nvidia0": 0, "nvidia1": 1} {
		p := filepath.Join(root, "dev", name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(195, minor))); err != nil {
			t.Logf("cannot create device nodes (%v): checking driver files only", err)
			devNodes = false
			break
		}
	}
	return root, devNodes
}

// TestNVCDIFromDriverRoot generates a claim spec with nvcdi on a fake driver
// root mounted at a temporary directory that is /run/nvidia/driver on the
// node, and reads it back through the CDI cache as a runtime would.
func TestNVCDIFromDriverRoot(t *testing.T) {
	mountPoint, devNodes := fakeDriverRoot(t)
	root, err := driverroot.New(driverroot.GPUOperatorHostPath, mountPoint)
	if err != nil {
		t.Fatal(err)
	}
	m, err := mockgpu.New(mockgpu.ProfileWorkstation2GPU, mockgpu.Options{NodeName: "n"})
	if err != nil {
		t.Fatal(err)
	}
	lib := m.NVML()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		t.Fatalf("init mock NVML: %v", ret)
	}
	const hook = "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
	gen, err := cdi.NewNVCDI(cdi.NVCDIOptions{Root: root, NVML: func() nvml.Interface { return lib }, HookPath: hook})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	w, err := cdi.New(dir, cdi.WithGenerator(gen))
	if err != nil {
		t.Fatal(err)
	}
	devices := []cdi.Device{{Name: "gpu-1", UUID: m.UUID(1), Minor: 1}}
	ids, err := w.WriteClaimSpec("uid-1", devices)
	if err != nil {
		t.Fatalf("write spec: %v", err)
	}

	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	if errs := cache.GetErrors(); len(errs) > 0 {
		t.Fatalf("CDI cache rejects the spec: %v", errs)
	}
	dev := cache.GetDevice(ids["gpu-1"])
	if dev == nil {
		t.Fatalf("runtime cannot resolve %s", ids["gpu-1"])
	}
	spec := dev.GetSpec().Spec
	if t.Failed() || testing.Verbose() {
		data, _ := json.MarshalIndent(spec, "", "  ")
		t.Logf("spec:\n%s", data)
	}

	all := allEdits(spec)
	mounts := map[string]string{}
	for _, mnt := range all.Mounts {
		mounts[mnt.ContainerPath] = mnt.HostPath
	}
	hostLib := "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/"
	for containerPath, hostPath := range map[string]string{
		"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + driverVersion: hostLib + "libnvidia-ml.so." + driverVersion,
		"/usr/lib/x86_64-linux-gnu/libcuda.so." + driverVersion:      hostLib + "libcuda.so." + driverVersion,
		"/usr/bin/nvidia-smi": "/run/nvidia/driver/usr/bin/nvidia-smi",
	} {
		if got, ok := mounts[containerPath]; !ok || got != hostPath {
			t.Errorf("mount of %s: host path %q (present %v), want %q", containerPath, got, ok, hostPath)
		}
	}
	for c, h := range mounts {
		if strings.HasPrefix(h, mountPoint) || strings.HasPrefix(c, mountPoint) {
			t.Errorf("mount %s -> %s names the agent's mount point %s, not the node's path", h, c, mountPoint)
		}
	}
	if len(all.Hooks) == 0 {
		t.Error("no hooks (ldcache update, symlinks)")
	}
	for _, h := range all.Hooks {
		if h.Path != hook {
			t.Errorf("hook %v runs %s, want %s", h.Args, h.Path, hook)
		}
	}
	var nodes []string
	for _, n := range all.DeviceNodes {
		nodes = append(nodes, n.Path)
		if strings.Contains(n.Path, "nvidia-uvm") {
			t.Errorf("device node %s listed, but it does not exist", n.Path)
		}
	}
	if devNodes {
		for _, want := range []string{"/dev/nvidia1", "/dev/nvidiactl"} {
			if !slices.Contains(nodes, want) {
				t.Errorf("device nodes %v lack %s", nodes, want)
			}
		}
		if slices.Contains(nodes, "/dev/nvidia0") {
			t.Errorf("device nodes %v include gpu-0's, which the claim does not have", nodes)
		}
	}
	if !slices.Contains(all.Env, "NVIDIA_VISIBLE_DEVICES="+m.UUID(1)) {
		t.Errorf("env %v lacks NVIDIA_VISIBLE_DEVICES", all.Env)
	}
}

func allEdits(spec *cdispec.Spec) cdispec.ContainerEdits {
	all := spec.ContainerEdits
	for _, d := range spec.Devices {
		all.Env = append(all.Env, d.ContainerEdits.Env...)
		all.DeviceNodes = append(all.DeviceNodes, d.ContainerEdits.DeviceNodes...)
		all.Mounts = append(all.Mounts, d.ContainerEdits.Mounts...)
		all.Hooks = append(all.Hooks, d.ContainerEdits.Hooks...)
	}
	return all
}

// TestNVCDIWithoutNVML fails clearly instead of writing a spec without the
// driver.
func TestNVCDIWithoutNVML(t *testing.T) {
	root, _ := driverroot.New("/", t.TempDir())
	gen, err := cdi.NewNVCDI(cdi.NVCDIOptions{Root: root, NVML: func() nvml.Interface { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	w, err := cdi.New(t.TempDir(), cdi.WithGenerator(gen))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.WriteClaimSpec("uid", []cdi.Device{{Name: "gpu-0", UUID: "GPU-0"}}); err == nil || !strings.Contains(err.Error(), "NVML is not loaded") {
		t.Errorf("want an error saying NVML is not loaded, got %v", err)
	}
}
