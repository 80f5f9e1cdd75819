// Package invariant checks the allocation invariants that every DRA
// scheduler in a cluster must keep together: no device is allocated to two
// claims (unless it allows multiple allocations and each of them is a
// share with a share ID), the devices allocated
// from a pool consume no more of its shared counters than there are
// (partitionable devices), the shares of a device that allows multiple
// allocations consume no more of its capacity than it has, no allocation
// names a device that no longer exists, no pod is bound while a claim
// it uses is unallocated or reserved neither for it nor for its PodGroup,
// no claim stays reserved only for pods that will not run, and no claim is
// allocated devices that its spec does not allow, and no device is
// allocated although it had a NoSchedule or NoExecute taint that the
// allocation does not tolerate. Allocations with admin access that their
// request asks for count for none of the device kinds, as for the
// upstream allocator; they are judged against their claim's spec like any
// other, and an allocation with admin access that its request does not
// ask for counts as an exclusive use.
//
// [Find] judges a set of objects; [Check] lists them from a cluster. Both
// are safe for concurrent use.
package invariant

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/utils/ptr"
)

// Kind names one kind of violation.
type Kind string

const (
	// DoubleAllocation: a device is allocated more than once (to two
	// claims, or twice to one) although it does not allow multiple
	// allocations, or although one of its allocations has no share ID.
	// An allocation without a share ID holds the whole device, even on a
	// device that allows multiple allocations, as for the upstream
	// allocator. Allocations with admin access do not count where their
	// request asks for it (see AllocationMismatch for those whose request
	// does not).
	DoubleAllocation Kind = "DoubleAllocation"
	// CounterExceeded: the devices allocated from a pool (each once,
	// however many claims share it) consume more of a counter of one of
	// the pool's shared counter sets than the set holds: two partitions
	// of one physical device are allocated that do not fit in it together.
	CounterExceeded Kind = "CounterExceeded"
	// IncompatiblePartitions: devices allocated from one shared counter
	// set of a pool declare compatibility groups that do not go
	// together (DRADeviceCompatibilityGroups): as for the upstream
	// allocator, such devices may be allocated together only where every
	// one declares none, or all declare groups and some group is common
	// to them all. Partitions of two layouts of one physical device are
	// allocated.
	IncompatiblePartitions Kind = "IncompatiblePartitions"
	// CapacityExceeded: the allocations of a device that allows multiple
	// allocations consume more of one of its capacities than it has.
	CapacityExceeded Kind = "CapacityExceeded"
	// VanishedDevice: an allocation names a device that no ResourceSlice
	// of the pool's current generation publishes, even while that
	// generation is incomplete (the scheduler waits then; see
	// [Publication.Presence]), in a pool that has slices.
	VanishedDevice Kind = "VanishedDevice"
	// UnpublishedPool: allocations name devices of a pool that no
	// ResourceSlice publishes at all. The kubelet removes a node's slices
	// when it starts and when a driver has been unregistered for 30 s (a
	// driver restart or upgrade), and a deleted Node takes its slices
	// with it: the driver publishes the pool again, or the pods on a
	// deleted node are deleted and their claims deallocated. So
	// [CheckWith] reports it only once its reads have found it for
	// CheckOptions.UnpublishedAfter, and notes it as pending until then;
	// [Find], judging a cluster at rest, reports it.
	UnpublishedPool Kind = "UnpublishedPool"
	// PodClaimUnallocated: a pod is bound to a node while one of its
	// claims is missing or unallocated.
	PodClaimUnallocated Kind = "PodClaimUnallocated"
	// PodClaimNotReserved: a pod is bound to a node while one of its
	// allocated claims is reserved neither for it nor for its PodGroup
	// (a reservedFor entry of podgroups.scheduling.k8s.io named as
	// pod.spec.schedulingGroup.podGroupName), as upstream's
	// resourceclaim.IsReservedForPod judges it with PodGroup
	// reservations accepted.
	PodClaimNotReserved Kind = "PodClaimNotReserved"
	// PodClaimOnOtherNode: a pod is bound to a node that the node
	// selector of one of its allocated claims (status.allocation.
	// nodeSelector) does not select, or that an allocated device's own
	// node selection (its ResourceSlice's nodeName, nodeSelector or
	// allNodes, or the device's where the slice selects per device) does
	// not admit, so the claim's devices cannot be reached from where the
	// pod runs. Pods bound to a node that no longer exists (or all pods,
	// where nodes may not be listed) are not judged.
	PodClaimOnOtherNode Kind = "PodClaimOnOtherNode"
	// StaleReservation: a claim is allocated and reserved, but only for
	// pods that are gone (no pod of the claim's namespace has the UID of
	// the reservation) or done (succeeded or failed, or deleted before
	// it was bound), so its devices are held for no one. The
	// resourceclaim controller of kube-controller-manager removes such
	// reservations and, when none is left, deallocates the claim; it does
	// so at a limited rate (its client's QPS), so after many pods finish
	// together the state lasts minutes, and longer only while the
	// controller is down or failing. [CheckWith] reports it only once the
	// pods have been done for CheckOptions.StaleAfter. A claim reserved
	// for anything other than pods (a PodGroup) is not judged.
	StaleReservation Kind = "StaleReservation"
	// UnreservedAllocation: a claim is allocated, reserved for no one, and
	// used by no pod that may still run (none names it in its
	// spec.resourceClaims, its status, or as its extended resource claim,
	// apart from pods that succeeded or failed or were deleted before they
	// were bound), so its devices are held for no one, and nothing in the
	// cluster gives them back: the resourceclaim controller deallocates a
	// claim only where it removes the last reservation itself, and deletes
	// only the claims it made from a template, when their pod goes. A
	// binding cycle that failed after it wrote the allocation leaves this
	// once its pod is deleted (the stock scheduler plugin keeps such an
	// allocation for the pod's next attempt), and so does an allocation
	// written by hand. Only claims with the allocation's finalizer
	// (resource.kubernetes.io/delete-protection), which schedulers add
	// with the allocation, are judged. Only [CheckWith] looks for it (a claim allocated
	// ahead of its pods is a state of its own to [Find]), and reports it
	// only once the reads have found it for CheckOptions.StaleAfter. A
	// claim being deleted is not judged.
	UnreservedAllocation Kind = "UnreservedAllocation"
	// AllocationMismatch: a claim is allocated devices that its spec does
	// not allow: a result for a request the spec does not have, more or
	// fewer devices than a request's exact count (or than the count of
	// the one subrequest of a firstAvailable request that was chosen, or
	// devices of two of its subrequests), a device that does not match a
	// selector of its request or of the request's DeviceClass, or
	// devices of a matchAttribute constraint that lack the attribute or
	// differ in its type or value, or of a distinctAttribute constraint
	// that lack it or share a type and value, or a result with admin
	// access whose request does not ask for it (which counts as an
	// exclusive use of its device for the device kinds). Judged on the
	// devices as the newest generations of their pools publish them, for
	// claims whose devices are all published; see allocationMismatches
	// for what is not judged. A driver may change a device's attributes
	// or capacity after it was allocated: the message says where a
	// mismatch rests on a device whose ResourceSlice changed since.
	AllocationMismatch Kind = "AllocationMismatch"
	// UntoleratedDeviceTaint: a claim is allocated a device that had,
	// more than AllocationLag before the allocation's
	// allocationTimestamp, a NoSchedule or NoExecute taint (of its
	// ResourceSlice, as the newest generation of its pool publishes it,
	// or of a DeviceTaintRule that selects it) that the tolerations of
	// the allocation result do not tolerate. The upstream allocator never
	// allocates such a device, and topodra keeps other schedulers off its
	// devices with such a taint: the device may be in use twice.
	// Allocations with admin access are judged too, as upstream. Not
	// judged where the allocation or the taint records no time (see
	// [Report.NotJudged]); a taint added after the allocation is legal.
	UntoleratedDeviceTaint Kind = "UntoleratedDeviceTaint"
)

