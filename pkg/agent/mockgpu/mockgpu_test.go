package mockgpu_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/topology"
)

func TestProfiles(t *testing.T) {
	for _, profile := range mockgpu.Profiles() {
		t.Run(profile, func(t *testing.T) {
			m, err := mockgpu.New(profile, mockgpu.Options{NodeName: "n"})
			if err != nil {
				t.Fatal(err)
			}
			count, ret := m.NVML().DeviceGetCount()
			if ret.Error() != "SUCCESS" || count != len(m.Spec().GPUs) {
				t.Errorf("NVML reports %d devices (%v), spec has %d", count, ret, len(m.Spec().GPUs))
			}
			root := t.TempDir()
			if err := m.WriteSysfs(root); err != nil {
				t.Fatal(err)
			}
			for _, g := range m.Spec().GPUs {
				target, err := os.Readlink(filepath.Join(root, "bus/pci/devices", g.PCIBusID))
				if err != nil {
					t.Fatal(err)
				}
				if !strings.Contains(target, "/devices/"+g.PCIeRoot+"/") {
					t.Errorf("%s links to %s, want a path below %s", g.PCIBusID, target, g.PCIeRoot)
				}
			}
		})
	}
	if _, err := mockgpu.New("dgx-z900", mockgpu.Options{}); err == nil || !strings.Contains(err.Error(), "dgx-h100") {
		t.Errorf("unknown profile: want an error listing the known profiles, got %v", err)
	}
}

// TestNICsShareGPUPCIeRoots checks what the simulator relies on: on a DGX
// H100 each NIC sits on the PCIe root of one GPU pair.
func TestNICsShareGPUPCIeRoots(t *testing.T) {
	testcases := map[string]struct {
		profile string
		want    map[string]string // NIC -> pcieRoot
	}{
		"dgx-h100": {
			profile: mockgpu.ProfileDGXH100,
			want:    map[string]string{"nic-0": "pci0000:16", "nic-1": "pci0000:49", "nic-2": "pci0000:97", "nic-3": "pci0000:c9"},
		},
		"workstation has none": {profile: mockgpu.ProfileWorkstation2GPU, want: map[string]string{}},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			m, err := mockgpu.New(tc.profile, mockgpu.Options{NodeName: "n"})
			if err != nil {
				t.Fatal(err)
			}
			nics := m.NICDevices()
			if len(nics) != len(tc.want) {
				t.Fatalf("%d NICs, want %d", len(nics), len(tc.want))
			}
			roots := m.Spec().PCIeRoots()
			for _, nic := range nics {
				root := ptr.Deref(nic.Attributes[topology.AttrPCIeRoot].StringValue, "")
				if root != tc.want[nic.Name] {
					t.Errorf("%s pcieRoot %q, want %q", nic.Name, root, tc.want[nic.Name])
				}
				shared := false
				for _, r := range roots {
					shared = shared || r == root
				}
				if !shared {
					t.Errorf("%s pcieRoot %q is no GPU's root %v", nic.Name, root, roots)
				}
				if nic.Attributes[topology.AttrNUMANode].IntValue == nil {
					t.Errorf("%s has no numaNode", nic.Name)
				}
			}
			res := m.NICResources()
			if len(res.Pools["n"].Slices) != 1 || len(res.Pools["n"].Slices[0].Devices) != len(tc.want) {
				t.Errorf("NIC resources: %+v", res)
			}
		})
	}
}

// TestWriteDeviceNodes lays out the driver's device nodes of a machine:
// character devices, one per GPU minor and the control device.
func TestWriteDeviceNodes(t *testing.T) {
	m, err := mockgpu.New(mockgpu.ProfileWorkstation2GPU, mockgpu.Options{NodeName: "n"})
	if err != nil {
		t.Fatal(err)
	}
	m.SetMinor(1, 5)
	root := t.TempDir()
	numbered, err := m.WriteDeviceNodes(root)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("driver's device numbers: %v", numbered)
	entries, err := os.ReadDir(filepath.Join(root, "dev"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
		if e.Type()&os.ModeCharDevice == 0 {
			t.Errorf("%s is %v, want a character device", e.Name(), e.Type())
		}
	}
	if want := []string{"nvidia0", "nvidia5", "nvidiactl"}; strings.Join(names, " ") != strings.Join(want, " ") {
		t.Errorf("device nodes %v, want %v", names, want)
	}
}
