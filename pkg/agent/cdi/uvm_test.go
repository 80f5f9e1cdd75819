package cdi_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"golang.org/x/sys/unix"

	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/driverroot"
)

// procDevices writes a file in the format of /proc/devices, with the
// nvidia-uvm module's character device (major 510) where loaded.
func procDevices(t *testing.T, loaded bool) string {
	t.Helper()
	text := "Character devices:\n  1 mem\n  4 tty\n195 nvidia\n"
	if loaded {
		text += "510 nvidia-uvm\n"
	}
	text += "511 nvidia-nvlink\n\nBlock devices:\n  7 loop\n510 nvidia-uvm-looks-alike\n"
	p := filepath.Join(t.TempDir(), "devices")
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestNVCDIUVMPolicy: on a driver root whose /dev has the GPUs and
// nvidiactl but not the nvidia-uvm device nodes, "create" creates them
// where the module is loaded (as nvidia-modprobe would), and the common
// edits list them; where it is not loaded, or with "require", the common
// edits fail with ErrMissingDeviceNode saying what to do on the node, and
// nothing is created; "optional" leaves them out, as nvcdi does.
func TestNVCDIUVMPolicy(t *testing.T) {
	// Creating a character device with a number needs CAP_MKNOD.
	probe := filepath.Join(t.TempDir(), "probe")
	canMknod := unix.Mknod(probe, unix.S_IFCHR|0o600, int(unix.Mkdev(510, 0))) == nil

	for name, tc := range map[string]struct {
		policy   cdi.UVMPolicy
		loaded   bool
		present  bool // the device nodes exist before
		wantErr  []string
		wantUVM  bool
		needNode bool
	}{
		"create, module loaded":     {policy: cdi.UVMCreate, loaded: true, wantUVM: true, needNode: true},
		"create, module not loaded": {policy: cdi.UVMCreate, wantErr: []string{"/dev/nvidia-uvm and /dev/nvidia-uvm-tools", "not loaded", "nvidia-modprobe -u -c=0", "--uvm=optional"}},
		"create, nodes there":       {policy: cdi.UVMCreate, present: true, wantUVM: true},
		"require, module loaded":    {policy: cdi.UVMRequire, loaded: true, wantErr: []string{"is loaded (major 510)", "--uvm=create"}},
		"require, nodes there":      {policy: cdi.UVMRequire, present: true, wantUVM: true},
		"optional":                  {policy: cdi.UVMOptional, loaded: true},
	} {
		t.Run(name, func(t *testing.T) {
			if tc.needNode && !canMknod {
				t.Skip("cannot create numbered character devices here (no CAP_MKNOD): the nodes the agent creates cannot be checked")
			}
			m, lib := workstation(t)
			mountPoint := fakeDriverRoot(t, m)
			if tc.present {
				// As the mock machine's nodes where numbers cannot be
				// given: nvcdi lists character devices only.
				for _, n := range []string{"nvidia-uvm", "nvidia-uvm-tools"} {
					if err := unix.Mknod(filepath.Join(mountPoint, "dev", n), unix.S_IFCHR|0o666, 0); err != nil {
						t.Fatal(err)
					}
				}
			}
			root, err := driverroot.New(driverroot.GPUOperatorHostPath, mountPoint)
			if err != nil {
				t.Fatal(err)
			}
			gen, err := cdi.NewNVCDI(cdi.NVCDIOptions{Root: root, NVML: func() nvml.Interface { return lib }, UVM: tc.policy, ProcDevices: procDevices(t, tc.loaded)})
			if err != nil {
				t.Fatal(err)
			}
			edits, err := gen.CommonEdits()
			if len(tc.wantErr) > 0 {
				if !errors.Is(err, cdi.ErrMissingDeviceNode) {
					t.Fatalf("common edits: error %v, want %v", err, cdi.ErrMissingDeviceNode)
				}
				for _, want := range tc.wantErr {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("error %q does not say %q", err, want)
					}
				}
			} else if err != nil {
				t.Fatalf("common edits: %v", err)
			}
			listed := map[string]string{}
			for _, n := range edits.DeviceNodes {
				listed[n.Path] = n.HostPath
			}
			for minor, n := range []string{"nvidia-uvm", "nvidia-uvm-tools"} {
				path := "/dev/" + n
				host, ok := listed[path]
				if ok != tc.wantUVM || (ok && host != driverroot.GPUOperatorHostPath+path) {
					t.Errorf("%s listed %v with host path %q, want listed %v with %s", path, ok, host, tc.wantUVM, driverroot.GPUOperatorHostPath+path)
				}
				var st unix.Stat_t
				err := unix.Stat(filepath.Join(mountPoint, path), &st)
				switch {
				case tc.present:
				case !tc.needNode:
					if err == nil {
						t.Errorf("%s created, want nothing created", path)
					}
				case err != nil:
					t.Errorf("%s not created: %v", path, err)
				case st.Mode&unix.S_IFMT != unix.S_IFCHR || unix.Major(st.Rdev) != 510 || unix.Minor(st.Rdev) != uint32(minor) || st.Mode&0o777 != 0o666:
					t.Errorf("%s: mode %o, device %d:%d; want a character device 510:%d with mode 0666", path, st.Mode, unix.Major(st.Rdev), unix.Minor(st.Rdev), minor)
				}
			}
		})
	}
}

// TestParseUVMPolicy accepts the three policies and names them when it
// refuses another.
func TestParseUVMPolicy(t *testing.T) {
	for _, p := range cdi.UVMPolicies {
		if got, err := cdi.ParseUVMPolicy(string(p)); err != nil || got != p {
			t.Errorf("ParseUVMPolicy(%q) = %q, %v", p, got, err)
		}
	}
	if _, err := cdi.ParseUVMPolicy("always"); err == nil || !strings.Contains(err.Error(), "create, require, optional") {
		t.Errorf("want an error naming the valid policies, got %v", err)
	}
	root, _ := driverroot.New("/", t.TempDir())
	if _, err := cdi.NewNVCDI(cdi.NVCDIOptions{Root: root, NVML: func() nvml.Interface { return nil }, UVM: "always"}); err == nil {
		t.Error("NewNVCDI accepted an unknown nvidia-uvm policy")
	}
}
