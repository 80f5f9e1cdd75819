package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/agent/checkpoint"
	"github.com/topodra/topodra/pkg/agent/discovery"
)

// healthRun is one run of the health source's WatchHealth.
type healthRun struct {
	cancel context.CancelFunc
}

// startHealth (re)starts watching the health of inv's devices. The
// previous watcher and a pending retry are stopped first. Devices count as
// watched only once the new watcher says which it watches.
func (a *Agent) startHealth(inv *discovery.Inventory) {
	a.mutex.Lock()
	a.stopHealthLocked()
	ctx, cancel := context.WithCancel(a.ctx)
	run := &healthRun{cancel: cancel}
	a.healthRun = run
	a.setHealthWatchLocked(false, nil)
	a.setHealthDownLocked("")
	a.mutex.Unlock()
	a.runHealth(ctx, run, inv)
}

// stopHealthLocked stops the current watcher and a pending retry.
func (a *Agent) stopHealthLocked() {
	for _, run := range []*healthRun{a.healthRun, a.healthRetry} {
		if run != nil {
			run.cancel()
		}
	}
	a.healthRun, a.healthRetry = nil, nil
}

// retryHealth starts another watcher of the current devices where the
// health source does not watch every GPU: it failed, or it left some
// unwatched. The current watcher keeps running, and what the agent reports
// stays, until the new one watches: if it watches more GPUs (all that the
// current one watches, and others), it replaces the current one, otherwise
// it is stopped. Nothing happens while a retry is pending, while the first
// watcher has not said what it watches, or without GPUs.
func (a *Agent) retryHealth() {
	a.mutex.Lock()
	inv := a.inventory
	needed := a.health != nil && a.healthRetry == nil && len(inv.GPUs) > 0 &&
		(len(a.unwatched) > 0 || (!a.healthActive && a.healthDown != ""))
	if !needed {
		a.mutex.Unlock()
		return
	}
	ctx, cancel := context.WithCancel(a.ctx)
	run := &healthRun{cancel: cancel}
	a.healthRetry = run
	a.mutex.Unlock()
	klog.FromContext(ctx).V(4).Info("Retrying to watch device health")
	a.runHealth(ctx, run, inv)
}

// healthRetryLoop calls retryHealth every interval.
func (a *Agent) healthRetryLoop(ctx context.Context, interval time.Duration) {
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
			a.retryHealth()
		}
	}
}

// watchesMore says whether a watcher that leaves next unwatched watches
// every GPU that one leaving current unwatched watches, and more.
func watchesMore(next, current discovery.Unwatched) bool {
	if len(next) >= len(current) {
		return false
	}
	for uuid := range next {
		if _, ok := current[uuid]; !ok {
			return false
		}
	}
	return true
}

// runHealth runs the health source for run (a.healthRun or a.healthRetry)
// in the background. Only the run that is a.healthRun changes what the
// agent reports; a pending retry becomes it when it watches more (see
// retryHealth). A run that was stopped changes nothing.
func (a *Agent) runHealth(ctx context.Context, run *healthRun, inv *discovery.Inventory) {
	logger := klog.FromContext(ctx)
	watching := func(unwatched discovery.Unwatched) {
		a.mutex.Lock()
		report, recovered := false, false
		switch {
		case a.healthRun == run:
			a.setHealthWatchLocked(true, unwatched)
			report = true
		case a.healthRetry == run && (!a.healthActive || watchesMore(unwatched, a.unwatched)):
			if a.healthRun != nil {
				a.healthRun.cancel()
			}
			a.healthRun, a.healthRetry = run, nil
			a.setHealthWatchLocked(true, unwatched)
			a.setHealthDownLocked("")
			report, recovered = true, true
		case a.healthRetry == run:
			// Watches no more than the current watcher.
			a.healthRetry = nil
			run.cancel()
		}
		a.mutex.Unlock()
		if !report {
			return
		}
		a.reportPartlyWatched(inv, unwatched)
		if recovered {
			logger.Info("Watching device health", "devices", len(inv.GPUs)-len(unwatched), "unwatched", len(unwatched))
			if len(unwatched) == 0 {
				a.nodeEvent(v1.EventTypeNormal, ReasonHealthWatched, "HealthCheck", "the health of all %d GPUs is watched now", len(inv.GPUs))
			}
		}
	}
	events := make(chan discovery.HealthEvent)
	a.wg.Go(func() {
		defer close(events)
		defer run.cancel()
		err := a.health.WatchHealth(ctx, inv, watching, events)
		if err == nil || ctx.Err() != nil {
			return
		}
		if errors.Is(err, discovery.ErrDriverChanged) {
			a.driverChanged(ctx, err)
			return
		}
		a.mutex.Lock()
		retry := a.healthRetry == run
		if retry {
			a.healthRetry = nil
		}
		changed := false
		if a.healthRun == run || (retry && !a.healthActive) {
			// The current watcher failed, or a retry failed where
			// nothing watches: devices are Unknown, with this reason.
			changed = a.healthDown != err.Error()
			a.setHealthWatchLocked(false, nil)
			a.setHealthDownLocked(err.Error())
		}
		a.mutex.Unlock()
		switch {
		case !changed:
			logger.V(4).Info("Watching device health failed again", "err", err.Error())
		case errors.Is(err, discovery.ErrHealthUnsupported):
			logger.Info("Device health reporting is not available, retrying", "reason", err.Error())
		default:
			logger.Error(err, "Watching device health failed, device health is not reported until a retry succeeds")
		}
	})
	a.wg.Go(func() {
		for ev := range events {
			a.markUnhealthy(ctx, ev)
		}
	})
}

