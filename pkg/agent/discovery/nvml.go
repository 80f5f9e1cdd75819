package discovery

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

// Attribute names published for every GPU. Where NVIDIA's DRA driver
// (gpu.nvidia.com) publishes the same information, the names are the same,
// so CEL selectors like `device.attributes["gpu.topodra.io"].productName`
// carry over by changing only the domain.
const (
	AttrType                  resourceapi.QualifiedName = "type"
	AttrUUID                  resourceapi.QualifiedName = "uuid"
	AttrIndex                 resourceapi.QualifiedName = "index"
	AttrMinor                 resourceapi.QualifiedName = "minor"
	AttrProductName           resourceapi.QualifiedName = "productName"
	AttrBrand                 resourceapi.QualifiedName = "brand"
	AttrArchitecture          resourceapi.QualifiedName = "architecture"
	AttrCUDAComputeCapability resourceapi.QualifiedName = "cudaComputeCapability"
	AttrDriverVersion         resourceapi.QualifiedName = "driverVersion"
	AttrCUDADriverVersion     resourceapi.QualifiedName = "cudaDriverVersion"

	// AttrNVLinkClique is topology.AttrNVLinkClique in the driver's own
	// domain (published unqualified; a test keeps the two in step).
	AttrNVLinkClique resourceapi.QualifiedName = "nvlinkClique"

	// CapacityMemory is the GPU's total memory in bytes.
	CapacityMemory resourceapi.QualifiedName = "memory"
	// CapacityMultiprocessors is the number of streaming multiprocessors.
	CapacityMultiprocessors resourceapi.QualifiedName = "multiprocessors"

	// TypeGPU is the value of the "type" attribute of a whole GPU.
	TypeGPU = "gpu"
)

// NUMAForm selects how resource.kubernetes.io/numaNode is published.
type NUMAForm = deviceattribute.AttributeForm

const (
	// NUMAScalar publishes the physical NUMA node as an int (no feature gate).
	NUMAScalar = deviceattribute.ScalarAttribute
	// NUMAList publishes a list: physical node first, then same-socket nodes
	// at minimum SLIT distance. Needs DRAListTypeAttributes in the cluster.
	NUMAList = deviceattribute.ListAttribute
)

// NVMLOptions configure [NewNVML].
type NVMLOptions struct {
	// Lib is the NVML implementation: nvml.New() on a real node, a mock
	// server in tests and simulations. Required.
	Lib nvml.Interface
	// Sysfs is the sysfs tree (rooted like /sys) from which PCIe roots and
	// NUMA nodes are read. Nil means the host's /sys.
	Sysfs fs.ReadLinkFS
	// NUMAForm chooses scalar (default) or list numaNode attributes.
	NUMAForm NUMAForm
}

// NVML discovers GPUs through NVML. It implements [Interface] and
// [HealthWatcher]. Create it with [NewNVML]; call Close when done.
type NVML struct {
	lib      nvml.Interface
	sysfs    fs.ReadLinkFS
	numaForm NUMAForm

	// mutex serializes NVML calls: the library is thread-safe, but a
	// discovery run should see one consistent machine. It guards logged
	// and noted.
	mutex sync.Mutex
	// logged holds the conditions that the last discovery logged (see
	// logChange), noted those that the running one has logged so far.
	logged, noted map[string]string
}

var _ Interface = &NVML{}
var _ HealthWatcher = &NVML{}

// NewNVML initializes NVML. When the library or the kernel driver is missing
// the error wraps [ErrNoGPU]; when initializing fails otherwise it wraps
// [ErrNVMLUnusable].
func NewNVML(opts NVMLOptions) (*NVML, error) {
	if opts.Lib == nil {
		return nil, errors.New("NVML library must be set")
	}
	switch ret := opts.Lib.Init(); ret {
	case nvml.SUCCESS:
	case nvml.ERROR_LIBRARY_NOT_FOUND, nvml.ERROR_DRIVER_NOT_LOADED:
		return nil, fmt.Errorf("%w: initialize NVML: %w", ErrNoGPU, ret)
	default:
		return nil, fmt.Errorf("%w: initialize NVML: %w", ErrNVMLUnusable, ret)
	}
	return &NVML{lib: opts.Lib, sysfs: opts.Sysfs, numaForm: opts.NUMAForm}, nil
}

