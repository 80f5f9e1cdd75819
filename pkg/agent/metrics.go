package agent

import (
	"errors"
	"strings"
	"sync/atomic"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/component-base/metrics"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/checkpoint"
)

// Metric names of [Agent.MetricsCollector]. Every metric is node-local
// and bounded: no claim, pod or device labels.
const (
	// MetricNVMLUsable (gauge) is 0 while the agent cannot use NVML
	// (see [Agent.NVMLUnusable]), 1 otherwise.
	MetricNVMLUsable = "topodra_agent_nvml_usable"
	// MetricGPUs (gauge) counts GPUs by state (label "state", see the
	// GPUState constants), as the agent finds them and wants them
	// published; MetricSlicesSynced says whether the API has them so.
	// The states overlap: GPUs in the other states are published too
	// (unless an unhealthy GPU is missing from discovery), and a GPU may
	// be in several of them.
	MetricGPUs = "topodra_agent_gpus"
	// MetricPreparedClaims (gauge) counts the prepared claims in the
	// checkpoint.
	MetricPreparedClaims = "topodra_agent_prepared_claims"
	// MetricStalePreparedClaims (gauge) counts the prepared claims that
	// the API server no longer has, or has without an allocation, and
	// that keep their GPUs until the kubelet unprepares them or
	// Options.StaleClaimGrace ends (see CleanupStaleClaims).
	MetricStalePreparedClaims = "topodra_agent_stale_prepared_claims"
	// MetricPrepareErrors (counter) counts the claims that a Prepare call
	// did not prepare, by reason (label "reason", see the PrepareError
	// constants). A call that fails as a whole counts each of its claims.
	MetricPrepareErrors = "topodra_agent_prepare_errors_total"
	// MetricKubeletRegistered (gauge) is 1 once the kubelet has
	// registered the plugin, 0 before and while it refuses it (see
	// ReasonNotRegistered); always 0 for a publish-only agent.
	MetricKubeletRegistered = "topodra_agent_kubelet_registered"
	// MetricSlicesSynced (gauge) is 1 while the node's ResourceSlices in
	// the API are those the agent wants published (Publisher.Synced), 0
	// while a write fails, the API server dropped fields, a change waits
	// to be written, and while the agent publishes nothing (before its
	// first publish; NVML unusable and its slices unreadable).
	MetricSlicesSynced = "topodra_agent_slices_synced"
	// MetricPublishErrors (counter) counts the errors that publishing
	// the node's ResourceSlices reports, by reason (label "reason", see
	// the PublishError constants); failed writes are retried.
	MetricPublishErrors = "topodra_agent_publish_errors_total"
)

// Values of the "state" label of MetricGPUs.
const (
	// GPUStatePublished: devices in the pool the agent publishes.
	GPUStatePublished = "published"
	// GPUStateUnhealthy: GPUs that reported a critical fault during this
	// boot, or whose row remapping discovery finds failed; the agent
	// publishes them with HealthTaintKey (in the API once
	// MetricSlicesSynced is 1).
	GPUStateUnhealthy = "unhealthy"
	// GPUStateUnwatched: published GPUs without a fault whose health is
	// not watched: the kubelet gets their health as Unknown, and an XID
	// does not taint them.
	GPUStateUnwatched = "unwatched"
	// GPUStateFabricNotReady: GPUs whose NVLink fabric is not ready; the
	// agent publishes them with FabricNotReadyTaintKey.
	GPUStateFabricNotReady = "fabric_not_ready"
	// GPUStateResetRequired: GPUs that need a reset to apply a repair of
	// their memory; the agent publishes them with ResetRequiredTaintKey.
	GPUStateResetRequired = "reset_required"
	// GPUStateComputeProhibited: GPUs whose compute mode is Prohibited;
	// the agent publishes them with ComputeProhibitedTaintKey.
	GPUStateComputeProhibited = "compute_prohibited"
	// GPUStateNotPublished: GPUs that NVML finds and the agent does not
	// publish (ReasonGPUNotPublished).
	GPUStateNotPublished = "not_published"
)

