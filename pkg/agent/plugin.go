package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/checkpoint"
)

// ErrNoState is returned by Prepare and Unprepare when the agent has no
// checkpoint or CDI directory (publish-only mode without StateDir/CDIDir).
var ErrNoState = errors.New("agent has no state or CDI directory: it cannot prepare devices")

// ErrDeviceInUse is the per-claim error when an allocated device is already
// prepared for another claim.
var ErrDeviceInUse = errors.New("device already prepared for another claim")

// ErrGPUMoved is the per-claim error for a claim that was prepared before
// the node rebooted and whose device name now names another GPU (the
// kernel numbered the GPUs differently at boot). Preparing it would give
// the pod a different physical GPU than the one it ran on.
var ErrGPUMoved = errors.New("GPU moved at boot")

// ReasonGPUMoved is the reason of the warning event on a claim that is
// refused with ErrGPUMoved.
const ReasonGPUMoved = "GPUMovedAtBoot"

// ErrReallocated is the per-claim error for a claim that is prepared and
// has been allocated again since, with other devices or at another time:
// the recorded devices belong to the earlier allocation, whose containers
// may still use them.
var ErrReallocated = errors.New("claim was allocated again since it was prepared")

// ReasonReallocated is the reason of the warning event on a claim that is
// refused with ErrReallocated.
const ReasonReallocated = "ClaimReallocatedWhilePrepared"

// ErrDeviceUnhealthy is the per-claim error for a claim that is not
// prepared yet and was allocated a GPU that reported a critical fault
// (its health taint came too late to keep the scheduler off it): a new
// container would start on a GPU known to be broken. Claims prepared
// before the fault are prepared again as before (the kubelet does that
// after it restarts), and claims with admin access are prepared (they
// are how monitoring and diagnostics reach a faulty GPU).
var ErrDeviceUnhealthy = errors.New("device is unhealthy")

// ReasonUnhealthyDeviceAllocated is the reason of the warning event on a
// claim that is refused with ErrDeviceUnhealthy.
const ReasonUnhealthyDeviceAllocated = "UnhealthyDeviceAllocated"

// ErrDevicePluginConflict is the per-claim error for a claim that is not
// prepared yet while the Node advertises GPUs of a device plugin (see
// CheckNode), or could not be read yet: the kubelet hands those GPUs to
// pods that ask for the extended resource as well, so a new container
// could share a GPU with one of them. Claims prepared before (in this
// boot) are prepared again as before, and claims with admin access are
// prepared.
var ErrDevicePluginConflict = errors.New("the node's device plugin hands out the same GPUs")

// ReasonDevicePluginAllocated is the reason of the warning event on a
// claim that is refused with ErrDevicePluginConflict.
const ReasonDevicePluginAllocated = "DevicePluginGPUAllocated"

// ErrConfigNotSupported is the per-claim error for a claim that carries
// opaque device configuration for this driver: the driver defines none, and
// ignoring it would run the pod with a configuration it did not ask for.
var ErrConfigNotSupported = errors.New("opaque device configuration is not supported")

// ErrNVMLUnusable is the per-claim error for a claim that is not prepared
// yet while the agent cannot use NVML (see Agent.NVMLUnusable); the error
// wraps why as well. It is not discovery.ErrNVMLUnusable, which only NVML's
// initialization returns.
var ErrNVMLUnusable = errors.New("cannot use NVML")

