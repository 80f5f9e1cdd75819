package topologydra

import (
	"context"
	"encoding/json"
	"iter"
	"strconv"
	"sync"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/dynamic-resource-allocation/api"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

// freedDevices answers, for one event that gave devices back, which
// devices are free on the nodes that the devices given back can be used
// on (see freedSites). It serves the queueing hint of every pending pod
// for that event: the queue asks the hints of its pods one after another,
// so the counts are kept for the last event only. Safe for concurrent use.
type freedDevices struct {
	mu sync.Mutex
	// key identifies the event: the claim and its resourceVersion.
	key   freedKey
	sites *freedSites
	// cluster counts, per driver, the node-local devices of the cluster
	// and how many are free, counted as free is; nodes counts them per
	// node (for the headroom).
	cluster map[string]driverDevices
	nodes   map[deviceGroup]driverDevices
	// gave counts the devices the event's claim gave back, per group.
	gave map[deviceGroup]int
	// restricted says, as of the last count, whether some node with
	// devices counted for the headroom is closed to pods that do not
	// tolerate it: cordoned, or with a NoSchedule or NoExecute taint.
	restricted bool
	// countLater, where set, counts cluster, nodes and restricted for
	// the event counted last: only a pod that the headroom may hold back
	// needs them (see nodeCountsLocked), and counting every node's
	// devices is most of an event's cost on a large cluster.
	countLater func()
	// consumableCapacity is the scheduler's DRAConsumableCapacity: with
	// it, shares of a device do not take the device (takesDevice).
	consumableCapacity bool
	// freedBy holds the devices given back by earlier events, with the
	// claim that gave each back: the claim tracker is fed by its own
	// event handler, so when several claims on one node give devices back
	// at once it may not have seen the earlier ones yet. A device counts
	// as free while the tracker still shows that claim holding it, at
	// the version that gave it back or an older one; an entry goes once
	// an event finds the tracker showing that claim no longer holding it
	// (given back, deleted, or holding it at a newer version: allocated
	// the same device again), or its pool unpublished, so there are never
	// more entries than published devices.
	freedBy map[structured.DeviceID]release
	// byReach holds, for the event counted last, the counts of the nodes
	// that pods with the same node affinity and tolerations may use
	// (reachKey): the pods waiting for a node mostly have the same, and
	// judging every node for each of them on every event that gives
	// devices back is the hint's largest cost on a large cluster.
	byReach map[string]reachCounts
}

// reachCounts are driverCounts and spareGained of one reachKey.
type reachCounts struct {
	counts map[string]driverDevices
	gained map[string]int
}

// reachKey identifies what decides which nodes a pod may use
// (podMayUseNode): its node selector, its required node affinity and its
// tolerations. Pods with equal keys may use the same nodes.
func reachKey(pod *v1.Pod) (string, error) {
	var required *v1.NodeSelector
	if a := pod.Spec.Affinity; a != nil && a.NodeAffinity != nil {
		required = a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution
	}
	key, err := json.Marshal(struct {
		Selector    map[string]string `json:"s,omitempty"`
		Required    *v1.NodeSelector  `json:"r,omitempty"`
		Tolerations []v1.Toleration   `json:"t,omitempty"`
	}{pod.Spec.NodeSelector, required, pod.Spec.Tolerations})
	return string(key), err
}

// reachCounts returns driverCounts and spareGained with mayUse, computing
// them once per event for pods of one reach key.
func (f *freedDevices) reachCounts(key string, mayUse func(node string) bool) (map[string]driverDevices, map[string]int) {
	f.mu.Lock()
	event := f.key
	c, ok := f.byReach[key]
	f.mu.Unlock()
	if ok {
		return c.counts, c.gained
	}
	c = reachCounts{counts: f.driverCounts(mayUse), gained: f.spareGained(mayUse)}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.key != event {
		// Another event was counted meanwhile: its pods count again.
		return c.counts, c.gained
	}
	if f.byReach == nil {
		f.byReach = map[string]reachCounts{}
	}
	f.byReach[key] = c
	return c.counts, c.gained
}

// release is the claim that gave a device back, and the resourceVersion
// of that claim that still held it.
type release struct {
	namespace, name string
	uid             types.UID
	version         string
}

// heldBy reports whether claim, as the claim tracker shows it, is the
// claim that gave the device back, not yet seen giving it back: the same
// claim at the version that gave it back or an older one. A version that
// is not a decimal number (the API server's are) counts as not newer.
func (r release) heldBy(claim *resourceapi.ResourceClaim) bool {
	if claim.UID != r.uid {
		return false
	}
	seen, err1 := strconv.ParseUint(claim.ResourceVersion, 10, 64)
	released, err2 := strconv.ParseUint(r.version, 10, 64)
	return err1 != nil || err2 != nil || seen <= released
}

type freedKey struct {
	uid             types.UID
	resourceVersion string
}

// poolKey names a resource pool of one driver.
type poolKey struct{ driver, pool string }

// deviceGroup names the devices of one driver on one node (node set), or
// in one pool for devices that are not local to a node.
type deviceGroup struct{ driver, node, pool string }

func groupOf(slice *resourceapi.ResourceSlice) deviceGroup {
	if slice.Spec.NodeName != nil && *slice.Spec.NodeName != "" {
		return deviceGroup{driver: slice.Spec.Driver, node: *slice.Spec.NodeName}
	}
	return deviceGroup{driver: slice.Spec.Driver, pool: slice.Spec.Pool.Name}
}

// freedSites holds, for one event, the nodes that the devices given back
// can be used on, with the free devices each of them can use: those of
// its own pools and those of the pools not local to a node that admit it
// (allNodes, a node selector, or per device), of every driver. Read-only
// once built; safe for concurrent use.
type freedSites struct {
	sites []freedSite
	// local holds the free devices of each site's own pools.
	local map[string][]freeDevice
	// shared holds the free devices of the pools not local to a node, by
	// the nodes they are for.
	shared []sharedDevices
	// sharedGiven: the claim gave back devices of a pool not local to a
	// node.
	sharedGiven bool
}

// freedSite is a node that devices given back can be used on. total
// counts the free devices it can use, of every driver; own counts those
// of the driver of the claim's devices that has most of them there.
type freedSite struct {
	node       string
	total, own int
	// shared indexes the entries of freedSites.shared that admit the node.
	shared []int
}

// freeDevice is a free device, for matching a pod's selectors: the
// device at index of slice.
type freeDevice struct {
	slice *resourceapi.ResourceSlice
	index int
}

// sharedDevices are free devices that the same nodes can use.
type sharedDevices struct {
	reach   nodeReach
	devices []freeDevice
}

// nodeReach is the node selection of a slice, or of a device in a slice
// with perDeviceNodeSelection: a node name, all nodes, or a node selector
// (parsed; nil where it does not parse).
type nodeReach struct {
	nodeName string
	allNodes bool
	selector *nodeaffinity.NodeSelector
	// invalid: the node selector did not parse.
	invalid bool
}

func reachOf(nodeName *string, allNodes *bool, selector *v1.NodeSelector) nodeReach {
	r := nodeReach{nodeName: ptr.Deref(nodeName, ""), allNodes: ptr.Deref(allNodes, false)}
	if selector != nil {
		sel, err := nodeaffinity.NewNodeSelector(selector)
		r.selector, r.invalid = sel, err != nil
	}
	return r
}

// admits reports whether the devices reach the named node (node is its
// object, nil where not known). A node selector that does not parse, or
// a node that is not known, counts as admitted: the hint errs towards a
// retry.
func (r nodeReach) admits(name string, node *v1.Node) bool {
	switch {
	case r.nodeName != "":
		return r.nodeName == name
	case r.allNodes:
		return true
	case r.selector != nil:
		return node == nil || r.selector.Match(node)
	}
	return r.invalid
}

// smallestRequest is the fewest devices that one request of the pod's
// claims that are not allocated yet asks for: its exact count, or the
// smallest count among a firstAvailable request's subrequests. Which
// driver serves which request is not known here, so freed devices may
// help the pod as soon as they leave this many free. ok is false when it
// cannot say (a claim is not there yet, all its claims are allocated, or
// a request asks for all matching devices or is of a kind it does not know).
func (pl *TopologyDRA) smallestRequest(pod *v1.Pod) (need int, ok bool) {
	claims, err := pl.podClaims(pod)
	if err != nil {
		return 0, false
	}
	need = -1
	for alt := range unallocatedRequests(claims) {
		if alt.all || alt.unknown {
			return 0, false
		}
		if need < 0 || int(alt.count) < need {
			need = int(alt.count)
		}
	}
	return need, need >= 0
}

// freedEnough reports whether the devices that claim gave back (its
// allocation before the event) can let pod fit: whether, on a node that
// the claim's devices can be used on (the node of a node-local pool;
// every node that a pool not local to a node admits) and that the pod's
// required node affinity (node selector and required terms) admits,
// enough devices are now free for one of the pod's requests. The devices
// counted for a node are all those it can use: its own pools' and those
// of the pools not local to a node that admit it, of every driver. Enough
// means: as many devices of one driver of the claim's devices as the
// pod's smallest request asks for (see smallestRequest; which driver
// serves which request is not known here, so the pod is taken to match
// them), or else as many devices, of any driver, that one of the pod's
// requests matches (class and selectors, through the CEL cache) as it
// asks for: one request may take devices of several pools and drivers.
// Free means published and not allocated; devices given back by this or
// an earlier event count as free while the claim tracker still shows the
// claim that gave them back holding them (it has not seen that event
// yet). A claim that held a share of a device (consumable capacity)
// always says yes. In-flight allocations, taints and shared counters are
// not subtracted, and a selector that fails at run time counts as
// matching, so the answer errs towards yes. It also says yes whenever it
// cannot tell. Where smallPodHeadroomPercent keeps devices
// free against the pod (its unallocated claims ask for half a node or
// more devices of one class in all, as PreFilter counts them; see
// headroomWait), it says no while fewer would
// stay free than the headroom, and yes when this event brings the nodes
// the pod may use up to it, or whenever they keep it with the pod placed
// if the headroom held the pod back at its latest attempt (heldBack): the
// node the pod fits on may be another one.
//
// Without it every pod that waits for devices is retried, and fails
// again, whenever any claim is deallocated anywhere; each failure renews
// the pod's place at the back of the queue and its backoff. A pod that
// needs many devices fails on nearly every such event, so when a node
// finally frees up for it, smaller pods that failed less recently are
// tried first and take the devices.
func (pl *TopologyDRA) freedEnough(logger klog.Logger, pod *v1.Pod, claim *resourceapi.ResourceClaim) bool {
	if claim.Status.Allocation == nil || len(claim.Status.Allocation.Devices.Results) == 0 {
		return true
	}
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.ShareID != nil || len(r.ConsumedCapacity) > 0 {
			// A share of a device that allows multiple allocations: it
			// gives capacity back, which counting free devices does not
			// see (other claims may still hold shares of the device).
			return true
		}
	}
	need, ok := pl.smallestRequest(pod)
	if !ok {
		return true
	}
	fs, ok := pl.freed.count(pl, claim)
	if !ok {
		return true
	}
	if nominated := pod.Status.NominatedNodeName; nominated != "" {
		// A preemptor waits for its victims' devices on the node it is
		// nominated to: their release is what it waits for, whatever
		// the counts below say (its trial judged the node). Only its
		// status says so here: hints run under the scheduling queue's
		// lock, which reading the scheduler's record of nominations
		// (NominatedPodsForNode) takes too.
		for _, site := range fs.sites {
			if site.node == nominated {
				return true
			}
		}
	}
	// A pod whose headroom Filter counted over only the devices its
	// requests match (heldBack.narrowed), which the counts per driver
	// here do not tell apart: devices of its own pools given back on
	// nodes where its requests match none change nothing for it;
	// elsewhere a pod the headroom held back is retried, any other as a
	// pod without a headroom. barren speaks of node-local devices only:
	// where the claim gave back devices of a pool not local to a node,
	// no node is barren.
	barren, narrow := pl.heldBack.narrowed(pod.UID)
	if fs.sharedGiven {
		barren = nil
	}
	switch {
	case narrow && pl.heldBack.held(pod.UID):
		for _, site := range fs.sites {
			if !barren.Has(site.node) {
				return true
			}
		}
		return false
	case !narrow && pl.headroomPercent > 0 && !pl.heldBack.outranks(pod.UID):
		// The headroom is Filter's where the pod's unallocated claims ask
		// for half a node or more devices of one class (summed over their
		// requests, as PreFilter counts them), however small each
		// request is, unless the pod may preempt (PreFilter said so at
		// its latest attempt).
		total, _ := podDevices(pod, pl.draManager.ResourceClaims().Get, true)
		if total < pl.halfNode() {
			break
		}
		switch pl.headroomWait(logger, pod, claim, total) {
		case headroomShort:
			return false
		case headroomRetry:
			return true
		}
	}
	affinity := nodeaffinity.GetRequiredNodeAffinity(pod)
	for i := range fs.sites {
		site := &fs.sites[i]
		if site.total < need || barren.Has(site.node) || !pl.mayUse(logger, pod, affinity, site.node) {
			continue
		}
		if site.own >= need || pl.requestMet(logger, pod, fs, site) {
			return true
		}
	}
	return false
}

