// Package discovery finds the GPUs of one node and describes them as DRA
// devices: attributes compatible with NVIDIA's DRA driver where names
// overlap, the standard topology attributes (PCIe root, PCI bus id, NUMA
// node) and topodra's NVLink clique.
//
// Discovery sits behind [Interface] so that the node agent, the simulator and
// tests can run on real NVML ([NewNVML] on nvml.New()) or on a simulated
// machine (package mockgpu builds an nvml.Interface and a fake sysfs).
package discovery

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"
)

// ErrNoGPU is returned (wrapped) by discovery when the node has no usable
// NVIDIA GPU: the NVML library is missing, the kernel driver is not loaded,
// or NVML reports zero devices. Callers that merely probe a node, like
// hack/gpu-check.sh, treat it as "nothing here" rather than as a failure.
var ErrNoGPU = errors.New("no NVIDIA GPU found")

// ErrNVMLUnusable is returned (wrapped, with NVML's return) by [NewNVML],
// and so by [Lazy]'s Discover, when the NVML library is there but cannot
// be initialized: ERROR_LIB_RM_VERSION_MISMATCH (the library belongs to
// another driver version than the loaded kernel module, as after a driver
// upgrade without a reboot), ERROR_NO_PERMISSION, ERROR_UNKNOWN and the
// like. Unlike [ErrNoGPU] it does not mean that the node has no GPUs.
var ErrNVMLUnusable = errors.New("NVML cannot be initialized")

// ErrDriverChanged is returned (wrapped) by discovery and health watching
// when NVML says that the loaded library can no longer talk to the kernel
// driver: ERROR_LIB_RM_VERSION_MISMATCH (the driver was upgraded under a
// running agent), ERROR_DRIVER_NOT_LOADED (the driver was unloaded) or
// ERROR_UNINITIALIZED (the library was shut down). The library must be
// shut down and loaded again; [Lazy] does that on its next call.
var ErrDriverChanged = errors.New("NVML lost the kernel driver (driver upgraded or unloaded)")

// driverChanged reports whether err carries one of the NVML returns that
// mean [ErrDriverChanged].
func driverChanged(err error) bool {
	return errors.Is(err, nvml.ERROR_LIB_RM_VERSION_MISMATCH) ||
		errors.Is(err, nvml.ERROR_DRIVER_NOT_LOADED) ||
		errors.Is(err, nvml.ERROR_UNINITIALIZED)
}

// wrapDriverChanged adds [ErrDriverChanged] to err where it applies.
func wrapDriverChanged(err error) error {
	if err == nil || errors.Is(err, ErrDriverChanged) || !driverChanged(err) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrDriverChanged, err)
}

// Interface discovers the devices of one node.
//
// Implementations must be safe for concurrent use. Discover must return the
// same result (same device names, same attribute values, same order) for an
// unchanged machine, because the agent republishes whenever the result
// changes.
type Interface interface {
	// Discover returns the node's current inventory. An error wrapping
	// [ErrNoGPU] means that there is nothing to publish; other errors
	// are faults (the agent retries).
	Discover(ctx context.Context) (*Inventory, error)
}

// HealthWatcher is implemented by discoveries that can report device faults.
type HealthWatcher interface {
	// WatchHealth sends an event for every device fault until ctx is
	// canceled, then returns nil. It must not block on a send after ctx
	// is canceled. It returns an error when health cannot be watched at
	// all (for example no device supports events); the agent then reports
	// the devices' health as unknown and calls WatchHealth again later,
	// until a call watches them. Where a call watches only some GPUs, the
	// agent may run another one beside it, which must not disturb it.
	//
	// Once it watches, and before it sends any event, WatchHealth calls
	// watching exactly once with the GPUs of inv that it does not watch
	// ([Unwatched]; nil when it watches them all). It does not call
	// watching when it returns an error without having watched. watching
	// is never nil and returns promptly; it may keep the map. The agent
	// reports a GPU as healthy only while the watcher watches it.
	WatchHealth(ctx context.Context, inv *Inventory, watching func(Unwatched), events chan<- HealthEvent) error
}