// PrepareResourceClaims implements kubeletplugin.DRAPlugin. For each claim
// it writes a CDI spec with the claim's GPUs and records the claim in the
// checkpoint, then returns the CDI device ids. It is idempotent: a claim
// that is already prepared gets the recorded result, and its CDI spec is
// generated again (see planClaim). A device that is prepared, or being
// prepared, for a different claim is refused with ErrDeviceInUse (unless
// both use admin access), the DRA driver being the last line of defense
// against double allocation.
// A prepared claim that has been allocated again since (other devices,
// or another allocation time) is refused with ErrReallocated (and a
// warning event on the claim) until it is unprepared.
// A claim that is not prepared yet and was allocated a GPU that reported
// a critical fault is refused with ErrDeviceUnhealthy (and a warning event
// on the claim), unless its result has admin access.
// Likewise, while the Node advertises GPUs of a device plugin, or could
// not be read yet, a claim that is not prepared yet is refused with
// ErrDevicePluginConflict (and a warning event on the claim), unless its
// result has admin access; so is one allocated a GPU that another DRA
// driver publishes on the node too, with ErrOtherDriverConflict (see
// Options.OtherDriverCheck).
// A claim that was prepared before the node rebooted is refused with
// ErrGPUMoved (and a warning event on the claim) if one of its device
// names now names a GPU with another UUID. While the agent cannot use
// NVML (NVMLUnusable), a claim that is not prepared yet is refused with
// ErrNVMLUnusable, wrapping why.
//
// CDI spec generation calls NVML, which can hang on a GPU in a bad state.
// It runs holding only the locks of the call's own claims (see
// claimLocks), so that the Prepare and Unprepare of other claims go on;
// a call for a claim whose earlier Prepare still generates waits for it
// until ctx ends, then fails with ErrClaimBusy.
//
// Per-claim problems are per-claim errors; an unreadable or unwritable
// checkpoint fails the whole call so that the kubelet retries.
//
// Every claim that it does not prepare counts in MetricPrepareErrors.
//
// A call that comes before the agent has started (see Start) waits for
// that until ctx ends.
func (a *Agent) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	result, err := a.prepareClaims(ctx, claims)
	a.countPrepareErrors(claims, result, err)
	return result, err
}

// prepareClaims is PrepareResourceClaims without the counting.
func (a *Agent) prepareClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	done, err := a.beginCall(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	if a.store == nil {
		return nil, ErrNoState
	}
	logger := klog.FromContext(ctx)
	unlock, err := a.claimLocks.lock(ctx, uidsOf(claims, func(c *resourceapi.ResourceClaim) types.UID { return c.UID }))
	if err != nil {
		return nil, err
	}
	defer unlock()

	// Check the claims against the checkpoint and reserve the devices of
	// new ones, so that no other Prepare takes them while the specs are
	// generated.
	type plan struct {
		claim    *resourceapi.ResourceClaim
		prepared checkpoint.PreparedClaim
		isNew    bool
		// adopted: the claim was recovered from its CDI spec and
		// prepared has the complete record (see adoptRecovered).
		adopted bool
	}
	var plans []plan
	result := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	a.prepareMutex.Lock()
	cp, err := a.store.Load()
	if err != nil {
		a.prepareMutex.Unlock()
		return nil, a.stateUnwritable(ctx, "Prepare", fmt.Errorf("%w: %w", ErrStateUnwritable, err))
	}
	for _, claim := range claims {
		before, known := cp.Claims[claim.UID]
		prepared, isNew, err := a.planClaim(ctx, cp, claim)
		if err != nil {
			result[claim.UID] = kubeletplugin.PrepareResult{Err: err}
			continue
		}
		if isNew {
			a.reserveLocked(claim.UID, prepared)
		}
		plans = append(plans, plan{claim: claim, prepared: prepared, isNew: isNew, adopted: known && isRecovered(before)})
	}
	a.prepareMutex.Unlock()
	defer func() {
		a.prepareMutex.Lock()
		defer a.prepareMutex.Unlock()
		for _, p := range plans {
			if p.isNew {
				a.releaseLocked(p.claim.UID)
			}
		}
	}()

	// Generate the CDI specs, without the agent-wide lock.
	for i := range plans {
		p := &plans[i]
		if err := a.writeSpec(ctx, p.claim, &p.prepared, p.isNew); err != nil {
			result[p.claim.UID] = kubeletplugin.PrepareResult{Err: err}
		}
	}

	// Record what was prepared.
	a.prepareMutex.Lock()
	defer a.prepareMutex.Unlock()
	cp, err = a.store.Load()
	if err != nil {
		return nil, a.stateUnwritable(ctx, "Prepare", fmt.Errorf("%w: %w", ErrStateUnwritable, err))
	}
	changed := false
	for _, p := range plans {
		if result[p.claim.UID].Err != nil {
			continue
		}
		if p.isNew || p.adopted {
			cp.Claims[p.claim.UID] = p.prepared
			changed = true
		}
		if _, ok := cp.PreviousBoot[p.claim.UID]; ok {
			delete(cp.PreviousBoot, p.claim.UID)
			changed = true
		}
		result[p.claim.UID] = kubeletplugin.PrepareResult{Devices: prepareResultDevices(p.prepared)}
		logger.V(2).Info("Claim prepared", "claim", klog.KObj(p.claim), "devices", len(p.prepared.Devices), "new", p.isNew)
	}
	if changed {
		if err := a.saveClaims(cp); err != nil {
			return nil, a.stateUnwritable(ctx, "Prepare", fmt.Errorf("%w: %w", ErrStateUnwritable, err))
		}
	}
	for _, claim := range claims {
		if err := result[claim.UID].Err; err != nil {
			a.prepareFailed(ctx, claim, err)
		}
	}
	return result, nil
}

