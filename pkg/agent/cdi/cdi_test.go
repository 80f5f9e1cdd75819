package cdi

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

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

// nodeGenerator lists /dev/nvidiactl and each GPU's /dev/nvidia<minor>,
// whether or not they exist.
type nodeGenerator struct{}

func (nodeGenerator) CommonEdits() (cdispec.ContainerEdits, error) {
	return cdispec.ContainerEdits{DeviceNodes: []*cdispec.DeviceNode{{Path: "/dev/nvidiactl"}}}, nil
}

func (nodeGenerator) DeviceEdits(d Device) (cdispec.ContainerEdits, error) {
	return cdispec.ContainerEdits{DeviceNodes: []*cdispec.DeviceNode{{Path: fmt.Sprintf("/dev/nvidia%d", d.Minor)}}}, nil
}

// TestClaimSpecsReadsWrittenSpecs: what WriteClaimSpec wrote,
// ListClaimSpecs lists and ReadClaimSpec reads back per claim (UID,
// device names, GPU UUIDs, minor numbers where
// the spec lists device nodes), leaving other files alone.
func TestClaimSpecsReadsWrittenSpecs(t *testing.T) {
	testcases := map[string]struct {
		generator Generator
		want      map[types.UID][]Device
	}{
		"device nodes": {
			generator: nodeGenerator{},
			want: map[types.UID][]Device{
				"3f2b6c1e-0d4a-4c1b-9a51-7e2f0c9d8a10": {{Name: "gpu-1", UUID: "GPU-b", Minor: 1}, {Name: "gpu-10", UUID: "GPU-k", Minor: 10}},
				"uid-2":                                {{Name: "gpu-0", UUID: "GPU-a", Minor: 0}},
			},
		},
		"no device nodes": {
			generator: Static{EnvOnly: true},
			want:      map[types.UID][]Device{"uid-1": {{Name: "gpu-3", UUID: "GPU-d", Minor: -1}}},
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			w, err := New(dir, WithGenerator(tc.generator))
			if err != nil {
				t.Fatal(err)
			}
			for uid, devices := range tc.want {
				if _, err := w.WriteClaimSpec(uid, devices); err != nil {
					t.Fatal(err)
				}
			}
			if err := os.WriteFile(filepath.Join(dir, "nvidia.com-gpu.json"), []byte("{not json"), 0o644); err != nil {
				t.Fatal(err)
			}
			specs := readAll(t, w)
			got := map[types.UID][]Device{}
			for _, s := range specs {
				if s.Path != w.SpecPath(s.UID) || s.ModTime.IsZero() {
					t.Errorf("spec of %s: path %s, modified %v; want %s and a time", s.UID, s.Path, s.ModTime, w.SpecPath(s.UID))
				}
				got[s.UID] = s.Devices
			}
			for _, devices := range tc.want {
				slices.SortFunc(devices, func(a, b Device) int { return strings.Compare(a.Name, b.Name) })
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("claim specs (-want +got):\n%s", diff)
			}
		})
	}
}

// readAll lists the claim specs in w's directory and reads each.
func readAll(t *testing.T, w *Writer) []ClaimSpec {
	t.Helper()
	files, err := w.ListClaimSpecs()
	if err != nil {
		t.Fatal(err)
	}
	var out []ClaimSpec
	for _, f := range files {
		spec, err := ReadClaimSpec(f)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, spec)
	}
	return out
}

// TestNamesAreStable pins the names that outlive an agent version: the
// kubelet keeps the CDI device ids that Prepare returned for a prepared
// claim (in its checkpoint, across its restarts) and hands them to the
// runtime for every container it starts, while a newer agent regenerates
// the claim's spec under the names it computes itself and finds the specs
// of an older one by file name (ListClaimSpecs, when its checkpoint is
// missing). Changing the spec file name, the CDI kind or the device name
// within the spec makes the kubelet's cached ids unresolvable (containers
// of running pods fail to start after a restart) or leaves an older
// agent's specs behind unrecognized. These values must not change.
func TestNamesAreStable(t *testing.T) {
	const (
		uid      = types.UID("f4b3c2a1-0d9e-4f8a-b7c6-d5e4f3a2b1c0")
		specFile = "gpu.topodra.io-gpu_f4b3c2a1-0d9e-4f8a-b7c6-d5e4f3a2b1c0.json"
		id       = "gpu.topodra.io/gpu=f4b3c2a1-0d9e-4f8a-b7c6-d5e4f3a2b1c0-gpu-3"
		// spec is a claim spec as an agent writes it.
		spec = `{"cdiVersion":"0.3.0","kind":"gpu.topodra.io/gpu","devices":[{"name":"f4b3c2a1-0d9e-4f8a-b7c6-d5e4f3a2b1c0-gpu-3","containerEdits":{"env":["TOPODRA_GPU_3=GPU-d"]}}],"containerEdits":{"env":["NVIDIA_VISIBLE_DEVICES=GPU-d"]}}`
	)
	if got := DeviceID(uid, "gpu-3"); got != id {
		t.Errorf("DeviceID = %q, want %q", got, id)
	}
	dir := t.TempDir()
	w, err := New(dir)
	if err != nil {
		t.Fatal(err)
	}
	if got := w.SpecPath(uid); got != filepath.Join(dir, specFile) {
		t.Errorf("SpecPath = %q, want %q in %s", filepath.Base(got), specFile, dir)
	}

	// What the agent writes is found under the pinned names.
	ids, err := w.WriteClaimSpec(uid, []Device{{Name: "gpu-3", UUID: "GPU-d", Minor: 3}})
	if err != nil {
		t.Fatal(err)
	}
	if ids["gpu-3"] != id {
		t.Errorf("WriteClaimSpec returns id %q, want %q", ids["gpu-3"], id)
	}
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	if dev := cache.GetDevice(id); dev == nil || filepath.Base(dev.GetSpec().GetPath()) != specFile {
		t.Errorf("the runtime does not resolve %s from %s: %v", id, specFile, cache.GetErrors())
	}

	// A spec under the pinned name, as an agent wrote it, is recognized.
	if err := os.WriteFile(filepath.Join(dir, specFile), []byte(spec), 0o644); err != nil {
		t.Fatal(err)
	}
	specs := readAll(t, w)
	want := []Device{{Name: "gpu-3", UUID: "GPU-d", Minor: -1}}
	if len(specs) != 1 || specs[0].UID != uid || !slices.Equal(specs[0].Devices, want) {
		t.Errorf("claim specs = %+v, want claim %s with %+v", specs, uid, want)
	}
}