// Close shuts NVML down.
func (d *NVML) Close() error {
	if ret := d.lib.Shutdown(); ret != nvml.SUCCESS {
		return fmt.Errorf("shut down NVML: %w", ret)
	}
	return nil
}

// gpuInfo is what one GPU reports, before cliques are known.
type gpuInfo struct {
	GPU
	links []Link
}

// Discover implements [Interface]. When NVML has lost the kernel driver
// (see [ErrDriverChanged]) it fails with an error wrapping
// ErrDriverChanged, also where only one GPU says so, rather than publishing
// GPUs as skipped.
func (d *NVML) Discover(ctx context.Context) (*Inventory, error) {
	inv, err := d.discover(ctx)
	return inv, wrapDriverChanged(err)
}

func (d *NVML) discover(ctx context.Context) (*Inventory, error) {
	logger := klog.FromContext(ctx)
	d.mutex.Lock()
	defer d.mutex.Unlock()
	d.noted = map[string]string{}
	defer func() { d.logged, d.noted = d.noted, nil }()

	count, ret := d.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("count devices: %w", ret)
	}
	if count == 0 {
		return nil, fmt.Errorf("%w: NVML reports zero devices", ErrNoGPU)
	}

	// System-wide versions, shared by all GPUs. Missing versions only
	// drop the attribute.
	var driverVersion, cudaDriverVersion string
	if v, ret := d.lib.SystemGetDriverVersion(); ret == nvml.SUCCESS {
		driverVersion = semver(v)
	} else {
		d.logChange(logger, 2, "driverVersion", ret.Error(), "driver version unavailable", "err", ret)
	}
	if v, ret := d.lib.SystemGetCudaDriverVersion(); ret == nvml.SUCCESS {
		cudaDriverVersion = fmt.Sprintf("%d.%d.0", v/1000, (v%1000)/10)
	} else {
		d.logChange(logger, 2, "cudaDriverVersion", ret.Error(), "CUDA driver version unavailable", "err", ret)
	}

	syms := symbols{
		fabricInfo:   hasSymbol(d.lib, fabricInfoSymbol),
		remappedRows: hasSymbol(d.lib, remappedRowsSymbol),
	}
	if !syms.fabricInfo {
		logger.V(4).Info("NVML has no fabric info, not checking NVLink fabrics", "function", fabricInfoSymbol)
	}
	if !syms.remappedRows {
		logger.V(4).Info("NVML has no row remapping info, checking retired pages only", "function", remappedRowsSymbol)
	}

	inv := &Inventory{}
	var infos []gpuInfo
	for i := 0; i < count; i++ {
		dev, ret := d.lib.DeviceGetHandleByIndex(i)
		if driverChanged(ret) {
			return nil, fmt.Errorf("get handle of GPU %d: %w", i, ret)
		}
		if ret != nvml.SUCCESS {
			// A lost GPU still counts but cannot be opened: report it,
			// publish the others.
			skipped := Skipped{Index: i, Reason: fmt.Sprintf("get device handle: %v", ret), Lost: ret == nvml.ERROR_GPU_IS_LOST}
			inv.Skipped = append(inv.Skipped, skipped)
			d.logChange(logger, 0, fmt.Sprintf("skipped %d", i), skipped.Reason, "skipping GPU", "index", i, "reason", skipped.Reason)
			continue
		}
		info, skipped, err := d.describe(ctx, dev, driverVersion, cudaDriverVersion, syms)
		if driverChanged(err) {
			return nil, fmt.Errorf("GPU %d: %w", i, err)
		}
		if err != nil {
			skipped := Skipped{Index: i, PCIBusID: pciBusID(dev), Reason: err.Error(), Lost: errors.Is(err, nvml.ERROR_GPU_IS_LOST)}
			inv.Skipped = append(inv.Skipped, skipped)
			d.logChange(logger, 0, fmt.Sprintf("skipped %d", i), skipped.PCIBusID+" "+skipped.Reason, "skipping GPU", "index", i, "pciBusID", skipped.PCIBusID, "reason", skipped.Reason)
			continue
		}
		if skipped != nil {
			inv.Skipped = append(inv.Skipped, *skipped)
			d.logChange(logger, 0, fmt.Sprintf("skipped %d", i), skipped.UUID+" "+skipped.Reason, "not publishing GPU as a whole GPU", "index", skipped.Index, "uuid", skipped.UUID, "reason", skipped.Reason)
			continue
		}
		infos = append(infos, *info)
	}

	// NVLink cliques over all published GPUs. GPUs that are not published
	// (MIG-enabled, or that could not be read) neither anchor a clique nor
	// join their neighbours into one: NVLink does not pass traffic on
	// through a GPU (links to them are left out here where their bus id
	// is known, and NVLinkCliques ignores links to a GPU it is not given).
	var busIDs []string
	var links []Link
	for _, info := range infos {
		if info.PCIBusID != "" {
			busIDs = append(busIDs, info.PCIBusID)
		}
		links = append(links, info.links...)
	}
	unpublished := map[string]bool{}
	for _, sk := range inv.Skipped {
		if sk.PCIBusID != "" {
			unpublished[sk.PCIBusID] = true
		}
	}
	links = slices.DeleteFunc(links, func(l Link) bool { return unpublished[l.Remote] })
	cliques := NVLinkCliques(busIDs, links)
	for _, info := range infos {
		if id, ok := cliques[info.PCIBusID]; ok {
			info.Device.Attributes[AttrNVLinkClique] = resourceapi.DeviceAttribute{StringValue: ptr.To(id)}
		}
		inv.GPUs = append(inv.GPUs, info.GPU)
	}
	slices.SortFunc(inv.GPUs, func(a, b GPU) int { return a.Index - b.Index })
	if logger := logger.V(5); logger.Enabled() {
		logger.Info("Discovered GPUs", "published", len(inv.GPUs), "skipped", len(inv.Skipped), "cliques", cliques)
	}
	return inv, nil
}