// Unwatched maps the UUID of each GPU whose health a [HealthWatcher] does
// not watch to why, for humans: "NVML RegisterEvents failed: Unknown
// Error".
type Unwatched map[string]string

// HealthEvent reports that one device (or all devices) became unhealthy.
// Devices stay unhealthy until the node reboots: NVML gives no reliable
// "recovered" signal after a critical XID or a lost GPU.
type HealthEvent struct {
	// Device is the device name in the slice ("gpu-3"). Empty means that
	// every device of the node is affected (for example the event set
	// itself reported that a GPU is lost without saying which).
	Device string
	// UUID is the GPU's UUID where the source knows it; it identifies
	// the GPU even if its device name changes. Empty with an empty Device.
	UUID string
	// Reason is short and machine readable: "xid-79", "gpu-lost".
	// It is published as the value of the health taint.
	Reason string
	// Message is for humans (agent log, kubelet health message).
	Message string
	// Time is when the fault was observed.
	Time time.Time
}

// GPU is one whole GPU that discovery found and that the agent publishes.
type GPU struct {
	// Name is the device name in the ResourceSlice: "gpu-<minor>".
	Name string
	// UUID is NVML's GPU UUID ("GPU-…"); a container that the GPU is
	// prepared for gets it in TOPODRA_GPU_<minor>.
	UUID string
	// Index is NVML's device index.
	Index int
	// Minor is the minor number of /dev/nvidia<minor>.
	Minor int
	// PCIBusID is the canonical bus id ("0000:1b:00.0"), empty if NVML
	// did not report one.
	PCIBusID string
	// Fabric says why the GPU's NVLink fabric is not ready, nil where it
	// is or where the GPU has none (see FabricNotReady).
	Fabric *FabricNotReady
	// ResetRequired says why the GPU needs a reset before it takes work:
	// RowRemapPending or PageRetirementPending; "" where it does not, or
	// where NVML cannot say.
	ResetRequired string
	// RowRemapFailed: NVML reports that a row of the GPU's memory could
	// not be remapped (RowRemapFailure); false where NVML cannot say. The
	// GPU keeps the faulty row until it is repaired or replaced.
	RowRemapFailed bool
	// ComputeProhibited: the GPU's compute mode is Prohibited, so that
	// no CUDA context can be created on it; false where NVML cannot say.
	ComputeProhibited bool
	// Device is what gets published for this GPU: name, attributes and
	// capacity. It never carries taints; the agent adds those.
	Device resourceapi.Device
}

// States of FabricNotReady.
const (
	// FabricNotStarted: the GPU's registration with the fabric has not
	// started (the NVIDIA fabric manager is not running).
	FabricNotStarted = "not-started"
	// FabricInProgress: the registration is under way (the fabric
	// manager is starting, or training the links).
	FabricInProgress = "in-progress"
	// FabricFailed: the registration ended with an error (Status).
	FabricFailed = "failed"
)

// FabricNotReady describes a GPU of an NVSwitch system (HGX and DGX
// H100, H200, B200; GB200) whose NVLink fabric is not ready: NVML lists
// the GPU, but CUDA does not initialize on it (CUDA_ERROR_SYSTEM_NOT_READY)
// until the fabric manager has registered it with the fabric.
type FabricNotReady struct {
	// State is FabricNotStarted, FabricInProgress or FabricFailed: a
	// label value, published as the value of the agent's taint.
	State string
	// Status is NVML's error of a failed registration, empty otherwise.
	Status string
}

// Values of GPU.ResetRequired, and RowRemapFailure: label values that the
// agent publishes as taint values.
const (
	// RowRemapPending: the GPU's row remapper has remapped rows of its
	// memory that take effect at the next GPU reset; until then the
	// faulty rows stay in use.
	RowRemapPending = "row-remap-pending"
	// PageRetirementPending: a GPU without row remapping (before Ampere)
	// has retired pages of its memory that take effect at the next GPU
	// reset or reboot; until then they stay in use.
	PageRetirementPending = "page-retirement-pending"
	// RowRemapFailure names GPU.RowRemapFailed: a row of the GPU's memory
	// could not be remapped.
	RowRemapFailure = "row-remap-failure"
)

