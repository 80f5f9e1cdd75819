package cdi_test

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/nvidia-container-toolkit/pkg/nvcdi"
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
// ldconfig makes them), nvidia-smi, and /dev with the machine's GPU and
// control nodes but without nvidia-uvm (module not loaded).
func fakeDriverRoot(t *testing.T, m *mockgpu.Machine) string {
	t.Helper()
	root := fakeDriverFiles(t)
	if _, err := m.WriteDeviceNodes(root); err != nil {
		t.Fatal(err)
	}
	return root
}

// fakeDriverFiles lays out the driver's libraries and binaries only, as a
// driver directory mounted without device nodes has them.
func fakeDriverFiles(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
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
	return root
}

// workstation is the mock machine of the tests, with its NVML initialized.
func workstation(t *testing.T) (*mockgpu.Machine, nvml.Interface) {
	t.Helper()
	m, err := mockgpu.New(mockgpu.ProfileWorkstation2GPU, mockgpu.Options{NodeName: "n"})
	if err != nil {
		t.Fatal(err)
	}
	lib := m.NVML()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		t.Fatalf("init mock NVML: %v", ret)
	}
	return m, lib
}

// TestNVCDIFromDriverRoot generates a claim spec with nvcdi on a fake driver
// root mounted at a temporary directory that is /run/nvidia/driver on the
// node, and reads it back through the CDI cache as a runtime would.
func TestNVCDIFromDriverRoot(t *testing.T) {
	m, lib := workstation(t)
	mountPoint := fakeDriverRoot(t, m)
	root, err := driverroot.New(driverroot.GPUOperatorHostPath, mountPoint)
	if err != nil {
		t.Fatal(err)
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
	nodes := map[string]string{}
	for _, n := range all.DeviceNodes {
		nodes[n.Path] = n.HostPath
		if strings.Contains(n.Path, "nvidia-uvm") {
			t.Errorf("device node %s listed, but it does not exist", n.Path)
		}
	}
	for _, want := range []string{"/dev/nvidia1", "/dev/nvidiactl"} {
		if host, ok := nodes[want]; !ok || host != "/run/nvidia/driver"+want {
			t.Errorf("device node %s: host path %q (present %v), want the driver root's %s (all: %v)", want, host, ok, "/run/nvidia/driver"+want, nodes)
		}
	}
	if _, ok := nodes["/dev/nvidia0"]; ok {
		t.Errorf("device nodes %v include gpu-0's, which the claim does not have", nodes)
	}
	// nvcdi's NVIDIA_VISIBLE_DEVICES=void stays, so that the NVIDIA
	// Container Runtime does not inject GPUs a second time; the GPU's
	// own variable names it.
	var visible []string
	for _, e := range all.Env {
		if strings.HasPrefix(e, "NVIDIA_VISIBLE_DEVICES=") {
			visible = append(visible, e)
		}
	}
	if !slices.Equal(visible, []string{"NVIDIA_VISIBLE_DEVICES=void"}) {
		t.Errorf("env sets %v, want only NVIDIA_VISIBLE_DEVICES=void", visible)
	}
	if want := cdi.DeviceEnv("gpu-1") + "=" + m.UUID(1); !slices.Contains(all.Env, want) {
		t.Errorf("env %v lacks %s", all.Env, want)
	}
}

// TestNVCDIDeviceNodes checks where the device nodes of a spec come from
// when the driver root has no /dev (a driver directory, a host installation
// mounted without its /dev): the device root, named by the node's path in
// the spec. A spec without the GPU's device node or /dev/nvidiactl would
// start the container without its GPU; generating it fails instead, naming
// the device and the node, and writes no spec.
func TestNVCDIDeviceNodes(t *testing.T) {
	testcases := map[string]struct {
		// remove lists device nodes that the device root lacks; nil
		// removes /dev altogether.
		remove []string
		// driverHost is the driver root on the node; default "/".
		driverHost string
		wantErr    []string
	}{
		"all there":                        {remove: []string{}},
		"all there, driver container root": {remove: []string{}, driverHost: driverroot.GPUOperatorHostPath},
		"no /dev at all":                   {wantErr: []string{"gpu-1", "/dev/nvidiactl"}},
		"no nvidiactl":                     {remove: []string{"nvidiactl"}, wantErr: []string{"gpu-1", "/dev/nvidiactl"}},
		"no GPU node":                      {remove: []string{"nvidia1"}, wantErr: []string{"gpu-1", "/dev/nvidia1"}},
		"other GPU's there":                {remove: []string{"nvidia1", "nvidiactl"}, wantErr: []string{"gpu-1", "/dev/nvidiactl"}},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			m, lib := workstation(t)
			devRoot := t.TempDir()
			if tc.remove != nil {
				if _, err := m.WriteDeviceNodes(devRoot); err != nil {
					t.Fatal(err)
				}
				for _, n := range tc.remove {
					if err := os.Remove(filepath.Join(devRoot, "dev", n)); err != nil {
						t.Fatal(err)
					}
				}
			}
			gen := generatorWithDevRoot(t, lib, tc.driverHost, fakeDriverFiles(t), devRoot)
			spec, err := claimSpec(t, m, gen)
			if tc.wantErr != nil {
				t.Logf("error: %v", err)
				if !errors.Is(err, cdi.ErrMissingDeviceNode) {
					t.Fatalf("want an error wrapping %q, got %v", cdi.ErrMissingDeviceNode, err)
				}
				for _, want := range tc.wantErr {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("error %q does not name %s", err, want)
					}
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			nodes := map[string]string{}
			for _, n := range allEdits(spec).DeviceNodes {
				nodes[n.Path] = n.HostPath
			}
			for _, want := range []string{"/dev/nvidia1", "/dev/nvidiactl"} {
				host, ok := nodes[want]
				if !ok {
					t.Errorf("device nodes %v lack %s", nodes, want)
				}
				// nvcdi leaves the host path out where it equals the path.
				if host != "" && host != want {
					t.Errorf("device node %s has host path %s, want the node's %s", want, host, want)
				}
			}
		})
	}
}

