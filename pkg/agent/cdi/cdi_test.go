package cdi

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"k8s.io/apimachinery/pkg/types"
)

// TestSpecIsUsableByRuntimes reads written specs back through the CDI
// library's own cache, as a container runtime would, and resolves the ids
// that Prepare hands to the kubelet.
func TestSpecIsUsableByRuntimes(t *testing.T) {
	testcases := map[string]struct {
		uid     types.UID
		devices []Device
		wantEnv string
	}{
		"one GPU":  {uid: "uid-1", devices: []Device{{Name: "gpu-0", UUID: "GPU-a", Minor: 0}}, wantEnv: "NVIDIA_VISIBLE_DEVICES=GPU-a"},
		"two GPUs": {uid: "uid-2", devices: []Device{{Name: "gpu-3", UUID: "GPU-d", Minor: 3}, {Name: "gpu-1", UUID: "GPU-b", Minor: 1}}, wantEnv: "NVIDIA_VISIBLE_DEVICES=GPU-d,GPU-b"},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			w, err := New(dir)
			if err != nil {
				t.Fatal(err)
			}
			ids, err := w.WriteClaimSpec(tc.uid, tc.devices)
			if err != nil {
				t.Fatal(err)
			}
			// Writing again (idempotent Prepare) replaces the file.
			if _, err := w.WriteClaimSpec(tc.uid, tc.devices); err != nil {
				t.Fatal(err)
			}
			cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
			if err != nil {
				t.Fatal(err)
			}
			if errs := cache.GetErrors(); len(errs) > 0 {
				t.Fatalf("CDI cache rejects the spec: %v", errs)
			}
			for _, d := range tc.devices {
				id := ids[d.Name]
				if id != DeviceID(tc.uid, d.Name) {
					t.Errorf("%s: id %q, want %q", d.Name, id, DeviceID(tc.uid, d.Name))
				}
				dev := cache.GetDevice(id)
				if dev == nil {
					t.Fatalf("runtime cannot resolve %s", id)
				}
				spec := dev.GetSpec()
				if got := spec.ContainerEdits.Env; len(got) != 1 || got[0] != tc.wantEnv {
					t.Errorf("env %v, want %s", got, tc.wantEnv)
				}
			}
			if err := w.DeleteClaimSpec(tc.uid); err != nil {
				t.Fatal(err)
			}
			if err := w.DeleteClaimSpec(tc.uid); err != nil {
				t.Errorf("second delete: %v", err)
			}
			if _, err := os.Stat(w.SpecPath(tc.uid)); !os.IsNotExist(err) {
				t.Errorf("spec still there: %v", err)
			}
		})
	}
}

// TestWriteClaimSpecOnlyOnChange writes a claim's spec again, as Prepare
// does for a claim it prepared before: an unchanged spec leaves the file
// alone, a device node that appeared since gets in.
func TestWriteClaimSpecOnlyOnChange(t *testing.T) {
	devRoot := t.TempDir()
	if err := os.Mkdir(filepath.Join(devRoot, "dev"), 0o755); err != nil {
		t.Fatal(err)
	}
	mknod := func(name string) {
		t.Helper()
		// 0:0 is the character device that any process may create.
		if err := unix.Mknod(filepath.Join(devRoot, "dev", name), unix.S_IFCHR|0o666, 0); err != nil {
			t.Fatal(err)
		}
	}
	mknod("nvidiactl")
	mknod("nvidia0")
	w, err := New(t.TempDir(), WithGenerator(Static{DevRoot: devRoot}))
	if err != nil {
		t.Fatal(err)
	}
	devices := []Device{{Name: "gpu-0", UUID: "GPU-a", Minor: 0}}
	if _, err := w.WriteClaimSpec("uid", devices); err != nil {
		t.Fatal(err)
	}
	past := time.Now().Add(-time.Hour).Truncate(time.Second)
	if err := os.Chtimes(w.SpecPath("uid"), past, past); err != nil {
		t.Fatal(err)
	}
	written := func() (time.Time, []string) {
		t.Helper()
		info, err := os.Stat(w.SpecPath("uid"))
		if err != nil {
			t.Fatal(err)
		}
		spec, err := cdiapi.ReadSpec(w.SpecPath("uid"), 0)
		if err != nil {
			t.Fatal(err)
		}
		var nodes []string
		for _, n := range spec.ContainerEdits.DeviceNodes {
			nodes = append(nodes, n.Path)
		}
		return info.ModTime(), nodes
	}

	if _, err := w.WriteClaimSpec("uid", devices); err != nil {
		t.Fatal(err)
	}
	if mtime, _ := written(); !mtime.Equal(past) {
		t.Errorf("unchanged spec rewritten (modified %s)", mtime)
	}

	mknod("nvidia-uvm")
	if _, err := w.WriteClaimSpec("uid", devices); err != nil {
		t.Fatal(err)
	}
	mtime, nodes := written()
	if mtime.Equal(past) || !slices.Contains(nodes, "/dev/nvidia-uvm") {
		t.Errorf("spec modified %s with device nodes %v, want it rewritten with /dev/nvidia-uvm", mtime, nodes)
	}
}
