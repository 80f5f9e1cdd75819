package mockgpu

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	nvmlmock "github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/google/uuid"
	"golang.org/x/sys/unix"
)

// Options configure [New].
type Options struct {
	// NodeName seeds the GPU UUIDs, so that simulated nodes built from the
	// same profile have distinct GPUs and a node keeps its UUIDs across
	// agent restarts. Empty is allowed (one anonymous machine).
	NodeName string
}

// Machine is one simulated GPU machine. Its NVML and sysfs views stay
// consistent while tests change it (links, MIG mode, faults). All methods
// are safe for concurrent use.
type Machine struct {
	spec     Spec
	nodeName string
	server   *server.Server
	devices  []*server.Device
	links    [][]remoteEnd
	sysfs    FS
	events   chan nvml.EventData
	// sets counts the event sets created, openSets those not freed yet.
	sets, openSets atomic.Int32

	mutex    sync.Mutex
	linkDown map[[2]int]bool
	lost     bool
	// offBus are the GPUs that fell off the bus: every call on them
	// answers ERROR_GPU_IS_LOST.
	offBus map[int]bool
	// uuidFails is what GetUUID returns per GPU index, where it fails.
	uuidFails map[int]nvml.Return
	// registerFails is what RegisterEvents returns per GPU index, where
	// it fails.
	registerFails map[int]nvml.Return
	// fabric is what GetGpuFabricInfo answers per GPU index.
	fabric []fabricAnswer
	// rowRemap, pagesPending and computeMode are what GetRemappedRows,
	// GetRetiredPagesPendingStatus and GetComputeMode answer per GPU
	// index.
	rowRemap     []answer[rowRemapState]
	pagesPending []answer[nvml.EnableState]
	computeMode  []answer[nvml.ComputeMode]
}

// answer is what an NVML query answers for one GPU: ret, and where that
// is SUCCESS the value.
type answer[T any] struct {
	ret   nvml.Return
	value T
}

// rowRemapState is what GetRemappedRows reports of a GPU's row remapper
// beside the counts of remapped rows.
type rowRemapState struct {
	pending, failed bool
}

// fabricAnswer is what GetGpuFabricInfo answers for one GPU: ret, and
// where that is SUCCESS the registration's state and status.
type fabricAnswer struct {
	ret    nvml.Return
	state  nvml.GpuFabricState
	status nvml.Return
}

type remoteEnd struct {
	busID string
	typ   nvml.IntNvLinkDeviceType
}

// eventQueueSize bounds injected, not yet consumed NVML events.
const eventQueueSize = 64

// New builds the machine of a built-in profile.
func New(profile string, opts Options) (*Machine, error) {
	spec, err := ProfileSpec(profile)
	if err != nil {
		return nil, err
	}
	return NewFromSpec(spec, opts)
}

