package agent_test

import (
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
)

// TestUnreadableGPUReported: a GPU that NVML cannot read is not published,
// and a Warning on the Node names its index, PCI bus id and why, once per
// set of such GPUs; a Normal event follows once every GPU is published.
func TestUnreadableGPUReported(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	busIDs := map[int]string{}
	{
		a := e.start(ctx, t)
		for _, g := range a.Inventory().GPUs {
			busIDs[g.Index] = g.PCIBusID
		}
		a.Stop()
	}
	if busIDs[3] == "" || busIDs[5] == "" {
		t.Fatalf("mock GPUs without PCI bus ids: %v", busIDs)
	}
	recorder := events.NewFakeRecorder(10)
	e.recorder = recorder
	e.machine.FailUUID(3, nvml.ERROR_GPU_IS_LOST)
	a := e.start(ctx, t)
	if n := len(a.Inventory().GPUs); n != 7 {
		t.Fatalf("%d GPUs published, want 7", n)
	}
	ev := expectEvent(t, recorder)
	for _, want := range []string{"Warning " + agent.ReasonGPUNotPublished + " ", "NVML index 3", busIDs[3], nvml.ERROR_GPU_IS_LOST.Error()} {
		if !strings.Contains(ev, want) {
			t.Errorf("event %q does not contain %q", ev, want)
		}
	}

	rescan := func(what string) {
		t.Helper()
		if err := a.Rescan(ctx); err != nil {
			t.Fatalf("rescan %s: %v", what, err)
		}
	}
	noEvent := func(what string) {
		t.Helper()
		if evs := drainEvents(recorder); len(evs) > 0 {
			t.Errorf("%s: unexpected events %q", what, evs)
		}
	}
	rescan("with the same GPU unreadable")
	noEvent("the same GPU unreadable")

	e.machine.FailUUID(5, nvml.ERROR_UNKNOWN)
	rescan("with a second GPU unreadable")
	ev = expectEvent(t, recorder)
	for _, want := range []string{"Warning " + agent.ReasonGPUNotPublished + " ", "NVML index 3", busIDs[3], "NVML index 5", busIDs[5]} {
		if !strings.Contains(ev, want) {
			t.Errorf("second GPU unreadable: event %q does not contain %q", ev, want)
		}
	}

	e.machine.FailUUID(3, nvml.SUCCESS)
	e.machine.FailUUID(5, nvml.SUCCESS)
	rescan("with every GPU readable")
	if ev := expectEvent(t, recorder); !strings.HasPrefix(ev, "Normal "+agent.ReasonAllGPUsPublished+" ") {
		t.Errorf("every GPU readable: event %q, want %s", ev, agent.ReasonAllGPUsPublished)
	}
	if n := len(a.Inventory().GPUs); n != 8 {
		t.Errorf("%d GPUs published, want 8", n)
	}
	rescan("again")
	noEvent("every GPU readable again")
}
