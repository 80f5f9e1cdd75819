package cdi

import (
	"errors"
	"fmt"
	"path/filepath"
	"sync"

	nvdevice "github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/nvidia-container-toolkit/pkg/nvcdi"
	"github.com/NVIDIA/nvidia-container-toolkit/pkg/nvcdi/transform"
	transformroot "github.com/NVIDIA/nvidia-container-toolkit/pkg/nvcdi/transform/root"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/agent/driverroot"
)

// DefaultHookPath is where the NVIDIA Container Toolkit installs
// nvidia-cdi-hook on a node; the GPU Operator puts it at
// /usr/local/nvidia/toolkit/nvidia-cdi-hook.
const DefaultHookPath = "/usr/bin/nvidia-cdi-hook"

// ErrMissingDeviceNode is returned (wrapped) by [NVCDI] when a device node
// that every container of a GPU needs is not in the device root: the GPU's
// own /dev/nvidia<minor>, /dev/nvidiactl, or (see [UVMPolicy]) those of
// nvidia-uvm. nvcdi lists only the device nodes that exist, and a spec
// without these would start the container without its GPU, or without
// CUDA.
var ErrMissingDeviceNode = errors.New("device node missing")

// NVCDIOptions configure [NewNVCDI].
type NVCDIOptions struct {
	// Root is the driver root. Required unless LoadedRoot is set.
	Root driverroot.Root
	// LoadedRoot, where set, returns the driver root in place of Root:
	// the root whose NVML library NVML returns, where that is chosen
	// when the library is loaded (driverroot.Selector.Loaded).
	// Generation fails while it returns false. It is called on every
	// generation.
	LoadedRoot func() (driverroot.Root, bool)
	// NVML returns the NVML library (initialized or not); nvcdi queries it
	// for the driver version and the GPUs. Required. It is called on
	// every generation, so a library loaded after start is picked up.
	NVML func() nvml.Interface
	// HookPath is nvidia-cdi-hook as the node sees it (DefaultHookPath).
	HookPath string
	// ContainerHookPath is HookPath as the agent sees it. Where set,
	// edits that run HookPath fail with [ErrHookMissing] while it is not
	// an executable file (see [NVCDI.CheckHook]); checked on every
	// generation. Empty: not checked.
	ContainerHookPath string
	// DisabledHooks are left out of the specs (see [ParseDisabledHooks]),
	// for an nvidia-cdi-hook older than some of the [Hooks].
	DisabledHooks []nvcdi.HookName
	// CreateDeviceNodes creates the driver's device nodes that the
	// containers of a GPU need (/dev/nvidiactl, the GPU's
	// /dev/nvidia<minor>, /dev/nvidia-uvm and /dev/nvidia-uvm-tools) where
	// they are missing in a device root mounted from the node (not the
	// agent's own "/") and their kernel module is loaded, as
	// nvidia-modprobe does, so that the specs list them.
	CreateDeviceNodes bool
	// UVM says whether the common edits require the nvidia-uvm device
	// nodes (see [UVMPolicy]); empty: [UVMOptional].
	UVM UVMPolicy
	// ProcDevices is the file in the format of /proc/devices that tells
	// whether the driver's kernel modules are loaded, and their major
	// numbers; default [DefaultProcDevices].
	ProcDevices string
	// DriverParams is the file in the format of /proc/driver/nvidia/params
	// whose DeviceFileUID, DeviceFileGID, DeviceFileMode and
	// ModifyDeviceFiles say how the nvidia module's device nodes are to be
	// made; default [DefaultDriverParams].
	DriverParams string
	// Logger receives nvcdi's messages; default: klog's background logger.
	Logger klog.Logger
}

// NVCDI is the [Generator] for real GPUs, built on NVIDIA's nvcdi library in
// "nvml" mode: the same spec content as NVIDIA's own DRA driver and the
// NVIDIA Container Toolkit produce for a whole GPU, including
// NVIDIA_VISIBLE_DEVICES=void in the common edits. Paths in the edits are
// rewritten from the agent's mounts of the driver and device roots to the
// node's. Missing device nodes are created first where
// NVCDIOptions.CreateDeviceNodes allows; edits that still lack
// /dev/nvidiactl (common edits), the nvidia-uvm device nodes (common
// edits, with [UVMRequire]) or the GPU's /dev/nvidia<minor> (device edits)
// are refused with [ErrMissingDeviceNode], edits with hooks while nvidia-cdi-hook is
// missing with [ErrHookMissing].
type NVCDI struct {
	opts NVCDIOptions

	mutex sync.Mutex
	lib   nvml.Interface
	nvcdi nvcdi.Interface
	// devs is the driver root and device root nvcdi was set up with,
	// which toHost rewrites.
	devs devRoots
}

