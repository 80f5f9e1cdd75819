package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"

	"github.com/pelletier/go-toml/v2"
	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// ReasonVisibleDevicesEnvAccepted (Warning, at start): the NVIDIA
// Container Toolkit's configuration on the node (Options.ToolkitConfig)
// lets unprivileged containers name GPUs in NVIDIA_VISIBLE_DEVICES, so a
// pod that sets it gets GPUs without a claim, other pods' GPUs included,
// wherever nvidia-container-runtime runs its containers.
const ReasonVisibleDevicesEnvAccepted = "TopodraVisibleDevicesEnvAccepted"

// VisibleDevicesEnvKey is the toolkit's setting that lets unprivileged
// containers choose their GPUs through NVIDIA_VISIBLE_DEVICES; the toolkit
// takes it as true where its configuration leaves it out.
const VisibleDevicesEnvKey = "accept-nvidia-visible-devices-envvar-when-unprivileged"

// visibleDevicesEnvAccepted reads the toolkit configuration at path and
// reports whether it lets unprivileged containers choose their GPUs
// through NVIDIA_VISIBLE_DEVICES. A missing file is fs.ErrNotExist.
func visibleDevicesEnvAccepted(path string) (bool, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return false, err
	}
	var config map[string]any
	if err := toml.Unmarshal(data, &config); err != nil {
		return false, fmt.Errorf("parse %s: %w", path, err)
	}
	value, ok := config[VisibleDevicesEnvKey]
	if !ok {
		return true, nil
	}
	accepted, ok := value.(bool)
	if !ok {
		return false, fmt.Errorf("%s: %s is %v, not a boolean", path, VisibleDevicesEnvKey, value)
	}
	return accepted, nil
}

// checkToolkitConfig reports at start, in the log and as a Warning event
// on the Node (ReasonVisibleDevicesEnvAccepted), a toolkit configuration
// that lets unprivileged containers choose their GPUs through
// NVIDIA_VISIBLE_DEVICES: topodra's CDI specs do not need it, and it lets
// any pod reach GPUs that claims hold. A missing file says nothing (the
// node may have no toolkit; one installed without its configuration takes
// the setting as true, which this does not see); an unreadable one is
// logged.
func (a *Agent) checkToolkitConfig(ctx context.Context) {
	path := a.opts.ToolkitConfig
	if path == "" {
		return
	}
	logger := klog.FromContext(ctx)
	accepted, err := visibleDevicesEnvAccepted(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		logger.V(2).Info("No NVIDIA Container Toolkit configuration, not checked", "path", path)
	case err != nil:
		logger.Error(err, "Cannot check the NVIDIA Container Toolkit configuration", "path", path)
	case accepted:
		logger.Info("The NVIDIA Container Toolkit lets unprivileged containers choose their GPUs through NVIDIA_VISIBLE_DEVICES", "path", path, "setting", VisibleDevicesEnvKey)
		a.nodeEvent(v1.EventTypeWarning, ReasonVisibleDevicesEnvAccepted, "Prepare",
			"the NVIDIA Container Toolkit on this node (%s) leaves %s true: where nvidia-container-runtime runs a container, a pod that sets NVIDIA_VISIBLE_DEVICES=all gets every GPU, those that %s claims hold included; set it to false (GPU Operator: toolkit env ACCEPT_NVIDIA_VISIBLE_DEVICES_ENVVAR_WHEN_UNPRIVILEGED=false); %s's pods get their GPUs through CDI and do not need it",
			path, VisibleDevicesEnvKey, a.opts.DriverName, a.opts.DriverName)
	default:
		logger.V(2).Info("The NVIDIA Container Toolkit does not let unprivileged containers choose their GPUs", "path", path)
	}
}