// NewFromSpec builds a machine from an explicit Spec.
func NewFromSpec(spec Spec, opts Options) (*Machine, error) {
	if spec.NewServer == nil {
		return nil, errors.New("spec has no NVML server constructor")
	}
	if len(spec.GPUs) == 0 {
		return nil, errors.New("spec has no GPUs")
	}
	m := &Machine{
		spec:     spec,
		nodeName: opts.NodeName,
		server:   spec.NewServer(len(spec.GPUs)),
		events:   make(chan nvml.EventData, eventQueueSize),
		linkDown: map[[2]int]bool{},
		offBus:   map[int]bool{},

		registerFails: map[int]nvml.Return{},
		uuidFails:     map[int]nvml.Return{},
	}
	if len(m.server.Devices) != len(spec.GPUs) {
		return nil, fmt.Errorf("NVML mock server has %d devices, spec has %d GPUs", len(m.server.Devices), len(spec.GPUs))
	}
	m.fabric = make([]fabricAnswer, len(spec.GPUs))
	for i := range m.fabric {
		m.fabric[i] = fabricAnswer{ret: nvml.ERROR_NOT_SUPPORTED}
		if spec.NVSwitchLinks > 0 {
			m.fabric[i] = fabricAnswer{ret: nvml.SUCCESS, state: nvml.GPU_FABRIC_STATE_COMPLETED, status: nvml.SUCCESS}
		}
	}
	// GPUs since Ampere remap rows and do not retire pages.
	m.rowRemap = make([]answer[rowRemapState], len(spec.GPUs))
	m.pagesPending = make([]answer[nvml.EnableState], len(spec.GPUs))
	m.computeMode = make([]answer[nvml.ComputeMode], len(spec.GPUs))
	for i := range spec.GPUs {
		m.pagesPending[i].ret = nvml.ERROR_NOT_SUPPORTED
	}
	m.links = make([][]remoteEnd, len(spec.GPUs))
	for i := range spec.GPUs {
		for l := 0; l < spec.NVSwitchLinks; l++ {
			m.links[i] = append(m.links[i], remoteEnd{busID: switchBusID(l % 4), typ: nvml.NVLINK_DEVICE_TYPE_SWITCH})
		}
	}
	for _, b := range spec.Bridges {
		for _, end := range [][2]int{{b[0], b[1]}, {b[1], b[0]}} {
			for l := 0; l < spec.LinksPerBridge; l++ {
				m.links[end[0]] = append(m.links[end[0]], remoteEnd{busID: spec.GPUs[end[1]].PCIBusID, typ: nvml.NVLINK_DEVICE_TYPE_GPU})
			}
		}
	}
	for i, d := range m.server.Devices {
		dev, ok := d.(*server.Device)
		if !ok {
			return nil, fmt.Errorf("NVML mock device %d has unexpected type %T", i, d)
		}
		m.devices = append(m.devices, dev)
		m.overlay(i, dev)
	}
	m.server.EventSetCreateFunc = m.newEventSet
	m.sysfs = buildSysfs(spec)
	return m, nil
}

func switchBusID(n int) string {
	return fmt.Sprintf("0001:%02x:00.0", n+1)
}

// nvmlBusID is how NVML spells a bus id: 8-digit domain, upper case.
func nvmlBusID(canonical string) string {
	return strings.ToUpper("0000" + canonical)
}

func pciInfo(canonical string) nvml.PciInfo {
	var info nvml.PciInfo
	id := nvmlBusID(canonical)
	for i := 0; i < len(id) && i < len(info.BusId)-1; i++ {
		info.BusId[i] = int8(id[i])
	}
	var domain, bus, device uint32
	_, _ = fmt.Sscanf(canonical, "%x:%x:%x.", &domain, &bus, &device)
	info.Domain, info.Bus, info.Device = domain, bus, device
	return info
}