// pciBusID returns a GPU's canonical PCI bus id, "" where NVML cannot
// read it.
func pciBusID(dev nvml.Device) string {
	pci, ret := dev.GetPciInfo()
	if ret != nvml.SUCCESS {
		return ""
	}
	return CanonicalPCIBusID(cString(pci.BusId[:]))
}

// symbols says which of the NVML functions that not every driver's library
// has this one has.
type symbols struct {
	// fabricInfo: the function that fabricNotReady calls.
	fabricInfo bool
	// remappedRows: the function that memoryRepair calls first.
	remappedRows bool
}

// describe reads one GPU. It returns exactly one of info, skipped or err.
func (d *NVML) describe(ctx context.Context, dev nvml.Device, driverVersion, cudaDriverVersion string, syms symbols) (*gpuInfo, *Skipped, error) {
	logger := klog.FromContext(ctx)

	index, ret := dev.GetIndex()
	if ret != nvml.SUCCESS {
		return nil, nil, fmt.Errorf("get index: %w", ret)
	}
	uuid, ret := dev.GetUUID()
	if ret != nvml.SUCCESS {
		return nil, nil, fmt.Errorf("get UUID: %w", ret)
	}
	minor, ret := dev.GetMinorNumber()
	if ret != nvml.SUCCESS {
		return nil, nil, fmt.Errorf("get minor number: %w", ret)
	}
	busID := pciBusID(dev)
	if busID == "" {
		d.logChange(logger, 2, "pciInfo "+uuid, "", "PCI info unavailable", "index", index)
	}

	// A GPU in MIG mode is partitioned; publishing it whole would hand out
	// memory and SMs that belong to MIG instances.
	if current, _, ret := dev.GetMigMode(); ret == nvml.SUCCESS && current == nvml.DEVICE_MIG_ENABLE {
		return nil, &Skipped{
			UUID:     uuid,
			Index:    index,
			PCIBusID: busID,
			Reason:   "MIG mode is enabled: topodra publishes whole GPUs only; disable MIG (nvidia-smi -i " + strconv.Itoa(index) + " -mig 0), or keep MIG GPUs on nodes that topodra's agent does not serve (no other GPU driver may run beside it)",
		}, nil
	} else if ret != nvml.SUCCESS && ret != nvml.ERROR_NOT_SUPPORTED {
		return nil, nil, fmt.Errorf("get MIG mode: %w", ret)
	}

	var fabric *FabricNotReady
	if syms.fabricInfo {
		var err error
		fabric, err = fabricNotReady(dev)
		switch {
		case driverChanged(err), errors.Is(err, nvml.ERROR_GPU_IS_LOST):
			return nil, nil, err
		case err != nil:
			// Not known: published as ready, as before the fabric
			// was read at all.
			d.logChange(logger, 2, "fabric "+uuid, err.Error(), "fabric state unavailable", "index", index, "err", err)
		}
	}
	// Where NVML cannot say, the GPU is published as if it had neither
	// condition, as before they were read at all.
	resetRequired, remapFailed, err := memoryRepair(dev, syms.remappedRows)
	switch {
	case driverChanged(err), errors.Is(err, nvml.ERROR_GPU_IS_LOST):
		return nil, nil, err
	case err != nil:
		d.logChange(logger, 2, "memoryRepair "+uuid, err.Error(), "memory repair state unavailable", "index", index, "err", err)
	}
	prohibited, err := computeProhibited(dev)
	switch {
	case driverChanged(err), errors.Is(err, nvml.ERROR_GPU_IS_LOST):
		return nil, nil, err
	case err != nil:
		d.logChange(logger, 2, "computeMode "+uuid, err.Error(), "compute mode unavailable", "index", index, "err", err)
	}

	attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		AttrType:  {StringValue: ptr.To(TypeGPU)},
		AttrUUID:  {StringValue: ptr.To(uuid)},
		AttrIndex: {IntValue: ptr.To(int64(index))},
		AttrMinor: {IntValue: ptr.To(int64(minor))},
	}
	if name, ret := dev.GetName(); ret == nvml.SUCCESS {
		attrs[AttrProductName] = resourceapi.DeviceAttribute{StringValue: ptr.To(name)}
	}
	if brand, ret := dev.GetBrand(); ret == nvml.SUCCESS {
		attrs[AttrBrand] = resourceapi.DeviceAttribute{StringValue: ptr.To(BrandName(brand))}
	}
	if arch, ret := dev.GetArchitecture(); ret == nvml.SUCCESS {
		attrs[AttrArchitecture] = resourceapi.DeviceAttribute{StringValue: ptr.To(ArchitectureName(arch))}
	}
	if major, minor, ret := dev.GetCudaComputeCapability(); ret == nvml.SUCCESS {
		attrs[AttrCUDAComputeCapability] = resourceapi.DeviceAttribute{VersionValue: ptr.To(fmt.Sprintf("%d.%d.0", major, minor))}
	}
	if driverVersion != "" {
		attrs[AttrDriverVersion] = resourceapi.DeviceAttribute{VersionValue: ptr.To(driverVersion)}
	}
	if cudaDriverVersion != "" {
		attrs[AttrCUDADriverVersion] = resourceapi.DeviceAttribute{VersionValue: ptr.To(cudaDriverVersion)}
	}
	if busID != "" {
		for _, attr := range d.pciAttributes(ctx, busID) {
			attrs[attr.Name] = attr.Value
		}
	}

	capacity := map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{}
	if mem, ret := dev.GetMemoryInfo(); ret == nvml.SUCCESS && mem.Total > 0 {
		capacity[CapacityMemory] = resourceapi.DeviceCapacity{Value: *resource.NewQuantity(int64(mem.Total), resource.BinarySI)}
	} else if ret != nvml.SUCCESS {
		d.logChange(logger, 2, "memory "+uuid, ret.Error(), "memory info unavailable", "index", index, "err", ret)
	}
	if da, ret := dev.GetAttributes(); ret == nvml.SUCCESS && da.MultiprocessorCount > 0 {
		capacity[CapacityMultiprocessors] = resourceapi.DeviceCapacity{Value: *resource.NewQuantity(int64(da.MultiprocessorCount), resource.DecimalSI)}
	} else if ret != nvml.SUCCESS {
		d.logChange(logger, 2, "attributes "+uuid, ret.Error(), "device attributes unavailable", "index", index, "err", ret)
	}

	name := DeviceName(minor)
	info := &gpuInfo{
		GPU: GPU{
			Name:              name,
			UUID:              uuid,
			Index:             index,
			Minor:             minor,
			PCIBusID:          busID,
			Fabric:            fabric,
			ResetRequired:     resetRequired,
			RowRemapFailed:    remapFailed,
			ComputeProhibited: prohibited,
			Device: resourceapi.Device{
				Name:       name,
				Attributes: attrs,
				Capacity:   capacity,
			},
		},
	}
	if busID != "" {
		info.links = activeLinks(ctx, dev, busID)
	}
	return info, nil, nil
}

