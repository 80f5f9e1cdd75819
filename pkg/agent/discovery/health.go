package discovery

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"k8s.io/klog/v2"
)

// ErrHealthUnsupported is returned (wrapped, with the reasons) by
// WatchHealth when no device can be watched: none supports the events
// that health watching needs, or registering for them failed on each.
var ErrHealthUnsupported = errors.New("device health cannot be watched")

// ApplicationXIDs are XIDs caused by applications (illegal address, page
// faults, a killed context, …) rather than by the GPU. They do not make a
// device unhealthy. Every other XID does.
var ApplicationXIDs = map[uint64]bool{
	13:  true, // graphics engine exception
	31:  true, // GPU memory page fault
	43:  true, // GPU stopped processing (reset channel)
	45:  true, // preemptive cleanup after a killed context
	68:  true, // video processor exception
	109: true, // context switch timeout
}

// xidMessages explain the most common critical XIDs in the taint message.
var xidMessages = map[uint64]string{
	48:  "double-bit ECC error",
	63:  "ECC page retirement or row remapping event",
	64:  "ECC page retirement or row remapper recording failure",
	74:  "NVLink error",
	79:  "GPU has fallen off the bus",
	92:  "high single-bit ECC error rate",
	94:  "contained ECC error",
	95:  "uncontained ECC error",
	119: "GSP RPC timeout",
	120: "GSP error",
}

// LostReportInterval is how often a watcher reports again a GPU that
// NVML still answers as lost.
var LostReportInterval = time.Minute

// waitTimeout bounds one wait on the NVML event set so that cancellation
// is noticed promptly.
const waitTimeout = 1000 * time.Millisecond

// WatchHealth implements [HealthWatcher] with NVML events: a critical XID
// on a device marks that device unhealthy. An XID whose device cannot say
// its UUID any more (a GPU that fell off the bus) is matched to a watched
// GPU by its handle. An event set reporting ERROR_GPU_IS_LOST, which does
// not say which GPU, marks the watched GPUs that now answer NVML with
// ERROR_GPU_IS_LOST; only where none does (NVML cannot tell) every device.
// When NVML has lost the kernel driver it returns an error wrapping
// [ErrDriverChanged] instead of waiting on a library that cannot recover.
// A GPU whose handle cannot be got, that does not support critical XID
// events or for which registering them fails is not watched: it is named
// to watching with the NVML call that failed, unless no GPU can be watched
// (then WatchHealth returns [ErrHealthUnsupported]).
func (d *NVML) WatchHealth(ctx context.Context, inv *Inventory, watching func(Unwatched), events chan<- HealthEvent) error {
	return wrapDriverChanged(d.watchHealth(ctx, inv, watching, events))
}

