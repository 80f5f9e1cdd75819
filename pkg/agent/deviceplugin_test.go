package agent_test

import (
	"errors"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apiresource "k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
)

// TestDevicePluginTaintsDevices: a Node whose allocatable has GPUs of
// NVIDIA's device plugin gets every published device tainted
// DevicePluginTaintKey from the first publish on, and a warning event;
// a claim prepared before stays prepared. Once the Node advertises none
// (the plugin gone, its resource at zero), the taint goes and a Normal
// event says so. MIG and time-sliced (nvidia.com/gpu.shared) resources
// count through the prefixes; other extended resources do not. A Node
// that cannot be read at start leaves the devices tainted, with a
// warning, until it can.
func TestDevicePluginTaintsDevices(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(10)
	e.recorder = recorder
	e.devicePlugin = agent.DefaultDevicePluginResources
	setAllocatable := func(list v1.ResourceList) {
		t.Helper()
		node, err := e.client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		node.Status.Allocatable = list
		if _, err := e.client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	tainted := func(a *agent.Agent) (n, of int) {
		devices := a.Resources().Pools[nodeName].Slices[0].Devices
		for _, d := range devices {
			for _, taint := range d.Taints {
				if taint.Key == agent.DevicePluginTaintKey && taint.Effect == resourceapi.DeviceTaintEffectNoSchedule {
					n++
				}
			}
		}
		return n, len(devices)
	}

	setAllocatable(v1.ResourceList{"nvidia.com/gpu": apiresource.MustParse("8"), "example.com/fpga": apiresource.MustParse("1")})
	a := e.start(ctx, t)
	if n, of := tainted(a); n != of || of == 0 {
		t.Errorf("node with nvidia.com/gpu=8: %d of %d devices tainted %s, want all", n, of, agent.DevicePluginTaintKey)
	}
	if ev := expectEvent(t, recorder); !strings.Contains(ev, "Warning "+agent.ReasonDevicePlugin) || !strings.Contains(ev, "nvidia.com/gpu=8") || strings.Contains(ev, "fpga") {
		t.Errorf("event %q, want a %s warning naming nvidia.com/gpu=8 only", ev, agent.ReasonDevicePlugin)
	}
	// A claim allocated a GPU while the device plugin hands it out too is
	// refused, with a warning on the claim; one with admin access is not.
	during := claim("during", gpus("gpus", "gpu-0")...)
	if err := prepareOne(ctx, t, a, during); !errors.Is(err, agent.ErrDevicePluginConflict) || !strings.Contains(err.Error(), "nvidia.com/gpu=8") {
		t.Errorf("prepare while the node advertises nvidia.com/gpu=8: %v, want ErrDevicePluginConflict naming it", err)
	}
	if ev := expectEvent(t, recorder); !strings.Contains(ev, "Warning "+agent.ReasonDevicePluginAllocated) || !strings.Contains(ev, "gpu-0") {
		t.Errorf("event %q, want a %s warning naming gpu-0", ev, agent.ReasonDevicePluginAllocated)
	}
	if err := prepareOne(ctx, t, a, claim("admin", alloc{request: "gpus", device: "gpu-1", admin: true})); err != nil {
		t.Errorf("prepare of an admin-access claim while the node advertises nvidia.com/gpu=8: %v", err)
	}

	setAllocatable(v1.ResourceList{"nvidia.com/gpu": apiresource.MustParse("0"), "example.com/fpga": apiresource.MustParse("1")})
	if err := a.CheckNode(ctx); err != nil {
		t.Fatal(err)
	}
	if n, _ := tainted(a); n != 0 {
		t.Errorf("device plugin gone: %d devices still tainted", n)
	}
	if ev := expectEvent(t, recorder); !strings.Contains(ev, "Normal "+agent.ReasonDevicePluginGone) {
		t.Errorf("event %q, want %s", ev, agent.ReasonDevicePluginGone)
	}
	if err := prepareOne(ctx, t, a, during); err != nil {
		t.Errorf("prepare once the device plugin is gone: %v", err)
	}

	// MIG devices, and time-slicing with renamed resources.
	for _, resource := range []string{"nvidia.com/mig-1g.10gb=7", "nvidia.com/gpu.shared=32"} {
		name, quantity, _ := strings.Cut(resource, "=")
		setAllocatable(v1.ResourceList{v1.ResourceName(name): apiresource.MustParse(quantity)})
		if err := a.CheckNode(ctx); err != nil {
			t.Fatal(err)
		}
		if n, of := tainted(a); n != of {
			t.Errorf("node with %s: %d of %d devices tainted", resource, n, of)
		}
		if ev := expectEvent(t, recorder); !strings.Contains(ev, resource) {
			t.Errorf("event %q, want it to name %s", ev, resource)
		}
		// A claim prepared before the device plugin came is prepared
		// again as before; a new one is refused.
		if err := prepareOne(ctx, t, a, during); err != nil {
			t.Errorf("node with %s: prepare again of the claim prepared before: %v", resource, err)
		}
		if err := prepareOne(ctx, t, a, claim("new-"+name, gpus("gpus", "gpu-2")...)); !errors.Is(err, agent.ErrDevicePluginConflict) {
			t.Errorf("node with %s: prepare of a new claim: %v, want ErrDevicePluginConflict", resource, err)
		}
		expectEvent(t, recorder)
	}

	// A Node that cannot be read at start: tainted until it can, with a
	// warning; once it reads without a device plugin, the taint goes
	// without a "gone" event (there was none).
	a.Stop()
	if err := e.client.CoreV1().Nodes().Delete(ctx, nodeName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	a = e.start(ctx, t)
	if n, of := tainted(a); n != of {
		t.Errorf("Node unreadable at start: %d of %d devices tainted, want all", n, of)
	}
	if ev := expectEvent(t, recorder); !strings.Contains(ev, "Warning "+agent.ReasonDevicePlugin) || !strings.Contains(ev, "cannot read the Node") {
		t.Errorf("event %q, want a %s warning that the Node cannot be read", ev, agent.ReasonDevicePlugin)
	}
	// Not known whether a device plugin hands out the GPUs: a new claim
	// waits until it is.
	unread := claim("unread", gpus("gpus", "gpu-3")...)
	if err := prepareOne(ctx, t, a, unread); !errors.Is(err, agent.ErrDevicePluginConflict) || !strings.Contains(err.Error(), "could not read Node") {
		t.Errorf("prepare while the Node cannot be read: %v, want ErrDevicePluginConflict saying so", err)
	}
	if ev := expectEvent(t, recorder); !strings.Contains(ev, "Warning "+agent.ReasonDevicePluginAllocated) {
		t.Errorf("event %q, want a %s warning", ev, agent.ReasonDevicePluginAllocated)
	}
	if _, err := e.client.CoreV1().Nodes().Create(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := a.CheckNode(ctx); err != nil {
		t.Fatal(err)
	}
	if n, _ := tainted(a); n != 0 {
		t.Errorf("Node readable, no device plugin: %d devices still tainted", n)
	}
	if err := prepareOne(ctx, t, a, unread); err != nil {
		t.Errorf("prepare once the Node is read, without a device plugin: %v", err)
	}
	select {
	case ev := <-recorder.Events:
		t.Errorf("unexpected event %q", ev)
	default:
	}
}