// gpuStates are the values of the "state" label of MetricGPUs, in the
// order the metric reports them.
var gpuStates = [...]string{
	GPUStatePublished,
	GPUStateUnhealthy,
	GPUStateUnwatched,
	GPUStateNotPublished,
	GPUStateFabricNotReady,
	GPUStateResetRequired,
	GPUStateComputeProhibited,
}

// GPUStates returns the values of the "state" label of MetricGPUs, in the
// order the metric reports them.
func GPUStates() []string {
	return gpuStates[:]
}

// Values of the "reason" label of MetricPrepareErrors.
const (
	PrepareErrorDeviceInUse        = "device_in_use"        // ErrDeviceInUse
	PrepareErrorClaimBusy          = "claim_busy"           // ErrClaimBusy
	PrepareErrorUnhealthyDevice    = "unhealthy_device"     // ErrDeviceUnhealthy
	PrepareErrorGPUMoved           = "gpu_moved"            // ErrGPUMoved
	PrepareErrorReallocated        = "reallocated"          // ErrReallocated
	PrepareErrorConfigNotSupported = "config_not_supported" // ErrConfigNotSupported
	PrepareErrorDevicePlugin       = "device_plugin"        // ErrDevicePluginConflict
	PrepareErrorOtherDriver        = "other_driver"         // ErrOtherDriverConflict
	PrepareErrorDeviceNodeMissing  = "device_node_missing"  // cdi.ErrMissingDeviceNode
	PrepareErrorCDIHookMissing     = "cdi_hook_missing"     // cdi.ErrHookMissing
	PrepareErrorNVMLUnusable       = "nvml_unusable"        // ErrNVMLUnusable
	PrepareErrorNoState            = "no_state"             // ErrNoState
	PrepareErrorStateUnwritable    = "state_unwritable"     // ErrStateUnwritable
	PrepareErrorOther              = "other"
)

// prepareErrorReasons are the values of the "reason" label of
// MetricPrepareErrors with the errors behind them, in the order of
// Agent.prepareErrors; an error counts under the first reason whose cause
// it wraps. The last reason, other, has no cause and takes the rest.
// From device_plugin on, the others are the node's set-up, not the
// claim's: every new claim fails there until an admin fixes the node.
var prepareErrorReasons = [...]struct {
	reason string
	cause  error
}{
	{PrepareErrorDeviceInUse, ErrDeviceInUse},
	{PrepareErrorClaimBusy, ErrClaimBusy},
	{PrepareErrorUnhealthyDevice, ErrDeviceUnhealthy},
	{PrepareErrorGPUMoved, ErrGPUMoved},
	{PrepareErrorReallocated, ErrReallocated},
	{PrepareErrorConfigNotSupported, ErrConfigNotSupported},
	{PrepareErrorDevicePlugin, ErrDevicePluginConflict},
	{PrepareErrorOtherDriver, ErrOtherDriverConflict},
	{PrepareErrorDeviceNodeMissing, cdi.ErrMissingDeviceNode},
	{PrepareErrorCDIHookMissing, cdi.ErrHookMissing},
	{PrepareErrorNVMLUnusable, ErrNVMLUnusable},
	{PrepareErrorNoState, ErrNoState},
	{PrepareErrorStateUnwritable, ErrStateUnwritable},
	{PrepareErrorOther, nil},
}

// prepareErrorCounts counts failed claims by the index of their reason in
// prepareErrorReasons.
type prepareErrorCounts [len(prepareErrorReasons)]atomic.Uint64

// prepareErrorIndex is the index in prepareErrorReasons of err's reason.
func prepareErrorIndex(err error) int {
	for i, r := range prepareErrorReasons {
		if r.cause != nil && errors.Is(err, r.cause) {
			return i
		}
	}
	return len(prepareErrorReasons) - 1
}

// PrepareErrorReasons returns the values of the "reason" label of
// MetricPrepareErrors, in the order the metric reports them.
func PrepareErrorReasons() []string {
	out := make([]string, 0, len(prepareErrorReasons))
	for _, r := range prepareErrorReasons {
		out = append(out, r.reason)
	}
	return out
}

