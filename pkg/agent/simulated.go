package agent

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
)

// SimulatedOptions configure [StartSimulated].
type SimulatedOptions struct {
	// NodeName of the simulated node; the Node object must exist (the
	// slices are owned by it). Required.
	NodeName string
	// Profile is a mockgpu profile name, e.g. mockgpu.ProfileDGXH100.
	// Required unless Machine is set.
	Profile string
	// Machine, if set, is used instead of building one from Profile
	// (for custom specs or for a machine shared with a test).
	Machine *mockgpu.Machine
	// KubeClient talks to the API server. Required.
	KubeClient kubernetes.Interface
	// OwnedTaint: see [Options.OwnedTaint].
	OwnedTaint bool
	// UnhealthyTaintEffect: see [Options.UnhealthyTaintEffect].
	UnhealthyTaintEffect resourceapi.DeviceTaintEffect
	// NICs also publishes the machine's simulated NICs under driver
	// mockgpu.NICDriverName, in a pool named after the node.
	NICs bool
	// StateDir and CDIDir enable direct Prepare/Unprepare calls; optional.
	StateDir, CDIDir string
	// NUMAForm: see discovery.NVMLOptions.
	NUMAForm discovery.NUMAForm
	// Recorder, if set, receives the agent's events (see [Options.Recorder]).
	Recorder events.EventRecorder
}

// Simulated is a publish-only agent on a simulated machine.
type Simulated struct {
	Agent   *Agent
	Machine *mockgpu.Machine
	// NICs publishes the machine's NICs (nil unless requested).
	NICs *Publisher
}

// StartSimulated runs an agent for one simulated node in this process: it
// builds the mock machine (unless given), discovery on it, and an agent in
// publish-only mode (no kubelet needed); with NICs it also publishes the
// machine's NICs. Health faults are injected through Machine (InjectXID,
// LoseGPU) and show up as device taints. A simulator runs N nodes by calling
// this N times with different node names, each with its own machine (GPU
// UUIDs are seeded by the node name). Stop it with Stop or by canceling ctx.
func StartSimulated(ctx context.Context, opts SimulatedOptions) (*Simulated, error) {
	if opts.NodeName == "" {
		return nil, errors.New("node name must be set")
	}
	m := opts.Machine
	if m == nil {
		var err error
		m, err = mockgpu.New(opts.Profile, mockgpu.Options{NodeName: opts.NodeName})
		if err != nil {
			return nil, err
		}
	}
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: m.NVML(), Sysfs: m.Sysfs(), NUMAForm: opts.NUMAForm})
	if err != nil {
		return nil, err
	}
	a, err := New(ctx, Options{
		NodeName:    opts.NodeName,
		KubeClient:  opts.KubeClient,
		Discovery:   disc,
		PublishOnly: true,
		StateDir:    opts.StateDir,
		CDIDir:      opts.CDIDir,
		OwnedTaint:  opts.OwnedTaint,
		Recorder:    opts.Recorder,

		UnhealthyTaintEffect: opts.UnhealthyTaintEffect,
	})
	if err != nil {
		return nil, err
	}
	s := &Simulated{Agent: a, Machine: m}
	if opts.NICs && len(m.NICDevices()) > 0 {
		s.NICs, err = PublishStatic(ctx, opts.KubeClient, mockgpu.NICDriverName, opts.NodeName, m.NICResources())
		if err != nil {
			a.Stop()
			return nil, err
		}
	}
	return s, nil
}

// Stop stops the agent and the NIC publisher.
func (s *Simulated) Stop() {
	s.NICs.Stop()
	s.Agent.Stop()
}

// Publisher publishes fixed resources of one driver for one node through
// a resourceslice controller (the engine behind the kubelet plugin helper's
// PublishResources), with the Node as owner of the slices.
type Publisher struct {
	controller *resourceslice.Controller
	queue      *countingQueue
	state      *syncState
}

// PublishStatus describes a [Publisher].
type PublishStatus struct {
	// Syncs counts completed sync attempts of the pool(s). After a
	// (re)start, Syncs > 0 means the controller has compared the API with
	// the desired slices at least once.
	Syncs int64
	// Stats counts the API writes the controller made.
	Stats resourceslice.Stats
	// Synced says whether the slices in the API are those of the
	// resources last handed to the publisher (see Publisher.Synced).
	Synced bool
}

// PublishStatic publishes fixed resources of one driver for one node (the
// Node must exist; it owns the slices) until ctx is canceled or Stop is
// called. Simulators use it for devices without a driver of their own, like
// mockgpu's NICs; publish-only agents use it for their GPUs.
func PublishStatic(ctx context.Context, client kubernetes.Interface, driverName, nodeName string, resources resourceslice.DriverResources) (*Publisher, error) {
	return publishStatic(ctx, client, driverName, nodeName, "", resources, publishHooks{})
}

