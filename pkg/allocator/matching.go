package allocator

import (
	"context"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/sets"
)

// DeviceCount counts one driver's devices on one node: all of them
// (Devices) and the free ones (Free: without an allocation, with the
// shared counters they consume not used up, and without a NoSchedule or
// NoExecute taint that the pod's request that matches the device does not
// tolerate; without any where none matches), and of them those that a
// pod's requests match (Matching) and the free ones among those
// (MatchingFree).
type DeviceCount struct{ Devices, Free, Matching, MatchingFree int }

// CountDevices counts, per node of nodes and per driver, the devices of
// the node's own pools (slices with spec.nodeName, the newest generation
// of each pool; not network-attached devices), and of them those that
// match the class and selectors of some request of claims, counting every
// subrequest of a firstAvailable request, each with how many are free: not
// allocated, not blocked by shared counters that allocated devices used
// up (a GPU with an allocated partition), and not tainted beyond what the
// requests tolerate (see DeviceCount). A device counts as matching where
// a selector fails on it at run time; a request (or subrequest) with a
// selector that does not compile matches no device, since upstream
// allocates none for it: it reports the error on the first device that
// the selector is evaluated on. It works on slices, through the selector cache, without
// gathering the nodes: pool rules (incomplete or invalid pools) are not
// applied. matched is false, and Matching and MatchingFree are 0, where
// the claims use fields this package does not interpret: only upstream's
// allocation can tell then. Like Allocate, it returns an error only for
// input problems that make the claims unallocatable on every node (an
// *InputError) and cancellation. It counts the nodes with
// Options.Parallelize. Safe for concurrent use.
func (a *Allocator) CountDevices(ctx context.Context, claims []*resourceapi.ResourceClaim, nodes sets.Set[string]) (counts map[string]map[string]DeviceCount, matched bool, err error) {
	var specs []*unitSpec
	matched = true
	for _, claim := range claims {
		st := a.claimStatic(claim)
		if st.err != nil {
			return nil, false, st.err
		}
		if st.passthrough {
			specs, matched = nil, false
			break
		}
		for _, rs := range st.requests {
			specs = append(specs, rs.alts...)
		}
	}
	newest := func(slice *resourceapi.ResourceSlice) bool {
		return slice.Spec.Pool.Generation == a.poolGen[poolKey{slice.Spec.Driver, slice.Spec.Pool.Name}]
	}
	names := nodes.UnsortedList()
	perNode := make([]map[string]DeviceCount, len(names))
	count := func(i int) {
		if ctx.Err() == nil {
			perNode[i] = a.countNode(ctx, names[i], specs, newest)
		}
	}
	if a.parallelize != nil && len(names) > 1 {
		a.parallelize(ctx, len(names), count)
	} else {
		for i := range names {
			count(i)
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, false, err
	}
	counts = make(map[string]map[string]DeviceCount, len(names))
	for i, name := range names {
		if perNode[i] != nil {
			counts[name] = perNode[i]
		}
	}
	return counts, matched, nil
}

// countNode is CountDevices' count of one node: per driver, nil where the
// node has no devices. Safe for concurrent use.
func (a *Allocator) countNode(ctx context.Context, node string, specs []*unitSpec, newest func(*resourceapi.ResourceSlice) bool) map[string]DeviceCount {
	var byDriver map[string]DeviceCount
	left := a.countersLeftOn(node, newest)
	for _, slice := range a.byNode[node] {
		if !newest(slice) || len(slice.Spec.Devices) == 0 {
			continue
		}
		if byDriver == nil {
			byDriver = map[string]DeviceCount{}
		}
		c := byDriver[slice.Spec.Driver]
		memo := a.cache.forSlice(slice.UID, slice.Generation, a.features.ListTypeAttributes)
		ids := a.sliceInfo(slice).ids
		for i := range slice.Spec.Devices {
			device := &slice.Spec.Devices[i]
			var match *unitSpec
			for _, u := range specs {
				if u.uncompiled {
					continue
				}
				if matches, _ := selectorsMatch(ctx, memo, slice, i, device, u.selectors); matches {
					match = u
					break
				}
			}
			free := !a.deviceInUse(ids[i]) && (left == nil || !left.exceeded(slice.Spec.Driver, slice.Spec.Pool.Name, device)) && a.tolerated(device, match)
			c.Devices++
			if free {
				c.Free++
			}
			if match != nil {
				c.Matching++
				if free {
					c.MatchingFree++
				}
			}
		}
		byDriver[slice.Spec.Driver] = c
	}
	return byDriver
}

// tolerated reports whether the device's NoSchedule and NoExecute taints
// are tolerated by match, the pod's request that matches the device; a
// device that no request matches counts as tolerated only without such
// taints. A device with a taint that the pod could not have, such as a
// health taint, is not free for the count: the smaller pods that a
// headroom keeps devices for could not have it either. Without device
// taints (the feature off) every device is.
func (a *Allocator) tolerated(device *resourceapi.Device, match *unitSpec) bool {
	if !a.features.DeviceTaints || len(device.Taints) == 0 {
		return true
	}
	if match == nil {
		return !taintPrevents(device, nil)
	}
	return !taintPrevents(device, match.tolerations)
}

// countersLeftOn returns what the devices in use on node leave of the
// shared counters of its pools (newest tells the slices that count), or
// nil where the node's devices consume no counters.
func (a *Allocator) countersLeftOn(node string, newest func(*resourceapi.ResourceSlice) bool) countersLeft {
	var left countersLeft
	for _, slice := range a.byNode[node] {
		if !newest(slice) {
			continue
		}
		for i := range slice.Spec.Devices {
			if len(slice.Spec.Devices[i].ConsumesCounters) > 0 {
				left = declaredCounters(a.byNode[node], newest)
				break
			}
		}
		if left != nil {
			break
		}
	}
	if left == nil {
		return nil
	}
	for _, slice := range a.byNode[node] {
		if !newest(slice) {
			continue
		}
		ids := a.sliceInfo(slice).ids
		for i := range slice.Spec.Devices {
			if a.deviceInUse(ids[i]) {
				left.consume(slice.Spec.Driver, slice.Spec.Pool.Name, &slice.Spec.Devices[i])
			}
		}
	}
	return left
}

// DeviceHasTaint reports whether the device driver/pool/device is in the
// newest generation of its pool among the Allocator's slices (found) and
// whether it carries a taint with key, of any effect (in the slice or
// from a DeviceTaintRule, where the slices were listed with the rules
// applied).
func (a *Allocator) DeviceHasTaint(driver, pool, device, key string) (found, tainted bool) {
	k := poolKey{driver, pool}
	for _, slice := range a.byPool[k] {
		if slice.Spec.Pool.Generation != a.poolGen[k] {
			continue
		}
		for i := range slice.Spec.Devices {
			d := &slice.Spec.Devices[i]
			if d.Name != device {
				continue
			}
			for _, t := range d.Taints {
				if t.Key == key {
					return true, true
				}
			}
			return true, false
		}
	}
	return false, false
}
