package checkpoint

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"k8s.io/apimachinery/pkg/types"
)

func claim(name string, devices ...string) PreparedClaim {
	c := PreparedClaim{Namespace: "default", Name: name}
	for i, d := range devices {
		c.Devices = append(c.Devices, PreparedDevice{
			Requests: []string{"gpus"}, Pool: "node-1", Device: d, UUID: "GPU-" + d, Minor: i,
			CDIDeviceIDs: []string{"topodra.io/gpu=" + name + "-" + d},
		})
	}
	return c
}

func TestRoundTrip(t *testing.T) {
	testcases := map[string]*Checkpoint{
		"empty":      {Claims: map[types.UID]PreparedClaim{}},
		"one claim":  {Claims: map[types.UID]PreparedClaim{"uid-a": claim("a", "gpu-0", "gpu-1")}},
		"two claims": {Claims: map[types.UID]PreparedClaim{"uid-a": claim("a", "gpu-0"), "uid-b": claim("b", "gpu-3")}},
		"previous boot and faults": {
			BootID:       "boot-2",
			Claims:       map[types.UID]PreparedClaim{"uid-a": claim("a", "gpu-0")},
			PreviousBoot: map[types.UID]PreparedClaim{"uid-b": claim("b", "gpu-3")},
			Faults:       map[string]Fault{"GPU-gpu-5": {Device: "gpu-5", Reason: "xid-48", Message: "double-bit ECC error", Time: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}},
		},
		"gone": {
			Claims: map[types.UID]PreparedClaim{"uid-a": claim("a", "gpu-0")},
			Gone:   map[types.UID]time.Time{"uid-a": time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)},
		},
	}
	for name, cp := range testcases {
		t.Run(name, func(t *testing.T) {
			s, err := New(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Save(cp); err != nil {
				t.Fatal(err)
			}
			got, err := s.Load()
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(cp, got); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}

func TestLoadMissingIsEmpty(t *testing.T) {
	s, err := New(filepath.Join(t.TempDir(), "new", "dir"))
	if err != nil {
		t.Fatal(err)
	}
	cp, err := s.Load()
	if err != nil {
		t.Fatal(err)
	}
	if cp.Claims == nil || len(cp.Claims) != 0 {
		t.Errorf("want empty claims, got %v", cp.Claims)
	}
}

func TestLoadRejectsBadFiles(t *testing.T) {
	testcases := map[string]struct {
		mutate  func(data string) string
		wantErr error
	}{
		"unknown version": {
			mutate:  func(d string) string { return strings.Replace(d, versionV3, "checkpoint.gpu.topodra.io/v99", 1) },
			wantErr: ErrUnknownVersion,
		},
		"flipped content": {
			mutate:  func(d string) string { return strings.Replace(d, "gpu-0", "gpu-7", 1) },
			wantErr: ErrCorrupt,
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			s, err := New(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Save(&Checkpoint{Claims: map[types.UID]PreparedClaim{"uid-a": claim("a", "gpu-0")}}); err != nil {
				t.Fatal(err)
			}
			data, err := os.ReadFile(s.Path())
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(s.Path(), []byte(tc.mutate(string(data))), 0o600); err != nil {
				t.Fatal(err)
			}
			if _, err := s.Load(); !errors.Is(err, tc.wantErr) {
				t.Errorf("want %v, got %v", tc.wantErr, err)
			}
		})
	}
}

// TestCrashBetweenWriteAndRename kills the saving goroutine after the new
// content is written and synced to the temporary file but before the rename,
// like a process dying there. The old checkpoint must survive intact and a
// restarted store must clean up the temporary file.
func TestCrashBetweenWriteAndRename(t *testing.T) {
	dir := t.TempDir()
	s, err := New(dir)
	if err != nil {
		t.Fatal(err)
	}
	old := &Checkpoint{Claims: map[types.UID]PreparedClaim{"uid-a": claim("a", "gpu-0")}}
	if err := s.Save(old); err != nil {
		t.Fatal(err)
	}

	s.beforeRename = runtime.Goexit
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = s.Save(&Checkpoint{Claims: map[types.UID]PreparedClaim{"uid-a": claim("a", "gpu-0"), "uid-b": claim("b", "gpu-1")}})
		t.Error("Save returned although it should have crashed")
	}()
	<-done

	temps, err := filepath.Glob(filepath.Join(dir, tempPrefix+"*"))
	if err != nil {
		t.Fatal(err)
	}
	if len(temps) != 1 {
		t.Fatalf("want the crashed write's temporary file, got %v", temps)
	}

	restarted, err := New(dir)
	if err != nil {
		t.Fatal(err)
	}
	got, err := restarted.Load()
	if err != nil {
		t.Fatalf("load after crash: %v", err)
	}
	if diff := cmp.Diff(old, got); diff != "" {
		t.Errorf("checkpoint after crash (-want +got):\n%s", diff)
	}
	if temps, _ := filepath.Glob(filepath.Join(dir, tempPrefix+"*")); len(temps) != 0 {
		t.Errorf("stale temporary files not removed: %v", temps)
	}
}

// TestLoadV2WithoutNewFields reads a file as agents wrote it before
// previousBoot, faults and allocatedAt existed (v2).
func TestLoadV2WithoutNewFields(t *testing.T) {
	s, err := New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	data := `{"bootID":"boot-1","claims":{"uid-a":{"namespace":"default","name":"a","devices":[{"requests":["gpus"],"pool":"node-1","device":"gpu-0","uuid":"GPU-0","minor":0,"cdiDeviceIDs":["x"]}]}}}`
	out := fmt.Sprintf(`{"version":%q,"checksum":%d,"data":%s}`, versionV2, crc32.ChecksumIEEE([]byte(data)), data)
	if err := os.WriteFile(s.Path(), []byte(out), 0o600); err != nil {
		t.Fatal(err)
	}
	cp, err := s.Load()
	if err != nil {
		t.Fatal(err)
	}
	if len(cp.Claims) != 1 || cp.PreviousBoot != nil || cp.Faults != nil {
		t.Errorf("got %+v", cp)
	}
}

// TestVersionWritten: a checkpoint without Gone entries is written as v3,
// which agents that read only v3 can read (they refuse any other version
// and unknown fields); one with them as v4.
func TestVersionWritten(t *testing.T) {
	testcases := map[string]struct {
		cp   *Checkpoint
		want string
	}{
		"without gone claims": {
			cp: &Checkpoint{
				BootID: "boot-1",
				Claims: map[types.UID]PreparedClaim{"uid-a": claim("a", "gpu-0")},
				Faults: map[string]Fault{"GPU-gpu-5": {Device: "gpu-5", Reason: "xid-48", Time: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}},
			},
			want: versionV3,
		},
		"with a gone claim": {
			cp: &Checkpoint{
				Claims: map[types.UID]PreparedClaim{"uid-a": claim("a", "gpu-0")},
				Gone:   map[types.UID]time.Time{"uid-a": time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)},
			},
			want: Version,
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			s, err := New(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Save(tc.cp); err != nil {
				t.Fatal(err)
			}
			data, err := os.ReadFile(s.Path())
			if err != nil {
				t.Fatal(err)
			}
			var f file
			if err := json.Unmarshal(data, &f); err != nil {
				t.Fatal(err)
			}
			if f.Version != tc.want {
				t.Errorf("written as %s, want %s", f.Version, tc.want)
			}
			if tc.want == versionV3 && strings.Contains(string(f.Data), `"gone"`) {
				t.Errorf("v3 file has a gone field: %s", f.Data)
			}
		})
	}
}

// TestExists: a store without a file has none (and Load gives an empty
// checkpoint); after Save it has one.
func TestExists(t *testing.T) {
	s, err := New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := s.Exists(); err != nil || ok {
		t.Fatalf("new store: Exists() = %v, %v; want false", ok, err)
	}
	if err := s.Save(&Checkpoint{Claims: map[types.UID]PreparedClaim{}}); err != nil {
		t.Fatal(err)
	}
	if ok, err := s.Exists(); err != nil || !ok {
		t.Errorf("after Save: Exists() = %v, %v; want true", ok, err)
	}
}
