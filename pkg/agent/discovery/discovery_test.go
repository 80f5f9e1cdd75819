package discovery_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	nvmlmock "github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/topology"
)

// model is what all GPUs of a simulated machine have in common.
type model struct {
	product, arch, brand, cc, driver, cuda, memory string
	multiprocessors                                int64
}

var (
	h100 = model{"NVIDIA H100 80GB HBM3", "Hopper", "Nvidia", "9.0.0", "550.54.15", "12.4.0", "80Gi", 132}
	a100 = model{"NVIDIA A100-PCIE-80GB", "Ampere", "Nvidia", "8.0.0", "550.54.15", "12.4.0", "80Gi", 108}
	rtx  = model{"NVIDIA RTX 6000 Ada Generation", "Ada Lovelace", "NvidiaRTX", "8.9.0", "570.133.7", "12.8.0", "49140Mi", 142}
)

// Clique ids are hashes of the member bus ids: stable across restarts and
// machines with the same layout.
const (
	cliqueDGX     = "nvl-4b503e6bfa88"
	cliquePair01  = "nvl-c2023d3a6c34"
	cliquePair23  = "nvl-dc9d14c3d4a7"
	cliquePair45  = "nvl-c870b7b80bd4"
	cliquePair67  = "nvl-298a5bc61407"
	noNUMA        = -1
	noClique      = ""
	node1GPU0UUID = "GPU-19315b3c-c1d1-5ce1-a32f-07677490362a"
	node2GPU0UUID = "GPU-7c13a1bf-49ed-57cc-a226-e3ed4d4de1a6"
)

// gpuDevice builds the device that discovery must publish.
func gpuDevice(m model, index int, uuid, bus, root string, numa int, clique string) resourceapi.Device {
	attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		"type":                            {StringValue: ptr.To("gpu")},
		"uuid":                            {StringValue: ptr.To(uuid)},
		"index":                           {IntValue: ptr.To(int64(index))},
		"minor":                           {IntValue: ptr.To(int64(index))},
		"productName":                     {StringValue: ptr.To(m.product)},
		"brand":                           {StringValue: ptr.To(m.brand)},
		"architecture":                    {StringValue: ptr.To(m.arch)},
		"cudaComputeCapability":           {VersionValue: ptr.To(m.cc)},
		"driverVersion":                   {VersionValue: ptr.To(m.driver)},
		"cudaDriverVersion":               {VersionValue: ptr.To(m.cuda)},
		"resource.kubernetes.io/pciBusID": {StringValue: ptr.To(bus)},
		"resource.kubernetes.io/pcieRoot": {StringValue: ptr.To(root)},
	}
	if numa >= 0 {
		attrs["resource.kubernetes.io/numaNode"] = resourceapi.DeviceAttribute{IntValue: ptr.To(int64(numa))}
	}
	if clique != "" {
		attrs["nvlinkClique"] = resourceapi.DeviceAttribute{StringValue: ptr.To(clique)}
	}
	return resourceapi.Device{
		Name:       discovery.DeviceName(index),
		Attributes: attrs,
		Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
			"memory":          {Value: resource.MustParse(m.memory)},
			"multiprocessors": {Value: *resource.NewQuantity(m.multiprocessors, resource.DecimalSI)},
		},
	}
}

// assertDevices compares YAML renderings: exact, readable, and insensitive
// to how a quantity was constructed.
func assertDevices(t *testing.T, want, got []resourceapi.Device) {
	t.Helper()
	wantYAML, err := yaml.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	gotYAML, err := yaml.Marshal(got)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(string(wantYAML), string(gotYAML)); diff != "" {
		t.Errorf("devices differ (-want +got):\n%s", diff)
	}
}

func discover(ctx context.Context, t *testing.T, m *mockgpu.Machine, opts discovery.NVMLOptions) *discovery.Inventory {
	t.Helper()
	opts.Lib = m.NVML()
	if opts.Sysfs == nil {
		opts.Sysfs = m.Sysfs()
	}
	d, err := discovery.NewNVML(opts)
	if err != nil {
		t.Fatalf("NewNVML: %v", err)
	}
	t.Cleanup(func() { _ = d.Close() })
	inv, err := d.Discover(ctx)
	if err != nil {
		t.Fatalf("Discover: %v", err)
	}
	return inv
}

// TestInventoryFromDevices: the inventory rebuilt from the published
// devices (in another order, with taints) is the discovered one, except
// for the GPUs that discovery skipped.
func TestInventoryFromDevices(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	m, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: "node-1"})
	if err != nil {
		t.Fatal(err)
	}
	// Minors that differ from the indices.
	m.SetMinor(0, 1)
	m.SetMinor(1, 0)
	m.SetMIG(5, true)
	inv := discover(ctx, t, m, discovery.NVMLOptions{})
	if len(inv.Skipped) != 1 {
		t.Fatalf("skipped %+v, want the MIG-enabled GPU", inv.Skipped)
	}
	devices := inv.Devices()
	slices.Reverse(devices)
	devices[0].Taints = []resourceapi.DeviceTaint{{Key: "example.com/taint", Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	noUUID := *devices[1].DeepCopy()
	noUUID.Name = "no-uuid"
	delete(noUUID.Attributes, discovery.AttrUUID)
	devices = append(devices, noUUID)

	got := discovery.InventoryFromDevices(devices)
	if diff := cmp.Diff(inv.GPUs, got.GPUs); diff != "" {
		t.Errorf("GPUs (-discovered +rebuilt):\n%s", diff)
	}
}

func TestDiscoverProfiles(t *testing.T) {
	type gpu struct {
		bus, root string
		numa      int
		clique    string
	}
	testcases := map[string]struct {
		profile string
		model   model
		gpus    []gpu
	}{
		"dgx-h100: pairs on PCIe roots, 4+4 NUMA, one NVSwitch clique": {
			profile: mockgpu.ProfileDGXH100,
			model:   h100,
			gpus: []gpu{
				{"0000:1b:00.0", "pci0000:16", 0, cliqueDGX},
				{"0000:43:00.0", "pci0000:16", 0, cliqueDGX},
				{"0000:52:00.0", "pci0000:49", 0, cliqueDGX},
				{"0000:61:00.0", "pci0000:49", 0, cliqueDGX},
				{"0000:9d:00.0", "pci0000:97", 1, cliqueDGX},
				{"0000:c3:00.0", "pci0000:97", 1, cliqueDGX},
				{"0000:d1:00.0", "pci0000:c9", 1, cliqueDGX},
				{"0000:df:00.0", "pci0000:c9", 1, cliqueDGX},
			},
		},
		"pcie-nvlink-pairs: bridged pairs, own PCIe roots, 4+4 NUMA": {
			profile: mockgpu.ProfilePCIeNVLinkPairs,
			model:   a100,
			gpus: []gpu{
				{"0000:17:00.0", "pci0000:16", 0, cliquePair01},
				{"0000:31:00.0", "pci0000:30", 0, cliquePair01},
				{"0000:4b:00.0", "pci0000:4a", 0, cliquePair23},
				{"0000:65:00.0", "pci0000:64", 0, cliquePair23},
				{"0000:98:00.0", "pci0000:97", 1, cliquePair45},
				{"0000:b1:00.0", "pci0000:b0", 1, cliquePair45},
				{"0000:ca:00.0", "pci0000:c9", 1, cliquePair67},
				{"0000:e3:00.0", "pci0000:e2", 1, cliquePair67},
			},
		},
		"workstation-2gpu: no NVLink, no NUMA affinity": {
			profile: mockgpu.ProfileWorkstation2GPU,
			model:   rtx,
			gpus: []gpu{
				{"0000:01:00.0", "pci0000:00", noNUMA, noClique},
				{"0000:41:00.0", "pci0000:00", noNUMA, noClique},
			},
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			m, err := mockgpu.New(tc.profile, mockgpu.Options{NodeName: "node-1"})
			if err != nil {
				t.Fatal(err)
			}
			inv := discover(ctx, t, m, discovery.NVMLOptions{})
			var want []resourceapi.Device
			for i, g := range tc.gpus {
				want = append(want, gpuDevice(tc.model, i, m.UUID(i), g.bus, g.root, g.numa, g.clique))
			}
			assertDevices(t, want, inv.Devices())
			if len(inv.Skipped) != 0 {
				t.Errorf("unexpected skipped GPUs: %+v", inv.Skipped)
			}
			for i, g := range inv.GPUs {
				if g.Minor != i || g.Index != i || g.UUID != m.UUID(i) || g.PCIBusID != tc.gpus[i].bus {
					t.Errorf("GPU %d: got index %d minor %d uuid %s bus %s", i, g.Index, g.Minor, g.UUID, g.PCIBusID)
				}
			}
		})
	}
}

