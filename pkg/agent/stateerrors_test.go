package agent_test

import (
	"errors"
	"os"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/cdi"
)

// replaceWithFile puts a file where dir was, so that nothing can be
// read or written below it (as root too, unlike permissions).
func replaceWithFile(t *testing.T, dir string) {
	t.Helper()
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir, []byte("not a directory"), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestStateUnwritableReported: where the agent cannot write its state
// directory at start, New fails with ErrStateUnwritable; where the state
// or CDI directory cannot be written later, Prepare and Unprepare fail
// (a claim whose spec cannot be written, that claim). Each time the Node
// gets a TopodraStateUnwritable Warning naming the error.
func TestStateUnwritableReported(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)

	e := newEnv(t)
	recorder := events.NewFakeRecorder(10)
	e.recorder = recorder
	replaceWithFile(t, e.stateDir)
	if _, err := agent.New(ctx, e.options(t)); !errors.Is(err, agent.ErrStateUnwritable) {
		t.Fatalf("start with the state directory a file: %v, want ErrStateUnwritable", err)
	}
	if ev := expectEventWithPrefix(t, recorder, "Warning "+agent.ReasonStateUnwritable); !strings.Contains(ev, e.stateDir) || !strings.Contains(ev, "not a directory") {
		t.Errorf("event %q does not name the state directory and the error", ev)
	}

	e = newEnv(t)
	recorder = events.NewFakeRecorder(10)
	e.recorder = recorder
	a := e.start(ctx, t)
	prepared := claim("prepared", gpus("gpus", "gpu-0")...)
	if err := prepareOne(ctx, t, a, prepared); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	replaceWithFile(t, e.cdiDir)
	res, err := a.UnprepareResourceClaims(ctx, []kubeletplugin.NamespacedObject{ref(prepared)})
	if err == nil {
		err = res[prepared.UID]
	}
	if err == nil {
		t.Fatal("unprepare with the CDI directory a file succeeded")
	}
	if ev := expectEventWithPrefix(t, recorder, "Warning "+agent.ReasonStateUnwritable); !strings.Contains(ev, "Unprepare failed") || !strings.Contains(ev, "prepared") {
		t.Errorf("event %q does not say that Unprepare of the claim failed", ev)
	}

	// A new claim's spec cannot be written either: the claim's error,
	// and the Node is told.
	unwritten := claim("unwritten", gpus("gpus", "gpu-2")...)
	if err := prepareOne(ctx, t, a, unwritten); !errors.Is(err, cdi.ErrWriteSpec) {
		t.Errorf("prepare with the CDI directory a file: %v, want ErrWriteSpec", err)
	}
	if ev := expectEventWithPrefix(t, recorder, "Warning "+agent.ReasonStateUnwritable); !strings.Contains(ev, "Prepare failed") || !strings.Contains(ev, "unwritten") {
		t.Errorf("event %q does not say that Prepare of the claim failed", ev)
	}

	replaceWithFile(t, e.stateDir)
	late := claim("late", gpus("gpus", "gpu-1")...)
	if _, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{late}); err == nil {
		t.Fatal("prepare with the state directory a file succeeded")
	}
	if ev := expectEventWithPrefix(t, recorder, "Warning "+agent.ReasonStateUnwritable); !strings.Contains(ev, "Prepare failed") {
		t.Errorf("event %q does not say that Prepare failed", ev)
	}
}