// prepareFailed logs a claim that could not be prepared and reports it
// where the user looks: the errors that the claim's own allocation causes
// on the claim, a node set-up problem on the Node.
func (a *Agent) prepareFailed(ctx context.Context, claim *resourceapi.ResourceClaim, err error) {
	klog.FromContext(ctx).Error(err, "Cannot prepare claim", "claim", klog.KObj(claim))
	switch {
	case errors.Is(err, ErrGPUMoved):
		a.event(claim, nil, v1.EventTypeWarning, ReasonGPUMoved, "Prepare", "%v", err)
	case errors.Is(err, ErrReallocated):
		a.event(claim, nil, v1.EventTypeWarning, ReasonReallocated, "Prepare", "%v", err)
	case errors.Is(err, ErrDeviceUnhealthy):
		a.event(claim, nil, v1.EventTypeWarning, ReasonUnhealthyDeviceAllocated, "Prepare", "%v", err)
	case errors.Is(err, ErrDevicePluginConflict):
		a.event(claim, nil, v1.EventTypeWarning, ReasonDevicePluginAllocated, "Prepare", "%v", err)
	case errors.Is(err, ErrOtherDriverConflict):
		a.event(claim, nil, v1.EventTypeWarning, ReasonOtherDriverAllocated, "Prepare", "%v", err)
	case errors.Is(err, ErrStateUnwritable):
		// The node's file system, not the claim: the admin looks at
		// the Node.
		a.stateUnwritableEvent("Prepare", fmt.Errorf("claim %s: %w", klog.KObj(claim), err))
	case errors.Is(err, cdi.ErrMissingDeviceNode):
		// The node's set-up, not the claim's: the admin looks at the
		// Node; the pod's events carry the error too.
		a.claimNodeEvent(claim.Namespace, claim.Name, claim.UID, v1.EventTypeWarning, ReasonDeviceNodeMissing, "Prepare", "claim %s/%s: %v", claim.Namespace, claim.Name, err)
	}
}

// reserveLocked marks the GPUs of a claim that is being prepared, so that
// no other claim is prepared with them meanwhile. The caller holds
// prepareMutex.
func (a *Agent) reserveLocked(uid types.UID, prepared checkpoint.PreparedClaim) {
	if a.preparing == nil {
		a.preparing = map[types.UID]checkpoint.PreparedClaim{}
	}
	// A copy of the devices: the caller goes on to fill in its own
	// (their CDI device ids) without prepareMutex, while other Prepares
	// read this one under it.
	prepared.Devices = slices.Clone(prepared.Devices)
	a.preparing[uid] = prepared
}

// releaseLocked drops what reserveLocked marked. The caller holds
// prepareMutex.
func (a *Agent) releaseLocked(uid types.UID) {
	delete(a.preparing, uid)
}