func TestDiscoverUUIDsAreStablePerNode(t *testing.T) {
	testcases := map[string]struct {
		node string
		want string
	}{
		"node-1": {node: "node-1", want: node1GPU0UUID},
		"node-2": {node: "node-2", want: node2GPU0UUID},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			for range 2 { // a restart sees the same machine
				m, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: tc.node})
				if err != nil {
					t.Fatal(err)
				}
				inv := discover(ctx, t, m, discovery.NVMLOptions{})
				if got := inv.GPUs[0].UUID; got != tc.want {
					t.Errorf("gpu-0 UUID: want %s, got %s", tc.want, got)
				}
			}
		})
	}
}

func TestDiscoverMIGEnabledGPUIsNotPublished(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	m, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: "node-1"})
	if err != nil {
		t.Fatal(err)
	}
	m.SetMIG(2, true)
	inv := discover(ctx, t, m, discovery.NVMLOptions{})

	if len(inv.GPUs) != 7 {
		t.Fatalf("want 7 whole GPUs, got %d", len(inv.GPUs))
	}
	if inv.GPU("gpu-2") != nil {
		t.Error("MIG-enabled gpu-2 was published as a whole GPU")
	}
	if len(inv.Skipped) != 1 {
		t.Fatalf("want one skipped GPU, got %+v", inv.Skipped)
	}
	s := inv.Skipped[0]
	if s.Index != 2 || s.UUID != m.UUID(2) || s.PCIBusID != "0000:52:00.0" || !strings.Contains(s.Reason, "MIG mode is enabled") {
		t.Errorf("unexpected skipped entry: %+v", s)
	}
	// Another DRA driver on the node would hand out the GPUs that the
	// agent publishes.
	if strings.Contains(s.Reason, "DRA driver") || !strings.Contains(s.Reason, "-mig 0") {
		t.Errorf("reason %q: want it to say how to disable MIG and not to suggest another DRA driver", s.Reason)
	}
	// The remaining seven still form one clique, but not the clique of eight.
	clique := *inv.GPUs[0].Device.Attributes["nvlinkClique"].StringValue
	if clique == cliqueDGX {
		t.Errorf("clique id unchanged although gpu-2 left the clique")
	}
	for _, g := range inv.GPUs {
		if got := *g.Device.Attributes["nvlinkClique"].StringValue; got != clique {
			t.Errorf("%s: clique %s, want %s", g.Name, got, clique)
		}
	}
}

// TestUnpublishedGPUJoinsNoClique: in a chain of NVLink bridges 0-1-2,
// GPU 1 in MIG mode is not published; GPUs 0 and 2 have no NVLink peer
// they could be given with, so neither gets a clique.
func TestUnpublishedGPUJoinsNoClique(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	spec, err := mockgpu.ProfileSpec(mockgpu.ProfilePCIeNVLinkPairs)
	if err != nil {
		t.Fatal(err)
	}
	spec.GPUs = spec.GPUs[:3]
	spec.Bridges = [][2]int{{0, 1}, {1, 2}}
	m, err := mockgpu.NewFromSpec(spec, mockgpu.Options{NodeName: "node-1"})
	if err != nil {
		t.Fatal(err)
	}
	// All three published, a chain: gpu-0 and gpu-2 share no NVLink, so
	// the first pair is the clique and gpu-2 has none.
	with := discover(ctx, t, m, discovery.NVMLOptions{})
	clique := func(inv *discovery.Inventory, name string) string {
		for _, g := range inv.GPUs {
			if c, ok := g.Device.Attributes["nvlinkClique"]; ok && g.Name == name {
				return *c.StringValue
			}
		}
		return ""
	}
	if c0, c1, c2 := clique(with, "gpu-0"), clique(with, "gpu-1"), clique(with, "gpu-2"); c0 == "" || c0 != c1 || c2 != "" {
		t.Fatalf("with all three published: cliques %q %q %q, want gpu-0 and gpu-1 in one, gpu-2 in none", c0, c1, c2)
	}
	m.SetMIG(1, true)
	inv := discover(ctx, t, m, discovery.NVMLOptions{})
	if len(inv.GPUs) != 2 {
		t.Fatalf("want 2 whole GPUs, got %d", len(inv.GPUs))
	}
	for _, g := range inv.GPUs {
		if c, ok := g.Device.Attributes["nvlinkClique"]; ok {
			t.Errorf("%s: clique %s through the unpublished GPU", g.Name, *c.StringValue)
		}
	}
}

