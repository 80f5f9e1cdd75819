// Package topology is the shared vocabulary of topodra: the device attribute
// names that carry topology, the driver name of the topodra node agent, the
// claim annotations, the device taint keys of the node agent, and device
// coordinates (a device's domain value per topology attribute).
package topology

import resourceapi "k8s.io/api/resource/v1"

// DriverName is the DRA driver name of the topodra node agent.
const DriverName = "gpu.topodra.io"

// Standard, driver-independent topology attributes (KEP-5491 / KEP-6072).
// Any DRA driver may publish them; topodra reads them from every driver.
const (
	// AttrPCIeRoot is the PCIe root complex of a device, e.g. "pci0000:00".
	AttrPCIeRoot resourceapi.QualifiedName = "resource.kubernetes.io/pcieRoot"
	// AttrNUMANode is the NUMA node of a device: an int, or a list of ints
	// whose first entry is the physical node.
	AttrNUMANode resourceapi.QualifiedName = "resource.kubernetes.io/numaNode"
	// AttrPCIBusID is the PCI bus id of a device, e.g. "0000:3b:00.0".
	AttrPCIBusID resourceapi.QualifiedName = "resource.kubernetes.io/pciBusID"
)

// Attributes published by the topodra node agent.
const (
	// AttrNVLinkClique is a string id shared by GPUs of one node every two
	// of which are joined by an active NVLink, directly or through the
	// NVSwitch fabric (a clique of the NVLink graph; where the linked GPUs
	// are not all joined pairwise, they are split into cliques, largest
	// first).
	// In a slice of driver gpu.topodra.io it is published as "nvlinkClique".
	AttrNVLinkClique resourceapi.QualifiedName = DriverName + "/nvlinkClique"
)

// Annotations on a ResourceClaim (copied from its template) that override the
// alignment policy for that claim.
const (
	// AnnotationAlignment is "require", "prefer" or "none".
	AnnotationAlignment = "topodra.io/alignment"
	// AnnotationAlignWith is "pod": align this claim's devices with the
	// devices of the pod's other claims that carry the same annotation.
	AnnotationAlignWith = "topodra.io/align-with"
)
