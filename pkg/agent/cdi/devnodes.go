package cdi

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/topodra/topodra/pkg/agent/driverroot"
)

// UVMPolicy says whether [NVCDI] requires /dev/nvidia-uvm and
// /dev/nvidia-uvm-tools, the device nodes of the nvidia-uvm kernel module.
// CUDA cannot initialize without them (cuInit fails with error 999 or
// 100), and they do not exist until something creates them: nvidia-modprobe
// when CUDA first runs on the host, a udev rule, the GPU Operator, or the
// agent (NVCDIOptions.CreateDeviceNodes). nvcdi lists only the device nodes
// that exist, so on a node where CUDA runs only in containers a spec would
// start every container without them.
type UVMPolicy string

const (
	// UVMRequire fails the common edits with [ErrMissingDeviceNode] while
	// either device node is missing, naming what to do on the node.
	UVMRequire UVMPolicy = "require"
	// UVMOptional lists them where they exist and leaves them out
	// otherwise (nvcdi's own behavior): a container that uses CUDA then
	// starts and fails in cuInit.
	UVMOptional UVMPolicy = "optional"
)

// UVMPolicies lists the valid policies, the default first.
var UVMPolicies = []UVMPolicy{UVMRequire, UVMOptional}

// ParseUVMPolicy parses a policy name.
func ParseUVMPolicy(s string) (UVMPolicy, error) {
	for _, p := range UVMPolicies {
		if s == string(p) {
			return p, nil
		}
	}
	return "", fmt.Errorf("unknown nvidia-uvm policy %q; valid: require, optional", s)
}

// DefaultProcDevices is where Linux lists the registered device numbers.
const DefaultProcDevices = "/proc/devices"

// DefaultDriverParams is where the nvidia module publishes its parameters.
const DefaultDriverParams = "/proc/driver/nvidia/params"

// module is a kernel module of the driver whose character device nodes
// the containers of a GPU need.
type module struct {
	// names are the module's character device names in /proc/devices,
	// any of which says that it is loaded.
	names []string
	// remedy is what creates its device nodes on the node.
	remedy string
	// params says whether the driver's parameters (DriverParams) set
	// the ownership and mode of its device nodes; otherwise root and
	// 0666.
	params bool
}

var (
	nvidiaModule = module{
		names:  []string{"nvidia-frontend", "nvidia"},
		remedy: "run nvidia-modprobe -c=0 on the node (nvidia-smi does it too), which creates them",
		params: true,
	}
	uvmModule = module{
		names:  []string{"nvidia-uvm"},
		remedy: "run nvidia-modprobe -u -c=0 on the node, which loads the module and creates them",
	}
)

// deviceNode is a device node (its path below the device root) of a
// module with its minor number.
type deviceNode struct {
	path   string
	module module
	minor  uint32
}

// controlMinor is the minor number of /dev/nvidiactl.
const controlMinor = 255

// gpuNode is the device node of the GPU with the minor number.
func gpuNode(minor int) deviceNode {
	return deviceNode{path: fmt.Sprintf("/dev/nvidia%d", minor), module: nvidiaModule, minor: uint32(minor)}
}

var (
	controlNode = deviceNode{path: driverroot.ControlDevice, module: nvidiaModule, minor: controlMinor}
	uvmNodes    = []deviceNode{
		{path: "/dev/nvidia-uvm", module: uvmModule, minor: 0},
		{path: "/dev/nvidia-uvm-tools", module: uvmModule, minor: 1},
	}
)

// characterMajor returns the major number that the file in the format of
// /proc/devices lists for one of the character device names; ok is false
// where it lists none (the module is not loaded).
func characterMajor(procDevices string, names []string) (major uint32, ok bool, err error) {
	f, err := os.Open(procDevices)
	if err != nil {
		return 0, false, err
	}
	defer f.Close()
	scanner := bufio.NewScanner(f)
	character := false
	for scanner.Scan() {
		line := strings.TrimSpace(scanner.Text())
		switch {
		case line == "":
			continue
		case strings.HasSuffix(line, ":"):
			character = line == "Character devices:"
			continue
		case !character:
			continue
		}
		number, device, found := strings.Cut(line, " ")
		if !found || !slices.Contains(names, strings.TrimSpace(device)) {
			continue
		}
		n, err := strconv.ParseUint(number, 10, 32)
		if err != nil {
			return 0, false, fmt.Errorf("%s: bad device number in %q", procDevices, line)
		}
		return uint32(n), true, nil
	}
	return 0, false, scanner.Err()
}

// missingNodes are device nodes that are not in the device root, with why
// and what to do; it renders as the part of an error that says so.
type missingNodes struct {
	paths []string
	why   string
}

func (m missingNodes) has(path string) bool { return slices.Contains(m.paths, path) }

// fileParams are the ownership and mode of a module's device nodes, and
// whether they may be created or changed at all.
type fileParams struct {
	uid, gid int
	mode     uint32
	modify   bool
}