// fabricInfoSymbol is the NVML function that fabricNotReady calls. A
// driver's library that lacks it (before R525) would crash the process
// when it is called, so discover looks it up first.
const fabricInfoSymbol = "nvmlDeviceGetGpuFabricInfo"

// hasSymbol says whether lib has the function name.
func hasSymbol(lib nvml.Interface, name string) bool {
	ext := lib.Extensions()
	return ext != nil && ext.LookupSymbol(name) == nil
}

// fabricNotReady reads the state of a GPU's NVLink fabric registration
// (GetGpuFabricInfo; its later versions cannot be mocked and add nothing
// that this needs). It returns nil where the fabric is ready (COMPLETED
// with SUCCESS) or where there is none: NVML answers
// ERROR_NOT_SUPPORTED (GPUs before Hopper, boards without NVSwitch) or
// ERROR_FUNCTION_NOT_FOUND, or reports GPU_FABRIC_STATE_NOT_SUPPORTED.
// Other errors are returned.
func fabricNotReady(dev nvml.Device) (*FabricNotReady, error) {
	info, ret := dev.GetGpuFabricInfo()
	switch ret {
	case nvml.SUCCESS:
	case nvml.ERROR_NOT_SUPPORTED, nvml.ERROR_FUNCTION_NOT_FOUND:
		return nil, nil
	default:
		return nil, fmt.Errorf("get fabric info: %w", ret)
	}
	switch info.State {
	case nvml.GPU_FABRIC_STATE_NOT_STARTED:
		return &FabricNotReady{State: FabricNotStarted}, nil
	case nvml.GPU_FABRIC_STATE_IN_PROGRESS:
		return &FabricNotReady{State: FabricInProgress}, nil
	case nvml.GPU_FABRIC_STATE_COMPLETED:
		if status := nvml.Return(info.Status); status != nvml.SUCCESS {
			return &FabricNotReady{State: FabricFailed, Status: status.Error()}, nil
		}
	}
	return nil, nil
}

