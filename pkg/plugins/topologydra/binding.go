package topologydra

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	schedmetrics "k8s.io/kubernetes/pkg/scheduler/metrics"

	"github.com/topodra/topodra/pkg/invariant"
)

// Devices with binding conditions (DRADeviceBindingConditions) are bound to
// a pod only after their driver reports every binding condition true. A
// true binding failure condition, or no success within bindingTimeout of
// the allocation's timestamp, makes the allocation unusable: Filter marks
// the claim unavailable on every node, PostFilter deallocates it, and the
// next attempt allocates afresh. This is what the stock plugin does. A
// device that is still waiting for its conditions but gone from its pool
// (invariant.DeviceGone: the pool's newest generation is complete without
// it, or the pool has no slices left) cannot become ready either, and is
// treated the same way. While the pool's newest generation is incomplete
// (its driver republishes it slice by slice), a device missing from it is
// not gone yet, and the wait goes on until bindingTimeout, as for the stock
// plugin, which does not look for the devices at all.

var (
	// errBindingFailed: a binding failure condition of an allocated device
	// is true.
	errBindingFailed = errors.New("device binding failed")
	// errBindingTimeout: the binding conditions were not all true within
	// the binding timeout, counted from the allocation's timestamp.
	errBindingTimeout = errors.New("device binding timed out")
	// errDeviceVanished: an allocated device whose binding conditions are
	// not all true is gone from its pool (invariant.DeviceGone).
	errDeviceVanished = errors.New("allocated device no longer exists")
	// errDeviceTainted: an allocated device has a NoSchedule or NoExecute
	// taint that its allocation does not tolerate (taintedAllocation).
	errDeviceTainted = errors.New("allocated device is tainted")
)

// publishedLookup tells whether a device is published, pending or gone
// (invariant.Publication.Presence) by the pools in the scheduler's slice
// cache, and which slices a pool has. The slices are listed on the first
// question only, since most allocations never need it, and only the pools
// asked about are picked out and judged (a pool's answer depends on its
// own slices alone): PreBind asks on every poll while it waits for
// binding conditions. Not safe for concurrent use.
type publishedLookup struct {
	pl     *TopologyDRA
	slices []*resourceapi.ResourceSlice
	err    error
	// pools holds the slices of each pool asked about.
	pools map[poolKey][]*resourceapi.ResourceSlice
	// byPool holds the publication of each pool asked about.
	byPool map[poolKey]*invariant.Publication
}

func (pl *TopologyDRA) newPublishedLookup() *publishedLookup { return &publishedLookup{pl: pl} }

// poolSlices returns the slices of pool k among the scheduler's slices,
// with DeviceTaintRules applied, listed on the first call.
func (p *publishedLookup) poolSlices(k poolKey) ([]*resourceapi.ResourceSlice, error) {
	if p.slices == nil && p.err == nil {
		resourceSlices, err := p.pl.draManager.ResourceSlices().ListWithDeviceTaintRules()
		if err != nil {
			p.err = fmt.Errorf("list resource slices: %w", err)
		} else {
			p.slices = resourceSlices
			p.pools = map[poolKey][]*resourceapi.ResourceSlice{}
			p.byPool = map[poolKey]*invariant.Publication{}
		}
	}
	if p.err != nil {
		return nil, p.err
	}
	own, ok := p.pools[k]
	if !ok {
		for _, s := range p.slices {
			if s.Spec.Driver == k.driver && s.Spec.Pool.Name == k.pool {
				own = append(own, s)
			}
		}
		p.pools[k] = own
	}
	return own, nil
}

func (p *publishedLookup) presence(d invariant.Device) (invariant.Presence, error) {
	k := poolKey{driver: d.Driver, pool: d.Pool}
	own, err := p.poolSlices(k)
	if err != nil {
		return invariant.DeviceGone, err
	}
	publication, ok := p.byPool[k]
	if !ok {
		publication = invariant.Publish(own)
		p.byPool[k] = publication
	}
	return publication.Presence(d), nil
}

