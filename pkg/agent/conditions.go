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

// ResetRequiredTaintKey is the NoSchedule device taint of a GPU that
// needs a GPU reset to apply a repair of its memory
// (discovery.GPU.ResetRequired), with the repair as value
// (discovery.RowRemapPending, discovery.PageRetirementPending): until the
// reset the faulty memory stays in use, so neither scheduler allocates it
// until a rescan finds the repair applied
// (topology.ResetRequiredTaintKey).
const ResetRequiredTaintKey = topology.ResetRequiredTaintKey

// ComputeProhibitedTaintKey is the NoSchedule device taint of a GPU whose
// compute mode is Prohibited (discovery.GPU.ComputeProhibited): no CUDA
// context can be created on it, so neither scheduler allocates it until a
// rescan finds another compute mode (topology.ComputeProhibitedTaintKey).
const ComputeProhibitedTaintKey = topology.ComputeProhibitedTaintKey

// Event reasons on the Node about the conditions that discovery reads of
// each GPU. Each Warning is recorded once per distinct set of GPUs and
// states, names the GPUs in its FieldPath and note, and says what to do;
// the Normal event follows once no GPU has the condition any more.
const (
	// ReasonGPUResetRequired (Warning): GPUs need a reset to apply a
	// repair of their memory; they carry ResetRequiredTaintKey.
	ReasonGPUResetRequired = "TopodraGPUResetRequired"
	// ReasonGPUResetDone (Normal): no GPU needs a reset any more.
	ReasonGPUResetDone = "TopodraGPUResetDone"
	// ReasonRowRemapFailed (Warning): NVML reports that a row of the
	// memory of GPUs could not be remapped; they carry HealthTaintKey
	// with the value discovery.RowRemapFailure.
	ReasonRowRemapFailed = "TopodraRowRemapFailed"
	// ReasonRowRemapFailureGone (Normal): no GPU reports a row remapping
	// failure any more.
	ReasonRowRemapFailureGone = "TopodraRowRemapFailureGone"
	// ReasonComputeProhibited (Warning): the compute mode of GPUs is
	// Prohibited; they carry ComputeProhibitedTaintKey.
	ReasonComputeProhibited = "TopodraComputeProhibited"
	// ReasonComputeAllowed (Normal): no GPU's compute mode is Prohibited
	// any more.
	ReasonComputeAllowed = "TopodraComputeAllowed"
)

// resetTaint is the taint of a GPU that needs a reset, nil for another.
func resetTaint(gpu *discovery.GPU) *resourceapi.DeviceTaint {
	if gpu == nil || gpu.ResetRequired == "" {
		return nil
	}
	return &resourceapi.DeviceTaint{
		Key:    ResetRequiredTaintKey,
		Value:  gpu.ResetRequired,
		Effect: resourceapi.DeviceTaintEffectNoSchedule,
	}
}

// computeTaint is the taint of a GPU whose compute mode is Prohibited, nil
// for another.
func computeTaint(gpu *discovery.GPU) *resourceapi.DeviceTaint {
	if gpu == nil || !gpu.ComputeProhibited {
		return nil
	}
	return &resourceapi.DeviceTaint{
		Key:    ComputeProhibitedTaintKey,
		Effect: resourceapi.DeviceTaintEffectNoSchedule,
	}
}

// rowRemapFault is the fault that BuildResources and the kubelet's health
// report give a GPU whose row remapping failed, where it has no fault of
// its own (see Agent.faults): it lasts while discovery reads it, not until
// the node reboots, and is not kept in the checkpoint.
var rowRemapFault = discovery.HealthEvent{
	Reason:  discovery.RowRemapFailure,
	Message: "a row of the GPU's memory could not be remapped (NVML row remapping failure): the GPU must be repaired or replaced",
}

// rowRemapFailed returns the UUIDs of inv's GPUs whose row remapping
// failed, in inventory order.
func rowRemapFailed(inv *discovery.Inventory) []string {
	var uuids []string
	for _, g := range inv.GPUs {
		if g.RowRemapFailed {
			uuids = append(uuids, g.UUID)
		}
	}
	return uuids
}

// whenSet describes a GPU by text where set says it has the condition,
// by "" otherwise (gpuCondition.of).
func whenSet(set func(*discovery.GPU) bool, text string) func(*discovery.GPU) string {
	return func(g *discovery.GPU) string {
		if !set(g) {
			return ""
		}
		return text
	}
}

// resetText says, for humans, what a GPU that needs a reset waits for.
func resetText(g *discovery.GPU) string {
	switch g.ResetRequired {
	case "":
		return ""
	case discovery.RowRemapPending:
		return "remapped rows of its memory are pending a GPU reset"
	case discovery.PageRetirementPending:
		return "retired pages of its memory are pending a GPU reset"
	}
	return g.ResetRequired
}

// gpuCondition is a condition that discovery reads of each GPU at every
// scan and that keeps the GPU from taking work while it lasts: the GPUs
// that have it carry taint, and recordCondition reports them on the Node.
type gpuCondition struct {
	// last identifies the GPUs that had the condition at the last report
	// (a field of the agent that a.mutex guards), "" for none.
	last *string
	// of says, for humans, what g has ("fabric registration not
	// started"): "" for nothing, a different text for each state.
	of func(g *discovery.GPU) string
	// taint is the key of the taint that the GPUs carry.
	taint string
	// warning and normal are the reasons of the events (see
	// recordCondition); logSet and logCleared the log messages.
	warning, normal    string
	logSet, logCleared string
	// note is the Warning's note, given how many GPUs have the
	// condition and what each has; cleared is the Normal event's note.
	note    func(n int, gpus string) string
	cleared string
}

