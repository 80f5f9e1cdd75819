package framework

import (
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/topodra/topodra/pkg/topology"
)

// DGXLikeGPUs returns the GPUs of a DGX-like machine as published by the
// topodra agent: gpu-0..gpu-7, PCIe roots in pairs (pci0000:00 for gpu-0
// and gpu-1, ...), NUMA node 0 for gpu-0..3 and 1 for gpu-4..7, one NVLink
// clique (NVSwitch) for all eight. Tests that do not need the mock NVML
// machines of pkg/agent build slices from it directly.
func DGXLikeGPUs(node string) []Device {
	var devices []Device
	for i := range 8 {
		devices = append(devices, Device{
			Name: fmt.Sprintf("gpu-%d", i),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				topology.AttrPCIeRoot: StringAttr(fmt.Sprintf("pci0000:%02x", i/2)),
				topology.AttrNUMANode: IntAttr(int64(i / 4)),
				"nvlinkClique":        StringAttr(node + "-clique-0"),
				"productName":         StringAttr("NVIDIA H100 80GB HBM3"),
				"index":               IntAttr(int64(i)),
			},
			Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
				"memory": {Value: resource.MustParse("80Gi")},
			},
		})
	}
	return devices
}