func TestDiscoverNVLinkFailures(t *testing.T) {
	testcases := map[string]struct {
		profile string
		hidden  bool
		break_  func(m *mockgpu.Machine)
		// want maps device name to clique; "" means no clique, "same:<name>"
		// means the same (new) clique as that device.
		want map[string]string
	}{
		"full fabric, one link down: clique unchanged": {
			profile: mockgpu.ProfileDGXH100,
			break_:  func(m *mockgpu.Machine) { m.SetLinkState(0, 3, false) },
			want: map[string]string{
				"gpu-0": cliqueDGX, "gpu-1": cliqueDGX, "gpu-2": cliqueDGX, "gpu-3": cliqueDGX,
				"gpu-4": cliqueDGX, "gpu-5": cliqueDGX, "gpu-6": cliqueDGX, "gpu-7": cliqueDGX,
			},
		},
		"full fabric, all links of gpu-5 down: gpu-5 alone, seven in a new clique": {
			profile: mockgpu.ProfileDGXH100,
			break_:  func(m *mockgpu.Machine) { m.SetAllLinks(5, false) },
			want: map[string]string{
				"gpu-0": "same:gpu-1", "gpu-1": "same:gpu-2", "gpu-2": "same:gpu-3", "gpu-3": "same:gpu-4",
				"gpu-4": "same:gpu-6", "gpu-5": noClique, "gpu-6": "same:gpu-7", "gpu-7": "same:gpu-0",
			},
		},
		"pairs, bridge 2-3 broken: both lose their clique, other pairs keep theirs": {
			profile: mockgpu.ProfilePCIeNVLinkPairs,
			break_:  func(m *mockgpu.Machine) { m.SetAllLinks(2, false) },
			want: map[string]string{
				"gpu-0": cliquePair01, "gpu-1": cliquePair01, "gpu-2": noClique, "gpu-3": noClique,
				"gpu-4": cliquePair45, "gpu-5": cliquePair45, "gpu-6": cliquePair67, "gpu-7": cliquePair67,
			},
		},
		"NVSwitches without PCI info: still one clique": {
			profile: mockgpu.ProfileDGXH100,
			hidden:  true,
			break_:  func(m *mockgpu.Machine) {},
			want: map[string]string{
				"gpu-0": cliqueDGX, "gpu-1": cliqueDGX, "gpu-2": cliqueDGX, "gpu-3": cliqueDGX,
				"gpu-4": cliqueDGX, "gpu-5": cliqueDGX, "gpu-6": cliqueDGX, "gpu-7": cliqueDGX,
			},
		},
		"pairs, one of twelve bridge links down: pair intact": {
			profile: mockgpu.ProfilePCIeNVLinkPairs,
			break_:  func(m *mockgpu.Machine) { m.SetLinkState(6, 0, false) },
			want: map[string]string{
				"gpu-0": cliquePair01, "gpu-1": cliquePair01, "gpu-2": cliquePair23, "gpu-3": cliquePair23,
				"gpu-4": cliquePair45, "gpu-5": cliquePair45, "gpu-6": cliquePair67, "gpu-7": cliquePair67,
			},
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			spec, err := mockgpu.ProfileSpec(tc.profile)
			if err != nil {
				t.Fatal(err)
			}
			spec.HiddenSwitches = tc.hidden
			m, err := mockgpu.NewFromSpec(spec, mockgpu.Options{NodeName: "node-1"})
			if err != nil {
				t.Fatal(err)
			}
			tc.break_(m)
			inv := discover(ctx, t, m, discovery.NVMLOptions{})
			got := map[string]string{}
			for _, g := range inv.GPUs {
				if a, ok := g.Device.Attributes["nvlinkClique"]; ok {
					got[g.Name] = *a.StringValue
				} else {
					got[g.Name] = noClique
				}
			}
			for dev, want := range tc.want {
				if peer, ok := strings.CutPrefix(want, "same:"); ok {
					if got[dev] == noClique || got[dev] != got[peer] || got[dev] == cliqueDGX {
						t.Errorf("%s: clique %q, want a new clique shared with %s (%q)", dev, got[dev], peer, got[peer])
					}
					continue
				}
				if got[dev] != want {
					t.Errorf("%s: clique %q, want %q", dev, got[dev], want)
				}
			}
		})
	}
}

func TestNVLinkCliques(t *testing.T) {
	const a, b, c, d = "0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"
	// The hybrid cube mesh of a DGX-1 (8 V100s): GPUs 0-3 and 4-7 are
	// each fully linked, and GPU i to GPU i+4; 0 and 5 share no link.
	var cube []string
	for i := range 8 {
		cube = append(cube, fmt.Sprintf("0000:%02x:00.0", 0x10+i))
	}
	cubeLinks := append(meshOf(cube[:4]), meshOf(cube[4:])...)
	for i := range 4 {
		cubeLinks = append(cubeLinks, meshOf([]string{cube[i], cube[i+4]})...)
	}
	const sw1, sw2 = "0001:01:00.0", "0001:02:00.0"
	mesh := func(gpus ...string) []discovery.Link { return meshOf(gpus) }
	testcases := map[string]struct {
		gpus  []string
		links []discovery.Link
		// groups lists the expected cliques; GPUs not listed have none.
		groups [][]string
	}{
		"full mesh of direct links": {
			gpus: []string{a, b, c, d}, links: mesh(a, b, c, d),
			groups: [][]string{{a, b, c, d}},
		},
		"switch fabric": {
			gpus: []string{a, b, c, d},
			links: []discovery.Link{
				{GPU: a, Remote: discovery.NVSwitchFabric}, {GPU: b, Remote: discovery.NVSwitchFabric},
				{GPU: c, Remote: discovery.NVSwitchFabric}, {GPU: d, Remote: discovery.NVSwitchFabric},
			},
			groups: [][]string{{a, b, c, d}},
		},
		// Switches seen by bus id: b and c share none, so they are not
		// joined; a, b and d are, on sw1.
		"switches by bus id": {
			gpus: []string{a, b, c, d},
			links: []discovery.Link{
				{GPU: a, Remote: sw1}, {GPU: a, Remote: sw2}, {GPU: b, Remote: sw1},
				{GPU: c, Remote: sw2}, {GPU: d, Remote: sw1},
			},
			groups: [][]string{{a, b, d}},
		},
		// A chain of bridges: a and c have no NVLink between them. The
		// first pair by bus id is the clique; c is left alone.
		"chain of bridges": {
			gpus: []string{a, b, c}, links: append(mesh(a, b), mesh(b, c)...),
			groups: [][]string{{a, b}},
		},
		// A link to a GPU that is not published (it could not be read)
		// does not join the GPUs on either side of it.
		"through a GPU that is not published": {
			gpus:  []string{a, c},
			links: []discovery.Link{{GPU: a, Remote: b, RemoteIsGPU: true}, {GPU: c, Remote: b, RemoteIsGPU: true}},
		},
		"pairs": {
			gpus: []string{a, b, c, d}, links: append(mesh(a, b), mesh(c, d)...),
			groups: [][]string{{a, b}, {c, d}},
		},
		"broken link seen from one side still joins": {
			gpus:   []string{a, b, c, d},
			links:  []discovery.Link{{GPU: a, Remote: b}, {GPU: c, Remote: d}},
			groups: [][]string{{a, b}, {c, d}},
		},
		"broken pair link": {
			gpus:   []string{a, b, c, d},
			links:  mesh(a, b),
			groups: [][]string{{a, b}},
		},
		"GPU alone on a switch is no clique": {
			gpus:  []string{a, b},
			links: []discovery.Link{{GPU: a, Remote: sw1}, {GPU: b, Remote: sw2}},
		},
		"links from unknown GPUs are ignored": {
			gpus:  []string{a, b},
			links: []discovery.Link{{GPU: c, Remote: a}, {GPU: c, Remote: b}},
		},
		"no links": {gpus: []string{a, b}},
		"hybrid cube mesh": {
			gpus: cube, links: cubeLinks,
			groups: [][]string{cube[:4], cube[4:]},
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			got := discovery.NVLinkCliques(tc.gpus, tc.links)
			inGroup := map[string]bool{}
			for _, group := range tc.groups {
				id := got[group[0]]
				if id == "" {
					t.Errorf("%s: no clique, want one with %v", group[0], group)
				}
				for _, gpu := range group {
					inGroup[gpu] = true
					if got[gpu] != id {
						t.Errorf("%s: clique %q, want %q (same as %s)", gpu, got[gpu], id, group[0])
					}
				}
			}
			ids := map[string]bool{}
			for _, group := range tc.groups {
				if ids[got[group[0]]] {
					t.Errorf("two groups share clique id %s", got[group[0]])
				}
				ids[got[group[0]]] = true
			}
			for _, gpu := range tc.gpus {
				if !inGroup[gpu] && got[gpu] != "" {
					t.Errorf("%s: unexpected clique %q", gpu, got[gpu])
				}
			}
			// Enumeration order must not matter.
			reversed := make([]string, len(tc.gpus))
			for i, gpu := range tc.gpus {
				reversed[len(tc.gpus)-1-i] = gpu
			}
			if again := discovery.NVLinkCliques(reversed, tc.links); !cmp.Equal(got, again) {
				t.Errorf("clique ids depend on GPU order: %v vs %v", got, again)
			}
		})
	}
}

