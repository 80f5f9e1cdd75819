package agent

import (
	"errors"
	"fmt"
	"testing"

	"github.com/topodra/topodra/pkg/agent/cdi"
)

// TestPrepareErrorReason: each error that Prepare returns for a claim, or
// for a whole call, counts under its own reason, wrapped as the agent
// wraps it; node-wide set-up problems do not end up in other.
func TestPrepareErrorReason(t *testing.T) {
	testcases := map[string]struct {
		err  error
		want string
	}{
		"device in use":         {err: fmt.Errorf("claim default/a: gpu-0 (GPU-1): %w", ErrDeviceInUse), want: PrepareErrorDeviceInUse},
		"claim busy":            {err: fmt.Errorf("claim default/a: %w", ErrClaimBusy), want: PrepareErrorClaimBusy},
		"unhealthy device":      {err: fmt.Errorf("claim default/a: %w: xid-79", ErrDeviceUnhealthy), want: PrepareErrorUnhealthyDevice},
		"GPU moved":             {err: fmt.Errorf("claim default/a: %w", ErrGPUMoved), want: PrepareErrorGPUMoved},
		"reallocated":           {err: fmt.Errorf("claim default/a: %w", ErrReallocated), want: PrepareErrorReallocated},
		"opaque config":         {err: fmt.Errorf("claim default/a: %w: remove it", ErrConfigNotSupported), want: PrepareErrorConfigNotSupported},
		"device plugin":         {err: fmt.Errorf("claim default/a: %w", ErrDevicePluginConflict), want: PrepareErrorDevicePlugin},
		"other driver":          {err: fmt.Errorf("claim default/a: %w: gpu-0 is also gpu.nvidia.com/gpu-0", ErrOtherDriverConflict), want: PrepareErrorOtherDriver},
		"device node missing":   {err: fmt.Errorf("write CDI spec: %w: /dev/nvidiactl", cdi.ErrMissingDeviceNode), want: PrepareErrorDeviceNodeMissing},
		"CDI hook missing":      {err: fmt.Errorf("write CDI spec: common edits: %w: /usr/bin/nvidia-cdi-hook", cdi.ErrHookMissing), want: PrepareErrorCDIHookMissing},
		"NVML unusable":         {err: fmt.Errorf("claim default/a: the agent on node n %w, so it cannot prepare GPUs: %w", ErrNVMLUnusable, errors.New("discover devices: ERROR_LIB_RM_VERSION_MISMATCH")), want: PrepareErrorNVMLUnusable},
		"no state (whole call)": {err: ErrNoState, want: PrepareErrorNoState},
		"spec not written":      {err: fmt.Errorf("%w: %w for claim uid-a: no space left on device", ErrStateUnwritable, cdi.ErrWriteSpec), want: PrepareErrorStateUnwritable},
		"checkpoint not saved":  {err: fmt.Errorf("%w: write temporary checkpoint: read-only file system", ErrStateUnwritable), want: PrepareErrorStateUnwritable},
		"not allocated":         {err: errors.New("claim default/a is not allocated"), want: PrepareErrorOther},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			if got := prepareErrorReasons[prepareErrorIndex(tc.err)].reason; got != tc.want {
				t.Errorf("reason of %q: %s, want %s", tc.err, got, tc.want)
			}
		})
	}
}
