package allocator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

// Options configure an Allocator. ClassLister is required; the others have
// usable zero values.
type Options struct {
	// Features are the DRA features enabled in the scheduler; passed through
	// to the upstream allocator unchanged.
	Features structured.Features
	// AllocatedState holds the devices already allocated or in flight (from
	// SharedDRAManager().ResourceClaims().GatherAllocatedState()). Nil means
	// nothing is allocated.
	AllocatedState *structured.AllocatedState
	// ClassLister gives access to DeviceClasses.
	ClassLister structured.DeviceClassLister
	// Slices are all ResourceSlices of the cluster, as the stock plugin
	// passes them. New indexes them per node.
	Slices []*resourceapi.ResourceSlice
	// CELCache compiles selectors; nil means a private cache.
	CELCache *cel.Cache
	// Policy is the preference model. A zero Alignment means prefer, nil
	// Attributes mean the default attributes.
	Policy Policy
}

// Allocator finds the best valid allocation of a pod's claims on one node at
// a time. It is built once per scheduling cycle and is safe for concurrent
// use by many goroutines (one per node).
type Allocator struct {
	features    structured.Features
	state       structured.AllocatedState
	classLister structured.DeviceClassLister
	celCache    *cel.Cache
	policy      Policy
	listTypes   bool

	// inUse holds every device that has any committed allocation: fully
	// allocated, or shared with consumed capacity.
	inUse sets.Set[structured.DeviceID]

	// Slices indexed once: by node name, the ones without a node name
	// (node selector, all nodes, per-device selection), and by pool.
	byNode map[string][]*resourceapi.ResourceSlice
	shared []*resourceapi.ResourceSlice
	byPool map[poolKey][]*resourceapi.ResourceSlice
	// poolGen is the newest generation of each pool.
	poolGen map[poolKey]int64
	// attrsKey identifies Policy.Attributes in the slice memo.
	attrsKey string
	// static caches what Allocate derives from a claim alone
	// (*resourceapi.ResourceClaim -> *claimStatic); the claims of a pod are
	// the same objects for every node of a cycle.
	static sync.Map
	// ordered is the claim-independent best-fit view (ordered.go).
	ordered   orderedState
	numSlices int
}

type poolKey struct{ driver, pool string }

// ErrInvalidInput is wrapped by errors about claims, requests or classes that
// cannot be allocated anywhere (invalid CEL, unknown class, bad annotation).
var ErrInvalidInput = errors.New("invalid input")

// New indexes the cluster's slices and prepares allocation for one
// scheduling cycle. It only fails for missing required options.
func New(ctx context.Context, opts Options) (*Allocator, error) {
	if opts.ClassLister == nil {
		return nil, errors.New("allocator: ClassLister is required")
	}
	policy := opts.Policy
	if policy.Attributes == nil {
		policy.Attributes = slices.Clone(topology.DefaultAttributes)
	}
	if policy.Alignment == "" {
		policy.Alignment = AlignmentPrefer
	}
	if _, err := ParseAlignmentMode(string(policy.Alignment)); err != nil {
		return nil, fmt.Errorf("allocator: policy: %w", err)
	}
	celCache := opts.CELCache
	if celCache == nil {
		celCache = cel.NewCache(100, cel.Features{
			EnableConsumableCapacity: opts.Features.ConsumableCapacity,
			EnableListTypeAttributes: opts.Features.ListTypeAttributes,
		})
	}
	a := &Allocator{
		features:    opts.Features,
		classLister: opts.ClassLister,
		celCache:    celCache,
		policy:      policy,
		listTypes:   opts.Features.ListTypeAttributes,
		byNode:      map[string][]*resourceapi.ResourceSlice{},
		byPool:      map[poolKey][]*resourceapi.ResourceSlice{},
	}
	if opts.AllocatedState != nil {
		a.state = *opts.AllocatedState
	}
	a.inUse = sets.New[structured.DeviceID]()
	for id := range a.state.AllocatedSharedDeviceIDs {
		a.inUse.Insert(id.GetDeviceID())
	}
	for id := range a.state.AggregatedCapacity {
		a.inUse.Insert(id)
	}
	for _, slice := range opts.Slices {
		if slice == nil {
			continue
		}
		a.numSlices++
		if name := ptr.Deref(slice.Spec.NodeName, ""); name != "" {
			a.byNode[name] = append(a.byNode[name], slice)
		} else {
			a.shared = append(a.shared, slice)
		}
		key := poolKey{slice.Spec.Driver, slice.Spec.Pool.Name}
		a.byPool[key] = append(a.byPool[key], slice)
	}
	a.poolGen = make(map[poolKey]int64, len(a.byPool))
	for key, poolSlices := range a.byPool {
		slices.SortStableFunc(poolSlices, func(x, y *resourceapi.ResourceSlice) int { return cmp.Compare(x.Name, y.Name) })
		var generation int64
		for _, slice := range poolSlices {
			generation = max(generation, slice.Spec.Pool.Generation)
		}
		a.poolGen[key] = generation
	}
	attrNames := make([]string, len(policy.Attributes))
	for i, attr := range policy.Attributes {
		attrNames[i] = string(attr)
	}
	a.attrsKey = strings.Join(attrNames, ",")
	klog.FromContext(ctx).V(5).Info("Indexed resource slices", "slices", len(opts.Slices), "nodes", len(a.byNode), "pools", len(a.byPool))
	return a, nil
}

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
}