// remappedRowsSymbol is the NVML function that memoryRepair calls first;
// a driver's library before R450 lacks it (see fabricInfoSymbol).
const remappedRowsSymbol = "nvmlDeviceGetRemappedRows"

// unsupported says whether NVML's ret means that the GPU or the library
// lacks the feature asked for (not a fault).
func unsupported(ret nvml.Return) bool {
	return ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_FUNCTION_NOT_FOUND
}

// memoryRepair reads what repairing the GPU's memory asks for. On a GPU
// that remaps rows (Ampere and later; remappedRows says whether the
// library has GetRemappedRows) it returns RowRemapPending where remapped
// rows wait for a GPU reset, and failed where a row could not be
// remapped. On a GPU without row remapping (NVML answers
// ERROR_NOT_SUPPORTED or ERROR_FUNCTION_NOT_FOUND) it returns
// PageRetirementPending where retired pages wait for a reset. A GPU that
// has neither feature has nothing to repair. Other NVML errors are
// returned, with "" and false.
func memoryRepair(dev nvml.Device, remappedRows bool) (resetRequired string, failed bool, err error) {
	if remappedRows {
		_, _, pending, failure, ret := dev.GetRemappedRows()
		switch {
		case ret == nvml.SUCCESS:
			if pending {
				resetRequired = RowRemapPending
			}
			return resetRequired, failure, nil
		case !unsupported(ret):
			return "", false, fmt.Errorf("get remapped rows: %w", ret)
		}
	}
	pending, ret := dev.GetRetiredPagesPendingStatus()
	switch {
	case ret == nvml.SUCCESS:
		if pending == nvml.FEATURE_ENABLED {
			return PageRetirementPending, false, nil
		}
		return "", false, nil
	case unsupported(ret):
		return "", false, nil
	default:
		return "", false, fmt.Errorf("get retired pages pending status: %w", ret)
	}
}

// computeProhibited says whether the GPU's compute mode is Prohibited. A
// GPU or library that does not report the compute mode has none: false.
// Other NVML errors are returned, with false.
func computeProhibited(dev nvml.Device) (bool, error) {
	mode, ret := dev.GetComputeMode()
	switch {
	case ret == nvml.SUCCESS:
		return mode == nvml.COMPUTEMODE_PROHIBITED, nil
	case unsupported(ret):
		return false, nil
	default:
		return false, fmt.Errorf("get compute mode: %w", ret)
	}
}