// updateCheckpoint loads the checkpoint, lets update change it and saves
// it, all under checkpointMutex, so that concurrent updates of different
// parts (claims, faults) do not overwrite each other.
func (a *Agent) updateCheckpoint(update func(cp *checkpoint.Checkpoint)) error {
	a.checkpointMutex.Lock()
	defer a.checkpointMutex.Unlock()
	cp, err := a.store.Load()
	if err != nil {
		return err
	}
	update(cp)
	if err := a.store.Save(cp); err != nil {
		return err
	}
	a.recordClaimCounts(cp)
	return nil
}

// saveClaims writes the prepared claims and what claims held before the
// last reboot, as cp has them, into the checkpoint, and forgets when
// claims that are no longer prepared were found gone; the rest of the
// file (the GPU faults, which health handling adds without prepareMutex)
// stays as it is now. The caller holds prepareMutex, so that cp was loaded
// under it and these fields have not changed in the file since.
func (a *Agent) saveClaims(cp *checkpoint.Checkpoint) error {
	return a.updateCheckpoint(func(current *checkpoint.Checkpoint) {
		current.Claims, current.PreviousBoot = cp.Claims, cp.PreviousBoot
		for uid := range current.Gone {
			if _, ok := current.Claims[uid]; !ok {
				delete(current.Gone, uid)
			}
		}
	})
}

func prepareResultDevices(prepared checkpoint.PreparedClaim) []kubeletplugin.Device {
	devices := make([]kubeletplugin.Device, 0, len(prepared.Devices))
	for _, d := range prepared.Devices {
		devices = append(devices, kubeletplugin.Device{
			Requests:     slices.Clone(d.Requests),
			PoolName:     d.Pool,
			DeviceName:   d.Device,
			CDIDeviceIDs: slices.Clone(d.CDIDeviceIDs),
		})
	}
	return devices
}

