package agent_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
)

// TestToolkitLetsPodsChooseGPUs: a toolkit configuration that lets
// unprivileged containers choose their GPUs through NVIDIA_VISIBLE_DEVICES
// (the setting true, or left out, as the toolkit then takes it) gets a
// TopodraVisibleDevicesEnvAccepted Warning on the Node at start, naming
// the setting and the file; one that sets it false, a missing file, and
// one that cannot be parsed get none (the last is logged).
func TestToolkitLetsPodsChooseGPUs(t *testing.T) {
	for name, tc := range map[string]struct {
		config string // "" for no file
		warn   bool
	}{
		"true": {config: `
accept-nvidia-visible-devices-as-volume-mounts = false
accept-nvidia-visible-devices-envvar-when-unprivileged = true

[nvidia-container-runtime]
mode = "auto"
`, warn: true},
		"left out": {config: `
disable-require = false

[nvidia-container-cli]
root = "/run/nvidia/driver"
`, warn: true},
		"false": {config: `
accept-nvidia-visible-devices-envvar-when-unprivileged = false

[nvidia-container-runtime]
mode = "cdi"
`},
		// The key inside a table is not the toolkit's setting.
		"false, with the key in a table too": {config: `
accept-nvidia-visible-devices-envvar-when-unprivileged = false

[nvidia-container-runtime]
accept-nvidia-visible-devices-envvar-when-unprivileged = true
`},
		"no file":  {},
		"not TOML": {config: "accept-nvidia-visible-devices-envvar-when-unprivileged = \n"},
	} {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			e := newEnv(t)
			recorder := events.NewFakeRecorder(10)
			e.recorder = recorder
			e.toolkitConfig = filepath.Join(t.TempDir(), "config.toml")
			if tc.config != "" {
				if err := os.WriteFile(e.toolkitConfig, []byte(tc.config), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			e.start(ctx, t)
			var warned []string
			for len(recorder.Events) > 0 {
				if ev := <-recorder.Events; strings.HasPrefix(ev, "Warning "+agent.ReasonVisibleDevicesEnvAccepted+" ") {
					warned = append(warned, ev)
				}
			}
			switch {
			case tc.warn && len(warned) != 1:
				t.Errorf("%d %s warnings, want 1", len(warned), agent.ReasonVisibleDevicesEnvAccepted)
			case tc.warn && (!strings.Contains(warned[0], agent.VisibleDevicesEnvKey) || !strings.Contains(warned[0], e.toolkitConfig)):
				t.Errorf("warning %q does not name the setting and the file", warned[0])
			case !tc.warn && len(warned) > 0:
				t.Errorf("warnings %q, want none", warned)
			}
		})
	}
}