// logChange logs msg at verbosity v where the condition key has a value
// that the discovery before did not log for it (it did not have the
// condition, or had it with another value), and at V(5) otherwise: a
// condition that stays (an attribute that sysfs lacks, a value that NVML
// does not support, a GPU that cannot be published) is logged when it
// appears or changes, not at every rescan. The caller holds d.mutex
// within discover.
func (d *NVML) logChange(logger klog.Logger, v int, key, value, msg string, keysAndValues ...any) {
	d.noted[key] = value
	if last, ok := d.logged[key]; ok && last == value {
		v = 5
	}
	logger.V(v).Info(msg, keysAndValues...)
}

// pciAttributes returns the standard attributes derived from the bus id:
// pciBusID always, pcieRoot and numaNode when sysfs knows them. numaNode is
// omitted when the kernel reports -1 (no affinity).
func (d *NVML) pciAttributes(ctx context.Context, busID string) []deviceattribute.DeviceAttribute {
	logger := klog.FromContext(ctx)
	var mods []deviceattribute.MachineModifier
	if d.sysfs != nil {
		mods = append(mods, deviceattribute.WithFS(d.sysfs))
	}
	var attrs []deviceattribute.DeviceAttribute
	if attr, err := deviceattribute.GetPCIBusIDAttribute(busID); err == nil {
		attrs = append(attrs, attr)
	} else {
		d.logChange(logger, 2, "pciBusID "+busID, err.Error(), "no pciBusID attribute", "pciBusID", busID, "err", err)
		return nil
	}
	if attr, err := deviceattribute.GetPCIeRootAttributeByPCIBusID(busID, mods...); err == nil {
		attrs = append(attrs, attr)
	} else {
		d.logChange(logger, 2, "pcieRoot "+busID, err.Error(), "no pcieRoot attribute", "pciBusID", busID, "err", err)
	}
	if attr, err := deviceattribute.GetNUMANodeAttributeByPCIBusID(busID, d.numaForm, mods...); err == nil {
		attrs = append(attrs, attr)
	} else {
		logger.V(4).Info("no numaNode attribute", "pciBusID", busID, "err", err)
	}
	return attrs
}

// NVSwitchFabric is the far end of every NVLink that ends at an NVSwitch.
const NVSwitchFabric = "nvswitch-fabric"

// activeLinks lists the GPU's active NVLinks with their far ends. Links to
// an IBM NPU (a CPU) are ignored: they do not join GPUs.
func activeLinks(ctx context.Context, dev nvml.Device, busID string) []Link {
	logger := klog.FromContext(ctx)
	var links []Link
	for l := 0; l < nvml.NVLINK_MAX_LINKS; l++ {
		state, ret := dev.GetNvLinkState(l)
		switch {
		case ret == nvml.ERROR_NOT_SUPPORTED && l == 0:
			// No NVLink on this GPU at all.
			return nil
		case ret != nvml.SUCCESS, state != nvml.FEATURE_ENABLED:
			// Past the last link of this GPU (INVALID_ARGUMENT), or a link
			// that is off: SKUs with fewer NVLinks may leave gaps, so the
			// other indices are asked too.
			continue
		}
		// NVSwitches are often not visible as PCI devices (remote PCI info
		// fails or is meaningless), and all switches of one node form one
		// fabric, so every switch link ends at the node's fabric.
		typ, typRet := dev.GetNvLinkRemoteDeviceType(l)
		if typRet == nvml.SUCCESS && typ == nvml.NVLINK_DEVICE_TYPE_IBMNPU {
			continue
		}
		if typRet == nvml.SUCCESS && typ == nvml.NVLINK_DEVICE_TYPE_SWITCH {
			links = append(links, Link{GPU: busID, Remote: NVSwitchFabric})
			continue
		}
		remote, ret := dev.GetNvLinkRemotePciInfo(l)
		if ret != nvml.SUCCESS {
			logger.V(4).Info("NVLink remote unknown", "pciBusID", busID, "link", l, "err", ret)
			continue
		}
		links = append(links, Link{GPU: busID, Remote: CanonicalPCIBusID(cString(remote.BusId[:])),
			RemoteIsGPU: typRet == nvml.SUCCESS && typ == nvml.NVLINK_DEVICE_TYPE_GPU})
	}
	return links
}

