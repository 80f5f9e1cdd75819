package agent_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/util/jsonpath"
	"k8s.io/klog/v2/ktesting"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/topology"
)

// failingDiscovery fails with the error it holds, while it holds one, and
// otherwise discovers what its Interface does.
type failingDiscovery struct {
	discovery.Interface
	err atomic.Pointer[error]
}

func (d *failingDiscovery) Discover(ctx context.Context) (*discovery.Inventory, error) {
	if err := d.err.Load(); err != nil {
		return nil, *err
	}
	return d.Interface.Discover(ctx)
}

// TestWarningsRepeatedWhileTheyLast: the Warning about a condition that
// lasts (a faulty GPU, no GPU found, NVML unusable) is recorded again
// every 30 minutes while it lasts, so that the Node shows it although the
// API server lets events expire after an hour; not at every rescan, and
// no more once the condition has ended.
func TestWarningsRepeatedWhileTheyLast(t *testing.T) {
	testcases := map[string]struct {
		// reason is the Warning's.
		reason string
		// err, if set, is what discovery fails with until end.
		err error
		// fault: a GPU reports a critical XID at start, and end clears
		// its fault through the Node's annotation.
		fault bool
	}{
		"faulty GPU": {reason: agent.ReasonDeviceUnhealthy, fault: true},
		"no GPU":     {reason: agent.ReasonNoGPU, err: fmt.Errorf("%w: libnvidia-ml.so.1 not found in driver root /driver-root", discovery.ErrNoGPU)},
		"NVML unusable": {
			reason: agent.ReasonNVMLUnusable,
			err:    fmt.Errorf("%w: initialize NVML: ERROR_LIB_RM_VERSION_MISMATCH", discovery.ErrNVMLUnusable),
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			e := newEnv(t)
			recorder := &noteRecorder{}
			e.recorder = recorder
			start := time.Now()
			clock := testingclock.NewFakePassiveClock(start)
			opts := e.options(t)
			opts.Clock = clock
			// The loops of the agent stay out of the way: the test
			// checks as they would.
			opts.RescanInterval = time.Hour
			opts.NoGPURetry = time.Hour
			disc := &failingDiscovery{Interface: opts.Discovery}
			if tc.err != nil {
				disc.err.Store(&tc.err)
				opts.Discovery = disc
			}
			a := startWith(ctx, t, opts)
			if tc.fault {
				injectXIDOnceWatched(ctx, t, e, 5, 79)
			}
			check := func() {
				t.Helper()
				if tc.fault {
					a.RepeatWarnings(ctx)
					return
				}
				_ = a.Rescan(ctx)
			}
			warnings := func(what string, want int) {
				t.Helper()
				if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
					return len(recorder.notes("Warning "+tc.reason)) >= want, nil
				}); err != nil {
					t.Fatalf("%s: %d %s Warnings, want %d", what, len(recorder.notes("Warning "+tc.reason)), tc.reason, want)
				}
				if got := recorder.notes("Warning " + tc.reason); len(got) != want {
					t.Fatalf("%s: %s Warnings %q, want %d", what, tc.reason, got, want)
				}
			}
			warnings("at start", 1)
			steps := []struct {
				after time.Duration
				want  int
			}{
				{after: time.Minute, want: 1},
				{after: agent.EventRepeat - time.Second, want: 1},
				{after: agent.EventRepeat, want: 2},
				{after: agent.EventRepeat + 15*time.Minute, want: 2},
				{after: 2 * agent.EventRepeat, want: 3},
			}
			for _, step := range steps {
				clock.SetTime(start.Add(step.after))
				check()
				warnings(fmt.Sprintf("%v later", step.after), step.want)
			}

			// The condition ends.
			if tc.fault {
				c := &clearEnv{env: e, t: t, ctx: ctx}
				_, now := nextSecond()
				c.annotate(now + " gpu-5")
				if err := a.CheckNode(ctx); err != nil {
					t.Fatal(err)
				}
			} else {
				disc.err.Store(nil)
			}
			check()
			clock.SetTime(start.Add(4 * agent.EventRepeat))
			check()
			warnings("after it ended", 3)
		})
	}
}