// nodeState is what Allocate knows about one node.
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
	// incomplete names the pools ("driver/pool") that lack slices.
	incomplete []string
	// dupPools names the pools ("driver/pool") with duplicate device names:
	// invalid upstream, so views never drop devices there.
	dupPools map[string]bool
	// dom[l][i] numbers the value of attribute l of device i among
	// domVals[l]; -1 if the device does not have it.
	dom     [][]int32
	domVals [][]string
}

// numberDomains fills dom and domVals.
func (ns *nodeState) numberDomains(levels int) {
	ns.dom = make([][]int32, levels)
	ns.domVals = make([][]string, levels)
	ids := make([]int32, levels*len(ns.devices))
	for l := range levels {
		ns.dom[l] = ids[l*len(ns.devices) : (l+1)*len(ns.devices)]
		var vals []string
		for i := range ns.devices {
			v := ns.devices[i].coords[l]
			if v == "" {
				ns.dom[l][i] = -1
				continue
			}
			id := slices.Index(vals, v)
			if id < 0 {
				id = len(vals)
				vals = append(vals, v)
			}
			ns.dom[l][i] = int32(id)
		}
		ns.domVals[l] = vals
	}
}

// gatherNode collects the node's slices and devices.
func (a *Allocator) gatherNode(node *v1.Node) (*nodeState, error) {
	ns := &nodeState{node: node}
	// Few slices per node: small slices beat maps here.
	var relevant []*resourceapi.ResourceSlice
	var pools []poolKey
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
		switch {
		case ptr.Deref(slice.Spec.AllNodes, false) || slice.Spec.NodeSelector != nil:
			match, err := structured.NodeMatches(a.features, node, "", ptr.Deref(slice.Spec.AllNodes, false), slice.Spec.NodeSelector)
			if err != nil {
				return nil, fmt.Errorf("node selection of slice %s: %w", slice.Name, err)
			}
			if match {
				add(slice)
			}
		case ptr.Deref(slice.Spec.PerDeviceNodeSelection, false):
			for i := range slice.Spec.Devices {
				d := &slice.Spec.Devices[i]
				match, err := structured.NodeMatches(a.features, node, ptr.Deref(d.NodeName, ""), ptr.Deref(d.AllNodes, false), d.NodeSelector)
				if err != nil {
					return nil, fmt.Errorf("node selection of device %s in slice %s: %w", d.Name, slice.Name, err)
				}
				if match {
					add(slice)
					break
				}
			}
		}
	}
	if len(pools) == 0 {
		return ns, nil
	}
	// Every slice of a relevant pool travels with the view, so that upstream
	// sees the same pool (completeness, generations, counters) as it does
	// with all slices of the cluster. Pools in upstream's order.
	slices.SortFunc(pools, func(x, y poolKey) int {
		return cmp.Or(cmp.Compare(x.driver, y.driver), cmp.Compare(x.pool, y.pool))
	})
	for _, key := range pools {
		poolSlices := a.byPool[key] // sorted by name in New
		ns.slices = append(ns.slices, poolSlices...)
		current := int64(0)
		var want int64
		for _, slice := range poolSlices {
			if slice.Spec.Pool.Generation == a.poolGen[key] {
				current++
				want = slice.Spec.Pool.ResourceSliceCount
			}
		}
		if current < want {
			ns.incomplete = append(ns.incomplete, key.driver+"/"+key.pool)
		}
	}
	stamp, cacheable := a.stamp(ns.slices, relevant)
	if cacheable {
		if cached, ok := nodeCache.Load(node.Name); ok {
			st := cached.(*nodeStatic)
			if st.attrsKey == a.attrsKey && st.features == a.features && slices.Equal(st.stamp, stamp) {
				ns.dupPools, ns.dom, ns.domVals = st.dupPools, st.dom, st.domVals
				if slices.Equal(st.slices, ns.slices) {
					// The very same objects: the cached devices point
					// at them already (read-only, shared).
					ns.devices = st.devices
					ns.fillInUse(a)
					return ns, nil
				}
				// Point at the current objects: equal UID and generation
				// mean an equal spec, except for taints that the DRA
				// manager patches in from DeviceTaintRules.
				ns.devices = slices.Clone(st.devices)
				for i := range ns.devices {
					d := &ns.devices[i]
					d.slice = ns.slices[d.sliceIndex]
					d.device = &d.slice.Spec.Devices[d.deviceIndex]
				}
				// Later cycles with these objects take the path above.
				storeNodeStatic(node.Name, &nodeStatic{stamp: st.stamp, attrsKey: st.attrsKey, features: st.features,
					slices: slices.Clone(ns.slices), devices: ns.devices, dupPools: st.dupPools, dom: st.dom, domVals: st.domVals})
				ns.fillInUse(a)
				return ns, nil
			}
		}
	}
	if err := a.buildDevices(ns, relevant, pools); err != nil {
		return nil, err
	}
	if cacheable {
		storeNodeStatic(node.Name, &nodeStatic{stamp: stamp, attrsKey: a.attrsKey, features: a.features,
			slices: slices.Clone(ns.slices), devices: ns.devices, dupPools: ns.dupPools, dom: ns.dom, domVals: ns.domVals})
	}
	ns.fillInUse(a)
	return ns, nil
}

