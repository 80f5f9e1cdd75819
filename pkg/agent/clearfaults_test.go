package agent_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/kubernetes/test/utils/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/checkpoint"
)

// clearEnv is an agent with a recorder and the helpers of the
// clear-faults tests.
type clearEnv struct {
	*env
	t        *testing.T
	ctx      context.Context
	recorder *events.FakeRecorder
}

func newClearEnv(t *testing.T) (*clearEnv, *agent.Agent) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	e.recorder = events.NewFakeRecorder(100)
	return &clearEnv{env: e, t: t, ctx: ctx, recorder: e.recorder.(*events.FakeRecorder)}, e.start(ctx, t)
}

// annotate sets the Node's ClearFaultsAnnotation; "" removes it.
func (c *clearEnv) annotate(value string) {
	c.t.Helper()
	node, err := c.client.CoreV1().Nodes().Get(c.ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		c.t.Fatal(err)
	}
	if value == "" {
		delete(node.Annotations, agent.ClearFaultsAnnotation)
	} else {
		metav1.SetMetaDataAnnotation(&node.ObjectMeta, agent.ClearFaultsAnnotation, value)
	}
	if _, err := c.client.CoreV1().Nodes().Update(c.ctx, node, metav1.UpdateOptions{}); err != nil {
		c.t.Fatal(err)
	}
}

// check runs a Node check and returns the events about clearing faults
// that it recorded (a fault's own events may still come in meanwhile).
func (c *clearEnv) check(a *agent.Agent) []string {
	c.t.Helper()
	drainEvents(c.recorder)
	if err := a.CheckNode(c.ctx); err != nil {
		c.t.Fatal(err)
	}
	var out []string
	for _, ev := range drainEvents(c.recorder) {
		if strings.Contains(ev, agent.ReasonFaultsCleared) || strings.Contains(ev, agent.ReasonClearFaultsRefused) {
			out = append(out, ev)
		}
	}
	return out
}

// taints checks the health taints of devices.
func (c *clearEnv) taints(a *agent.Agent, want map[string]string) {
	c.t.Helper()
	for device, value := range want {
		if got := healthTaint(c.t, a, device); got != value {
			c.t.Errorf("%s: health taint %q, want %q", device, got, value)
		}
	}
}

// xid makes a GPU report a critical XID once the agent watches its health.
func (c *clearEnv) xid(gpu int, xid uint64) {
	c.t.Helper()
	injectXIDOnceWatched(c.ctx, c.t, c.env, gpu, xid)
}

// nextSecond waits until the next whole second and returns it, as an
// annotation's time.
func nextSecond() (time.Time, string) {
	t := time.Now().Truncate(time.Second).Add(time.Second)
	time.Sleep(time.Until(t))
	return t, t.UTC().Format(time.RFC3339)
}

// oneEvent checks that evs is one event of the reason that contains all
// of want and none of wantNot.
func oneEvent(t *testing.T, what string, evs []string, prefix string, want []string, wantNot ...string) {
	t.Helper()
	ok := len(evs) == 1 && strings.HasPrefix(evs[0], prefix)
	for _, w := range want {
		ok = ok && strings.Contains(evs[0], w)
	}
	for _, w := range wantNot {
		ok = ok && !strings.Contains(evs[0], w)
	}
	if !ok {
		t.Errorf("%s: events %q, want one %q naming %q and not %q", what, evs, prefix, want, wantNot)
	}
}

