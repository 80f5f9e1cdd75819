package agent

import (
	"context"
	"testing"
	"time"
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
