package topology

// Device taint keys that the node agent publishes.
const (
	// DefaultTaintKey is the device taint key that the node agent can
	// publish on devices that only topodra should hand out: topodra
	// tolerates it, the default scheduler does not.
	DefaultTaintKey = DriverName + "/topodra-only"
	// HealthTaintKey marks a faulty device; its value is the reason
	// ("xid-79", "row-remap-failure").
	HealthTaintKey = DriverName + "/unhealthy"
	// NVMLUnusableTaintKey is on every device while the node agent cannot
	// use NVML: such devices cannot be prepared.
	NVMLUnusableTaintKey = DriverName + "/nvml-unusable"
	// DevicePluginTaintKey is on every device while the Node advertises
	// GPUs of a device plugin, which hands out the same GPUs.
	DevicePluginTaintKey = DriverName + "/device-plugin"
	// OtherDriverTaintKey is on each device that another DRA driver
	// (NVIDIA's gpu.nvidia.com) publishes on the same node as well: the
	// default scheduler hands out that driver's devices, so the same GPU
	// could go to two pods. Its value names the other driver.
	OtherDriverTaintKey = DriverName + "/other-driver"
	// FabricNotReadyTaintKey is on each GPU whose NVLink fabric
	// (NVSwitch systems) is not ready: CUDA cannot initialize on it.
	// Its value is the fabric's state ("not-started", "in-progress",
	// "failed").
	FabricNotReadyTaintKey = DriverName + "/fabric-not-ready"
	// ResetRequiredTaintKey is on each GPU that needs a GPU reset to
	// apply a repair of its memory: until then the faulty memory stays
	// in use. Its value says which repair ("row-remap-pending",
	// "page-retirement-pending").
	ResetRequiredTaintKey = DriverName + "/reset-required"
	// ComputeProhibitedTaintKey is on each GPU whose compute mode is
	// Prohibited: no CUDA context can be created on it.
	ComputeProhibitedTaintKey = DriverName + "/compute-prohibited"
)

// TaintExplanation says, for a pod author, what a device taint of the node
// agent (HealthTaintKey, NVMLUnusableTaintKey, DevicePluginTaintKey,
// OtherDriverTaintKey, FabricNotReadyTaintKey, ResetRequiredTaintKey,
// ComputeProhibitedTaintKey) means
// and who must act; "" for any other key. The text has no commas, since
// kube-scheduler joins the reasons of its nodes with ", ".
func TaintExplanation(key string) string {
	switch key {
	case DevicePluginTaintKey:
		return "NVIDIA's device plugin also hands out these GPUs; a cluster admin must disable it on the node as docs/install.md says; no claim may tolerate this taint"
	case OtherDriverTaintKey:
		return "another DRA driver (the taint's value names it) also publishes these GPUs; a cluster admin must remove that driver from the node as docs/install.md says; no claim may tolerate this taint"
	case FabricNotReadyTaintKey:
		return "the GPU's NVLink fabric is not ready so CUDA cannot start on it; a cluster admin must get the NVIDIA fabric manager on the node running (systemctl status nvidia-fabricmanager); no claim may tolerate this taint"
	case ResetRequiredTaintKey:
		return "the GPU must be reset to apply a repair of its memory (the taint's value names it) and until then uses the faulty memory; a cluster admin must drain the GPU and reset it (nvidia-smi -r) or reboot the node; no claim may tolerate this taint"
	case ComputeProhibitedTaintKey:
		return "the GPU's compute mode is Prohibited so CUDA cannot start on it; a cluster admin must set it back (nvidia-smi -c DEFAULT); no claim may tolerate this taint"
	case HealthTaintKey:
		return "a GPU fault that the node agent reported; the taint's value names it"
	case NVMLUnusableTaintKey:
		return "the node agent cannot read the node's GPUs through NVML; a cluster admin must repair the node's NVIDIA driver or reboot the node"
	}
	return ""
}
