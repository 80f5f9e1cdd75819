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
	a.healthActive = true
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
			a.healthActive = false
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
		close(a.healthChanged)
		a.healthChanged = make(chan struct{})
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

// WatchHealthStatus implements kubeletplugin.DRAPlugin. Without a working
// health source it returns kubeletplugin.ErrHealthNotSupported at once.
// Otherwise it sends the health of every device now, on every change, and
// at least every 10 seconds so that the kubelet's data does not go stale.
func (a *Agent) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	for {
		a.mutex.Lock()
		active := a.healthActive
		changed := a.healthChanged
		report := a.healthReportLocked()
		a.mutex.Unlock()
		if !active {
			return kubeletplugin.ErrHealthNotSupported
		}
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
	for _, g := range a.inventory.GPUs {
		h := kubeletplugin.DeviceHealth{
			PoolName:           a.opts.PoolName,
			DeviceName:         g.Name,
			Health:             kubeletplugin.HealthStatusHealthy,
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
