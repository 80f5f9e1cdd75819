package agent_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"
	cgotesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/topology"
)

// TestDroppedFieldsReported: an API server without DRADeviceTaints stores
// the published slice without its device taints; the agent records one
// Warning on the Node that names the feature gate and the missing owned
// and health taints, also when the kubelet plugin helper reports the same
// problem again, and keeps running.
func TestDroppedFieldsReported(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(10)
	e.recorder = recorder
	e.ownedTaint = true
	var dropped *resourceslice.DroppedFieldsError
	for _, verb := range []string{"create", "update"} {
		e.client.PrependReactor(verb, "resourceslices", func(action cgotesting.Action) (bool, runtime.Object, error) {
			slice := action.(interface{ GetObject() runtime.Object }).GetObject().(*resourceapi.ResourceSlice).DeepCopy()
			desired := slice.DeepCopy()
			for i := range slice.Spec.Devices {
				slice.Spec.Devices[i].Taints = nil
			}
			if dropped == nil {
				dropped = &resourceslice.DroppedFieldsError{PoolName: nodeName, DesiredSlice: desired, ActualSlice: slice}
			}
			gvr := resourceapi.SchemeGroupVersion.WithResource("resourceslices")
			var err error
			if verb == "create" {
				if slice.Name == "" {
					slice.Name = slice.GenerateName + "x"
				}
				err = e.client.Tracker().Create(gvr, slice, "")
			} else {
				err = e.client.Tracker().Update(gvr, slice, "")
			}
			return true, slice, err
		})
	}
	a := e.start(ctx, t)
	ev := expectEvent(t, recorder)
	t.Logf("event: %s", ev)
	for _, want := range []string{"Warning " + agent.ReasonSliceFieldsDropped, "DRADeviceTaints", topology.DefaultTaintKey, agent.HealthTaintKey, "double-book"} {
		if !strings.Contains(ev, want) {
			t.Errorf("event %q does not contain %q", ev, want)
		}
	}
	// The kubelet plugin helper reports it wrapped as recoverable: no
	// second event, and the agent runs on.
	a.HandleError(ctx, fmt.Errorf("%w: %w", kubeletplugin.ErrRecoverable, dropped), "publish")
	if evs := drainEvents(recorder); len(evs) != 0 {
		t.Errorf("second report of the same problem: events %q", evs)
	}
	if err := a.Ready(); err != nil {
		t.Errorf("not ready: %v", err)
	}
	if errors.Is(a.Err(), kubeletplugin.ErrRecoverable) {
		t.Errorf("agent stopped: %v", a.Err())
	}
}