// overlay adds what go-nvml's mock device does not model.
func (m *Machine) overlay(i int, dev *server.Device) {
	g := m.spec.GPUs[i]
	dev.UUID = "GPU-" + uuid.NewSHA1(uuid.NameSpaceOID, []byte(fmt.Sprintf("topodra/%s/gpu/%d", m.nodeName, i))).String()
	dev.PciBusID = nvmlBusID(g.PCIBusID)
	deviceID := dev.Config.PciDeviceId
	// Whole GPUs are never MIG device handles (nvcdi asks).
	dev.IsMigDeviceHandleFunc = func() (bool, nvml.Return) { return false, nvml.SUCCESS }
	dev.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
		info := pciInfo(g.PCIBusID)
		info.PciDeviceId = deviceID
		return info, nvml.SUCCESS
	}
	dev.GetAttributesFunc = func() (nvml.DeviceAttributes, nvml.Return) {
		return nvml.DeviceAttributes{
			MultiprocessorCount: m.spec.Multiprocessors,
			MemorySizeMB:        dev.Config.MemoryMB,
		}, nvml.SUCCESS
	}
	links := m.links[i]
	dev.GetNvLinkStateFunc = func(link int) (nvml.EnableState, nvml.Return) {
		if len(links) == 0 {
			return nvml.FEATURE_DISABLED, nvml.ERROR_NOT_SUPPORTED
		}
		if link < 0 || link >= len(links) {
			return nvml.FEATURE_DISABLED, nvml.ERROR_INVALID_ARGUMENT
		}
		m.mutex.Lock()
		defer m.mutex.Unlock()
		if m.linkDown[[2]int{i, link}] {
			return nvml.FEATURE_DISABLED, nvml.SUCCESS
		}
		return nvml.FEATURE_ENABLED, nvml.SUCCESS
	}
	dev.GetNvLinkRemotePciInfoFunc = func(link int) (nvml.PciInfo, nvml.Return) {
		if link < 0 || link >= len(links) {
			return nvml.PciInfo{}, nvml.ERROR_INVALID_ARGUMENT
		}
		if m.spec.HiddenSwitches && links[link].typ == nvml.NVLINK_DEVICE_TYPE_SWITCH {
			return nvml.PciInfo{}, nvml.ERROR_NOT_SUPPORTED
		}
		return pciInfo(links[link].busID), nvml.SUCCESS
	}
	dev.GetNvLinkRemoteDeviceTypeFunc = func(link int) (nvml.IntNvLinkDeviceType, nvml.Return) {
		if link < 0 || link >= len(links) {
			return nvml.NVLINK_DEVICE_TYPE_UNKNOWN, nvml.ERROR_INVALID_ARGUMENT
		}
		return links[link].typ, nvml.SUCCESS
	}
	dev.GetUUIDFunc = func() (string, nvml.Return) {
		m.mutex.Lock()
		defer m.mutex.Unlock()
		if m.offBus[i] {
			return "", nvml.ERROR_GPU_IS_LOST
		}
		if ret, ok := m.uuidFails[i]; ok {
			return "", ret
		}
		return dev.UUID, nvml.SUCCESS
	}
	dev.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) {
		m.mutex.Lock()
		defer m.mutex.Unlock()
		if m.offBus[i] {
			return nvml.Memory{}, nvml.ERROR_GPU_IS_LOST
		}
		return dev.MemoryInfo, nvml.SUCCESS
	}
	dev.GetGpuFabricInfoFunc = func() (nvml.GpuFabricInfo, nvml.Return) {
		m.mutex.Lock()
		defer m.mutex.Unlock()
		if m.offBus[i] {
			return nvml.GpuFabricInfo{}, nvml.ERROR_GPU_IS_LOST
		}
		answer := m.fabric[i]
		if answer.ret != nvml.SUCCESS {
			return nvml.GpuFabricInfo{}, answer.ret
		}
		return nvml.GpuFabricInfo{State: uint8(answer.state), Status: uint32(answer.status)}, nvml.SUCCESS
	}
	dev.GetRemappedRowsFunc = func() (int, int, bool, bool, nvml.Return) {
		a, ret := answerOf(m, i, m.rowRemap)
		return 0, 0, a.pending, a.failed, ret
	}
	dev.GetRetiredPagesPendingStatusFunc = func() (nvml.EnableState, nvml.Return) {
		return answerOf(m, i, m.pagesPending)
	}
	dev.GetComputeModeFunc = func() (nvml.ComputeMode, nvml.Return) {
		return answerOf(m, i, m.computeMode)
	}
	dev.GetSupportedEventTypesFunc = func() (uint64, nvml.Return) {
		return nvml.EventTypeXidCriticalError | nvml.EventTypeDoubleBitEccError | nvml.EventTypeSingleBitEccError, nvml.SUCCESS
	}
	dev.RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return {
		m.mutex.Lock()
		defer m.mutex.Unlock()
		if ret, ok := m.registerFails[i]; ok {
			return ret
		}
		return nvml.SUCCESS
	}
}