// planClaim checks one claim against the loaded checkpoint and what other
// calls are preparing, and returns what it is prepared with (without the
// CDI device ids of a new claim, which writeSpec adds). isNew reports
// whether the claim is not prepared yet. The caller holds prepareMutex.
//
// A claim that is already prepared gets the same answer as before, as
// long as its allocation is the one that was prepared (the same devices
// for the same requests and, where both are known, the same allocation
// time; otherwise ErrReallocated). A claim recovered from its CDI spec
// gets its record completed (see adoptRecovered).
func (a *Agent) planClaim(ctx context.Context, cp *checkpoint.Checkpoint, claim *resourceapi.ResourceClaim) (checkpoint.PreparedClaim, bool, error) {
	if prepared, ok := cp.Claims[claim.UID]; ok {
		if isRecovered(prepared) {
			adopted, err := a.adoptRecovered(claim, prepared)
			return adopted, false, err
		}
		if err := a.checkReallocated(claim, prepared); err != nil {
			return checkpoint.PreparedClaim{}, false, err
		}
		return prepared, false, nil
	}
	if claim.Status.Allocation == nil {
		return checkpoint.PreparedClaim{}, false, fmt.Errorf("claim %s is not allocated", klog.KObj(claim))
	}
	if err := a.NVMLUnusable(); err != nil {
		return checkpoint.PreparedClaim{}, false, fmt.Errorf("claim %s: the agent on node %s %w, so it cannot prepare GPUs (it retries; after a driver upgrade, reboot the node): %w", klog.KObj(claim), a.opts.NodeName, ErrNVMLUnusable, err)
	}

	if err := a.checkConfig(claim); err != nil {
		return checkpoint.PreparedClaim{}, false, err
	}
	inv := a.Inventory()
	devicePlugin := a.devicePluginFound()
	prepared := checkpoint.PreparedClaim{Namespace: claim.Namespace, Name: claim.Name}
	if ts := claim.Status.Allocation.AllocationTimestamp; ts != nil {
		prepared.AllocatedAt = ptr.To(ts.UTC().Truncate(time.Second))
	}
	before, rebooted := cp.PreviousBoot[claim.UID]
	if rebooted && !sameAllocation(before.AllocatedAt, prepared.AllocatedAt) {
		rebooted = false
	}
	byDevice := map[string]int{}
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != a.opts.DriverName {
			continue
		}
		if r.Pool != a.opts.PoolName {
			return checkpoint.PreparedClaim{}, false, fmt.Errorf("claim %s: device %s is from pool %q, this node publishes pool %q", klog.KObj(claim), r.Device, r.Pool, a.opts.PoolName)
		}
		gpu := inv.GPU(r.Device)
		if gpu == nil {
			return checkpoint.PreparedClaim{}, false, fmt.Errorf("claim %s: device %s does not exist on node %s", klog.KObj(claim), r.Device, a.opts.NodeName)
		}
		if rebooted {
			if uuid, ok := deviceUUID(before, r.Device); ok && uuid != gpu.UUID {
				return checkpoint.PreparedClaim{}, false, fmt.Errorf("claim %s: %w: device %s was GPU %s when the claim was prepared before node %s rebooted and is GPU %s now; the pod must be recreated so that the claim is allocated again",
					klog.KObj(claim), ErrGPUMoved, r.Device, uuid, a.opts.NodeName, gpu.UUID)
			}
		}
		admin := grantsAdminAccess(claim, r)
		if fault, ok := a.fault(gpu.UUID); ok && !admin {
			return checkpoint.PreparedClaim{}, false, fmt.Errorf("claim %s: %w: %s (GPU %s) on node %s reported %s at %s (%s) and keeps its health taint until the node reboots or the Node annotation %s clears the fault after a GPU reset; delete the pod so that its claim is allocated other devices (a claim created by hand must be created again)",
				klog.KObj(claim), ErrDeviceUnhealthy, r.Device, gpu.UUID, a.opts.NodeName, fault.Reason, fault.Time.UTC().Format(time.RFC3339), fault.Message, ClearFaultsAnnotation)
		}
		if gpu.RowRemapFailed && !admin {
			return checkpoint.PreparedClaim{}, false, fmt.Errorf("claim %s: %w: %s (GPU %s) on node %s reports a row remapping failure (%s): %s; delete the pod so that its claim is allocated other devices (a claim created by hand must be created again)",
				klog.KObj(claim), ErrDeviceUnhealthy, r.Device, gpu.UUID, a.opts.NodeName, HealthTaintKey+"="+rowRemapFault.Reason, rowRemapFault.Message)
		}
		if devicePlugin == devicePluginUnknown && !admin {
			a.checkNodeSoon()
			return checkpoint.PreparedClaim{}, false, fmt.Errorf("claim %s: %w: the agent could not read Node %s yet, so it does not know whether a device plugin there hands out %s (GPU %s) too; it reads the Node again now, and the kubelet retries",
				klog.KObj(claim), ErrDevicePluginConflict, a.opts.NodeName, r.Device, gpu.UUID)
		}
		if devicePlugin != "" && !admin {
			return checkpoint.PreparedClaim{}, false, fmt.Errorf("claim %s: %w: node %s advertises %s from a device plugin, which the kubelet hands out to pods that ask for it, %s (GPU %s) included; a cluster admin must disable the device plugin on this node (GPU Operator: devicePlugin.enabled=false); then delete the pod so that its claim is allocated again (a claim created by hand must be created again)",
				klog.KObj(claim), ErrDevicePluginConflict, a.opts.NodeName, devicePlugin, r.Device, gpu.UUID)
		}
		if others := a.otherDriverDevices(gpu); len(others) > 0 && !admin {
			names := make([]string, 0, len(others))
			for _, d := range others {
				names = append(names, d.String())
			}
			return checkpoint.PreparedClaim{}, false, fmt.Errorf("claim %s: %w: %s (GPU %s) on node %s is also %s, which the default scheduler hands out to other pods; a cluster admin must remove that driver from this node (docs/install.md: \"Beside NVIDIA's DRA driver\"); then delete the pod so that its claim is allocated again (a claim created by hand must be created again)",
				klog.KObj(claim), ErrOtherDriverConflict, r.Device, gpu.UUID, a.opts.NodeName, strings.Join(names, " and "))
		}
		if owner, uid, ok := preparedElsewhere(cp, a.preparing, claim.UID, gpu.UUID, admin); ok {
			// The message reaches the pod's events: a claim of another
			// namespace is named by its UID only (the log names it).
			other := fmt.Sprintf("claim %s (%s)", owner.Name, uid)
			free := fmt.Sprintf("where that claim is gone or no longer allocated, the agent frees the device after --stale-claim-grace (a %s event on the Node), otherwise both claims were allocated the device: run topodra-check", ReasonPreparedClaimGone)
			switch {
			case isRecovered(owner):
				other = recoveredOwner(uid)
				free = "the device is free once the kubelet unprepares that claim, after the pods that use it stop"
			case owner.Namespace != claim.Namespace:
				other = fmt.Sprintf("a claim of another namespace (UID %s)", uid)
				klog.FromContext(ctx).Info("Device prepared for a claim of another namespace", "claim", klog.KObj(claim), "device", r.Device, "preparedFor", klog.KRef(owner.Namespace, owner.Name), "uid", uid)
			}
			return checkpoint.PreparedClaim{}, false, fmt.Errorf("claim %s: %w: %s is prepared for %s on node %s; %s",
				klog.KObj(claim), ErrDeviceInUse, r.Device, other, a.opts.NodeName, free)
		}
		if i, ok := byDevice[r.Device]; ok {
			// The allocator lets a request with admin access share a
			// device with any other request, of the same claim too: the
			// claim holds the device exclusively where any of its results
			// does.
			prepared.Devices[i].Requests = append(prepared.Devices[i].Requests, r.Request)
			prepared.Devices[i].AdminAccess = prepared.Devices[i].AdminAccess && admin
			continue
		}
		byDevice[r.Device] = len(prepared.Devices)
		prepared.Devices = append(prepared.Devices, checkpoint.PreparedDevice{
			Requests:    []string{r.Request},
			Pool:        r.Pool,
			Device:      r.Device,
			UUID:        gpu.UUID,
			Minor:       gpu.Minor,
			AdminAccess: admin,
		})
	}
	return prepared, true, nil
}

