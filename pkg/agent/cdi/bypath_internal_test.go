package cdi

import (
	"path/filepath"
	"slices"
	"testing"

	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/topodra/topodra/pkg/agent/driverroot"
)

// TestDRMByPathLinksInContainer: nvcdi names the links that its
// create-symlinks hook makes for a GPU's DRM devices (/dev/dri/by-path)
// by where it found them, below the agent's mount of the device root; in
// the container they belong in /dev, as the device nodes do. Host paths
// go to the node's, and the other container paths stay.
func TestDRMByPathLinksInContainer(t *testing.T) {
	root, err := driverroot.New("/", "/driver-root")
	if err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		devs     devRoots
		wantLink string
	}{
		"node's /dev mounted at /host": {devRoots{path: "/host", hostPath: "/"}, "../card1::/dev/dri/by-path/pci-0000:07:00.0-card"},
		"driver root's /dev":           {devRoots{path: "/driver-root", hostPath: "/"}, "../card1::/dev/dri/by-path/pci-0000:07:00.0-card"},
		"own /dev":                     {devRoots{path: "/", hostPath: "/"}, "../card1::/dev/dri/by-path/pci-0000:07:00.0-card"},
	} {
		t.Run(name, func(t *testing.T) {
			link := "../card1::" + tc.devs.path + "/dev/dri/by-path/pci-0000:07:00.0-card"
			if tc.devs.path == "/" {
				link = "../card1::/dev/dri/by-path/pci-0000:07:00.0-card"
			}
			edits := cdispec.ContainerEdits{
				DeviceNodes: []*cdispec.DeviceNode{{Path: "/dev/dri/card1", HostPath: filepath.Join(tc.devs.path, "/dev/dri/card1")}},
				Mounts:      []*cdispec.Mount{{ContainerPath: "/usr/bin/nvidia-smi", HostPath: "/driver-root/usr/bin/nvidia-smi"}},
				Hooks: []*cdispec.Hook{
					{HookName: "createContainer", Path: "/usr/bin/nvidia-cdi-hook", Args: []string{"nvidia-cdi-hook", "create-symlinks", "--link", link}},
					{HookName: "createContainer", Path: "/usr/bin/nvidia-cdi-hook", Args: []string{"nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"}},
				},
			}
			g := &NVCDI{opts: NVCDIOptions{Root: root}}
			devs := tc.devs
			devs.root = root
			got, err := g.toHost(edits, devs)
			if err != nil {
				t.Fatal(err)
			}
			if args := got.Hooks[0].Args; !slices.Equal(args, []string{"nvidia-cdi-hook", "create-symlinks", "--link", tc.wantLink}) {
				t.Errorf("create-symlinks args %q, want the link at %s", args, tc.wantLink)
			}
			if args := got.Hooks[1].Args; !slices.Equal(args, []string{"nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"}) {
				t.Errorf("update-ldcache args %q changed", args)
			}
			if n := got.DeviceNodes[0]; n.Path != "/dev/dri/card1" || n.HostPath != "/dev/dri/card1" {
				t.Errorf("device node %s at %s, want /dev/dri/card1 at /dev/dri/card1", n.Path, n.HostPath)
			}
			if m := got.Mounts[0]; m.ContainerPath != "/usr/bin/nvidia-smi" || m.HostPath != "/usr/bin/nvidia-smi" {
				t.Errorf("mount %s at %s, want /usr/bin/nvidia-smi from the node's /usr/bin/nvidia-smi", m.ContainerPath, m.HostPath)
			}
		})
	}
}
