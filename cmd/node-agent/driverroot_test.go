package main

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/driverroot"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
)

// touchAll creates empty files (and their directories) below dir.
func touchAll(t *testing.T, dir string, files ...string) {
	t.Helper()
	for _, f := range files {
		p := filepath.Join(dir, f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestDriverRootFlags: --driver-root takes a path or auto, with
// --container-driver-root the node's "/" for auto, and --nvml-library a
// path in the root; each has its environment twin, and a wrong value is
// refused at start with the flag's name.
func TestDriverRootFlags(t *testing.T) {
	t.Run("environment twins", func(t *testing.T) {
		t.Setenv("DRIVER_ROOT", "auto")
		t.Setenv("CONTAINER_DRIVER_ROOT", "/driver-root")
		t.Setenv("NVML_LIBRARY", "opt/nvidia/lib64/libnvidia-ml.so.1")
		cmd, o := newCommandWithOptions()
		if err := cmd.ParseFlags(nil); err != nil {
			t.Fatal(err)
		}
		if err := applyEnv(cmd.Flags(), agentFlags); err != nil {
			t.Fatal(err)
		}
		if o.driverRoot != driverroot.Auto || o.containerDriverRoot != "/driver-root" || o.nvmlLibrary != "opt/nvidia/lib64/libnvidia-ml.so.1" {
			t.Errorf("driver root %q, container driver root %q, NVML library %q from the environment", o.driverRoot, o.containerDriverRoot, o.nvmlLibrary)
		}
		help := cmd.Flags().Lookup("driver-root").Usage
		for _, want := range []string{"'auto'", driverroot.GPUOperatorHostPath, reasonDriverRoot, "[$DRIVER_ROOT]"} {
			if !strings.Contains(help, want) {
				t.Errorf("--driver-root help does not mention %s: %s", want, help)
			}
		}
		if help := cmd.Flags().Lookup("nvml-library").Usage; !strings.Contains(help, "[$NVML_LIBRARY]") {
			t.Errorf("--nvml-library help has no environment twin: %s", help)
		}
	})

	node := t.TempDir()
	testcases := map[string]struct {
		opts    options
		wantErr string
	}{
		"relative driver root": {
			opts:    options{driverRoot: "run/nvidia/driver"},
			wantErr: `--driver-root (or DRIVER_ROOT; an absolute path or "auto"): driver root must be absolute`,
		},
		"auto, relative node root": {
			opts:    options{driverRoot: "auto", containerDriverRoot: "driver-root"},
			wantErr: "--container-driver-root (or CONTAINER_DRIVER_ROOT) with --driver-root=auto: the node's root must be absolute",
		},
		"auto, node root not there": {
			opts:    options{driverRoot: "auto", containerDriverRoot: "/nonexistent/driver-root"},
			wantErr: `--driver-root "auto" (or DRIVER_ROOT; seen here as /nonexistent/driver-root, --container-driver-root): not a directory`,
		},
		"library outside the driver root": {
			opts:    options{driverRoot: driverroot.GPUOperatorHostPath, containerDriverRoot: node, nvmlLibrary: "/opt/nvidia/libnvidia-ml.so.1"},
			wantErr: "--nvml-library (or NVML_LIBRARY): NVML library /opt/nvidia/libnvidia-ml.so.1 is not below the driver root /run/nvidia/driver",
		},
		"library leaving the driver root": {
			opts:    options{driverRoot: "auto", containerDriverRoot: node, nvmlLibrary: "../libnvidia-ml.so.1"},
			wantErr: "--nvml-library (or NVML_LIBRARY): NVML library ../libnvidia-ml.so.1 leaves the driver root",
		},
		"auto, relative device root": {
			opts:    options{driverRoot: "auto", containerDriverRoot: node, containerDevRoot: "host"},
			wantErr: "--container-dev-root (or CONTAINER_DEV_ROOT)",
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			o := tc.opts
			o.nvml, o.dryRun, o.nodeName = "real", true, "node-1"
			var stdout, stderr bytes.Buffer
			err := run(ctx, &o, &stdout, &stderr)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("want error containing %q, got %v (stderr %q)", tc.wantErr, err, stderr.String())
			}
		})
	}
}

// TestAutoDriverRootNoGPU: where neither root holds the library (the
// operator's directory is there but empty), the dry run reports no GPU
// naming both roots, or the --nvml-library path that is missing.
func TestAutoDriverRootNoGPU(t *testing.T) {
	for name, tc := range map[string]struct {
		library string
		want    []string
	}{
		"standard directories": {want: []string{noGPUMessage, "no driver root holds the NVML library", "/run/nvidia/driver (at ", "/ (at "}},
		"library override":     {library: "opt/nvidia/lib64/libnvidia-ml.so.1", want: []string{noGPUMessage, "--nvml-library (or NVML_LIBRARY) opt/nvidia/lib64/libnvidia-ml.so.1", "/opt/nvidia/lib64/libnvidia-ml.so.1 not found"}},
	} {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			node := t.TempDir()
			if err := os.MkdirAll(filepath.Join(node, driverroot.GPUOperatorHostPath), 0o755); err != nil {
				t.Fatal(err)
			}
			o := options{nvml: "real", driverRoot: "auto", containerDriverRoot: node, nvmlLibrary: tc.library, dryRun: true, nodeName: "node-1"}
			var stdout, stderr bytes.Buffer
			if err := run(ctx, &o, &stdout, &stderr); err != nil {
				t.Fatal(err)
			}
			for _, want := range tc.want {
				if !strings.Contains(stderr.String(), want) {
					t.Errorf("stderr %q lacks %q", stderr.String(), want)
				}
			}
		})
	}
}