// TestNVCDIDeviceNodesAppearInDriverRoot: the driver root (the host's /,
// mounted in the agent's container) has no device nodes at first, so the
// node's /dev is the device root and nothing can be prepared; then the
// nodes appear in the driver root's /dev (something ran on the host). The
// generator takes them from there, and the spec names them by the node's
// paths, not by the agent's mount points.
func TestNVCDIDeviceNodesAppearInDriverRoot(t *testing.T) {
	m, lib := workstation(t)
	mount := fakeDriverFiles(t)
	devRoot := t.TempDir()
	gen := generatorWithDevRoot(t, lib, "/", mount, devRoot)
	if _, err := claimSpec(t, m, gen); !errors.Is(err, cdi.ErrMissingDeviceNode) {
		t.Fatalf("without device nodes: %v, want %v", err, cdi.ErrMissingDeviceNode)
	}
	for _, dir := range []string{mount, devRoot} {
		if _, err := m.WriteDeviceNodes(dir); err != nil {
			t.Fatal(err)
		}
	}
	spec, err := claimSpec(t, m, gen)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range allEdits(spec).DeviceNodes {
		for _, agentPath := range []string{mount, devRoot} {
			if strings.HasPrefix(n.HostPath, agentPath) || strings.HasPrefix(n.Path, agentPath) {
				t.Errorf("device node %s names the agent's path %s (host path %s)", n.Path, agentPath, n.HostPath)
			}
		}
	}
}

