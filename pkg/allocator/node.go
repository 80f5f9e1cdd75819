package allocator

import (
	"cmp"
	"fmt"
	"slices"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

// nodeDevice is one device that is accessible from the node.
type nodeDevice struct {
	id     structured.DeviceID
	name   string // "driver/pool/device"
	driver string
	slice  *resourceapi.ResourceSlice
	// sliceIndex is the index of slice in nodeState.slices.
	sliceIndex int
	// deviceIndex is the index in slice.Spec.Devices.
	deviceIndex int
	device      *resourceapi.Device
	coords      topology.Coordinates
	// capacityFails is capacityCheckFails for a request without capacity
	// requests.
	capacityFails bool
	// uncountable: counting is not exact for a request that matches the
	// device (see exactUnits).
	uncountable bool
}

// nodeState is what Allocate knows about one node's devices.
type nodeState struct {
	node *v1.Node
	// slices is the view of the complete node: the relevant slices and all
	// other slices of their pools, unmodified.
	slices []*resourceapi.ResourceSlice
	// devices in upstream's order: driver, pool, slice name, index.
	// Shared between cycles: read-only.
	devices []nodeDevice
	// inUse[i] is true if device i has an allocation (this cycle).
	inUse []bool
	// busy[i] is true if device i is in use or consumes more of a shared
	// counter than the allocated devices of its pool leave (a whole GPU
	// beside an allocated partition of it): what the placement's quality
	// counts as taken. Feasibility is upstream's; busy is inUse (the same
	// slice) where no device consumes counters.
	busy []bool
	// incomplete names the pools ("driver/pool") that lack slices.
	incomplete []string
	// invalid maps the invalid pools ("driver/pool") to the reason.
	// Devices of incomplete and invalid pools are not in devices: upstream
	// allocates none of them, and views leave their slices as they are.
	invalid map[string]string
	// offNode lists the devices of other nodes in the
	// per-device-node-selection slices that devices come from. Upstream
	// searches every device of such a slice and evaluates a request's
	// selectors before it checks the device's node, so a selector that
	// fails at run time on one of them is upstream's error on this node
	// too (see Allocator.evaluate). Nil without such slices; never cached,
	// since such slices make the node's view uncacheable (stampOf).
	offNode []deviceRef
	// unsure lists the devices of per-device-node-selection slices whose
	// node selection upstream cannot evaluate (a node selector it fails to
	// parse). Upstream evaluates it, and reports that error, only where its
	// search selects such a device for a request; so the device is in
	// neither devices nor offNode, and a request that may match it leaves
	// the decision to upstream's own order (see Allocator.evaluate). Nil
	// without such devices; never cached, like offNode.
	unsure []deviceRef
	// dom[l][i] numbers the value of attribute l of device i among
	// domVals[l]; -1 if the device does not have it.
	dom     [][]int32
	domVals [][]string
}

// deviceRef is one device of a slice.
type deviceRef struct {
	slice *resourceapi.ResourceSlice
	// index is the index in slice.Spec.Devices.
	index int
}

// nodeStatic is the part of a nodeState that only depends on the node's
// slices; cached per node (Cache.node) and validated by stamp.
type nodeStatic struct {
	stamp []sliceStamp
	// slices are the objects devices point into.
	slices     []*resourceapi.ResourceSlice
	devices    []nodeDevice
	incomplete []string
	invalid    map[string]string
	dom        [][]int32
	domVals    [][]string
}

// sliceStamp identifies one slice of a node's view.
type sliceStamp struct {
	uid        types.UID
	generation int64
	relevant   bool
}

// numberDomains numbers the domain values of n devices for one attribute:
// ids[i] becomes the index of value(i) in vals, which grows as new values
// appear, or -1 where value(i) is empty (the device is in no domain of the
// attribute). vals may already hold values, so that numbers can be shared
// across slices. It returns the extended vals. Every domain numbering of
// this package uses it.
func numberDomains(n int, value func(i int) string, vals []string, ids []int32) []string {
	for i := range n {
		v := value(i)
		if v == "" {
			ids[i] = -1
			continue
		}
		id := slices.Index(vals, v)
		if id < 0 {
			id = len(vals)
			vals = append(vals, v)
		}
		ids[i] = int32(id)
	}
	return vals
}

// numberNodeDomains fills dom and domVals.
func (ns *nodeState) numberNodeDomains(levels int) {
	ns.dom = make([][]int32, levels)
	ns.domVals = make([][]string, levels)
	ids := make([]int32, levels*len(ns.devices))
	for l := range levels {
		ns.dom[l] = ids[l*len(ns.devices) : (l+1)*len(ns.devices)]
		ns.domVals[l] = numberDomains(len(ns.devices), func(i int) string { return ns.devices[i].coords[l] }, nil, ns.dom[l])
	}
}

// gatherNode collects the node's slices and devices.
func (a *Allocator) gatherNode(node *v1.Node) (*nodeState, error) {
	ns := &nodeState{node: node}
	relevant, pools, err := a.nodeSlices(node)
	if err != nil || len(pools) == 0 {
		return ns, err
	}
	// Every slice of a relevant pool travels with the view, so that upstream
	// sees the same pool (completeness, generations, counters) as it does
	// with all slices of the cluster. Pools in upstream's order.
	slices.SortFunc(pools, func(x, y poolKey) int {
		return cmp.Or(cmp.Compare(x.driver, y.driver), cmp.Compare(x.pool, y.pool))
	})
	for _, key := range pools {
		ns.slices = append(ns.slices, a.byPool[key]...) // sorted by name in New
	}
	stamp, cacheable := stampOf(ns.slices, relevant)
	key := nodeKey{name: node.Name, attrsKey: a.attrsKey, features: a.features}
	if cacheable && a.fromCache(ns, key, stamp) {
		ns.fillInUse(a)
		return ns, nil
	}
	a.buildDevices(ns, relevant, pools)
	if cacheable {
		a.cache.storeNode(key, &nodeStatic{stamp: stamp, slices: slices.Clone(ns.slices),
			devices: ns.devices, incomplete: ns.incomplete, invalid: ns.invalid, dom: ns.dom, domVals: ns.domVals})
	}
	ns.fillInUse(a)
	return ns, nil
}

// nodeSlices returns the slices that publish devices for the node and
// their pools, in no particular order. Other nodes' pools are not among
// them, not even for upstream's stable allocator, which also reads their
// counter-set slices: an All request fails there while such a pool is
// incomplete, and not here (a known difference, see docs/scheduler.md).
// For the stable allocator, a counter-set slice whose node selector cannot
// be parsed selects every node, as upstream reads it everywhere.
func (a *Allocator) nodeSlices(node *v1.Node) (relevant []*resourceapi.ResourceSlice, pools []poolKey, err error) {
	// Few slices per node: small slices beat maps here.
	add := func(slice *resourceapi.ResourceSlice) {
		relevant = append(relevant, slice)
		key := poolKey{slice.Spec.Driver, slice.Spec.Pool.Name}
		if !slices.Contains(pools, key) {
			pools = append(pools, key)
		}
	}
	for _, slice := range a.byNode[node.Name] {
		add(slice)
	}
	for _, slice := range a.shared {
		if a.ignoredSlice(slice) {
			// Upstream skips it before node selection, which then cannot
			// fail.
			continue
		}
		switch {
		case ptr.Deref(slice.Spec.AllNodes, false) || slice.Spec.NodeSelector != nil:
			match, err := structured.NodeMatches(a.features, node, "", ptr.Deref(slice.Spec.AllNodes, false), slice.Spec.NodeSelector)
			if err != nil && a.stableVariant && len(slice.Spec.SharedCounters) > 0 {
				// The stable allocator reads counter sets on every node
				// without node selection, which cannot fail there.
				match, err = true, nil
			}
			if err != nil {
				return nil, nil, fmt.Errorf("node selection of slice %s: %w", slice.Name, err)
			}
			if match {
				add(slice)
			}
		case ptr.Deref(slice.Spec.PerDeviceNodeSelection, false):
			for i := range slice.Spec.Devices {
				d := &slice.Spec.Devices[i]
				match, err := structured.NodeMatches(a.features, node, ptr.Deref(d.NodeName, ""), ptr.Deref(d.AllNodes, false), d.NodeSelector)
				if err != nil {
					return nil, nil, fmt.Errorf("node selection of device %s in slice %s: %w", d.Name, slice.Name, err)
				}
				if match {
					add(slice)
					break
				}
			}
		}
	}
	return relevant, pools, nil
}

// fromCache fills ns's devices and domains from the cache when its entry
// matches stamp.
func (a *Allocator) fromCache(ns *nodeState, key nodeKey, stamp []sliceStamp) bool {
	st := a.cache.node(key)
	if st == nil || !slices.Equal(st.stamp, stamp) {
		return false
	}
	ns.incomplete, ns.invalid, ns.dom, ns.domVals = st.incomplete, st.invalid, st.dom, st.domVals
	if slices.Equal(st.slices, ns.slices) {
		// The very same objects: the cached devices point at them
		// already (read-only, shared).
		ns.devices = st.devices
		return true
	}
	// Point at the current objects: equal UID and generation mean an equal
	// spec, except for taints that the DRA manager patches in from
	// DeviceTaintRules.
	ns.devices = slices.Clone(st.devices)
	for i := range ns.devices {
		d := &ns.devices[i]
		d.slice = ns.slices[d.sliceIndex]
		d.device = &d.slice.Spec.Devices[d.deviceIndex]
	}
	// Later cycles with these objects take the path above.
	a.cache.storeNode(key, &nodeStatic{stamp: st.stamp, slices: slices.Clone(ns.slices),
		devices: ns.devices, incomplete: st.incomplete, invalid: st.invalid, dom: st.dom, domVals: st.domVals})
	return true
}

// stampOf identifies the node's view; it is not cacheable when a slice has
// no UID or selects nodes per device (that depends on the node's labels).
func stampOf(view, relevant []*resourceapi.ResourceSlice) ([]sliceStamp, bool) {
	stamp := make([]sliceStamp, len(view))
	for i, slice := range view {
		if slice.UID == "" || ptr.Deref(slice.Spec.PerDeviceNodeSelection, false) {
			return nil, false
		}
		stamp[i] = sliceStamp{uid: slice.UID, generation: slice.Generation, relevant: slices.Contains(relevant, slice)}
	}
	return stamp, true
}

// fillInUse records which devices have an allocation in this cycle, and
// which are busy (see nodeState.busy).
func (ns *nodeState) fillInUse(a *Allocator) {
	ns.inUse = make([]bool, len(ns.devices))
	counters := false
	for i := range ns.devices {
		ns.inUse[i] = a.deviceInUse(ns.devices[i].id)
		counters = counters || len(ns.devices[i].device.ConsumesCounters) > 0
	}
	ns.busy = ns.inUse
	if counters {
		ns.busy = ns.blockedByCounters()
	}
}

// blockedByCounters returns inUse with, in addition, the devices that
// consume more of a counter than its counter set (in the slices of the
// newest generation of the device's pool) has left after the allocated
// devices of the pool.
// Counters that no set declares block nothing (upstream finds such pools
// invalid).
func (ns *nodeState) blockedByCounters() []bool {
	newest := map[poolKey]int64{}
	for _, s := range ns.slices {
		k := poolKey{s.Spec.Driver, s.Spec.Pool.Name}
		newest[k] = max(newest[k], s.Spec.Pool.Generation)
	}
	left := declaredCounters(ns.slices, func(s *resourceapi.ResourceSlice) bool {
		return s.Spec.Pool.Generation == newest[poolKey{s.Spec.Driver, s.Spec.Pool.Name}]
	})
	for i := range ns.devices {
		if d := &ns.devices[i]; ns.inUse[i] {
			left.consume(d.driver, d.slice.Spec.Pool.Name, d.device)
		}
	}
	busy := slices.Clone(ns.inUse)
	for i := range ns.devices {
		if d := &ns.devices[i]; !busy[i] && left.exceeded(d.driver, d.slice.Spec.Pool.Name, d.device) {
			busy[i] = true
		}
	}
	return busy
}

// countersLeft is what is left of each counter set of some pools, by
// driver, pool and set name, then counter name.
type countersLeft map[counterSetKey]map[string]resource.Quantity

type counterSetKey struct{ driver, pool, set string }

// declaredCounters returns the counter sets that the slices for which
// counted is true declare, each at its full value.
func declaredCounters(slices []*resourceapi.ResourceSlice, counted func(*resourceapi.ResourceSlice) bool) countersLeft {
	left := countersLeft{}
	for _, s := range slices {
		if len(s.Spec.SharedCounters) == 0 || !counted(s) {
			continue
		}
		for _, cs := range s.Spec.SharedCounters {
			m := make(map[string]resource.Quantity, len(cs.Counters))
			for name, c := range cs.Counters {
				m[name] = c.Value.DeepCopy()
			}
			left[counterSetKey{s.Spec.Driver, s.Spec.Pool.Name, cs.Name}] = m
		}
	}
	return left
}

// consume takes what device d of a pool consumes from the counters left.
func (left countersLeft) consume(driver, pool string, d *resourceapi.Device) {
	for _, cc := range d.ConsumesCounters {
		m := left[counterSetKey{driver, pool, cc.CounterSet}]
		for name, c := range cc.Counters {
			if q, ok := m[name]; ok {
				q.Sub(c.Value)
				m[name] = q
			}
		}
	}
}

// exceeded reports whether device d of a pool consumes more of some
// counter than is left.
func (left countersLeft) exceeded(driver, pool string, d *resourceapi.Device) bool {
	for _, cc := range d.ConsumesCounters {
		m := left[counterSetKey{driver, pool, cc.CounterSet}]
		for name, c := range cc.Counters {
			if q, ok := m[name]; ok && c.Value.Cmp(q) > 0 {
				return true
			}
		}
	}
	return false
}

// deviceInUse reports whether a device has a committed or in-flight allocation.
func (a *Allocator) deviceInUse(id structured.DeviceID) bool {
	if len(a.inUse) > 0 && a.inUse.Has(id) || a.taken.Has(id) {
		return true
	}
	return a.state.AllocatedDevices.Has(id) && !a.freed.Has(id)
}

// buildDevices collects the devices of the node's view that upstream may
// allocate on the node.
func (a *Allocator) buildDevices(ns *nodeState, relevant []*resourceapi.ResourceSlice, pools []poolKey) {
	n := 0
	for _, slice := range relevant {
		n += len(slice.Spec.Devices)
	}
	ns.devices = make([]nodeDevice, 0, n)
	start := 0
	for _, key := range pools {
		poolSlices := a.byPool[key]
		status := a.gatherPool(key, relevant)
		switch status.state {
		case poolIncomplete:
			ns.incomplete = append(ns.incomplete, key.driver+"/"+key.pool)
		case poolInvalid:
			if ns.invalid == nil {
				ns.invalid = map[string]string{}
			}
			ns.invalid[key.driver+"/"+key.pool] = status.reason
		case poolValid:
			for i, slice := range poolSlices {
				if !slices.Contains(relevant, slice) || slice.Spec.Pool.Generation != status.generation ||
					a.ignoredSlice(slice) || len(slice.Spec.SharedCounters) > 0 {
					// Counter sets only (or ignored without partitionable
					// devices): upstream allocates no devices from here.
					continue
				}
				a.appendSliceDevices(ns, slice, a.sliceInfo(slice), start+i)
			}
		}
		start += len(poolSlices)
	}
	ns.numberNodeDomains(len(a.policy.Attributes))
}

// appendSliceDevices appends the devices of one slice that upstream may
// allocate on the node to ns.devices, and the devices of a
// per-device-node-selection slice that upstream looks at but that belong
// to other nodes to ns.offNode, or to ns.unsure where their node selection
// fails.
func (a *Allocator) appendSliceDevices(ns *nodeState, slice *resourceapi.ResourceSlice, info *sliceInfo, sliceIndex int) {
	perDevice := ptr.Deref(slice.Spec.PerDeviceNodeSelection, false)
	for j := range slice.Spec.Devices {
		d := &slice.Spec.Devices[j]
		if !a.features.DeviceBindingAndStatus && len(d.BindingConditions) > 0 {
			// Upstream skips it before any selector.
			continue
		}
		if perDevice {
			match, err := structured.NodeMatches(a.features, ns.node, ptr.Deref(d.NodeName, ""), ptr.Deref(d.AllNodes, false), d.NodeSelector)
			if err != nil {
				ns.unsure = append(ns.unsure, deviceRef{slice: slice, index: j})
				continue
			}
			if !match {
				ns.offNode = append(ns.offNode, deviceRef{slice: slice, index: j})
				continue
			}
		}
		ns.devices = append(ns.devices, nodeDevice{
			id:          info.ids[j],
			name:        info.names[j],
			driver:      slice.Spec.Driver,
			slice:       slice,
			sliceIndex:  sliceIndex,
			deviceIndex: j,
			device:      d,
			coords:      info.coords[j],
			// Computed where the node's devices are gathered, which the
			// node cache keeps.
			capacityFails: len(d.Capacity) > 0 && capacityCheckFails(nil, d.Capacity),
			uncountable:   uncountable(d),
		})
	}
}

// unsureNodeSelection reports whether the slice selects nodes per device
// and a device's node selector cannot be parsed (on any node). Upstream
// reports that error where it gets to the device before a device of the
// node, in the slice's order: views of such a slice must not move the
// device forward (nodeState.unsure).
func (a *Allocator) unsureNodeSelection(slice *resourceapi.ResourceSlice) bool {
	if !ptr.Deref(slice.Spec.PerDeviceNodeSelection, false) {
		return false
	}
	for j := range slice.Spec.Devices {
		d := &slice.Spec.Devices[j]
		if d.NodeSelector == nil || ptr.Deref(d.NodeName, "") != "" || ptr.Deref(d.AllNodes, false) {
			continue
		}
		if _, err := structured.NodeMatches(a.features, &v1.Node{}, "", false, d.NodeSelector); err != nil {
			return true
		}
	}
	return false
}

// isUnsure reports whether device j of slice is in ns.unsure.
func (ns *nodeState) isUnsure(slice *resourceapi.ResourceSlice, j int) bool {
	for _, r := range ns.unsure {
		if r.slice == slice && r.index == j {
			return true
		}
	}
	return false
}

// sliceInfo returns the per-device data of a slice for the policy's
// attributes, from the cache when the slice can be cached.
func (a *Allocator) sliceInfo(slice *resourceapi.ResourceSlice) *sliceInfo {
	memo := a.cache.forSlice(slice.UID, slice.Generation, a.features.ListTypeAttributes)
	if memo != nil {
		if info, ok := memo.infos.Load(a.attrsKey); ok {
			return info.(*sliceInfo)
		}
	}
	info := &sliceInfo{}
	n := len(slice.Spec.Devices)
	info.ids = make([]structured.DeviceID, n)
	info.names = make([]string, n)
	info.coords = make([]topology.Coordinates, n)
	for j := range slice.Spec.Devices {
		d := &slice.Spec.Devices[j]
		info.ids[j] = structured.MakeDeviceID(slice.Spec.Driver, slice.Spec.Pool.Name, d.Name)
		info.names[j] = slice.Spec.Driver + "/" + slice.Spec.Pool.Name + "/" + d.Name
		info.coords[j] = topology.DeviceCoordinates(slice.Spec.Driver, d, a.policy.Attributes)
	}
	levels := len(a.policy.Attributes)
	info.dom = make([][]int32, levels)
	info.domVals = make([][]string, levels)
	for l := range levels {
		info.dom[l] = make([]int32, n)
		info.domVals[l] = numberDomains(n, func(j int) string { return info.coords[j][l] }, nil, info.dom[l])
	}
	if memo != nil {
		memo.infos.Store(a.attrsKey, info)
	}
	return info
}

// lookup returns the node device index of a result entry, or -1.
func (ns *nodeState) lookup(r *resourceapi.DeviceRequestAllocationResult) int {
	for i := range ns.devices {
		d := &ns.devices[i]
		if d.device.Name == r.Device && d.slice.Spec.Pool.Name == r.Pool && d.driver == r.Driver {
			return i
		}
	}
	return -1
}

// claimDevices lists the node device indices allocated to the given claims.
func (ns *nodeState) claimDevices(results []resourceapi.AllocationResult, claims []int) []int {
	var devs []int
	for _, ci := range claims {
		for k := range results[ci].Devices.Results {
			if i := ns.lookup(&results[ci].Devices.Results[k]); i >= 0 {
				devs = append(devs, i)
			}
		}
	}
	return devs
}

// addResult appends device i to an allocation result for request.
func (ns *nodeState) addResult(res *resourceapi.AllocationResult, request string, i int) {
	d := &ns.devices[i]
	res.Devices.Results = append(res.Devices.Results, resourceapi.DeviceRequestAllocationResult{
		Request: request,
		Driver:  d.driver,
		Pool:    d.slice.Spec.Pool.Name,
		Device:  d.device.Name,
	})
}

// sharedLevel returns the first level at which all devs share one value,
// and that value; len(Attributes) if none.
func (a *Allocator) sharedLevel(ns *nodeState, devs []int) (int, string) {
	for l := range a.policy.Attributes {
		if v, ok := sharedValue(ns, l, devs); ok {
			return l, v
		}
	}
	return len(a.policy.Attributes), ""
}

// sharedValue returns the value of attribute level that all devs have, if
// there is one.
func sharedValue(ns *nodeState, level int, devs []int) (string, bool) {
	if len(devs) == 0 {
		return "", false
	}
	v := ns.devices[devs[0]].coords[level]
	if v == "" {
		return "", false
	}
	for _, i := range devs[1:] {
		if ns.devices[i].coords[level] != v {
			return "", false
		}
	}
	return v, true
}
