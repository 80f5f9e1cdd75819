package agent

import (
	"fmt"

	resourceapi "k8s.io/api/resource/v1"

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

// fabricCondition is the gpuCondition of GPUs whose fabric is not ready.
func (a *Agent) fabricCondition() gpuCondition {
	driver := a.opts.DriverName
	return gpuCondition{
		last: &a.fabricNotReady,
		of: func(g *discovery.GPU) string {
			if g.Fabric == nil {
				return ""
			}
			return fabricText(g.Fabric)
		},
		taint:      FabricNotReadyTaintKey,
		warning:    ReasonFabricNotReady,
		normal:     ReasonFabricReady,
		logSet:     "GPUs whose NVLink fabric is not ready, tainting them",
		logCleared: "Every GPU's NVLink fabric is ready, removing the taint",
		note: func(n int, gpus string) string {
			return fmt.Sprintf("the NVLink fabric of %d GPUs is not ready, so CUDA cannot start on them (CUDA_ERROR_SYSTEM_NOT_READY): %s; %s publishes them tainted %s (NoSchedule) until a rescan finds the fabric ready; check the NVIDIA fabric manager on the node (systemctl status nvidia-fabricmanager, journalctl -u nvidia-fabricmanager) and the GPUs' fabric state (nvidia-smi -q | grep -A2 Fabric)",
				n, gpus, driver, FabricNotReadyTaintKey)
		},
		cleared: fmt.Sprintf("the NVLink fabric of every GPU is ready: %s devices are no longer tainted %s", driver, FabricNotReadyTaintKey),
	}
}
