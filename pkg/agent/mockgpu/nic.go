package mockgpu

import (
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"
)

// NICDriverName is the DRA driver name of the simulated NICs.
const NICDriverName = "nic.topodra.io"

// NICDevices returns the machine's simulated NICs as DRA devices "nic-0",
// "nic-1", … with attribute type="nic", an rdma flag and the standard
// attributes pciBusID, pcieRoot and numaNode read from the same fake sysfs
// as the GPUs' (so a NIC and the GPUs on its PCIe root share a pcieRoot
// value). Machines without NICs return nil.
func (m *Machine) NICDevices() []resourceapi.Device {
	var devices []resourceapi.Device
	for i, nic := range m.spec.NICs {
		attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			"type": {StringValue: ptr.To("nic")},
			"rdma": {BoolValue: ptr.To(true)},
		}
		if a, err := deviceattribute.GetPCIBusIDAttribute(nic.PCIBusID); err == nil {
			attrs[a.Name] = a.Value
		}
		if a, err := deviceattribute.GetPCIeRootAttributeByPCIBusID(nic.PCIBusID, deviceattribute.WithFS(m.sysfs)); err == nil {
			attrs[a.Name] = a.Value
		}
		if a, err := deviceattribute.GetNUMANodeAttributeByPCIBusID(nic.PCIBusID, deviceattribute.ScalarAttribute, deviceattribute.WithFS(m.sysfs)); err == nil {
			attrs[a.Name] = a.Value
		}
		devices = append(devices, resourceapi.Device{
			Name:       fmt.Sprintf("nic-%d", i),
			Attributes: attrs,
		})
	}
	return devices
}

// NICResources describes the NICs as one pool named after the node, ready
// for resourceslice.StartController with DriverName [NICDriverName] (or
// agent.PublishStatic).
func (m *Machine) NICResources() resourceslice.DriverResources {
	return resourceslice.DriverResources{
		Pools: map[string]resourceslice.Pool{
			m.nodeName: {Slices: []resourceslice.Slice{{Devices: m.NICDevices()}}},
		},
	}
}
