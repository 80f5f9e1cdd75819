package agent_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
)

// waitForHealthReport returns, by device name, the first health report
// that the kubelet would get for which ok holds; what says what ok waits
// for.
func waitForHealthReport(ctx context.Context, t *testing.T, a *agent.Agent, what string, ok func(map[string]kubeletplugin.DeviceHealth) bool) map[string]kubeletplugin.DeviceHealth {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	reports := make(chan kubeletplugin.DeviceHealthReport)
	go func() { _ = a.WatchHealthStatus(ctx, reports) }()
	deadline := time.After(30 * time.Second)
	var last map[string]kubeletplugin.DeviceHealth
	for {
		select {
		case r := <-reports:
			last = map[string]kubeletplugin.DeviceHealth{}
			for _, d := range r.Devices {
				last[d.DeviceName] = d
			}
			if ok(last) {
				return last
			}
		case <-deadline:
			t.Fatalf("no health report with %s, last %+v", what, last)
		}
	}
}

// TestWatchHealthStatusUnwatched: a GPU whose health events cannot be
// registered is Unknown to the kubelet, with a message that says why, and
// stays so; the watched GPUs are Healthy until a fault makes one
// Unhealthy. The Node gets a Warning that names the unwatched GPU.
func TestWatchHealthStatusUnwatched(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(10)
	e.recorder = recorder
	e.machine.FailEventRegistration(2, nvml.ERROR_UNKNOWN)
	a := e.start(ctx, t)
	unwatched := a.Inventory().GPUs[2].Name
	const wantMessage = "health not watched: NVML RegisterEvents failed: ERROR_UNKNOWN"

	check := func(h map[string]kubeletplugin.DeviceHealth, unhealthy string) {
		t.Helper()
		if len(h) != 8 {
			t.Errorf("health of %d devices, want 8: %+v", len(h), h)
		}
		for name, d := range h {
			want := kubeletplugin.HealthStatusHealthy
			switch name {
			case unwatched:
				if d.Message != wantMessage {
					t.Errorf("%s: message %q, want %q", name, d.Message, wantMessage)
				}
				want = kubeletplugin.HealthStatusUnknown
			case unhealthy:
				want = kubeletplugin.HealthStatusUnhealthy
			}
			if d.Health != want {
				t.Errorf("%s: %s, want %s", name, d.Health, want)
			}
		}
	}

	// Every device is Unknown until the watcher says what it watches.
	h := waitForHealthReport(ctx, t, a, "gpu-0 watched", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h["gpu-0"].Health == kubeletplugin.HealthStatusHealthy
	})
	check(h, "")

	if err := e.machine.InjectXID(3, 79); err != nil {
		t.Fatal(err)
	}
	faulty := a.Inventory().GPUs[3].Name
	h = waitForHealthReport(ctx, t, a, faulty+" Unhealthy", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h[faulty].Health == kubeletplugin.HealthStatusUnhealthy
	})
	check(h, faulty)

	var partly []string
	for _, ev := range drainEvents(recorder) {
		if strings.HasPrefix(ev, "Warning "+agent.ReasonHealthPartlyWatched) {
			partly = append(partly, ev)
		}
	}
	if len(partly) != 1 || !strings.Contains(partly[0], unwatched+" (NVML RegisterEvents failed: ERROR_UNKNOWN)") || !strings.Contains(partly[0], "1 of 8") {
		t.Errorf("%s events %q, want one naming %s and why", agent.ReasonHealthPartlyWatched, partly, unwatched)
	}
}

// TestWatchHealthStatusNoneWatched: where no GPU's health events can be
// registered, every GPU is Unknown to the kubelet with a message that
// names why for each, and no partly-watched Warning is sent.
func TestWatchHealthStatusNoneWatched(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(10)
	e.recorder = recorder
	for i := range 8 {
		e.machine.FailEventRegistration(i, nvml.ERROR_NOT_SUPPORTED)
	}
	a := e.start(ctx, t)
	h := waitForHealthReport(ctx, t, a, "a message on gpu-0", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h["gpu-0"].Message != ""
	})
	for name, d := range h {
		if d.Health != kubeletplugin.HealthStatusUnknown || !strings.Contains(d.Message, "health not watched: device health cannot be watched") ||
			!strings.Contains(d.Message, "gpu-7: NVML RegisterEvents failed: ERROR_NOT_SUPPORTED") {
			t.Errorf("%s: %s %q, want Unknown with a message naming why for every GPU", name, d.Health, d.Message)
		}
	}
	for _, ev := range drainEvents(recorder) {
		if strings.HasPrefix(ev, "Warning "+agent.ReasonHealthPartlyWatched) {
			t.Errorf("unexpected event %q", ev)
		}
	}
}
