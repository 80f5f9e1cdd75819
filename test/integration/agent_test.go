package integration

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/kubernetes/test/utils/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// nodeSlices lists the slices of one driver on one node.
func nodeSlices(ctx context.Context, client kubernetes.Interface, driver, node string) ([]resourceapi.ResourceSlice, error) {
	list, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
		FieldSelector: fields.Set{
			resourceapi.ResourceSliceSelectorDriver:   driver,
			resourceapi.ResourceSliceSelectorNodeName: node,
		}.String(),
	})
	if err != nil {
		return nil, err
	}
	return list.Items, nil
}

// waitForSlice polls until the node has exactly one slice of the driver and
// cond accepts it.
func waitForSlice(ctx context.Context, t *testing.T, client kubernetes.Interface, driver, node, what string, cond func(*resourceapi.ResourceSlice) bool) *resourceapi.ResourceSlice {
	t.Helper()
	var last []resourceapi.ResourceSlice
	err := wait.PollUntilContextTimeout(ctx, framework.PollInterval, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		items, err := nodeSlices(ctx, client, driver, node)
		if err != nil {
			return false, nil
		}
		last = items
		return len(items) == 1 && cond(&items[0]), nil
	})
	if err != nil {
		t.Fatalf("waiting for %s slice of node %s (%s): %v; last seen: %s", driver, node, what, err, describeSlices(last))
	}
	return &last[0]
}

func describeSlices(items []resourceapi.ResourceSlice) string {
	out := fmt.Sprintf("%d slices", len(items))
	for _, s := range items {
		out += fmt.Sprintf("; %s@%s generation %d, %d devices, taints %v", s.Name, s.ResourceVersion, s.Spec.Pool.Generation, len(s.Spec.Devices), taintsByDevice(&s))
	}
	return out
}

func taintsByDevice(slice *resourceapi.ResourceSlice) map[string][]string {
	out := map[string][]string{}
	for _, d := range slice.Spec.Devices {
		for _, taint := range d.Taints {
			out[d.Name] = append(out[d.Name], fmt.Sprintf("%s=%s:%s", taint.Key, taint.Value, taint.Effect))
		}
	}
	return out
}