// requestMet reports whether the free devices that site can use make up
// one of the pod's requests (of its claims that are not allocated yet):
// as many of them match the request's class and selectors (one
// subrequest's, for a firstAvailable request) as it asks for. It says
// yes whenever it cannot tell (a claim or class not there, a selector
// that does not compile, a request with admin access, which may use
// allocated devices).
func (pl *TopologyDRA) requestMet(logger klog.Logger, pod *v1.Pod, fs *freedSites, site *freedSite) bool {
	claims, err := pl.podClaims(pod)
	if err != nil {
		return true
	}
	ctx := klog.NewContext(context.Background(), logger)
	met := func(className string, selectors []resourceapi.DeviceSelector, count int64, admin bool) bool {
		if admin {
			return true
		}
		class, err := pl.draManager.DeviceClasses().Get(className)
		if err != nil {
			return true
		}
		var exprs []cel.CompilationResult
		for _, list := range [][]resourceapi.DeviceSelector{class.Spec.Selectors, selectors} {
			for _, sel := range list {
				if sel.CEL == nil {
					continue
				}
				expr := pl.celCache.GetOrCompile(sel.CEL.Expression)
				if expr.Error != nil {
					return true
				}
				exprs = append(exprs, expr)
			}
		}
		n := int64(0)
		for d := range fs.devices(site) {
			if pl.cache.SelectorsMatch(ctx, d.slice, d.index, pl.features.ListTypeAttributes, exprs) {
				if n++; n >= count {
					return true
				}
			}
		}
		return false
	}
	for alt := range unallocatedRequests(claims) {
		if alt.unknown || met(alt.className, alt.selectors, alt.count, alt.admin) {
			return true
		}
	}
	return false
}

