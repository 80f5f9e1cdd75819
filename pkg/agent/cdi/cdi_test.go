package cdi

import (
	"os"
	"testing"

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
