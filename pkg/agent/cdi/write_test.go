package cdi

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"k8s.io/apimachinery/pkg/types"
)

// envGenerator sets env as the common edits of every spec.
type envGenerator []string

func (g envGenerator) CommonEdits() (cdispec.ContainerEdits, error) {
	return cdispec.ContainerEdits{Env: g}, nil
}

func (envGenerator) DeviceEdits(Device) (cdispec.ContainerEdits, error) {
	return cdispec.ContainerEdits{}, nil
}

// dirNames lists the names in dir.
func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

// TestWriteClaimSpecFailure: a spec write that fails (the disk fills up
// part-way through it, the spec does not validate, the rename fails)
// leaves no temporary file and the claim's spec as it was; once the
// cause is gone the next write succeeds. The spec file's mode is 0600.
func TestWriteClaimSpecFailure(t *testing.T) {
	const uid = types.UID("uid-1")
	before := []Device{{Name: "gpu-0", UUID: "GPU-a", Minor: 0}}
	after := []Device{{Name: "gpu-0", UUID: "GPU-a", Minor: 0}, {Name: "gpu-1", UUID: "GPU-b", Minor: 1}}
	diskFull := func(f *os.File, data []byte) error {
		if _, err := f.Write(data[:len(data)/2]); err != nil {
			return err
		}
		return &os.PathError{Op: "write", Path: f.Name(), Err: syscall.ENOSPC}
	}
	testcases := map[string]struct {
		// existing is the spec written before, if any.
		existing []Device
		// breakWrite makes the write fail and returns what undoes that.
		breakWrite func(t *testing.T, w *Writer) (undo func())
		// wantErr is what the error wraps, wantIn what it says.
		wantErr error
		wantIn  string
	}{
		"disk full, new spec": {
			breakWrite: func(t *testing.T, w *Writer) func() {
				w.write = diskFull
				return func() { w.write = writeAll }
			},
			wantErr: syscall.ENOSPC,
		},
		"disk full, replacing a spec": {
			existing: before,
			breakWrite: func(t *testing.T, w *Writer) func() {
				w.write = diskFull
				return func() { w.write = writeAll }
			},
			wantErr: syscall.ENOSPC,
		},
		"invalid spec": {
			existing: before,
			breakWrite: func(t *testing.T, w *Writer) func() {
				w.generator = envGenerator{"NO_VALUE"}
				return func() { w.generator = Static{EnvOnly: true} }
			},
			wantIn: "NO_VALUE",
		},
		"rename fails": {
			breakWrite: func(t *testing.T, w *Writer) func() {
				// A directory that is not empty cannot be replaced by a file.
				if err := os.MkdirAll(filepath.Join(w.SpecPath(uid), "x"), 0o755); err != nil {
					t.Fatal(err)
				}
				return func() {
					if err := os.RemoveAll(w.SpecPath(uid)); err != nil {
						t.Fatal(err)
					}
				}
			},
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			w, err := New(dir, WithGenerator(Static{EnvOnly: true}))
			if err != nil {
				t.Fatal(err)
			}
			var old []byte
			if tc.existing != nil {
				if _, err := w.WriteClaimSpec(uid, tc.existing); err != nil {
					t.Fatal(err)
				}
				if old, err = os.ReadFile(w.SpecPath(uid)); err != nil {
					t.Fatal(err)
				}
			}
			undo := tc.breakWrite(t, w)
			for range 3 {
				_, err := w.WriteClaimSpec(uid, after)
				if err == nil || (tc.wantErr != nil && !errors.Is(err, tc.wantErr)) || !strings.Contains(err.Error(), tc.wantIn) {
					t.Fatalf("write: %v, want an error (%v %q)", err, tc.wantErr, tc.wantIn)
				}
			}
			if tc.existing != nil {
				if got, err := os.ReadFile(w.SpecPath(uid)); err != nil || string(got) != string(old) {
					t.Errorf("spec after the failed writes: %q (%v), want it as it was: %q", got, err, old)
				}
			}
			var want []string
			if _, err := os.Lstat(w.SpecPath(uid)); err == nil {
				want = []string{filepath.Base(w.SpecPath(uid))}
			}
			if names := dirNames(t, dir); !slices.Equal(names, want) {
				t.Errorf("directory after the failed writes holds %v, want %v (no temporary file)", names, want)
			}

			undo()
			if _, err := w.WriteClaimSpec(uid, after); err != nil {
				t.Fatalf("write once the cause is gone: %v", err)
			}
			spec, err := ReadClaimSpec(SpecFile{UID: uid, Path: w.SpecPath(uid)})
			if err != nil {
				t.Fatal(err)
			}
			if want := []Device{{Name: "gpu-0", UUID: "GPU-a", Minor: -1}, {Name: "gpu-1", UUID: "GPU-b", Minor: -1}}; !slices.Equal(spec.Devices, want) {
				t.Errorf("spec written names %+v, want %+v", spec.Devices, want)
			}
			if names := dirNames(t, dir); !slices.Equal(names, []string{filepath.Base(w.SpecPath(uid))}) {
				t.Errorf("directory holds %v, want the spec alone", names)
			}
			info, err := os.Stat(w.SpecPath(uid))
			if err != nil {
				t.Fatal(err)
			}
			if info.Mode().Perm() != 0o600 {
				t.Errorf("spec file mode %v, want 0600", info.Mode().Perm())
			}
		})
	}
}

