package agent_test

import (
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/kubernetes/test/utils/ktesting"

	"github.com/topodra/topodra/pkg/agent"
)

// TestClearFaultsAnnotation: an admin who reset a faulty GPU puts it back
// in service with the Node annotation gpu.topodra.io/clear-faults: the
// faults named (by device name or UUID; all without a list) that were
// recorded before its time are cleared at the next Node check, the health
// taint goes, the kubelet gets the GPU as Healthy, the checkpoint forgets
// the fault (a restarted agent does not taint it again) and the Node gets
// a Normal event naming it. A fault recorded after the time stays while
// the annotation does. A value that cannot be read, a time ahead of the
// node's clock and a GPU the node does not have clear nothing and get one
// Warning each.
func TestClearFaultsAnnotation(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(100)
	e.recorder = recorder
	a := e.start(ctx, t)
	for gpu, xid := range map[int]uint64{3: 79, 5: 48} {
		if err := e.machine.InjectXID(gpu, xid); err != nil {
			t.Fatal(err)
		}
	}
	waitForHealthTaint(ctx, t, a, "gpu-3", "xid-79")
	waitForHealthTaint(ctx, t, a, "gpu-5", "xid-48")
	// T1 is after both faults.
	t1 := time.Now().Truncate(time.Second).Add(time.Second)
	time.Sleep(time.Until(t1))

	annotate := func(value string) {
		t.Helper()
		node, err := e.client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if value == "" {
			delete(node.Annotations, agent.ClearFaultsAnnotation)
		} else {
			metav1.SetMetaDataAnnotation(&node.ObjectMeta, agent.ClearFaultsAnnotation, value)
		}
		if _, err := e.client.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	check := func(a *agent.Agent) []string {
		t.Helper()
		drain(recorder)
		if err := a.CheckNode(ctx); err != nil {
			t.Fatal(err)
		}
		return drain(recorder)
	}
	taints := func(a *agent.Agent, want map[string]string) {
		t.Helper()
		for device, value := range want {
			if got := healthTaint(t, a, device); got != value {
				t.Errorf("%s: health taint %q, want %q", device, got, value)
			}
		}
	}
	stamp := t1.UTC().Format(time.RFC3339)

	for _, value := range []string{
		"yesterday",
		time.Now().Add(time.Hour).UTC().Format(time.RFC3339),
		stamp + " gpu-5,",
		stamp + " gpu-5 gpu-3",
		stamp + " gpu-9",
	} {
		annotate(value)
		evs := check(a)
		taints(a, map[string]string{"gpu-3": "xid-79", "gpu-5": "xid-48"})
		if len(evs) != 1 || !strings.HasPrefix(evs[0], "Warning "+agent.ReasonClearFaultsRefused) || !strings.Contains(evs[0], value) {
			t.Errorf("annotation %q: events %q, want one %s warning quoting it", value, evs, agent.ReasonClearFaultsRefused)
		}
		if evs := check(a); len(evs) != 0 {
			t.Errorf("annotation %q checked again: events %q, want none", value, evs)
		}
	}

	annotate(stamp + " gpu-5")
	evs := check(a)
	taints(a, map[string]string{"gpu-3": "xid-79", "gpu-5": ""})
	if len(evs) != 1 || !strings.HasPrefix(evs[0], "Normal "+agent.ReasonFaultsCleared) || !strings.Contains(evs[0], "gpu-5 "+e.machine.UUID(5)+" (xid-48") || strings.Contains(evs[0], "gpu-3") {
		t.Errorf("events %q, want one %s naming gpu-5's fault only", evs, agent.ReasonFaultsCleared)
	}
	waitForHealthReport(ctx, t, a, "gpu-5 Healthy, gpu-3 Unhealthy", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h["gpu-5"].Health == kubeletplugin.HealthStatusHealthy && h["gpu-3"].Health == kubeletplugin.HealthStatusUnhealthy
	})

	// The checkpoint forgot gpu-5's fault, not gpu-3's.
	annotate("")
	a.Stop()
	a = e.start(ctx, t)
	taints(a, map[string]string{"gpu-3": "xid-79", "gpu-5": ""})

	// A fault after the time stays; the one before, of any GPU without a
	// list, goes; a UUID names a GPU too.
	if err := e.machine.InjectXID(5, 94); err != nil {
		t.Fatal(err)
	}
	waitForHealthTaint(ctx, t, a, "gpu-5", "xid-94")
	annotate(stamp + " " + e.machine.UUID(5))
	if evs := check(a); len(evs) != 0 {
		t.Errorf("a fault after the annotation's time: events %q, want none", evs)
	}
	taints(a, map[string]string{"gpu-3": "xid-79", "gpu-5": "xid-94"})
	annotate(stamp)
	evs = check(a)
	taints(a, map[string]string{"gpu-3": "", "gpu-5": "xid-94"})
	if len(evs) != 1 || !strings.Contains(evs[0], "gpu-3 "+e.machine.UUID(3)+" (xid-79") || strings.Contains(evs[0], "xid-94") {
		t.Errorf("events %q, want one %s naming gpu-3's fault only", evs, agent.ReasonFaultsCleared)
	}

	// At start, before the first publish: an agent restarted with the
	// annotation naming a later time never taints gpu-5 again.
	a.Stop()
	t2 := time.Now().Truncate(time.Second).Add(time.Second)
	time.Sleep(time.Until(t2))
	annotate(t2.UTC().Format(time.RFC3339) + " gpu-5")
	a = e.start(ctx, t)
	taints(a, map[string]string{"gpu-3": "", "gpu-5": ""})
}

// drain returns the events recorded so far.
func drain(r *events.FakeRecorder) []string {
	var out []string
	for {
		select {
		case ev := <-r.Events:
			out = append(out, ev)
		default:
			return out
		}
	}
}