// TestAgentPublishesSlices runs a publish-only agent on a simulated DGX H100
// against the real apiserver: it must publish the node's pool exactly as
// discovery describes it, leave it alone across a restart, taint a device
// that NVML reports faulty, and republish when devices change.
func TestAgentPublishesSlices(t *testing.T) {
	tCtx := ktesting.Init(t)
	client := cp.Client
	ns, err := framework.CreateNamespace(tCtx, client, "agent")
	tCtx.ExpectNoError(err)
	nodeName := ns + "-node"
	node, err := framework.CreateReadyNode(tCtx, client, nodeName, nil)
	tCtx.ExpectNoError(err)

	machine, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: nodeName})
	tCtx.ExpectNoError(err)
	start := func() *agent.Simulated {
		t.Helper()
		s, err := agent.StartSimulated(tCtx, agent.SimulatedOptions{
			NodeName:   nodeName,
			Machine:    machine,
			KubeClient: client,
			OwnedTaint: true,
			NICs:       true,
		})
		tCtx.ExpectNoError(err, "start agent")
		return s
	}

	// The expected devices come from an independent machine with the same
	// profile and node name: discovery is deterministic.
	twin, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: nodeName})
	tCtx.ExpectNoError(err)
	twinDiscovery, err := discovery.NewNVML(discovery.NVMLOptions{Lib: twin.NVML(), Sysfs: twin.Sysfs()})
	tCtx.ExpectNoError(err)
	inv, err := twinDiscovery.Discover(tCtx)
	tCtx.ExpectNoError(err)
	wantDevices := agent.BuildResources(inv, nodeName, nil, agent.TaintOptions{Owned: true}).Pools[nodeName].Slices[0].Devices

	// 1. The agent publishes the expected slice.
	s := start()
	slice := waitForSlice(tCtx, t, client, topology.DriverName, nodeName, "8 devices", func(s *resourceapi.ResourceSlice) bool {
		return len(s.Spec.Devices) == 8
	})
	if !resourceslice.DevicesDeepEqual(wantDevices, slice.Spec.Devices) {
		t.Errorf("published devices differ from discovery:\n%s", cmp.Diff(wantDevices, slice.Spec.Devices))
	}
	if diff := cmp.Diff(resourceapi.ResourcePool{Name: nodeName, Generation: slice.Spec.Pool.Generation, ResourceSliceCount: 1}, slice.Spec.Pool); diff != "" {
		t.Errorf("pool (-want +got):\n%s", diff)
	}
	if ptr.Deref(slice.Spec.NodeName, "") != nodeName {
		t.Errorf("slice nodeName %v, want %s", slice.Spec.NodeName, nodeName)
	}
	wantOwner := []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: nodeName, UID: node.UID, Controller: ptr.To(true)}}
	if diff := cmp.Diff(wantOwner, slice.OwnerReferences); diff != "" {
		t.Errorf("owner (-want +got):\n%s", diff)
	}
	// Spot checks that do not rely on discovery agreeing with itself.
	byName := map[string]resourceapi.Device{}
	for _, d := range slice.Spec.Devices {
		byName[d.Name] = d
	}
	for dev, want := range map[string]string{"gpu-0": "pci0000:16", "gpu-1": "pci0000:16", "gpu-2": "pci0000:49", "gpu-7": "pci0000:c9"} {
		if got := ptr.Deref(byName[dev].Attributes[topology.AttrPCIeRoot].StringValue, ""); got != want {
			t.Errorf("%s pcieRoot %q, want %q", dev, got, want)
		}
	}
	if got := ptr.Deref(byName["gpu-5"].Attributes[topology.AttrNUMANode].IntValue, -1); got != 1 {
		t.Errorf("gpu-5 numaNode %d, want 1", got)
	}
	clique := ptr.Deref(byName["gpu-0"].Attributes["nvlinkClique"].StringValue, "")
	for _, d := range slice.Spec.Devices {
		if got := ptr.Deref(d.Attributes["nvlinkClique"].StringValue, ""); clique == "" || got != clique {
			t.Errorf("%s nvlinkClique %q, want %q shared by all GPUs", d.Name, got, clique)
		}
		if d.Attributes["uuid"].StringValue == nil || *d.Attributes["uuid"].StringValue != machine.UUID(int(*d.Attributes["index"].IntValue)) {
			t.Errorf("%s uuid %v does not match the machine", d.Name, d.Attributes["uuid"].StringValue)
		}
	}
	// The NICs share the GPU pairs' PCIe roots.
	nics := waitForSlice(tCtx, t, client, mockgpu.NICDriverName, nodeName, "4 NICs", func(s *resourceapi.ResourceSlice) bool {
		return len(s.Spec.Devices) == 4
	})
	if got := ptr.Deref(nics.Spec.Devices[1].Attributes[topology.AttrPCIeRoot].StringValue, ""); got != "pci0000:49" {
		t.Errorf("nic-1 pcieRoot %q, want pci0000:49 (shared with gpu-2 and gpu-3)", got)
	}

	// 2. A restart with the same devices changes nothing in the API.
	rv, nicRV := slice.ResourceVersion, nics.ResourceVersion
	s.Stop()
	s = start()
	defer func() { s.Stop() }()
	err = wait.PollUntilContextTimeout(tCtx, framework.PollInterval, 60*time.Second, true, func(context.Context) (bool, error) {
		status, ok := s.Agent.PublishStatus()
		return ok && status.Syncs > 0 && s.NICs.Status().Syncs > 0, nil
	})
	tCtx.ExpectNoError(err, "restarted agent never synced its pools")
	if status, _ := s.Agent.PublishStatus(); status.Stats != (resourceslice.Stats{}) {
		t.Errorf("restarted agent wrote GPU slices: %+v", status.Stats)
	}
	if stats := s.NICs.Status().Stats; stats != (resourceslice.Stats{}) {
		t.Errorf("restarted agent wrote NIC slices: %+v", stats)
	}
	after, err := nodeSlices(tCtx, client, topology.DriverName, nodeName)
	tCtx.ExpectNoError(err)
	if len(after) != 1 || after[0].ResourceVersion != rv || after[0].Name != slice.Name {
		t.Errorf("slice changed across restart: before %s@%s, after %s", slice.Name, rv, describeSlices(after))
	}
	afterNICs, err := nodeSlices(tCtx, client, mockgpu.NICDriverName, nodeName)
	tCtx.ExpectNoError(err)
	if len(afterNICs) != 1 || afterNICs[0].ResourceVersion != nicRV {
		t.Errorf("NIC slice changed across restart: before %s@%s, after %s", nics.Name, nicRV, describeSlices(afterNICs))
	}

	// 3. A device going unhealthy shows up as a taint on that device only.
	tCtx.ExpectNoError(machine.InjectXID(3, 79))
	owned := topology.DefaultTaintKey + "=:NoSchedule"
	tainted := waitForSlice(tCtx, t, client, topology.DriverName, nodeName, "health taint on gpu-3", func(s *resourceapi.ResourceSlice) bool {
		return len(taintsByDevice(s)["gpu-3"]) == 2
	})
	wantTaints := map[string][]string{}
	for i := range 8 {
		wantTaints[fmt.Sprintf("gpu-%d", i)] = []string{owned}
	}
	wantTaints["gpu-3"] = []string{owned, agent.HealthTaintKey + "=xid-79:NoSchedule"}
	if diff := cmp.Diff(wantTaints, taintsByDevice(tainted)); diff != "" {
		t.Errorf("taints (-want +got):\n%s", diff)
	}
	for _, d := range tainted.Spec.Devices {
		for _, taint := range d.Taints {
			if taint.TimeAdded == nil {
				t.Errorf("%s taint %s has no timeAdded", d.Name, taint.Key)
			}
		}
	}

	// 4. A device change is republished: MIG mode on gpu-7 withdraws it.
	machine.SetMIG(7, true)
	tCtx.ExpectNoError(s.Agent.Rescan(tCtx))
	shrunk := waitForSlice(tCtx, t, client, topology.DriverName, nodeName, "7 devices", func(s *resourceapi.ResourceSlice) bool {
		return len(s.Spec.Devices) == 7
	})
	names := make([]string, 0, 7)
	for _, d := range shrunk.Spec.Devices {
		names = append(names, d.Name)
	}
	if slices.Contains(names, "gpu-7") || !slices.Contains(names, "gpu-3") {
		t.Errorf("devices after MIG on gpu-7: %v", names)
	}
	if taints := taintsByDevice(shrunk)["gpu-3"]; len(taints) != 2 {
		t.Errorf("gpu-3 lost its health taint on republish: %v", taints)
	}
}