// Device identifies a device the way an allocation result does.
type Device struct {
	Driver, Pool, Name string
}

func (d Device) String() string { return d.Driver + "/" + d.Pool + "/" + d.Name }

// Violation is one broken invariant.
type Violation struct {
	Kind Kind `json:"kind"`
	// Device is set for DoubleAllocation, CapacityExceeded,
	// VanishedDevice and UntoleratedDeviceTaint.
	Device *Device `json:"device,omitempty"`
	// Counter is set for CounterExceeded, as
	// driver/pool/counterSet/counter, and for IncompatiblePartitions, as
	// driver/pool/counterSet.
	Counter string `json:"counter,omitempty"`
	// Pool is set for UnpublishedPool, as driver/pool.
	Pool string `json:"pool,omitempty"`
	// Claims are the claims involved, as namespace/name, sorted; empty,
	// never nil (a JSON array), where none exists.
	Claims []string `json:"claims"`
	// Pod is set for the pod kinds, as namespace/name.
	Pod string `json:"pod,omitempty"`
	// Message says what is wrong in words.
	Message string `json:"message"`
}

func (v Violation) String() string { return string(v.Kind) + ": " + v.Message }

// State is what the invariants are judged on. Nil entries are not allowed.
type State struct {
	Slices []*resourceapi.ResourceSlice
	Claims []*resourceapi.ResourceClaim
	Pods   []*v1.Pod
	// Nodes are needed for PodClaimOnOtherNode only: a pod whose node is
	// not among them is not judged for it.
	Nodes []*v1.Node
	// NodesUnread, when set, is why Nodes could not be read.
	NodesUnread error
	// DeviceClasses are needed for AllocationMismatch only, for the
	// selectors of the classes.
	DeviceClasses []*resourceapi.DeviceClass
	// DeviceClassesUnread, when set, is why DeviceClasses could not be
	// read: the selectors of classes are not judged then.
	DeviceClassesUnread error
	// DeviceTaintRules are needed for UntoleratedDeviceTaint only, for
	// the taints they add.
	DeviceTaintRules []*resourceapi.DeviceTaintRule
	// DeviceTaintRulesUnread, when set, is why DeviceTaintRules could not
	// be read: only the taints of ResourceSlices are judged then.
	DeviceTaintRulesUnread error
}

