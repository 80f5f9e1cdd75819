package discovery_test

import (
	"context"
	"errors"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/driverroot"
)

// TestRealNVML discovers this machine's GPUs with the real NVML library of
// the driver root that DRIVER_ROOT names (default "/"), then watches their
// health for three seconds: a healthy GPU must raise no health event.
// The conditions the agent taints a GPU for (fabric not ready, memory
// repair pending or failed, compute mode Prohibited) are logged where a
// GPU has them, not judged: a real GPU may.
// Where there is no NVML library or no GPU (CI) it skips and says why.
func TestRealNVML(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	root, err := driverroot.New(os.Getenv("DRIVER_ROOT"), "")
	if err != nil {
		t.Fatal(err)
	}
	d := discovery.NewLazy(discovery.OpenFromRoot(root), discovery.NVMLOptions{})
	defer func() { _ = d.Close() }()
	inv, err := d.Discover(ctx)
	if errors.Is(err, discovery.ErrNoGPU) {
		t.Skipf("no GPU here: %v", err)
	}
	if err != nil {
		t.Fatalf("discover with the NVML of driver root %s: %v", root.Path, err)
	}
	if len(inv.GPUs)+len(inv.Skipped) == 0 {
		t.Fatal("discovery succeeded with neither published nor skipped GPUs")
	}
	seen := map[string]bool{}
	for _, g := range inv.GPUs {
		if g.Name != discovery.DeviceName(g.Minor) || g.Device.Name != g.Name {
			t.Errorf("GPU with minor %d named %q (device %q)", g.Minor, g.Name, g.Device.Name)
		}
		if !strings.HasPrefix(g.UUID, "GPU-") || seen[g.UUID] {
			t.Errorf("%s: UUID %q is not a GPU UUID or is not unique", g.Name, g.UUID)
		}
		seen[g.UUID] = true
		if g.PCIBusID != discovery.CanonicalPCIBusID(g.PCIBusID) || g.PCIBusID == "" {
			t.Errorf("%s: PCI bus id %q is not canonical", g.Name, g.PCIBusID)
		}
		var names []string
		for name := range g.Device.Attributes {
			names = append(names, string(name))
		}
		slices.Sort(names)
		t.Logf("%s: %s, PCI %s, attributes %v, memory %v", g.Name, g.UUID, g.PCIBusID, names, ptr.To(g.Device.Capacity[discovery.CapacityMemory].Value))
		if g.Fabric != nil || g.ResetRequired != "" || g.RowRemapFailed || g.ComputeProhibited {
			t.Logf("%s: the agent taints it: fabric %+v, reset required %q, row remap failed %v, compute prohibited %v", g.Name, g.Fabric, g.ResetRequired, g.RowRemapFailed, g.ComputeProhibited)
		}
	}
	for _, s := range inv.Skipped {
		t.Logf("not published: GPU %d %s: %s", s.Index, s.UUID, s.Reason)
	}
	if len(inv.GPUs) == 0 {
		t.Skipf("NVML found %d GPUs and none is published (see the log): health watching is not checked", len(inv.Skipped))
	}

	watchCtx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	events := make(chan discovery.HealthEvent, 16)
	err = d.WatchHealth(watchCtx, inv, func(unwatched discovery.Unwatched) {
		for uuid, why := range unwatched {
			t.Logf("health of GPU %s not watched: %s", uuid, why)
		}
	}, events)
	switch {
	case errors.Is(err, discovery.ErrHealthUnsupported):
		t.Logf("no GPU here supports critical XID events: %v", err)
	case err != nil:
		t.Errorf("watch health: %v", err)
	}
	close(events)
	for ev := range events {
		t.Errorf("healthy GPU reported unhealthy: %+v", ev)
	}
}
