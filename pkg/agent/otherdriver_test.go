package agent_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	clienttesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/topology"
)

// nvidiaDriver is the driver name of NVIDIA's DRA driver.
const nvidiaDriver = "gpu.nvidia.com"

// otherSlice is a slice of driver on node with one device per entry of
// devices: its name, then attribute name and value pairs.
func otherSlice(name, driver, node string, devices ...[]string) *resourceapi.ResourceSlice {
	s := &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourceapi.ResourceSliceSpec{
			Driver:   driver,
			NodeName: ptr.To(node),
			Pool:     resourceapi.ResourcePool{Name: node, ResourceSliceCount: 1},
		},
	}
	for _, d := range devices {
		dev := resourceapi.Device{Name: d[0], Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{}}
		for i := 1; i+1 < len(d); i += 2 {
			dev.Attributes[resourceapi.QualifiedName(d[i])] = resourceapi.DeviceAttribute{StringValue: ptr.To(d[i+1])}
		}
		s.Spec.Devices = append(s.Spec.Devices, dev)
	}
	return s
}

// selectSlicesByFields makes client's lists and watches of ResourceSlices
// honor field selectors on spec.nodeName and spec.driver as the API
// server does: without it the agent's resourceslice controller, which
// lists its driver's slices, would take another driver's for its own and
// delete them.
func selectSlicesByFields(client *fake.Clientset) {
	gvr := resourceapi.SchemeGroupVersion.WithResource("resourceslices")
	matches := func(sel fields.Selector, obj runtime.Object) bool {
		s, ok := obj.(*resourceapi.ResourceSlice)
		return !ok || sel == nil || sel.Matches(fields.Set{
			resourceapi.ResourceSliceSelectorNodeName: ptr.Deref(s.Spec.NodeName, ""),
			resourceapi.ResourceSliceSelectorDriver:   s.Spec.Driver,
		})
	}
	client.PrependReactor("list", "resourceslices", func(action clienttesting.Action) (bool, runtime.Object, error) {
		list := action.(clienttesting.ListActionImpl)
		obj, err := client.Tracker().List(gvr, list.GetKind(), "", list.ListOptions)
		if err != nil {
			return true, nil, err
		}
		slices := obj.(*resourceapi.ResourceSliceList)
		var kept []resourceapi.ResourceSlice
		for _, s := range slices.Items {
			if matches(list.GetListRestrictions().Fields, &s) {
				kept = append(kept, s)
			}
		}
		slices.Items = kept
		return true, slices, nil
	})
	client.PrependWatchReactor("resourceslices", func(action clienttesting.Action) (bool, watch.Interface, error) {
		w := action.(clienttesting.WatchActionImpl)
		watcher, err := client.Tracker().Watch(gvr, "", w.ListOptions)
		if err != nil {
			return true, nil, err
		}
		sel := w.GetWatchRestrictions().Fields
		return true, watch.Filter(watcher, func(ev watch.Event) (watch.Event, bool) { return ev, matches(sel, ev.Object) }), nil
	})
}