// bindingState reports whether an allocated claim's devices are ready to
// bind (all binding conditions true, or none), and errBindingFailed,
// errBindingTimeout or errDeviceVanished (wrapped, naming the claim and
// device) when the allocation can no longer become ready. presence tells
// whether a device is published, pending or gone (asked only for devices
// that are not ready); only a gone device is errDeviceVanished. nil skips
// that check. Unallocated claims are not ready.
func (pl *TopologyDRA) bindingState(claim *resourceapi.ResourceClaim, now time.Time, presence func(invariant.Device) (invariant.Presence, error)) (bool, error) {
	alloc := claim.Status.Allocation
	if alloc == nil {
		return false, nil
	}
	ready := true
	for _, r := range alloc.Devices.Results {
		if len(r.BindingConditions) == 0 && len(r.BindingFailureConditions) == 0 {
			continue
		}
		var conds []metav1.Condition
		for _, d := range claim.Status.Devices {
			if d.Driver == r.Driver && d.Pool == r.Pool && d.Device == r.Device {
				conds = d.Conditions
			}
		}
		for _, c := range r.BindingFailureConditions {
			if cond := apimeta.FindStatusCondition(conds, c); cond != nil && cond.Status == metav1.ConditionTrue {
				return false, fmt.Errorf("%w: claim %s, device %s/%s/%s: %s (%s: %s)", errBindingFailed, claim.Name, r.Driver, r.Pool, r.Device, c, cond.Reason, cond.Message)
			}
		}
		deviceReady := true
		for _, c := range r.BindingConditions {
			if !apimeta.IsStatusConditionTrue(conds, c) {
				deviceReady = false
			}
		}
		if !deviceReady && presence != nil {
			// Where the slices cannot be read the device is not known
			// to be gone: the claim keeps its allocation and waits on
			// (the binding timeout still bounds the wait).
			if p, err := presence(invariant.Device{Driver: r.Driver, Pool: r.Pool, Name: r.Device}); err == nil && p == invariant.DeviceGone {
				return false, fmt.Errorf("%w: claim %s, device %s/%s/%s is not published by the current ResourceSlices of its pool", errDeviceVanished, claim.Name, r.Driver, r.Pool, r.Device)
			}
		}
		ready = ready && deviceReady
	}
	if ready {
		return true, nil
	}
	if alloc.AllocationTimestamp != nil {
		if now.After(alloc.AllocationTimestamp.Add(pl.bindingTimeout)) {
			return false, fmt.Errorf("%w: claim %s, allocated at %s, binding timeout %s", errBindingTimeout, claim.Name, alloc.AllocationTimestamp.UTC().Format(time.RFC3339), pl.bindingTimeout)
		}
	} else if since, ok := pl.untimed.since(claim.UID); ok && now.After(since.Add(pl.bindingTimeout)) {
		return false, fmt.Errorf("%w: claim %s, allocated without a timestamp, first waited for at %s, binding timeout %s", errBindingTimeout, claim.Name, since.UTC().Format(time.RFC3339), pl.bindingTimeout)
	}
	return false, nil
}

// untimedWaits records, per claim, when this scheduler first waited for
// the binding conditions of an allocation without a timestamp (written by
// another scheduler or a controller; the allocation is immutable, so it
// cannot be stamped later). The binding timeout of such an allocation
// counts from then. Entries go when the claim is deallocated or deleted
// (untimedHandler). The zero value is ready to use; safe for concurrent
// use.
type untimedWaits struct{ m sync.Map }

// start records now for uid unless a time is recorded.
func (u *untimedWaits) start(uid types.UID, now time.Time) { u.m.LoadOrStore(uid, now) }

func (u *untimedWaits) since(uid types.UID) (time.Time, bool) {
	t, ok := u.m.Load(uid)
	if !ok {
		return time.Time{}, false
	}
	return t.(time.Time), true
}

func (u *untimedWaits) forget(uid types.UID) { u.m.Delete(uid) }

// bindingFailed reports an allocated claim whose binding failed, timed out
// or waits for a device that is gone (PreFilter records it; Filter marks
// the claim unavailable so that PostFilter deallocates it). published is
// shared by the claims of one cycle.
func (pl *TopologyDRA) bindingFailed(claim *resourceapi.ResourceClaim, published *publishedLookup) error {
	if !pl.features.DeviceBindingAndStatus || !hasBindingConditions([]*resourceapi.ResourceClaim{claim}) {
		return nil
	}
	_, err := pl.bindingState(claim, time.Now(), published.presence)
	return err
}

// hasBindingConditions reports whether any allocated device of the claims
// has binding conditions.
func hasBindingConditions(claims []*resourceapi.ResourceClaim) bool {
	for _, c := range claims {
		if c.Status.Allocation == nil {
			continue
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			if len(r.BindingConditions) > 0 {
				return true
			}
		}
	}
	return false
}

