package cdi_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"golang.org/x/sys/unix"

	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/driverroot"
)

// procDevices writes a file in the format of /proc/devices, with the
// nvidia module's character device (195) and nvidia-uvm's (510) where
// loaded.
func procDevices(t *testing.T, nvidia, uvm bool) string {
	t.Helper()
	text := "Character devices:\n  1 mem\n  4 tty\n"
	if nvidia {
		text += "195 nvidia\n"
	}
	if uvm {
		text += "510 nvidia-uvm\n"
	}
	text += "511 nvidia-nvlink\n\nBlock devices:\n  7 loop\n510 nvidia-uvm-looks-alike\n"
	p := filepath.Join(t.TempDir(), "devices")
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestNVCDICreatesDeviceNodes: on a driver root whose /dev lacks some of the
// device nodes that a GPU's containers need, or has one that is not the
// device it should be, CreateDeviceNodes makes them where their module is
// loaded, as nvidia-modprobe would (character devices with the module's
// major number, the nvidia module's nodes with the ownership and mode of
// its parameters, a /dev/char link to each), and the edits list them;
// where it cannot or may not, the edits fail with ErrMissingDeviceNode
// saying what to do on the node, and nothing is created. The nvidia-uvm
// nodes are required with UVMRequire only.
func TestNVCDICreatesDeviceNodes(t *testing.T) {
	// Creating a character device with a number needs CAP_MKNOD.
	probe := filepath.Join(t.TempDir(), "probe")
	canMknod := unix.Mknod(probe, unix.S_IFCHR|0o600, int(unix.Mkdev(510, 0))) == nil

	type node struct {
		path         string
		major, minor uint32
		mode         uint32
		gid          uint32
	}
	uvm := []node{{"/dev/nvidia-uvm", 510, 0, 0o666, 0}, {"/dev/nvidia-uvm-tools", 510, 1, 0o666, 0}}
	ctl := node{"/dev/nvidiactl", 195, 255, 0o666, 0}
	gpu1 := node{"/dev/nvidia1", 195, 1, 0o666, 0}
	ctlGroup := node{"/dev/nvidiactl", 195, 255, 0o660, 44}
	for name, tc := range map[string]struct {
		create    bool
		uvm       cdi.UVMPolicy
		nvidia    bool // the nvidia module is loaded
		uvmLoaded bool
		uvmThere  bool   // the nvidia-uvm nodes exist before (0:0)
		removed   []node // of the nodes the driver root has
		// rootOnly: of the nodes the driver root has, made again with
		// their right numbers, root-only (0600, root's group)
		rootOnly     []node
		wantRootOnly []node // left as they are
		params       string // the nvidia module's parameters
		noDevices    bool   // /proc/devices cannot be read
		wantErr      []string
		wantCreated  []node
		wantListed   []string
		wantUnlisted []string
	}{
		"create, uvm module loaded": {create: true, uvm: cdi.UVMRequire, nvidia: true, uvmLoaded: true,
			wantCreated: uvm, wantListed: []string{"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidiactl", "/dev/nvidia1"}},
		"create, uvm nodes of another major": {create: true, uvm: cdi.UVMRequire, nvidia: true, uvmLoaded: true, uvmThere: true,
			wantCreated: uvm, wantListed: []string{"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}},
		"create, uvm module not loaded": {create: true, uvm: cdi.UVMRequire, nvidia: true,
			wantErr: []string{"/dev/nvidia-uvm and /dev/nvidia-uvm-tools", "nvidia-uvm kernel module is not loaded", "nvidia-modprobe -u -c=0", "--uvm=optional"}},
		"create, uvm not required, module not loaded": {create: true, uvm: cdi.UVMOptional, nvidia: true,
			wantUnlisted: []string{"/dev/nvidia-uvm"}},
		"create, control and GPU nodes missing": {create: true, uvm: cdi.UVMOptional, nvidia: true, removed: []node{ctl, gpu1},
			wantCreated: []node{ctl, gpu1}, wantListed: []string{"/dev/nvidiactl", "/dev/nvidia1"}},
		"create, the driver's mode and group": {create: true, uvm: cdi.UVMRequire, nvidia: true, uvmLoaded: true, removed: []node{ctl},
			params:      "Mobile: 4294967295\nModifyDeviceFiles: 1\nDeviceFileUID: 0\nDeviceFileGID: 44\nDeviceFileMode: 432\n",
			wantCreated: append([]node{ctlGroup}, uvm...), wantListed: []string{"/dev/nvidiactl", "/dev/nvidia-uvm"}},
		"create, the driver's files not to be modified": {create: true, uvm: cdi.UVMOptional, nvidia: true, removed: []node{ctl},
			params:  "ModifyDeviceFiles: 0\n",
			wantErr: []string{"/dev/nvidiactl", "ModifyDeviceFiles: 0"}},
		"create, a node of the right number with another owner and mode": {create: true, uvm: cdi.UVMOptional, nvidia: true, rootOnly: []node{ctl, gpu1},
			params:      "ModifyDeviceFiles: 1\nDeviceFileUID: 0\nDeviceFileGID: 44\nDeviceFileMode: 432\n",
			wantCreated: []node{ctlGroup, {"/dev/nvidia1", 195, 1, 0o660, 44}}, wantListed: []string{"/dev/nvidiactl", "/dev/nvidia1"}},
		"create, another owner and mode, the driver's files not to be modified": {create: true, uvm: cdi.UVMOptional, nvidia: true, rootOnly: []node{ctl},
			params:       "ModifyDeviceFiles: 0\nDeviceFileGID: 44\nDeviceFileMode: 432\n",
			wantRootOnly: []node{ctl}, wantListed: []string{"/dev/nvidiactl"}},
		"control node missing, not created": {uvm: cdi.UVMOptional, nvidia: true, removed: []node{ctl},
			wantErr: []string{"/dev/nvidiactl, looked up in", "nvidia-modprobe -c=0", "--create-device-nodes"}},
		"control node missing, /proc/devices unreadable": {create: true, uvm: cdi.UVMOptional, nvidia: true, removed: []node{ctl}, noDevices: true,
			wantErr: []string{"/dev/nvidiactl", "cannot tell whether the nvidia kernel module is loaded", "nvidia-modprobe -c=0"}},
		"control node missing, module not loaded": {create: true, uvm: cdi.UVMOptional, removed: []node{ctl},
			wantErr: []string{"/dev/nvidiactl", "the nvidia kernel module is not loaded", "nvidia-frontend or nvidia"}},
		"require, not created, module loaded": {uvm: cdi.UVMRequire, nvidia: true, uvmLoaded: true,
			wantErr: []string{"is loaded (major 510)", "--create-device-nodes", "nvidia-modprobe -u -c=0"}},
		"require, nodes there":  {uvm: cdi.UVMRequire, uvmThere: true, wantListed: []string{"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}},
		"optional, not created": {uvm: cdi.UVMOptional, nvidia: true, uvmLoaded: true, wantUnlisted: []string{"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}},
	} {
		t.Run(name, func(t *testing.T) {
			if tc.create && !canMknod && (len(tc.wantCreated) > 0 || len(tc.rootOnly) > 0) {
				t.Skip("cannot create numbered character devices here (no CAP_MKNOD): the mock machine's device nodes are 0:0, and those the agent creates cannot be checked")
			}
			m, lib := workstation(t)
			mountPoint := fakeDriverRoot(t, m)
			if err := os.Mkdir(filepath.Join(mountPoint, "dev", "char"), 0o755); err != nil {
				t.Fatal(err)
			}
			for _, n := range tc.removed {
				if err := os.Remove(filepath.Join(mountPoint, n.path)); err != nil {
					t.Fatal(err)
				}
			}
			for _, n := range tc.rootOnly {
				p := filepath.Join(mountPoint, n.path)
				if err := os.Remove(p); err != nil {
					t.Fatal(err)
				}
				if err := unix.Mknod(p, unix.S_IFCHR|0o600, int(unix.Mkdev(n.major, n.minor))); err != nil {
					t.Fatal(err)
				}
				if err := os.Chmod(p, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			if tc.uvmThere {
				// As the mock machine's nodes where numbers cannot be
				// given: nvcdi lists character devices only.
				for _, n := range uvm {
					if err := unix.Mknod(filepath.Join(mountPoint, n.path), unix.S_IFCHR|0o666, 0); err != nil {
						t.Fatal(err)
					}
				}
			}
			root, err := driverroot.New(driverroot.GPUOperatorHostPath, mountPoint)
			if err != nil {
				t.Fatal(err)
			}
			if len(tc.removed) > 0 && tc.removed[0].path == ctl.path {
				// The driver root's /dev without nvidiactl is not a
				// device root; the node's /dev is, here the same tree.
				if root, err = root.WithDevRoot(driverroot.GPUOperatorHostPath, mountPoint); err != nil {
					t.Fatal(err)
				}
			}
			params := filepath.Join(t.TempDir(), "params")
			if err := os.WriteFile(params, []byte(tc.params), 0o644); err != nil {
				t.Fatal(err)
			}
			devices := procDevices(t, tc.nvidia, tc.uvmLoaded)
			if tc.noDevices {
				devices = filepath.Join(t.TempDir(), "no-such-file")
			}
			gen, err := cdi.NewNVCDI(cdi.NVCDIOptions{Root: root, NVML: func() nvml.Interface { return lib },
				CreateDeviceNodes: tc.create, UVM: tc.uvm, ProcDevices: devices, DriverParams: params})
			if err != nil {
				t.Fatal(err)
			}
			common, err := gen.CommonEdits()
			if err == nil {
				device, deviceErr := gen.DeviceEdits(cdi.Device{Name: "gpu-1", UUID: m.UUID(1), Minor: 1})
				common.DeviceNodes = append(common.DeviceNodes, device.DeviceNodes...)
				err = deviceErr
			}
			if len(tc.wantErr) > 0 {
				if !errors.Is(err, cdi.ErrMissingDeviceNode) {
					t.Fatalf("edits: error %v, want %v", err, cdi.ErrMissingDeviceNode)
				}
				for _, want := range tc.wantErr {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("error %q does not say %q", err, want)
					}
				}
			} else if err != nil {
				t.Fatalf("edits: %v", err)
			}
			listed := map[string]string{}
			for _, n := range common.DeviceNodes {
				listed[n.Path] = n.HostPath
			}
			for _, path := range tc.wantListed {
				if host, ok := listed[path]; !ok || host != driverroot.GPUOperatorHostPath+path {
					t.Errorf("%s listed %v with host path %q, want it with %s (all: %v)", path, ok, host, driverroot.GPUOperatorHostPath+path, listed)
				}
			}
			for _, path := range tc.wantUnlisted {
				if _, ok := listed[path]; ok {
					t.Errorf("%s listed, want it left out", path)
				}
			}
			created := map[string]bool{}
			for _, n := range tc.wantCreated {
				created[n.path] = true
				var st unix.Stat_t
				if err := unix.Stat(filepath.Join(mountPoint, n.path), &st); err != nil {
					t.Errorf("%s not created: %v", n.path, err)
					continue
				}
				if st.Mode&unix.S_IFMT != unix.S_IFCHR || unix.Major(st.Rdev) != n.major || unix.Minor(st.Rdev) != n.minor || st.Mode&0o777 != n.mode || st.Gid != n.gid {
					t.Errorf("%s: mode %o, group %d, device %d:%d; want a character device %d:%d with mode %o, group %d", n.path, st.Mode, st.Gid, unix.Major(st.Rdev), unix.Minor(st.Rdev), n.major, n.minor, n.mode, n.gid)
				}
				link := filepath.Join(mountPoint, "dev", "char", fmt.Sprintf("%d:%d", n.major, n.minor))
				if target, err := os.Readlink(link); err != nil || target != "../"+strings.TrimPrefix(n.path, "/dev/") {
					t.Errorf("%s: %q, %v; want a link to ../%s", link, target, err, strings.TrimPrefix(n.path, "/dev/"))
				}
			}
			for _, n := range tc.wantRootOnly {
				created[n.path] = true
				var st unix.Stat_t
				if err := unix.Stat(filepath.Join(mountPoint, n.path), &st); err != nil || st.Mode&0o777 != 0o600 || st.Gid != 0 {
					t.Errorf("%s: mode %o, group %d, %v; want it left at 0600, group 0", n.path, st.Mode&0o777, st.Gid, err)
				}
			}
			// Nothing else appeared or went.
			for _, n := range append([]node{ctl, gpu1}, uvm...) {
				if created[n.path] || (tc.uvmThere && strings.Contains(n.path, "uvm")) {
					continue
				}
				_, err := os.Lstat(filepath.Join(mountPoint, n.path))
				removed := slices.ContainsFunc(tc.removed, func(r node) bool { return r.path == n.path })
				if want := !removed && !strings.Contains(n.path, "uvm"); (err == nil) != want {
					t.Errorf("%s exists %v, want %v", n.path, err == nil, want)
				}
			}
		})
	}
}

// TestParseUVMPolicy accepts the policies and names them when it refuses
// another.
func TestParseUVMPolicy(t *testing.T) {
	for _, p := range cdi.UVMPolicies {
		if got, err := cdi.ParseUVMPolicy(string(p)); err != nil || got != p {
			t.Errorf("ParseUVMPolicy(%q) = %q, %v", p, got, err)
		}
	}
	if _, err := cdi.ParseUVMPolicy("create"); err == nil || !strings.Contains(err.Error(), "require, optional") {
		t.Errorf("want an error naming the valid policies, got %v", err)
	}
	root, _ := driverroot.New("/", t.TempDir())
	if _, err := cdi.NewNVCDI(cdi.NVCDIOptions{Root: root, NVML: func() nvml.Interface { return nil }, UVM: "always"}); err == nil {
		t.Error("NewNVCDI accepted an unknown nvidia-uvm policy")
	}
}