// writeSpec writes the CDI spec of a planned claim and, for a new one,
// adds the CDI device ids to prepared. A prepared claim's spec is
// generated again, so that it names what the node has now: device nodes
// created since the last Prepare (nvidia-uvm once its module is loaded)
// get in, and a spec that was lost (/var/run is a tmpfs) is restored. The
// kubelet prepares a claim again after it restarted. A spec that comes
// out the same is left alone. Where generating fails, a spec that exists
// stays and the claim stays prepared, as it was; a missing one fails the
// claim.
func (a *Agent) writeSpec(ctx context.Context, claim *resourceapi.ResourceClaim, prepared *checkpoint.PreparedClaim, isNew bool) error {
	ids, err := a.cdi.WriteClaimSpec(claim.UID, a.cdiDevices(*prepared))
	if errors.Is(err, cdi.ErrWriteSpec) {
		err = fmt.Errorf("%w: %w", ErrStateUnwritable, err)
	}
	if !isNew {
		if err != nil {
			if _, statErr := os.Stat(a.cdi.SpecPath(claim.UID)); statErr != nil {
				return err
			}
			klog.FromContext(ctx).Error(err, "Cannot generate the CDI spec of a prepared claim again, keeping the one written before", "claim", klog.KObj(claim))
		}
		return nil
	}
	if err != nil {
		return err
	}
	for i := range prepared.Devices {
		prepared.Devices[i].CDIDeviceIDs = []string{ids[prepared.Devices[i].Device]}
	}
	return nil
}