// requestAlternative is a request, or one subrequest of a firstAvailable
// request, of a claim that is not allocated yet.
type requestAlternative struct {
	className string
	selectors []resourceapi.DeviceSelector
	count     int64
	// all: allocationMode All; admin: admin access; unknown: a request
	// of a kind this package does not know.
	all, admin, unknown bool
}

// unallocatedRequests yields the requests of claims that are not
// allocated yet, each subrequest of a firstAvailable request on its own.
func unallocatedRequests(claims []*resourceapi.ResourceClaim) iter.Seq[requestAlternative] {
	return func(yield func(requestAlternative) bool) {
		for _, claim := range claims {
			if claim.Status.Allocation != nil {
				continue
			}
			for _, r := range claim.Spec.Devices.Requests {
				var alts []requestAlternative
				switch {
				case r.Exactly != nil:
					alts = append(alts, requestAlternative{className: r.Exactly.DeviceClassName, selectors: r.Exactly.Selectors, count: r.Exactly.Count,
						all: r.Exactly.AllocationMode == resourceapi.DeviceAllocationModeAll, admin: ptr.Deref(r.Exactly.AdminAccess, false)})
				case len(r.FirstAvailable) > 0:
					for _, sub := range r.FirstAvailable {
						alts = append(alts, requestAlternative{className: sub.DeviceClassName, selectors: sub.Selectors, count: sub.Count,
							all: sub.AllocationMode == resourceapi.DeviceAllocationModeAll})
					}
				default:
					alts = append(alts, requestAlternative{unknown: true})
				}
				for _, alt := range alts {
					if !yield(alt) {
						return
					}
				}
			}
		}
	}
}