// nodeStatic is the part of a nodeState that only depends on the node's
// slices; cached per node name across cycles and validated by stamp.
type nodeStatic struct {
	stamp    []sliceStamp
	attrsKey string
	features structured.Features
	// slices are the objects devices point into.
	slices   []*resourceapi.ResourceSlice
	devices  []nodeDevice
	dupPools map[string]bool
	dom      [][]int32
	domVals  [][]string
}

// sliceStamp identifies one slice of a node's view.
type sliceStamp struct {
	uid        types.UID
	generation int64
	relevant   bool
}

var (
	nodeCache     sync.Map // node name -> *nodeStatic
	nodeCacheSize atomic.Int64
)

// maxCachedNodes bounds nodeCache: node names come and go (autoscaling), and
// entries of deleted nodes are never looked up again. Past the bound the
// cache starts over, which costs one rebuild per node.
const maxCachedNodes = 50000

func storeNodeStatic(name string, st *nodeStatic) {
	if _, loaded := nodeCache.Swap(name, st); loaded {
		return
	}
	if nodeCacheSize.Add(1) > maxCachedNodes {
		nodeCache.Clear()
		nodeCacheSize.Store(0)
	}
}

// stamp identifies the node's view; it is not cacheable when a slice has no
// UID or selects nodes per device (that depends on the node's labels).
func (a *Allocator) stamp(view, relevant []*resourceapi.ResourceSlice) ([]sliceStamp, bool) {
	stamp := make([]sliceStamp, len(view))
	for i, slice := range view {
		if slice.UID == "" || ptr.Deref(slice.Spec.PerDeviceNodeSelection, false) {
			return nil, false
		}
		stamp[i] = sliceStamp{uid: slice.UID, generation: slice.Generation, relevant: slices.Contains(relevant, slice)}
	}
	return stamp, true
}

