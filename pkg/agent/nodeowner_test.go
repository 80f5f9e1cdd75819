package agent_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	cgotesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
)

// TestNodeUnreadableAtStartThenRecreated: the agent cannot read its Node
// when it starts, so the resourceslice controller looks the Node up
// itself; the Node is then deleted and created again. At its next node
// check the agent finds its slices owned by the old Node, publishes them
// owned by the new one and says so; where the slices are owned by the
// Node as it is, it changes nothing. Where the controller has looked up
// the Node but not written a slice yet when the Node is created again,
// the slices it writes then are owned by the new Node.
func TestNodeUnreadableAtStartThenRecreated(t *testing.T) {
	for _, recreated := range []bool{false, true} {
		t.Run(map[bool]string{false: "same Node", true: "recreated"}[recreated], func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			e := newEnv(t)
			recorder := events.NewFakeRecorder(10)
			e.recorder = recorder
			failFirstNodeRead(e)
			a := e.start(ctx, t)
			owners := ownersOf(ctx, t, e)
			// The controller looked the Node up itself.
			waitForOwner(ctx, t, owners, "node-uid")

			if !recreated {
				if err := a.CheckNode(ctx); err != nil {
					t.Fatal(err)
				}
				select {
				case ev := <-recorder.Events:
					t.Errorf("event %q with the slices owned by the Node as it is", ev)
				case <-time.After(100 * time.Millisecond):
				}
				if got := owners(); len(got) != 1 || got[0] != "node-uid" {
					t.Errorf("slices owned by %v after the check, want by node-uid alone", got)
				}
				return
			}

			recreateNodeAndCheck(ctx, t, e, a)
			if ev := expectEvent(t, recorder); !strings.Contains(ev, "Normal "+agent.ReasonNodeRecreated) || !strings.Contains(ev, "node-uid-2") {
				t.Errorf("event %q, want %s naming the new UID", ev, agent.ReasonNodeRecreated)
			}
			waitForOwner(ctx, t, owners, "node-uid-2")
			if devices := publishedDevices(ctx, e); len(devices) != 8 {
				t.Errorf("%d devices published under the new Node, want 8", len(devices))
			}
		})
	}
}

// TestNodeRecreatedBeforeFirstSlice: the agent cannot read its Node when
// it starts; the resourceslice controller looks the Node up but cannot
// write a slice yet when the Node is deleted and created again. The
// agent's next node check, which finds no slice owned by another Node,
// still has the slices written owned by the new Node (the garbage
// collector would delete those of the old one, again and again).
func TestNodeRecreatedBeforeFirstSlice(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	var blockCreates atomic.Bool
	var creates atomic.Int32
	blockCreates.Store(true)
	failFirstNodeRead(e)
	e.client.PrependReactor("create", "resourceslices", func(cgotesting.Action) (bool, runtime.Object, error) {
		creates.Add(1)
		if blockCreates.Load() {
			return true, nil, apierrors.NewServiceUnavailable("the API server is busy")
		}
		return false, nil, nil
	})
	a := e.start(ctx, t)
	// The controller has looked up the Node once it tries to write.
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return creates.Load() > 0, nil
	}); err != nil {
		t.Fatal("the controller never tried to write a slice")
	}
	recreateNodeAndCheck(ctx, t, e, a)
	blockCreates.Store(false)
	owners := ownersOf(ctx, t, e)
	waitForOwner(ctx, t, owners, "node-uid-2")
	if devices := publishedDevices(ctx, e); len(devices) != 8 {
		t.Errorf("%d devices published, want 8", len(devices))
	}
}

// ownersOf returns a function that lists the UIDs of the owners of the
// slices in the API.
func ownersOf(ctx context.Context, t *testing.T, e *env) func() []types.UID {
	return func() (uids []types.UID) {
		list, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range list.Items {
			for _, ref := range s.OwnerReferences {
				uids = append(uids, ref.UID)
			}
		}
		return uids
	}
}

// waitForOwner waits until the slices are owned by the Node of uid alone.
func waitForOwner(ctx context.Context, t *testing.T, owners func() []types.UID, uid types.UID) {
	t.Helper()
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		got := owners()
		return len(got) == 1 && got[0] == uid, nil
	}); err != nil {
		t.Fatalf("slices owned by %v, want by %s alone", owners(), uid)
	}
}

// failFirstNodeRead makes the first read of a Node fail, as while the API
// server starts.
func failFirstNodeRead(e *env) {
	var failed atomic.Bool
	e.client.PrependReactor("get", "nodes", func(cgotesting.Action) (bool, runtime.Object, error) {
		if failed.CompareAndSwap(false, true) {
			return true, nil, apierrors.NewServiceUnavailable("the API server is starting")
		}
		return false, nil, nil
	})
}

// recreateNodeAndCheck deletes the Node and creates it again with UID
// node-uid-2, then has the agent check its Node.
func recreateNodeAndCheck(ctx context.Context, t *testing.T, e *env, a *agent.Agent) {
	t.Helper()
	if err := e.client.CoreV1().Nodes().Delete(ctx, nodeName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.CoreV1().Nodes().Create(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName, UID: "node-uid-2"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := a.CheckNode(ctx); err != nil {
		t.Fatal(err)
	}
}