// sncSpec is a one-socket machine with sub-NUMA clustering (two NUMA nodes
// on socket 0) and a second socket: list-form numaNode of a GPU on node 0
// is [0 1].
func sncSpec() mockgpu.Spec {
	return mockgpu.Spec{
		NewServer: func(n int) *server.Server {
			return dgxh100.NewWithGPUs(gpus.Multiple(n, gpus.H100_SXM5_80GB)...)
		},
		Multiprocessors: 132,
		NUMADistances:   [][]int{{10, 11, 21, 21}, {11, 10, 21, 21}, {21, 21, 10, 11}, {21, 21, 11, 10}},
		NUMASockets:     []int{0, 0, 1, 1},
		GPUs: []mockgpu.GPUSpec{
			{PCIBusID: "0000:1b:00.0", PCIeRoot: "pci0000:16", NUMANode: 0},
			{PCIBusID: "0000:9d:00.0", PCIeRoot: "pci0000:97", NUMANode: 3},
			{PCIBusID: "0000:c3:00.0", PCIeRoot: "pci0000:c1", NUMANode: -1},
		},
	}
}

// TestStandardAttributesFromSysfs reads a fake sysfs written to disk, the
// way deviceattribute.WithFSFromRoot reads a directory.
func TestStandardAttributesFromSysfs(t *testing.T) {
	testcases := map[string]struct {
		form discovery.NUMAForm
		// remove deletes a sysfs entry before discovery.
		remove string
		want   map[string]map[string]string
	}{
		"scalar numaNode, pcieRoot, pciBusID": {
			form: discovery.NUMAScalar,
			want: map[string]map[string]string{
				"gpu-0": {"numaNode": "0", "pcieRoot": "pci0000:16", "pciBusID": "0000:1b:00.0"},
				"gpu-1": {"numaNode": "3", "pcieRoot": "pci0000:97", "pciBusID": "0000:9d:00.0"},
				"gpu-2": {"numaNode": "", "pcieRoot": "pci0000:c1", "pciBusID": "0000:c3:00.0"},
			},
		},
		"list numaNode: physical node first, then same-socket nodes at minimum distance": {
			form: discovery.NUMAList,
			want: map[string]map[string]string{
				"gpu-0": {"numaNode": "[0 1]", "pcieRoot": "pci0000:16"},
				"gpu-1": {"numaNode": "[3 2]", "pcieRoot": "pci0000:97"},
				"gpu-2": {"numaNode": ""},
			},
		},
		"list numaNode without SLIT table falls back to the physical node": {
			form:   discovery.NUMAList,
			remove: "devices/system/node/node0/distance",
			want: map[string]map[string]string{
				"gpu-0": {"numaNode": "[0]"},
			},
		},
		"device missing from sysfs: only pciBusID": {
			form:   discovery.NUMAScalar,
			remove: "bus/pci/devices/0000:9d:00.0",
			want: map[string]map[string]string{
				"gpu-0": {"numaNode": "0", "pcieRoot": "pci0000:16"},
				"gpu-1": {"numaNode": "", "pcieRoot": "", "pciBusID": "0000:9d:00.0"},
			},
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			m, err := mockgpu.NewFromSpec(sncSpec(), mockgpu.Options{NodeName: "node-1"})
			if err != nil {
				t.Fatal(err)
			}
			root := t.TempDir()
			if err := m.WriteSysfs(root); err != nil {
				t.Fatal(err)
			}
			if tc.remove != "" {
				if err := os.Remove(root + "/" + tc.remove); err != nil {
					t.Fatal(err)
				}
			}
			sysfs := os.DirFS(root).(fs.ReadLinkFS)
			inv := discover(ctx, t, m, discovery.NVMLOptions{Sysfs: sysfs, NUMAForm: tc.form})
			for dev, attrs := range tc.want {
				g := inv.GPU(dev)
				if g == nil {
					t.Fatalf("%s not discovered", dev)
				}
				for short, want := range attrs {
					attr, ok := g.Device.Attributes[resourceapi.QualifiedName("resource.kubernetes.io/"+short)]
					got := ""
					switch {
					case !ok:
					case attr.IntValue != nil:
						got = fmt.Sprint(*attr.IntValue)
					case attr.IntValues != nil:
						got = fmt.Sprint(attr.IntValues)
					case attr.StringValue != nil:
						got = *attr.StringValue
					}
					if got != want {
						t.Errorf("%s %s: want %q, got %q", dev, short, want, got)
					}
				}
			}
		})
	}
}

// TestConditionsLoggedOnChange: a rescan every minute logs an attribute
// that sysfs lacks when it goes missing, and again once it went missing
// again after it was there, not at every discovery (at the agent's
// --v=2).
func TestConditionsLoggedOnChange(t *testing.T) {
	const busID = "0000:9d:00.0"
	m, err := mockgpu.NewFromSpec(sncSpec(), mockgpu.Options{NodeName: "node-1"})
	if err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	if err := m.WriteSysfs(root); err != nil {
		t.Fatal(err)
	}
	entry := root + "/bus/pci/devices/" + busID
	target, err := os.Readlink(entry)
	if err != nil {
		t.Fatal(err)
	}
	logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.Verbosity(2), ktesting.BufferLogs(true)))
	ctx := klog.NewContext(context.Background(), logger)
	d, err := discovery.NewNVML(discovery.NVMLOptions{Lib: m.NVML(), Sysfs: os.DirFS(root).(fs.ReadLinkFS)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	logged := func() int {
		return strings.Count(logger.GetSink().(ktesting.Underlier).GetBuffer().String(), "no pcieRoot attribute")
	}
	steps := []struct {
		what    string
		present bool
		want    int
	}{
		{what: "missing", want: 1},
		{what: "still missing", want: 1},
		{what: "still missing again", want: 1},
		{what: "back", present: true, want: 1},
		{what: "missing once more", want: 2},
		{what: "still missing once more", want: 2},
	}
	for _, step := range steps {
		_ = os.Remove(entry)
		if step.present {
			if err := os.Symlink(target, entry); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := d.Discover(ctx); err != nil {
			t.Fatalf("%s: %v", step.what, err)
		}
		if got := logged(); got != step.want {
			t.Fatalf("pcieRoot of %s %s: logged %d times at V(2), want %d", busID, step.what, got, step.want)
		}
	}
}

// TestCliqueAttributeName keeps the published (unqualified) name in step
// with the vocabulary the scheduler reads.
func TestCliqueAttributeName(t *testing.T) {
	if got := topology.DriverName + "/" + string(discovery.AttrNVLinkClique); got != string(topology.AttrNVLinkClique) {
		t.Errorf("published as %q, scheduler reads %q", got, topology.AttrNVLinkClique)
	}
}

func TestCanonicalPCIBusID(t *testing.T) {
	testcases := map[string]struct{ in, want string }{
		"NVML form":         {"00000000:1B:00.0", "0000:1b:00.0"},
		"already canonical": {"0000:1b:00.0", "0000:1b:00.0"},
		"non-zero domain":   {"00000001:C3:00.0", "0001:c3:00.0"},
		"five-digit domain": {"00010000:E1:00.0", "10000:e1:00.0"},
		"legacy short":      {"0000:c3:00.0", "0000:c3:00.0"},
		"garbage":           {"Not-A-Bus", "not-a-bus"},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			if got := discovery.CanonicalPCIBusID(tc.in); got != tc.want {
				t.Errorf("want %q, got %q", tc.want, got)
			}
		})
	}
}

