package cdi

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/NVIDIA/nvidia-container-toolkit/pkg/nvcdi"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/topodra/topodra/pkg/agent/driverroot"
)

// Hook names that nvcdi emits but does not export.
const (
	// ApplicationProfileHook restricts EGL/Vulkan GPU visibility to the
	// container's GPUs (createContainer hook of the common edits).
	ApplicationProfileHook nvcdi.HookName = "update-application-profile"
	// ApplyCUDAMemoryLimitsHook sets CUDA memory limits for the
	// container's cgroup (createRuntime hook of each GPU).
	ApplyCUDAMemoryLimitsHook nvcdi.HookName = "apply-cuda-memory-limits"
)

// Hook is an nvidia-cdi-hook subcommand that [NVCDI] specs run.
type Hook struct {
	Name nvcdi.HookName
	// Since is the first NVIDIA Container Toolkit release whose
	// nvidia-cdi-hook has the subcommand.
	Since string
}

// Hooks are the hooks that the nvcdi library built into the agent puts
// into specs for whole GPUs, in the order of Since. An nvidia-cdi-hook
// older than 1.18.0 that lacks one fails the creation of every container
// that gets a GPU; 1.18.0 and later skip a subcommand they lack, warning.
var Hooks = []Hook{
	// nvidia-cdi-hook itself first shipped with 1.16.0; before, the same
	// subcommands were "nvidia-ctk hook".
	{Name: nvcdi.CreateSymlinksHook, Since: "1.16.0"},
	{Name: nvcdi.UpdateLDCacheHook, Since: "1.16.0"},
	{Name: nvcdi.EnableCudaCompatHook, Since: "1.17.5"},
	{Name: nvcdi.DisableDeviceNodeModificationHook, Since: "1.17.8"},
	{Name: ApplicationProfileHook, Since: "1.20.0"},
	{Name: ApplyCUDAMemoryLimitsHook, Since: "1.20.1"},
}

// HookNames are the names that [ParseDisabledHooks] accepts: the [Hooks]
// and nvcdi.AllHooks.
func HookNames() []string {
	names := make([]string, 0, len(Hooks)+1)
	for _, h := range Hooks {
		names = append(names, string(h.Name))
	}
	return append(names, string(nvcdi.AllHooks))
}

// ParseDisabledHooks checks hook names to disable (surrounding spaces and
// empty names ignored) against [HookNames].
func ParseDisabledHooks(names []string) ([]nvcdi.HookName, error) {
	valid := HookNames()
	var hooks []nvcdi.HookName
	for _, name := range names {
		name = strings.TrimSpace(name)
		if name == "" {
			continue
		}
		if !slices.Contains(valid, name) {
			return nil, fmt.Errorf("unknown CDI hook %q; valid: %s", name, strings.Join(valid, ", "))
		}
		hooks = append(hooks, nvcdi.HookName(name))
	}
	return hooks, nil
}

// RequiredToolkit is the oldest NVIDIA Container Toolkit release whose
// nvidia-cdi-hook has every hook of [Hooks] that is not disabled, and the
// newest such hook; both are empty where all are disabled.
func RequiredToolkit(disabled []nvcdi.HookName) (version string, hook nvcdi.HookName) {
	if slices.Contains(disabled, nvcdi.AllHooks) {
		return "", ""
	}
	for _, h := range Hooks {
		if !slices.Contains(disabled, h.Name) {
			version, hook = h.Since, h.Name
		}
	}
	return version, hook
}

// ErrHookMissing is returned (wrapped) by [NVCDI] when the nvidia-cdi-hook
// that its specs' hooks run is not an executable file on the node.
var ErrHookMissing = errors.New("nvidia-cdi-hook missing")

// HookChecker is implemented by a [Generator] whose specs run a program
// on the node that may be missing.
type HookChecker interface {
	// CheckHook returns an error wrapping [ErrHookMissing] when the
	// program is missing or not executable, nil when it is there or
	// cannot be checked.
	CheckHook() error
}

var _ HookChecker = &NVCDI{}

// CheckHook implements [HookChecker]: it looks for HookPath at
// ContainerHookPath. Where ContainerHookPath ends with HookPath, the part
// before is taken as the node's root, and symbolic links are resolved
// inside it. Without ContainerHookPath, or with all hooks disabled, it
// checks nothing.
func (g *NVCDI) CheckHook() error {
	version, newest := RequiredToolkit(g.opts.DisabledHooks)
	path := g.opts.ContainerHookPath
	if path == "" || version == "" {
		return nil
	}
	info, err := g.statHook()
	switch {
	case err != nil:
	case !info.Mode().IsRegular():
		err = fmt.Errorf("not a regular file (%s)", info.Mode().Type())
	case info.Mode().Perm()&0o111 == 0:
		err = fmt.Errorf("not executable (mode %s)", info.Mode().Perm())
	}
	if err == nil {
		return nil
	}
	if errors.Is(err, fs.ErrNotExist) {
		err = errors.New("no such file")
	}
	return fmt.Errorf("%w: %s on the node (looked up as %s in the agent's container): %v. The CDI specs' hooks run it when a container with a GPU is created, which fails without it: "+
		"install the NVIDIA Container Toolkit %s or later on the node (%s needs it), "+
		"or set NVIDIA_CDI_HOOK_PATH (--nvidia-cdi-hook-path) to where nvidia-cdi-hook is, "+
		"or, for an older nvidia-cdi-hook, set DISABLED_CDI_HOOKS (--disabled-cdi-hooks) to the hooks it lacks (docs/agent.md, \"nvidia-cdi-hook\")",
		ErrHookMissing, g.opts.HookPath, path, err, version, newest)
}

// statHook stats the file that ContainerHookPath names, with symbolic
// links resolved inside the node's root where ContainerHookPath shows it.
func (g *NVCDI) statHook() (fs.FileInfo, error) {
	path, hostPath := filepath.Clean(g.opts.ContainerHookPath), filepath.Clean(g.opts.HookPath)
	if root, ok := strings.CutSuffix(path, hostPath); ok && filepath.IsAbs(hostPath) && (root == "" || filepath.IsAbs(root)) {
		r, err := driverroot.New("/", root)
		if err != nil {
			return nil, err
		}
		resolved, err := r.Resolve(hostPath)
		if err != nil {
			return nil, err
		}
		path = resolved
	}
	return os.Stat(path)
}

// runsHook says whether edits have a hook that runs path.
func runsHook(edits cdispec.ContainerEdits, path string) bool {
	return slices.ContainsFunc(edits.Hooks, func(h *cdispec.Hook) bool { return h != nil && h.Path == path })
}
