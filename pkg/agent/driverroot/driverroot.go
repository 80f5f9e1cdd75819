// Package driverroot locates the NVIDIA driver's files (libnvidia-ml,
// nvidia-smi, device nodes) in a driver root: the file system tree in which
// the driver is installed, as the node agent sees it from its container.
//
// A driver root has two names. HostPath is where the driver lives on the
// node: "/" for a driver installed on the host, "/run/nvidia/driver" for the
// NVIDIA GPU Operator's driver container. Path is where the agent's
// container mounts it (for example /driver-root); running directly on the
// host, Path equals HostPath. Files are looked up below Path; CDI specs,
// which the container runtime reads on the host, name them below HostPath.
//
// Device nodes (/dev/nvidia0, /dev/nvidiactl) are taken from the driver
// root's /dev where it holds them, as a driver container's does. Otherwise
// they come from a device root: a directory whose dev/ is the node's /dev,
// with its own two names, DevRoot in the agent's container and
// DevRootHostPath on the node (both "/" unless set, see [Root.WithDevRoot]).
//
// Symbolic links inside the tree are resolved relative to the tree, so an
// absolute link like /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1 ->
// /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15 stays inside Path.
//
// Where a node's driver root is not known in advance (a GPU Operator
// cluster whose nodes have either the operator's driver container or a
// driver installed on the host), a [Selector] picks it among
// [AutoCandidates]: the first that holds the NVML library.
package driverroot

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// DefaultHostPath is the driver root of a driver installed on the host.
const DefaultHostPath = "/"

// GPUOperatorHostPath is the driver root of the NVIDIA GPU Operator's driver
// container.
const GPUOperatorHostPath = "/run/nvidia/driver"

// NVMLLibrary is the file name of the NVML library that the agent loads.
const NVMLLibrary = "libnvidia-ml.so.1"

// ErrNotFound is returned (wrapped) when a driver file is not in the root.
var ErrNotFound = errors.New("not found in driver root")

// ErrOutsideRoot is returned (wrapped) by [Root.WithNVMLLibrary] for an
// absolute path that is not below the root's HostPath.
var ErrOutsideRoot = errors.New("not below the driver root")

// LibrarySearchPaths are the directories, relative to the root, searched
// for driver libraries, in order.
var LibrarySearchPaths = []string{
	"/usr/lib64",
	"/usr/lib/x86_64-linux-gnu",
	"/usr/lib/aarch64-linux-gnu",
	"/usr/lib/x86_64-linux-gnu/nvidia/current",
	"/usr/lib/aarch64-linux-gnu/nvidia/current",
	"/lib64",
	"/lib/x86_64-linux-gnu",
	"/lib/aarch64-linux-gnu",
	"/usr/lib",
	"/lib",
}

// BinarySearchPaths are the directories, relative to the root, searched for
// driver executables, in order.
var BinarySearchPaths = []string{"/usr/bin", "/usr/sbin", "/bin", "/sbin", "/opt/bin", "/usr/local/bin"}

// maxLinks bounds symbolic link resolution (loops).
const maxLinks = 40

// Root is one driver root. The zero value is not valid; use [New].
type Root struct {
	// Path is the root as the agent sees it (its mount point).
	Path string
	// HostPath is the same root as the container runtime on the node sees it.
	HostPath string
	// DevRoot is the directory whose dev/ holds the node's device nodes, as
	// the agent sees it, for a driver root whose /dev does not hold
	// [ControlDevice]; DevRootHostPath is the same directory on the node.
	// Empty means "/" for both: the agent's own /dev, which must then be
	// the node's. Set both with [Root.WithDevRoot].
	DevRoot         string
	DevRootHostPath string
	// NVMLLibrary is where [Root.NVMLLibraryPath] looks for the NVML
	// library: a path relative to the root, with a leading slash. Empty
	// means [NVMLLibrary] in each of [LibrarySearchPaths]. Set it with
	// [Root.WithNVMLLibrary].
	NVMLLibrary string
}

// New returns the root mounted at path that is hostPath on the node. An
// empty path means hostPath (the agent runs on the host, or mounts the root
// at the same place). Both must be absolute.
func New(hostPath, path string) (Root, error) {
	if hostPath == "" {
		hostPath = DefaultHostPath
	}
	if path == "" {
		path = hostPath
	}
	if !filepath.IsAbs(hostPath) || !filepath.IsAbs(path) {
		return Root{}, fmt.Errorf("driver root must be absolute, got host path %q and container path %q", hostPath, path)
	}
	return Root{Path: filepath.Clean(path), HostPath: filepath.Clean(hostPath)}, nil
}

// FindLibrary returns the agent-side path of a driver library (symbolic
// links resolved within the root). The error wraps [ErrNotFound].
func (r Root) FindLibrary(name string) (string, error) {
	return r.find(name, LibrarySearchPaths)
}

// FindBinary returns the agent-side path of a driver executable.
func (r Root) FindBinary(name string) (string, error) {
	return r.find(name, BinarySearchPaths)
}

// NVMLLibraryPath is the agent-side path of libnvidia-ml.so.1: the file
// that NVMLLibrary names where set, otherwise the first found in
// [LibrarySearchPaths]. Symbolic links are resolved within the root. The
// error wraps [ErrNotFound].
func (r Root) NVMLLibraryPath() (string, error) {
	if r.NVMLLibrary == "" {
		return r.FindLibrary(NVMLLibrary)
	}
	resolved, err := r.Resolve(r.NVMLLibrary)
	if err != nil {
		return "", fmt.Errorf("%s %w %s: %w", r.NVMLLibrary, ErrNotFound, r.Path, err)
	}
	return resolved, nil
}

