package agent_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent/cdi"
)

// mountsGenerator adds n bind mounts of driver libraries with long paths
// to the common edits of its Generator, as nvcdi lists a driver's
// libraries: a spec of some kilobytes.
type mountsGenerator struct {
	cdi.Generator
	n int
}

func (g mountsGenerator) CommonEdits() (cdispec.ContainerEdits, error) {
	edits, err := g.Generator.CommonEdits()
	if err != nil {
		return edits, err
	}
	for i := range g.n {
		path := fmt.Sprintf("/usr/lib/libnvidia-%03d.so", i)
		edits.Mounts = append(edits.Mounts, &cdispec.Mount{HostPath: path, ContainerPath: path, Options: []string{"ro", "nosuid", "nodev", "bind"}})
	}
	return edits, nil
}

// tempFiles lists the names in dir that end in .tmp.
func tempFiles(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".tmp") {
			names = append(names, e.Name())
		}
	}
	return names
}

// TestPrepareAfterCDIDirFull: the CDI directory, a tmpfs as /var/run/cdi
// is, fills up, so that a claim's spec can be written only part-way: each
// of the kubelet's Prepares of the claim fails, and leaves nothing behind
// that takes space, so that once there is space again the next Prepare
// succeeds. It needs to mount a tmpfs (CAP_SYS_ADMIN).
func TestPrepareAfterCDIDirFull(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	if err := unix.Mount("tmpfs", e.cdiDir, "tmpfs", 0, "size=16k,mode=0755"); err != nil {
		t.Skipf("cannot mount a tmpfs on the CDI directory (%v): needs CAP_SYS_ADMIN", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(e.cdiDir, 0); err != nil {
			t.Errorf("unmount %s: %v", e.cdiDir, err)
		}
	})
	e.generator = mountsGenerator{Generator: cdi.Static{DevRoot: e.devRoot}, n: 80}
	held := claim("held", gpus("gpus", "gpu-1")...)

	// The spec is larger than the space that the filler leaves (8 KiB)
	// and smaller than the tmpfs (16 KiB).
	spec, err := cdi.Spec(e.generator, held.UID, []cdi.Device{{Name: "gpu-1", UUID: "GPU-1", Minor: 1}})
	if err != nil {
		t.Fatal(err)
	}
	data, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	if len(data) <= 9<<10 || len(data) >= 12<<10 {
		t.Fatalf("spec of %d bytes, want about 10 KiB", len(data))
	}
	t.Logf("spec of %d bytes on a tmpfs of 16 KiB with 8 KiB taken", len(data))
	filler := filepath.Join(e.cdiDir, "filler")
	if err := os.WriteFile(filler, make([]byte, 8<<10), 0o600); err != nil {
		t.Fatal(err)
	}

	a := e.start(ctx, t)
	for i := range 3 {
		err := prepareOne(ctx, t, a, held)
		if !errors.Is(err, syscall.ENOSPC) {
			t.Fatalf("prepare %d on a full CDI directory: %v, want ENOSPC", i+1, err)
		}
		if left := tempFiles(t, e.cdiDir); len(left) > 0 {
			t.Errorf("prepare %d left %v behind", i+1, left)
		}
	}
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	if err := prepareOne(ctx, t, a, held); err != nil {
		t.Fatalf("prepare once there is space: %v", err)
	}
	if got := readSpec(t, e, held.UID); len(got.ContainerEdits.Mounts) != 80 || len(got.Devices) != 1 {
		t.Errorf("spec written with %d mounts and %d devices, want 80 and 1", len(got.ContainerEdits.Mounts), len(got.Devices))
	}
	if left := tempFiles(t, e.cdiDir); len(left) > 0 {
		t.Errorf("temporary files %v left", left)
	}
}

// TestStartRemovesOwnTempSpecFiles: an agent that starts removes the
// temporary spec files that an agent of this driver left behind in the
// CDI directory (it ended while it wrote a spec), and leaves those of
// other writers (the CDI library's and nvidia-ctk's spec.*.tmp), and
// the specs themselves, alone.
func TestStartRemovesOwnTempSpecFiles(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	held := claim("held", gpus("gpus", "gpu-1")...)
	a := e.start(ctx, t)
	if err := prepareOne(ctx, t, a, held); err != nil {
		t.Fatal(err)
	}
	a.Stop()
	ours := []string{
		".gpu.topodra.io-gpu_uid-held.json.2212345.tmp",
		".gpu.topodra.io-gpu_uid-gone.json.99.tmp",
	}
	others := []string{"spec.123.tmp", "spec.4567.tmp", "nvidia.com-gpu.json"}
	for _, name := range append(slices.Clone(ours), others...) {
		if err := os.WriteFile(filepath.Join(e.cdiDir, name), []byte(`{"cdiVersion":"0.6.0","kind":`), 0o600); err != nil {
			t.Fatal(err)
		}
	}

	a = e.start(ctx, t)
	for _, name := range ours {
		if _, err := os.Stat(filepath.Join(e.cdiDir, name)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the agent's temporary file %s after start: %v, want it removed", name, err)
		}
	}
	for _, name := range others {
		if _, err := os.Stat(filepath.Join(e.cdiDir, name)); err != nil {
			t.Errorf("%s of another writer after start: %v, want it kept", name, err)
		}
	}
	readSpec(t, e, held.UID)
	if err := prepareOne(ctx, t, a, held); err != nil {
		t.Errorf("prepare again after start: %v", err)
	}
}
