package agent

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/checkpoint"
	"github.com/topodra/topodra/pkg/agent/discovery"
)

// ReasonTakeOverBlocked (Warning, once per distinct cause): an agent with
// Options.RollingUpdateUID does not take over from the agent that runs on
// the node, because its dry run of what it does once it holds the lock on
// StateDir fails (see checkTakeOver). It has not registered with the
// kubelet, so it stays unready, the rollout stops at this node and the
// running agent keeps serving; it checks again with backoff.
const ReasonTakeOverBlocked = "TopodraTakeOverBlocked"

// takeOverDiscoveryTimeout is how long the takeover check waits for
// discovery before it counts discovery as hung. A hung discovery is not
// started again: later checks wait for the same call.
var takeOverDiscoveryTimeout = time.Minute

// canTakeOver checks, before an agent with RollingUpdateUID registers
// with the kubelet (which then sends its calls to it, not to the agent
// it replaces), what it can check without the lock on StateDir and what
// cannot get better by waiting: that it can write CDI specs and read the
// checkpoint as the running agent left it. Where it cannot, Start fails:
// the pod does not become ready, the rollout stops on this node, and the
// running agent keeps serving (an agent rolled back to a build that
// cannot read a newer checkpoint). What can get better by waiting
// (discovery) is checked by awaitTakeOver.
func (a *Agent) canTakeOver(ctx context.Context) error {
	if a.opts.StateDir == "" || a.opts.CDIDir == "" {
		return nil
	}
	if err := probeDir(a.opts.CDIDir); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrCDIDir, a.opts.CDIDir, err)
	}
	if _, err := checkpoint.Read(a.opts.StateDir); err != nil {
		err = fmt.Errorf("%w: %w", ErrCheckpoint, err)
		klog.FromContext(ctx).Error(err, "Cannot take over from the running agent: the record of prepared claims is unreadable", "path", filepath.Join(a.opts.StateDir, checkpoint.FileName))
		a.nodeEvent(v1.EventTypeWarning, ReasonCheckpointUnreadable, "TakeOver",
			"%s does not take over from the agent that runs on this node: %v; that agent keeps serving, and this pod stays unready, which stops the rollout here. Roll back to the agent that wrote the file, or forward to one that reads it (docs/agent.md: \"Unreadable checkpoint\")",
			a.opts.DriverName, err)
		return err
	}
	return nil
}

// awaitTakeOver runs checkTakeOver until it passes, before an agent with
// RollingUpdateUID starts its kubelet sockets: until then the kubelet
// does not register it, Ready fails naming why, and the rollout does not
// stop the running agent. It reports each new cause in the log and as a
// ReasonTakeOverBlocked Warning on the Node and checks again after
// NoGPURetry, doubling up to RescanInterval. It returns nil once the
// check passes, the cause of ctx once ctx ends.
func (a *Agent) awaitTakeOver(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	retry := a.opts.NoGPURetry
	reported := ""
	for {
		err := a.checkTakeOver(ctx)
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		if err == nil {
			if reported != "" {
				logger.Info("The dry run before taking over from the running agent passes now")
			}
			return nil
		}
		if msg := err.Error(); msg != reported {
			reported = msg
			logger.Error(err, "Not taking over from the running agent: what this agent does once it holds the node's state fails; the running agent keeps serving, retrying")
			a.nodeCauseEvent(v1.EventTypeWarning, ReasonTakeOverBlocked, "TakeOver",
				"%s does not take over from the agent that runs on this node: %v; that agent keeps serving, and this pod stays unready, which stops the rollout here; retrying. Roll back (kubectl rollout undo), or fix the cause (docs/agent.md: \"Rolling updates\")",
				a.opts.DriverName, err)
		}
		what := "waiting to take over from the running agent: " + err.Error()
		if run := a.takeOverRun; run != nil {
			// Discovery still hangs: not live after maxStartStep,
			// as where it hangs in start.
			a.step.Store(&startStep{what: what, since: run.since})
		} else {
			a.setStep(what, true)
		}
		timer := time.NewTimer(retry)
		select {
		case <-ctx.Done():
			timer.Stop()
			return context.Cause(ctx)
		case <-timer.C:
		}
		retry = min(2*retry, max(a.opts.RescanInterval, a.opts.NoGPURetry))
	}
}

// dryRun is a run of what start does with the devices, without the lock
// on StateDir and without publishing: discovery, building the resources
// to publish, and building a CDI spec of the GPUs found. done is closed
// once the other fields are set.
type dryRun struct {
	since time.Time
	done  chan struct{}
	// devices are the names of the devices it would publish.
	devices []string
	// skipped is how many GPUs discovery found and does not publish.
	skipped int
	// discoverErr is what discovery returned (discovery.ErrNoGPU
	// included).
	discoverErr error
	// fault is a panic, or why the CDI spec cannot be built.
	fault error
}

