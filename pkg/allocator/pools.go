package allocator

import (
	"fmt"
	"slices"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/sets"
)

// poolState is what the upstream allocator makes of one resource pool for
// one node.
type poolState int

const (
	// poolAbsent: upstream does not see the pool on this node (none of
	// its slices that it reads is relevant there, or the generation the
	// node's slices have is being replaced).
	poolAbsent poolState = iota
	// poolIncomplete: slices of the generation are missing; upstream
	// allocates nothing from the pool.
	poolIncomplete
	// poolInvalid: duplicate device names, duplicate counter sets or
	// devices that consume counters that no counter set has; upstream
	// allocates nothing from the pool.
	poolInvalid
	// poolValid: upstream allocates from the slices of generation that
	// are relevant for the node.
	poolValid
)

// poolStatus is the outcome of gathering one pool for one node, the way
// the upstream structured allocator gathers its pools.
type poolStatus struct {
	state poolState
	// generation is the pool generation upstream uses on the node.
	generation int64
	// reason says why the pool is invalid.
	reason string
}

// stableFeatures are the features that upstream's "stable" allocator
// implements; it is the one NewAllocator picks when no other feature is
// enabled. It reads counter-set slices of every node.
var stableFeatures = sets.New("DRAAdminAccess", "DRAPrioritizedList", "DRAPartitionableDevices", "DRADeviceTaints")

// ignoredSlice reports whether upstream skips a slice before it looks at
// node selection: partitionable-device slices while that feature is off,
// and slices with compatibility groups while that feature is off (which
// leaves their pool incomplete).
func (a *Allocator) ignoredSlice(slice *resourceapi.ResourceSlice) bool {
	if !a.features.PartitionableDevices && (slice.Spec.PerDeviceNodeSelection != nil || len(slice.Spec.SharedCounters) > 0) {
		return true
	}
	return !a.features.CompatibilityGroups && usesCompatibilityGroups(slice)
}

// usesCompatibilityGroups reports whether a device of the slice declares
// compatibility groups for the counters it consumes.
func usesCompatibilityGroups(slice *resourceapi.ResourceSlice) bool {
	for i := range slice.Spec.Devices {
		for _, c := range slice.Spec.Devices[i].ConsumesCounters {
			if len(c.CompatibilityGroups) > 0 {
				return true
			}
		}
	}
	return false
}

// counterSetSlice reports whether upstream reads the slice as one that
// only defines counter sets.
func (a *Allocator) counterSetSlice(slice *resourceapi.ResourceSlice) bool {
	return a.features.PartitionableDevices && len(slice.Spec.SharedCounters) > 0
}

// gatherPool decides the state of one pool for the node whose relevant
// slices (those that select the node, in any pool) are given, with
// upstream's rules:
//   - the newest generation among the node's own usable slices counts,
//     even if another node already sees a newer one, as long as the
//     node's slices of that generation are the whole pool;
//   - otherwise the pool's slices of that generation on all nodes must
//     add up to ResourceSliceCount (incomplete if not), and a newer
//     generation anywhere means the node's generation is on its way out
//     (absent);
//   - device names must be unique among the node's device slices, counter
//     set names unique, and every counter a device consumes must exist.
func (a *Allocator) gatherPool(key poolKey, relevant []*resourceapi.ResourceSlice) poolStatus {
	all := a.byPool[key]
	var usable []*resourceapi.ResourceSlice
	for _, slice := range all {
		if a.ignoredSlice(slice) {
			continue
		}
		// The stable allocator takes counter-set slices from any node.
		if slices.Contains(relevant, slice) || (a.stableVariant && len(slice.Spec.SharedCounters) > 0) {
			usable = append(usable, slice)
		}
	}
	if len(usable) == 0 {
		return poolStatus{state: poolAbsent}
	}
	generation := usable[0].Spec.Pool.Generation
	for _, slice := range usable[1:] {
		generation = max(generation, slice.Spec.Pool.Generation)
	}
	var onNode []*resourceapi.ResourceSlice
	for _, slice := range usable {
		if slice.Spec.Pool.Generation == generation {
			onNode = append(onNode, slice)
		}
	}
	want := onNode[0].Spec.Pool.ResourceSliceCount
	var offNode []*resourceapi.ResourceSlice
	if int64(len(onNode)) != want {
		var whole []*resourceapi.ResourceSlice
		for _, slice := range all {
			switch {
			case slice.Spec.Pool.Generation > generation:
				return poolStatus{state: poolAbsent}
			case slice.Spec.Pool.Generation == generation:
				if a.features.CompatibilityGroups || !usesCompatibilityGroups(slice) {
					whole = append(whole, slice)
				}
			}
		}
		if int64(len(whole)) != want {
			return poolStatus{state: poolIncomplete, generation: generation}
		}
		for _, slice := range whole {
			if !slices.Contains(onNode, slice) {
				offNode = append(offNode, slice)
			}
		}
	}
	if reason := a.invalidPool(onNode, offNode); reason != "" {
		return poolStatus{state: poolInvalid, generation: generation, reason: reason}
	}
	return poolStatus{state: poolValid, generation: generation}
}

// invalidPool returns why upstream rejects a pool whose slices of the
// node's generation are onNode (relevant for the node) and offNode (the
// rest of the pool, read only when onNode alone is not the whole pool),
// or "".
func (a *Allocator) invalidPool(onNode, offNode []*resourceapi.ResourceSlice) string {
	names := sets.New[string]()
	for _, slice := range onNode {
		if a.counterSetSlice(slice) {
			continue
		}
		for i := range slice.Spec.Devices {
			name := slice.Spec.Devices[i].Name
			if names.Has(name) {
				return fmt.Sprintf("duplicate device name %s", name)
			}
			names.Insert(name)
		}
	}
	if !a.features.PartitionableDevices {
		return ""
	}
	counters := map[string]sets.Set[string]{}
	for _, slice := range slices.Concat(onNode, offNode) {
		if !a.counterSetSlice(slice) {
			continue
		}
		for _, set := range slice.Spec.SharedCounters {
			if _, ok := counters[set.Name]; ok {
				return fmt.Sprintf("duplicate counter set name %s", set.Name)
			}
			names := sets.New[string]()
			for name := range set.Counters {
				names.Insert(name)
			}
			counters[set.Name] = names
		}
	}
	for _, slice := range slices.Concat(onNode, offNode) {
		if a.counterSetSlice(slice) {
			continue
		}
		for i := range slice.Spec.Devices {
			for _, c := range slice.Spec.Devices[i].ConsumesCounters {
				set, ok := counters[c.CounterSet]
				if !ok {
					return fmt.Sprintf("counter set %s not found", c.CounterSet)
				}
				for name := range c.Counters {
					if !set.Has(name) {
						return fmt.Sprintf("counter %s not found in counter set %s", name, c.CounterSet)
					}
				}
			}
		}
	}
	return ""
}