// WithNVMLLibrary returns r with the NVML library at path, for a driver
// whose library is outside [LibrarySearchPaths]: a path relative to the
// root (usr/local/nvidia/lib64/libnvidia-ml.so.1), or an absolute path as
// the node sees it, which must be below HostPath (with HostPath
// /run/nvidia/driver, /run/nvidia/driver/usr/lib64/libnvidia-ml.so.1);
// the error for one that is not wraps [ErrOutsideRoot]. A relative path
// may not leave the root (".."). Empty path means the search of
// [LibrarySearchPaths].
func (r Root) WithNVMLLibrary(path string) (Root, error) {
	switch {
	case path == "":
		r.NVMLLibrary = ""
		return r, nil
	case filepath.IsAbs(path):
		rel, err := filepath.Rel(r.HostPath, filepath.Clean(path))
		if err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") {
			return Root{}, fmt.Errorf("NVML library %s is %w %s", path, ErrOutsideRoot, r.HostPath)
		}
		r.NVMLLibrary = "/" + rel
	default:
		rel := filepath.Clean(path)
		if rel == "." || rel == ".." || strings.HasPrefix(rel, "../") {
			return Root{}, fmt.Errorf("NVML library %s leaves the driver root", path)
		}
		r.NVMLLibrary = "/" + rel
	}
	return r, nil
}

// ControlDevice is the device node that every NVIDIA driver creates; a
// root whose /dev holds it is where the driver's device nodes are.
const ControlDevice = "/dev/nvidiactl"

// WithDevRoot returns r with the device root mounted at path that is
// hostPath on the node: where r's /dev does not hold [ControlDevice],
// device nodes are looked up in path/dev and named hostPath/dev in CDI
// specs. An empty hostPath means "/" (the node's /dev), an empty path
// means hostPath. Both must be absolute.
func (r Root) WithDevRoot(hostPath, path string) (Root, error) {
	if hostPath == "" {
		hostPath = "/"
	}
	if path == "" {
		path = hostPath
	}
	if !filepath.IsAbs(hostPath) || !filepath.IsAbs(path) {
		return Root{}, fmt.Errorf("device root must be absolute, got host path %q and container path %q", hostPath, path)
	}
	r.DevRoot, r.DevRootHostPath = filepath.Clean(path), filepath.Clean(hostPath)
	return r, nil
}

// hasDev says whether the driver root's /dev holds [ControlDevice].
func (r Root) hasDev() bool {
	_, err := os.Stat(filepath.Join(r.Path, ControlDevice))
	return err == nil
}

// DevRoots returns the agent-side root below which device nodes
// (/dev/nvidia0) are found, and the same root as the node sees it, from
// one look at the driver root's /dev: the driver root if its /dev holds
// [ControlDevice], otherwise the device root (DevRoot, default "/"). A
// driver root with an empty /dev (a driver directory mounted into a VM or
// container, such as /usr/local/nvidia, or a host installation mounted
// without its /dev) therefore uses the node's device nodes as the device
// root has them.
func (r Root) DevRoots() (path, hostPath string) {
	switch {
	case r.hasDev():
		return r.Path, r.HostPath
	case r.DevRoot == "":
		return "/", "/"
	}
	hostPath = r.DevRootHostPath
	if hostPath == "" {
		hostPath = "/"
	}
	return r.DevRoot, hostPath
}

// ToHost turns an agent-side path below Path into the node's path below
// HostPath. Paths outside the root are returned unchanged.
func (r Root) ToHost(path string) string {
	rel, ok := r.relative(path)
	if !ok {
		return path
	}
	return filepath.Join(r.HostPath, rel)
}

func (r Root) relative(path string) (string, bool) {
	rel, err := filepath.Rel(r.Path, path)
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return "", false
	}
	return "/" + rel, true
}

func (r Root) find(name string, dirs []string) (string, error) {
	var errs []error
	for _, dir := range dirs {
		resolved, err := r.Resolve(filepath.Join(dir, name))
		if err == nil {
			return resolved, nil
		}
		if !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return "", fmt.Errorf("%s %w %s: %w", name, ErrNotFound, r.Path, errors.Join(errs...))
	}
	return "", fmt.Errorf("%s %w %s (searched %s)", name, ErrNotFound, r.Path, strings.Join(dirs, ", "))
}

// Resolve follows symbolic links of rel (a path relative to the root, with
// a leading slash) inside the root and returns the agent-side path of a
// regular file. A missing file's error wraps fs.ErrNotExist.
func (r Root) Resolve(rel string) (string, error) {
	links := 0
	parts := strings.Split(strings.TrimPrefix(filepath.Clean(rel), "/"), "/")
	done := "/"
	for len(parts) > 0 {
		part := parts[0]
		parts = parts[1:]
		if part == "" || part == "." {
			continue
		}
		if part == ".." {
			done = filepath.Dir(done)
			continue
		}
		next := filepath.Join(done, part)
		full := filepath.Join(r.Path, next)
		info, err := os.Lstat(full)
		if err != nil {
			return "", err
		}
		if info.Mode()&fs.ModeSymlink == 0 {
			done = next
			continue
		}
		links++
		if links > maxLinks {
			return "", fmt.Errorf("resolve %s in %s: too many symbolic links", rel, r.Path)
		}
		target, err := os.Readlink(full)
		if err != nil {
			return "", err
		}
		if !filepath.IsAbs(target) {
			target = filepath.Join(done, target)
		}
		parts = append(strings.Split(strings.TrimPrefix(filepath.Clean(target), "/"), "/"), parts...)
		done = "/"
	}
	full := filepath.Join(r.Path, done)
	info, err := os.Stat(full)
	if err != nil {
		return "", err
	}
	if !info.Mode().IsRegular() {
		return "", fmt.Errorf("%s is not a regular file", full)
	}
	return full, nil
}
