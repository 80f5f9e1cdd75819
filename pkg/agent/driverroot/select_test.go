package driverroot

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// touch creates empty files (and their directories) below dir.
func touch(t *testing.T, dir string, files ...string) {
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

const (
	hostLib     = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
	operatorLib = "/run/nvidia/driver/usr/lib64/libnvidia-ml.so.1"
)

// TestAutoDetect: on a node whose "/" the agent sees at a temporary
// directory, auto takes the GPU Operator's driver root where it holds
// the library and the host's otherwise, never an operator directory
// without it, and names every candidate where none holds it.
func TestAutoDetect(t *testing.T) {
	testcases := map[string]struct {
		files []string
		dirs  []string
		// library is --nvml-library; empty searches the standard
		// directories.
		library string
		// want is the chosen root's node path; "" means none.
		want string
		// wantLibrary is the library's path below the node's "/".
		wantLibrary string
		// wantPassed are the node paths of the candidates passed over.
		wantPassed []string
		wantErr    error
	}{
		"host driver, no operator directory": {
			files: []string{hostLib}, want: "/", wantLibrary: hostLib, wantPassed: []string{GPUOperatorHostPath},
		},
		"host driver, empty operator directory left behind": {
			files: []string{hostLib}, dirs: []string{"/run/nvidia/driver/usr/lib64"},
			want: "/", wantLibrary: hostLib, wantPassed: []string{GPUOperatorHostPath},
		},
		"operator driver only": {
			files: []string{operatorLib}, want: GPUOperatorHostPath, wantLibrary: operatorLib,
		},
		"both: the operator's comes first": {
			files: []string{hostLib, operatorLib}, want: GPUOperatorHostPath, wantLibrary: operatorLib,
		},
		"operator directory being populated, no host driver": {
			files: []string{"/run/nvidia/driver/usr/bin/nvidia-smi"}, wantErr: ErrNotFound,
		},
		"library outside the standard directories, relative override": {
			files: []string{"/opt/nvidia/lib/libnvidia-ml.so.1"}, library: "opt/nvidia/lib/libnvidia-ml.so.1",
			want: "/", wantLibrary: "/opt/nvidia/lib/libnvidia-ml.so.1", wantPassed: []string{GPUOperatorHostPath},
		},
		"library outside the standard directories, absolute override": {
			files: []string{hostLib, "/opt/nvidia/lib/libnvidia-ml.so.1"}, library: "/opt/nvidia/lib/libnvidia-ml.so.1",
			want: "/", wantLibrary: "/opt/nvidia/lib/libnvidia-ml.so.1",
		},
		"override inside the operator's root": {
			files: []string{hostLib, "/run/nvidia/driver/opt/lib/libnvidia-ml.so.1"}, library: "/run/nvidia/driver/opt/lib/libnvidia-ml.so.1",
			want: GPUOperatorHostPath, wantLibrary: "/run/nvidia/driver/opt/lib/libnvidia-ml.so.1",
		},
		"override missing, the standard directories not searched": {
			files: []string{hostLib, operatorLib}, library: "opt/nvidia/lib/libnvidia-ml.so.1", wantErr: ErrNotFound,
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			node := t.TempDir()
			touch(t, node, tc.files...)
			for _, d := range tc.dirs {
				if err := os.MkdirAll(filepath.Join(node, d), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			candidates, err := AutoCandidates(node)
			if err != nil {
				t.Fatal(err)
			}
			if candidates, err = WithNVMLLibrary(candidates, tc.library); err != nil {
				t.Fatal(err)
			}
			s, err := NewSelector(candidates...)
			if err != nil {
				t.Fatal(err)
			}
			c, err := s.Detect()
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("want error %v, got %v (choice %s)", tc.wantErr, err, c)
				}
				var notFound *NotFoundError
				if len(candidates) > 1 && (!errors.As(err, &notFound) || len(notFound.Misses) != len(candidates)) {
					t.Errorf("error %v does not name each of %d candidates", err, len(candidates))
				}
				if tc.library != "" && !strings.Contains(err.Error(), tc.library) {
					t.Errorf("error %q does not name the library %s", err, tc.library)
				}
				// The standard directories, searched in each root, are
				// named once (the error goes into an event's note).
				if n := strings.Count(err.Error(), LibrarySearchPaths[0]); tc.library == "" && n != 1 {
					t.Errorf("error %q names %s %d times, want once", err, LibrarySearchPaths[0], n)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.Root.HostPath != tc.want {
				t.Errorf("chose %s, want %s", c, tc.want)
			}
			if want := filepath.Join(node, tc.wantLibrary); c.Library != want {
				t.Errorf("library %s, want %s", c.Library, want)
			}
			// CDI specs name the library below the chosen root's
			// node path.
			if got := c.Root.ToHost(c.Library); got != tc.wantLibrary {
				t.Errorf("library on the node %s, want %s", got, tc.wantLibrary)
			}
			var passed []string
			for _, m := range c.Passed {
				passed = append(passed, m.Root.HostPath)
				if !errors.Is(m.Err, ErrNotFound) {
					t.Errorf("passed over %s for %v, want not found", m.Root.HostPath, m.Err)
				}
			}
			if strings.Join(passed, ",") != strings.Join(tc.wantPassed, ",") {
				t.Errorf("passed over %v, want %v", passed, tc.wantPassed)
			}
		})
	}
}

// TestSelectorLoad: the root whose library was loaded stays the answer
// until another candidate holds the library first, which Load and Check
// then report, so that a process that loaded the host's library while
// the operator's driver container was starting is replaced.
func TestSelectorLoad(t *testing.T) {
	node := t.TempDir()
	candidates, err := AutoCandidates(node)
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewSelector(candidates...)
	if err != nil {
		t.Fatal(err)
	}
	var notified []Choice
	s.Notify(func(c Choice) { notified = append(notified, c) })
	if err := os.MkdirAll(filepath.Join(node, GPUOperatorHostPath), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Load(); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Load without any library: %v, want not found", err)
	}
	if _, ok := s.Loaded(); ok {
		t.Fatal("a root is loaded after a failed Load")
	}
	if err := s.Check(); err != nil {
		t.Fatalf("Check before any Load: %v", err)
	}

	touch(t, node, hostLib)
	c, err := s.Load()
	if err != nil || c.Root.HostPath != "/" {
		t.Fatalf("Load with the host's library: %s, %v", c, err)
	}
	if _, err := s.Load(); err != nil {
		t.Fatalf("Load again: %v", err)
	}
	if len(notified) != 1 || notified[0].Root.HostPath != "/" {
		t.Errorf("notified %v, want the host's root once", notified)
	}
	if err := s.Check(); err != nil {
		t.Fatalf("Check, nothing changed: %v", err)
	}

	touch(t, node, operatorLib)
	var changed *ChangedError
	if err := s.Check(); !errors.As(err, &changed) || changed.From.HostPath != "/" || changed.To.Root.HostPath != GPUOperatorHostPath {
		t.Fatalf("Check once the operator's root holds the library: %v, want a change from / to %s", err, GPUOperatorHostPath)
	}
	if _, err := s.Load(); !errors.As(err, &changed) {
		t.Fatalf("Load once the operator's root holds the library: %v, want a change", err)
	}
	if r, _ := s.Loaded(); r.HostPath != "/" {
		t.Errorf("loaded root %s after a refused change, want /", r.HostPath)
	}

	// Nothing anywhere: nothing better to load than what was loaded.
	for _, f := range []string{hostLib, operatorLib} {
		if err := os.Remove(filepath.Join(node, f)); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Check(); err != nil {
		t.Errorf("Check with no library anywhere: %v", err)
	}
}

func TestWithNVMLLibrary(t *testing.T) {
	operator, err := New(GPUOperatorHostPath, "/driver-root")
	if err != nil {
		t.Fatal(err)
	}
	host, err := New("/", "/host")
	if err != nil {
		t.Fatal(err)
	}
	testcases := map[string]struct {
		root    Root
		path    string
		want    string
		wantErr error
	}{
		"relative":                      {root: operator, path: "usr/lib64/libnvidia-ml.so.1", want: "/usr/lib64/libnvidia-ml.so.1"},
		"absolute below the root":       {root: operator, path: "/run/nvidia/driver/opt/libnvidia-ml.so.1", want: "/opt/libnvidia-ml.so.1"},
		"absolute, host root":           {root: host, path: "/opt/nvidia/libnvidia-ml.so.1", want: "/opt/nvidia/libnvidia-ml.so.1"},
		"absolute outside the root":     {root: operator, path: "/opt/nvidia/libnvidia-ml.so.1", wantErr: ErrOutsideRoot},
		"absolute beside the root":      {root: operator, path: "/run/nvidia/driver2/libnvidia-ml.so.1", wantErr: ErrOutsideRoot},
		"relative, leaving the root":    {root: operator, path: "../../libnvidia-ml.so.1", wantErr: errAny},
		"the root itself":               {root: operator, path: "/run/nvidia/driver", wantErr: ErrOutsideRoot},
		"empty: the standard search":    {root: operator, path: "", want: ""},
		"relative, cleaned in the root": {root: host, path: "opt/../usr/lib/libnvidia-ml.so.1", want: "/usr/lib/libnvidia-ml.so.1"},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			r, err := tc.root.WithNVMLLibrary(tc.path)
			switch {
			case tc.wantErr == errAny && err != nil:
				return
			case tc.wantErr != nil:
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("want error %v, got %v (%q)", tc.wantErr, err, r.NVMLLibrary)
				}
				return
			case err != nil:
				t.Fatal(err)
			}
			if r.NVMLLibrary != tc.want {
				t.Errorf("NVMLLibrary %q, want %q", r.NVMLLibrary, tc.want)
			}
			if r.Path != tc.root.Path || r.HostPath != tc.root.HostPath {
				t.Errorf("WithNVMLLibrary changed the root: %+v", r)
			}
		})
	}

	// Auto with an absolute path leaves out the candidates it is not
	// below, and refuses one below none.
	candidates, err := AutoCandidates("/host")
	if err != nil {
		t.Fatal(err)
	}
	roots, err := WithNVMLLibrary(candidates, "/opt/nvidia/libnvidia-ml.so.1")
	if err != nil || len(roots) != 1 || roots[0].HostPath != "/" {
		t.Errorf("auto with a library outside the operator's root: %+v, %v; want the host's root alone", roots, err)
	}
	if _, err := WithNVMLLibrary([]Root{operator}, "/opt/nvidia/libnvidia-ml.so.1"); !errors.Is(err, ErrOutsideRoot) {
		t.Errorf("a library below no candidate: %v, want %v", err, ErrOutsideRoot)
	}
}

// errAny stands for any error in test tables.
var errAny = errors.New("any error")