// waitForBindingConditions waits in PreBind until the devices of all the
// pod's claims are ready to bind, reading the claims from the scheduler's
// claim cache (informer). It tells the user on the pod that it waits, and
// records upstream's binding-condition metrics. A failure or timeout, or a
// claim that is deallocated or being deleted meanwhile, fails the attempt
// with an error (the pod is retried with backoff; Unreserve removes the
// allocations this attempt wrote, and Filter and PostFilter release one
// written before). So does the pod's own
// deletion: nothing would use the devices it waits for.
func (pl *TopologyDRA) waitForBindingConditions(ctx context.Context, pod *v1.Pod, nodeName string, s *stateData) *fwk.Status {
	if !pl.features.DeviceBindingAndStatus || !hasBindingConditions(s.claims) {
		return nil
	}
	logger := klog.FromContext(ctx)
	pl.event(pod, v1.EventTypeNormal, "BindingConditionsPending", "Scheduling", "waiting for binding conditions of devices on node %s", nodeName)
	start := time.Now()
	// bindingTimeout bounds the wait also for allocations without a
	// timestamp (written by another scheduler or a controller).
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, pl.bindingTimeout, true, func(context.Context) (bool, error) {
		if pl.pods != nil {
			if current, err := pl.pods.Pods(pod.Namespace).Get(pod.Name); apierrors.IsNotFound(err) || (err == nil && current.UID != pod.UID) {
				return false, fmt.Errorf("pod %s was deleted while waiting for binding conditions", klog.KObj(pod))
			}
		}
		published := pl.newPublishedLookup()
		for i, claim := range s.claims {
			if s.isExtendedInMemory(i) && s.extended.created == nil {
				continue // not needed on this node (a device plugin)
			}
			latest, err := pl.draManager.ResourceClaims().Get(claim.Namespace, claim.Name)
			if err != nil {
				return false, fmt.Errorf("claim %s: %w", claim.Name, err)
			}
			if latest.DeletionTimestamp != nil {
				// A pod that is not bound yet must not start with a claim
				// that is going away (PreFilter and bindClaim refuse such
				// claims too); Unreserve lets the claim go.
				return false, fmt.Errorf("claim %s is being deleted", claim.Name)
			}
			if latest.Status.Allocation == nil {
				return false, fmt.Errorf("claim %s was deallocated while waiting for binding conditions", claim.Name)
			}
			s.claims[i] = latest
			if latest.Status.Allocation.AllocationTimestamp == nil {
				pl.untimed.start(latest.UID, start)
			}
			// A device that got a taint its allocation does not tolerate
			// while the pod waits (a GPU's health taint) must not be bound
			// to the pod, whatever its driver reports: the next attempt
			// deallocates the claim (taintedAllocation).
			if err := pl.taintedAllocation(pod, latest, published); err != nil {
				return false, fmt.Errorf("claim %s: %w", latest.Name, err)
			}
			ready, err := pl.bindingState(latest, time.Now(), published.presence)
			if err != nil || !ready {
				return false, err
			}
		}
		return true, nil
	})
	if wait.Interrupted(err) && ctx.Err() == nil {
		err = fmt.Errorf("%w: not all ready within the binding timeout %s", errBindingTimeout, pl.bindingTimeout)
	}
	status := schedmetrics.BindingConditionsStatusSuccess
	switch {
	case err == nil:
	case errors.Is(err, errBindingFailed), errors.Is(err, errDeviceVanished), errors.Is(err, errDeviceTainted):
		status = schedmetrics.BindingConditionsStatusFailed
	case errors.Is(err, errBindingTimeout):
		status = schedmetrics.BindingConditionsStatusTimeout
	default:
		status = schedmetrics.BindingConditionsStatusError
	}
	pl.recordBindingConditions(s.claims, status, time.Since(start))
	if err != nil {
		var names []string
		for _, c := range s.claims {
			names = append(names, c.Name)
		}
		return inputError(logger, fmt.Errorf("binding conditions of claims %s: %w", strings.Join(names, ", "), err), "pod", klog.KObj(pod), "node", klog.KRef("", nodeName))
	}
	return nil
}

func (pl *TopologyDRA) recordBindingConditions(claims []*resourceapi.ResourceClaim, status string, waited time.Duration) {
	profile := pl.handle.ProfileName()
	for _, c := range claims {
		if c.Status.Allocation == nil {
			continue
		}
		drivers := map[string]bool{}
		for _, r := range c.Status.Allocation.Devices.Results {
			if len(r.BindingConditions) > 0 && !drivers[r.Driver] {
				drivers[r.Driver] = true
				schedmetrics.DRABindingConditionsPreBindDuration.WithLabelValues(profile, r.Driver, status).Observe(waited.Seconds())
				schedmetrics.DRABindingConditionsAllocationsTotal.WithLabelValues(profile, r.Driver, status).Inc()
			}
		}
	}
}