// answerOf returns what answers holds for GPU i: ERROR_GPU_IS_LOST once
// the GPU fell off the bus, the zero value beside an error.
func answerOf[T any](m *Machine, i int, answers []answer[T]) (T, nvml.Return) {
	m.mutex.Lock()
	defer m.mutex.Unlock()
	var zero T
	switch a := answers[i]; {
	case m.offBus[i]:
		return zero, nvml.ERROR_GPU_IS_LOST
	case a.ret != nvml.SUCCESS:
		return zero, a.ret
	default:
		return a.value, nvml.SUCCESS
	}
}

// setAnswer records what a query answers for a GPU in answers (one of the
// machine's slices).
func setAnswer[T any](m *Machine, answers []answer[T], gpu int, a answer[T]) {
	m.mutex.Lock()
	defer m.mutex.Unlock()
	answers[gpu] = a
}

func (m *Machine) newEventSet() (nvml.EventSet, nvml.Return) {
	set := &nvmlmock.EventSet{}
	m.sets.Add(1)
	m.openSets.Add(1)
	var freed atomic.Bool
	set.FreeFunc = func() nvml.Return {
		if !freed.Swap(true) {
			m.openSets.Add(-1)
		}
		return nvml.SUCCESS
	}
	set.WaitFunc = func(timeoutMs uint32) (nvml.EventData, nvml.Return) {
		m.mutex.Lock()
		lost := m.lost || len(m.offBus) > 0
		m.mutex.Unlock()
		if lost {
			return nvml.EventData{}, nvml.ERROR_GPU_IS_LOST
		}
		timer := time.NewTimer(time.Duration(timeoutMs) * time.Millisecond)
		defer timer.Stop()
		select {
		case ev := <-m.events:
			return ev, nvml.SUCCESS
		case <-timer.C:
			return nvml.EventData{}, nvml.ERROR_TIMEOUT
		}
	}
	return set, nvml.SUCCESS
}

// EventSets counts the event sets created: health watchers started.
func (m *Machine) EventSets() int { return int(m.sets.Load()) }

// EventSetsOpen counts the event sets that were created and not freed
// yet: the health watchers that run, and those that were stopped and have
// not returned from their last wait. Unlike NVML, which gives every event
// set registered for a GPU each of its events, the machine hands each
// injected event to one waiting set: a test that injects an XID after it
// replaced a watcher waits until the old one is gone.
func (m *Machine) EventSetsOpen() int { return int(m.openSets.Load()) }

// NVML returns the machine's NVML implementation.
func (m *Machine) NVML() nvml.Interface { return m.server }

// Sysfs returns the machine's sysfs tree (rooted like /sys).
func (m *Machine) Sysfs() fs.ReadLinkFS { return m.sysfs }

// Spec returns the machine's Spec.
func (m *Machine) Spec() Spec { return m.spec }

// NodeName returns the node name that seeded the machine.
func (m *Machine) NodeName() string { return m.nodeName }

// UUID returns the UUID of the GPU with the given NVML index.
func (m *Machine) UUID(gpu int) string { return m.devices[gpu].UUID }

// SetLinkState brings one NVLink of a GPU up or down.
func (m *Machine) SetLinkState(gpu, link int, up bool) {
	m.mutex.Lock()
	defer m.mutex.Unlock()
	if up {
		delete(m.linkDown, [2]int{gpu, link})
	} else {
		m.linkDown[[2]int{gpu, link}] = true
	}
}

// SetAllLinks brings every NVLink of a GPU up or down. Bridge links are
// brought down at both ends.
func (m *Machine) SetAllLinks(gpu int, up bool) {
	for l := range m.links[gpu] {
		m.SetLinkState(gpu, l, up)
	}
	for peer, ends := range m.links {
		for l, end := range ends {
			if end.busID == m.spec.GPUs[gpu].PCIBusID {
				m.SetLinkState(peer, l, up)
			}
		}
	}
}

