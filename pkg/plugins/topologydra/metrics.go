package topologydra

import (
	"fmt"
	"strings"
	"sync"

	v1 "k8s.io/api/core/v1"
	"k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/legacyregistry"
)

const metricsSubsystem = "topodra"

var (
	allocationDuration = metrics.NewHistogram(&metrics.HistogramOpts{
		Subsystem: metricsSubsystem,
		Name:      "allocation_duration_seconds",
		Help:      "Time to find the best allocation of a pod's claims on one node (one Filter call).",
		// 10 us to about 10.5 s: up to filterTimeout's default of 10 s.
		Buckets:        metrics.ExponentialBuckets(0.00001, 2, 21),
		StabilityLevel: metrics.ALPHA,
	})
	placements = metrics.NewCounterVec(&metrics.CounterOpts{
		Subsystem:      metricsSubsystem,
		Name:           "placements_total",
		Help:           "Pods whose claims topodra allocated, by the tightest topology level their devices share (an attribute name, node, or device for a single device).",
		StabilityLevel: metrics.ALPHA,
	}, []string{"level"})
	devicesAllocated = metrics.NewHistogram(&metrics.HistogramOpts{
		Subsystem:      metricsSubsystem,
		Name:           "devices_per_placement",
		Help:           "Number of devices allocated per pod.",
		Buckets:        []float64{1, 2, 4, 8, 16, 32},
		StabilityLevel: metrics.ALPHA,
	})
	devicesConsidered = metrics.NewHistogram(&metrics.HistogramOpts{
		Subsystem:      metricsSubsystem,
		Name:           "devices_considered",
		Help:           "Devices of a node that topodra's allocator looked at in one Filter call (upstream-only paths not counted).",
		Buckets:        metrics.ExponentialBuckets(1, 2, 12),
		StabilityLevel: metrics.ALPHA,
	})
	verifyMismatches = metrics.NewCounter(&metrics.CounterOpts{
		Subsystem:      metricsSubsystem,
		Name:           "verify_mismatch_total",
		Help:           "Allocations that Filter decided by counting and that the upstream allocator refused in Reserve (counting and upstream disagree; the node is then allocated by upstream directly for a while).",
		StabilityLevel: metrics.ALPHA,
	})
	headroomHolds = metrics.NewCounter(&metrics.CounterOpts{
		Subsystem:      metricsSubsystem,
		Name:           "headroom_holds_total",
		Help:           "Scheduling attempts in which smallPodHeadroomPercent turned a pod down on at least one node that its devices fit (devices kept free for smaller pods), as distinct from devices short.",
		StabilityLevel: metrics.ALPHA,
	})
	headroomHeldPods = metrics.NewGauge(&metrics.GaugeOpts{
		Subsystem:      metricsSubsystem,
		Name:           "headroom_held_pods",
		Help:           "Pods whose latest scheduling attempt smallPodHeadroomPercent turned down on at least one node that their devices fit, and that are still waiting (not reserved, not deleted).",
		StabilityLevel: metrics.ALPHA,
	})
	unownedAllocations = metrics.NewCounterVec(&metrics.CounterOpts{
		Subsystem:      metricsSubsystem,
		Name:           "unowned_devices_allocated_total",
		Help:           "Devices allocated that do not carry the owned taint (ownedTaintKey), by driver: where a default scheduler runs beside topodra, it can allocate these devices too.",
		StabilityLevel: metrics.ALPHA,
	}, []string{"driver"})
	uncertainClaims = metrics.NewGauge(&metrics.GaugeOpts{
		Subsystem:      metricsSubsystem,
		Name:           "uncertain_allocation_writes",
		Help:           "Claims whose allocation write failed without telling whether the API server stored it, and whose state could not be read since: their devices stay taken until it can.",
		StabilityLevel: metrics.ALPHA,
	})
	devicesAllocatedTwice = metrics.NewGauge(&metrics.GaugeOpts{
		Subsystem:      metricsSubsystem,
		Name:           "devices_allocated_twice",
		Help:           "Dedicated devices that two claims hold at once as the scheduler's claim cache shows them (another scheduler or a hand-written allocation gave a device out twice), as of the latest scheduling attempt.",
		StabilityLevel: metrics.ALPHA,
	})
	unschedulableAttempts = metrics.NewCounterVec(&metrics.CounterOpts{
		Subsystem:      metricsSubsystem,
		Name:           "unschedulable_attempts_total",
		Help:           "Scheduling attempts in which TopologyDRA turned the pod down, by profile and reason: of the pod's claims, or the reason it turned down the most nodes for (" + strings.Join(rejectionNames[:], ", ") + "). Attempts in which only other plugins turned nodes down are not counted.",
		StabilityLevel: metrics.ALPHA,
	}, []string{"profile", "reason"})
	registerOnce sync.Once
)

func init() {
	registerOnce.Do(func() {
		legacyregistry.MustRegister(allocationDuration, placements, devicesAllocated, devicesConsidered, verifyMismatches, headroomHolds, headroomHeldPods, unownedAllocations, uncertainClaims, devicesAllocatedTwice, unschedulableAttempts)
	})
}

// recordPlacement updates metrics and emits an event on the pod naming the
// chosen devices and the domain they share.
func (pl *TopologyDRA) recordPlacement(pod *v1.Pod, nodeName string, s *stateData) {
	q := s.result.Quality
	level := q.LevelName
	if level == "" {
		level = "node"
	}
	placements.WithLabelValues(level).Inc()
	devicesAllocated.Observe(float64(len(q.Devices)))
	where := "devices span domains"
	if q.Domain != "" {
		where = "sharing " + q.Domain
	} else if len(q.Devices) == 1 {
		where = "single device"
	}
	msg := fmt.Sprintf("allocated %s on node %s (%s)", devicesByPool(q.Devices), nodeName, where)
	if why := s.result.Explanation.String(); why != "" && q.Domain == "" && len(q.Devices) > 1 {
		// Why the devices could not share a domain here.
		msg += ": " + why
	}
	if s.draining.Has(nodeName) {
		msg += "; the node was being kept for waiting whole-node pods, and no other node offered as good a placement"
	}
	pl.event(pod, v1.EventTypeNormal, "DevicesAllocated", "Binding", "%s", msg)
}

// devicesByPool lists devices named "driver/pool/device" by pool, each
// pool once: "gpu.topodra.io/node-a: gpu-0, gpu-1; dra.net/node-a:
// nic-0" (a pool name may hold slashes, driver and device names none).
// Names without a pool are listed as they are.
func devicesByPool(devices []string) string {
	var pools []string
	byPool := map[string][]string{}
	for _, d := range devices {
		pool, name := "", d
		if i := strings.LastIndex(d, "/"); i > 0 && strings.Contains(d[:i], "/") {
			pool, name = d[:i], d[i+1:]
		}
		if _, ok := byPool[pool]; !ok {
			pools = append(pools, pool)
		}
		byPool[pool] = append(byPool[pool], name)
	}
	parts := make([]string, 0, len(pools))
	for _, pool := range pools {
		if pool == "" {
			parts = append(parts, strings.Join(byPool[pool], ", "))
			continue
		}
		parts = append(parts, pool+": "+strings.Join(byPool[pool], ", "))
	}
	return strings.Join(parts, "; ")
}