// checkReallocated returns ErrReallocated (wrapped) if the claim's
// allocation is not the one that was prepared: other devices of this
// driver for its requests, or another allocation time where both are
// known. A claim without allocation is not checked.
func (a *Agent) checkReallocated(claim *resourceapi.ResourceClaim, prepared checkpoint.PreparedClaim) error {
	if claim.Status.Allocation == nil {
		return nil
	}
	var now []string
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver == a.opts.DriverName {
			now = append(now, r.Request+"="+r.Pool+"/"+r.Device)
		}
	}
	var before []string
	for _, d := range prepared.Devices {
		for _, req := range d.Requests {
			before = append(before, req+"="+d.Pool+"/"+d.Device)
		}
	}
	slices.Sort(now)
	slices.Sort(before)
	var allocatedAt *time.Time
	if ts := claim.Status.Allocation.AllocationTimestamp; ts != nil {
		allocatedAt = ptr.To(ts.UTC().Truncate(time.Second))
	}
	if slices.Equal(now, before) && sameAllocation(prepared.AllocatedAt, allocatedAt) {
		return nil
	}
	list := func(devices []string) string {
		if len(devices) == 0 {
			return "no device of " + a.opts.DriverName
		}
		return strings.Join(devices, ", ")
	}
	at := func(t *time.Time) string {
		if t == nil {
			return ""
		}
		return " allocated at " + t.Format(time.RFC3339)
	}
	return fmt.Errorf("claim %s: %w: it is prepared on node %s with %s%s and is now allocated %s%s; the agent keeps the earlier devices until the kubelet unprepares the claim, then prepares the new allocation; the kubelet unprepares a claim only once no pod on the node uses it, so a pod that waits on this error must be deleted (and created again) after the pod that used the earlier allocation is gone",
		klog.KObj(claim), ErrReallocated, a.opts.NodeName, list(before), at(prepared.AllocatedAt), list(now), at(allocatedAt))
}

// sameAllocation says whether two allocation timestamps may belong to the
// same allocation: unknown ones (not every API server records them) may.
func sameAllocation(a, b *time.Time) bool {
	return a == nil || b == nil || a.Equal(*b)
}

// deviceUUID is the UUID of the GPU that a prepared claim held under the
// device name.
func deviceUUID(c checkpoint.PreparedClaim, device string) (string, bool) {
	for _, d := range c.Devices {
		if d.Device == device {
			return d.UUID, true
		}
	}
	return "", false
}

// checkConfig refuses opaque configuration for this driver that applies to
// any of the claim's requests that this driver serves.
func (a *Agent) checkConfig(claim *resourceapi.ResourceClaim) error {
	ours := map[string]bool{}
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver == a.opts.DriverName {
			ours[r.Request] = true
			// A config for "req" applies to the subrequests "req/sub" too.
			if parent, _, ok := strings.Cut(r.Request, "/"); ok {
				ours[parent] = true
			}
		}
	}
	for _, c := range claim.Status.Allocation.Devices.Config {
		if c.Opaque == nil || c.Opaque.Driver != a.opts.DriverName {
			continue
		}
		applies := len(c.Requests) == 0
		for _, r := range c.Requests {
			applies = applies || ours[r]
		}
		if !applies {
			continue
		}
		where := "the claim"
		if c.Source == resourceapi.AllocationConfigSourceClass {
			where = "its DeviceClass"
		}
		return fmt.Errorf("claim %s: %w: %s defines no configuration parameters; remove the opaque config for driver %s from %s", klog.KObj(claim), ErrConfigNotSupported, a.opts.DriverName, a.opts.DriverName, where)
	}
	return nil
}

