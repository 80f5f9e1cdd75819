package agent

import (
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