func TestDriverVersionIsSemver(t *testing.T) {
	testcases := map[string]struct{ driver, want string }{
		"three parts":        {"550.54.15", "550.54.15"},
		"leading zero patch": {"535.104.05", "535.104.5"},
		"two parts":          {"550.54", "550.54.0"},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			s, err := server.New(server.WithGPUs(gpus.H100_SXM5_80GB), server.WithDriverVersion(tc.driver), server.WithCUDADriverVersion(12020))
			if err != nil {
				t.Fatal(err)
			}
			spec := mockgpu.Spec{
				NewServer: func(int) *server.Server { return s },
				GPUs:      []mockgpu.GPUSpec{{PCIBusID: "0000:01:00.0", PCIeRoot: "pci0000:00", NUMANode: 0}},
			}
			m, err := mockgpu.NewFromSpec(spec, mockgpu.Options{})
			if err != nil {
				t.Fatal(err)
			}
			inv := discover(ctx, t, m, discovery.NVMLOptions{})
			attrs := inv.GPUs[0].Device.Attributes
			if got := *attrs["driverVersion"].VersionValue; got != tc.want {
				t.Errorf("driverVersion: want %q, got %q", tc.want, got)
			}
			if got := *attrs["cudaDriverVersion"].VersionValue; got != "12.2.0" {
				t.Errorf("cudaDriverVersion: want 12.2.0, got %q", got)
			}
			if _, ok := inv.GPUs[0].Device.Capacity["multiprocessors"]; ok {
				t.Errorf("multiprocessors published although NVML reported 0")
			}
		})
	}
}

func TestNoNVML(t *testing.T) {
	testcases := map[string]struct {
		init    nvml.Return
		count   int
		wantErr error
	}{
		"library missing":   {init: nvml.ERROR_LIBRARY_NOT_FOUND, wantErr: discovery.ErrNoGPU},
		"driver not loaded": {init: nvml.ERROR_DRIVER_NOT_LOADED, wantErr: discovery.ErrNoGPU},
		"zero devices":      {init: nvml.SUCCESS, count: 0, wantErr: discovery.ErrNoGPU},
		// The node has GPUs; NVML cannot use them.
		"library of another driver version": {init: nvml.ERROR_LIB_RM_VERSION_MISMATCH, wantErr: discovery.ErrNVMLUnusable},
		"no permission":                     {init: nvml.ERROR_NO_PERMISSION, wantErr: discovery.ErrNVMLUnusable},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			lib := &nvmlmock.Interface{
				InitFunc:           func() nvml.Return { return tc.init },
				ShutdownFunc:       func() nvml.Return { return nvml.SUCCESS },
				DeviceGetCountFunc: func() (int, nvml.Return) { return tc.count, nvml.SUCCESS },
			}
			d, err := discovery.NewNVML(discovery.NVMLOptions{Lib: lib})
			if err == nil {
				_, err = d.Discover(ctx)
			}
			if !errors.Is(err, tc.wantErr) {
				t.Errorf("want error wrapping %v, got %v", tc.wantErr, err)
			}
			if tc.wantErr == discovery.ErrNVMLUnusable && (errors.Is(err, discovery.ErrNoGPU) || errors.Is(err, discovery.ErrDriverChanged)) {
				t.Errorf("error %v also wraps ErrNoGPU or ErrDriverChanged", err)
			}
		})
	}
}

func TestWatchHealth(t *testing.T) {
	type step struct {
		do   func(m *mockgpu.Machine) error
		want discovery.HealthEvent
	}
	xid := func(gpu int, x uint64) func(m *mockgpu.Machine) error {
		return func(m *mockgpu.Machine) error { return m.InjectXID(gpu, x) }
	}
	testcases := map[string][]step{
		"critical XID marks that device": {
			{do: xid(3, 79), want: discovery.HealthEvent{Device: "gpu-3", Reason: "xid-79", Message: "critical XID 79: GPU has fallen off the bus"}},
		},
		"application XIDs are ignored": {
			{do: func(m *mockgpu.Machine) error {
				if err := m.InjectXID(1, 13); err != nil {
					return err
				}
				return m.InjectXID(6, 48)
			}, want: discovery.HealthEvent{Device: "gpu-6", Reason: "xid-48", Message: "critical XID 48: double-bit ECC error"}},
		},
		"XID on an unpublished MIG GPU is ignored": {
			{do: func(m *mockgpu.Machine) error {
				if err := m.InjectXID(7, 79); err != nil {
					return err
				}
				return m.InjectXID(2, 94)
			}, want: discovery.HealthEvent{Device: "gpu-2", Reason: "xid-94", Message: "critical XID 94: contained ECC error"}},
		},
		"lost GPU that NVML cannot name marks every device": {
			{do: func(m *mockgpu.Machine) error { m.LoseGPU(); return nil }, want: discovery.HealthEvent{Reason: "gpu-lost", Message: "NVML reports a lost GPU and cannot say which"}},
		},
		"lost GPU is the one that answers as lost": {
			{do: func(m *mockgpu.Machine) error { m.FallOffBus(5); return nil }, want: discovery.HealthEvent{Device: "gpu-5", Reason: "gpu-lost", Message: "NVML reports the GPU lost (fallen off the bus)"}},
		},
		"XID of a GPU that cannot say its UUID is found by its handle": {
			{do: func(m *mockgpu.Machine) error {
				m.FailUUID(4, nvml.ERROR_UNKNOWN)
				return m.InjectXID(4, 79)
			}, want: discovery.HealthEvent{Device: "gpu-4", Reason: "xid-79", Message: "critical XID 79: GPU has fallen off the bus"}},
		},
	}
	for name, steps := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			m, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: "node-1"})
			if err != nil {
				t.Fatal(err)
			}
			m.SetMIG(7, true)
			watched := make(chan discovery.Unwatched, 1)
			inv, events, stop := watchMachine(ctx, t, m, func(u discovery.Unwatched) { watched <- u }, 0)
			select {
			case u := <-watched:
				if len(u) != 0 {
					t.Errorf("unwatched GPUs %v, want none", u)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("watching not called")
			}
			for _, s := range steps {
				if err := s.do(m); err != nil {
					t.Fatal(err)
				}
				select {
				case got := <-events:
					got.Time = time.Time{}
					if s.want.Device != "" {
						s.want.UUID = inv.GPU(s.want.Device).UUID
					}
					if diff := cmp.Diff(s.want, got); diff != "" {
						t.Errorf("event (-want +got):\n%s", diff)
					}
				case <-time.After(30 * time.Second):
					t.Fatal("no health event")
				}
			}
			stop()
		})
	}
}

// watchMachine discovers the GPUs of m and watches their health in the
// background, with watching and an events channel of the given buffer;
// stop ends the watch and checks how it ended.
func watchMachine(ctx context.Context, t *testing.T, m *mockgpu.Machine, watching func(discovery.Unwatched), buffer int) (*discovery.Inventory, chan discovery.HealthEvent, func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	d, err := discovery.NewNVML(discovery.NVMLOptions{Lib: m.NVML(), Sysfs: m.Sysfs()})
	if err != nil {
		t.Fatal(err)
	}
	inv, err := d.Discover(ctx)
	if err != nil {
		t.Fatal(err)
	}
	events := make(chan discovery.HealthEvent, buffer)
	done := make(chan error)
	go func() { done <- d.WatchHealth(ctx, inv, watching, events) }()
	return inv, events, func() { stopWatch(t, cancel, done) }
}