// driverFileParams reads the device file parameters of the nvidia module
// from a file in the format of /proc/driver/nvidia/params ("Name: value"
// lines); where it cannot be read, or for a module without params, the
// defaults: root, 0666, modifiable.
func driverFileParams(path string, m module) fileParams {
	p := fileParams{mode: 0o666, modify: true}
	if !m.params {
		return p
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return p
	}
	for _, line := range strings.Split(string(data), "\n") {
		name, value, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		n, err := strconv.ParseUint(strings.TrimSpace(value), 10, 32)
		if err != nil {
			continue
		}
		switch strings.TrimSpace(name) {
		case "DeviceFileUID":
			p.uid = int(n)
		case "DeviceFileGID":
			p.gid = int(n)
		case "DeviceFileMode":
			p.mode = uint32(n) & 0o7777
		case "ModifyDeviceFiles", "DeviceFileModify":
			p.modify = n == 1
		}
	}
	return p
}

// ensureNodes makes sure of the device nodes in the device root devs
// before nvcdi looks for them. Where CreateDeviceNodes is set, the device
// root is mounted from the node (not the agent's own "/") and a node's
// module is loaded, it does what nvidia-modprobe does: a node that is
// missing, or is not the character device of the module's major and its
// minor, is created (again) with the driver's ownership and mode, and
// /dev/char/<major>:<minor> is linked to it where the device root has
// /dev/char (the systemd cgroup driver of runc allows a container the
// devices it finds there, and the NVIDIA devices have no sysfs entry).
// Otherwise it only looks for them. It returns those still missing, with
// why; none where all are there.
func (g *NVCDI) ensureNodes(devs devRoots, nodes []deviceNode) (missingNodes, error) {
	create := g.opts.CreateDeviceNodes && devs.path != "/"
	// What /proc/devices and the driver's parameters say of a module,
	// read once per call.
	type moduleState struct {
		major  uint32
		loaded bool
		err    error
		params fileParams
	}
	modules := map[string]moduleState{}
	state := func(m module) moduleState {
		st, ok := modules[m.names[0]]
		if !ok {
			st.major, st.loaded, st.err = characterMajor(g.opts.ProcDevices, m.names)
			st.params = driverFileParams(g.opts.DriverParams, m)
			modules[m.names[0]] = st
		}
		return st
	}
	var still, why []string
	for _, n := range nodes {
		p := filepath.Join(devs.path, n.path)
		var st unix.Stat_t
		err := unix.Lstat(p, &st)
		exists := err == nil
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return missingNodes{}, fmt.Errorf("look up %s: %w", p, err)
		}
		if exists && !create {
			continue
		}
		name := n.module.names[len(n.module.names)-1]
		ms := state(n.module)
		major, loaded, err, params := ms.major, ms.loaded, ms.err, ms.params
		dev := unix.Mkdev(major, n.minor)
		switch {
		case err != nil && exists:
			continue // nothing to compare it with
		case err != nil:
			why = appendOnce(why, fmt.Sprintf("cannot tell whether the %s kernel module is loaded (%v); %s", name, err, n.module.remedy))
		case exists && (!loaded || !params.modify):
			continue // as it is: nothing to compare it with, or not to be changed
		case exists && st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == dev:
			g.fixOwnerAndMode(p, &st, params)
			g.linkCharDevice(devs, n, major)
			continue
		case !loaded:
			why = appendOnce(why, fmt.Sprintf("the %s kernel module is not loaded (%s lists no %s); %s", name, g.opts.ProcDevices, strings.Join(n.module.names, " or "), n.module.remedy))
		case !g.opts.CreateDeviceNodes:
			why = appendOnce(why, fmt.Sprintf("the %s module is loaded (major %d) but nothing created its device nodes; %s, or let the agent create them (--create-device-nodes)", name, major, n.module.remedy))
		case devs.path == "/":
			why = appendOnce(why, fmt.Sprintf("the %s module is loaded (major %d), but the agent does not create device nodes in its own /dev, which in a container is not the node's (mount the node's /dev and set --container-dev-root); %s", name, major, n.module.remedy))
		case !params.modify:
			why = appendOnce(why, fmt.Sprintf("the %s module is set not to have its device files created or changed (ModifyDeviceFiles: 0 in %s); create them on the node", name, g.opts.DriverParams))
		default:
			if err := g.makeNode(p, exists, dev, params); err != nil {
				why = appendOnce(why, fmt.Sprintf("%v; %s", err, n.module.remedy))
				break
			}
			g.opts.Logger.Info("created a device node of the NVIDIA driver", "path", p, "major", major, "minor", n.minor, "replaced", exists)
			g.linkCharDevice(devs, n, major)
			continue
		}
		still = append(still, n.path)
	}
	return missingNodes{paths: still, why: strings.Join(why, "; ")}, nil
}