// devices yields the free devices that site can use.
func (fs *freedSites) devices(site *freedSite) iter.Seq[freeDevice] {
	return func(yield func(freeDevice) bool) {
		for _, d := range fs.local[site.node] {
			if !yield(d) {
				return
			}
		}
		for _, i := range site.shared {
			for _, d := range fs.shared[i].devices {
				if !yield(d) {
					return
				}
			}
		}
	}
}

// nodeKnown reports whether the node lister has the named node (true
// without a lister).
func (pl *TopologyDRA) nodeKnown(nodeName string) bool {
	if pl.nodes == nil {
		return true
	}
	_, err := pl.nodes.Get(nodeName)
	return err == nil
}

// mayUse reports whether the pod (with affinity, its required node
// affinity) may run on the named node, as Filter judges it
// (podMayUseNode): true for devices not local to a node ("") and where the
// node is not known (yet).
func (pl *TopologyDRA) mayUse(logger klog.Logger, pod *v1.Pod, affinity nodeaffinity.RequiredNodeAffinity, nodeName string) bool {
	if nodeName == "" || pl.nodes == nil {
		return true
	}
	node, err := pl.nodes.Get(nodeName)
	if err != nil {
		return true
	}
	return podMayUseNode(logger, pod, affinity, node, pl.taintOps)
}