// reportPartlyWatched records a ReasonHealthPartlyWatched warning on the
// Node when the health source watches some of inv's GPUs but not all.
func (a *Agent) reportPartlyWatched(inv *discovery.Inventory, unwatched discovery.Unwatched) {
	var names, devices []string
	for _, g := range inv.GPUs {
		if why, ok := unwatched[g.UUID]; ok {
			names = append(names, fmt.Sprintf("%s (%s)", g.Name, why))
			devices = append(devices, g.Name)
		}
	}
	if len(names) == 0 || len(names) == len(inv.GPUs) {
		return
	}
	a.devicesNodeEvent(devices, v1.EventTypeWarning, ReasonHealthPartlyWatched, "HealthCheck",
		"the health of %d of %d GPUs is not watched, the kubelet gets it as Unknown and their XIDs do not taint them: %s",
		len(names), len(inv.GPUs), strings.Join(names, ", "))
}

// markUnhealthy records a fault under the GPU's UUID (the event's UUID, or
// the GPU that has the event's device name now; all GPUs for an event
// without either), keeps it in the checkpoint, republishes with a health
// taint and wakes up the kubelet health streams. A fault reported again
// for a GPU already faulty keeps its first reason and time (the taint's)
// and records the time of the latest report, which ClearFaultsAnnotation
// goes by. The checkpoint records the latest report's time as the
// fault's: a restarted agent takes that for the fault's time (and the
// taint's timeAdded).
func (a *Agent) markUnhealthy(ctx context.Context, ev discovery.HealthEvent) {
	logger := klog.FromContext(ctx)
	if ev.Time.IsZero() {
		ev.Time = time.Now()
	}
	a.mutex.Lock()
	var affected, again []string
	added := map[string]discovery.HealthEvent{}
	for _, g := range a.inventory.GPUs {
		switch {
		case ev.UUID != "" && ev.UUID != g.UUID:
			continue
		case ev.UUID == "" && ev.Device != "" && ev.Device != g.Name:
			continue
		}
		if _, already := a.faults[g.UUID]; already {
			if ev.Time.After(a.lastReportLocked(g.UUID)) {
				a.faultLast[g.UUID] = ev.Time
				again = append(again, g.Name)
			}
			continue
		}
		fault := ev
		fault.Device, fault.UUID = g.Name, g.UUID
		a.faults[g.UUID] = fault
		a.warnDueLocked(warning{reason: ReasonDeviceUnhealthy, subject: g.UUID}, true)
		delete(a.faultLast, g.UUID)
		delete(a.faultsCleared, g.UUID)
		added[g.UUID] = fault
		affected = append(affected, g.Name)
	}
	if len(affected) > 0 {
		a.healthChangedLocked()
	}
	a.mutex.Unlock()
	if len(again) > 0 {
		logger.V(2).Info("Fault reported again on unhealthy devices", "devices", again, "reason", ev.Reason, "message", ev.Message)
		if len(affected) == 0 {
			a.saveFaults(ctx)
		}
	}
	if len(affected) == 0 {
		return
	}
	logger.Info("Devices became unhealthy", "devices", affected, "reason", ev.Reason, "message", ev.Message)
	// The taint first: it is what keeps new pods off the GPUs.
	if err := a.publish(ctx); err != nil {
		a.HandleError(ctx, err, "publish health taints")
	}
	a.saveFaults(ctx)
	a.reportUnhealthy(ctx, affected, slices.Collect(maps.Keys(added)), ev)
}