// TestFaultTakenOverAnnounced: an agent that takes a GPU fault over from
// the checkpoint (a restart) records its DeviceUnhealthy Warning at its
// first check, since the one recorded before the restart may be about to
// expire, and then every 30 minutes.
func TestFaultTakenOverAnnounced(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	e.rescanInterval = time.Hour
	a := e.start(ctx, t)
	injectXIDOnceWatched(ctx, t, e, 5, 79)
	waitForHealthTaint(ctx, t, a, "gpu-5", "xid-79")
	a.Stop()

	recorder := &noteRecorder{}
	e.recorder = recorder
	start := time.Now()
	clock := testingclock.NewFakePassiveClock(start)
	opts := e.options(t)
	opts.Clock = clock
	a = startWith(ctx, t, opts)
	for _, step := range []struct {
		after time.Duration
		want  int
	}{
		{after: 0, want: 1},
		{after: time.Minute, want: 1},
		{after: agent.EventRepeat, want: 2},
	} {
		clock.SetTime(start.Add(step.after))
		a.RepeatWarnings(ctx)
		got := recorder.notes("Warning " + agent.ReasonDeviceUnhealthy)
		if len(got) != step.want || !strings.Contains(got[0], "devices gpu-5 are unhealthy") {
			t.Fatalf("%v after the restart: %s Warnings %q, want %d naming gpu-5", step.after, agent.ReasonDeviceUnhealthy, got, step.want)
		}
	}
}

// kubectlJSONPath matches the documented kubectl command that lists the
// health taints of a node's GPUs, capturing its field selector and
// jsonpath template.
var kubectlJSONPath = regexp.MustCompile(`kubectl get resourceslices --field-selector (\S+) \\\n\s+-o jsonpath='([^']+)'`)

// TestDocumentedTaintQuery: the kubectl command of docs/install.md ("A GPU
// fails") that lists the node's GPUs with their faults selects the
// agent's slices of the node and, run on them as kubectl runs its jsonpath
// templates, prints the faulty GPU with its fault and when it was
// tainted, and the others without.
func TestDocumentedTaintQuery(t *testing.T) {
	doc, err := os.ReadFile("../../docs/install.md")
	if err != nil {
		t.Fatal(err)
	}
	m := kubectlJSONPath.FindSubmatch(doc)
	if m == nil {
		t.Fatal("docs/install.md has no command kubectl get resourceslices --field-selector ... -o jsonpath='...'")
	}
	selector, template := string(m[1]), string(m[2])
	if want := "spec.nodeName=<node>,spec.driver=" + topology.DriverName; selector != want {
		t.Errorf("field selector %q, want %q", selector, want)
	}

	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	e.ownedTaint = true
	a := e.start(ctx, t)
	injectXIDOnceWatched(ctx, t, e, 5, 79)
	waitForHealthTaint(ctx, t, a, "gpu-5", "xid-79")
	var list *resourceapi.ResourceSliceList
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
		list, err = e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: strings.ReplaceAll(selector, "<node>", nodeName)})
		return err == nil && healthTainted(ctx, t, e, "gpu-5"), nil
	}); err != nil {
		t.Fatalf("the API has no health taint on gpu-5: %v", err)
	}
	obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(list)
	if err != nil {
		t.Fatal(err)
	}
	// kubectl's jsonpath printer: missing keys print nothing.
	jp := jsonpath.New("taints").AllowMissingKeys(true)
	if err := jp.Parse(template); err != nil {
		t.Fatalf("parse %q: %v", template, err)
	}
	var out bytes.Buffer
	if err := jp.Execute(&out, obj); err != nil {
		t.Fatalf("execute %q: %v", template, err)
	}
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	if len(lines) != 8 {
		t.Fatalf("%d lines, want one per GPU:\n%s", len(lines), out.String())
	}
	for _, line := range lines {
		fields := strings.Split(line, "\t")
		switch {
		case len(fields) != 3:
			t.Errorf("line %q: want the device, the fault and the time, tab-separated", line)
		case fields[0] == "gpu-5":
			if _, err := time.Parse(time.RFC3339, fields[2]); fields[1] != "xid-79" || err != nil {
				t.Errorf("line %q: want gpu-5 with xid-79 and the time it was tainted", line)
			}
		case fields[1] != "" || fields[2] != "":
			t.Errorf("line %q: a fault on a healthy GPU", line)
		}
	}
}
