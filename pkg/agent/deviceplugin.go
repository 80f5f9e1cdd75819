package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/topology"
)

// DevicePluginTaintKey is the NoSchedule device taint on every device while
// the Node advertises GPUs of a device plugin (see
// Options.DevicePluginResources): neither scheduler allocates them then
// (topology.DevicePluginTaintKey).
const DevicePluginTaintKey = topology.DevicePluginTaintKey

// DefaultDevicePluginResources are the node agent command's default for
// Options.DevicePluginResources: the extended resources of NVIDIA's device
// plugin, whole GPUs (also shared by time-slicing or MPS under a renamed
// resource, nvidia.com/gpu.shared) and MIG devices of the mixed strategy.
var DefaultDevicePluginResources = []string{"nvidia.com/gpu*", "nvidia.com/mig-*"}

// Event reasons on the Node about a device plugin.
const (
	// ReasonDevicePlugin (Warning): the Node advertises GPUs of a device
	// plugin; the agent's devices are tainted DevicePluginTaintKey.
	ReasonDevicePlugin = "TopodraDevicePluginConflict"
	// ReasonDevicePluginGone (Normal): the Node no longer advertises them;
	// the taint is gone.
	ReasonDevicePluginGone = "TopodraDevicePluginGone"
)

// devicePluginResources names the resources in the Node's allocatable that
// match patterns (a name, or a prefix ending in "*") with a quantity above
// zero, as "name=quantity", sorted.
func devicePluginResources(node *v1.Node, patterns []string) []string {
	var out []string
	for name, q := range node.Status.Allocatable {
		if q.Sign() <= 0 {
			continue
		}
		for _, p := range patterns {
			prefix, wildcard := strings.CutSuffix(p, "*")
			if string(name) == p || wildcard && strings.HasPrefix(string(name), prefix) {
				out = append(out, fmt.Sprintf("%s=%s", name, q.String()))
				break
			}
		}
	}
	slices.Sort(out)
	return out
}

// CheckNode reads the Node and acts on what changed since the last read.
// The agent calls it at start, every Options.NodeCheck and when the
// kubelet registers the plugin again (a restarted kubelet; one restarts to
// register a Node that was deleted):
//
//   - Where the Node was deleted and created again (another UID), the
//     published slices, owned by the old Node, are being (or will be)
//     deleted by the garbage collector, and a controller that still names
//     the old Node as owner would create them again only to see them
//     deleted; the agent publishes under the new Node from then on and
//     deletes its slices owned by the old one (see followNode).
//   - While its allocatable has GPUs of a device plugin
//     (Options.DevicePluginResources), every device is tainted
//     DevicePluginTaintKey: the kubelet hands those out to pods that ask
//     for the extended resource, the same GPUs that this agent publishes,
//     so a pod of either kind could get a GPU the other holds. A change is
//     reported on the Node (ReasonDevicePlugin, ReasonDevicePluginGone)
//     and republished. Claims already prepared are left alone; new ones
//     are refused (ErrDevicePluginConflict), as while the Node could not
//     be read yet.
//   - GPU faults that its ClearFaultsAnnotation clears are forgotten and
//     their health taints removed (clearFaults publishes).
//
// An error reading the Node keeps the last answers.
func (a *Agent) CheckNode(ctx context.Context) error {
	node, err := a.readNode(ctx)
	if err != nil {
		return err
	}
	ownerErr := a.followNode(ctx, node)
	pluginChanged := len(a.opts.DevicePluginResources) > 0 && a.setDevicePlugin(ctx, devicePlugin(node, a.opts.DevicePluginResources))
	// After the device plugin check, as at start: a clear publishes.
	a.clearFaults(ctx, node)
	if !pluginChanged {
		return ownerErr
	}
	return errors.Join(ownerErr, a.publish(ctx))
}

// checkNodeSoon makes the node loop check the Node now rather than at its
// next interval.
func (a *Agent) checkNodeSoon() {
	select {
	case a.nodeCheckNow <- struct{}{}:
	default: // a check is asked for already
	}
}

// readNode reads the agent's Node.
func (a *Agent) readNode(ctx context.Context) (*v1.Node, error) {
	node, err := a.opts.KubeClient.CoreV1().Nodes().Get(ctx, a.opts.NodeName, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("read node %s: %w", a.opts.NodeName, err)
	}
	return node, nil
}

// devicePlugin lists the resources of patterns that node advertises
// ("name=quantity, ...", empty for none or a nil node).
func devicePlugin(node *v1.Node, patterns []string) string {
	if node == nil {
		return ""
	}
	return strings.Join(devicePluginResources(node, patterns), ", ")
}

// devicePluginUnknown is Agent.devicePlugin while the Node could not be
// read at start: the devices are tainted until it can.
const devicePluginUnknown = "unknown"

// setDevicePlugin records what readDevicePlugin found, reports a change
// in the log and on the Node, and says whether it changed.
func (a *Agent) setDevicePlugin(ctx context.Context, found string) bool {
	prev := a.swap(&a.devicePlugin, found)
	if found == prev {
		return false
	}
	logger := klog.FromContext(ctx)
	switch {
	case found == devicePluginUnknown:
		logger.Info("Not known whether the node advertises GPUs of a device plugin, tainting all devices", "taint", DevicePluginTaintKey)
	case found != "":
		logger.Info("The node advertises GPUs of a device plugin, tainting all devices", "resources", found, "taint", DevicePluginTaintKey)
		a.nodeEvent(v1.EventTypeWarning, ReasonDevicePlugin, "Publish",
			"the node advertises %s from a device plugin, which hands out the GPUs that %s publishes: all its devices are tainted %s (NoSchedule) until the node no longer does; disable the device plugin on this node (GPU Operator: devicePlugin.enabled=false)",
			found, a.opts.DriverName, DevicePluginTaintKey)
	case prev == devicePluginUnknown:
		logger.Info("The node advertises no GPUs of a device plugin, removing the taint", "taint", DevicePluginTaintKey)
	default:
		logger.Info("The node no longer advertises GPUs of a device plugin, removing the taint", "taint", DevicePluginTaintKey)
		a.nodeEvent(v1.EventTypeNormal, ReasonDevicePluginGone, "Publish", "the node no longer advertises GPUs of a device plugin: %s devices are no longer tainted %s", a.opts.DriverName, DevicePluginTaintKey)
	}
	return true
}

// devicePluginFound lists the device plugin's resources that the Node was
// last read to advertise: "" where it advertises none, devicePluginUnknown
// while it could not be read yet.
func (a *Agent) devicePluginFound() string {
	a.mutex.Lock()
	defer a.mutex.Unlock()
	return a.devicePlugin
}

// nodeLoop runs CheckNode every interval, and when checkNodeSoon asks.
func (a *Agent) nodeLoop(ctx context.Context, interval time.Duration) {
	for {
		timer := time.NewTimer(interval)
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C:
		case <-a.nodeCheckNow:
			timer.Stop()
		}
		if err := a.CheckNode(ctx); err != nil && ctx.Err() == nil {
			utilruntime.HandleErrorWithContext(ctx, err, "node check failed, keeping the last answer")
		}
	}
}