// count returns the nodes that claim's devices can be used on, with the
// free devices each can use, computing them once per event. ok is false
// where it cannot tell: a list failed, or the claim gave back devices of
// a pool not local to a node and there is no node lister to tell which
// nodes the pool admits.
func (f *freedDevices) count(pl *TopologyDRA, claim *resourceapi.ResourceClaim) (*freedSites, bool) {
	key := freedKey{uid: claim.UID, resourceVersion: claim.ResourceVersion}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.sites != nil && f.key == key {
		return f.sites, true
	}
	if f.freedBy == nil {
		f.freedBy = map[structured.DeviceID]release{}
	}
	freedPools := map[poolKey]bool{}
	freedDrivers := map[string]bool{}
	given := map[structured.DeviceID]bool{}
	for _, r := range claim.Status.Allocation.Devices.Results {
		if !f.takesDevice(r) {
			continue
		}
		freedPools[poolKey{driver: r.Driver, pool: r.Pool}] = true
		freedDrivers[r.Driver] = true
		id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
		given[id] = true
		f.freedBy[id] = release{namespace: claim.Namespace, name: claim.Name, uid: claim.UID, version: claim.ResourceVersion}
	}
	slices, err := pl.draManager.ResourceSlices().ListWithDeviceTaintRules()
	if err != nil {
		return nil, false
	}
	allocated, err := pl.allocatedDevices()
	if err != nil {
		return nil, false
	}
	stillHeld, countFree, err := f.givenBack(pl, allocated)
	if err != nil {
		return nil, false
	}
	// The groups the freed devices belong to, and the newest generation
	// of every pool (only it counts).
	groupOfPool := map[poolKey]deviceGroup{}
	generation := map[poolKey]int64{}
	for _, s := range slices {
		k := poolKey{driver: s.Spec.Driver, pool: s.Spec.Pool.Name}
		generation[k] = max(generation[k], s.Spec.Pool.Generation)
		if freedPools[k] {
			groupOfPool[k] = groupOf(s)
		}
	}
	gave := map[deviceGroup]int{}
	for _, r := range claim.Status.Allocation.Devices.Results {
		if !f.takesDevice(r) {
			continue
		}
		if g, ok := groupOfPool[poolKey{driver: r.Driver, pool: r.Pool}]; ok {
			gave[g]++
		}
	}
	// The sites: the nodes of the node-local pools the claim held devices
	// of, and every node that a pool not local to a node admits, where the
	// claim held devices of such a pool.
	siteNodes := map[string]bool{}
	var givenReach []nodeReach
	for _, s := range slices {
		k := poolKey{driver: s.Spec.Driver, pool: s.Spec.Pool.Name}
		g, freed := groupOfPool[k]
		switch {
		case !freed || s.Spec.Pool.Generation != generation[k]:
		case g.node != "":
			siteNodes[g.node] = true
		case !ptr.Deref(s.Spec.PerDeviceNodeSelection, false):
			givenReach = append(givenReach, reachOf(s.Spec.NodeName, s.Spec.AllNodes, s.Spec.NodeSelector))
		default:
			for _, d := range s.Spec.Devices {
				if given[structured.MakeDeviceID(k.driver, k.pool, d.Name)] {
					givenReach = append(givenReach, reachOf(d.NodeName, d.AllNodes, d.NodeSelector))
				}
			}
		}
	}
	sharedGiven := len(givenReach) > 0
	if sharedGiven {
		if pl.nodes == nil {
			return nil, false
		}
		all, err := pl.nodes.List(labels.Everything())
		if err != nil {
			return nil, false
		}
		for _, node := range all {
			for _, r := range givenReach {
				if r.admits(node.Name, node) {
					siteNodes[node.Name] = true
					break
				}
			}
		}
	}
	// The pools counted: the sites' own pools, of every driver, and the
	// pools not local to a node. So the cost per event follows the nodes
	// the claim held devices on, not the cluster, apart from one pass over
	// the slices and the claims (and a pass over the nodes where a pool
	// not local to a node gave devices back).
	pools := map[poolKey]bool{}
	for _, s := range slices {
		g := groupOf(s)
		if g.node == "" || siteNodes[g.node] {
			pools[poolKey{driver: s.Spec.Driver, pool: s.Spec.Pool.Name}] = true
		}
	}
	for id := range f.freedBy {
		k := poolKey{driver: id.Driver.String(), pool: id.Pool.String()}
		if _, published := generation[k]; !published {
			delete(f.freedBy, id) // its pool is gone: nothing to count
			continue
		}
		if !stillHeld[id] {
			delete(f.freedBy, id) // seen free, or taken again
		}
	}
	fs := &freedSites{local: map[string][]freeDevice{}, sharedGiven: sharedGiven}
	for _, s := range slices {
		k := poolKey{driver: s.Spec.Driver, pool: s.Spec.Pool.Name}
		if !pools[k] || s.Spec.Pool.Generation != generation[k] {
			continue
		}
		g := groupOf(s)
		perDevice := g.node == "" && ptr.Deref(s.Spec.PerDeviceNodeSelection, false)
		var free []freeDevice
		for i := range s.Spec.Devices {
			d := &s.Spec.Devices[i]
			if id := structured.MakeDeviceID(k.driver, k.pool, d.Name); allocated.Has(id) && !countFree[id] {
				continue
			}
			fd := freeDevice{slice: s, index: i}
			if perDevice {
				fs.shared = append(fs.shared, sharedDevices{reach: reachOf(d.NodeName, d.AllNodes, d.NodeSelector), devices: []freeDevice{fd}})
				continue
			}
			free = append(free, fd)
		}
		switch {
		case len(free) == 0:
		case g.node != "":
			fs.local[g.node] = append(fs.local[g.node], free...)
		default:
			fs.shared = append(fs.shared, sharedDevices{reach: reachOf(s.Spec.NodeName, s.Spec.AllNodes, s.Spec.NodeSelector), devices: free})
		}
	}
	for name := range siteNodes {
		site := freedSite{node: name}
		var node *v1.Node
		if pl.nodes != nil {
			node, _ = pl.nodes.Get(name)
		}
		for i, sd := range fs.shared {
			if sd.reach.admits(name, node) {
				site.shared = append(site.shared, i)
			}
		}
		perDriver := map[string]int{}
		for d := range fs.devices(&site) {
			perDriver[d.slice.Spec.Driver]++
			site.total++
		}
		for driver := range freedDrivers {
			site.own = max(site.own, perDriver[driver])
		}
		fs.sites = append(fs.sites, site)
	}
	// Every node's devices of each driver, and how many are free, for the
	// headroom: counted when a pod first asks for them.
	f.key, f.sites, f.cluster, f.nodes, f.gave, f.restricted = key, fs, nil, nil, gave, false
	f.countLater = nil
	if pl.headroomPercent > 0 {
		f.countLater = func() {
			f.nodes, f.cluster = f.countNodes(slices, allocated, countFree, generation, pl.nodeKnown)
			f.restricted = pl.anyRestricted(f.nodes)
		}
	}
	f.byReach = nil
	return fs, true
}

