package agent_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/topodra/topodra/pkg/agent"
)

// TestStaleClaimGraceSurvivesRestart: the grace period of a prepared claim
// that the API server no longer has runs from when an agent first found
// it gone, also across agent restarts (a crash-looping agent still drops
// it); a restarted agent reports the claim again, with that time.
func TestStaleClaimGraceSurvivesRestart(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	const grace = time.Hour
	e.staleClaimGrace = grace
	start := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	clock := testingclock.NewFakePassiveClock(start)
	startAgent := func() (*agent.Agent, *events.FakeRecorder) {
		t.Helper()
		recorder := events.NewFakeRecorder(10)
		e.recorder = recorder
		opts := e.options(t)
		opts.Clock = clock
		a, err := agent.New(ctx, opts)
		if err != nil {
			t.Fatalf("start agent: %v", err)
		}
		t.Cleanup(a.Stop)
		return a, recorder
	}
	check := func(a *agent.Agent, what string, want ...types.UID) {
		t.Helper()
		removed, err := a.CleanupStaleClaims(ctx)
		if err != nil || !slices.Equal(removed, want) {
			t.Fatalf("%s (%v after the claim was found gone): removed %v (%v), want %v", what, clock.Now().Sub(start), removed, err, want)
		}
	}

	a, _ := startAgent()
	orphan := claim("orphan", gpus("gpus", "gpu-1")...)
	if err := prepareOne(ctx, t, a, orphan); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	check(a, "first found gone")
	clock.SetTime(start.Add(grace / 2))
	check(a, "halfway")

	a.Stop()
	a, recorder := startAgent()
	check(a, "halfway, after a restart")
	ev := expectEvent(t, recorder)
	if !strings.HasPrefix(ev, "Warning "+agent.ReasonPreparedClaimGone+" ") || !strings.Contains(ev, start.Format(time.RFC3339)) {
		t.Errorf("restarted agent's event %q, want a %s warning with the time the claim was first found gone (%s)", ev, agent.ReasonPreparedClaimGone, start.Format(time.RFC3339))
	}
	clock.SetTime(start.Add(grace - time.Second))
	check(a, "just before the grace period ends")
	clock.SetTime(start.Add(grace))
	check(a, "when the grace period ends", orphan.UID)
}

// TestStaleClaimInUseKept: a stale claim that a Prepare or Unprepare
// works on (its lock held) is not dropped: its CDI spec and checkpoint
// entry stay until a check finds it free.
func TestStaleClaimInUseKept(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	e.staleClaimGrace = time.Minute
	start := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	clock := testingclock.NewFakePassiveClock(start)
	opts := e.options(t)
	opts.Clock = clock
	a, err := agent.New(ctx, opts)
	if err != nil {
		t.Fatalf("start agent: %v", err)
	}
	t.Cleanup(a.Stop)
	orphan := claim("orphan", gpus("gpus", "gpu-1")...)
	if err := prepareOne(ctx, t, a, orphan); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	check := func(what string, want ...types.UID) {
		t.Helper()
		removed, err := a.CleanupStaleClaims(ctx)
		if err != nil || !slices.Equal(removed, want) {
			t.Fatalf("%s: removed %v (%v), want %v", what, removed, err, want)
		}
	}
	check("first found gone")
	clock.SetTime(start.Add(time.Minute))
	unlock := a.HoldClaim(t, orphan.UID)
	check("grace over, the claim locked")
	unlock()
	check("grace over, the claim free", orphan.UID)
}