// startDryRun starts a dryRun in the background. It is not waited for by
// Stop: NVML can hang, and a hung call cannot be canceled.
func (a *Agent) startDryRun(ctx context.Context) *dryRun {
	r := &dryRun{since: time.Now(), done: make(chan struct{})}
	go func() {
		defer close(r.done)
		defer func() {
			if p := recover(); p != nil {
				r.fault = fmt.Errorf("panic: %v", p)
			}
		}()
		inv, err := a.discovery.Discover(ctx)
		if err != nil {
			r.discoverErr = err
			return
		}
		r.skipped = len(inv.Skipped)
		resources := BuildResources(inv, a.opts.PoolName, nil, TaintOptions{
			Owned:     a.opts.OwnedTaint,
			OwnedKey:  a.opts.OwnedTaintKey,
			Unhealthy: a.opts.UnhealthyTaintEffect,
		})
		for _, d := range resources.Pools[a.opts.PoolName].Slices[0].Devices {
			r.devices = append(r.devices, d.Name)
		}
		if len(inv.GPUs) == 0 {
			return
		}
		var generator cdi.Generator = cdi.Static{}
		if a.opts.CDIGenerator != nil {
			generator = a.opts.CDIGenerator
		}
		devices := make([]cdi.Device, 0, len(inv.GPUs))
		for _, g := range inv.GPUs {
			devices = append(devices, cdi.Device{Name: g.Name, UUID: g.UUID, Minor: g.Minor})
		}
		if _, err := cdi.Spec(generator, "takeover-check", devices); err != nil {
			r.fault = fmt.Errorf("cannot build the CDI spec of its GPUs: %w", err)
		}
	}()
	return r
}

// checkTakeOver is the dry run that an agent with RollingUpdateUID passes
// before it registers with the kubelet, while another agent holds the
// lock on StateDir; without such an agent there is nothing to take over
// from, and it passes (start then handles a node without GPUs, or where
// NVML does not work, as at any start). It runs discovery as start does
// (reusing a run that has not returned yet), builds the resources it
// would publish and the CDI spec of their GPUs, and fails where
//   - discovery has not returned within takeOverDiscoveryTimeout, or
//     panics, or the CDI spec cannot be built;
//   - it would not publish a device that the running agent publishes
//     usable (without NVMLUnusableTaintKey): discovery finds no GPU
//     (discovery.ErrNoGPU), fails, or leaves the device out.
//
// So a node without GPUs or driver (nothing published), or where NVML
// does not work for the running agent either (its devices tainted),
// does not hold up the takeover; a build whose discovery fails where the
// running agent's works does. The devices in the API are read anew at
// every check: a GPU that the running agent still publishes and that is
// gone passes once that agent's rescan has left it out.
func (a *Agent) checkTakeOver(ctx context.Context) error {
	held, err := stateLockHeld(a.opts.StateDir)
	if err != nil {
		return err
	}
	if !held {
		return nil
	}
	run := a.takeOverRun
	if run == nil {
		run = a.startDryRun(ctx)
		a.takeOverRun = run
	}
	a.step.Store(&startStep{what: "checking that it can take over from the running agent: discovering GPUs", since: run.since})
	timer := time.NewTimer(max(0, takeOverDiscoveryTimeout-time.Since(run.since)))
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-timer.C:
		return fmt.Errorf("GPU discovery has not returned within %s (does NVML hang?)", takeOverDiscoveryTimeout)
	case <-run.done:
	}
	a.takeOverRun = nil
	if run.fault != nil {
		return run.fault
	}
	published, err := a.publishedDevices(ctx)
	if err != nil {
		return fmt.Errorf("cannot read the devices that the running agent publishes: %w", err)
	}
	usable := sets.New[string]()
	for _, d := range published {
		if !slices.ContainsFunc(d.Taints, func(t resourceapi.DeviceTaint) bool { return t.Key == NVMLUnusableTaintKey }) {
			usable.Insert(d.Name)
		}
	}
	missing := sets.List(usable.Difference(sets.New(run.devices...)))
	if len(missing) == 0 {
		return nil
	}
	var why string
	switch {
	case errors.Is(run.discoverErr, discovery.ErrNoGPU):
		why = fmt.Sprintf("discovery finds no GPU: %v", run.discoverErr)
	case run.discoverErr != nil:
		why = fmt.Sprintf("discovery fails: %v", run.discoverErr)
	case run.skipped > 0:
		why = fmt.Sprintf("discovery leaves out %d GPUs that NVML finds", run.skipped)
	default:
		why = fmt.Sprintf("discovery finds %d devices", len(run.devices))
	}
	return fmt.Errorf("it would not publish %d of the %d devices that the running agent publishes (%s): %s", len(missing), usable.Len(), strings.Join(missing, ", "), why)
}