// gpuConditions are the conditions that recordDiscovery reports.
func (a *Agent) gpuConditions() []gpuCondition {
	driver := a.opts.DriverName
	return []gpuCondition{
		a.fabricCondition(),
		{
			last:       &a.resetRequired,
			of:         resetText,
			taint:      ResetRequiredTaintKey,
			warning:    ReasonGPUResetRequired,
			normal:     ReasonGPUResetDone,
			logSet:     "GPUs that need a reset to apply a repair of their memory, tainting them",
			logCleared: "No GPU needs a reset any more, removing the taint",
			note: func(n int, gpus string) string {
				return fmt.Sprintf("%d GPUs must be reset to apply a repair of their memory, and until then use the faulty memory: %s; %s publishes them tainted %s (NoSchedule) until a rescan finds the repair applied; drain each GPU and reset it (nvidia-smi -r -i <index>) or reboot the node, then check nvidia-smi -q -d ROW_REMAPPER,PAGE_RETIREMENT",
					n, gpus, driver, ResetRequiredTaintKey)
			},
			cleared: fmt.Sprintf("no GPU needs a reset to apply a repair of its memory: %s devices are no longer tainted %s", driver, ResetRequiredTaintKey),
		},
		{
			last:       &a.rowRemapFailed,
			of:         whenSet(func(g *discovery.GPU) bool { return g.RowRemapFailed }, "row remapping failed"),
			taint:      HealthTaintKey,
			warning:    ReasonRowRemapFailed,
			normal:     ReasonRowRemapFailureGone,
			logSet:     "GPUs whose row remapping failed, tainting them unhealthy",
			logCleared: "No GPU reports a row remapping failure any more, removing the taint",
			note: func(n int, gpus string) string {
				return fmt.Sprintf("a row of the memory of %d GPUs could not be remapped, so they should not take work: %s; %s publishes them tainted %s=%s and reports them unhealthy to the kubelet while NVML reports the failure (the Node annotation %s does not clear it); a GPU with a row remapping failure must be repaired or replaced (nvidia-smi -q -d ROW_REMAPPER)",
					n, gpus, driver, HealthTaintKey, discovery.RowRemapFailure, ClearFaultsAnnotation)
			},
			cleared: fmt.Sprintf("no GPU reports a row remapping failure: %s devices are no longer tainted %s=%s", driver, HealthTaintKey, discovery.RowRemapFailure),
		},
		{
			last:       &a.computeProhibited,
			of:         whenSet(func(g *discovery.GPU) bool { return g.ComputeProhibited }, "compute mode Prohibited"),
			taint:      ComputeProhibitedTaintKey,
			warning:    ReasonComputeProhibited,
			normal:     ReasonComputeAllowed,
			logSet:     "GPUs whose compute mode is Prohibited, tainting them",
			logCleared: "No GPU's compute mode is Prohibited any more, removing the taint",
			note: func(n int, gpus string) string {
				return fmt.Sprintf("the compute mode of %d GPUs is Prohibited, so CUDA cannot start on them: %s; %s publishes them tainted %s (NoSchedule) until a rescan finds another compute mode; set it back with nvidia-smi -i <index> -c DEFAULT (and look for what set it: a node setup script, nvidia-persistenced's settings)",
					n, gpus, driver, ComputeProhibitedTaintKey)
			},
			cleared: fmt.Sprintf("no GPU's compute mode is Prohibited: %s devices are no longer tainted %s", driver, ComputeProhibitedTaintKey),
		},
	}
}

// recordConditions reports the gpuConditions of the GPUs of a successful
// discovery (see recordCondition).
func (a *Agent) recordConditions(ctx context.Context, inv *discovery.Inventory) {
	for _, c := range a.gpuConditions() {
		a.recordCondition(ctx, inv, c)
	}
}

// recordCondition reports the GPUs of inv that have c, when they or what
// they have differ from the last report: a c.warning Warning on the Node
// naming them, or a c.normal Normal event once there are none after
// some.
func (a *Agent) recordCondition(ctx context.Context, inv *discovery.Inventory, c gpuCondition) {
	var names, descs, keys []string
	for i := range inv.GPUs {
		g := &inv.GPUs[i]
		what := c.of(g)
		if what == "" {
			continue
		}
		names = append(names, g.Name)
		descs = append(descs, fmt.Sprintf("%s (UUID %s, PCI bus id %s): %s", g.Name, g.UUID, orUnknown(g.PCIBusID), what))
		keys = append(keys, g.UUID+"/"+what)
	}
	slices.Sort(keys)
	key := strings.Join(keys, "\n")
	if a.swap(c.last, key) == key {
		return
	}
	logger := klog.FromContext(ctx)
	if len(names) == 0 {
		logger.Info(c.logCleared, "taint", c.taint)
		a.nodeEvent(v1.EventTypeNormal, c.normal, "Discover", "%s", c.cleared)
		return
	}
	logger.Info(c.logSet, "devices", descs, "taint", c.taint)
	a.devicesNodeEvent(names, v1.EventTypeWarning, c.warning, "Discover", "%s", c.note(len(names), strings.Join(descs, "; ")))
}
