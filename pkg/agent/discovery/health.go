package discovery

import (
	"context"
	"errors"
	"fmt"
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

// waitTimeout bounds one wait on the NVML event set so that cancellation
// is noticed promptly.
const waitTimeout = 1000 * time.Millisecond

// WatchHealth implements [HealthWatcher] with NVML events: a critical XID
// on a device marks that device unhealthy; an event set reporting
// ERROR_GPU_IS_LOST marks every device unhealthy (NVML does not say which).
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
	var unwatched Unwatched
	for _, gpu := range inv.GPUs {
		why, err := registerXIDEvents(d.lib, gpu.UUID, set)
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

	lostReported := false
	for ctx.Err() == nil {
		data, ret := set.Wait(uint32(waitTimeout.Milliseconds()))
		switch ret {
		case nvml.SUCCESS:
		case nvml.ERROR_TIMEOUT:
			continue
		case nvml.ERROR_GPU_IS_LOST:
			if !lostReported {
				lostReported = true
				if !send(HealthEvent{Reason: "gpu-lost", Message: "NVML reports a lost GPU", Time: time.Now()}) {
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
		// Without a device NVML cannot say which GPU failed: all are
		// suspect. A device we do not publish (MIG-enabled) is ignored.
		name, uuid := "", ""
		if data.Device != nil {
			var ret nvml.Return
			uuid, ret = data.Device.GetUUID()
			if ret != nvml.SUCCESS {
				uuid = ""
				logger.Info("critical XID on a device without UUID, marking all devices", "xid", xid, "err", ret)
			} else if name = nameByUUID[uuid]; name == "" {
				logger.Info("ignoring critical XID on an unpublished device", "xid", xid, "uuid", uuid)
				continue
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
// with the given UUID. It returns why the GPU cannot be watched, empty
// when it is, and the NVML return that made it so (nil when it is
// watched or simply does not support the events).
func registerXIDEvents(lib nvml.Interface, uuid string, set nvml.EventSet) (string, error) {
	dev, ret := lib.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		return fmt.Sprintf("NVML DeviceGetHandleByUUID failed: %v", ret), ret
	}
	supported, ret := dev.GetSupportedEventTypes()
	if ret != nvml.SUCCESS {
		return fmt.Sprintf("NVML GetSupportedEventTypes failed: %v", ret), ret
	}
	if supported&nvml.EventTypeXidCriticalError == 0 {
		return "the GPU does not support critical XID events", nil
	}
	if ret := dev.RegisterEvents(nvml.EventTypeXidCriticalError, set); ret != nvml.SUCCESS {
		return fmt.Sprintf("NVML RegisterEvents failed: %v", ret), ret
	}
	return "", nil
}