// lastReportLocked is when the fault of the GPU with uuid was last
// reported: its time, or the time of a later report of the same GPU.
func (a *Agent) lastReportLocked(uuid string) time.Time {
	t := a.faults[uuid].Time
	if last, ok := a.faultLast[uuid]; ok && last.After(t) {
		return last
	}
	return t
}

// fault returns the fault recorded for the GPU with uuid, if any.
func (a *Agent) fault(uuid string) (discovery.HealthEvent, bool) {
	a.mutex.Lock()
	defer a.mutex.Unlock()
	ev, ok := a.faults[uuid]
	return ev, ok
}

// faultSaveRetry is how often the agent tries again to record GPU faults
// in the checkpoint after writing them failed.
var faultSaveRetry = 5 * time.Second

// saveFaults brings the checkpoint's faults up to date (see writeFaults),
// so that a restarted agent still taints those GPUs and no longer taints
// those cleared. It does not wait for a Prepare or Unprepare (see
// checkpointMutex). A failure is logged and retried every faultSaveRetry
// in the background until it succeeds or the agent stops: the taint is
// published (or removed) all the same.
func (a *Agent) saveFaults(ctx context.Context) {
	if a.store == nil {
		return
	}
	err := a.writeFaults()
	if err == nil {
		return
	}
	utilruntime.HandleErrorWithContext(ctx, err, "Cannot record GPU faults in the checkpoint, retrying; an agent restarted meanwhile would not know them, or taint GPUs whose faults were cleared")
	a.mutex.Lock()
	retrying := a.faultsUnsaved
	a.faultsUnsaved = true
	a.mutex.Unlock()
	if retrying {
		return
	}
	// In the agent's wait group, so that Stop does not release the state
	// lock while a retry may still write the checkpoint.
	a.wg.Go(func() {
		_ = wait.PollUntilContextCancel(a.ctx, faultSaveRetry, false, func(context.Context) (bool, error) {
			if err := a.writeFaults(); err != nil {
				klog.FromContext(ctx).V(2).Info("Recording GPU faults in the checkpoint failed again", "err", err)
				return false, nil
			}
			a.mutex.Lock()
			a.faultsUnsaved = false
			n := len(a.faults)
			a.mutex.Unlock()
			klog.FromContext(ctx).Info("Recorded GPU faults in the checkpoint", "faults", n)
			return true, nil
		})
	})
}

// writeFaults writes the agent's faults into the checkpoint, each with the
// time of its latest report, and removes those cleared since the last
// write. Faults that only the checkpoint has (it could not be read when
// the agent started) stay. The faults are read under the checkpoint's
// lock, so that writes that race write the latest state last.
func (a *Agent) writeFaults() error {
	removed := map[string]uint64{}
	err := a.updateCheckpoint(func(cp *checkpoint.Checkpoint) {
		a.mutex.Lock()
		defer a.mutex.Unlock()
		clear(removed)
		for uuid, gen := range a.faultsCleared {
			delete(cp.Faults, uuid)
			removed[uuid] = gen
		}
		if cp.Faults == nil && len(a.faults) > 0 {
			cp.Faults = map[string]checkpoint.Fault{}
		}
		for uuid, ev := range a.faults {
			cp.Faults[uuid] = checkpoint.Fault{Device: ev.Device, Reason: ev.Reason, Message: ev.Message, Time: a.lastReportLocked(uuid).UTC()}
		}
	})
	if err != nil {
		return err
	}
	// A clear made while this write ran (a newer clearGen) is written by
	// the next.
	a.mutex.Lock()
	defer a.mutex.Unlock()
	for uuid, gen := range removed {
		if a.faultsCleared[uuid] == gen {
			delete(a.faultsCleared, uuid)
		}
	}
	return nil
}

