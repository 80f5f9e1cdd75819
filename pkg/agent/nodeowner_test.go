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
// Node as it is, it changes nothing.
func TestNodeUnreadableAtStartThenRecreated(t *testing.T) {
	for _, recreated := range []bool{false, true} {
		t.Run(map[bool]string{false: "same Node", true: "recreated"}[recreated], func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			e := newEnv(t)
			recorder := events.NewFakeRecorder(10)
			e.recorder = recorder
			var failed atomic.Bool
			e.client.PrependReactor("get", "nodes", func(cgotesting.Action) (bool, runtime.Object, error) {
				if failed.CompareAndSwap(false, true) {
					return true, nil, apierrors.NewServiceUnavailable("the API server is starting")
				}
				return false, nil, nil
			})
			a := e.start(ctx, t)
			owners := func() (uids []types.UID) {
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
			waitForOwner := func(uid types.UID) {
				t.Helper()
				if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
					got := owners()
					return len(got) == 1 && got[0] == uid, nil
				}); err != nil {
					t.Fatalf("slices owned by %v, want by %s alone", owners(), uid)
				}
			}
			// The controller looked the Node up itself.
			waitForOwner("node-uid")

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

			if err := e.client.CoreV1().Nodes().Delete(ctx, nodeName, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
			if _, err := e.client.CoreV1().Nodes().Create(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName, UID: "node-uid-2"}}, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			if err := a.CheckNode(ctx); err != nil {
				t.Fatal(err)
			}
			if ev := expectEvent(t, recorder); !strings.Contains(ev, "Normal "+agent.ReasonNodeRecreated) || !strings.Contains(ev, "node-uid-2") {
				t.Errorf("event %q, want %s naming the new UID", ev, agent.ReasonNodeRecreated)
			}
			waitForOwner("node-uid-2")
			if devices := publishedDevices(ctx, e); len(devices) != 8 {
				t.Errorf("%d devices published under the new Node, want 8", len(devices))
			}
		})
	}
}