// Skipped is a GPU that discovery found but does not publish as a whole
// GPU, with the reason: MIG-enabled GPUs (handing one out as a whole GPU
// would give a pod a device whose memory and SMs belong to MIG instances)
// and GPUs that NVML cannot read. UUID and PCIBusID are empty where NVML
// cannot read them.
type Skipped struct {
	UUID     string
	Index    int
	PCIBusID string
	Reason   string
	// Lost: NVML answers ERROR_GPU_IS_LOST for the GPU (it fell off the
	// bus).
	Lost bool
}

// Inventory is the result of one discovery run. GPUs are sorted by index.
type Inventory struct {
	GPUs    []GPU
	Skipped []Skipped
}

// GPU returns the GPU with the given device name, nil if there is none.
func (inv *Inventory) GPU(name string) *GPU {
	if inv == nil {
		return nil
	}
	for i := range inv.GPUs {
		if inv.GPUs[i].Name == name {
			return &inv.GPUs[i]
		}
	}
	return nil
}

// Devices returns deep copies of the devices to publish, in index order.
func (inv *Inventory) Devices() []resourceapi.Device {
	if inv == nil {
		return nil
	}
	devices := make([]resourceapi.Device, 0, len(inv.GPUs))
	for i := range inv.GPUs {
		devices = append(devices, *inv.GPUs[i].Device.DeepCopy())
	}
	return devices
}

// DriverResources describes the inventory as one pool with one slice, the
// way a node-local driver publishes it. The agent uses it and adds taints.
// An empty inventory still yields one empty slice: "driver up, no devices"
// differs from "no pool".
func (inv *Inventory) DriverResources(poolName string) resourceslice.DriverResources {
	return resourceslice.DriverResources{
		Pools: map[string]resourceslice.Pool{
			poolName: {Slices: []resourceslice.Slice{{Devices: inv.Devices()}}},
		},
	}
}

// InventoryFromDevices rebuilds the inventory whose devices were published
// (Inventory.DriverResources), for an agent that cannot discover them now:
// name, UUID, index, minor and bus id come from the attributes that
// discovery publishes, taints are dropped, and the GPUs are sorted by
// index. A device without a UUID attribute is left out.
func InventoryFromDevices(devices []resourceapi.Device) *Inventory {
	inv := &Inventory{}
	for _, d := range devices {
		uuid := d.Attributes[AttrUUID].StringValue
		if uuid == nil {
			continue
		}
		d := *d.DeepCopy()
		d.Taints = nil
		inv.GPUs = append(inv.GPUs, GPU{
			Name:     d.Name,
			UUID:     *uuid,
			Index:    int(ptr.Deref(d.Attributes[AttrIndex].IntValue, 0)),
			Minor:    int(ptr.Deref(d.Attributes[AttrMinor].IntValue, 0)),
			PCIBusID: ptr.Deref(d.Attributes[deviceattribute.StandardDeviceAttributePCIBusID].StringValue, ""),
			Device:   d,
		})
	}
	slices.SortStableFunc(inv.GPUs, func(a, b GPU) int { return cmp.Compare(a.Index, b.Index) })
	return inv
}

// DeviceName is the published name of the GPU whose device node is
// /dev/nvidia<minor>. The minor number, unlike NVML's index, does not depend
// on CUDA_VISIBLE_DEVICES-like enumeration order, so a GPU keeps its name
// across agent restarts. The kernel module hands out minors as it probes
// GPUs, so a GPU that fails to probe at boot can shift the minors of the
// later ones: what a prepared claim holds is therefore checked by UUID.
func DeviceName(minor int) string {
	return fmt.Sprintf("gpu-%d", minor)
}
