package agent_test

import (
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
)

// TestFabricNotReadyTaintsGPU: on an NVSwitch machine, a GPU whose NVLink
// fabric registration has not started (no fabric manager) is published
// with the NoSchedule taint FabricNotReadyTaintKey, its state as value,
// and the Node gets a Warning naming it and what to check; the other GPUs
// are untainted. Each rescan reads the state again: a change of state is
// reported again, and once the registration has completed the taint goes
// and a Normal event says so.
func TestFabricNotReadyTaintsGPU(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(10)
	e.recorder = recorder
	e.machine.SetFabric(2, nvml.GPU_FABRIC_STATE_NOT_STARTED, nvml.SUCCESS)
	// fabricTaints maps the devices with the fabric taint to its value.
	fabricTaints := func(a *agent.Agent) map[string]string {
		t.Helper()
		got := map[string]string{}
		for _, d := range a.Resources().Pools[nodeName].Slices[0].Devices {
			for _, taint := range d.Taints {
				if taint.Key == agent.FabricNotReadyTaintKey {
					if taint.Effect != resourceapi.DeviceTaintEffectNoSchedule {
						t.Errorf("%s: taint %s has effect %s, want NoSchedule", d.Name, taint.Key, taint.Effect)
					}
					got[d.Name] = taint.Value
				}
			}
		}
		return got
	}
	rescan := func(a *agent.Agent) {
		t.Helper()
		if err := a.Rescan(ctx); err != nil {
			t.Fatal(err)
		}
	}

	a := e.start(ctx, t)
	if got := fabricTaints(a); len(got) != 1 || got["gpu-2"] != "not-started" {
		t.Errorf("fabric taints %v, want gpu-2=not-started only", got)
	}
	ev := expectEvent(t, recorder)
	for _, want := range []string{"Warning " + agent.ReasonFabricNotReady, "gpu-2", e.machine.UUID(2), "not started", "systemctl status nvidia-fabricmanager", "nvidia-smi -q | grep -A2 Fabric"} {
		if !strings.Contains(ev, want) {
			t.Errorf("event %q does not say %q", ev, want)
		}
	}
	if strings.Contains(ev, "gpu-3") {
		t.Errorf("event %q names gpu-3, whose fabric is ready", ev)
	}

	// The same state at the next rescan: nothing new to report.
	rescan(a)
	// Another state, a failed registration: reported with NVML's error.
	e.machine.SetFabric(2, nvml.GPU_FABRIC_STATE_COMPLETED, nvml.ERROR_UNKNOWN)
	rescan(a)
	if got := fabricTaints(a); len(got) != 1 || got["gpu-2"] != "failed" {
		t.Errorf("after a failed registration: fabric taints %v, want gpu-2=failed only", got)
	}
	if ev := expectEvent(t, recorder); !strings.Contains(ev, "Warning "+agent.ReasonFabricNotReady) || !strings.Contains(ev, "failed: ERROR_UNKNOWN") {
		t.Errorf("event %q, want a %s warning naming the registration's error", ev, agent.ReasonFabricNotReady)
	}

	e.machine.SetFabric(2, nvml.GPU_FABRIC_STATE_COMPLETED, nvml.SUCCESS)
	rescan(a)
	if got := fabricTaints(a); len(got) != 0 {
		t.Errorf("fabric ready: fabric taints %v, want none", got)
	}
	if ev := expectEvent(t, recorder); !strings.Contains(ev, "Normal "+agent.ReasonFabricReady) {
		t.Errorf("event %q, want %s", ev, agent.ReasonFabricReady)
	}
	select {
	case ev := <-recorder.Events:
		t.Errorf("unexpected event %q", ev)
	default:
	}
}