// TestWatchHealthLostGPUs: where discovery found a GPU lost (fallen off
// the bus before the watcher started, say at a rescan), NVML answers the
// event set's waits with ERROR_GPU_IS_LOST, so that the watched GPUs'
// XIDs are not received: they are all marked, with a message that says
// so. A watched GPU that NVML answers as lost is reported again every
// LostReportInterval while it stays lost.
func TestWatchHealthLostGPUs(t *testing.T) {
	interval := discovery.LostReportInterval
	discovery.LostReportInterval = 300 * time.Millisecond
	t.Cleanup(func() { discovery.LostReportInterval = interval })
	next := func(t *testing.T, events chan discovery.HealthEvent) discovery.HealthEvent {
		t.Helper()
		select {
		case ev := <-events:
			return ev
		case <-time.After(30 * time.Second):
			t.Fatal("no health event")
			return discovery.HealthEvent{}
		}
	}

	t.Run("lost before the watcher started", func(t *testing.T) {
		_, ctx := ktesting.NewTestContext(t)
		m, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: "node-1"})
		if err != nil {
			t.Fatal(err)
		}
		m.FallOffBus(5)
		inv, events, stop := watchMachine(ctx, t, m, func(discovery.Unwatched) {}, 10)
		defer stop()
		if inv.GPU("gpu-5") != nil || !slices.ContainsFunc(inv.Skipped, func(s discovery.Skipped) bool { return s.Index == 5 && s.Lost }) {
			t.Fatalf("discovery: gpu-5 %v, skipped %+v; want GPU 5 skipped as lost", inv.GPU("gpu-5") != nil, inv.Skipped)
		}
		if ev := next(t, events); ev.Device != "" || ev.UUID != "" || ev.Reason != "gpu-lost" || !strings.Contains(ev.Message, "discovery found lost") {
			t.Errorf("event %+v, want every GPU marked lost, the message naming the GPU discovery found lost", ev)
		}
	})

	t.Run("lost while watched, reported again", func(t *testing.T) {
		_, ctx := ktesting.NewTestContext(t)
		m, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: "node-1"})
		if err != nil {
			t.Fatal(err)
		}
		_, events, stop := watchMachine(ctx, t, m, func(discovery.Unwatched) {}, 10)
		defer stop()
		m.FallOffBus(5)
		first := next(t, events)
		second := next(t, events)
		for _, ev := range []discovery.HealthEvent{first, second} {
			if ev.Device != "gpu-5" || ev.Reason != "gpu-lost" {
				t.Errorf("event %+v, want gpu-5 lost", ev)
			}
		}
		if gap := second.Time.Sub(first.Time); gap < discovery.LostReportInterval {
			t.Errorf("reported again after %v, want %v or more", gap, discovery.LostReportInterval)
		}
	})
}

// TestWatchHealthUnwatched: a GPU whose events cannot be registered is
// named to watching with the failed call, the others are watched; where
// no GPU can be watched WatchHealth fails without calling watching.
func TestWatchHealthUnwatched(t *testing.T) {
	testcases := map[string]struct {
		fail map[int]nvml.Return
		// want are the unwatched GPUs by index, with why.
		want    map[int]string
		wantErr error
	}{
		"RegisterEvents fails on one GPU": {
			fail: map[int]nvml.Return{1: nvml.ERROR_UNKNOWN},
			want: map[int]string{1: "NVML RegisterEvents failed: ERROR_UNKNOWN"},
		},
		"RegisterEvents fails on every GPU": {
			fail:    map[int]nvml.Return{0: nvml.ERROR_NOT_SUPPORTED, 1: nvml.ERROR_UNKNOWN},
			wantErr: discovery.ErrHealthUnsupported,
		},
		"RegisterEvents finds the driver unloaded": {
			fail:    map[int]nvml.Return{1: nvml.ERROR_DRIVER_NOT_LOADED},
			wantErr: discovery.ErrDriverChanged,
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			ctx, cancel := context.WithCancel(ctx)
			defer cancel()
			m, err := mockgpu.New(mockgpu.ProfileWorkstation2GPU, mockgpu.Options{NodeName: "node-1"})
			if err != nil {
				t.Fatal(err)
			}
			for gpu, ret := range tc.fail {
				m.FailEventRegistration(gpu, ret)
			}
			d, err := discovery.NewNVML(discovery.NVMLOptions{Lib: m.NVML(), Sysfs: m.Sysfs()})
			if err != nil {
				t.Fatal(err)
			}
			inv, err := d.Discover(ctx)
			if err != nil {
				t.Fatal(err)
			}
			events := make(chan discovery.HealthEvent)
			watched := make(chan discovery.Unwatched, 2)
			done := make(chan error, 1)
			go func() { done <- d.WatchHealth(ctx, inv, func(u discovery.Unwatched) { watched <- u }, events) }()

			if tc.wantErr != nil {
				select {
				case err := <-done:
					if !errors.Is(err, tc.wantErr) {
						t.Errorf("WatchHealth: %v, want %v", err, tc.wantErr)
					}
				case <-time.After(30 * time.Second):
					t.Fatal("WatchHealth did not return")
				}
				if len(watched) > 0 {
					t.Errorf("watching called with %v", <-watched)
				}
				return
			}

			var got discovery.Unwatched
			select {
			case got = <-watched:
			case <-time.After(30 * time.Second):
				t.Fatal("watching not called")
			}
			want := discovery.Unwatched{}
			for gpu, why := range tc.want {
				want[m.UUID(gpu)] = why
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("unwatched (-want +got):\n%s", diff)
			}
			// A watched GPU still reports its faults.
			watchedGPU := slices.IndexFunc(inv.GPUs, func(g discovery.GPU) bool { _, ok := want[g.UUID]; return !ok })
			if err := m.InjectXID(inv.GPUs[watchedGPU].Index, 79); err != nil {
				t.Fatal(err)
			}
			select {
			case ev := <-events:
				if ev.UUID != inv.GPUs[watchedGPU].UUID || ev.Reason != "xid-79" {
					t.Errorf("event %+v, want xid-79 on %s", ev, inv.GPUs[watchedGPU].Name)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("no health event")
			}
			stopWatch(t, cancel, done)
			if len(watched) > 0 {
				t.Errorf("watching called again with %v", <-watched)
			}
		})
	}
}

// stopWatch cancels a WatchHealth and checks that it returns without an
// error.
func stopWatch(t *testing.T, cancel context.CancelFunc, done <-chan error) {
	t.Helper()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("WatchHealth: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("WatchHealth did not return after cancel")
	}
}

// meshOf links every two of gpus directly, seen from both sides.
func meshOf(gpus []string) []discovery.Link {
	var links []discovery.Link
	for _, x := range gpus {
		for _, y := range gpus {
			if x != y {
				links = append(links, discovery.Link{GPU: x, Remote: y, RemoteIsGPU: true})
			}
		}
	}
	return links
}

// noSymbols is an NVML library whose LookupSymbol finds nothing, as a
// driver's library that lacks a function.
type noSymbols struct{ nvml.Interface }

func (noSymbols) Extensions() nvml.ExtendedInterface {
	return &nvmlmock.ExtendedInterface{LookupSymbolFunc: func(name string) error { return fmt.Errorf("%s: undefined symbol", name) }}
}