// allocatedDevices returns the devices that claims take from others, as
// the claim tracker counts them (in the informer's claims and the
// allocations in flight; as takesDevice judges results). The tracker keeps
// that set as claims change, so that this costs a copy of it, not a pass
// over every claim. It retries a few times while claims change during
// the copy.
func (pl *TopologyDRA) allocatedDevices() (sets.Set[structured.DeviceID], error) {
	var err error
	for range 3 {
		var allocated sets.Set[structured.DeviceID]
		if allocated, err = pl.draManager.ResourceClaims().ListAllAllocatedDevices(); err == nil {
			if pl.holders != nil {
				pl.holders.restore(allocated, pl.draManager.ResourceClaims().Get)
			}
			return allocated, nil
		}
	}
	return nil, err
}

// givenBack sorts the devices of freedBy: stillHeld holds those that the
// claim tracker still shows held by the claim that gave them back, at the
// version that gave them back or an older one (see release.heldBy); free
// holds those that count as free although allocated has them: stillHeld,
// and those that allocated has only because it has not caught up with
// the tracker's claims yet (it is fed by the tracker's event handler):
// no claim the tracker shows holds them. Only where allocated has a
// device whose claim shows it given back does this list the claims.
// Caller holds f.mu.
func (f *freedDevices) givenBack(pl *TopologyDRA, allocated sets.Set[structured.DeviceID]) (stillHeld, free map[structured.DeviceID]bool, err error) {
	stillHeld = map[structured.DeviceID]bool{}
	free = map[structured.DeviceID]bool{}
	type claimRef struct{ namespace, name string }
	shown := map[claimRef]*resourceapi.ResourceClaim{}
	var unsure []structured.DeviceID
	for id, rel := range f.freedBy {
		ref := claimRef{rel.namespace, rel.name}
		c, ok := shown[ref]
		if !ok {
			c, _ = pl.draManager.ResourceClaims().Get(rel.namespace, rel.name)
			shown[ref] = c
		}
		if c != nil && rel.heldBy(c) && f.holds(c, id) {
			stillHeld[id] = true
			free[id] = true
			continue
		}
		if allocated.Has(id) {
			unsure = append(unsure, id)
		}
	}
	if len(unsure) == 0 {
		return stillHeld, free, nil
	}
	claims, err := pl.draManager.ResourceClaims().List()
	if err != nil {
		return nil, nil, err
	}
	// Only the results of the unsure devices' pools are looked at.
	type deviceKey struct{ driver, pool, device string }
	unsurePools := map[poolKey]bool{}
	for _, id := range unsure {
		unsurePools[poolKey{driver: id.Driver.String(), pool: id.Pool.String()}] = true
	}
	held := map[deviceKey]bool{}
	for _, c := range claims {
		if c.Status.Allocation == nil {
			continue
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			if unsurePools[poolKey{driver: r.Driver, pool: r.Pool}] && f.takesDevice(r) {
				held[deviceKey{r.Driver, r.Pool, r.Device}] = true
			}
		}
	}
	for _, id := range unsure {
		if !held[deviceKey{id.Driver.String(), id.Pool.String(), id.Device.String()}] {
			free[id] = true
		}
	}
	return stillHeld, free, nil
}

