package agent_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	eventsv1 "k8s.io/api/events/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/discovery"
)

// broadcastEvents sends the events of e's agent through a real event
// broadcaster (which counts an event like one it sent shortly before as a
// repetition, keeping the first one's note) to e's fake API server, as the
// node agent command does.
func broadcastEvents(ctx context.Context, t *testing.T, e *env) {
	t.Helper()
	broadcaster := events.NewBroadcaster(&events.EventSinkImpl{Interface: e.client.EventsV1()})
	broadcaster.StartRecordingToSink(ctx.Done())
	t.Cleanup(broadcaster.Shutdown)
	e.recorder = broadcaster.NewRecorder(scheme.Scheme, "topodra-node-agent")
}

// waitForStoredEvent waits until the API server has an event with reason,
// regarding an object of kind, whose note contains each of want.
func waitForStoredEvent(ctx context.Context, t *testing.T, e *env, reason, kind string, want ...string) eventsv1.Event {
	t.Helper()
	var found eventsv1.Event
	var notes []string
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
		list, err := e.client.EventsV1().Events("").List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		notes = nil
		for _, ev := range list.Items {
			if ev.Reason != reason || ev.Regarding.Kind != kind {
				continue
			}
			notes = append(notes, ev.Note)
			all := true
			for _, w := range want {
				all = all && strings.Contains(ev.Note, w)
			}
			if all {
				found = ev
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		t.Fatalf("no %s event on a %s with %q in the API; there are: %q", reason, kind, want, notes)
	}
	return found
}

// checkOnNode fails unless ev regards the Node the way kubectl describe
// node finds its events: kind Node, the node's name, the name as UID.
func checkOnNode(t *testing.T, ev eventsv1.Event) {
	t.Helper()
	if r := ev.Regarding; r.Kind != "Node" || r.Name != nodeName || r.UID != types.UID(nodeName) {
		t.Errorf("%s event regards %+v, want Node %s with UID %s", ev.Reason, r, nodeName, nodeName)
	}
}

// TestEventsPerDeviceAndClaim: Node events about different GPUs or claims,
// recorded within minutes of each other, all reach the API server with
// their own notes, as do the events on a claim about two of its GPUs.
func TestEventsPerDeviceAndClaim(t *testing.T) {
	t.Run("unhealthy GPUs", func(t *testing.T) {
		_, ctx := ktesting.NewTestContext(t)
		e := newEnv(t)
		broadcastEvents(ctx, t, e)
		a := e.start(ctx, t)
		both := claim("both", gpus("gpus", "gpu-0", "gpu-3")...)
		if err := prepareOne(ctx, t, a, both); err != nil {
			t.Fatalf("prepare: %v", err)
		}
		for _, gpu := range []int{0, 3} {
			device := fmt.Sprintf("gpu-%d", gpu)
			injectXIDOnceWatched(ctx, t, e, gpu, 79)
			waitForHealthTaint(ctx, t, a, device, "xid-79")
			checkOnNode(t, waitForStoredEvent(ctx, t, e, agent.ReasonDeviceUnhealthy, "Node", "devices "+device+" are unhealthy"))
			waitForStoredEvent(ctx, t, e, agent.ReasonDeviceUnhealthy, "ResourceClaim", "device "+device+" on node")
		}
	})

	t.Run("stale claims", func(t *testing.T) {
		_, ctx := ktesting.NewTestContext(t)
		e := newEnv(t)
		broadcastEvents(ctx, t, e)
		e.staleClaimGrace = time.Nanosecond
		a := e.start(ctx, t)
		var claims []*resourceapi.ResourceClaim
		for i, name := range []string{"gone-a", "gone-b"} {
			c := claim(name, gpus("gpus", fmt.Sprintf("gpu-%d", i+1))...)
			if err := prepareOne(ctx, t, a, c); err != nil {
				t.Fatalf("prepare %s: %v", name, err)
			}
			claims = append(claims, c)
		}
		// The first check finds them gone, the second one drops them.
		for range 2 {
			if _, err := a.CleanupStaleClaims(ctx); err != nil {
				t.Fatal(err)
			}
		}
		for _, c := range claims {
			for _, reason := range []string{agent.ReasonPreparedClaimGone, agent.ReasonPreparedClaimDropped} {
				ev := waitForStoredEvent(ctx, t, e, reason, "Node", c.Namespace+"/"+c.Name)
				checkOnNode(t, ev)
				if r := ev.Related; r == nil || r.Kind != "ResourceClaim" || r.Name != c.Name || r.UID != c.UID {
					t.Errorf("%s event about %s has related object %+v, want the claim", reason, c.Name, r)
				}
			}
		}
	})

	t.Run("device node missing", func(t *testing.T) {
		_, ctx := ktesting.NewTestContext(t)
		e := newEnv(t)
		broadcastEvents(ctx, t, e)
		gen := &failingGenerator{Generator: cdi.Static{DevRoot: e.devRoot}, err: errUVM}
		gen.missing.Store(true)
		e.generator = gen
		a := e.start(ctx, t)
		for _, c := range []*resourceapi.ResourceClaim{claim("first", gpus("gpus", "gpu-0")...), claim("second", gpus("gpus", "gpu-1")...)} {
			if err := prepareOne(ctx, t, a, c); err == nil {
				t.Fatalf("prepare %s without nvidia-uvm succeeded", c.Name)
			}
			checkOnNode(t, waitForStoredEvent(ctx, t, e, agent.ReasonDeviceNodeMissing, "Node", "claim "+c.Namespace+"/"+c.Name))
		}
	})
}

// TestNoGPUEventPerCause: while a driver installs, discovery fails first
// for want of the library, then for want of the kernel driver; each cause
// reaches the API server with its own note (the event broadcaster would
// fold the second into the first and keep the first's note were they the
// same series), and a cause that repeats folds into its own.
func TestNoGPUEventPerCause(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	broadcastEvents(ctx, t, e)
	var opens atomic.Int32
	lazy := discovery.NewLazy(func() (nvml.Interface, error) {
		if opens.Add(1) <= 2 {
			return nil, fmt.Errorf("%w: libnvidia-ml.so.1 not found in driver root /driver-root", discovery.ErrNoGPU)
		}
		return nil, fmt.Errorf("%w: NVML: Driver Not Loaded", discovery.ErrNoGPU)
	}, discovery.NVMLOptions{Sysfs: e.machine.Sysfs()})
	a, err := agent.New(ctx, agent.Options{
		NodeName:       nodeName,
		KubeClient:     e.client,
		Discovery:      lazy,
		PublishOnly:    true,
		Recorder:       e.recorder,
		RescanInterval: time.Hour,
		NoGPURetry:     10 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Stop)
	first := waitForStoredEvent(ctx, t, e, agent.ReasonNoGPU, "Node", "libnvidia-ml.so.1")
	second := waitForStoredEvent(ctx, t, e, agent.ReasonNoGPU, "Node", "Driver Not Loaded")
	checkOnNode(t, second)
	if first.Name == second.Name {
		t.Errorf("both causes in one event %s", first.Name)
	}
}
