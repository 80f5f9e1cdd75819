package mockgpu_test

import (
	"io/fs"
	"testing"
	"testing/fstest"

	"github.com/topodra/topodra/pkg/agent/mockgpu"
)

// TestFS: the in-memory tree behaves as a file system to io/fs (fstest's
// checks), follows links in the middle of a path as sysfs readers expect
// (bus/pci/devices/<bdf>/numa_node), and reads links without following
// them.
func TestFS(t *testing.T) {
	tree := mockgpu.FS{
		"devices/pci0000:00/0000:00:01.0/0000:01:00.0/numa_node": {Data: []byte("1\n")},
		"bus/pci/devices/0000:01:00.0":                           {Data: []byte("../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0"), Mode: fs.ModeSymlink},
		"devices/system/cpu/cpu0/node0":                          {Mode: fs.ModeDir | 0o755},
		"devices/system/node/node0/cpulist":                      {Data: []byte("0-3\n")},
	}
	if err := fstest.TestFS(tree,
		"devices/pci0000:00/0000:00:01.0/0000:01:00.0/numa_node",
		"devices/system/cpu/cpu0/node0",
		"devices/system/node/node0/cpulist",
	); err != nil {
		t.Fatal(err)
	}

	data, err := fs.ReadFile(tree, "bus/pci/devices/0000:01:00.0/numa_node")
	if err != nil || string(data) != "1\n" {
		t.Errorf("read through the link: %q, %v", data, err)
	}
	target, err := fs.ReadLink(tree, "bus/pci/devices/0000:01:00.0")
	if err != nil || target != "../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0" {
		t.Errorf("ReadLink: %q, %v", target, err)
	}
	if fi, err := fs.Lstat(tree, "bus/pci/devices/0000:01:00.0"); err != nil || fi.Mode()&fs.ModeSymlink == 0 {
		t.Errorf("Lstat of the link: %v, %v; want a link", fi, err)
	}
	if fi, err := fs.Stat(tree, "bus/pci/devices/0000:01:00.0"); err != nil || !fi.IsDir() {
		t.Errorf("Stat of the link: %v, %v; want the directory it names", fi, err)
	}
	if _, err := fs.ReadLink(tree, "devices/system/node/node0/cpulist"); err == nil {
		t.Error("ReadLink of a regular file succeeded")
	}
	matches, err := fs.Glob(tree, "devices/system/cpu/cpu0/node[0-9]*")
	if err != nil || len(matches) != 1 || matches[0] != "devices/system/cpu/cpu0/node0" {
		t.Errorf("Glob: %v, %v", matches, err)
	}
	tree["loop/a"] = &mockgpu.File{Data: []byte("b"), Mode: fs.ModeSymlink}
	tree["loop/b"] = &mockgpu.File{Data: []byte("a"), Mode: fs.ModeSymlink}
	tree["outside"] = &mockgpu.File{Data: []byte("../etc/passwd"), Mode: fs.ModeSymlink}
	for _, name := range []string{"loop/a/x", "outside", "missing", "/abs"} {
		if _, err := fs.ReadFile(tree, name); err == nil {
			t.Errorf("ReadFile(%q) succeeded", name)
		}
	}
}
