package agent

import (
	"context"
	"fmt"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/topology"
)

// FabricNotReadyTaintKey is the NoSchedule device taint of a GPU whose
// NVLink fabric is not ready (discovery.GPU.Fabric), with the fabric's
// state as value: CUDA does not initialize on it, so neither scheduler
// allocates it until a rescan finds the fabric ready
// (topology.FabricNotReadyTaintKey).
const FabricNotReadyTaintKey = topology.FabricNotReadyTaintKey

// Event reasons on the Node about NVLink fabrics.
const (
	// ReasonFabricNotReady (Warning, once per distinct set): discovery
	// found GPUs whose NVLink fabric is not ready; the note names each
	// one and its state, and what to check on the node. The devices
	// named in the event's FieldPath carry FabricNotReadyTaintKey.
	ReasonFabricNotReady = "TopodraFabricNotReady"
	// ReasonFabricReady (Normal): every GPU's fabric is ready after a
	// ReasonFabricNotReady; the taints are gone.
	ReasonFabricReady = "TopodraFabricReady"
)

// fabricTaint is the taint of a GPU whose fabric is not ready, nil for
// another.
func fabricTaint(gpu *discovery.GPU) *resourceapi.DeviceTaint {
	if gpu == nil || gpu.Fabric == nil {
		return nil
	}
	return &resourceapi.DeviceTaint{
		Key:    FabricNotReadyTaintKey,
		Value:  gpu.Fabric.State,
		Effect: resourceapi.DeviceTaintEffectNoSchedule,
	}
}

// fabricText says, for humans, what a fabric state means.
func fabricText(f *discovery.FabricNotReady) string {
	switch f.State {
	case discovery.FabricNotStarted:
		return "fabric registration not started"
	case discovery.FabricInProgress:
		return "fabric registration in progress"
	case discovery.FabricFailed:
		return "fabric registration failed: " + f.Status
	}
	return "fabric " + f.State
}

// recordFabric reports the GPUs of a successful discovery whose fabric is
// not ready, when they or their states differ from those of the discovery
// before: a ReasonFabricNotReady Warning on the Node naming them, or a
// ReasonFabricReady Normal event once there are none after some.
func (a *Agent) recordFabric(ctx context.Context, inv *discovery.Inventory) {
	var names, descs, keys []string
	for _, g := range inv.GPUs {
		if g.Fabric == nil {
			continue
		}
		names = append(names, g.Name)
		descs = append(descs, fmt.Sprintf("%s (UUID %s, PCI bus id %s): %s", g.Name, g.UUID, orUnknown(g.PCIBusID), fabricText(g.Fabric)))
		keys = append(keys, g.UUID+"/"+g.Fabric.State+"/"+g.Fabric.Status)
	}
	slices.Sort(keys)
	key := strings.Join(keys, "\n")
	if a.swap(&a.fabricNotReady, key) == key {
		return
	}
	logger := klog.FromContext(ctx)
	if len(names) == 0 {
		logger.Info("Every GPU's NVLink fabric is ready, removing the taint", "taint", FabricNotReadyTaintKey)
		a.nodeEvent(v1.EventTypeNormal, ReasonFabricReady, "Discover", "the NVLink fabric of every GPU is ready: %s devices are no longer tainted %s", a.opts.DriverName, FabricNotReadyTaintKey)
		return
	}
	logger.Info("GPUs whose NVLink fabric is not ready, tainting them", "devices", descs, "taint", FabricNotReadyTaintKey)
	a.devicesNodeEvent(names, v1.EventTypeWarning, ReasonFabricNotReady, "Discover",
		"the NVLink fabric of %d GPUs is not ready, so CUDA cannot start on them (CUDA_ERROR_SYSTEM_NOT_READY): %s; %s publishes them tainted %s (NoSchedule) until a rescan finds the fabric ready; check the NVIDIA fabric manager on the node (systemctl status nvidia-fabricmanager, journalctl -u nvidia-fabricmanager) and the GPUs' fabric state (nvidia-smi -q | grep -A2 Fabric)",
		len(names), strings.Join(descs, "; "), a.opts.DriverName, FabricNotReadyTaintKey)
}