// TestClearFaultsAnnotation: an admin who reset a faulty GPU puts it back
// in service with the Node annotation gpu.topodra.io/clear-faults: the
// faults named (by device name or UUID; all without a list) last reported
// before its time are cleared at the next Node check and at start, the
// health taint goes, the kubelet gets the GPU as Healthy, the checkpoint
// forgets the fault (a restarted agent does not taint it again) and the
// Node gets a Normal event naming it. A fault reported after the time,
// first or again, stays while the annotation does, across restarts. A
// value that cannot be read, a time after the annotation was set (refused
// for as long as the value stays), a GPU the node does not have and a
// value that clears nothing clear nothing and get one Warning each.
func TestClearFaultsAnnotation(t *testing.T) {
	c, a := newClearEnv(t)
	c.xid(3, 79)
	waitForHealthTaint(c.ctx, t, a, "gpu-3", "xid-79")
	c.xid(5, 48)
	waitForHealthTaint(c.ctx, t, a, "gpu-5", "xid-48")
	_, t1 := nextSecond()
	refused := "Warning " + agent.ReasonClearFaultsRefused
	cleared := "Normal " + agent.ReasonFaultsCleared

	// A time ahead of the clock, refused, stays refused once it has
	// passed, as long as the value stays.
	aheadTime := time.Now().Truncate(time.Second).Add(2 * time.Second)
	ahead := aheadTime.UTC().Format(time.RFC3339)
	c.annotate(ahead)
	oneEvent(t, "a time ahead", c.check(a), refused, []string{fmt.Sprintf("%s=%q", agent.ClearFaultsAnnotation, ahead), "ahead of when the annotation was set"})
	time.Sleep(time.Until(aheadTime.Add(time.Second)))
	if evs := c.check(a); len(evs) != 0 {
		t.Errorf("a refused value whose time has passed: events %q, want none", evs)
	}
	c.taints(a, map[string]string{"gpu-3": "xid-79", "gpu-5": "xid-48"})

	for _, value := range []string{"yesterday", "", t1 + " gpu-5,", t1 + " gpu-5 gpu-3", t1 + " gpu-9"} {
		node, err := c.client.CoreV1().Nodes().Get(c.ctx, nodeName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		// An empty value is a value too.
		metav1.SetMetaDataAnnotation(&node.ObjectMeta, agent.ClearFaultsAnnotation, value)
		if _, err := c.client.CoreV1().Nodes().Update(c.ctx, node, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		oneEvent(t, "annotation "+value, c.check(a), refused, []string{fmt.Sprintf("%s=%q", agent.ClearFaultsAnnotation, value)})
		c.taints(a, map[string]string{"gpu-3": "xid-79", "gpu-5": "xid-48"})
		if evs := c.check(a); len(evs) != 0 {
			t.Errorf("annotation %q checked again: events %q, want none", value, evs)
		}
	}

	c.annotate(t1 + " gpu-5")
	oneEvent(t, "gpu-5 cleared", c.check(a), cleared, []string{"gpu-5 " + c.machine.UUID(5) + " (xid-48"}, "gpu-3")
	c.taints(a, map[string]string{"gpu-3": "xid-79", "gpu-5": ""})
	waitForHealthReport(c.ctx, t, a, "gpu-5 Healthy, gpu-3 Unhealthy", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h["gpu-5"].Health == kubeletplugin.HealthStatusHealthy && h["gpu-3"].Health == kubeletplugin.HealthStatusUnhealthy
	})

	// The checkpoint forgot gpu-5's fault, not gpu-3's.
	c.annotate("")
	a.Stop()
	a = c.start(c.ctx, t)
	c.taints(a, map[string]string{"gpu-3": "xid-79", "gpu-5": ""})

	// gpu-3 reports again after T1 and is not cleared by T1, also after a
	// restart; gpu-5's new fault after T1 is not cleared by T1 either.
	c.xid(3, 48)
	store, err := checkpoint.New(c.stateDir)
	if err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(c.ctx, 20*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		cp, err := store.Load()
		return err == nil && cp.Faults[c.machine.UUID(3)].Time.UTC().Format(time.RFC3339) >= t1, nil
	}); err != nil {
		t.Fatalf("the checkpoint does not record gpu-3's second report: %v", err)
	}
	c.xid(5, 94)
	waitForHealthTaint(c.ctx, t, a, "gpu-5", "xid-94")
	c.annotate(t1 + " gpu-3," + strings.ToLower(c.machine.UUID(5)))
	oneEvent(t, "faults reported after T1", c.check(a), refused, []string{"no GPU fault cleared", "gpu-3", "xid-94"})
	c.taints(a, map[string]string{"gpu-3": "xid-79", "gpu-5": "xid-94"})
	a.Stop()
	a = c.start(c.ctx, t)
	c.taints(a, map[string]string{"gpu-3": "xid-79", "gpu-5": "xid-94"})

	// Without a list, every fault last reported before the time goes.
	_, t2 := nextSecond()
	c.annotate(t2)
	oneEvent(t, "all before T2", c.check(a), cleared, []string{"gpu-3", "gpu-5"})
	c.taints(a, map[string]string{"gpu-3": "", "gpu-5": ""})

	// At start, before the first publish.
	c.xid(6, 95)
	waitForHealthTaint(c.ctx, t, a, "gpu-6", "xid-95")
	a.Stop()
	_, t3 := nextSecond()
	c.annotate(t3 + " gpu-6")
	a = c.start(c.ctx, t)
	c.taints(a, map[string]string{"gpu-6": ""})
}

