package cdi

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2/ktesting"
)

// TestNodesNotCreatedInOwnDev: with the device root "/" (the agent's own
// /dev, in a container not the node's, where a node created would not be
// seen by the runtime), nothing is created and the nodes are reported
// missing with what to do instead.
func TestNodesNotCreatedInOwnDev(t *testing.T) {
	for _, n := range uvmNodes {
		if _, err := os.Lstat(n.path); err == nil {
			t.Skipf("%s exists on this machine: nothing would be created anyway", n.path)
		}
	}
	devices := filepath.Join(t.TempDir(), "devices")
	if err := os.WriteFile(devices, []byte("Character devices:\n195 nvidia\n510 nvidia-uvm\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	logger, _ := ktesting.NewTestContext(t)
	g := &NVCDI{opts: NVCDIOptions{CreateDeviceNodes: true, UVM: UVMRequire, ProcDevices: devices, Logger: logger}}
	missing, err := g.ensureNodes(devRoots{path: "/", hostPath: "/"}, uvmNodes)
	if err != nil {
		t.Fatal(err)
	}
	if len(missing.paths) != 2 || !strings.Contains(missing.why, "does not create device nodes in its own /dev") || !strings.Contains(missing.why, "--container-dev-root") {
		t.Errorf("missing %v because %q; want both nodes missing, saying why they were not created", missing.paths, missing.why)
	}
	for _, n := range uvmNodes {
		if _, err := os.Lstat(n.path); err == nil {
			t.Errorf("%s created in this machine's /dev", n.path)
		}
	}
}

// TestCharacterMajor reads the character section of /proc/devices only,
// takes any of the names, and fails on a file it cannot read.
func TestCharacterMajor(t *testing.T) {
	p := filepath.Join(t.TempDir(), "devices")
	text := "Character devices:\n  1 mem\n195 nvidia-frontend\n235 nvidia-uvm\n\nBlock devices:\n259 nvidia-uvm\n"
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	if major, ok, err := characterMajor(p, uvmModule.names); err != nil || !ok || major != 235 {
		t.Errorf("nvidia-uvm: %d %v %v, want 235", major, ok, err)
	}
	if major, ok, err := characterMajor(p, nvidiaModule.names); err != nil || !ok || major != 195 {
		t.Errorf("nvidia (as nvidia-frontend): %d %v %v, want 195", major, ok, err)
	}
	if _, ok, err := characterMajor(p, []string{"nvidia-nvlink"}); err != nil || ok {
		t.Errorf("nvidia-nvlink: found %v, %v; want not found", ok, err)
	}
	if _, _, err := characterMajor(filepath.Join(t.TempDir(), "none"), uvmModule.names); err == nil {
		t.Error("a missing file read as no module loaded")
	}
}

// TestSetOwnerAndModeFollowsNoLink: where a link stands in place of a
// device node, or a file that is not the device, setting the node's owner
// and mode fails and the file the link names keeps its own.
func TestSetOwnerAndModeFollowsNoLink(t *testing.T) {
	dir := t.TempDir()
	victim := filepath.Join(dir, "victim")
	if err := os.WriteFile(victim, []byte("secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "nvidia0")
	if err := os.Symlink(victim, link); err != nil {
		t.Fatal(err)
	}
	dev := unix.Mkdev(195, 0)
	if err := setOwnerAndMode(link, dev, 0o666, os.Getuid(), os.Getgid()); err == nil {
		t.Error("a link in place of the device node was accepted")
	}
	if err := setOwnerAndMode(victim, dev, 0o666, os.Getuid(), os.Getgid()); err == nil || !strings.Contains(err.Error(), "is not the character device 195:0") {
		t.Errorf("a regular file in place of the device node: %v, want a refusal naming the device", err)
	}
	if info, err := os.Stat(victim); err != nil || info.Mode().Perm() != 0o600 {
		t.Errorf("the file the link names: %v, %v; want its mode 0600 kept", info.Mode(), err)
	}
}