// CanonicalPCIBusID turns NVML's "00000000:1B:00.0" into sysfs' "0000:1b:00.0":
// the domain without leading zeros beyond four digits, as the kernel
// prints it ("00010000:E1:00.0" is "10000:e1:00.0", a device of another
// domain than "0000:e1:00.0"). Input that does not look like a bus id is
// returned lower-cased.
func CanonicalPCIBusID(id string) string {
	id = strings.ToLower(strings.TrimSpace(id))
	domain, rest, ok := strings.Cut(id, ":")
	if !ok || strings.Count(rest, ":") != 1 {
		return id
	}
	for len(domain) > 4 && domain[0] == '0' {
		domain = domain[1:]
	}
	for len(domain) < 4 {
		domain = "0" + domain
	}
	return domain + ":" + rest
}

func cString(b []int8) string {
	buf := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		buf = append(buf, byte(c))
	}
	return string(buf)
}

// semver turns a driver version like "535.104.05" or "550.54" into a valid
// semantic version ("535.104.5", "550.54.0"); DRA version attributes must be
// semver. Non-numeric parts are dropped from the end.
func semver(v string) string {
	parts := strings.Split(strings.TrimSpace(v), ".")
	nums := make([]string, 0, 3)
	for _, p := range parts {
		n, err := strconv.Atoi(p)
		if err != nil || n < 0 {
			break
		}
		nums = append(nums, strconv.Itoa(n))
		if len(nums) == 3 {
			break
		}
	}
	if len(nums) == 0 {
		return ""
	}
	for len(nums) < 3 {
		nums = append(nums, "0")
	}
	return strings.Join(nums, ".")
}

// BrandName is the brand string that NVIDIA's DRA driver publishes.
func BrandName(b nvml.BrandType) string {
	switch b {
	case nvml.BRAND_QUADRO:
		return "Quadro"
	case nvml.BRAND_TESLA:
		return "Tesla"
	case nvml.BRAND_NVS:
		return "NVS"
	case nvml.BRAND_GRID:
		return "Grid"
	case nvml.BRAND_GEFORCE:
		return "GeForce"
	case nvml.BRAND_TITAN:
		return "Titan"
	case nvml.BRAND_NVIDIA_VAPPS:
		return "NvidiaVApps"
	case nvml.BRAND_NVIDIA_VPC:
		return "NvidiaVPC"
	case nvml.BRAND_NVIDIA_VCS:
		return "NvidiaVCS"
	case nvml.BRAND_NVIDIA_VWS:
		return "NvidiaVWS"
	case nvml.BRAND_NVIDIA_CLOUD_GAMING:
		return "NvidiaCloudGaming"
	case nvml.BRAND_QUADRO_RTX:
		return "QuadroRTX"
	case nvml.BRAND_NVIDIA_RTX:
		return "NvidiaRTX"
	case nvml.BRAND_NVIDIA:
		return "Nvidia"
	case nvml.BRAND_GEFORCE_RTX:
		return "GeForceRTX"
	case nvml.BRAND_TITAN_RTX:
		return "TitanRTX"
	default:
		return "Unknown"
	}
}

// ArchitectureName is the architecture string that NVIDIA's DRA driver
// publishes.
func ArchitectureName(a nvml.DeviceArchitecture) string {
	switch a {
	case nvml.DEVICE_ARCH_KEPLER:
		return "Kepler"
	case nvml.DEVICE_ARCH_MAXWELL:
		return "Maxwell"
	case nvml.DEVICE_ARCH_PASCAL:
		return "Pascal"
	case nvml.DEVICE_ARCH_VOLTA:
		return "Volta"
	case nvml.DEVICE_ARCH_TURING:
		return "Turing"
	case nvml.DEVICE_ARCH_AMPERE:
		return "Ampere"
	case nvml.DEVICE_ARCH_ADA:
		return "Ada Lovelace"
	case nvml.DEVICE_ARCH_HOPPER:
		return "Hopper"
	case nvml.DEVICE_ARCH_BLACKWELL:
		return "Blackwell"
	case nvml.DEVICE_ARCH_RUBIN:
		return "Rubin"
	default:
		return "Unknown"
	}
}
