package discovery_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
)

// TestLazyReloadsAfterDriverUpgrade: once the loaded library answers
// ERROR_LIB_RM_VERSION_MISMATCH (the driver was upgraded under the agent),
// Discover fails with ErrDriverChanged and shuts the library down, health
// watching ends instead of waiting forever, and the next Discover loads
// the new library with the new driver version.
func TestLazyReloadsAfterDriverUpgrade(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	m, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: "node-1"})
	if err != nil {
		t.Fatal(err)
	}
	old, upgraded := m.Library("550.54.15"), m.Library("570.86.10")
	var mutex sync.Mutex
	next := old
	lazy := discovery.NewLazy(func() (nvml.Interface, error) {
		mutex.Lock()
		defer mutex.Unlock()
		return next, nil
	}, discovery.NVMLOptions{Sysfs: m.Sysfs()})
	driverVersion := func(inv *discovery.Inventory) string {
		return *inv.GPUs[0].Device.Attributes[discovery.AttrDriverVersion].VersionValue
	}

	inv, err := lazy.Discover(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := driverVersion(inv); got != "550.54.15" {
		t.Fatalf("driver version %s", got)
	}
	watchDone := make(chan error, 1)
	watchCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		watchDone <- lazy.WatchHealth(watchCtx, inv, func(discovery.Unwatched) {}, make(chan discovery.HealthEvent))
	}()
	if err := wait.PollUntilContextTimeout(ctx, time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return old.EventSets() > 0, nil
	}); err != nil {
		t.Fatalf("health watching did not start: %v", err)
	}

	old.Break()
	mutex.Lock()
	next = upgraded
	mutex.Unlock()
	_, err = lazy.Discover(ctx)
	if !errors.Is(err, discovery.ErrDriverChanged) || !errors.Is(err, nvml.ERROR_LIB_RM_VERSION_MISMATCH) {
		t.Fatalf("after the upgrade: got %v, want ErrDriverChanged", err)
	}
	if old.Shutdowns() != 1 {
		t.Errorf("old library shut down %d times, want 1", old.Shutdowns())
	}
	select {
	case err := <-watchDone:
		if !errors.Is(err, discovery.ErrDriverChanged) {
			t.Errorf("WatchHealth: %v, want ErrDriverChanged", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("WatchHealth still waits on the old library")
	}

	inv, err = lazy.Discover(ctx)
	if err != nil {
		t.Fatalf("after reload: %v", err)
	}
	if got := driverVersion(inv); got != "570.86.10" {
		t.Errorf("driver version after reload %s, want 570.86.10", got)
	}
	if lazy.Lib() != nvml.Interface(upgraded) {
		t.Error("Lib() does not return the reloaded library")
	}
}
