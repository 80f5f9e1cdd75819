package agent_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/topology"
)

// TestSecondAgentWaitsForFirst: a second agent on the same node (same
// state and socket directories) waits, with a warning on the Node, until
// the first one stops, and then serves: its registration socket is there,
// not removed by the first one's stop. One whose context ends while it
// waits gives up.
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
	type started struct {
		a   *agent.Agent
		err error
	}
	second := make(chan started, 1)
	go func() {
		a, err := agent.New(ctx, opts)
		second <- started{a, err}
	}()
	ev := expectEvent(t, recorder)
	if !strings.Contains(ev, "Warning "+agent.ReasonStateLocked) || !strings.Contains(ev, filepath.Join(e.stateDir, agent.LockFileName)) {
		t.Errorf("event %q, want a %s warning naming the lock file", ev, agent.ReasonStateLocked)
	}
	select {
	case s := <-second:
		if s.a != nil {
			s.a.Stop()
		}
		t.Fatalf("second agent started beside the first one (err %v)", s.err)
	case <-time.After(2 * time.Second):
	}
	if _, err := os.Stat(regSocket); err != nil {
		t.Errorf("first agent's registration socket while the second waits: %v", err)
	}

	// An agent whose context ends while it waits gives up.
	waitCtx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if a, err := agent.New(waitCtx, kubeletOptions()); err == nil {
		a.Stop()
		t.Error("third agent started beside the first one")
	}

	first.Stop()
	var s started
	select {
	case s = <-second:
	case <-time.After(10 * time.Second):
		t.Fatal("second agent did not start after the first one stopped")
	}
	if s.err != nil {
		t.Fatalf("second agent: %v", s.err)
	}
	defer s.a.Stop()
	if _, err := os.Stat(regSocket); err != nil {
		t.Errorf("second agent's registration socket: %v", err)
	}
}