// SetMinor changes the minor number (/dev/nvidia<minor>) of a GPU, as a
// reboot does when the kernel numbers the GPUs in another order (a GPU
// that failed to probe shifts the later ones). Call it only while nothing
// uses the machine's NVML.
func (m *Machine) SetMinor(gpu, minor int) {
	m.devices[gpu].Minor = minor
}

// SetMIG enables or disables MIG mode on a GPU.
func (m *Machine) SetMIG(gpu int, enabled bool) {
	mode := 0
	if enabled {
		mode = nvml.DEVICE_MIG_ENABLE
	}
	m.devices[gpu].SetMigMode(mode)
}

// SetFabric sets the state of a GPU's NVLink fabric registration that
// NVML's GetGpuFabricInfo reports, and where it is COMPLETED its status
// (nvml.SUCCESS, or the error the registration ended with), as the
// NVIDIA fabric manager moves a GPU of an NVSwitch system through them.
// GPUs of a Spec with NVSwitchLinks start COMPLETED with nvml.SUCCESS.
func (m *Machine) SetFabric(gpu int, state nvml.GpuFabricState, status nvml.Return) {
	m.mutex.Lock()
	defer m.mutex.Unlock()
	m.fabric[gpu] = fabricAnswer{ret: nvml.SUCCESS, state: state, status: status}
}

// FailFabricInfo makes NVML's GetGpuFabricInfo return ret for a GPU:
// ERROR_NOT_SUPPORTED, as for every GPU of a Spec without NVSwitchLinks
// (GPUs before Hopper answer so), or ERROR_FUNCTION_NOT_FOUND, as a
// driver without the function does. SetFabric makes it answer again.
func (m *Machine) FailFabricInfo(gpu int, ret nvml.Return) {
	m.mutex.Lock()
	defer m.mutex.Unlock()
	m.fabric[gpu] = fabricAnswer{ret: ret}
}

// SetRowRemap sets what NVML's GetRemappedRows reports of a GPU's row
// remapper: pending, remapped rows that a GPU reset applies; failed, a row
// that could not be remapped. Every GPU starts with neither.
func (m *Machine) SetRowRemap(gpu int, pending, failed bool) {
	setAnswer(m, m.rowRemap, gpu, answer[rowRemapState]{value: rowRemapState{pending: pending, failed: failed}})
}

// FailRowRemap makes NVML's GetRemappedRows return ret for a GPU:
// ERROR_NOT_SUPPORTED, as GPUs before Ampere answer (they retire pages
// instead, see SetRetiredPagesPending), or another error. SetRowRemap makes
// it answer again.
func (m *Machine) FailRowRemap(gpu int, ret nvml.Return) {
	setAnswer(m, m.rowRemap, gpu, answer[rowRemapState]{ret: ret})
}

// SetRetiredPagesPending sets whether NVML's GetRetiredPagesPendingStatus
// reports retired pages of a GPU that a GPU reset (or reboot) applies.
// Every GPU starts answering ERROR_NOT_SUPPORTED, as GPUs that remap rows
// do.
func (m *Machine) SetRetiredPagesPending(gpu int, pending bool) {
	state := nvml.FEATURE_DISABLED
	if pending {
		state = nvml.FEATURE_ENABLED
	}
	setAnswer(m, m.pagesPending, gpu, answer[nvml.EnableState]{value: state})
}

// FailRetiredPagesPending makes NVML's GetRetiredPagesPendingStatus return
// ret for a GPU. SetRetiredPagesPending makes it answer again.
func (m *Machine) FailRetiredPagesPending(gpu int, ret nvml.Return) {
	setAnswer(m, m.pagesPending, gpu, answer[nvml.EnableState]{ret: ret})
}

// SetComputeMode sets the compute mode that NVML's GetComputeMode reports
// for a GPU, as nvidia-smi -c sets it. Every GPU starts in
// COMPUTEMODE_DEFAULT.
func (m *Machine) SetComputeMode(gpu int, mode nvml.ComputeMode) {
	setAnswer(m, m.computeMode, gpu, answer[nvml.ComputeMode]{value: mode})
}