// makeNode creates the character device p (replacing what is there where
// exists), with the ownership and mode of params.
func (g *NVCDI) makeNode(p string, exists bool, dev uint64, params fileParams) error {
	if exists {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("replace %s, which is not the device it should be: %w", p, err)
		}
	}
	err := unix.Mknod(p, unix.S_IFCHR|params.mode, int(dev))
	if errors.Is(err, unix.EEXIST) {
		return nil // created meanwhile (udev)
	}
	if err != nil {
		return fmt.Errorf("create %s: %w", p, err)
	}
	// Mknod applies the umask.
	if err := setOwnerAndMode(p, dev, params.mode&0o777, params.uid, params.gid); err != nil {
		_ = os.Remove(p)
		return fmt.Errorf("set the mode and owner of %s: %w", p, err)
	}
	return nil
}

// setOwnerAndMode gives the character device p, which must be device dev,
// the mode and owner. It works on the node it opened (without following a
// link) and checked, so that a link put in its place meanwhile is never
// followed to another file.
func setOwnerAndMode(p string, dev uint64, mode uint32, uid, gid int) error {
	fd, err := unix.Open(p, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != dev {
		return fmt.Errorf("%s is not the character device %d:%d", p, unix.Major(dev), unix.Minor(dev))
	}
	if err := unix.Fchownat(fd, "", uid, gid, unix.AT_EMPTY_PATH); err != nil {
		return err
	}
	// chmod has no form for a descriptor opened with O_PATH before Linux
	// 6.6; the descriptor's /proc link names the very node opened.
	return unix.Chmod(fmt.Sprintf("/proc/self/fd/%d", fd), mode)
}

// fixOwnerAndMode gives the existing device node p (stat st) the
// ownership and mode of params where it has others, as nvidia-modprobe
// does: a node that another tool created root-only keeps a container
// that runs as another user from opening it. Best effort: the node is
// there, and a container that runs as root can use it as it is.
func (g *NVCDI) fixOwnerAndMode(p string, st *unix.Stat_t, params fileParams) {
	mode := params.mode & 0o777
	if st.Mode&0o777 == mode && int(st.Uid) == params.uid && int(st.Gid) == params.gid {
		return
	}
	if err := setOwnerAndMode(p, st.Rdev, mode, params.uid, params.gid); err != nil {
		g.opts.Logger.Error(err, "Device node of the NVIDIA driver has another owner or mode than the driver's; containers that do not run as root may not open it", "path", p,
			"mode", fmt.Sprintf("%#o", st.Mode&0o777), "uid", st.Uid, "gid", st.Gid, "wantMode", fmt.Sprintf("%#o", mode), "wantUID", params.uid, "wantGID", params.gid)
		return
	}
	g.opts.Logger.Info("set the owner and mode of a device node of the NVIDIA driver to the driver's", "path", p,
		"mode", fmt.Sprintf("%#o", mode), "uid", params.uid, "gid", params.gid, "was", fmt.Sprintf("%#o %d:%d", st.Mode&0o777, st.Uid, st.Gid))
}

// linkCharDevice links /dev/char/<major>:<minor> of the device root to
// the device node, where the device root has /dev/char; best effort.
func (g *NVCDI) linkCharDevice(devs devRoots, n deviceNode, major uint32) {
	dir := filepath.Join(devs.path, "dev", "char")
	if info, err := os.Lstat(dir); err != nil || !info.IsDir() {
		return // none, or a link that is not followed
	}
	link := filepath.Join(dir, fmt.Sprintf("%d:%d", major, n.minor))
	target := "../" + strings.TrimPrefix(n.path, "/dev/")
	if got, err := os.Readlink(link); err == nil && got == target {
		return
	}
	_ = os.Remove(link)
	if err := os.Symlink(target, link); err != nil && !errors.Is(err, fs.ErrExist) {
		g.opts.Logger.Error(err, "cannot link the device node in /dev/char; containers may lose it when systemd reloads their device rules", "link", link, "target", target)
	}
}

func appendOnce(list []string, s string) []string {
	if slices.Contains(list, s) {
		return list
	}
	return append(list, s)
}

// requireNodes fails with [ErrMissingDeviceNode] where edits do not list
// all the device nodes (their paths in the container), saying why where
// ensureNodes found them missing.
func (g *NVCDI) requireNodes(edits cdispec.ContainerEdits, nodes []deviceNode, devs devRoots, missing missingNodes) error {
	var absent []string
	uvm := false
	for _, n := range nodes {
		if slices.ContainsFunc(edits.DeviceNodes, func(d *cdispec.DeviceNode) bool { return d.Path == n.path }) {
			continue
		}
		absent = append(absent, n.path)
		uvm = uvm || n.module.names[0] == uvmModule.names[0]
	}
	if len(absent) == 0 {
		return nil
	}
	msg := fmt.Sprintf("%s, looked up in %s in the agent's container (%s on the node)",
		strings.Join(absent, " and "), filepath.Join(devs.path, "dev"), filepath.Join(devs.hostPath, "dev"))
	if slices.ContainsFunc(absent, missing.has) && missing.why != "" {
		msg += ": " + missing.why
	}
	if uvm {
		msg += "; CUDA cannot start in a container without the nvidia-uvm device nodes (--uvm=optional prepares GPUs without them)"
	}
	return fmt.Errorf("%w: %s", ErrMissingDeviceNode, msg)
}