// publishHooks tell the owner of a Publisher what its controller does.
// Nil hooks are not called. The controller calls them from its worker,
// one at a time.
type publishHooks struct {
	// failed gets each error that the controller reports, after it is
	// logged: a sync that failed (it is retried with backoff, up to
	// publishRetryMax apart) or a resourceslice.DroppedFieldsError.
	failed func(ctx context.Context, err error)
	// synced is called after each sync that leaves the slices in the API
	// as desired (see Publisher.Synced).
	synced func(ctx context.Context)
}

// publishStatic is PublishStatic with the Node's UID, if known (otherwise
// the controller looks it up once), and hooks.
func publishStatic(ctx context.Context, client kubernetes.Interface, driverName, nodeName string, nodeUID types.UID, resources resourceslice.DriverResources, hooks publishHooks) (*Publisher, error) {
	logger := klog.LoggerWithValues(klog.FromContext(ctx), "node", nodeName, "driver", driverName)
	ctx = klog.NewContext(ctx, klog.LoggerWithName(logger, "ResourceSlice controller"))
	state := newSyncState(&resources)
	p := &Publisher{queue: newCountingQueue(ctx, state, hooks.synced), state: state}
	var err error
	p.controller, err = resourceslice.StartController(ctx, resourceslice.Options{
		DriverName: driverName,
		KubeClient: client,
		Owner:      &resourceslice.Owner{APIVersion: "v1", Kind: "Node", Name: nodeName, UID: nodeUID},
		Resources:  &resources,
		Queue:      p.queue,
		ErrorHandler: func(ctx context.Context, err error, msg string) {
			// Like the kubelet plugin helper: publishing errors are
			// not fixed by a restart, so they are all recoverable.
			utilruntime.HandleErrorWithContext(ctx, err, msg)
			state.report(err)
			if hooks.failed != nil {
				hooks.failed(ctx, err)
			}
		},
	})
	if err != nil {
		return nil, fmt.Errorf("publish %s resources for node %s: %w", driverName, nodeName, err)
	}
	return p, nil
}

// Update replaces the published resources.
func (p *Publisher) Update(resources resourceslice.DriverResources) {
	p.controller.Update(&resources)
	// After the controller has them: a sync that begins before this
	// counts for the resources before, which it may have published
	// already or not.
	p.state.update(&resources)
}

// Status reports what the controller has done so far.
func (p *Publisher) Status() PublishStatus {
	return PublishStatus{Syncs: p.queue.done.Load(), Stats: p.controller.GetStats(), Synced: p.state.synced()}
}

// Synced says whether the slices in the API are those of the resources
// last handed to the publisher, as far as the controller can tell: the
// last sync of each of their pools began after they were handed over,
// made every write it needed, and the API server stored every field of
// the slices it wrote (no resourceslice.DroppedFieldsError for them); and
// no sync of another pool, whose slices the controller deletes, has
// failed since it last succeeded. Changes that others make in the API
// count once the controller's informer has seen them and synced again
// (within its sync delay, 30 s).
func (p *Publisher) Synced() bool {
	return p.state.synced()
}

// Stop stops publishing and waits for the controller. The slices stay.
// Stop on a nil Publisher is a no-op.
func (p *Publisher) Stop() {
	if p == nil {
		return
	}
	p.controller.Stop()
}

// publishRetryMax is the longest a Publisher waits before it tries a
// failed sync again. The controller's default backoff grows to more than
// 16 minutes, which an outage of the API server of half an hour reaches:
// a faulty GPU's taint would wait that long after the API server is back.
const publishRetryMax = time.Minute

// countingQueue is the controller's work queue, with its backoff capped at
// publishRetryMax, counting Done calls (one per processed item) and
// telling state when a sync of a pool begins and ends; synced, if not nil,
// is called with ctx after a sync that leaves the API as desired.
type countingQueue struct {
	workqueue.TypedRateLimitingInterface[string]
	done   atomic.Int64
	state  *syncState
	ctx    context.Context
	synced func(ctx context.Context)
}

func newCountingQueue(ctx context.Context, state *syncState, synced func(context.Context)) *countingQueue {
	return &countingQueue{
		TypedRateLimitingInterface: workqueue.NewTypedRateLimitingQueueWithConfig(
			publishRateLimiter(),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "node_resource_slices"},
		),
		state:  state,
		ctx:    ctx,
		synced: synced,
	}
}

// publishRateLimiter is the backoff of a Publisher's failed syncs: the
// controller's default, from 5 ms doubling at each failure, capped at
// publishRetryMax.
func publishRateLimiter() workqueue.TypedRateLimiter[string] {
	return workqueue.NewTypedItemExponentialFailureRateLimiter[string](5*time.Millisecond, publishRetryMax)
}

// Get is called by the controller's one worker before it syncs a pool.
func (q *countingQueue) Get() (string, bool) {
	item, shutdown := q.TypedRateLimitingInterface.Get()
	if !shutdown {
		q.state.begin()
	}
	return item, shutdown
}

// Done is called by the controller's worker after it synced item, and
// after it reported the sync's errors.
func (q *countingQueue) Done(item string) {
	synced := q.state.end(item)
	q.TypedRateLimitingInterface.Done(item)
	q.done.Add(1)
	if synced && q.synced != nil {
		q.synced(q.ctx)
	}
}