// FailComputeMode makes NVML's GetComputeMode return ret for a GPU.
// SetComputeMode makes it answer again.
func (m *Machine) FailComputeMode(gpu int, ret nvml.Return) {
	setAnswer(m, m.computeMode, gpu, answer[nvml.ComputeMode]{ret: ret})
}

// InjectXID queues a critical-XID event for a GPU, as NVML would deliver it
// to an event set. It fails when too many events are pending.
func (m *Machine) InjectXID(gpu int, xid uint64) error {
	if gpu < 0 || gpu >= len(m.devices) {
		return fmt.Errorf("no GPU %d", gpu)
	}
	select {
	case m.events <- nvml.EventData{Device: m.devices[gpu], EventType: nvml.EventTypeXidCriticalError, EventData: xid}:
		return nil
	default:
		return errors.New("NVML event queue is full")
	}
}

// FailEventRegistration makes NVML's RegisterEvents return ret for a GPU
// from now on, so that its health cannot be watched; nvml.SUCCESS lets it
// succeed again.
func (m *Machine) FailEventRegistration(gpu int, ret nvml.Return) {
	m.setFailure(m.registerFails, gpu, ret)
}

// LoseGPU makes event sets report ERROR_GPU_IS_LOST from now on, while
// every GPU still answers: NVML cannot say which GPU is lost.
func (m *Machine) LoseGPU() {
	m.mutex.Lock()
	defer m.mutex.Unlock()
	m.lost = true
}

// FallOffBus makes a GPU fall off the bus: event sets report
// ERROR_GPU_IS_LOST from now on, and the GPU's queries of its UUID,
// memory, fabric, row remapper, retired pages and compute mode answer
// ERROR_GPU_IS_LOST.
func (m *Machine) FallOffBus(gpu int) {
	m.mutex.Lock()
	defer m.mutex.Unlock()
	m.offBus[gpu] = true
}

// FailUUID makes NVML's GetUUID return ret for a GPU from now on;
// nvml.SUCCESS lets it succeed again.
func (m *Machine) FailUUID(gpu int, ret nvml.Return) {
	m.setFailure(m.uuidFails, gpu, ret)
}

// setFailure records what a call returns for a GPU in fails (one of the
// machine's maps), nvml.SUCCESS removing it.
func (m *Machine) setFailure(fails map[int]nvml.Return, gpu int, ret nvml.Return) {
	m.mutex.Lock()
	defer m.mutex.Unlock()
	if ret == nvml.SUCCESS {
		delete(fails, gpu)
	} else {
		fails[gpu] = ret
	}
}