// TestOtherDriverTaintsDevices: NVIDIA's DRA driver publishes GPUs of the
// node as well: a device of its slice whose resource.kubernetes.io/pciBusID
// or uuid is that of one of the agent's GPUs gets that GPU tainted
// OtherDriverTaintKey (value: the driver) from the first write of the
// agent's slice on, the Node a Warning naming the driver and the devices,
// and a new claim on it is refused with a Warning on the claim, while a
// claim with admin access is prepared; other GPUs, another node's slice
// and the agent's own slices change nothing. A device that the other
// driver adds later is tainted too; once its slices are gone, the taints
// go and a Normal event says so.
func TestOtherDriverTaintsDevices(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(10)
	e.recorder = recorder
	e.otherDriverCheck = true
	m := e.machine
	selectSlicesByFields(e.client)

	// Every write of the agent's slice, with its tainted devices.
	var mutex sync.Mutex
	var writes [][]string
	e.client.PrependReactor("*", "resourceslices", func(action clienttesting.Action) (bool, runtime.Object, error) {
		var obj runtime.Object
		switch a := action.(type) {
		case clienttesting.CreateAction:
			obj = a.GetObject()
		case clienttesting.UpdateAction:
			obj = a.GetObject()
		default:
			return false, nil, nil
		}
		if s, ok := obj.(*resourceapi.ResourceSlice); ok && s.Spec.Driver == topology.DriverName {
			var tainted []string
			for _, d := range s.Spec.Devices {
				if hasTaint(d.Taints, agent.OtherDriverTaintKey) {
					tainted = append(tainted, d.Name)
				}
			}
			mutex.Lock()
			writes = append(writes, tainted)
			mutex.Unlock()
		}
		return false, nil, nil
	})
	// tainted maps the published devices with the taint to its value.
	tainted := func(a *agent.Agent) map[string]string {
		got := map[string]string{}
		for _, d := range a.Resources().Pools[nodeName].Slices[0].Devices {
			for _, taint := range d.Taints {
				if taint.Key == agent.OtherDriverTaintKey && taint.Effect == resourceapi.DeviceTaintEffectNoSchedule {
					got[d.Name] = taint.Value
				}
			}
		}
		return got
	}
	// awaitWritten polls until the agent's last write taints want.
	awaitWritten := func(want ...string) {
		t.Helper()
		var last []string
		if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			mutex.Lock()
			defer mutex.Unlock()
			if len(writes) == 0 {
				return false, nil
			}
			last = writes[len(writes)-1]
			return slices.Equal(last, want), nil
		}); err != nil {
			t.Fatalf("the agent's slice was last written with %v tainted, want %v", last, want)
		}
	}
	create := func(s *resourceapi.ResourceSlice) {
		t.Helper()
		if _, err := e.client.ResourceV1().ResourceSlices().Create(ctx, s, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	// gpu-2 by its bus id (as NVML spells it: the agent compares them
	// canonical), gpu-5 by its UUID only; a GPU the agent does not have,
	// and another node's slice with gpu-3's bus id, match nothing.
	nvidia := otherSlice("node-1-gpu.nvidia.com", nvidiaDriver, nodeName,
		[]string{"gpu-0", "resource.kubernetes.io/pciBusID", "0000:52:00.0", "uuid", "GPU-elsewhere"},
		[]string{"gpu-1", "uuid", m.UUID(5)},
		[]string{"gpu-2", "resource.kubernetes.io/pciBusID", "0000:ee:00.0"},
		[]string{"no-id"},
	)
	create(nvidia)
	create(otherSlice("node-2-gpu.nvidia.com", nvidiaDriver, "node-2", []string{"gpu-0", "resource.kubernetes.io/pciBusID", "0000:61:00.0"}))

	a := e.start(ctx, t)
	if got, want := tainted(a), map[string]string{"gpu-2": nvidiaDriver, "gpu-5": nvidiaDriver}; !mapsEqual(got, want) {
		t.Errorf("tainted %v, want %v", got, want)
	}
	awaitWritten("gpu-2", "gpu-5")
	mutex.Lock()
	for i, w := range writes {
		if !slices.Equal(w, []string{"gpu-2", "gpu-5"}) {
			t.Errorf("write %d of the agent's slice tainted %v, want gpu-2 and gpu-5 from the first write on", i, w)
		}
	}
	mutex.Unlock()
	ev := expectEvent(t, recorder)
	for _, want := range []string{"Warning " + agent.ReasonOtherDriver, nvidiaDriver, "gpu-2", "gpu-5", "node-1/gpu-0", "node-1/gpu-1", m.UUID(2), "remove the other driver"} {
		if !strings.Contains(ev, want) {
			t.Errorf("event %q does not say %q", ev, want)
		}
	}
	if strings.Contains(ev, "gpu-3") {
		t.Errorf("event %q names gpu-3, which only another node's slice lists", ev)
	}

	// A claim allocated gpu-2 is refused, with a warning on the claim; one
	// with admin access, and one on a GPU no other driver has, are not.
	during := claim("during", gpus("gpus", "gpu-2")...)
	if err := prepareOne(ctx, t, a, during); !errors.Is(err, agent.ErrOtherDriverConflict) || !strings.Contains(err.Error(), nvidiaDriver+" device node-1/gpu-0") {
		t.Errorf("prepare of gpu-2: %v, want ErrOtherDriverConflict naming the other driver's device", err)
	}
	if ev := expectEvent(t, recorder); !strings.Contains(ev, "Warning "+agent.ReasonOtherDriverAllocated) || !strings.Contains(ev, "gpu-2") {
		t.Errorf("event %q, want a %s warning naming gpu-2", ev, agent.ReasonOtherDriverAllocated)
	}
	if err := prepareOne(ctx, t, a, claim("admin", alloc{request: "gpus", device: "gpu-5", admin: true})); err != nil {
		t.Errorf("prepare of an admin-access claim on gpu-5: %v", err)
	}
	if err := prepareOne(ctx, t, a, claim("free", gpus("gpus", "gpu-1")...)); err != nil {
		t.Errorf("prepare of gpu-1, which no other driver publishes: %v", err)
	}

	// The other driver publishes gpu-7 too: the watch sees it.
	nvidia.Spec.Devices = append(nvidia.Spec.Devices, otherSlice("", "", "", []string{"gpu-3", "resource.kubernetes.io/pciBusID", "0000:df:00.0"}).Spec.Devices...)
	if _, err := e.client.ResourceV1().ResourceSlices().Update(ctx, nvidia, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	awaitWritten("gpu-2", "gpu-5", "gpu-7")
	if ev := expectEvent(t, recorder); !strings.Contains(ev, "Warning "+agent.ReasonOtherDriver) || !strings.Contains(ev, "gpu-7") {
		t.Errorf("event %q, want a %s warning naming gpu-7", ev, agent.ReasonOtherDriver)
	}

	// The other driver leaves the node.
	if err := e.client.ResourceV1().ResourceSlices().Delete(ctx, nvidia.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	awaitWritten()
	if got := tainted(a); len(got) != 0 {
		t.Errorf("other driver gone: tainted %v", got)
	}
	if ev := expectEvent(t, recorder); !strings.Contains(ev, "Normal "+agent.ReasonOtherDriverGone) {
		t.Errorf("event %q, want %s", ev, agent.ReasonOtherDriverGone)
	}
	if err := prepareOne(ctx, t, a, during); err != nil {
		t.Errorf("prepare of gpu-2 once the other driver is gone: %v", err)
	}
	select {
	case ev := <-recorder.Events:
		t.Errorf("unexpected event %q", ev)
	default:
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}
