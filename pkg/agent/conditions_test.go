package agent_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
)

// conditionKeys are the keys of the taints that a condition read by
// discovery gives a GPU.
var conditionKeys = []string{agent.ResetRequiredTaintKey, agent.ComputeProhibitedTaintKey, agent.HealthTaintKey}

// conditionTaints maps each device of a's pool that has a taint with one
// of conditionKeys to those taints.
func conditionTaints(a *agent.Agent) map[string][]resourceapi.DeviceTaint {
	got := map[string][]resourceapi.DeviceTaint{}
	for _, d := range a.Resources().Pools[nodeName].Slices[0].Devices {
		for _, taint := range d.Taints {
			for _, key := range conditionKeys {
				if taint.Key == key {
					got[d.Name] = append(got[d.Name], taint)
				}
			}
		}
	}
	return got
}

// noEvent fails where the recorder holds an event.
func noEvent(t *testing.T, recorder *events.FakeRecorder) {
	t.Helper()
	select {
	case ev := <-recorder.Events:
		t.Errorf("unexpected event %q", ev)
	default:
	}
}

// TestGPUConditionsTaintGPU: a GPU whose row remapper has remaps pending,
// that has no row remapping and retired pages pending, whose row
// remapping failed, or whose compute mode is Prohibited is published with
// its taint (the health taint for a failure, NoSchedule for the others)
// from the agent's first discovery on, and the Node gets a Warning
// naming it and what to do; the other GPUs are untainted. A rescan that
// finds the condition gone removes the taint, and a Normal event says
// so. The kubelet gets a GPU whose row remapping failed as Unhealthy
// until then.
func TestGPUConditionsTaintGPU(t *testing.T) {
	testcases := map[string]struct {
		// set gives GPU 2 the condition, clear takes it away.
		set, clear func(m *mockgpu.Machine)
		want       resourceapi.DeviceTaint
		// warning is the reason of the Warning, says what it must say
		// beside the GPU; normal the reason of the Normal event.
		warning string
		says    []string
		normal  string
		// unhealthy: the kubelet gets the GPU as Unhealthy.
		unhealthy bool
	}{
		"row remap pending": {
			set:     func(m *mockgpu.Machine) { m.SetRowRemap(2, true, false) },
			clear:   func(m *mockgpu.Machine) { m.SetRowRemap(2, false, false) },
			want:    resourceapi.DeviceTaint{Key: agent.ResetRequiredTaintKey, Value: "row-remap-pending", Effect: resourceapi.DeviceTaintEffectNoSchedule},
			warning: agent.ReasonGPUResetRequired,
			says:    []string{"remapped rows of its memory are pending a GPU reset", "nvidia-smi -r", agent.ResetRequiredTaintKey},
			normal:  agent.ReasonGPUResetDone,
		},
		"retired pages pending, no row remapping": {
			set: func(m *mockgpu.Machine) {
				m.FailRowRemap(2, nvml.ERROR_NOT_SUPPORTED)
				m.SetRetiredPagesPending(2, true)
			},
			clear:   func(m *mockgpu.Machine) { m.SetRetiredPagesPending(2, false) },
			want:    resourceapi.DeviceTaint{Key: agent.ResetRequiredTaintKey, Value: "page-retirement-pending", Effect: resourceapi.DeviceTaintEffectNoSchedule},
			warning: agent.ReasonGPUResetRequired,
			says:    []string{"retired pages of its memory are pending a GPU reset", "nvidia-smi -r"},
			normal:  agent.ReasonGPUResetDone,
		},
		"row remap failure": {
			set:       func(m *mockgpu.Machine) { m.SetRowRemap(2, false, true) },
			clear:     func(m *mockgpu.Machine) { m.SetRowRemap(2, false, false) },
			want:      resourceapi.DeviceTaint{Key: agent.HealthTaintKey, Value: "row-remap-failure", Effect: resourceapi.DeviceTaintEffectNoSchedule},
			warning:   agent.ReasonRowRemapFailed,
			says:      []string{"row remapping failed", "repaired or replaced", agent.HealthTaintKey + "=row-remap-failure"},
			normal:    agent.ReasonRowRemapFailureGone,
			unhealthy: true,
		},
		"compute mode prohibited": {
			set:     func(m *mockgpu.Machine) { m.SetComputeMode(2, nvml.COMPUTEMODE_PROHIBITED) },
			clear:   func(m *mockgpu.Machine) { m.SetComputeMode(2, nvml.COMPUTEMODE_DEFAULT) },
			want:    resourceapi.DeviceTaint{Key: agent.ComputeProhibitedTaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule},
			warning: agent.ReasonComputeProhibited,
			says:    []string{"compute mode Prohibited", "-c DEFAULT", agent.ComputeProhibitedTaintKey},
			normal:  agent.ReasonComputeAllowed,
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			e := newEnv(t)
			recorder := events.NewFakeRecorder(10)
			e.recorder = recorder
			tc.set(e.machine)

			a := e.start(ctx, t)
			if got := conditionTaints(a); len(got) != 1 || len(got["gpu-2"]) != 1 || got["gpu-2"][0] != tc.want {
				t.Errorf("taints %v, want gpu-2 with %+v only", got, tc.want)
			}
			ev := expectEvent(t, recorder)
			for _, want := range append([]string{"Warning " + tc.warning, "gpu-2", e.machine.UUID(2)}, tc.says...) {
				if !strings.Contains(ev, want) {
					t.Errorf("event %q does not say %q", ev, want)
				}
			}
			if strings.Contains(ev, "gpu-3") {
				t.Errorf("event %q names gpu-3, which does not have the condition", ev)
			}
			health := waitForHealthReport(ctx, t, a, "all GPUs watched", func(h map[string]kubeletplugin.DeviceHealth) bool {
				return h["gpu-3"].Health == kubeletplugin.HealthStatusHealthy
			})
			if got := health["gpu-2"]; (got.Health == kubeletplugin.HealthStatusUnhealthy) != tc.unhealthy {
				t.Errorf("gpu-2 health %+v, want unhealthy: %v", got, tc.unhealthy)
			}

			// The same condition at the next rescan: nothing new.
			if err := a.Rescan(ctx); err != nil {
				t.Fatal(err)
			}
			noEvent(t, recorder)

			tc.clear(e.machine)
			if err := a.Rescan(ctx); err != nil {
				t.Fatal(err)
			}
			if got := conditionTaints(a); len(got) != 0 {
				t.Errorf("condition gone: taints %v, want none", got)
			}
			if ev := expectEvent(t, recorder); !strings.Contains(ev, "Normal "+tc.normal) {
				t.Errorf("event %q, want %s", ev, tc.normal)
			}
			waitForHealthReport(ctx, t, a, "gpu-2 healthy", func(h map[string]kubeletplugin.DeviceHealth) bool {
				return h["gpu-2"].Health == kubeletplugin.HealthStatusHealthy
			})
			noEvent(t, recorder)
		})
	}
}