func (d *NVML) watchHealth(ctx context.Context, inv *Inventory, watching func(Unwatched), events chan<- HealthEvent) error {
	logger := klog.FromContext(ctx)

	set, ret := d.lib.EventSetCreate()
	if ret != nvml.SUCCESS {
		return fmt.Errorf("create NVML event set: %w", ret)
	}
	defer set.Free()

	nameByUUID := map[string]string{}
	// handles are the watched GPUs' NVML handles by UUID: an event's
	// device is one of them.
	handles := map[string]nvml.Device{}
	var unwatched Unwatched
	for _, gpu := range inv.GPUs {
		dev, why, err := registerXIDEvents(d.lib, gpu.UUID, set)
		if driverChanged(err) {
			return fmt.Errorf("watch health of %s: %w", gpu.Name, err)
		}
		if why != "" {
			logger.Info("device health not watched", "device", gpu.Name, "uuid", gpu.UUID, "reason", why)
			if unwatched == nil {
				unwatched = Unwatched{}
			}
			unwatched[gpu.UUID] = why
			continue
		}
		nameByUUID[gpu.UUID] = gpu.Name
		handles[gpu.UUID] = dev
	}
	if len(nameByUUID) == 0 {
		var reasons []string
		for _, gpu := range inv.GPUs {
			reasons = append(reasons, gpu.Name+": "+unwatched[gpu.UUID])
		}
		if len(reasons) == 0 {
			return fmt.Errorf("%w: no GPUs", ErrHealthUnsupported)
		}
		return fmt.Errorf("%w: %s", ErrHealthUnsupported, strings.Join(reasons, "; "))
	}
	logger.V(2).Info("watching device health", "devices", len(nameByUUID), "unwatched", len(unwatched))
	watching(unwatched)

	send := func(ev HealthEvent) bool {
		select {
		case <-ctx.Done():
			return false
		case events <- ev:
			return true
		}
	}
	pause := func() bool {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(waitTimeout):
			return true
		}
	}

	// A GPU that discovery found lost (fell off the bus before this
	// watcher started) is not published and not watched; NVML may answer
	// every wait of the event set with ERROR_GPU_IS_LOST from then on, so
	// that the watched GPUs' XIDs cannot be received: they are marked
	// (all of them), as for a lost GPU that NVML cannot name.
	lostMessage := "NVML reports a lost GPU and cannot say which"
	if slices.ContainsFunc(inv.Skipped, func(s Skipped) bool { return s.Lost }) {
		lostMessage = "NVML reports a lost GPU, one that discovery found lost and does not publish; the XIDs of the others may not be received until the node reboots"
	}
	// lostReported is when each GPU was last reported lost, "" for all of
	// them; while NVML says so it is reported again every
	// LostReportInterval (the agent dedups), so that a fault cleared
	// while the GPU is still lost comes back.
	lostReported := map[string]time.Time{}
	due := func(uuid string) bool {
		if time.Since(lostReported[uuid]) < LostReportInterval {
			return false
		}
		lostReported[uuid] = time.Now()
		return true
	}
	for ctx.Err() == nil {
		data, ret := set.Wait(uint32(waitTimeout.Milliseconds()))
		switch ret {
		case nvml.SUCCESS:
		case nvml.ERROR_TIMEOUT:
			continue
		case nvml.ERROR_GPU_IS_LOST:
			lost := lostGPUs(handles)
			if len(lost) == 0 && due("") {
				logger.Info("NVML reports a lost GPU but no watched GPU answers as lost, marking all devices", "why", lostMessage)
				if !send(HealthEvent{Reason: "gpu-lost", Message: lostMessage, Time: time.Now()}) {
					return nil
				}
			}
			for _, uuid := range lost {
				if !due(uuid) {
					continue
				}
				if !send(HealthEvent{Device: nameByUUID[uuid], UUID: uuid, Reason: "gpu-lost", Message: "NVML reports the GPU lost (fallen off the bus)", Time: time.Now()}) {
					return nil
				}
			}
			if !pause() {
				return nil
			}
			continue
		default:
			if driverChanged(ret) {
				return fmt.Errorf("wait for NVML events: %w", ret)
			}
			logger.Info("waiting for NVML events failed", "err", ret)
			if !pause() {
				return nil
			}
			continue
		}
		if data.EventType&nvml.EventTypeXidCriticalError == 0 {
			continue
		}
		xid := data.EventData
		if ApplicationXIDs[xid] {
			logger.V(4).Info("ignoring application XID", "xid", xid)
			continue
		}
		// A device that cannot say its UUID is found by its handle; one
		// that is neither (or no device) leaves every GPU suspect. A
		// device we do not publish (MIG-enabled) is ignored.
		name, uuid := "", ""
		if data.Device != nil {
			var ret nvml.Return
			uuid, ret = data.Device.GetUUID()
			switch {
			case ret != nvml.SUCCESS:
				if uuid = uuidOfHandle(handles, data.Device); uuid != "" {
					name = nameByUUID[uuid]
					break
				}
				logger.Info("Critical XID on a device that is not known by its UUID or handle, marking all devices", "xid", xid, "err", ret)
			case nameByUUID[uuid] == "":
				logger.Info("Ignoring critical XID on an unpublished device", "xid", xid, "uuid", uuid)
				continue
			default:
				name = nameByUUID[uuid]
			}
		}
		msg := fmt.Sprintf("critical XID %d", xid)
		if what, ok := xidMessages[xid]; ok {
			msg += ": " + what
		}
		if !send(HealthEvent{Device: name, UUID: uuid, Reason: fmt.Sprintf("xid-%d", xid), Message: msg, Time: time.Now()}) {
			return nil
		}
	}
	return nil
}

// registerXIDEvents registers set for the critical XID events of the GPU
// with the given UUID. It returns the GPU's handle, why the GPU cannot be
// watched (empty when it is), and the NVML return that made it so (nil
// when it is watched or simply does not support the events).
func registerXIDEvents(lib nvml.Interface, uuid string, set nvml.EventSet) (nvml.Device, string, error) {
	dev, ret := lib.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		return nil, fmt.Sprintf("NVML DeviceGetHandleByUUID failed: %v", ret), ret
	}
	supported, ret := dev.GetSupportedEventTypes()
	if ret != nvml.SUCCESS {
		return nil, fmt.Sprintf("NVML GetSupportedEventTypes failed: %v", ret), ret
	}
	if supported&nvml.EventTypeXidCriticalError == 0 {
		return nil, "the GPU does not support critical XID events", nil
	}
	if ret := dev.RegisterEvents(nvml.EventTypeXidCriticalError, set); ret != nvml.SUCCESS {
		return nil, fmt.Sprintf("NVML RegisterEvents failed: %v", ret), ret
	}
	return dev, "", nil
}

// lostGPUs returns the UUIDs, in order, of the GPUs among handles that
// NVML answers with ERROR_GPU_IS_LOST: it does so for every call on a GPU
// that has fallen off the bus. Two calls are asked, one the driver may
// answer from what it keeps (the UUID) and one that reads the GPU (its
// memory use).
func lostGPUs(handles map[string]nvml.Device) []string {
	var lost []string
	for uuid, dev := range handles {
		_, r1 := dev.GetUUID()
		_, r2 := dev.GetMemoryInfo()
		if r1 == nvml.ERROR_GPU_IS_LOST || r2 == nvml.ERROR_GPU_IS_LOST {
			lost = append(lost, uuid)
		}
	}
	slices.Sort(lost)
	return lost
}

// uuidOfHandle returns the UUID under which handles holds dev, "" where
// none. NVML hands out one handle per GPU for the life of the library, so
// an event's device is the handle the GPU was registered with.
func uuidOfHandle(handles map[string]nvml.Device, dev nvml.Device) string {
	if t := reflect.TypeOf(dev); t == nil || !t.Comparable() {
		return ""
	}
	for uuid, h := range handles {
		if reflect.TypeOf(h) == reflect.TypeOf(dev) && h == dev {
			return uuid
		}
	}
	return ""
}