// preparedElsewhere finds another claim that holds the GPU with this UUID.
// Comparing UUIDs, not names, keeps the check right even if a GPU's name
// changed between the two prepares. A claim with admin access (monitoring)
// shares the GPU with any other claim, as the scheduler allocates it: only
// two claims without admin access exclude each other.
func preparedElsewhere(cp *checkpoint.Checkpoint, preparing map[types.UID]checkpoint.PreparedClaim, self types.UID, uuid string, admin bool) (checkpoint.PreparedClaim, types.UID, bool) {
	if admin {
		return checkpoint.PreparedClaim{}, "", false
	}
	for _, claims := range []map[types.UID]checkpoint.PreparedClaim{cp.Claims, preparing} {
		for uid, other := range claims {
			if uid == self {
				continue
			}
			for _, d := range other.Devices {
				if d.UUID == uuid && !d.AdminAccess {
					return other, uid, true
				}
			}
		}
	}
	return checkpoint.PreparedClaim{}, "", false
}

// grantsAdminAccess reports whether result r of claim gives admin access
// to its device: the result says so and so does the request it is for (a
// result of a firstAvailable subrequest never does). The API server does
// not check a result against its request, so a result marked by hand
// counts as an exclusive use of the device, not as one beside others.
func grantsAdminAccess(claim *resourceapi.ResourceClaim, r resourceapi.DeviceRequestAllocationResult) bool {
	if !ptr.Deref(r.AdminAccess, false) {
		return false
	}
	for _, req := range claim.Spec.Devices.Requests {
		if req.Name == r.Request {
			return req.Exactly != nil && ptr.Deref(req.Exactly.AdminAccess, false)
		}
	}
	return false
}

// cdiDevices lists the GPUs of a prepared claim for its CDI spec. The
// minor number comes from the current inventory (found by UUID) where the
// GPU is still there: the recorded one is only a fallback.
func (a *Agent) cdiDevices(prepared checkpoint.PreparedClaim) []cdi.Device {
	inv := a.Inventory()
	devices := make([]cdi.Device, 0, len(prepared.Devices))
	for _, d := range prepared.Devices {
		minor := d.Minor
		for _, g := range inv.GPUs {
			if g.UUID == d.UUID {
				minor = g.Minor
			}
		}
		devices = append(devices, cdi.Device{Name: d.Device, UUID: d.UUID, Minor: minor})
	}
	return devices
}

// UnprepareResourceClaims implements kubeletplugin.DRAPlugin: it removes
// each claim's CDI spec and checkpoint entries (including what the claim
// held before the last reboot). Unknown claims are fine (the
// call is idempotent); their CDI spec is removed anyway in case a crash
// happened between writing it and recording the claim. Like Prepare it
// waits for the agent to start.
func (a *Agent) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	done, err := a.beginCall(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	if a.store == nil {
		return nil, ErrNoState
	}
	unlock, err := a.claimLocks.lock(ctx, uidsOf(claims, func(c kubeletplugin.NamespacedObject) types.UID { return c.UID }))
	if err != nil {
		return nil, err
	}
	defer unlock()
	a.prepareMutex.Lock()
	defer a.prepareMutex.Unlock()
	logger := klog.FromContext(ctx)

	cp, err := a.store.Load()
	if err != nil {
		return nil, a.stateUnwritable(ctx, "Unprepare", fmt.Errorf("%w: %w", ErrStateUnwritable, err))
	}
	result := make(map[types.UID]error, len(claims))
	changed := false
	for _, claim := range claims {
		if err := a.cdi.DeleteClaimSpec(claim.UID); err != nil {
			result[claim.UID] = a.stateUnwritable(ctx, "Unprepare", fmt.Errorf("%w: claim %s: %w", ErrStateUnwritable, claim.NamespacedName, err))
			continue
		}
		if _, ok := cp.Claims[claim.UID]; ok {
			delete(cp.Claims, claim.UID)
			changed = true
			logger.V(2).Info("Claim unprepared", "claim", claim.NamespacedName)
		}
		if _, ok := cp.PreviousBoot[claim.UID]; ok {
			delete(cp.PreviousBoot, claim.UID)
			changed = true
		}
		result[claim.UID] = nil
	}
	if changed {
		if err := a.saveClaims(cp); err != nil {
			return nil, a.stateUnwritable(ctx, "Unprepare", fmt.Errorf("%w: %w", ErrStateUnwritable, err))
		}
	}
	return result, nil
}