// holds reports whether claim's allocation takes device id (see
// takesDevice).
func (f *freedDevices) holds(claim *resourceapi.ResourceClaim, id structured.DeviceID) bool {
	if claim.Status.Allocation == nil {
		return false
	}
	for _, r := range claim.Status.Allocation.Devices.Results {
		if f.takesDevice(r) && r.Device == id.Device.String() && r.Pool == id.Pool.String() && r.Driver == id.Driver.String() {
			return true
		}
	}
	return false
}

// takesDevice reports whether an allocation result takes its device from
// other claims, as the upstream allocator's state counts it (and so
// allocator.CountDevices in Filter): results with admin access do not, and
// with consumable capacity on neither does a share of a device that
// allows multiple allocations (a result with a share ID), which leaves the
// device to further shares while capacity lasts.
func (f *freedDevices) takesDevice(r resourceapi.DeviceRequestAllocationResult) bool {
	return takesDevice(r, f.consumableCapacity)
}

// takesDevice is freedDevices.takesDevice with DRAConsumableCapacity
// given.
func takesDevice(r resourceapi.DeviceRequestAllocationResult, consumableCapacity bool) bool {
	if ptr.Deref(r.AdminAccess, false) {
		return false
	}
	return !consumableCapacity || r.ShareID == nil
}

// anyRestricted reports whether a node of groups is cordoned or carries a
// NoSchedule or NoExecute taint: whether a pod may use it then depends on
// the pod's tolerations.
func (pl *TopologyDRA) anyRestricted(groups map[deviceGroup]driverDevices) bool {
	if pl.nodes == nil {
		return false
	}
	for g := range groups {
		node, err := pl.nodes.Get(g.node)
		if err != nil {
			continue
		}
		if node.Spec.Unschedulable {
			return true
		}
		for _, t := range node.Spec.Taints {
			if t.Effect == v1.TaintEffectNoSchedule || t.Effect == v1.TaintEffectNoExecute {
				return true
			}
		}
	}
	return false
}

// anyRestricted is anyRestricted of the last count.
func (f *freedDevices) anyRestricted() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.nodeCountsLocked()
	return f.restricted
}

// nodeCountsLocked counts cluster, nodes and restricted of the last event
// where they are not counted yet. Caller holds f.mu.
func (f *freedDevices) nodeCountsLocked() {
	if f.countLater != nil {
		f.countLater()
		f.countLater = nil
	}
}

// countNodes counts every known node's devices of each driver (the newest
// generation of each node-local pool; slices of nodes that are gone do not
// count, as they do not for Filter) and how many of them are free: not in
// allocated, or in free (given back, see givenBack). It sums them per
// driver. Caller holds f.mu.
func (f *freedDevices) countNodes(slices []*resourceapi.ResourceSlice, allocated sets.Set[structured.DeviceID], free map[structured.DeviceID]bool, generation map[poolKey]int64, known func(string) bool) (map[deviceGroup]driverDevices, map[string]driverDevices) {
	// Counted in a slice, one entry per node and driver, so that an
	// allocated device costs one lookup of its pool. Pools are keyed by
	// the interned names a DeviceID holds.
	type poolID struct{ driver, pool api.UniqueString }
	var groups []deviceGroup
	var counts []driverDevices
	index := make(map[deviceGroup]int, len(slices))
	poolIndex := make(map[poolID]int, len(slices))
	for _, s := range slices {
		k := poolKey{driver: s.Spec.Driver, pool: s.Spec.Pool.Name}
		if s.Spec.NodeName == nil || *s.Spec.NodeName == "" || s.Spec.Pool.Generation != generation[k] || !known(*s.Spec.NodeName) {
			continue
		}
		g := groupOf(s)
		i, ok := index[g]
		if !ok {
			i = len(groups)
			index[g] = i
			groups = append(groups, g)
			counts = append(counts, driverDevices{})
		}
		poolIndex[poolID{api.MakeUniqueString(k.driver), api.MakeUniqueString(k.pool)}] = i
		counts[i].total += len(s.Spec.Devices)
		counts[i].free += len(s.Spec.Devices)
	}
	for id := range allocated {
		i, ok := poolIndex[poolID{id.Driver, id.Pool}]
		if !ok || free[id] {
			continue
		}
		counts[i].free--
	}
	nodes := make(map[deviceGroup]driverDevices, len(groups))
	cluster := map[string]driverDevices{}
	for i, g := range groups {
		nodes[g] = counts[i]
		c := cluster[g.driver]
		c.total += counts[i].total
		c.free += counts[i].free
		c.spare += Spare(counts[i].free)
		cluster[g.driver] = c
	}
	return nodes, cluster
}