// devRoots is a driver root and the device root that goes with it: the
// driver root's /dev once it holds the device nodes, the node's /dev
// before; the device root as the agent and as the node see it.
type devRoots struct {
	root           driverroot.Root
	path, hostPath string
}

var _ Generator = &NVCDI{}

// NewNVCDI checks the options; nvcdi itself is set up on first use, when
// NVML is available.
func NewNVCDI(opts NVCDIOptions) (*NVCDI, error) {
	if opts.NVML == nil {
		return nil, errors.New("NVML must be set")
	}
	if opts.LoadedRoot == nil && (opts.Root.Path == "" || opts.Root.HostPath == "") {
		return nil, errors.New("driver root must be set")
	}
	if opts.HookPath == "" {
		opts.HookPath = DefaultHookPath
	}
	if opts.ContainerHookPath != "" && !filepath.IsAbs(opts.ContainerHookPath) {
		return nil, fmt.Errorf("container hook path must be absolute, got %q", opts.ContainerHookPath)
	}
	names := make([]string, 0, len(opts.DisabledHooks))
	for _, h := range opts.DisabledHooks {
		names = append(names, string(h))
	}
	if _, err := ParseDisabledHooks(names); err != nil {
		return nil, err
	}
	if opts.UVM == "" {
		opts.UVM = UVMOptional
	}
	if _, err := ParseUVMPolicy(string(opts.UVM)); err != nil {
		return nil, err
	}
	if opts.ProcDevices == "" {
		opts.ProcDevices = DefaultProcDevices
	}
	if opts.DriverParams == "" {
		opts.DriverParams = DefaultDriverParams
	}
	if opts.Logger.GetSink() == nil {
		opts.Logger = klog.Background()
	}
	return &NVCDI{opts: opts}, nil
}

// UVM returns the nvidia-uvm policy in effect.
func (g *NVCDI) UVM() UVMPolicy { return g.opts.UVM }

// CreatesDeviceNodes reports whether it creates missing device nodes.
func (g *NVCDI) CreatesDeviceNodes() bool { return g.opts.CreateDeviceNodes }

// get returns nvcdi, set up for the NVML library loaded now and for the
// device root as the driver root's /dev says now (set up again where
// either changed), and that device root.
func (g *NVCDI) get() (nvcdi.Interface, devRoots, error) {
	lib := g.opts.NVML()
	if lib == nil {
		return nil, devRoots{}, errors.New("NVML is not loaded")
	}
	root := g.opts.Root
	if g.opts.LoadedRoot != nil {
		var ok bool
		if root, ok = g.opts.LoadedRoot(); !ok {
			return nil, devRoots{}, errors.New("no driver root chosen: NVML is not loaded")
		}
	}
	devs := devRoots{root: root}
	devs.path, devs.hostPath = root.DevRoots()
	g.mutex.Lock()
	defer g.mutex.Unlock()
	if g.nvcdi != nil && g.lib == lib && g.devs == devs {
		return g.nvcdi, devs, nil
	}
	l, err := nvcdi.New(
		nvcdi.WithMode(nvcdi.ModeNvml),
		nvcdi.WithNvmlLib(lib),
		nvcdi.WithDeviceLib(nvdevice.New(lib)),
		nvcdi.WithDriverRoot(root.Path),
		nvcdi.WithDevRoot(devs.path),
		nvcdi.WithVendor(Vendor),
		nvcdi.WithClass(Class),
		nvcdi.WithNVIDIACDIHookPath(g.opts.HookPath),
		nvcdi.WithDisabledHooks(g.opts.DisabledHooks...),
		nvcdi.WithFeatureFlags(nvcdi.FeatureDisableNvsandboxUtils),
		nvcdi.WithLogger(nvcdiLogger{g.opts.Logger}),
	)
	if err != nil {
		return nil, devRoots{}, fmt.Errorf("set up nvcdi: %w", err)
	}
	g.lib, g.nvcdi, g.devs = lib, l, devs
	return l, devs, nil
}