// fillInUse records which devices have an allocation in this cycle.
func (ns *nodeState) fillInUse(a *Allocator) {
	ns.inUse = make([]bool, len(ns.devices))
	for i := range ns.devices {
		ns.inUse[i] = a.deviceInUse(ns.devices[i].id)
	}
}

// buildDevices collects the devices of the node's view that upstream may
// allocate on the node.
func (a *Allocator) buildDevices(ns *nodeState, relevant []*resourceapi.ResourceSlice, pools []poolKey) error {
	node := ns.node
	n := 0
	for _, slice := range relevant {
		n += len(slice.Spec.Devices)
	}
	ns.devices = make([]nodeDevice, 0, n)
	start := 0
	for _, key := range pools {
		poolSlices := a.byPool[key]
		generation := a.poolGen[key]
		var names map[string]bool // only for pools with several device slices
		for i, slice := range poolSlices {
			if !slices.Contains(relevant, slice) || slice.Spec.Pool.Generation != generation {
				continue
			}
			if len(slice.Spec.SharedCounters) > 0 {
				// Counter sets only (or ignored without partitionable
				// devices): upstream allocates no devices from here.
				continue
			}
			if !a.features.PartitionableDevices && slice.Spec.PerDeviceNodeSelection != nil {
				continue
			}
			info := a.sliceInfo(slice)
			if info.dup {
				ns.markDup(key)
			}
			if len(poolSlices) > 1 {
				if names == nil {
					names = map[string]bool{}
				}
				for j := range slice.Spec.Devices {
					if names[slice.Spec.Devices[j].Name] {
						ns.markDup(key)
					}
					names[slice.Spec.Devices[j].Name] = true
				}
			}
			perDevice := ptr.Deref(slice.Spec.PerDeviceNodeSelection, false)
			for j := range slice.Spec.Devices {
				d := &slice.Spec.Devices[j]
				if perDevice {
					match, err := structured.NodeMatches(a.features, node, ptr.Deref(d.NodeName, ""), ptr.Deref(d.AllNodes, false), d.NodeSelector)
					if err != nil {
						return fmt.Errorf("node selection of device %s in slice %s: %w", d.Name, slice.Name, err)
					}
					if !match {
						continue
					}
				}
				if !a.features.DeviceBindingAndStatus && len(d.BindingConditions) > 0 {
					continue
				}
				ns.devices = append(ns.devices, nodeDevice{
					id:          info.ids[j],
					name:        info.names[j],
					driver:      slice.Spec.Driver,
					slice:       slice,
					sliceIndex:  start + i,
					deviceIndex: j,
					device:      d,
					coords:      info.coords[j],
				})
			}
		}
		start += len(poolSlices)
	}
	ns.numberDomains(len(a.policy.Attributes))
	return nil
}

func (ns *nodeState) markDup(key poolKey) {
	if ns.dupPools == nil {
		ns.dupPools = map[string]bool{}
	}
	ns.dupPools[key.driver+"/"+key.pool] = true
}

// sliceInfo returns the per-device data of a slice that does not depend on
// the cycle, from the memo when the slice can be memoised.
func (a *Allocator) sliceInfo(slice *resourceapi.ResourceSlice) *sliceInfo {
	memo := globalMemo.forSlice(slice.UID, slice.Generation, a.listTypes)
	if memo != nil {
		if info := memo.info.Load(); info != nil && info.attrsKey == a.attrsKey {
			return info
		}
	}
	info := &sliceInfo{attrsKey: a.attrsKey}
	n := len(slice.Spec.Devices)
	info.ids = make([]structured.DeviceID, n)
	info.names = make([]string, n)
	info.coords = make([]topology.Coordinates, n)
	seen := make(map[string]bool, n)
	for j := range slice.Spec.Devices {
		d := &slice.Spec.Devices[j]
		info.ids[j] = structured.MakeDeviceID(slice.Spec.Driver, slice.Spec.Pool.Name, d.Name)
		info.names[j] = slice.Spec.Driver + "/" + slice.Spec.Pool.Name + "/" + d.Name
		info.coords[j] = topology.DeviceCoordinates(slice.Spec.Driver, d, a.policy.Attributes)
		if seen[d.Name] {
			info.dup = true
		}
		seen[d.Name] = true
	}
	levels := len(a.policy.Attributes)
	info.dom = make([]int32, n*levels)
	info.domVals = make([][]string, levels)
	for l := range levels {
		for j := range n {
			v := info.coords[j][l]
			if v == "" {
				info.dom[j*levels+l] = -1
				continue
			}
			id := slices.Index(info.domVals[l], v)
			if id < 0 {
				id = len(info.domVals[l])
				info.domVals[l] = append(info.domVals[l], v)
			}
			info.dom[j*levels+l] = int32(id)
		}
	}
	if memo != nil {
		memo.info.Store(info)
	}
	return info
}

