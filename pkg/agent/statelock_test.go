package agent_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/topology"
)

// TestSecondAgentWaitsForFirst: a second agent on the same node (same
// state and socket directories) waits, with a warning on the Node, live
// but not ready, until the first one stops, and then serves: its
// registration socket is there, not removed by the first one's stop. One
// whose context ends while it waits gives up, and one stopped while it
// waits stops.
func TestSecondAgentWaitsForFirst(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	base := socketDirs(t)
	kubeletOptions := func() agent.Options {
		opts := e.options(t)
		opts.PublishOnly = false
		opts.PluginDataDir = filepath.Join(base, "p")
		opts.RegistrarDir = filepath.Join(base, "r")
		return opts
	}
	regSocket := filepath.Join(base, "r", topology.DriverName+"-reg.sock")

	first, err := agent.New(ctx, kubeletOptions())
	if err != nil {
		t.Fatalf("first agent: %v", err)
	}
	t.Cleanup(first.Stop) // Stop may be called more than once

	recorder := events.NewFakeRecorder(10)
	opts := kubeletOptions()
	opts.Recorder = recorder
	second, err := agent.Start(ctx, opts)
	if err != nil {
		t.Fatalf("second agent: %v", err)
	}
	t.Cleanup(second.Stop)
	ev := expectEvent(t, recorder)
	if !strings.Contains(ev, "Warning "+agent.ReasonStateLocked) || !strings.Contains(ev, filepath.Join(e.stateDir, agent.LockFileName)) {
		t.Errorf("event %q, want a %s warning naming the lock file", ev, agent.ReasonStateLocked)
	}
	select {
	case <-second.Started():
		t.Fatal("second agent started beside the first one")
	case <-second.Done():
		t.Fatalf("second agent stopped while it waits: %v", second.Err())
	case <-time.After(2 * time.Second):
	}
	if _, err := os.Stat(regSocket); err != nil {
		t.Errorf("first agent's registration socket while the second waits: %v", err)
	}
	// Without its pod's UID the waiting agent has no sockets yet: a
	// rollout must not count it available.
	if err := second.Ready(); err == nil {
		t.Error("second agent ready while it waits for the lock")
	}
	if err := second.Live(); err != nil {
		t.Errorf("second agent not live while it waits for the lock: %v", err)
	}

	// An agent stopped while it waits stops.
	fourth, err := agent.Start(ctx, kubeletOptions())
	if err != nil {
		t.Fatalf("fourth agent: %v", err)
	}
	stopped := make(chan struct{})
	go func() {
		fourth.Stop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("Stop of an agent that waits for the lock did not return")
	}
	if fourth.Err() == nil {
		t.Error("an agent stopped while it waits reports no error")
	}

	// An agent whose context ends while it waits gives up.
	waitCtx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if a, err := agent.New(waitCtx, kubeletOptions()); err == nil {
		a.Stop()
		t.Error("third agent started beside the first one")
	}

	first.Stop()
	select {
	case <-second.Started():
	case <-second.Done():
		t.Fatalf("second agent: %v", second.Err())
	case <-time.After(10 * time.Second):
		t.Fatal("second agent did not start after the first one stopped")
	}
	if _, err := os.Stat(regSocket); err != nil {
		t.Errorf("second agent's registration socket: %v", err)
	}
}

// TestStopWaitsForRunningPrepare: Stop releases the lock on the state
// directory only once a Prepare that is still running (its CDI spec
// generation hangs) has ended, so that another agent that takes the lock
// never sees the checkpoint change under it; a Prepare after Stop fails.
func TestStopWaitsForRunningPrepare(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	a, gen, release := startBlocked(ctx, t, e)

	held := claim("held", gpus("gpus", "gpu-0")...)
	go func() {
		_, _ = a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{held})
	}()
	gen.awaitEntered(t)
	stopped := make(chan struct{})
	go func() {
		a.Stop()
		close(stopped)
	}()
	select {
	case <-stopped:
		t.Fatal("Stop returned while a Prepare still runs")
	case <-time.After(500 * time.Millisecond):
	}
	if !locked(t, e.stateDir) {
		t.Error("the lock on the state directory was released while a Prepare still runs")
	}
	release()
	select {
	case <-stopped:
	case <-time.After(30 * time.Second):
		t.Fatal("Stop did not return after the Prepare ended")
	}
	if locked(t, e.stateDir) {
		t.Error("the lock on the state directory is still held after Stop")
	}
	if _, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{claim("after", gpus("gpus", "gpu-1")...)}); err == nil {
		t.Error("Prepare after Stop succeeded")
	}
}

// locked says whether another process or descriptor holds the lock on
// the state directory.
func locked(t *testing.T, dir string) bool {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(dir, agent.LockFileName), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	if err == nil {
		_ = unix.Flock(int(f.Fd()), unix.LOCK_UN)
		return false
	}
	return true
}