// Find returns the violations in s, sorted by kind, then device, counter
// or pool, then pod. It reads s without modifying it.
func Find(s State) []Violation {
	found, _ := find(newJudge(context.Background()), s)
	out := make([]Violation, 0, len(found))
	for _, f := range found {
		out = append(out, f.Violation)
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

// finding is a violation as [Find] reports it, with whether it may be an
// artefact of a pool that its driver is republishing.
type finding struct {
	Violation
	// pending, when set, says why it may yet resolve itself and is not
	// reported by [CheckWith]: set on a VanishedDevice of a device that
	// is DevicePending, on an UnpublishedPool (CheckWith clears it once
	// its reads have found the pool so for
	// CheckOptions.UnpublishedAfter), and by CheckWith on a
	// StaleReservation whose pods have not been done for
	// CheckOptions.StaleAfter.
	pending string
	// repairable is set on a StaleReservation, an UnreservedAllocation and
	// an UnpublishedPool:
	// the cluster's own controllers or the pool's driver undo them, so
	// they count only if they outlast every read.
	repairable bool
	// doneSince is set on a StaleReservation whose pods all record when
	// they stopped (see podDoneSince): the latest of those times. Zero
	// where a pod is gone or records no such time.
	doneSince time.Time
	// firstSeen is when the first read that found it began (set by
	// [CheckWith]).
	firstSeen time.Time
	// unpublishedMessage is the message of an UnpublishedPool as [Find]
	// words it, which [CheckWith] extends by how long it lasted.
	unpublishedMessage string
	// identity is what makes it the same violation in another read,
	// beside its kind: the device or counter for the device kinds (the
	// claims involved may change from read to read while the device stays
	// over-used), the claim and the pods it is reserved for for a
	// StaleReservation (a claim reserved in each read for another pod
	// created after the pods were listed is not stale); empty: the
	// device, counter, pod and claims.
	identity string
}

// find returns the violations in s, sorted as by [Find], and what it did
// not judge beside the kinds that s lacks the objects for (in words).
func find(j judge, s State) ([]finding, []string) {
	pools := publishedPools(s.Slices)
	var out []finding
	out = append(out, deviceViolations(s.Claims, pools)...)
	var classes map[string]*resourceapi.DeviceClass
	if s.DeviceClassesUnread == nil {
		classes = make(map[string]*resourceapi.DeviceClass, len(s.DeviceClasses))
		for _, c := range s.DeviceClasses {
			classes[c.Name] = c
		}
	}
	mismatches, notes := allocationMismatches(j, s.Claims, classes, pools)
	out = append(out, mismatches...)
	untolerated, taintNotes := untoleratedTaints(s.Claims, s.DeviceTaintRules, pools)
	out = append(out, untolerated...)
	notes = append(notes, taintNotes...)
	for _, v := range podViolations(s.Pods, s.Claims, s.Nodes, pools) {
		out = append(out, finding{Violation: v})
	}
	out = append(out, staleReservations(s.Pods, s.Claims)...)
	sortFindings(out)
	return out, notes
}

// sortFindings sorts found as [Find] does, and gives each an empty list
// of claims where it has none.
func sortFindings(found []finding) {
	for i := range found {
		if found[i].Claims == nil {
			found[i].Claims = []string{}
		}
	}
	slices.SortFunc(found, func(a, b finding) int {
		return cmp.Or(cmp.Compare(a.Kind, b.Kind), cmp.Compare(deviceKey(a.Device), deviceKey(b.Device)), cmp.Compare(a.Counter, b.Counter), cmp.Compare(a.Pool, b.Pool), cmp.Compare(a.Pod, b.Pod), slices.Compare(a.Claims, b.Claims))
	})
}

func deviceKey(d *Device) string {
	if d == nil {
		return ""
	}
	return d.String()
}

// Presence is what a pool's ResourceSlices say about one of its devices.
type Presence int

const (
	// DevicePublished: a slice of the newest generation of the device's
	// pool publishes it.
	DevicePublished Presence = iota
	// DevicePending: no slice of the newest generation of the device's
	// pool publishes it, but that generation is incomplete (fewer of its
	// slices exist than its resourceSliceCount): the driver is updating
	// the pool slice by slice, and a slice still to come may publish the
	// device.
	DevicePending
	// DeviceGone: the newest generation of the device's pool is complete
	// without it, or no slice publishes the pool at all. A driver replaces
	// a pool's slices by publishing a new generation, so a pool without
	// slices was removed (its driver or node is gone).
	DeviceGone
)

// Publication is what the newest generation of each pool publishes. It is
// immutable and safe for concurrent use.
type Publication struct {
	pools pools
}

// Publish judges the pools of resourceSlices: a pool's newest generation
// is complete when as many slices of it exist as its resourceSliceCount,
// as for the upstream allocator.
func Publish(resourceSlices []*resourceapi.ResourceSlice) *Publication {
	return &Publication{pools: publishedPools(resourceSlices)}
}

// Presence tells whether d is published, may still be published by a slice
// of an incomplete pool, or is gone. [Find] is stricter: it reports every
// allocated device that is not DevicePublished, as a VanishedDevice or,
// where no slice publishes its pool, an UnpublishedPool, since it judges a
// cluster at rest.
func (p *Publication) Presence(d Device) Presence {
	return p.pools.presence(d)
}

func allowsMultiple(d *resourceapi.Device) bool {
	return d.AllowMultipleAllocations != nil && *d.AllowMultipleAllocations
}

// counterKey names one counter of a pool's shared counter set.
type counterKey struct {
	driver, pool, set, name string
}

func (k counterKey) String() string { return k.driver + "/" + k.pool + "/" + k.set + "/" + k.name }

type poolID struct{ driver, pool string }

// pools is what the newest generation of each pool publishes: its devices,
// the values of its shared counters, and whether all its slices exist.
type pools struct {
	devices map[Device]*resourceapi.Device
	// reach holds, for every published device, the nodes it can be
	// used on: its slice's, or its own where its slice selects nodes per
	// device.
	reach map[Device]deviceReach
	// sources holds, for every published device, the ResourceSlice that
	// publishes it.
	sources  map[Device]sliceSource
	counters map[counterKey]resource.Quantity
	// complete tells, for every pool that a slice publishes, whether as
	// many slices of its newest generation exist as the resourceSliceCount
	// of the first of them (the upstream allocator's test).
	complete map[poolID]bool
}

// sliceSource is the ResourceSlice that publishes a device: its name,
// and when it was last changed as far as its metadata tells (see
// specChanged: its creation, for a slice created anew, or its latest
// managed-fields entry, which the API server stamps whenever a writer
// changes a field it owns); zero where the slice records no time.
type sliceSource struct {
	name    string
	changed time.Time
}

// deviceReach is the node selection of a published device: one node, the
// nodes a selector selects, or all nodes.
type deviceReach struct {
	node     string
	selector *v1.NodeSelector
	all      bool
}

// admits says whether a device of this reach can be used on node, and
// whether that can be told (a device that selects no node in any way, or
// an invalid selector, cannot).
func (r deviceReach) admits(node *v1.Node) (admits, known bool) {
	switch {
	case r.all:
		return true, true
	case r.node != "":
		return r.node == node.Name, true
	case r.selector != nil:
		selector, err := nodeaffinity.NewNodeSelector(r.selector)
		if err != nil {
			return false, false
		}
		return selector.Match(node), true
	}
	return false, false
}

func (p pools) presence(d Device) Presence {
	if _, ok := p.devices[d]; ok {
		return DevicePublished
	}
	if complete, ok := p.complete[poolID{d.Driver, d.Pool}]; ok && !complete {
		return DevicePending
	}
	return DeviceGone
}

func publishedPools(resourceSlices []*resourceapi.ResourceSlice) pools {
	newest := map[poolID]int64{}
	for _, s := range resourceSlices {
		id := poolID{s.Spec.Driver, s.Spec.Pool.Name}
		if g, ok := newest[id]; !ok || s.Spec.Pool.Generation > g {
			newest[id] = s.Spec.Pool.Generation
		}
	}
	out := pools{devices: map[Device]*resourceapi.Device{}, reach: map[Device]deviceReach{}, sources: map[Device]sliceSource{}, counters: map[counterKey]resource.Quantity{}, complete: map[poolID]bool{}}
	sliceCount := map[poolID]int64{}
	seen := map[poolID]int64{}
	for _, s := range resourceSlices {
		id := poolID{s.Spec.Driver, s.Spec.Pool.Name}
		if s.Spec.Pool.Generation != newest[id] {
			continue
		}
		if _, ok := sliceCount[id]; !ok {
			sliceCount[id] = s.Spec.Pool.ResourceSliceCount
		}
		seen[id]++
		perDevice := ptr.Deref(s.Spec.PerDeviceNodeSelection, false)
		source := sliceSource{name: s.Name, changed: specChanged(s.ObjectMeta)}
		for i := range s.Spec.Devices {
			d := &s.Spec.Devices[i]
			id := Device{s.Spec.Driver, s.Spec.Pool.Name, d.Name}
			out.devices[id] = d
			out.sources[id] = source
			if perDevice {
				out.reach[id] = deviceReach{node: ptr.Deref(d.NodeName, ""), selector: d.NodeSelector, all: ptr.Deref(d.AllNodes, false)}
			} else {
				out.reach[id] = deviceReach{node: ptr.Deref(s.Spec.NodeName, ""), selector: s.Spec.NodeSelector, all: ptr.Deref(s.Spec.AllNodes, false)}
			}
		}
		for _, set := range s.Spec.SharedCounters {
			for name, c := range set.Counters {
				k := counterKey{s.Spec.Driver, s.Spec.Pool.Name, set.Name, name}
				if _, dup := out.counters[k]; !dup {
					out.counters[k] = c.Value
				}
			}
		}
	}
	for id, n := range seen {
		out.complete[id] = n == sliceCount[id]
	}
	return out
}

// unpublishedPending says why an UnpublishedPool may resolve itself.
const unpublishedPending = "its pool may be published again or its pods deleted: the kubelet removes a node's slices when it starts and 30 s after a driver unregisters (a driver restart or upgrade), and a deleted Node takes its slices with it"

func deviceViolations(claims []*resourceapi.ResourceClaim, published pools) []finding {
	holders := map[Device][]string{}
	// dedicated counts the results without a ShareID: upstream, such a
	// result holds the whole device, whether or not it allows multiple
	// allocations.
	dedicated := map[Device]int{}
	consumed := map[Device]map[resourceapi.QualifiedName]resource.Quantity{}
	for _, c := range claims {
		if c.Status.Allocation == nil {
			continue
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			if grantsAdminAccess(c, r) {
				continue
			}
			d := Device{r.Driver, r.Pool, r.Device}
			holders[d] = append(holders[d], c.Namespace+"/"+c.Name)
			if r.ShareID == nil {
				dedicated[d]++
			}
			for name, q := range r.ConsumedCapacity {
				if consumed[d] == nil {
					consumed[d] = map[resourceapi.QualifiedName]resource.Quantity{}
				}
				sum := consumed[d][name]
				sum.Add(q)
				consumed[d][name] = sum
			}
		}
	}
	var out []finding
	counterUse := map[counterKey]resource.Quantity{}
	counterClaims := map[counterKey][]string{}
	// The allocated devices that consume each counter set (counterKey
	// without a counter name), with their compatibility groups.
	type member struct {
		device Device
		groups []string
		claims []string
	}
	setMembers := map[counterKey][]member{}
	// The allocated devices and their claims of each pool without slices.
	unpublished := map[poolID][]Device{}
	unpublishedClaims := map[poolID][]string{}
	for d, claimNames := range holders {
		slices.Sort(claimNames)
		distinct := slices.Compact(slices.Clone(claimNames))
		spec, exists := published.devices[d]
		_, poolPublished := published.complete[poolID{d.Driver, d.Pool}]
		switch {
		case !exists && !poolPublished:
			id := poolID{d.Driver, d.Pool}
			unpublished[id] = append(unpublished[id], d)
			unpublishedClaims[id] = append(unpublishedClaims[id], distinct...)
		case !exists:
			var pending string
			if published.presence(d) == DevicePending {
				pending = "its pool is being republished"
			}
			out = append(out, finding{pending: pending, identity: d.String(), Violation: Violation{
				Kind: VanishedDevice, Device: &d, Claims: distinct,
				Message: fmt.Sprintf("device %s is allocated to %s but the newest generation of its pool's ResourceSlices does not publish it", d, strings.Join(distinct, ", ")),
			}})
		}
		multiple := exists && allowsMultiple(spec)
		switch {
		case !exists && dedicated[d] == 0:
			// Held only by shares of a device that is not published
			// (now): the allocator writes a share ID only for a device
			// that allows multiple allocations, so the sharing was
			// legal; the device is reported as vanished.
		case len(claimNames) > 1 && !multiple:
			out = append(out, finding{identity: d.String(), Violation: Violation{
				Kind: DoubleAllocation, Device: &d, Claims: claimNames,
				Message: fmt.Sprintf("device %s is allocated %d times: %s", d, len(claimNames), strings.Join(claimNames, ", ")),
			}})
		case len(claimNames) > 1 && dedicated[d] > 0:
			out = append(out, finding{identity: d.String(), Violation: Violation{
				Kind: DoubleAllocation, Device: &d, Claims: claimNames,
				Message: fmt.Sprintf("device %s allows multiple allocations but is allocated %d times, %d of them without a share ID (holding the whole device): %s", d, len(claimNames), dedicated[d], strings.Join(claimNames, ", ")),
			}})
		}
		if !exists {
			continue
		}
		if multiple {
			for _, name := range slices.Sorted(maps.Keys(consumed[d])) {
				capacity, ok := spec.Capacity[name]
				if sum := consumed[d][name]; ok && sum.Cmp(capacity.Value) > 0 {
					out = append(out, finding{identity: d.String() + "|" + string(name), Violation: Violation{
						Kind: CapacityExceeded, Device: &d, Claims: distinct,
						Message: fmt.Sprintf("device %s has %s of %s, but %s consume %s", d, capacity.Value.String(), name, strings.Join(distinct, ", "), sum.String()),
					}})
				}
			}
		}
		// A device consumes its counters once, however many claims
		// share it.
		for _, consumption := range spec.ConsumesCounters {
			set := counterKey{d.Driver, d.Pool, consumption.CounterSet, ""}
			setMembers[set] = append(setMembers[set], member{d, consumption.CompatibilityGroups, distinct})
			for name, c := range consumption.Counters {
				k := counterKey{d.Driver, d.Pool, consumption.CounterSet, name}
				sum := counterUse[k]
				sum.Add(c.Value)
				counterUse[k] = sum
				counterClaims[k] = append(counterClaims[k], distinct...)
			}
		}
	}
	for id, devs := range unpublished {
		slices.SortFunc(devs, func(a, b Device) int { return cmp.Compare(a.Name, b.Name) })
		names := make([]string, len(devs))
		for i, d := range devs {
			names[i] = d.Name
		}
		claimNames := unpublishedClaims[id]
		slices.Sort(claimNames)
		claimNames = slices.Compact(claimNames)
		pool := id.driver + "/" + id.pool
		message := fmt.Sprintf("pool %s has no ResourceSlices, but its devices %s are allocated to %s", pool, strings.Join(names, ", "), strings.Join(claimNames, ", "))
		out = append(out, finding{
			pending:            unpublishedPending,
			repairable:         true,
			identity:           pool,
			unpublishedMessage: message,
			Violation: Violation{
				Kind: UnpublishedPool, Pool: pool, Claims: claimNames,
				Message: message,
			},
		})
	}
	for set, members := range setMembers {
		groups := make([][]string, len(members))
		for i, m := range members {
			groups[i] = m.groups
		}
		if compatible(groups) {
			continue
		}
		slices.SortFunc(members, func(a, b member) int { return cmp.Compare(a.device.Name, b.device.Name) })
		var parts, claimNames []string
		for _, m := range members {
			groups := "no groups"
			if len(m.groups) > 0 {
				groups = "groups " + strings.Join(m.groups, ",")
			}
			parts = append(parts, fmt.Sprintf("%s (%s)", m.device.Name, groups))
			claimNames = append(claimNames, m.claims...)
		}
		slices.Sort(claimNames)
		claimNames = slices.Compact(claimNames)
		id := set.driver + "/" + set.pool + "/" + set.set
		out = append(out, finding{identity: id, Violation: Violation{
			Kind: IncompatiblePartitions, Counter: id, Claims: claimNames,
			Message: fmt.Sprintf("devices %s of pool %s/%s consume counter set %s together, but their compatibility groups do not go together (allocated to %s)", strings.Join(parts, ", "), set.driver, set.pool, set.set, strings.Join(claimNames, ", ")),
		}})
	}
	for k, used := range counterUse {
		// A counter set that the pool does not publish leaves the pool
		// unusable for the allocator; nothing is over-consumed then.
		limit, ok := published.counters[k]
		if !ok || used.Cmp(limit) <= 0 {
			continue
		}
		claimNames := counterClaims[k]
		slices.Sort(claimNames)
		claimNames = slices.Compact(claimNames)
		out = append(out, finding{identity: k.String(), Violation: Violation{
			Kind: CounterExceeded, Counter: k.String(), Claims: claimNames,
			Message: fmt.Sprintf("counter %s of counter set %s in pool %s/%s is %s, but the devices allocated to %s consume %s", k.name, k.set, k.driver, k.pool, limit.String(), strings.Join(claimNames, ", "), used.String()),
		}})
	}
	return out
}

// compatible reports whether devices that consume one counter set may be
// allocated together by their compatibility groups (one list per device),
// as the upstream allocator decides: all declare none, or all declare
// some and one group is common to all of them.
func compatible(groups [][]string) bool {
	if len(groups) == 0 {
		return true
	}
	common := slices.Clone(groups[0])
	allNone := len(common) == 0
	for _, g := range groups[1:] {
		switch {
		case (len(g) == 0) != allNone:
			return false
		case allNone:
			continue
		}
		common = slices.DeleteFunc(common, func(name string) bool { return !slices.Contains(g, name) })
		if len(common) == 0 {
			return false
		}
	}
	return true
}

func podViolations(pods []*v1.Pod, claims []*resourceapi.ResourceClaim, nodes []*v1.Node, published pools) []Violation {
	type key struct{ namespace, name string }
	byName := make(map[key]*resourceapi.ResourceClaim, len(claims))
	for _, c := range claims {
		byName[key{c.Namespace, c.Name}] = c
	}
	nodeByName := make(map[string]*v1.Node, len(nodes))
	for _, n := range nodes {
		nodeByName[n.Name] = n
	}
	var out []Violation
	for _, pod := range pods {
		if pod.Spec.NodeName == "" || pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed {
			continue
		}
		podName := pod.Namespace + "/" + pod.Name
		for _, ref := range PodClaimNames(pod) {
			if ref.Name == "" {
				out = append(out, Violation{
					Kind: PodClaimUnallocated, Pod: podName,
					Message: fmt.Sprintf("pod %s is bound to %s but its claim %q was never created", podName, pod.Spec.NodeName, ref.PodClaimName),
				})
				continue
			}
			claimName := pod.Namespace + "/" + ref.Name
			c := byName[key{pod.Namespace, ref.Name}]
			switch {
			case c == nil:
				out = append(out, Violation{
					Kind: PodClaimUnallocated, Pod: podName, Claims: []string{claimName},
					Message: fmt.Sprintf("pod %s is bound to %s but its claim %s does not exist", podName, pod.Spec.NodeName, claimName),
				})
			case c.Status.Allocation == nil:
				out = append(out, Violation{
					Kind: PodClaimUnallocated, Pod: podName, Claims: []string{claimName},
					Message: fmt.Sprintf("pod %s is bound to %s but its claim %s is not allocated", podName, pod.Spec.NodeName, claimName),
				})
			case !resourceclaim.IsReservedForPod(pod, c, true):
				out = append(out, Violation{
					Kind: PodClaimNotReserved, Pod: podName, Claims: []string{claimName},
					Message: fmt.Sprintf("pod %s is bound to %s but its claim %s is reserved neither for it nor for its pod group", podName, pod.Spec.NodeName, claimName),
				})
			}
			if c == nil || c.Status.Allocation == nil {
				continue
			}
			node := nodeByName[pod.Spec.NodeName]
			if node == nil {
				continue // gone, or nodes may not be listed: not judged
			}
			if c.Status.Allocation.NodeSelector != nil {
				if selector, err := nodeaffinity.NewNodeSelector(c.Status.Allocation.NodeSelector); err != nil || !selector.Match(node) {
					why := "does not select it"
					if err != nil {
						why = fmt.Sprintf("is invalid (%v)", err)
					}
					out = append(out, Violation{
						Kind: PodClaimOnOtherNode, Pod: podName, Claims: []string{claimName},
						Message: fmt.Sprintf("pod %s is bound to %s but the node selector of its claim %s's allocation %s: its devices (%s) cannot be reached from there", podName, pod.Spec.NodeName, claimName, why, allocatedDevices(c)),
					})
					continue
				}
			}
			// The allocation's node selector may be missing or wider
			// than its devices' reach: the devices' own node selection,
			// as published, decides where they can be used.
			var unreachable []string
			for _, r := range c.Status.Allocation.Devices.Results {
				id := Device{r.Driver, r.Pool, r.Device}
				reach, ok := published.reach[id]
				if !ok {
					continue // not published: VanishedDevice or UnpublishedPool
				}
				if admits, known := reach.admits(node); known && !admits {
					unreachable = append(unreachable, id.String())
				}
			}
			if len(unreachable) > 0 {
				out = append(out, Violation{
					Kind: PodClaimOnOtherNode, Pod: podName, Claims: []string{claimName},
					Message: fmt.Sprintf("pod %s is bound to %s but devices of its claim %s (%s) are published for other nodes and cannot be reached from there", podName, pod.Spec.NodeName, claimName, strings.Join(unreachable, ", ")),
				})
			}
		}
	}
	return out
}

// staleReservations finds the allocated claims whose reservations all name
// pods that are gone or done, judged as the resourceclaim controller
// judges them (by UID within the claim's namespace).
func staleReservations(pods []*v1.Pod, claims []*resourceapi.ResourceClaim) []finding {
	type key struct {
		namespace string
		uid       types.UID
	}
	byUID := make(map[key]*v1.Pod, len(pods))
	for _, p := range pods {
		byUID[key{p.Namespace, p.UID}] = p
	}
	// why says why reservation r of a claim in namespace no longer holds
	// the claim's devices; "" where it still does, or is not a pod's.
	// The pod of the reservation, if it is not gone.
	why := func(namespace string, r resourceapi.ResourceClaimConsumerReference) (string, *v1.Pod) {
		if r.APIGroup != "" || r.Resource != "pods" {
			return "", nil
		}
		switch p := byUID[key{namespace, r.UID}]; {
		case p == nil:
			return "gone", nil
		case p.Status.Phase == v1.PodSucceeded || p.Status.Phase == v1.PodFailed:
			return string(p.Status.Phase), p
		case p.DeletionTimestamp != nil && p.Spec.NodeName == "":
			return "deleted before it was bound", p
		}
		return "", nil
	}
	var out []finding
	for _, c := range claims {
		if c.Status.Allocation == nil || len(c.Status.ReservedFor) == 0 {
			continue
		}
		var stale, uids []string
		var since time.Time
		sinceKnown := true
		for _, r := range c.Status.ReservedFor {
			reason, p := why(c.Namespace, r)
			if reason == "" {
				stale = nil
				break
			}
			stale = append(stale, fmt.Sprintf("%s/%s (%s)", c.Namespace, r.Name, reason))
			uids = append(uids, string(r.UID))
			var t time.Time
			if p != nil {
				t = podDoneSince(p)
			}
			if t.IsZero() {
				sinceKnown = false
			} else if t.After(since) {
				since = t
			}
		}
		if stale == nil {
			continue
		}
		if !sinceKnown {
			since = time.Time{}
		}
		name := c.Namespace + "/" + c.Name
		slices.Sort(uids)
		out = append(out, finding{repairable: true, doneSince: since, identity: name + "|" + strings.Join(uids, ","), Violation: Violation{
			Kind: StaleReservation, Claims: []string{name},
			Message: fmt.Sprintf("claim %s holds %s but is reserved only for pods that will not run: %s; kube-controller-manager's resourceclaim controller removes such reservations and deallocates the claim (is it running? see its log)", name, allocatedDevices(c), strings.Join(stale, ", ")),
		}})
	}
	return out
}

// unreservedAllocations finds the allocated claims that are reserved for
// no one and that no pod that may still run uses.
func unreservedAllocations(pods []*v1.Pod, claims []*resourceapi.ResourceClaim) []finding {
	used := map[string]bool{}
	for _, p := range pods {
		if p.Status.Phase == v1.PodSucceeded || p.Status.Phase == v1.PodFailed || p.DeletionTimestamp != nil && p.Spec.NodeName == "" {
			continue
		}
		for _, ref := range PodClaimNames(p) {
			if ref.Name != "" {
				used[p.Namespace+"/"+ref.Name] = true
			}
		}
	}
	var out []finding
	for _, c := range claims {
		name := c.Namespace + "/" + c.Name
		if c.Status.Allocation == nil || len(c.Status.ReservedFor) > 0 || c.DeletionTimestamp != nil || used[name] || !slices.Contains(c.Finalizers, resourceapi.Finalizer) {
			continue
		}
		out = append(out, finding{repairable: true, identity: name + "|" + string(c.UID), Violation: Violation{
			Kind: UnreservedAllocation, Claims: []string{name},
			Message: fmt.Sprintf("claim %s holds %s but is reserved for no one and no pod that may run uses it; nothing in the cluster deallocates such a claim: delete it if no pod will use it again (a pod that uses it is placed on its devices' node)", name, allocatedDevices(c)),
		}})
	}
	return out
}

// podDoneSince is when pod p, done (succeeded or failed, or deleted
// before it was bound), stopped: the latest of its containers' finishedAt
// and of its conditions' lastTransitionTime for a pod that succeeded or
// failed (the kubelet turns its Ready condition false as it finishes; a
// condition that changed later only makes the time later, never
// earlier), its deletionTimestamp for a pod deleted before it was bound
// (the API server deletes an unbound pod without a grace period). Zero
// where p records no such time.
func podDoneSince(p *v1.Pod) time.Time {
	if p.Status.Phase != v1.PodSucceeded && p.Status.Phase != v1.PodFailed {
		if p.DeletionTimestamp != nil {
			return p.DeletionTimestamp.Time
		}
		return time.Time{}
	}
	var latest time.Time
	later := func(t metav1.Time) {
		if t.After(latest) {
			latest = t.Time
		}
	}
	for _, statuses := range [][]v1.ContainerStatus{p.Status.InitContainerStatuses, p.Status.ContainerStatuses, p.Status.EphemeralContainerStatuses} {
		for _, st := range statuses {
			if st.State.Terminated != nil {
				later(st.State.Terminated.FinishedAt)
			}
		}
	}
	for _, c := range p.Status.Conditions {
		later(c.LastTransitionTime)
	}
	return latest
}

// allocatedDevices lists the devices of c's allocation, comma-separated.
func allocatedDevices(c *resourceapi.ResourceClaim) string {
	var devices []string
	for _, r := range c.Status.Allocation.Devices.Results {
		devices = append(devices, Device{r.Driver, r.Pool, r.Device}.String())
	}
	return strings.Join(devices, ", ")
}

// ClaimRef is one claim a pod uses: PodClaimName is its name in
// pod.spec.resourceClaims ("" for the claim of DRA-backed extended
// resources), Name the ResourceClaim's name ("" while a claim from a
// template has not been created).
type ClaimRef struct {
	PodClaimName, Name string
}

// PodClaimNames lists the claims a pod uses. A claim from a template whose
// status entry names no claim is left out: the API says that generating it
// was not necessary.
func PodClaimNames(pod *v1.Pod) []ClaimRef {
	var out []ClaimRef
	for _, pc := range pod.Spec.ResourceClaims {
		ref := ClaimRef{PodClaimName: pc.Name}
		needed := true
		if pc.ResourceClaimName != nil {
			ref.Name = *pc.ResourceClaimName
		} else {
			for _, st := range pod.Status.ResourceClaimStatuses {
				if st.Name != pc.Name {
					continue
				}
				if st.ResourceClaimName == nil {
					needed = false
				} else {
					ref.Name = *st.ResourceClaimName
				}
			}
		}
		if needed {
			out = append(out, ref)
		}
	}
	if ext := pod.Status.ExtendedResourceClaimStatus; ext != nil && ext.ResourceClaimName != "" {
		out = append(out, ClaimRef{Name: ext.ResourceClaimName})
	}
	return out
}
