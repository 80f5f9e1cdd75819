// Package mockgpu simulates GPU machines for the node agent, its tests and
// topodra-sim: go-nvml's mock NVML servers (pkg/nvml/mock/dgxh100, dgxa100,
// server) plus a topology overlay that go-nvml does not model: PCI bus ids,
// NVLinks and their far ends, multiprocessor counts, NVML events, and a fake
// sysfs tree (PCIe roots, NUMA nodes, SLIT distances) for the standard
// attributes. It also describes simulated NICs that share PCIe roots with
// the GPUs, for simulations that publish a second driver.
package mockgpu

import (
	"fmt"
	"slices"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// Names of the built-in machine profiles.
const (
	// ProfileDGXH100: 8x H100 SXM5 80GB, two NUMA nodes (GPUs 0-3 on node 0,
	// 4-7 on node 1), PCIe roots shared by GPU pairs (0+1, 2+3, 4+5, 6+7),
	// every GPU linked to the same NVSwitch fabric (one NVLink clique of
	// 8), and four NICs, one on each GPU pair's PCIe root.
	ProfileDGXH100 = "dgx-h100"
	// ProfilePCIeNVLinkPairs: 8x A100 PCIe 80GB, each on its own PCIe
	// root, two NUMA nodes (0-3, 4-7), NVLink bridges joining GPU pairs
	// (0+1, 2+3, 4+5, 6+7), no NICs.
	ProfilePCIeNVLinkPairs = "pcie-nvlink-pairs"
	// ProfileWorkstation2GPU: 2x RTX 6000 Ada on one PCIe root complex,
	// no NVLink, and a kernel that reports no NUMA affinity (numa_node
	// = -1), so numaNode is not published.
	ProfileWorkstation2GPU = "workstation-2gpu"
)

// Profiles lists the built-in profile names in a stable order.
func Profiles() []string {
	return []string{ProfileDGXH100, ProfilePCIeNVLinkPairs, ProfileWorkstation2GPU}
}

// Spec describes a simulated machine. Profiles are Specs; tests build their
// own.
type Spec struct {
	// NewServer builds the go-nvml mock server with len(GPUs) devices.
	NewServer func(n int) *server.Server
	// Multiprocessors per GPU (go-nvml's mocks do not model full-GPU SMs).
	Multiprocessors uint32
	// GPUs in NVML index order.
	GPUs []GPUSpec
	// NUMADistances is the SLIT table, one row per NUMA node.
	NUMADistances [][]int
	// NUMASockets maps each NUMA node to its CPU socket.
	NUMASockets []int
	// NVSwitchLinks > 0 joins every GPU to the NVSwitch fabric with that
	// many links per GPU (spread over four switches); NVML's
	// GetGpuFabricInfo then reports each GPU's fabric registration as
	// COMPLETED (see Machine.SetFabric), and otherwise answers
	// ERROR_NOT_SUPPORTED.
	NVSwitchLinks int
	// HiddenSwitches makes NVML fail to report the PCI info of NVSwitch
	// link ends, as on systems whose switches are not PCI devices.
	HiddenSwitches bool
	// Bridges are direct GPU-to-GPU NVLinks (by index), with LinksPerBridge
	// links each.
	Bridges        [][2]int
	LinksPerBridge int
	// NICs sharing the machine's PCIe roots.
	NICs []NICSpec
}

// GPUSpec places one GPU.
type GPUSpec struct {
	// PCIBusID in canonical form ("0000:1b:00.0").
	PCIBusID string
	// PCIeRoot is the root complex ("pci0000:16").
	PCIeRoot string
	// NUMANode as the kernel reports it; -1 for none.
	NUMANode int
}

// NICSpec places one NIC.
type NICSpec struct {
	PCIBusID string
	PCIeRoot string
	NUMANode int
}

// ProfileSpec returns the Spec of a built-in profile.
func ProfileSpec(profile string) (Spec, error) {
	switch profile {
	case ProfileDGXH100:
		return dgxH100(), nil
	case ProfilePCIeNVLinkPairs:
		return pcieNVLinkPairs(), nil
	case ProfileWorkstation2GPU:
		return workstation2GPU(), nil
	default:
		return Spec{}, fmt.Errorf("unknown machine profile %q (known: %s)", profile, strings.Join(Profiles(), ", "))
	}
}

func twoSocketNUMA() ([][]int, []int) {
	return [][]int{{10, 21}, {21, 10}}, []int{0, 1}
}

func dgxH100() Spec {
	dist, sockets := twoSocketNUMA()
	bus := []string{"1b", "43", "52", "61", "9d", "c3", "d1", "df"}
	roots := []string{"pci0000:16", "pci0000:16", "pci0000:49", "pci0000:49", "pci0000:97", "pci0000:97", "pci0000:c9", "pci0000:c9"}
	spec := Spec{
		NewServer: func(n int) *server.Server {
			return dgxh100.NewWithGPUs(gpus.Multiple(n, gpus.H100_SXM5_80GB)...)
		},
		Multiprocessors: 132,
		NUMADistances:   dist,
		NUMASockets:     sockets,
		NVSwitchLinks:   18,
		NICs: []NICSpec{
			{PCIBusID: "0000:1a:00.0", PCIeRoot: "pci0000:16", NUMANode: 0},
			{PCIBusID: "0000:51:00.0", PCIeRoot: "pci0000:49", NUMANode: 0},
			{PCIBusID: "0000:9c:00.0", PCIeRoot: "pci0000:97", NUMANode: 1},
			{PCIBusID: "0000:d0:00.0", PCIeRoot: "pci0000:c9", NUMANode: 1},
		},
	}
	for i := range bus {
		spec.GPUs = append(spec.GPUs, GPUSpec{PCIBusID: "0000:" + bus[i] + ":00.0", PCIeRoot: roots[i], NUMANode: i / 4})
	}
	return spec
}

func pcieNVLinkPairs() Spec {
	dist, sockets := twoSocketNUMA()
	bus := []string{"17", "31", "4b", "65", "98", "b1", "ca", "e3"}
	spec := Spec{
		NewServer: func(n int) *server.Server {
			return dgxa100.NewWithGPUs(gpus.Multiple(n, gpus.A100_PCIE_80GB)...)
		},
		Multiprocessors: 108,
		NUMADistances:   dist,
		NUMASockets:     sockets,
		Bridges:         [][2]int{{0, 1}, {2, 3}, {4, 5}, {6, 7}},
		LinksPerBridge:  12,
	}
	for i := range bus {
		root := "pci0000:" + fmt.Sprintf("%02x", mustHex(bus[i])-1)
		spec.GPUs = append(spec.GPUs, GPUSpec{PCIBusID: "0000:" + bus[i] + ":00.0", PCIeRoot: root, NUMANode: i / 4})
	}
	return spec
}

// RTX6000Ada is a workstation GPU that go-nvml's mocks do not ship.
var RTX6000Ada = gpus.Config{
	Name:         "NVIDIA RTX 6000 Ada Generation",
	Architecture: nvml.DEVICE_ARCH_ADA,
	Brand:        nvml.BRAND_NVIDIA_RTX,
	MemoryMB:     49140,
	CudaMajor:    8,
	CudaMinor:    9,
	PciDeviceId:  0x26B110DE,
}

func workstation2GPU() Spec {
	return Spec{
		NewServer: func(n int) *server.Server {
			s, _ := server.New(
				server.WithGPUs(gpus.Multiple(n, RTX6000Ada)...),
				server.WithDriverVersion("570.133.07"),
				server.WithNVMLVersion("12.570.133.07"),
				server.WithCUDADriverVersion(12080),
			)
			return s
		},
		Multiprocessors: 142,
		NUMADistances:   [][]int{{10}},
		NUMASockets:     []int{0},
		GPUs: []GPUSpec{
			{PCIBusID: "0000:01:00.0", PCIeRoot: "pci0000:00", NUMANode: -1},
			{PCIBusID: "0000:41:00.0", PCIeRoot: "pci0000:00", NUMANode: -1},
		},
	}
}

func mustHex(s string) int {
	var v int
	if _, err := fmt.Sscanf(s, "%x", &v); err != nil {
		panic(err)
	}
	return v
}

// PCIeRoots returns the distinct PCIe roots of the spec's GPUs, sorted.
func (s Spec) PCIeRoots() []string {
	var roots []string
	for _, g := range s.GPUs {
		if !slices.Contains(roots, g.PCIeRoot) {
			roots = append(roots, g.PCIeRoot)
		}
	}
	slices.Sort(roots)
	return roots
}