// generatorWithDevRoot is an NVCDI generator for a driver root that is
// driverHost on the node ("" is "/") and mount in the agent's container,
// with the node's / as device root mounted at devRoot.
func generatorWithDevRoot(t *testing.T, lib nvml.Interface, driverHost, mount, devRoot string) *cdi.NVCDI {
	t.Helper()
	root, err := driverroot.New(driverHost, mount)
	if err != nil {
		t.Fatal(err)
	}
	if root, err = root.WithDevRoot("/", devRoot); err != nil {
		t.Fatal(err)
	}
	gen, err := cdi.NewNVCDI(cdi.NVCDIOptions{Root: root, NVML: func() nvml.Interface { return lib }})
	if err != nil {
		t.Fatal(err)
	}
	return gen
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

// hookNames are the nvidia-cdi-hook subcommands that edits run.
func hookNames(edits cdispec.ContainerEdits) []string {
	var names []string
	for _, h := range edits.Hooks {
		if len(h.Args) > 1 && !slices.Contains(names, h.Args[1]) {
			names = append(names, h.Args[1])
		}
	}
	slices.Sort(names)
	return names
}

// claimSpec writes the spec of a claim for gpu-1 with gen and reads it
// back as a runtime would.
func claimSpec(t *testing.T, m *mockgpu.Machine, gen cdi.Generator) (*cdispec.Spec, error) {
	t.Helper()
	dir := t.TempDir()
	w, err := cdi.New(dir, cdi.WithGenerator(gen))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.WriteClaimSpec("uid-1", []cdi.Device{{Name: "gpu-1", UUID: m.UUID(1), Minor: 1}}); err != nil {
		if _, statErr := os.Stat(w.SpecPath("uid-1")); !errors.Is(statErr, os.ErrNotExist) {
			t.Errorf("spec written despite %v", err)
		}
		return nil, err
	}
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	dev := cache.GetDevice(cdi.DeviceID("uid-1", "gpu-1"))
	if dev == nil {
		t.Fatalf("runtime cannot resolve the device: %v", cache.GetErrors())
	}
	return dev.GetSpec().Spec, nil
}

// TestNVCDIDisabledHooks: every hook that nvcdi puts into a spec is one
// of cdi.Hooks (whose toolkit versions the README and the errors name),
// and a disabled hook is left out of the spec while the others stay.
func TestNVCDIDisabledHooks(t *testing.T) {
	m, lib := workstation(t)
	root, err := driverroot.New("/", fakeDriverRoot(t, m))
	if err != nil {
		t.Fatal(err)
	}
	generate := func(disabled ...string) []string {
		t.Helper()
		hooks, err := cdi.ParseDisabledHooks(disabled)
		if err != nil {
			t.Fatal(err)
		}
		gen, err := cdi.NewNVCDI(cdi.NVCDIOptions{Root: root, NVML: func() nvml.Interface { return lib }, DisabledHooks: hooks})
		if err != nil {
			t.Fatal(err)
		}
		spec, err := claimSpec(t, m, gen)
		if err != nil {
			t.Fatal(err)
		}
		return hookNames(allEdits(spec))
	}

	all := generate()
	var known []string
	for _, h := range cdi.Hooks {
		known = append(known, string(h.Name))
	}
	slices.Sort(known)
	if !slices.Equal(all, known) {
		t.Errorf("spec runs hooks %v, cdi.Hooks lists %v", all, known)
	}

	disabled := []string{string(cdi.ApplicationProfileHook), string(cdi.ApplyCUDAMemoryLimitsHook)}
	got := generate(disabled...)
	want := slices.DeleteFunc(slices.Clone(all), func(h string) bool { return slices.Contains(disabled, h) })
	if !slices.Equal(got, want) {
		t.Errorf("with %v disabled: hooks %v, want %v", disabled, got, want)
	}
	if got := generate("all"); len(got) != 0 {
		t.Errorf("with all hooks disabled: hooks %v", got)
	}
}

func TestParseDisabledHooks(t *testing.T) {
	hooks, err := cdi.ParseDisabledHooks([]string{" update-application-profile", "", "apply-cuda-memory-limits "})
	if err != nil || len(hooks) != 2 || hooks[0] != cdi.ApplicationProfileHook || hooks[1] != cdi.ApplyCUDAMemoryLimitsHook {
		t.Errorf("got %v, %v", hooks, err)
	}
	_, err = cdi.ParseDisabledHooks([]string{"update-application-profiles"})
	if err == nil || !strings.Contains(err.Error(), `"update-application-profiles"`) || !strings.Contains(err.Error(), "update-application-profile, apply-cuda-memory-limits, all") {
		t.Errorf("want an error naming the bad and the valid hooks, got %v", err)
	}
	if _, err := cdi.NewNVCDI(cdi.NVCDIOptions{Root: driverroot.Root{Path: "/", HostPath: "/"}, NVML: func() nvml.Interface { return nil }, DisabledHooks: []nvcdi.HookName{"chmod"}}); err == nil {
		t.Error("NewNVCDI accepts an unknown hook")
	}
	for disabled, want := range map[string]string{
		"":                         "1.20.1",
		"apply-cuda-memory-limits": "1.20.0",
		"apply-cuda-memory-limits,update-application-profile": "1.17.8",
		"all": "",
	} {
		hooks, err := cdi.ParseDisabledHooks(strings.Split(disabled, ","))
		if err != nil {
			t.Fatal(err)
		}
		if got, _ := cdi.RequiredToolkit(hooks); got != want {
			t.Errorf("disabled %q: toolkit %q, want %q", disabled, got, want)
		}
	}
}

// TestNVCDIHookMissing: where the agent can see the node's
// nvidia-cdi-hook (ContainerHookPath), a spec whose hooks run it is
// generated only while it is an executable file there, found with
// symbolic links resolved inside the node's root as mounted; otherwise
// generating fails with an error naming the path on the node, the
// toolkit release needed and the way out, and writes no spec. Every
// generation looks again, so a hook installed later is found. Without
// hooks (all disabled) or without ContainerHookPath nothing is checked.
func TestNVCDIHookMissing(t *testing.T) {
	const hookPath = "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
	testcases := map[string]struct {
		// setup lays out the node's root.
		setup     func(t *testing.T, nodeRoot string)
		disabled  []string
		noCheck   bool
		wantErr   []string
		wantHooks bool
	}{
		"executable": {setup: writeHook(0o755), wantHooks: true},
		"absolute link inside the node's root": {setup: func(t *testing.T, nodeRoot string) {
			writeFile(t, filepath.Join(nodeRoot, "opt/toolkit-1.20.2/nvidia-cdi-hook"), 0o755)
			if err := os.Symlink("/opt/toolkit-1.20.2/nvidia-cdi-hook", filepath.Join(nodeRoot, hookPath)); err != nil {
				t.Fatal(err)
			}
		}, wantHooks: true},
		"missing":        {wantErr: []string{hookPath, "no such file", "NVIDIA Container Toolkit 1.20.1", "apply-cuda-memory-limits", "NVIDIA_CDI_HOOK_PATH", "DISABLED_CDI_HOOKS"}},
		"not executable": {setup: writeHook(0o644), wantErr: []string{hookPath, "not executable"}},
		"a directory": {setup: func(t *testing.T, nodeRoot string) {
			if err := os.MkdirAll(filepath.Join(nodeRoot, hookPath), 0o755); err != nil {
				t.Fatal(err)
			}
		}, wantErr: []string{hookPath, "not a regular file"}},
		"link out of the node's root": {setup: func(t *testing.T, nodeRoot string) {
			outside := filepath.Join(t.TempDir(), "nvidia-cdi-hook")
			writeFile(t, outside, 0o755)
			if err := os.Symlink(outside, filepath.Join(nodeRoot, hookPath)); err != nil {
				t.Fatal(err)
			}
		}, wantErr: []string{hookPath, "no such file"}},
		"missing, new hooks disabled": {disabled: []string{"apply-cuda-memory-limits", "update-application-profile"}, wantErr: []string{"NVIDIA Container Toolkit 1.17.8", "disable-device-node-modification"}},
		"missing, all hooks disabled": {disabled: []string{"all"}},
		"missing, not checked":        {noCheck: true, wantHooks: true},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			m, lib := workstation(t)
			driverRoot, err := driverroot.New(driverroot.GPUOperatorHostPath, fakeDriverRoot(t, m))
			if err != nil {
				t.Fatal(err)
			}
			nodeRoot := t.TempDir()
			if err := os.MkdirAll(filepath.Join(nodeRoot, filepath.Dir(hookPath)), 0o755); err != nil {
				t.Fatal(err)
			}
			if tc.setup != nil {
				tc.setup(t, nodeRoot)
			}
			disabled, err := cdi.ParseDisabledHooks(tc.disabled)
			if err != nil {
				t.Fatal(err)
			}
			opts := cdi.NVCDIOptions{Root: driverRoot, NVML: func() nvml.Interface { return lib }, HookPath: hookPath, DisabledHooks: disabled}
			if !tc.noCheck {
				opts.ContainerHookPath = filepath.Join(nodeRoot, hookPath)
			}
			gen, err := cdi.NewNVCDI(opts)
			if err != nil {
				t.Fatal(err)
			}
			spec, err := claimSpec(t, m, gen)
			if tc.wantErr == nil {
				if err != nil {
					t.Fatal(err)
				}
				if err := gen.CheckHook(); err != nil {
					t.Errorf("CheckHook: %v", err)
				}
				if got := len(allEdits(spec).Hooks) > 0; got != tc.wantHooks {
					t.Errorf("spec has hooks: %v, want %v", got, tc.wantHooks)
				}
				return
			}
			t.Logf("error: %v", err)
			if !errors.Is(err, cdi.ErrHookMissing) {
				t.Fatalf("want an error wrapping %q, got %v", cdi.ErrHookMissing, err)
			}
			for _, want := range append(tc.wantErr, opts.ContainerHookPath) {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error does not name %q", want)
				}
			}
			if err := gen.CheckHook(); !errors.Is(err, cdi.ErrHookMissing) {
				t.Errorf("CheckHook: %v, want %v", err, cdi.ErrHookMissing)
			}

			// Installed after the fact: the same generator finds it.
			if err := os.RemoveAll(filepath.Join(nodeRoot, hookPath)); err != nil {
				t.Fatal(err)
			}
			writeHook(0o755)(t, nodeRoot)
			if _, err := claimSpec(t, m, gen); err != nil {
				t.Errorf("after installing the hook: %v", err)
			}
		})
	}
}