// TestRemoveTempFiles: the temporary files that the writer writes a spec
// to before it renames them are named so that RemoveTempFiles finds them
// (also those of an agent of another version: the names are pinned), and
// it removes nothing else: not the temporary files of other writers of
// the directory (the CDI library's and nvidia-ctk's spec.*.tmp), nor
// specs.
func TestRemoveTempFiles(t *testing.T) {
	dir := t.TempDir()
	w, err := New(dir, WithGenerator(Static{EnvOnly: true}))
	if err != nil {
		t.Fatal(err)
	}
	const uid = types.UID("0b6f3c1e-2d4a-4c1b-9a51-7e2f0c9d8a10")
	var tempName string
	w.write = func(f *os.File, data []byte) error {
		tempName = filepath.Base(f.Name())
		return writeAll(f, data)
	}
	if _, err := w.WriteClaimSpec(uid, []Device{{Name: "gpu-0", UUID: "GPU-a"}}); err != nil {
		t.Fatal(err)
	}
	const pinnedPrefix = ".gpu.topodra.io-gpu_" + string(uid) + ".json."
	if !strings.HasPrefix(tempName, pinnedPrefix) || !strings.HasSuffix(tempName, ".tmp") {
		t.Errorf("temporary file %q, want %s*.tmp", tempName, pinnedPrefix)
	}

	ours := []string{
		tempName,
		".gpu.topodra.io-gpu_uid-2.json.123456.tmp",
	}
	others := []string{
		"spec.123.tmp",
		"spec.2212345.tmp",
		".gpu.topodra.io-gpu_uid-3.json.bak",
		"nvidia.com-gpu.json",
		".topodra-probe-123",
	}
	for _, name := range append(slices.Clone(ours), others...) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("{partial"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// A directory is not a file the writer left.
	if err := os.Mkdir(filepath.Join(dir, ".gpu.topodra.io-gpu_uid-4.json.1.tmp"), 0o755); err != nil {
		t.Fatal(err)
	}
	others = append(others, ".gpu.topodra.io-gpu_uid-4.json.1.tmp", filepath.Base(w.SpecPath(uid)))

	removed, err := w.RemoveTempFiles()
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, name := range ours {
		want = append(want, filepath.Join(dir, name))
	}
	slices.Sort(want)
	slices.Sort(removed)
	if !slices.Equal(removed, want) {
		t.Errorf("removed %v, want %v", removed, want)
	}
	got := dirNames(t, dir)
	slices.Sort(others)
	if !slices.Equal(got, others) {
		t.Errorf("directory holds %v, want %v", got, others)
	}

	missing, err := New(filepath.Join(dir, "missing"))
	if err != nil {
		t.Fatal(err)
	}
	if removed, err := missing.RemoveTempFiles(); err != nil || len(removed) != 0 {
		t.Errorf("in a missing directory: removed %v, %v; want nothing", removed, err)
	}
}
