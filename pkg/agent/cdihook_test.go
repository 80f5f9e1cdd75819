package agent_test

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/client-go/tools/events"
	"k8s.io/component-base/metrics"
	"k8s.io/klog/v2/ktesting"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/cdi"
)

// failingGenerator fails its common edits with err while missing is set,
// as cdi.NVCDI does while something the node needs is missing.
type failingGenerator struct {
	cdi.Generator
	err     error
	missing atomic.Bool
}

func (g *failingGenerator) CommonEdits() (cdispec.ContainerEdits, error) {
	if g.missing.Load() {
		return cdispec.ContainerEdits{}, g.err
	}
	return g.Generator.CommonEdits()
}

// hookGenerator is a cdi.HookChecker whose hook is missing while missing
// is set; edits fail then.
type hookGenerator struct{ failingGenerator }

var errHook = fmt.Errorf("%w: /usr/bin/nvidia-cdi-hook on the node: no such file; install the NVIDIA Container Toolkit", cdi.ErrHookMissing)

func (g *hookGenerator) CheckHook() error {
	if g.missing.Load() {
		return errHook
	}
	return nil
}

// TestCDIHookMissing: a CDI generator whose hook is missing on the node
// gets a TopodraCDIHookMissing Warning on the Node at start, with its
// error; Prepare fails for the claim with that error (counted under
// cdi_hook_missing) and succeeds, without a restart, once the hook is
// there. A generator that finds its hook
// there, or cannot check, leaves no event.
func TestCDIHookMissing(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(10)
	e.recorder = recorder
	gen := &hookGenerator{failingGenerator{Generator: cdi.Static{DevRoot: e.devRoot}, err: errHook}}
	gen.missing.Store(true)
	e.generator = gen
	a := e.start(ctx, t)
	registry := metrics.NewKubeRegistry()
	registry.CustomMustRegister(a.MetricsCollector())

	if ev := expectEvent(t, recorder); !strings.HasPrefix(ev, "Warning "+agent.ReasonCDIHookMissing+" ") || !strings.Contains(ev, errHook.Error()) {
		t.Errorf("event %q, want a %s warning with %q", ev, agent.ReasonCDIHookMissing, errHook)
	}
	c := claim("train", gpus("gpus", "gpu-0")...)
	result, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{c})
	if err != nil {
		t.Fatal(err)
	}
	if err := result[c.UID].Err; !errors.Is(err, cdi.ErrHookMissing) || !strings.Contains(err.Error(), "/usr/bin/nvidia-cdi-hook") {
		t.Errorf("prepare with the hook missing: %v, want %v", err, errHook)
	}
	expectMetrics(ctx, t, registry, map[string]float64{
		agent.MetricPrepareErrors + `{reason="cdi_hook_missing"}`: 1,
		agent.MetricPrepareErrors + `{reason="other"}`:            0,
	})

	gen.missing.Store(false)
	result, err = a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{c})
	if err != nil {
		t.Fatal(err)
	}
	if err := result[c.UID].Err; err != nil {
		t.Errorf("prepare once the hook is there: %v", err)
	}

	// Restarts with the hook there, and with a generator without hooks.
	a.Stop()
	e.start(ctx, t).Stop()
	e.generator = cdi.Static{DevRoot: e.devRoot}
	e.start(ctx, t)
	select {
	case ev := <-recorder.Events:
		t.Errorf("unexpected event %q", ev)
	default:
	}
}

// longHookError is a hook checker whose error is longer than an event note
// may be.
type longHookError struct{ cdi.Generator }

func (longHookError) CheckHook() error {
	return fmt.Errorf("%w: %s", cdi.ErrHookMissing, strings.Repeat("x", 2000))
}

// TestNodeEventNoteLimit: a Node event whose note would exceed the API
// server's 1024 bytes is cut, not refused.
func TestNodeEventNoteLimit(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(10)
	e.recorder = recorder
	e.generator = longHookError{cdi.Static{DevRoot: e.devRoot}}
	e.start(ctx, t)
	ev := expectEvent(t, recorder)
	note := strings.TrimPrefix(ev, "Warning "+agent.ReasonCDIHookMissing+" ")
	if note == ev || len(note) > 1024 || !strings.HasSuffix(note, "...") {
		t.Errorf("event of %d bytes, want a %s note of at most 1024 bytes ending in ...: %q", len(note), agent.ReasonCDIHookMissing, ev)
	}
}

var errUVM = fmt.Errorf("%w: /dev/nvidia-uvm and /dev/nvidia-uvm-tools: the nvidia-uvm kernel module is not loaded", cdi.ErrMissingDeviceNode)

// TestDeviceNodeMissing: Prepare that fails for a device node missing on
// the node fails the claim with that error and records a
// TopodraDeviceNodeMissing Warning on the Node, where the admin looks; once
// the node has it, the kubelet's next try prepares the claim.
func TestDeviceNodeMissing(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(10)
	e.recorder = recorder
	gen := &failingGenerator{Generator: cdi.Static{DevRoot: e.devRoot}, err: errUVM}
	gen.missing.Store(true)
	e.generator = gen
	a := e.start(ctx, t)

	c := claim("train", gpus("gpus", "gpu-0")...)
	result, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{c})
	if err != nil {
		t.Fatal(err)
	}
	if err := result[c.UID].Err; !errors.Is(err, cdi.ErrMissingDeviceNode) {
		t.Errorf("prepare without nvidia-uvm: %v, want %v", err, errUVM)
	}
	if ev := expectEvent(t, recorder); !strings.HasPrefix(ev, "Warning "+agent.ReasonDeviceNodeMissing+" ") || !strings.Contains(ev, errUVM.Error()) {
		t.Errorf("event %q, want a %s warning with %q", ev, agent.ReasonDeviceNodeMissing, errUVM)
	}

	gen.missing.Store(false)
	result, err = a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{c})
	if err != nil {
		t.Fatal(err)
	}
	if err := result[c.UID].Err; err != nil {
		t.Errorf("prepare once the device nodes are there: %v", err)
	}
	select {
	case ev := <-recorder.Events:
		t.Errorf("unexpected event %q", ev)
	default:
	}
}