// TestAutoDriverRootSource: with --driver-root=auto the agent loads NVML
// from the first root that holds the library, its CDI generator uses that
// root, and once the GPU Operator's root holds the library after the
// host's was loaded, discovery fails with discovery.ErrDriverChanged
// (the agent exits and its restart loads the operator's). The libraries
// are empty files, which NVML fails to load: the root is chosen all the
// same, as a process that loaded a library cannot load another.
func TestAutoDriverRootSource(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	node := t.TempDir()
	touchAll(t, node, "usr/lib64/libnvidia-ml.so.1")
	if err := os.MkdirAll(filepath.Join(node, driverroot.GPUOperatorHostPath), 0o755); err != nil {
		t.Fatal(err)
	}
	o := options{nvml: "real", driverRoot: "auto", containerDriverRoot: node, containerDevRoot: "/"}
	src, err := newSource(&o, "node-1")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = src.close() }()
	if got := src.rootInUse(); got != "" {
		t.Fatalf("root in use %q before discovery", got)
	}
	if _, err := src.discovery.Discover(ctx); !errors.Is(err, discovery.ErrNoGPU) {
		t.Fatalf("discovery with an empty library file: %v, want no GPU", err)
	}
	if got := src.rootInUse(); got != "/" {
		t.Fatalf("root in use %q, want / (the operator's directory is empty)", got)
	}
	if _, err := src.cdi.CommonEdits(); err == nil || !strings.Contains(err.Error(), "NVML is not loaded") {
		t.Errorf("CDI edits without NVML: %v", err)
	}

	touchAll(t, node, filepath.Join(driverroot.GPUOperatorHostPath, "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"))
	_, err = src.discovery.Discover(ctx)
	var changed *driverroot.ChangedError
	if !errors.Is(err, discovery.ErrDriverChanged) || !errors.As(err, &changed) || changed.To.Root.HostPath != driverroot.GPUOperatorHostPath {
		t.Fatalf("discovery once the operator's root holds the library: %v, want a driver change to %s", err, driverroot.GPUOperatorHostPath)
	}
	if strings.Contains(err.Error(), discovery.ErrDriverChanged.Error()) {
		t.Errorf("error %q says that NVML lost the kernel driver", err)
	}
	if got := src.rootInUse(); got != "/" {
		t.Errorf("root in use %q after the change was refused, want /", got)
	}
}

// TestRootCheckingDiscovery: while NVML works from the host's root, a
// rescan that finds the GPU Operator's root holding the library fails
// with discovery.ErrDriverChanged, naming both roots; before that it
// discovers the GPUs.
func TestRootCheckingDiscovery(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	node := t.TempDir()
	touchAll(t, node, "usr/lib64/libnvidia-ml.so.1")
	candidates, err := driverroot.AutoCandidates(node)
	if err != nil {
		t.Fatal(err)
	}
	roots, err := driverroot.NewSelector(candidates...)
	if err != nil {
		t.Fatal(err)
	}
	m, err := mockgpu.New(mockgpu.ProfileWorkstation2GPU, mockgpu.Options{NodeName: "node-1"})
	if err != nil {
		t.Fatal(err)
	}
	// The mock machine stands in for the library of the root loaded.
	open := func() (nvml.Interface, error) {
		if _, err := roots.Load(); err != nil {
			return nil, err
		}
		return m.NVML(), nil
	}
	lazy := discovery.NewLazy(open, discovery.NVMLOptions{Sysfs: m.Sysfs()})
	defer func() { _ = lazy.Close() }()
	d := rootCheckingDiscovery{Lazy: lazy, roots: roots}
	inv, err := d.Discover(ctx)
	if err != nil || len(inv.GPUs) != 2 {
		t.Fatalf("discovery from the host's root: %v, %v", inv, err)
	}
	if _, err := d.Discover(ctx); err != nil {
		t.Fatalf("rescan, nothing changed: %v", err)
	}
	touchAll(t, node, filepath.Join(driverroot.GPUOperatorHostPath, "usr/lib64/libnvidia-ml.so.1"))
	_, err = d.Discover(ctx)
	if !errors.Is(err, discovery.ErrDriverChanged) || !strings.Contains(err.Error(), "driver root /run/nvidia/driver") {
		t.Fatalf("rescan once the operator's root holds the library: %v, want a driver change naming it", err)
	}
	if _, ok := any(d).(discovery.HealthWatcher); !ok {
		t.Error("the discovery does not watch health")
	}
}
