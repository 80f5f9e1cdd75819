package agent

import (
	"context"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
)

// SetTakeOverDiscoveryTimeout sets how long the takeover check waits for
// discovery until t ends. Tests that call it must not run in parallel.
func SetTakeOverDiscoveryTimeout(t *testing.T, d time.Duration) {
	old := takeOverDiscoveryTimeout
	takeOverDiscoveryTimeout = d
	t.Cleanup(func() { takeOverDiscoveryTimeout = old })
}

// RepeatWarnings records again the Warnings about faulty GPUs that are
// due, as the agent does every rescan interval.
func (a *Agent) RepeatWarnings(ctx context.Context) {
	a.repeatWarnings(ctx)
}

// HoldClaim takes the lock that a Prepare or Unprepare of the claim holds
// while it works, as one that is slow would; it returns the unlock.
func (a *Agent) HoldClaim(t *testing.T, uid types.UID) func() {
	unlock, ok := a.claimLocks.tryLock(uid)
	if !ok {
		t.Fatalf("claim %s is locked already", uid)
	}
	return unlock
}

// SpecTimesTellBoot says whether the agent tells specs of an earlier boot
// in dir by their modification time, and before which time they are of
// an earlier boot.
func SpecTimesTellBoot(dir string) (time.Time, bool) {
	boot := bootTime()
	return boot, !livesOneBoot(dir) && !boot.IsZero()
}