// buildSysfs lays out the part of /sys that deviceattribute reads:
// bus/pci/devices/<bdf> -> ../../../devices/<root>/<port>/<bdf> with
// numa_node, and devices/system/{node,cpu} with SLIT distances and sockets.
func buildSysfs(spec Spec) FS {
	sysfs := FS{}
	ports := map[string]int{}
	addPCI := func(busID, root string, numa int) {
		ports[root]++
		domain, rootBus, _ := strings.Cut(strings.TrimPrefix(root, "pci"), ":")
		port := fmt.Sprintf("%s:%s:%02x.0", domain, rootBus, ports[root])
		dir := path.Join("devices", root, port, busID)
		sysfs[path.Join(dir, "numa_node")] = &File{Data: fmt.Appendf(nil, "%d\n", numa)}
		sysfs[path.Join("bus/pci/devices", busID)] = &File{
			Data: []byte(path.Join("../../..", dir)),
			Mode: fs.ModeSymlink,
		}
	}
	for _, g := range spec.GPUs {
		addPCI(g.PCIBusID, g.PCIeRoot, g.NUMANode)
	}
	for _, n := range spec.NICs {
		addPCI(n.PCIBusID, n.PCIeRoot, n.NUMANode)
	}
	const cpusPerNode = 4
	for node, row := range spec.NUMADistances {
		dist := make([]string, len(row))
		for i, d := range row {
			dist[i] = fmt.Sprint(d)
		}
		nodeDir := fmt.Sprintf("devices/system/node/node%d", node)
		sysfs[nodeDir+"/distance"] = &File{Data: []byte(strings.Join(dist, " ") + "\n")}
		first := node * cpusPerNode
		sysfs[nodeDir+"/cpulist"] = &File{Data: fmt.Appendf(nil, "%d-%d\n", first, first+cpusPerNode-1)}
		socket := 0
		if node < len(spec.NUMASockets) {
			socket = spec.NUMASockets[node]
		}
		for cpu := first; cpu < first+cpusPerNode; cpu++ {
			cpuDir := fmt.Sprintf("devices/system/cpu/cpu%d", cpu)
			sysfs[cpuDir+"/topology/physical_package_id"] = &File{Data: fmt.Appendf(nil, "%d\n", socket)}
			sysfs[fmt.Sprintf("%s/node%d", cpuDir, node)] = &File{Mode: fs.ModeDir | 0o755}
		}
	}
	return sysfs
}

// WriteSysfs writes the machine's sysfs tree below root, with real
// symlinks, for code that reads a directory (deviceattribute.WithFSFromRoot).
func (m *Machine) WriteSysfs(root string) error {
	return WriteFS(m.sysfs, root)
}

// nvidiaMajor is the character device major number of the NVIDIA driver's
// GPU and control device nodes.
const nvidiaMajor = 195

// nvidiactlMinor is the minor number of /dev/nvidiactl.
const nvidiactlMinor = 255

// WriteDeviceNodes creates the device nodes that the NVIDIA driver gives
// the machine below root/dev: nvidiactl and nvidia<minor> for each GPU,
// character devices of major 195, which needs CAP_MKNOD. Without it they
// are character devices 0:0, which any process may create (Linux 5.8 and
// later) and which stand in for the driver's where only their presence
// and type count (CDI spec generation); numbered reports which. The nodes
// are never opened: NVML is the machine's, not the kernel's.
func (m *Machine) WriteDeviceNodes(root string) (numbered bool, err error) {
	dir := filepath.Join(root, "dev")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return false, err
	}
	names := []string{"nvidiactl"}
	minors := []uint32{nvidiactlMinor}
	for _, d := range m.devices {
		names = append(names, fmt.Sprintf("nvidia%d", d.Minor))
		minors = append(minors, uint32(d.Minor))
	}
	numbered = true
	for i, name := range names {
		p := filepath.Join(dir, name)
		dev := 0
		if numbered {
			dev = int(unix.Mkdev(nvidiaMajor, minors[i]))
		}
		err := unix.Mknod(p, unix.S_IFCHR|0o666, dev)
		if errors.Is(err, unix.EPERM) && numbered {
			numbered = false
			err = unix.Mknod(p, unix.S_IFCHR|0o666, 0)
		}
		if err != nil {
			return false, fmt.Errorf("create device node %s: %w", p, err)
		}
	}
	return numbered, nil
}

// WriteFS writes an in-memory tree to disk below root.
func WriteFS(tree FS, root string) error {
	names := make([]string, 0, len(tree))
	for name := range tree {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		f := tree[name]
		p := filepath.Join(root, filepath.FromSlash(name))
		switch {
		case f.Mode&fs.ModeDir != 0:
			if err := os.MkdirAll(p, 0o755); err != nil {
				return err
			}
		case f.Mode&fs.ModeSymlink != 0:
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				return err
			}
			if err := os.Symlink(string(f.Data), p); err != nil {
				return err
			}
		default:
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				return err
			}
			if err := os.WriteFile(p, f.Data, 0o644); err != nil {
				return err
			}
		}
	}
	return nil
}