// toHost rewrites the agent-side paths of edits, which nvcdi found below
// the driver root and the device root devs, to the node's.
func (g *NVCDI) toHost(edits cdispec.ContainerEdits, devs devRoots) (cdispec.ContainerEdits, error) {
	root := devs.root
	spec := &cdispec.Spec{ContainerEdits: edits}
	devPath, devHostPath := devs.path, devs.hostPath
	t := transformroot.NewDriverTransformer(
		transformroot.WithDriverRoot(root.Path),
		transformroot.WithTargetDriverRoot(root.HostPath),
		transformroot.WithDevRoot(devPath),
		transformroot.WithTargetDevRoot(devHostPath),
	)
	if devPath != root.Path && devHostPath == root.HostPath {
		// The driver transformer rewrites the device root only where
		// the node's device and driver roots differ; here they are one
		// directory on the node (the host's "/"), mounted apart in the
		// agent's container.
		t = transform.Merge(transformroot.New(
			transformroot.WithRoot(filepath.Join(devPath, "dev")),
			transformroot.WithTargetRoot(filepath.Join(devHostPath, "dev")),
		), t)
	}
	if devPath != "/" {
		// Paths in the container that nvcdi took from where it found
		// them below the agent's device root: the links that the
		// create-symlinks hook makes for the GPU's DRM devices
		// (/dev/dri/by-path/...) belong in the container's /dev.
		t = transform.Merge(t, transformroot.New(
			transformroot.WithRoot(filepath.Join(devPath, "dev")),
			transformroot.WithTargetRoot("/dev"),
			transformroot.WithRelativeTo("container"),
		))
	}
	if err := t.Transform(spec); err != nil {
		return cdispec.ContainerEdits{}, fmt.Errorf("rewrite driver root %s to %s: %w", root.Path, root.HostPath, err)
	}
	return spec.ContainerEdits, nil
}

// requireHook fails with [ErrHookMissing] where edits run nvidia-cdi-hook
// and CheckHook finds it missing.
func (g *NVCDI) requireHook(edits cdispec.ContainerEdits) error {
	if !runsHook(edits, g.opts.HookPath) {
		return nil
	}
	return g.CheckHook()
}

// CommonEdits implements [Generator].
func (g *NVCDI) CommonEdits() (cdispec.ContainerEdits, error) {
	l, devs, err := g.get()
	if err != nil {
		return cdispec.ContainerEdits{}, err
	}
	nodes := []deviceNode{controlNode}
	if g.opts.CreateDeviceNodes || g.opts.UVM == UVMRequire {
		nodes = append(nodes, uvmNodes...)
	}
	missing, err := g.ensureNodes(devs, nodes)
	if err != nil {
		return cdispec.ContainerEdits{}, err
	}
	edits, err := l.GetCommonEdits()
	if err != nil {
		return cdispec.ContainerEdits{}, err
	}
	var common cdispec.ContainerEdits
	if edits != nil && edits.ContainerEdits != nil {
		if common, err = g.toHost(*edits.ContainerEdits, devs); err != nil {
			return cdispec.ContainerEdits{}, err
		}
	}
	required := []deviceNode{controlNode}
	if g.opts.UVM == UVMRequire {
		required = append(required, uvmNodes...)
	}
	if err := g.requireNodes(common, required, devs, missing); err != nil {
		return cdispec.ContainerEdits{}, err
	}
	if err := g.requireHook(common); err != nil {
		return cdispec.ContainerEdits{}, err
	}
	return common, nil
}

// DeviceEdits implements [Generator].
func (g *NVCDI) DeviceEdits(d Device) (cdispec.ContainerEdits, error) {
	l, devs, err := g.get()
	if err != nil {
		return cdispec.ContainerEdits{}, err
	}
	node := gpuNode(d.Minor)
	missing, err := g.ensureNodes(devs, []deviceNode{node})
	if err != nil {
		return cdispec.ContainerEdits{}, err
	}
	specs, err := l.GetDeviceSpecsByID(d.UUID)
	if err != nil {
		return cdispec.ContainerEdits{}, err
	}
	if len(specs) == 0 {
		return cdispec.ContainerEdits{}, fmt.Errorf("nvcdi returned no device for %s", d.UUID)
	}
	edits, err := g.toHost(specs[0].ContainerEdits, devs)
	if err != nil {
		return cdispec.ContainerEdits{}, err
	}
	if err := g.requireNodes(edits, []deviceNode{node}, devs, missing); err != nil {
		return cdispec.ContainerEdits{}, err
	}
	if err := g.requireHook(edits); err != nil {
		return cdispec.ContainerEdits{}, err
	}
	return edits, nil
}

// nvcdiLogger adapts a klog.Logger to nvcdi's printf-style logger:
// warnings and errors at V(2), the rest at V(5) and up.
type nvcdiLogger struct{ logger klog.Logger }

func (l nvcdiLogger) Errorf(format string, args ...any) {
	l.logger.V(2).Info(fmt.Sprintf(format, args...), "source", "nvcdi", "level", "error")
}
func (l nvcdiLogger) Warningf(format string, args ...any) {
	l.logger.V(2).Info(fmt.Sprintf(format, args...), "source", "nvcdi", "level", "warning")
}
func (l nvcdiLogger) Infof(format string, args ...any) {
	l.logger.V(5).Info(fmt.Sprintf(format, args...), "source", "nvcdi")
}
func (l nvcdiLogger) Debugf(format string, args ...any) {
	l.logger.V(6).Info(fmt.Sprintf(format, args...), "source", "nvcdi")
}
func (l nvcdiLogger) Tracef(format string, args ...any) {
	l.logger.V(7).Info(fmt.Sprintf(format, args...), "source", "nvcdi")
}