// unitSpec is one request, or one subrequest of a firstAvailable request,
// as the claim and its class define it.
type unitSpec struct {
	// request is the request name; subName the subrequest name or "".
	request, subName string
	subIndex         int
	all              bool
	count            int
	admin            bool
	class            *resourceapi.DeviceClass
	selectors        []cel.CompilationResult
	tolerations      []resourceapi.DeviceToleration
}

// unit is a unitSpec evaluated on one node.
type unit struct {
	*unitSpec
	claimIndex int
	claim      *resourceapi.ResourceClaim

	// matching[i] is true if device i matches class and selectors.
	matching []bool
	// free lists the matching devices that are usable: not in use (or
	// shareable / admin access), taints tolerated.
	free []int
	// upper counts matching devices that are not in use (or may be shared);
	// an upper bound for what upstream can allocate.
	upper   int
	nMatch  int
	uncertn bool // some CEL evaluation failed at runtime
}

func (u *unitSpec) displayName() string {
	if u.subName != "" {
		return u.request + "/" + u.subName
	}
	return u.request
}

// request is one request of a claim with its alternatives (one for
// ExactCount, several for firstAvailable).
type request struct {
	claimIndex int
	name       string
	alts       []*unit
	// target is the index in alts that counting expects upstream to choose:
	// the first alternative that can fit. -1 if none can.
	target int
}

func (r *request) chosen() *unit {
	if r.target < 0 {
		return nil
	}
	return r.alts[r.target]
}

// claimInfo is what Allocate derives from one claim on one node.
type claimInfo struct {
	claim    *resourceapi.ResourceClaim
	mode     AlignmentMode
	alignPod bool
	requests []*request
	hasAll   bool
}

// claimStatic is what a claim alone determines; computed once per claim
// object and cycle.
type claimStatic struct {
	// err is a fatal input error (ErrInvalidInput).
	err         error
	mode        AlignmentMode
	alignPod    bool
	passthrough bool
	requests    []requestStatic
}

type requestStatic struct {
	name string
	alts []*unitSpec
}

// analyze validates claims and evaluates selectors on the node's devices.
// passthrough is true for inputs this package does not interpret (future
// fields, disabled features): upstream alone decides and reports them.
func (a *Allocator) analyze(ctx context.Context, ns *nodeState, claims []*resourceapi.ResourceClaim) (infos []*claimInfo, passthrough bool, err error) {
	infos = make([]*claimInfo, 0, len(claims))
	for ci, claim := range claims {
		st := a.claimStatic(claim)
		if st.err != nil {
			return nil, false, st.err
		}
		passthrough = passthrough || st.passthrough
		info := &claimInfo{claim: claim, mode: st.mode, alignPod: st.alignPod}
		for _, rs := range st.requests {
			r := &request{claimIndex: ci, name: rs.name, target: -1}
			for _, spec := range rs.alts {
				u := &unit{unitSpec: spec, claimIndex: ci, claim: claim}
				a.evaluate(ctx, ns, u)
				r.alts = append(r.alts, u)
				if u.all {
					info.hasAll = true
				}
				if r.target < 0 && (u.all || u.upper >= u.count) {
					r.target = len(r.alts) - 1
				}
			}
			info.requests = append(info.requests, r)
		}
		infos = append(infos, info)
	}
	return infos, passthrough, nil
}