// loadFaults takes over the faults recorded in the checkpoint; a fault's
// time is that of its latest report before the restart.
func (a *Agent) loadFaults() error {
	cp, err := a.store.Load()
	if err != nil {
		return err
	}
	a.mutex.Lock()
	defer a.mutex.Unlock()
	for uuid, f := range cp.Faults {
		a.faults[uuid] = discovery.HealthEvent{Device: f.Device, UUID: uuid, Reason: f.Reason, Message: f.Message, Time: f.Time}
	}
	return nil
}

// ReasonDeviceUnhealthy is the reason of the warning events on the node and
// on the prepared claims whose device became unhealthy. The FieldPath of
// their regarding reference names the devices ("devices{gpu-3}"), so that
// faults of different GPUs are separate events. They are recorded again
// every EventRepeat while the fault lasts.
const ReasonDeviceUnhealthy = "DeviceUnhealthy"

// reportUnhealthy tells the users of the devices: a warning event on every
// prepared claim that holds one of them (the pods that use the claim may
// fail), and one on the node that names those claims. It is called when
// the devices become unhealthy, and again every EventRepeat while they
// stay so (see repeatWarnings).
func (a *Agent) reportUnhealthy(ctx context.Context, devices, uuids []string, ev discovery.HealthEvent) {
	if a.opts.Recorder == nil {
		return
	}
	what := ev.Reason
	if ev.Message != "" {
		what += ": " + ev.Message
	}
	var users []string
	var unknown string
	if a.store != nil {
		// Reading may fail for a moment (the checkpoint is being written
		// elsewhere, I/O errors): the events on the claims are lost, the
		// one on the Node says so. Nothing else depends on it.
		cp, err := a.store.Load()
		if err != nil {
			utilruntime.HandleErrorWithContext(ctx, err, "Cannot read the checkpoint to find the claims that use unhealthy devices")
			unknown = fmt.Sprintf("the claims that use them are unknown (the checkpoint could not be read: %v)", err)
		} else {
			uids := slices.Sorted(maps.Keys(cp.Claims))
			for _, uid := range uids {
				claim := cp.Claims[uid]
				for _, d := range claim.Devices {
					if !slices.Contains(uuids, d.UUID) {
						continue
					}
					if isRecovered(claim) {
						// Its name is unknown: the Node's event names it.
						users = append(users, "UID "+string(uid))
						break
					}
					ref := devicesRef(claimRef(claim.Namespace, claim.Name, uid), []string{d.Device})
					a.event(ref, nil, v1.EventTypeWarning, ReasonDeviceUnhealthy, "HealthCheck",
						"device %s on node %s is unhealthy (%s); pods using this claim may fail", d.Device, a.opts.NodeName, what)
					users = append(users, claim.Namespace+"/"+claim.Name)
					break
				}
			}
		}
	}
	inUse := "no prepared claim uses them"
	switch {
	case unknown != "":
		inUse = unknown
	case len(users) > 0:
		inUse = "used by claims " + strings.Join(users, ", ")
	}
	a.devicesNodeEvent(devices, v1.EventTypeWarning, ReasonDeviceUnhealthy, "HealthCheck",
		"devices %s are unhealthy since %s (%s), tainted %s until the node reboots or the annotation %s clears the fault after a GPU reset; %s", strings.Join(devices, ", "), ev.Time.UTC().Format(time.RFC3339), what, HealthTaintKey, ClearFaultsAnnotation, inUse)
}