// TestAgentTaintsGPUsOfOtherDriver: NVIDIA's DRA driver publishes one of
// the node's GPUs (by its PCI bus id) on a real API server, which serves
// the field selectors that the agent's watch of other drivers and its own
// resourceslice controller use: the agent publishes that GPU tainted
// gpu.topodra.io/other-driver and leaves the other driver's slice alone;
// once that slice is deleted the taint goes.
func TestAgentTaintsGPUsOfOtherDriver(t *testing.T) {
	tCtx := ktesting.Init(t)
	client := cp.Client
	ns, err := framework.CreateNamespace(tCtx, client, "other-driver")
	tCtx.ExpectNoError(err)
	nodeName := ns + "-node"
	_, err = framework.CreateReadyNode(tCtx, client, nodeName, nil)
	tCtx.ExpectNoError(err)

	const nvidia = "gpu.nvidia.com"
	other, err := client.ResourceV1().ResourceSlices().Create(tCtx, framework.SliceForNode(nodeName, nvidia, []framework.Device{{
		Name:       "gpu-0",
		Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"resource.kubernetes.io/pciBusID": {StringValue: ptr.To("0000:52:00.0")}},
	}}), metav1.CreateOptions{})
	tCtx.ExpectNoError(err, "create the other driver's slice")

	machine, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: nodeName})
	tCtx.ExpectNoError(err)
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: machine.NVML(), Sysfs: machine.Sysfs()})
	tCtx.ExpectNoError(err)
	a, err := agent.New(tCtx, agent.Options{
		NodeName:         nodeName,
		KubeClient:       client,
		Discovery:        disc,
		PublishOnly:      true,
		RescanInterval:   -1,
		OtherDriverCheck: true,
	})
	tCtx.ExpectNoError(err, "start agent")
	defer a.Stop()

	otherTaint := agent.OtherDriverTaintKey + "=" + nvidia + ":NoSchedule"
	waitForSlice(tCtx, t, client, topology.DriverName, nodeName, "gpu-2 tainted "+otherTaint, func(s *resourceapi.ResourceSlice) bool {
		taints := taintsByDevice(s)
		return len(s.Spec.Devices) == 8 && len(taints) == 1 && slices.Equal(taints["gpu-2"], []string{otherTaint})
	})
	if _, err := client.ResourceV1().ResourceSlices().Get(tCtx, other.Name, metav1.GetOptions{}); err != nil {
		t.Errorf("the other driver's slice: %v, want it left alone", err)
	}

	tCtx.ExpectNoError(client.ResourceV1().ResourceSlices().Delete(tCtx, other.Name, metav1.DeleteOptions{}))
	waitForSlice(tCtx, t, client, topology.DriverName, nodeName, "no taints", func(s *resourceapi.ResourceSlice) bool {
		return len(s.Spec.Devices) == 8 && len(taintsByDevice(s)) == 0
	})
}
