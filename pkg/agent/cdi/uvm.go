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
)

// UVMPolicy says what [NVCDI] does about /dev/nvidia-uvm and
// /dev/nvidia-uvm-tools, the device nodes of the nvidia-uvm kernel module.
// CUDA cannot initialize without them (cuInit fails with error 999 or
// 100), and they do not exist until something creates them: nvidia-modprobe
// when CUDA first runs on the host, a udev rule, or the GPU Operator. nvcdi
// lists only the device nodes that exist, so on a node where CUDA runs only
// in containers a spec would start every container without them.
type UVMPolicy string

const (
	// UVMCreate creates the two device nodes in the device root where they
	// are missing and the nvidia-uvm module is loaded (its character
	// device number is in /proc/devices), as nvidia-modprobe does: mode
	// 0666, minor 0 and 1. Where the module is not loaded, or the device
	// root is the agent's own "/" (in a container, not the node's /dev),
	// it acts as UVMRequire.
	UVMCreate UVMPolicy = "create"
	// UVMRequire fails the common edits with [ErrMissingDeviceNode] while
	// either device node is missing, naming what to do on the node.
	UVMRequire UVMPolicy = "require"
	// UVMOptional lists them where they exist and leaves them out
	// otherwise (nvcdi's own behavior): a container that uses CUDA then
	// starts and fails in cuInit.
	UVMOptional UVMPolicy = "optional"
)

// UVMPolicies lists the valid policies, the default first.
var UVMPolicies = []UVMPolicy{UVMCreate, UVMRequire, UVMOptional}

// ParseUVMPolicy parses a policy name.
func ParseUVMPolicy(s string) (UVMPolicy, error) {
	for _, p := range UVMPolicies {
		if s == string(p) {
			return p, nil
		}
	}
	return "", fmt.Errorf("unknown nvidia-uvm policy %q; valid: create, require, optional", s)
}

// DefaultProcDevices is where Linux lists the registered device numbers.
const DefaultProcDevices = "/proc/devices"

// uvmModule is the nvidia-uvm module's name in /proc/devices.
const uvmModule = "nvidia-uvm"

// uvmNodes are the module's device nodes (below the device root) with
// their minor numbers.
var uvmNodes = []struct {
	path  string
	minor uint32
}{{"/dev/nvidia-uvm", 0}, {"/dev/nvidia-uvm-tools", 1}}

// characterMajor returns the major number that the file in the format of
// /proc/devices lists for the character device name; ok is false where
// it lists none (the module is not loaded).
func characterMajor(procDevices, name string) (major uint32, ok bool, err error) {
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
		if !found || strings.TrimSpace(device) != name {
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

// ensureUVM applies the UVM policy to the device root devs before nvcdi
// looks at it: with UVMCreate it creates the missing device nodes where it
// can. It returns the device nodes that are still missing, with why and
// what to do, for requireUVM to report; nothing with UVMOptional.
func (g *NVCDI) ensureUVM(devs devRoots) (missing []string, why string, err error) {
	if g.opts.UVM == UVMOptional {
		return nil, "", nil
	}
	for _, n := range uvmNodes {
		if _, err := os.Lstat(filepath.Join(devs.path, n.path)); err == nil {
			continue
		} else if !errors.Is(err, fs.ErrNotExist) {
			return nil, "", fmt.Errorf("look up %s: %w", filepath.Join(devs.path, n.path), err)
		}
		missing = append(missing, n.path)
	}
	if len(missing) == 0 {
		return nil, "", nil
	}
	major, loaded, err := characterMajor(g.opts.ProcDevices, uvmModule)
	if err != nil {
		return nil, "", fmt.Errorf("cannot tell whether the nvidia-uvm module is loaded: %w", err)
	}
	const load = "load it on the node (nvidia-modprobe -u -c=0, which also creates the device nodes, or modprobe nvidia-uvm)"
	switch {
	case !loaded:
		return missing, "the nvidia-uvm kernel module is not loaded (" + g.opts.ProcDevices + " lists no " + uvmModule + "); " + load + ", then the pod's next try gets them", nil
	case g.opts.UVM == UVMRequire:
		return missing, fmt.Sprintf("the nvidia-uvm module is loaded (major %d) but its device nodes were not created; run nvidia-modprobe -u -c=0 on the node, or start the agent with --uvm=create to have it create them", major), nil
	case devs.path == "/":
		return missing, fmt.Sprintf("the nvidia-uvm module is loaded (major %d), but the agent does not create device nodes in its own /dev, which is not the node's (mount the node's /dev and set --container-dev-root); run nvidia-modprobe -u -c=0 on the node", major), nil
	}
	var still []string
	var failed []error
	for _, n := range uvmNodes {
		if !slices.Contains(missing, n.path) {
			continue
		}
		p := filepath.Join(devs.path, n.path)
		err := unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(major, n.minor)))
		if err == nil || errors.Is(err, unix.EEXIST) {
			// Mknod applies the umask; nvidia-modprobe's mode is 0666.
			if err == nil {
				err = os.Chmod(p, 0o666)
			}
			if err == nil {
				g.opts.Logger.Info("created a device node of the nvidia-uvm module", "path", p, "major", major, "minor", n.minor)
				continue
			}
		}
		still = append(still, n.path)
		failed = append(failed, fmt.Errorf("create %s: %w", p, err))
	}
	if len(still) == 0 {
		return nil, "", nil
	}
	return still, fmt.Sprintf("the nvidia-uvm module is loaded (major %d), but creating its device nodes failed (%v); run nvidia-modprobe -u -c=0 on the node", major, errors.Join(failed...)), nil
}

// requireUVM fails with [ErrMissingDeviceNode] where ensureUVM left
// device nodes missing or edits do not list them.
func (g *NVCDI) requireUVM(edits cdispec.ContainerEdits, missing []string, why string, devs devRoots) error {
	if g.opts.UVM == UVMOptional {
		return nil
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: %s, looked up below %s in the agent's container (%s on the node): %s; CUDA cannot start in a container without them (--uvm=optional prepares GPUs without them)",
			ErrMissingDeviceNode, strings.Join(missing, " and "), devs.path, devs.hostPath, why)
	}
	for _, n := range uvmNodes {
		if err := g.requireNode(edits, n.path, devs); err != nil {
			return err
		}
	}
	return nil
}