// countPrepareErrors counts the claims of a Prepare call that were not
// prepared: all of them where the call failed (err), otherwise those
// whose result has an error.
func (a *Agent) countPrepareErrors(claims []*resourceapi.ResourceClaim, result map[types.UID]kubeletplugin.PrepareResult, err error) {
	for _, claim := range claims {
		e := err
		if e == nil {
			e = result[claim.UID].Err
		}
		if e != nil {
			a.prepareErrors[prepareErrorIndex(e)].Add(1)
		}
	}
}

// recordClaimCounts keeps the number of prepared claims and of those
// found gone, as the checkpoint cp that was just read or written has them.
func (a *Agent) recordClaimCounts(cp *checkpoint.Checkpoint) {
	a.preparedClaims.Store(int64(len(cp.Claims)))
	gone := 0
	for uid := range cp.Gone {
		if _, ok := cp.Claims[uid]; ok {
			gone++
		}
	}
	a.staleClaims.Store(int64(gone))
}

// metricsState is what the gauges report, read at once.
type metricsState struct {
	nvmlUsable, synced bool
	// gpus counts the GPUs by state (MetricGPUs).
	gpus map[string]int
}

func (a *Agent) readMetricsState() metricsState {
	synced := a.slicesSynced()
	a.mutex.Lock()
	defer a.mutex.Unlock()
	gpus := map[string]int{
		GPUStateUnhealthy:    len(a.faults),
		GPUStateNotPublished: len(a.inventory.Skipped),
	}
	if !a.holdPublishing {
		gpus[GPUStatePublished] = len(a.inventory.GPUs)
	}
	for _, g := range a.inventory.GPUs {
		if g.Fabric != nil {
			gpus[GPUStateFabricNotReady]++
		}
		if g.ResetRequired != "" {
			gpus[GPUStateResetRequired]++
		}
		if g.ComputeProhibited {
			gpus[GPUStateComputeProhibited]++
		}
		if _, faulty := a.faults[g.UUID]; faulty {
			continue
		}
		if g.RowRemapFailed {
			gpus[GPUStateUnhealthy]++
			continue
		}
		if _, unwatched := a.unwatched[g.UUID]; a.health == nil || !a.healthActive || unwatched {
			gpus[GPUStateUnwatched]++
		}
	}
	return metricsState{synced: synced, nvmlUsable: a.nvmlUnusable == nil, gpus: gpus}
}