// TestDiscoverFabric: a GPU of an NVSwitch machine whose fabric
// registration has not started, is in progress or failed is published
// with Fabric saying so, the others without; a GPU or driver without
// fabric info, or an answer that does not say, leaves it nil; a lost GPU
// is skipped and a lost driver fails discovery, as for any other query.
func TestDiscoverFabric(t *testing.T) {
	testcases := map[string]struct {
		profile string
		// set changes GPU 3.
		set     func(m *mockgpu.Machine)
		noSym   bool
		want    *discovery.FabricNotReady
		skipped bool
		wantErr error
	}{
		"dgx-h100: completed":    {profile: mockgpu.ProfileDGXH100},
		"pcie: not supported":    {profile: mockgpu.ProfilePCIeNVLinkPairs},
		"workstation: no fabric": {profile: mockgpu.ProfileWorkstation2GPU},
		"not started": {
			profile: mockgpu.ProfileDGXH100,
			set:     func(m *mockgpu.Machine) { m.SetFabric(3, nvml.GPU_FABRIC_STATE_NOT_STARTED, nvml.SUCCESS) },
			want:    &discovery.FabricNotReady{State: discovery.FabricNotStarted},
		},
		"in progress": {
			profile: mockgpu.ProfileDGXH100,
			set:     func(m *mockgpu.Machine) { m.SetFabric(3, nvml.GPU_FABRIC_STATE_IN_PROGRESS, nvml.SUCCESS) },
			want:    &discovery.FabricNotReady{State: discovery.FabricInProgress},
		},
		"completed with an error": {
			profile: mockgpu.ProfileDGXH100,
			set:     func(m *mockgpu.Machine) { m.SetFabric(3, nvml.GPU_FABRIC_STATE_COMPLETED, nvml.ERROR_UNKNOWN) },
			want:    &discovery.FabricNotReady{State: discovery.FabricFailed, Status: "ERROR_UNKNOWN"},
		},
		"state not supported": {
			profile: mockgpu.ProfileDGXH100,
			set:     func(m *mockgpu.Machine) { m.SetFabric(3, nvml.GPU_FABRIC_STATE_NOT_SUPPORTED, nvml.SUCCESS) },
		},
		"function not found": {
			profile: mockgpu.ProfileDGXH100,
			set:     func(m *mockgpu.Machine) { m.FailFabricInfo(3, nvml.ERROR_FUNCTION_NOT_FOUND) },
		},
		"not supported": {
			profile: mockgpu.ProfileDGXH100,
			set:     func(m *mockgpu.Machine) { m.FailFabricInfo(3, nvml.ERROR_NOT_SUPPORTED) },
		},
		"unknown error: published as ready": {
			profile: mockgpu.ProfileDGXH100,
			set:     func(m *mockgpu.Machine) { m.FailFabricInfo(3, nvml.ERROR_UNKNOWN) },
		},
		"library without the function: not asked": {
			profile: mockgpu.ProfileDGXH100,
			set:     func(m *mockgpu.Machine) { m.SetFabric(3, nvml.GPU_FABRIC_STATE_NOT_STARTED, nvml.SUCCESS) },
			noSym:   true,
		},
		"GPU lost": {
			profile: mockgpu.ProfileDGXH100,
			set:     func(m *mockgpu.Machine) { m.FailFabricInfo(3, nvml.ERROR_GPU_IS_LOST) },
			skipped: true,
		},
		"driver lost": {
			profile: mockgpu.ProfileDGXH100,
			set:     func(m *mockgpu.Machine) { m.FailFabricInfo(3, nvml.ERROR_LIB_RM_VERSION_MISMATCH) },
			wantErr: discovery.ErrDriverChanged,
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			inv := discoverGPU3(t, tc.profile, tc.set, tc.noSym, tc.wantErr, tc.skipped)
			if inv == nil {
				return
			}
			for _, g := range inv.GPUs {
				want := (*discovery.FabricNotReady)(nil)
				if g.Index == 3 {
					want = tc.want
				}
				if diff := cmp.Diff(want, g.Fabric); diff != "" {
					t.Errorf("%s: fabric (-want +got):\n%s", g.Name, diff)
				}
			}
		})
	}
}

// conditions is what discovery reads of a GPU's memory repair and compute
// mode.
type conditions struct {
	ResetRequired     string
	RowRemapFailed    bool
	ComputeProhibited bool
}

func conditionsOf(g discovery.GPU) conditions {
	return conditions{ResetRequired: g.ResetRequired, RowRemapFailed: g.RowRemapFailed, ComputeProhibited: g.ComputeProhibited}
}

// TestDiscoverConditions: a GPU whose row remapper has remaps pending, or
// that has no row remapping and retired pages pending, is published as
// needing a reset; one whose row remapper failed as such; one whose
// compute mode is Prohibited as such; the others without. A feature that
// the GPU or library lacks (NOT_SUPPORTED, FUNCTION_NOT_FOUND, a library
// without GetRemappedRows) and an NVML error leave the GPU published
// without the condition; a lost GPU is skipped and a lost driver fails
// discovery, as for any other query.
func TestDiscoverConditions(t *testing.T) {
	noRemap := func(m *mockgpu.Machine) { m.FailRowRemap(3, nvml.ERROR_NOT_SUPPORTED) }
	testcases := map[string]struct {
		// set changes GPU 3.
		set     func(m *mockgpu.Machine)
		noSym   bool
		want    conditions
		skipped bool
		wantErr error
	}{
		"nothing to report": {},
		"row remap pending": {
			set:  func(m *mockgpu.Machine) { m.SetRowRemap(3, true, false) },
			want: conditions{ResetRequired: discovery.RowRemapPending},
		},
		"row remap failed": {
			set:  func(m *mockgpu.Machine) { m.SetRowRemap(3, false, true) },
			want: conditions{RowRemapFailed: true},
		},
		"row remap pending and failed": {
			set:  func(m *mockgpu.Machine) { m.SetRowRemap(3, true, true) },
			want: conditions{ResetRequired: discovery.RowRemapPending, RowRemapFailed: true},
		},
		"row remap error: not known": {
			set: func(m *mockgpu.Machine) {
				m.FailRowRemap(3, nvml.ERROR_UNKNOWN)
				m.SetRetiredPagesPending(3, true)
			},
		},
		"no row remapping, retired pages pending": {
			set: func(m *mockgpu.Machine) {
				noRemap(m)
				m.SetRetiredPagesPending(3, true)
			},
			want: conditions{ResetRequired: discovery.PageRetirementPending},
		},
		"row remapping function not found, retired pages pending": {
			set: func(m *mockgpu.Machine) {
				m.FailRowRemap(3, nvml.ERROR_FUNCTION_NOT_FOUND)
				m.SetRetiredPagesPending(3, true)
			},
			want: conditions{ResetRequired: discovery.PageRetirementPending},
		},
		"library without GetRemappedRows: retired pages only": {
			set: func(m *mockgpu.Machine) {
				m.SetRowRemap(3, true, true)
				m.SetRetiredPagesPending(3, true)
			},
			noSym: true,
			want:  conditions{ResetRequired: discovery.PageRetirementPending},
		},
		"no row remapping, no retired pages pending": {
			set: func(m *mockgpu.Machine) {
				noRemap(m)
				m.SetRetiredPagesPending(3, false)
			},
		},
		"neither row remapping nor page retirement": {set: noRemap},
		"no row remapping, retired pages error: not known": {
			set: func(m *mockgpu.Machine) {
				noRemap(m)
				m.FailRetiredPagesPending(3, nvml.ERROR_UNKNOWN)
			},
		},
		"compute mode prohibited": {
			set:  func(m *mockgpu.Machine) { m.SetComputeMode(3, nvml.COMPUTEMODE_PROHIBITED) },
			want: conditions{ComputeProhibited: true},
		},
		"compute mode exclusive process": {
			set: func(m *mockgpu.Machine) { m.SetComputeMode(3, nvml.COMPUTEMODE_EXCLUSIVE_PROCESS) },
		},
		"compute mode not supported": {
			set: func(m *mockgpu.Machine) { m.FailComputeMode(3, nvml.ERROR_NOT_SUPPORTED) },
		},
		"compute mode error: not known": {
			set: func(m *mockgpu.Machine) { m.FailComputeMode(3, nvml.ERROR_UNKNOWN) },
		},
		"every condition": {
			set: func(m *mockgpu.Machine) {
				m.SetRowRemap(3, true, true)
				m.SetComputeMode(3, nvml.COMPUTEMODE_PROHIBITED)
			},
			want: conditions{ResetRequired: discovery.RowRemapPending, RowRemapFailed: true, ComputeProhibited: true},
		},
		"GPU lost (row remapper)": {
			set:     func(m *mockgpu.Machine) { m.FailRowRemap(3, nvml.ERROR_GPU_IS_LOST) },
			skipped: true,
		},
		"GPU lost (retired pages)": {
			set: func(m *mockgpu.Machine) {
				noRemap(m)
				m.FailRetiredPagesPending(3, nvml.ERROR_GPU_IS_LOST)
			},
			skipped: true,
		},
		"GPU lost (compute mode)": {
			set:     func(m *mockgpu.Machine) { m.FailComputeMode(3, nvml.ERROR_GPU_IS_LOST) },
			skipped: true,
		},
		"driver lost (row remapper)": {
			set:     func(m *mockgpu.Machine) { m.FailRowRemap(3, nvml.ERROR_LIB_RM_VERSION_MISMATCH) },
			wantErr: discovery.ErrDriverChanged,
		},
		"driver lost (compute mode)": {
			set:     func(m *mockgpu.Machine) { m.FailComputeMode(3, nvml.ERROR_DRIVER_NOT_LOADED) },
			wantErr: discovery.ErrDriverChanged,
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			inv := discoverGPU3(t, mockgpu.ProfileDGXH100, tc.set, tc.noSym, tc.wantErr, tc.skipped)
			if inv == nil {
				return
			}
			for _, g := range inv.GPUs {
				want := conditions{}
				if g.Index == 3 {
					want = tc.want
				}
				if diff := cmp.Diff(want, conditionsOf(g)); diff != "" {
					t.Errorf("%s: conditions (-want +got):\n%s", g.Name, diff)
				}
			}
		})
	}
}