// TestGPUConditionsUnknown: where NVML fails to read a GPU's row
// remapping, retired pages or compute mode, or the GPU lacks the feature
// (NOT_SUPPORTED), the GPU is published as usual, without a taint for
// it, and nothing is reported on the Node.
func TestGPUConditionsUnknown(t *testing.T) {
	testcases := map[string]func(m *mockgpu.Machine){
		"row remapping error": func(m *mockgpu.Machine) {
			m.FailRowRemap(2, nvml.ERROR_UNKNOWN)
			m.SetRetiredPagesPending(2, true)
		},
		"retired pages error": func(m *mockgpu.Machine) {
			m.FailRowRemap(2, nvml.ERROR_NOT_SUPPORTED)
			m.FailRetiredPagesPending(2, nvml.ERROR_UNKNOWN)
		},
		"compute mode error":   func(m *mockgpu.Machine) { m.FailComputeMode(2, nvml.ERROR_UNKNOWN) },
		"compute mode timeout": func(m *mockgpu.Machine) { m.FailComputeMode(2, nvml.ERROR_TIMEOUT) },
		"neither row remapping nor page retirement": func(m *mockgpu.Machine) {
			m.FailRowRemap(2, nvml.ERROR_NOT_SUPPORTED)
			m.FailRetiredPagesPending(2, nvml.ERROR_NOT_SUPPORTED)
		},
		"compute mode not supported": func(m *mockgpu.Machine) { m.FailComputeMode(2, nvml.ERROR_NOT_SUPPORTED) },
	}
	for name, set := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			e := newEnv(t)
			recorder := events.NewFakeRecorder(10)
			e.recorder = recorder
			set(e.machine)
			a := e.start(ctx, t)
			if err := a.Rescan(ctx); err != nil {
				t.Fatal(err)
			}
			devices := a.Resources().Pools[nodeName].Slices[0].Devices
			if len(devices) != 8 {
				t.Errorf("%d devices published, want 8", len(devices))
			}
			if got := conditionTaints(a); len(got) != 0 {
				t.Errorf("taints %v, want none", got)
			}
			noEvent(t, recorder)
		})
	}
}

