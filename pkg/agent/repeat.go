package agent

import (
	"cmp"
	"context"
	"slices"
	"time"

	"github.com/topodra/topodra/pkg/agent/discovery"
)

// EventRepeat is how often the agent records a Warning about a condition
// that lasts again, while it lasts: a faulty GPU (ReasonDeviceUnhealthy on
// the Node and on the claims that hold it), no GPU found (ReasonNoGPU) and
// NVML unusable (ReasonNVMLUnusable). The API server keeps an event for
// an hour by default (kube-apiserver --event-ttl), after which kubectl
// describe node would show nothing of a fault reported once.
const EventRepeat = 30 * time.Minute

// warning identifies a condition that lasts, as its Warnings announce
// it: their reason, and what they are about (a GPU's UUID; "" for the
// node).
type warning struct {
	reason, subject string
}

// warnDueLocked says whether a Warning about w is to be recorded now, and
// if so records that it is: where the condition is new or has changed
// (changed), or its last Warning is EventRepeat old or older by
// Options.Clock. The caller holds a.mutex.
func (a *Agent) warnDueLocked(w warning, changed bool) bool {
	now := a.opts.Clock.Now()
	if last, ok := a.warned[w]; ok && !changed && now.Sub(last) < EventRepeat {
		return false
	}
	a.warned[w] = now
	return true
}

// repeatLoop calls repeatWarnings every interval.
func (a *Agent) repeatLoop(ctx context.Context, interval time.Duration) {
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
			a.repeatWarnings(ctx)
		}
	}
}

// repeatWarnings records the ReasonDeviceUnhealthy Warnings of the faulty
// GPUs whose last Warning is EventRepeat old, or that have none yet (the
// agent took them over from the checkpoint), naming each GPU as
// discovery names it now (as when the fault was seen where it is
// missing). The Warnings of NoGPU and NVMLUnusable are repeated by the
// discoveries that find them again (see recordDiscovery).
func (a *Agent) repeatWarnings(ctx context.Context) {
	type due struct {
		name string
		ev   discovery.HealthEvent
	}
	var dues []due
	a.mutex.Lock()
	names := map[string]string{}
	for _, g := range a.inventory.GPUs {
		names[g.UUID] = g.Name
	}
	for uuid, ev := range a.faults {
		if a.warnDueLocked(warning{reason: ReasonDeviceUnhealthy, subject: uuid}, false) {
			dues = append(dues, due{name: cmp.Or(names[uuid], ev.Device), ev: ev})
		}
	}
	a.mutex.Unlock()
	slices.SortFunc(dues, func(x, y due) int { return cmp.Compare(x.name, y.name) })
	for _, d := range dues {
		a.reportUnhealthy(ctx, []string{d.name}, []string{d.ev.UUID}, d.ev)
	}
}