// TestConditionsReadAtEachDiscovery: each discovery reads the memory
// repair and compute mode again, so that a condition that is gone (after
// a GPU reset, or nvidia-smi -c DEFAULT) is gone from the next inventory;
// an NVML error reading them is logged when it appears (at the agent's
// --v=2), not at every discovery.
func TestConditionsReadAtEachDiscovery(t *testing.T) {
	m, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: "node-1"})
	if err != nil {
		t.Fatal(err)
	}
	logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.Verbosity(2), ktesting.BufferLogs(true)))
	ctx := klog.NewContext(context.Background(), logger)
	d, err := discovery.NewNVML(discovery.NVMLOptions{Lib: m.NVML(), Sysfs: m.Sysfs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	logged := func(msg string) int {
		return strings.Count(logger.GetSink().(ktesting.Underlier).GetBuffer().String(), msg)
	}
	steps := []struct {
		what string
		set  func()
		// want is the conditions of GPUs 3 and 5.
		want [2]conditions
		// memory and compute count the logged errors.
		memory, compute int
	}{
		{
			what: "faults",
			set: func() {
				m.SetRowRemap(3, true, true)
				m.SetComputeMode(3, nvml.COMPUTEMODE_PROHIBITED)
				m.FailRowRemap(5, nvml.ERROR_NOT_SUPPORTED)
				m.SetRetiredPagesPending(5, true)
			},
			want: [2]conditions{
				{ResetRequired: discovery.RowRemapPending, RowRemapFailed: true, ComputeProhibited: true},
				{ResetRequired: discovery.PageRetirementPending},
			},
		},
		{
			what: "reset and compute mode Default",
			set: func() {
				m.SetRowRemap(3, false, false)
				m.SetComputeMode(3, nvml.COMPUTEMODE_DEFAULT)
				m.SetRetiredPagesPending(5, false)
			},
		},
		{
			what: "NVML errors",
			set: func() {
				m.FailRowRemap(3, nvml.ERROR_UNKNOWN)
				m.FailComputeMode(3, nvml.ERROR_UNKNOWN)
			},
			memory: 1, compute: 1,
		},
		{what: "the same errors", set: func() {}, memory: 1, compute: 1},
		{what: "the same errors again", set: func() {}, memory: 1, compute: 1},
		{
			what: "answers again",
			set: func() {
				m.SetRowRemap(3, true, false)
				m.SetComputeMode(3, nvml.COMPUTEMODE_DEFAULT)
			},
			want:   [2]conditions{{ResetRequired: discovery.RowRemapPending}},
			memory: 1, compute: 1,
		},
		{
			what:   "errors once more",
			set:    func() { m.FailRowRemap(3, nvml.ERROR_UNKNOWN) },
			memory: 2, compute: 1,
		},
	}
	for _, step := range steps {
		step.set()
		inv, err := d.Discover(ctx)
		if err != nil {
			t.Fatalf("%s: %v", step.what, err)
		}
		if len(inv.GPUs) != len(m.Spec().GPUs) {
			t.Fatalf("%s: %d GPUs published, want %d", step.what, len(inv.GPUs), len(m.Spec().GPUs))
		}
		got := [2]conditions{conditionsOf(*inv.GPU("gpu-3")), conditionsOf(*inv.GPU("gpu-5"))}
		if diff := cmp.Diff(step.want, got); diff != "" {
			t.Errorf("%s: conditions of gpu-3 and gpu-5 (-want +got):\n%s", step.what, diff)
		}
		if got := logged("memory repair state unavailable"); got != step.memory {
			t.Errorf("%s: memory repair error logged %d times at V(2), want %d", step.what, got, step.memory)
		}
		if got := logged("compute mode unavailable"); got != step.compute {
			t.Errorf("%s: compute mode error logged %d times at V(2), want %d", step.what, got, step.compute)
		}
	}
}

// discoverGPU3 discovers the GPUs of a mock machine of profile that set
// changed (noSym: a library without the newer NVML functions), where GPU
// 3 is the one a case is about. It checks the outcome the case expects:
// an error wrapping wantErr, GPU 3 skipped as lost, or every GPU
// published; it returns the inventory in that last case only, nil
// otherwise.
func discoverGPU3(t *testing.T, profile string, set func(*mockgpu.Machine), noSym bool, wantErr error, skipped bool) *discovery.Inventory {
	t.Helper()
	_, ctx := ktesting.NewTestContext(t)
	m, err := mockgpu.New(profile, mockgpu.Options{NodeName: "node-1"})
	if err != nil {
		t.Fatal(err)
	}
	if set != nil {
		set(m)
	}
	lib := m.NVML()
	if noSym {
		lib = noSymbols{lib}
	}
	d, err := discovery.NewNVML(discovery.NVMLOptions{Lib: lib, Sysfs: m.Sysfs()})
	if err != nil {
		t.Fatal(err)
	}
	inv, err := d.Discover(ctx)
	if wantErr != nil {
		if !errors.Is(err, wantErr) {
			t.Fatalf("Discover: %v, want an error wrapping %v", err, wantErr)
		}
		return nil
	}
	if err != nil {
		t.Fatalf("Discover: %v", err)
	}
	if skipped {
		if len(inv.Skipped) != 1 || inv.Skipped[0].Index != 3 || !inv.Skipped[0].Lost || inv.GPU("gpu-3") != nil {
			t.Errorf("skipped %+v, want GPU 3 skipped as lost", inv.Skipped)
		}
		return nil
	}
	if len(inv.Skipped) != 0 || len(inv.GPUs) != len(m.Spec().GPUs) {
		t.Fatalf("%d GPUs published, skipped %+v; want all %d", len(inv.GPUs), inv.Skipped, len(m.Spec().GPUs))
	}
	return inv
}