// claimStatic returns the cached analysis of a claim.
func (a *Allocator) claimStatic(claim *resourceapi.ResourceClaim) *claimStatic {
	if st, ok := a.static.Load(claim); ok {
		return st.(*claimStatic)
	}
	st := a.analyzeClaim(claim)
	a.static.Store(claim, st)
	return st
}

func (a *Allocator) analyzeClaim(claim *resourceapi.ResourceClaim) *claimStatic {
	st := &claimStatic{mode: a.policy.Alignment}
	if value, ok := claim.Annotations[topology.AnnotationAlignment]; ok {
		mode, err := ParseAlignmentMode(value)
		if err != nil {
			st.err = fmt.Errorf("%w: claim %s: annotation %s: %w", ErrInvalidInput, klog.KObj(claim), topology.AnnotationAlignment, err)
			return st
		}
		st.mode = mode
	}
	if value, ok := claim.Annotations[topology.AnnotationAlignWith]; ok {
		if value != "pod" {
			st.err = fmt.Errorf("%w: claim %s: annotation %s: invalid value %q (want pod)", ErrInvalidInput, klog.KObj(claim), topology.AnnotationAlignWith, value)
			return st
		}
		st.alignPod = true
	}
	for _, c := range claim.Spec.Devices.Constraints {
		if c.MatchAttribute == nil && c.DistinctAttribute == nil {
			st.passthrough = true
		}
	}
	claimMin := 0
	for ri := range claim.Spec.Devices.Requests {
		req := &claim.Spec.Devices.Requests[ri]
		rs := requestStatic{name: req.Name}
		switch {
		case req.Exactly != nil:
			e := req.Exactly
			if len(e.DerivedAttributes) > 0 || (e.Capacity != nil && !a.features.ConsumableCapacity) ||
				(ptr.Deref(e.AdminAccess, false) && !a.features.AdminAccess) {
				st.passthrough = true
			}
			spec, err := a.newUnitSpec(claim, req.Name, "", 0, e.DeviceClassName, e.Selectors, e.AllocationMode, e.Count, ptr.Deref(e.AdminAccess, false), e.Tolerations)
			if err != nil {
				st.err = err
				return st
			}
			if spec == nil {
				st.passthrough = true
				continue
			}
			rs.alts = []*unitSpec{spec}
		case len(req.FirstAvailable) > 0:
			if !a.features.PrioritizedList {
				st.passthrough = true
			}
			for si := range req.FirstAvailable {
				sub := &req.FirstAvailable[si]
				if len(sub.DerivedAttributes) > 0 || (sub.Capacity != nil && !a.features.ConsumableCapacity) {
					st.passthrough = true
				}
				spec, err := a.newUnitSpec(claim, req.Name, sub.Name, si, sub.DeviceClassName, sub.Selectors, sub.AllocationMode, sub.Count, false, sub.Tolerations)
				if err != nil {
					st.err = err
					return st
				}
				if spec == nil {
					st.passthrough = true
					continue
				}
				rs.alts = append(rs.alts, spec)
			}
		default:
			st.passthrough = true
			continue
		}
		minCount := math.MaxInt
		for _, u := range rs.alts {
			minCount = min(minCount, u.count)
		}
		if len(rs.alts) > 0 {
			claimMin += minCount
		}
		st.requests = append(st.requests, rs)
	}
	if claimMin > resourceapi.AllocationResultsMaxSize {
		// Upstream rejects such claims with an error.
		st.passthrough = true
	}
	return st
}