// driverCounts returns, per driver, the node-local devices and how many
// of them are free, as of the last count: of the whole cluster, or, with
// mayUse, of the nodes it accepts.
func (f *freedDevices) driverCounts(mayUse func(node string) bool) map[string]driverDevices {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.nodeCountsLocked()
	if mayUse == nil {
		return f.cluster
	}
	out := map[string]driverDevices{}
	for g, n := range f.nodes {
		if mayUse(g.node) {
			c := out[g.driver]
			c.total += n.total
			c.free += n.free
			c.spare += Spare(n.free)
			out[g.driver] = c
		}
	}
	return out
}

// spareGained returns, per driver, how much the event raised the count of
// devices free on nodes with SpareOnNode or more (see Spare), on the nodes
// mayUse accepts (all with nil), as of the last count.
func (f *freedDevices) spareGained(mayUse func(node string) bool) map[string]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.nodeCountsLocked()
	out := map[string]int{}
	for g, n := range f.gave {
		c, ok := f.nodes[g]
		if !ok || mayUse != nil && !mayUse(g.node) {
			continue
		}
		out[g.driver] += Spare(c.free) - Spare(c.free-n)
	}
	return out
}

// headroomState is what the headroom says about retrying a pod after
// devices were given back.
type headroomState int

const (
	// headroomNone: the headroom does not decide; count free devices per
	// node as for any pod.
	headroomNone headroomState = iota
	// headroomShort: fewer devices would stay free than the headroom, for
	// every driver the claim gave devices back of: the pod would fail
	// again.
	headroomShort
	// headroomRetry: this event brought the nodes the pod may use up to
	// the headroom for a driver the claim gave devices back of, or they
	// keep it and the headroom held the pod back at its latest attempt.
	headroomRetry
)

// headroomWait tells whether the headroom (HeadroomFor, with the node-local
// devices of each driver the claim gave devices back of, on the nodes the
// pod may use, see mayUse) kept a pod that asks for need
// devices waiting, before and after the event.
func (pl *TopologyDRA) headroomWait(logger klog.Logger, pod *v1.Pod, claim *resourceapi.ResourceClaim, need int) headroomState {
	// The nodes the pod may use, as Filter counts them (podMayUseNode):
	// its required node affinity, and cordons and taints where a node has
	// them.
	// Without either, every node counts (the cluster's totals).
	var counts map[string]driverDevices
	var gained map[string]int
	hasAffinity := pod.Spec.NodeSelector != nil || pod.Spec.Affinity != nil && pod.Spec.Affinity.NodeAffinity != nil
	if hasAffinity || pl.freed.anyRestricted() {
		affinity := nodeaffinity.GetRequiredNodeAffinity(pod)
		mayUse := func(node string) bool { return pl.mayUse(logger, pod, affinity, node) }
		if key, err := reachKey(pod); err == nil {
			counts, gained = pl.freed.reachCounts(key, mayUse)
		} else {
			counts, gained = pl.freed.driverCounts(mayUse), pl.freed.spareGained(mayUse)
		}
	} else {
		counts, gained = pl.freed.driverCounts(nil), pl.freed.spareGained(nil)
	}
	given := map[string]bool{}
	for _, r := range claim.Status.Allocation.Devices.Results {
		given[r.Driver] = true
	}
	// Which of the drivers serves the pod is not known here: one whose
	// headroom this event reached means a retry, whatever the others say
	// (a driver with too few devices for a headroom, such as the NICs
	// beside the GPUs, says nothing). A pod the headroom alone held back
	// at its latest attempt is retried whenever a driver's headroom is
	// kept with it placed (see heldBack).
	held := pl.heldBack.held(pod.UID)
	short, retry := 0, false
	for driver := range given {
		c := counts[driver]
		h := HeadroomFor(pl.headroomPercent, c.total, need, pl.wholeNode())
		if v := logger.V(6); v.Enabled() {
			v.Info("Headroom after devices were given back", "pod", klog.KObj(pod), "claim", klog.KObj(claim), "driver", driver,
				"devices", c.total, "free", c.free, "freeOnNodesWithRoom", c.spare, "gained", gained[driver], "needs", need, "headroom", h, "heldBack", held)
		}
		// Filter counts the devices free on nodes left with SpareOnNode
		// or more: at most c.spare-need wherever the pod goes.
		switch {
		case h == 0:
		case c.spare-need < h:
			short++
		case held || c.spare-gained[driver]-need < h:
			retry = true
		}
	}
	switch {
	case retry:
		return headroomRetry
	case short == len(given):
		return headroomShort
	}
	return headroomNone
}
