package agent_test

import (
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/checkpoint"
)

// versionField is the version in a checkpoint file.
var versionField = regexp.MustCompile(`"version":"[^"]*"`)

// TestUnreadableCheckpointReported: an agent whose checkpoint is damaged,
// or was written in a newer format, does not start, and says so on the
// Node first: the file, the error and what to do.
func TestUnreadableCheckpointReported(t *testing.T) {
	testcases := map[string]struct {
		damage  func(data string) string
		wantErr error
		want    []string
	}{
		"checksum": {
			damage: func(data string) string {
				return strings.Replace(data, `"namespace":"default"`, `"namespace":"defaulT"`, 1)
			},
			wantErr: checkpoint.ErrCorrupt,
			want:    []string{"checksum mismatch", "move the file aside", "Unreadable checkpoint"},
		},
		"newer format": {
			damage: func(data string) string {
				return versionField.ReplaceAllString(data, `"version":"checkpoint.gpu.topodra.io/v9"`)
			},
			wantErr: checkpoint.ErrUnknownVersion,
			want:    []string{"v9", "newer agent", "Unreadable checkpoint"},
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			e := newEnv(t)
			a := e.start(ctx, t)
			c := claim("held", gpus("gpus", "gpu-1")...)
			if res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{c}); err != nil || res[c.UID].Err != nil {
				t.Fatalf("prepare: %v %v", err, res)
			}
			a.Stop()
			path := filepath.Join(e.stateDir, checkpoint.FileName)
			data, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, []byte(tc.damage(string(data))), 0o600); err != nil {
				t.Fatal(err)
			}

			recorder := events.NewFakeRecorder(10)
			e.recorder = recorder
			a, err = agent.New(ctx, e.options(t))
			if err == nil {
				a.Stop()
				t.Fatal("agent started with an unreadable checkpoint")
			}
			if !errors.Is(err, agent.ErrCheckpoint) || !errors.Is(err, tc.wantErr) {
				t.Errorf("error %v, want ErrCheckpoint and %v", err, tc.wantErr)
			}
			ev := expectEvent(t, recorder)
			for _, want := range append([]string{"Warning " + agent.ReasonCheckpointUnreadable, path}, tc.want...) {
				if !strings.Contains(ev, want) {
					t.Errorf("event %q does not contain %q", ev, want)
				}
			}
		})
	}
}