func writeFile(t *testing.T, path string, mode os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("#!/bin/sh\n"), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}

// writeHook installs a fake nvidia-cdi-hook at the GPU Operator's path
// below a node's root.
func writeHook(mode os.FileMode) func(t *testing.T, nodeRoot string) {
	return func(t *testing.T, nodeRoot string) {
		writeFile(t, filepath.Join(nodeRoot, "/usr/local/nvidia/toolkit/nvidia-cdi-hook"), mode)
	}
}

// TestNVCDILoadedRoot: with LoadedRoot the spec names the driver files
// below the node path of the root that it returns at generation (the
// root whose NVML library was loaded), and nothing is generated before
// there is one.
func TestNVCDILoadedRoot(t *testing.T) {
	m, lib := workstation(t)
	mountPoint := fakeDriverRoot(t, m)
	operator, err := driverroot.New(driverroot.GPUOperatorHostPath, mountPoint)
	if err != nil {
		t.Fatal(err)
	}
	host, err := driverroot.New("/", mountPoint)
	if err != nil {
		t.Fatal(err)
	}
	var loaded *driverroot.Root
	gen, err := cdi.NewNVCDI(cdi.NVCDIOptions{
		LoadedRoot: func() (driverroot.Root, bool) {
			if loaded == nil {
				return driverroot.Root{}, false
			}
			return *loaded, true
		},
		NVML: func() nvml.Interface { return lib },
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := gen.CommonEdits(); err == nil {
		t.Fatal("common edits generated before a driver root was chosen")
	}
	const lib1 = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + driverVersion
	for _, root := range []driverroot.Root{operator, host} {
		loaded = &root
		edits, err := gen.CommonEdits()
		if err != nil {
			t.Fatalf("root %s: %v", root.HostPath, err)
		}
		want := filepath.Join(root.HostPath, lib1)
		found := false
		for _, mnt := range edits.Mounts {
			if mnt.ContainerPath == lib1 {
				found = mnt.HostPath == want
			}
			if strings.HasPrefix(mnt.HostPath, mountPoint) {
				t.Errorf("root %s: mount %s names the agent's mount point", root.HostPath, mnt.HostPath)
			}
		}
		if !found {
			t.Errorf("root %s: no mount of %s from %s in %+v", root.HostPath, lib1, want, edits.Mounts)
		}
	}
}