// MetricsCollector returns a collector of the agent's metrics (the Metric
// constants), read from the agent's state at each scrape. The metrics
// carry no node label: register the collector in a registry that serves
// one agent (the node agent command does, beside the process's
// legacyregistry), never in a registry that several agents of one
// process share. Each call returns a new collector.
func (a *Agent) MetricsCollector() metrics.StableCollector {
	return &collector{
		agent: a,
		nvmlUsable: metrics.NewDesc(MetricNVMLUsable,
			"1 while the node agent can use NVML, 0 while it cannot: GPUs cannot be prepared for new claims then and carry the "+NVMLUnusableTaintKey+" taint (after a driver upgrade: reboot the node).",
			nil, nil, metrics.ALPHA, ""),
		gpus: metrics.NewDesc(MetricGPUs,
			"GPUs of the node by state, as the node agent finds them and wants them published ("+MetricSlicesSynced+" says whether the API has them so): published (in the agent's pool), unhealthy (critical fault during this boot, or row remapping failed; the agent publishes them tainted "+HealthTaintKey+"), unwatched (in the pool, no fault, health not watched: Unknown to the kubelet), not_published (found by NVML, left out of the pool), fabric_not_ready (tainted "+FabricNotReadyTaintKey+"), reset_required (memory repair pending a GPU reset; tainted "+ResetRequiredTaintKey+"), compute_prohibited (compute mode Prohibited; tainted "+ComputeProhibitedTaintKey+"). States overlap.",
			[]string{"state"}, nil, metrics.ALPHA, ""),
		prepared: metrics.NewDesc(MetricPreparedClaims,
			"ResourceClaims prepared on the node (in the agent's checkpoint).",
			nil, nil, metrics.ALPHA, ""),
		stale: metrics.NewDesc(MetricStalePreparedClaims,
			"Prepared ResourceClaims that the API server no longer has, or has without an allocation: their GPUs stay reserved until the kubelet unprepares them or --stale-claim-grace ends (see the Node's "+ReasonPreparedClaimGone+" events).",
			nil, nil, metrics.ALPHA, ""),
		prepareErrors: metrics.NewDesc(MetricPrepareErrors,
			"ResourceClaims that a Prepare call did not prepare, by reason: "+strings.Join(PrepareErrorReasons(), ", ")+". The kubelet retries; the pod's events and the node agent's log say why.",
			[]string{"reason"}, nil, metrics.ALPHA, ""),
		synced: metrics.NewDesc(MetricSlicesSynced,
			"1 while the node's ResourceSlices in the API are what the node agent publishes, 0 while a write fails, the API server dropped fields of a slice, a change waits to be written, or the agent publishes nothing: devices and taints (a faulty GPU's "+HealthTaintKey+") that changed since are not in the API then (see "+MetricPublishErrors+" and the Node's "+ReasonPublishFailed+" and "+ReasonSliceFieldsDropped+" events).",
			nil, nil, metrics.ALPHA, ""),
		publishErrors: metrics.NewDesc(MetricPublishErrors,
			"Errors publishing the node's ResourceSlices, by reason: "+strings.Join(PublishErrorReasons(), ", ")+". Failed writes are retried; forbidden and invalid do not fix themselves (see the Node's "+ReasonPublishFailed+" events).",
			[]string{"reason"}, nil, metrics.ALPHA, ""),
		registered: metrics.NewDesc(MetricKubeletRegistered,
			"1 once the kubelet has registered the node agent's DRA plugin, 0 before and while the kubelet refuses it: pods with claims of the node's GPUs cannot start then (see the Node's "+ReasonNotRegistered+" events).",
			nil, nil, metrics.ALPHA, ""),
	}
}

// collector is the metrics.StableCollector of one Agent.
type collector struct {
	metrics.BaseStableCollector
	agent                                                                               *Agent
	nvmlUsable, gpus, prepared, stale, prepareErrors, registered, synced, publishErrors *metrics.Desc
}

var _ metrics.StableCollector = &collector{}

// DescribeWithStability implements metrics.StableCollector.
func (c *collector) DescribeWithStability(ch chan<- *metrics.Desc) {
	for _, d := range []*metrics.Desc{c.nvmlUsable, c.gpus, c.prepared, c.stale, c.prepareErrors, c.registered, c.synced, c.publishErrors} {
		ch <- d
	}
}

// CollectWithStability implements metrics.StableCollector.
func (c *collector) CollectWithStability(ch chan<- metrics.Metric) {
	a := c.agent
	s := a.readMetricsState()
	usable := 0.0
	if s.nvmlUsable {
		usable = 1
	}
	ch <- metrics.NewLazyConstMetric(c.nvmlUsable, metrics.GaugeValue, usable)
	for _, state := range gpuStates {
		ch <- metrics.NewLazyConstMetric(c.gpus, metrics.GaugeValue, float64(s.gpus[state]), state)
	}
	ch <- metrics.NewLazyConstMetric(c.prepared, metrics.GaugeValue, float64(a.preparedClaims.Load()))
	ch <- metrics.NewLazyConstMetric(c.stale, metrics.GaugeValue, float64(a.staleClaims.Load()))
	for i, r := range prepareErrorReasons {
		ch <- metrics.NewLazyConstMetric(c.prepareErrors, metrics.CounterValue, float64(a.prepareErrors[i].Load()), r.reason)
	}
	registered := 0.0
	if a.Registered() {
		registered = 1
	}
	ch <- metrics.NewLazyConstMetric(c.registered, metrics.GaugeValue, registered)
	synced := 0.0
	if s.synced {
		synced = 1
	}
	ch <- metrics.NewLazyConstMetric(c.synced, metrics.GaugeValue, synced)
	for i, reason := range publishErrorReasons {
		ch <- metrics.NewLazyConstMetric(c.publishErrors, metrics.CounterValue, float64(a.publishErrors[i].Load()), reason)
	}
}