// newUnitSpec resolves the class and compiles selectors. It returns nil (and
// no error) for requests it does not understand.
func (a *Allocator) newUnitSpec(claim *resourceapi.ResourceClaim,
	requestName, subName string, subIndex int, className string, selectors []resourceapi.DeviceSelector,
	mode resourceapi.DeviceAllocationMode, count int64, admin bool, tolerations []resourceapi.DeviceToleration) (*unitSpec, error) {
	u := &unitSpec{
		request:     requestName,
		subName:     subName,
		subIndex:    subIndex,
		admin:       admin,
		tolerations: tolerations,
	}
	display := u.displayName()
	if className == "" {
		return nil, nil
	}
	switch mode {
	case resourceapi.DeviceAllocationModeAll:
		u.all = true
	case resourceapi.DeviceAllocationModeExactCount, "":
		if count < 0 || count > resourceapi.AllocationResultsMaxSize {
			return nil, nil
		}
		u.count = int(count)
		if mode == "" && count == 0 {
			u.count = 1
		}
	default:
		return nil, nil
	}
	class, err := a.classLister.Get(className)
	if err != nil {
		return nil, fmt.Errorf("%w: claim %s, request %s: device class %s: %w", ErrInvalidInput, klog.KObj(claim), display, className, err)
	}
	u.class = class
	for i, sel := range class.Spec.Selectors {
		if sel.CEL == nil {
			return nil, nil
		}
		expr := a.celCache.GetOrCompile(sel.CEL.Expression)
		if expr.Error != nil {
			return nil, fmt.Errorf("%w: claim %s, request %s: device class %s: selector #%d: CEL expression `%s`: %w", ErrInvalidInput, klog.KObj(claim), display, className, i, sel.CEL.Expression, expr.Error)
		}
		u.selectors = append(u.selectors, expr)
	}
	for i, sel := range selectors {
		if sel.CEL == nil {
			return nil, nil
		}
		expr := a.celCache.GetOrCompile(sel.CEL.Expression)
		if expr.Error != nil {
			return nil, fmt.Errorf("%w: claim %s, request %s: selector #%d: CEL expression `%s`: %w", ErrInvalidInput, klog.KObj(claim), display, i, sel.CEL.Expression, expr.Error)
		}
		u.selectors = append(u.selectors, expr)
	}
	return u, nil
}

// evaluate fills in matching, free and upper for u.
func (a *Allocator) evaluate(ctx context.Context, ns *nodeState, u *unit) {
	u.matching = make([]bool, len(ns.devices))
	var memo *sliceMemo
	var memoSlice *resourceapi.ResourceSlice
	for i := range ns.devices {
		d := &ns.devices[i]
		if d.slice != memoSlice {
			memoSlice = d.slice
			memo = globalMemo.forSlice(d.slice.UID, d.slice.Generation, a.listTypes)
		}
		matches := true
		for _, expr := range u.selectors {
			state := memoUnknown
			if memo != nil {
				state = memo.get(expr.Expression, d.deviceIndex)
			}
			if state == memoUnknown {
				ok, _, err := expr.DeviceMatches(ctx, cel.Device{
					Driver:                   d.driver,
					AllowMultipleAllocations: d.device.AllowMultipleAllocations,
					Attributes:               d.device.Attributes,
					Capacity:                 d.device.Capacity,
				})
				switch {
				case err != nil:
					state = memoError
				case ok:
					state = memoTrue
				default:
					state = memoFalse
				}
				if memo != nil && (err == nil || ctx.Err() == nil) {
					memo.set(expr.Expression, d.deviceIndex, len(d.slice.Spec.Devices), state)
				}
			}
			if state == memoError {
				// Upstream reports runtime errors when it gets to
				// this device; count it as matching so that counting
				// never rules out what upstream would do.
				u.uncertn = true
				continue
			}
			if state == memoFalse {
				matches = false
				break
			}
		}
		if !matches {
			continue
		}
		u.matching[i] = true
		u.nMatch++
		shareable := ptr.Deref(d.device.AllowMultipleAllocations, false)
		if ns.inUse[i] && !u.admin && !shareable {
			continue
		}
		u.upper++
		if a.features.DeviceTaints && taintPrevents(d.device, u.tolerations) {
			continue
		}
		u.free = append(u.free, i)
	}
}

// taintPrevents reports whether a NoSchedule or NoExecute taint on the
// device is not tolerated.
func taintPrevents(device *resourceapi.Device, tolerations []resourceapi.DeviceToleration) bool {
	for _, taint := range device.Taints {
		if taint.Effect != resourceapi.DeviceTaintEffectNoSchedule && taint.Effect != resourceapi.DeviceTaintEffectNoExecute {
			continue
		}
		tolerated := false
		for _, t := range tolerations {
			if resourceclaim.ToleratesTaint(t, taint) {
				tolerated = true
				break
			}
		}
		if !tolerated {
			return true
		}
	}
	return false
}
