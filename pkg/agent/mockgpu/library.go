package mockgpu

import (
	"sync/atomic"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Library is one load of the machine's NVML library by a process, with its
// own driver version. [Library.Break] makes it behave as a loaded
// libnvidia-ml does after the kernel driver was upgraded under the running
// process: every call returns ERROR_LIB_RM_VERSION_MISMATCH. A test that
// simulates a driver upgrade breaks one Library and hands out another with
// the new version to the next load.
type Library struct {
	nvml.Interface
	driverVersion string
	broken        atomic.Bool
	shutdowns     atomic.Int32
	eventSets     atomic.Int32
}

var _ nvml.Interface = &Library{}

// Library returns a new load of the machine's NVML that reports
// driverVersion (empty: the machine's own).
func (m *Machine) Library(driverVersion string) *Library {
	return &Library{Interface: m.server, driverVersion: driverVersion}
}

// Break makes every later call fail with ERROR_LIB_RM_VERSION_MISMATCH.
func (l *Library) Break() { l.broken.Store(true) }

// Shutdowns counts the calls of Shutdown.
func (l *Library) Shutdowns() int { return int(l.shutdowns.Load()) }

// EventSets counts the event sets created (health watchers started).
func (l *Library) EventSets() int { return int(l.eventSets.Load()) }

func (l *Library) ret() nvml.Return {
	if l.broken.Load() {
		return nvml.ERROR_LIB_RM_VERSION_MISMATCH
	}
	return nvml.SUCCESS
}

// Init implements nvml.Interface.
func (l *Library) Init() nvml.Return {
	if ret := l.ret(); ret != nvml.SUCCESS {
		return ret
	}
	return l.Interface.Init()
}

// Shutdown implements nvml.Interface.
func (l *Library) Shutdown() nvml.Return {
	l.shutdowns.Add(1)
	return l.Interface.Shutdown()
}

// SystemGetDriverVersion implements nvml.Interface.
func (l *Library) SystemGetDriverVersion() (string, nvml.Return) {
	if ret := l.ret(); ret != nvml.SUCCESS {
		return "", ret
	}
	if l.driverVersion != "" {
		return l.driverVersion, nvml.SUCCESS
	}
	return l.Interface.SystemGetDriverVersion()
}

// DeviceGetCount implements nvml.Interface.
func (l *Library) DeviceGetCount() (int, nvml.Return) {
	if ret := l.ret(); ret != nvml.SUCCESS {
		return 0, ret
	}
	return l.Interface.DeviceGetCount()
}

// DeviceGetHandleByIndex implements nvml.Interface.
func (l *Library) DeviceGetHandleByIndex(i int) (nvml.Device, nvml.Return) {
	if ret := l.ret(); ret != nvml.SUCCESS {
		return nil, ret
	}
	return l.Interface.DeviceGetHandleByIndex(i)
}

// DeviceGetHandleByUUID implements nvml.Interface.
func (l *Library) DeviceGetHandleByUUID(uuid string) (nvml.Device, nvml.Return) {
	if ret := l.ret(); ret != nvml.SUCCESS {
		return nil, ret
	}
	return l.Interface.DeviceGetHandleByUUID(uuid)
}

// EventSetCreate implements nvml.Interface: the set's Wait fails too once
// the library is broken.
func (l *Library) EventSetCreate() (nvml.EventSet, nvml.Return) {
	if ret := l.ret(); ret != nvml.SUCCESS {
		return nil, ret
	}
	set, ret := l.Interface.EventSetCreate()
	if ret != nvml.SUCCESS {
		return nil, ret
	}
	l.eventSets.Add(1)
	return &librarySet{EventSet: set, lib: l}, nvml.SUCCESS
}

type librarySet struct {
	nvml.EventSet
	lib *Library
}

func (s *librarySet) Wait(timeoutMs uint32) (nvml.EventData, nvml.Return) {
	if ret := s.lib.ret(); ret != nvml.SUCCESS {
		return nvml.EventData{}, ret
	}
	data, ret := s.EventSet.Wait(timeoutMs)
	if ret == nvml.ERROR_TIMEOUT {
		if broken := s.lib.ret(); broken != nvml.SUCCESS {
			return nvml.EventData{}, broken
		}
	}
	return data, ret
}