// TestRowRemapFailureWakesHealthStream: a rescan that finds a GPU's row
// remapping failed sends the kubelet's open health stream a report with
// the GPU Unhealthy at once, well before the stream's 10 second resend.
func TestRowRemapFailureWakesHealthStream(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	a := e.start(ctx, t)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	reports := make(chan kubeletplugin.DeviceHealthReport)
	go func() { _ = a.WatchHealthStatus(ctx, reports) }()
	healthOf := func(r kubeletplugin.DeviceHealthReport, device string) kubeletplugin.HealthStatus {
		for _, d := range r.Devices {
			if d.DeviceName == device {
				return d.Health
			}
		}
		return ""
	}
	deadline := time.After(30 * time.Second)
	for watched := false; !watched; {
		select {
		case r := <-reports:
			watched = healthOf(r, "gpu-2") == kubeletplugin.HealthStatusHealthy
		case <-deadline:
			t.Fatal("gpu-2 never reported healthy")
		}
	}
	e.machine.SetRowRemap(2, false, true)
	if err := a.Rescan(ctx); err != nil {
		t.Fatal(err)
	}
	soon := time.After(5 * time.Second)
	for {
		select {
		case r := <-reports:
			if healthOf(r, "gpu-2") == kubeletplugin.HealthStatusUnhealthy {
				return
			}
		case <-soon:
			t.Fatal("no report with gpu-2 unhealthy within 5s of the rescan")
		}
	}
}

// TestRowRemapFailureRefusesPrepare: a claim not prepared yet that was
// allocated a GPU whose row remapping failed is refused, as one on a GPU
// with a critical XID is; other GPUs, and the GPU once NVML no longer
// reports the failure, are prepared. A GPU that needs a reset or whose
// compute mode is Prohibited is tainted only: claims allocated before
// are prepared.
func TestRowRemapFailureRefusesPrepare(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	e.machine.SetRowRemap(2, false, true)
	e.machine.SetRowRemap(4, true, false)
	e.machine.SetComputeMode(5, nvml.COMPUTEMODE_PROHIBITED)
	a := e.start(ctx, t)

	err := prepareOne(ctx, t, a, claim("broken", gpus("gpus", "gpu-2")...))
	if !errors.Is(err, agent.ErrDeviceUnhealthy) || !strings.Contains(err.Error(), "gpu-2") || !strings.Contains(err.Error(), "row remapping failure") {
		t.Errorf("prepare of a claim on gpu-2, whose row remapping failed: %v, want ErrDeviceUnhealthy naming the GPU and the failure", err)
	}
	for _, device := range []string{"gpu-3", "gpu-4", "gpu-5"} {
		if err := prepareOne(ctx, t, a, claim("on-"+device, gpus("gpus", device)...)); err != nil {
			t.Errorf("prepare of a claim on %s: %v", device, err)
		}
	}
	e.machine.SetRowRemap(2, false, false)
	if err := a.Rescan(ctx); err != nil {
		t.Fatal(err)
	}
	if err := prepareOne(ctx, t, a, claim("repaired", gpus("gpus", "gpu-2")...)); err != nil {
		t.Errorf("prepare on gpu-2 once NVML reports no row remapping failure: %v", err)
	}
}