// WatchHealthStatus implements kubeletplugin.DRAPlugin. An agent without a
// health source (no Options.Health, and a discovery that cannot watch
// health) returns kubeletplugin.ErrHealthNotSupported at once. Otherwise it
// waits for the agent to start (see Start), then
// sends the health of every device now, on every change, and at least
// every 10 seconds so that the kubelet's data does not go stale. A device
// is Healthy only while the source watches it and no fault was seen. While
// the source is not watching (not started yet, NVML not loaded, no device
// reports events, or the watch failed), devices not known to be faulty are
// Unknown rather than the stream ending: the kubelet does not ask again
// for as long as the agent stays registered. A device that the source
// does not watch while it watches others is Unknown with a message that
// says why. A GPU whose row remapping the last discovery found failed is
// Unhealthy, watched or not. A faulty GPU that discovery no longer finds
// stays in the report as Unhealthy.
func (a *Agent) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	if a.health == nil {
		return kubeletplugin.ErrHealthNotSupported
	}
	if a.awaitStart(ctx) != nil {
		// The stream or the agent ended first.
		return nil
	}
	for {
		a.mutex.Lock()
		changed := a.healthChanged
		report := a.healthReportLocked()
		a.mutex.Unlock()
		select {
		case <-ctx.Done():
			return nil
		case reports <- report:
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		case <-time.After(healthResendInterval):
		}
	}
}

func (a *Agent) healthReportLocked() kubeletplugin.DeviceHealthReport {
	now := time.Now()
	var report kubeletplugin.DeviceHealthReport
	// Healthy means: watched, and no fault seen.
	known := kubeletplugin.HealthStatusUnknown
	if a.healthActive {
		known = kubeletplugin.HealthStatusHealthy
	}
	for _, g := range a.inventory.GPUs {
		h := kubeletplugin.DeviceHealth{
			PoolName:           a.opts.PoolName,
			DeviceName:         g.Name,
			Health:             known,
			LastUpdated:        now,
			HealthCheckTimeout: healthCheckTimeout,
		}
		if ev, ok := a.faults[g.UUID]; ok {
			h.Health = kubeletplugin.HealthStatusUnhealthy
			h.Message = ev.Message
			h.LastUpdated = ev.Time
		} else if g.RowRemapFailed {
			h.Health = kubeletplugin.HealthStatusUnhealthy
			h.Message = rowRemapFault.Message
		} else if why, ok := a.unwatched[g.UUID]; ok {
			h.Health = kubeletplugin.HealthStatusUnknown
			h.Message = "health not watched: " + why
		} else if !a.healthActive && a.healthDown != "" {
			h.Message = "health not watched: " + a.healthDown
		}
		report.Devices = append(report.Devices, h)
	}
	// A faulty GPU that discovery no longer finds (fallen off the bus)
	// stays Unhealthy under the name it had, unless another GPU has that
	// name now: the kubelet would otherwise lose its health, and the pods
	// that use it would not show that their GPU failed.
	for _, uuid := range slices.Sorted(maps.Keys(a.faults)) {
		ev := a.faults[uuid]
		if ev.Device == "" || slices.ContainsFunc(report.Devices, func(d kubeletplugin.DeviceHealth) bool { return d.DeviceName == ev.Device }) {
			continue
		}
		msg := fmt.Sprintf("GPU %s is missing from discovery", uuid)
		if ev.Message != "" {
			msg = ev.Message + "; " + msg
		}
		report.Devices = append(report.Devices, kubeletplugin.DeviceHealth{
			PoolName:           a.opts.PoolName,
			DeviceName:         ev.Device,
			Health:             kubeletplugin.HealthStatusUnhealthy,
			Message:            msg,
			LastUpdated:        now,
			HealthCheckTimeout: healthCheckTimeout,
		})
	}
	return report
}

// setHealthWatchLocked records whether the health source is watching and
// which GPUs it does not watch, and wakes up the kubelet health streams if
// that changed.
func (a *Agent) setHealthWatchLocked(active bool, unwatched discovery.Unwatched) {
	if a.healthActive != active || !maps.Equal(a.unwatched, unwatched) {
		a.healthActive = active
		a.unwatched = unwatched
		a.healthChangedLocked()
	}
}

// setHealthDownLocked records why the health source stopped watching
// ("" while it watches or starts to), for the message of the devices it
// leaves Unknown, and wakes up the kubelet health streams if that changed.
func (a *Agent) setHealthDownLocked(why string) {
	if a.healthDown != why {
		a.healthDown = why
		a.healthChangedLocked()
	}
}

// healthChangedLocked wakes up the kubelet health streams.
func (a *Agent) healthChangedLocked() {
	close(a.healthChanged)
	a.healthChanged = make(chan struct{})
}
