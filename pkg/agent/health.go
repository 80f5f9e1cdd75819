package agent

import (
	"context"
	"errors"
	"time"

	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/agent/discovery"
)

// startHealth (re)starts watching the health of inv's devices. A previous
// watcher is stopped first.
func (a *Agent) startHealth(inv *discovery.Inventory) {
	a.mutex.Lock()
	if a.stopHealth != nil {
		a.stopHealth()
	}
	ctx, cancel := context.WithCancel(a.ctx)
	a.stopHealth = cancel
	a.setHealthActiveLocked(true)
	a.mutex.Unlock()

	events := make(chan discovery.HealthEvent)
	a.wg.Go(func() {
		logger := klog.FromContext(ctx)
		err := a.health.WatchHealth(ctx, inv, events)
		if err != nil && ctx.Err() == nil {
			if errors.Is(err, discovery.ErrHealthUnsupported) {
				logger.Info("device health reporting is not available", "reason", err.Error())
			} else {
				logger.Error(err, "watching device health failed, device health is no longer reported")
			}
			a.mutex.Lock()
			a.setHealthActiveLocked(false)
			a.mutex.Unlock()
		}
		close(events)
	})
	a.wg.Go(func() {
		for ev := range events {
			a.markUnhealthy(ctx, ev)
		}
	})
}

// markUnhealthy records a fault, republishes with a health taint and wakes
// up the kubelet health streams.
func (a *Agent) markUnhealthy(ctx context.Context, ev discovery.HealthEvent) {
	logger := klog.FromContext(ctx)
	if ev.Time.IsZero() {
		ev.Time = time.Now()
	}
	a.mutex.Lock()
	var affected []string
	for _, g := range a.inventory.GPUs {
		if ev.Device != "" && ev.Device != g.Name {
			continue
		}
		if _, already := a.unhealthy[g.Name]; already {
			continue
		}
		a.unhealthy[g.Name] = ev
		affected = append(affected, g.Name)
	}
	if len(affected) > 0 {
		a.healthChangedLocked()
	}
	a.mutex.Unlock()
	if len(affected) == 0 {
		return
	}
	logger.Info("devices became unhealthy", "devices", affected, "reason", ev.Reason, "message", ev.Message)
	if err := a.publish(ctx); err != nil {
		a.HandleError(ctx, err, "publish health taints")
	}
}

// WatchHealthStatus implements kubeletplugin.DRAPlugin. An agent without a
// health source (no Options.Health, and a discovery that cannot watch
// health) returns kubeletplugin.ErrHealthNotSupported at once. Otherwise it
// sends the health of every device now, on every change, and at least
// every 10 seconds so that the kubelet's data does not go stale. While the
// source is not watching (not started yet, NVML not loaded, no device
// reports events, or the watch failed), devices not known to be faulty are
// Unknown rather than the stream ending: the kubelet does not ask again
// for as long as the agent stays registered.
func (a *Agent) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	if a.health == nil {
		return kubeletplugin.ErrHealthNotSupported
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
		if ev, ok := a.unhealthy[g.Name]; ok {
			h.Health = kubeletplugin.HealthStatusUnhealthy
			h.Message = ev.Message
			h.LastUpdated = ev.Time
		}
		report.Devices = append(report.Devices, h)
	}
	return report
}

// setHealthActiveLocked records whether the health source is watching and
// wakes up the kubelet health streams if that changed.
func (a *Agent) setHealthActiveLocked(active bool) {
	if a.healthActive != active {
		a.healthActive = active
		a.healthChangedLocked()
	}
}

// healthChangedLocked wakes up the kubelet health streams.
func (a *Agent) healthChangedLocked() {
	close(a.healthChanged)
	a.healthChanged = make(chan struct{})
}