// TestClearFaultsRenamedGPU: a device name in the annotation is the name
// a GPU has now. A GPU whose minor number changed within the boot (a
// driver reload) is cleared by its new name; its old name, now nobody's,
// names no GPU.
func TestClearFaultsRenamedGPU(t *testing.T) {
	c, a := newClearEnv(t)
	c.xid(3, 79)
	waitForHealthTaint(c.ctx, t, a, "gpu-3", "xid-79")
	c.machine.SetMinor(3, 9)
	if err := a.Rescan(c.ctx); err != nil {
		t.Fatal(err)
	}
	waitForHealthTaint(c.ctx, t, a, "gpu-9", "xid-79")
	_, now := nextSecond()
	c.annotate(now + " gpu-3")
	oneEvent(t, "old name", c.check(a), "Warning "+agent.ReasonClearFaultsRefused, []string{"names no GPU of this node: gpu-3"})
	c.taints(a, map[string]string{"gpu-9": "xid-79"})
	c.annotate(now + " gpu-9")
	oneEvent(t, "new name", c.check(a), "Normal "+agent.ReasonFaultsCleared, []string{"gpu-9 (gpu-3 at the fault) " + c.machine.UUID(3)})
	c.taints(a, map[string]string{"gpu-9": ""})
}

// TestClearFaultsKeptWhileCheckpointUnwritable: a clear while the
// checkpoint cannot be read or written takes effect at once and reaches
// the checkpoint once it can be written: a restarted agent does not taint
// the GPU again, although the annotation is gone by then.
func TestClearFaultsKeptWhileCheckpointUnwritable(t *testing.T) {
	c, a := newClearEnv(t)
	c.xid(5, 48)
	waitForHealthTaint(c.ctx, t, a, "gpu-5", "xid-48")
	store, err := checkpoint.New(c.stateDir)
	if err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(c.ctx, 20*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		cp, err := store.Load()
		return err == nil && cp.Faults[c.machine.UUID(5)].Reason == "xid-48", nil
	}); err != nil {
		t.Fatalf("the checkpoint does not record gpu-5's fault: %v", err)
	}
	path := filepath.Join(c.stateDir, checkpoint.FileName)
	good, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("{not a checkpoint"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, now := nextSecond()
	c.annotate(now + " gpu-5")
	oneEvent(t, "cleared", c.check(a), "Normal "+agent.ReasonFaultsCleared, []string{"gpu-5"})
	c.taints(a, map[string]string{"gpu-5": ""})

	// The file as it was, with the fault: the retry removes it.
	if err := os.WriteFile(path, good, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(c.ctx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		cp, err := store.Load()
		_, faulty := cp.Faults[c.machine.UUID(5)]
		return err == nil && !faulty, nil
	}); err != nil {
		t.Fatalf("the checkpoint still records gpu-5's cleared fault: %v", err)
	}
	c.annotate("")
	a.Stop()
	a = c.start(c.ctx, t)
	c.taints(a, map[string]string{"gpu-5": ""})
}
