package driverroot

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestFindLibrary(t *testing.T) {
	testcases := map[string]struct {
		// files are created below the root, links map a path to its
		// target (absolute targets are relative to the root).
		files   []string
		links   map[string]string
		want    string
		wantErr error
	}{
		"absolute link stays in the root": {
			files: []string{"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.570.133.07"},
			links: map[string]string{"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.570.133.07"},
			want:  "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.570.133.07",
		},
		"relative link": {
			files: []string{"/usr/lib64/libnvidia-ml.so.550.54.15"},
			links: map[string]string{"/usr/lib64/libnvidia-ml.so.1": "libnvidia-ml.so.550.54.15"},
			want:  "/usr/lib64/libnvidia-ml.so.550.54.15",
		},
		"link through a linked directory (usrmerge)": {
			files: []string{"/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1"},
			links: map[string]string{"/lib": "/usr/lib"},
			want:  "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
		},
		"missing": {
			files:   []string{"/usr/lib/x86_64-linux-gnu/libcuda.so.1"},
			wantErr: ErrNotFound,
		},
		"dangling link": {
			links:   map[string]string{"/usr/lib64/libnvidia-ml.so.1": "/nowhere/libnvidia-ml.so.1"},
			wantErr: ErrNotFound,
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			for _, f := range tc.files {
				p := filepath.Join(dir, f)
				if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(p, nil, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			for link, target := range tc.links {
				p := filepath.Join(dir, link)
				if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.Symlink(target, p); err != nil {
					t.Fatal(err)
				}
			}
			r, err := New("/run/nvidia/driver", dir)
			if err != nil {
				t.Fatal(err)
			}
			got, err := r.NVMLLibraryPath()
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("want error %v, got %q, %v", tc.wantErr, got, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if want := filepath.Join(dir, tc.want); got != want {
				t.Errorf("got %s, want %s", got, want)
			}
			if host, want := r.ToHost(got), filepath.Join("/run/nvidia/driver", tc.want); host != want {
				t.Errorf("host path %s, want %s", host, want)
			}
		})
	}
}

func TestRootPaths(t *testing.T) {
	dir := t.TempDir()
	r, err := New("", dir)
	if err != nil {
		t.Fatal(err)
	}
	if r.HostPath != "/" {
		t.Errorf("default host path %q, want /", r.HostPath)
	}
	if p, hp := r.DevRoots(); p != "/" || hp != "/" {
		t.Errorf("root without /dev: dev paths %s %s, want / /", p, hp)
	}
	if err := os.Mkdir(filepath.Join(dir, "dev"), 0o755); err != nil {
		t.Fatal(err)
	}
	if p, hp := r.DevRoots(); p != "/" || hp != "/" {
		t.Errorf("root with an empty /dev: dev paths %s %s, want / /", p, hp)
	}
	if err := os.WriteFile(filepath.Join(dir, ControlDevice), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if p, hp := r.DevRoots(); p != dir || hp != "/" {
		t.Errorf("root with /dev/nvidiactl: dev paths %s %s, want %s /", p, hp, dir)
	}
	if got := r.ToHost("/etc/passwd"); got != "/etc/passwd" {
		t.Errorf("path outside the root rewritten to %s", got)
	}
	if _, err := New("relative", ""); err == nil {
		t.Error("relative driver root accepted")
	}
	same, _ := New("/run/nvidia/driver", "")
	if same.Path != "/run/nvidia/driver" {
		t.Errorf("empty container path: %s, want the host path", same.Path)
	}
}

// TestDevRoot checks where device nodes come from for a driver root
// without its own /dev/nvidiactl: the device root, mounted in the agent's
// container and named by its node path, and from the driver root as soon
// as that holds the control device.
func TestDevRoot(t *testing.T) {
	driver, devRoot := t.TempDir(), t.TempDir()
	plain, err := New(GPUOperatorHostPath, driver)
	if err != nil {
		t.Fatal(err)
	}
	r, err := plain.WithDevRoot("", devRoot)
	if err != nil {
		t.Fatal(err)
	}
	if p, hp := r.DevRoots(); p != devRoot || hp != "/" {
		t.Errorf("driver root without /dev: dev paths %s %s, want %s /", p, hp, devRoot)
	}
	if r.Path != plain.Path || r.HostPath != plain.HostPath {
		t.Errorf("WithDevRoot changed the driver root: %+v", r)
	}
	same, _ := plain.WithDevRoot("/srv/devices", "")
	if p, hp := same.DevRoots(); p != "/srv/devices" || hp != "/srv/devices" {
		t.Errorf("empty container path: dev paths %s %s, want the host path twice", p, hp)
	}
	if _, err := plain.WithDevRoot("/", "relative"); err == nil {
		t.Error("relative device root accepted")
	}
	if err := os.MkdirAll(filepath.Join(driver, "dev"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(driver, ControlDevice), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if p, hp := r.DevRoots(); p != driver || hp != GPUOperatorHostPath {
		t.Errorf("driver root with /dev/nvidiactl: dev paths %s %s, want %s %s", p, hp, driver, GPUOperatorHostPath)
	}
}
