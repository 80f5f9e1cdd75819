package allocator

import (
	"cmp"
	"context"
	"slices"
	"sync"
	"sync/atomic"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

// Cache keeps what Allocators derive from ResourceSlices across scheduling
// cycles: CEL selector results per device, per-device data (IDs, topology
// coordinates, domain numbers), reordered copies of slices and each node's
// device list. ResourceSlices rarely change while pods come and go, so after
// the first cycle a node costs map lookups, not CEL runs.
//
// Give one Cache to all Allocators of a scheduler profile (Options.Cache),
// as a cel.Cache is given. A Cache is safe for concurrent use. Every entry
// is keyed by all that its content depends on — slice UID and
// metadata.generation, the CEL environment, the policy's topology
// attributes, the allocator features — so Allocators with different
// policies may share one Cache without evicting each other's entries.
// Slices without a UID (objects built in memory) are not cached. Each part
// (the slice entries, the node entries, the selector results of one slice)
// is dropped as a whole when it grows past its bound, which bounds memory
// without bookkeeping in the hot path; ForgetSlice and ForgetNode drop the
// entries of slice versions and nodes that are gone sooner, from informer
// events.
type Cache struct {
	slices    sync.Map // sliceKey -> *sliceMemo
	numSlices atomic.Int64
	nodes     sync.Map // nodeKey -> *nodeStatic
	numNodes  atomic.Int64
	// forgotten holds, per slice UID, the newest generation ForgetSlice
	// dropped: a cycle still holding that version (or an older one) gets
	// no entry for it again, which nothing would drop but the bound.
	forgotten    sync.Map // types.UID -> int64
	numForgotten atomic.Int64
	// index is the index of the slices of the latest Allocator; the next
	// one reuses it where its slices are the same objects.
	index atomic.Pointer[sliceIndex]
}

// sliceIndex indexes a list of ResourceSlices for New: by node name, the
// ones without a node name, and by pool (each pool's slices sorted by
// name), with the newest generation of each pool. It is never changed
// once built: Allocators of concurrent cycles share it.
type sliceIndex struct {
	// of holds the slices indexed. The informers replace an object when
	// it changes, so the same objects are the same slices.
	of        map[*resourceapi.ResourceSlice]struct{}
	byNode    map[string][]*resourceapi.ResourceSlice
	shared    []*resourceapi.ResourceSlice
	byPool    map[poolKey][]*resourceapi.ResourceSlice
	poolGen   map[poolKey]int64
	numSlices int
}

// sliceIndexOf returns the index of list (nil entries left out): the
// cached one where it indexes exactly these objects, otherwise a new one,
// which it caches.
func (c *Cache) sliceIndexOf(list []*resourceapi.ResourceSlice) *sliceIndex {
	if idx := c.index.Load(); idx != nil && idx.indexes(list) {
		return idx
	}
	idx := newSliceIndex(list)
	c.index.Store(idx)
	return idx
}

// indexes reports whether idx is the index of exactly the slices of list,
// which holds each slice once (as listers return them).
func (idx *sliceIndex) indexes(list []*resourceapi.ResourceSlice) bool {
	n := 0
	for _, slice := range list {
		if slice == nil {
			continue
		}
		if _, ok := idx.of[slice]; !ok {
			return false
		}
		n++
	}
	return n == idx.numSlices
}

func newSliceIndex(list []*resourceapi.ResourceSlice) *sliceIndex {
	idx := &sliceIndex{
		of:     make(map[*resourceapi.ResourceSlice]struct{}, len(list)),
		byNode: map[string][]*resourceapi.ResourceSlice{},
		byPool: map[poolKey][]*resourceapi.ResourceSlice{},
	}
	for _, slice := range list {
		if slice == nil {
			continue
		}
		idx.of[slice] = struct{}{}
		idx.numSlices++
		if name := ptr.Deref(slice.Spec.NodeName, ""); name != "" {
			idx.byNode[name] = append(idx.byNode[name], slice)
		} else {
			idx.shared = append(idx.shared, slice)
		}
		key := poolKey{slice.Spec.Driver, slice.Spec.Pool.Name}
		idx.byPool[key] = append(idx.byPool[key], slice)
	}
	idx.poolGen = make(map[poolKey]int64, len(idx.byPool))
	for key, poolSlices := range idx.byPool {
		slices.SortStableFunc(poolSlices, func(x, y *resourceapi.ResourceSlice) int { return cmp.Compare(x.Name, y.Name) })
		var generation int64
		for _, slice := range poolSlices {
			generation = max(generation, slice.Spec.Pool.Generation)
		}
		idx.poolGen[key] = generation
	}
	return idx
}

// NewCache returns an empty Cache.
func NewCache() *Cache { return &Cache{} }

const (
	// maxCachedSlices bounds the slice entries.
	maxCachedSlices = 200000
	// maxCachedNodes bounds the node entries: node names come and go
	// (autoscaling), and entries of deleted nodes are never looked up
	// again. Past the bound the node cache starts over, which costs one
	// rebuild per node.
	maxCachedNodes = 50000
	// maxForgotten bounds the record of forgotten slice versions (one
	// entry per slice that changed or went). Past the bound the record
	// starts over: versions forgotten before may be cached again, up to
	// maxCachedSlices.
	maxForgotten = 200000
	// maxMemoExprs bounds the selector expressions whose results one
	// slice entry keeps: claims may each bring selectors of their own.
	// Past the bound the slice's results start over, which costs one CEL
	// run per device and expression still in use.
	maxMemoExprs = 64
)

type sliceKey struct {
	uid        types.UID
	generation int64
	// listTypes separates results of the two CEL environments.
	listTypes bool
}

// nodeKey identifies a node's cached device list: the device list depends
// on the topology attributes (coordinates, domains) and the features (which
// devices upstream may allocate).
type nodeKey struct {
	name     string
	attrsKey string
	features structured.Features
}

// Per-device selector states.
const (
	memoUnknown uint8 = iota
	memoTrue
	memoFalse
	memoError
)

// sliceMemo is what the cache keeps for one slice (UID and generation).
type sliceMemo struct {
	mu sync.RWMutex
	// byExpr holds each device's selector state (memoUnknown…) per
	// selector expression, for at most maxMemoExprs expressions.
	byExpr map[string][]uint8
	// infos maps a policy's attrsKey to the slice's *sliceInfo.
	infos sync.Map
	// permuted maps a policy's orderKey (attributes and packing) to the
	// slice's last reordered copy (*permutedSlice) in the ordered view.
	permuted sync.Map
}

// sliceInfo is per-device data of one slice for one list of topology
// attributes; valid for as long as the slice does not change.
type sliceInfo struct {
	ids    []structured.DeviceID
	names  []string // "driver/pool/device"
	coords []topology.Coordinates
	// dom[l][j] numbers device j's value of attribute l among domVals[l]
	// (-1: absent), for counting without string compares.
	dom     [][]int32
	domVals [][]string
}

// permutedSlice is a slice copy with its devices reordered.
type permutedSlice struct {
	src   *resourceapi.ResourceSlice
	perm  []int
	slice *resourceapi.ResourceSlice
}

// SelectorsMatch reports whether every one of selectors matches the
// device at deviceIndex of slice; a selector that fails at run time counts
// as matching. Results are kept with the allocators' own (per slice
// version), so evaluating again costs a lookup; a nil Cache evaluates
// every time. listTypes is the DRAListTypeAttributes feature (it selects
// the CEL environment). Safe for concurrent use.
func (c *Cache) SelectorsMatch(ctx context.Context, slice *resourceapi.ResourceSlice, deviceIndex int, listTypes bool, selectors []cel.CompilationResult) bool {
	var memo *sliceMemo
	if c != nil {
		memo = c.forSlice(slice.UID, slice.Generation, listTypes)
	}
	matches, _ := selectorsMatch(ctx, memo, slice, deviceIndex, &slice.Spec.Devices[deviceIndex], selectors)
	return matches
}

// forSlice returns the memo of one slice, or nil if the slice cannot be
// cached (no UID).
func (c *Cache) forSlice(uid types.UID, generation int64, listTypes bool) *sliceMemo {
	if uid == "" {
		return nil
	}
	key := sliceKey{uid: uid, generation: generation, listTypes: listTypes}
	if sm, ok := c.slices.Load(key); ok {
		return sm.(*sliceMemo)
	}
	if c.isForgotten(uid, generation) {
		return nil
	}
	if c.numSlices.Load() > maxCachedSlices {
		c.slices.Clear()
		c.numSlices.Store(0)
	}
	sm, loaded := c.slices.LoadOrStore(key, &sliceMemo{byExpr: map[string][]uint8{}})
	if !loaded {
		c.numSlices.Add(1)
		// ForgetSlice may have run since the check above.
		if c.isForgotten(uid, generation) {
			c.forgetKey(key)
			return nil
		}
	}
	return sm.(*sliceMemo)
}

// isForgotten reports whether ForgetSlice dropped this version of the
// slice, or a newer one.
func (c *Cache) isForgotten(uid types.UID, generation int64) bool {
	g, ok := c.forgotten.Load(uid)
	return ok && generation <= g.(int64)
}

func (sm *sliceMemo) get(expr string, deviceIndex int) uint8 {
	sm.mu.RLock()
	defer sm.mu.RUnlock()
	states := sm.byExpr[expr]
	if deviceIndex < len(states) {
		return states[deviceIndex]
	}
	return memoUnknown
}

func (sm *sliceMemo) set(expr string, deviceIndex, numDevices int, state uint8) {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	states := sm.byExpr[expr]
	if states == nil {
		if len(sm.byExpr) >= maxMemoExprs {
			clear(sm.byExpr)
		}
		states = make([]uint8, numDevices)
		sm.byExpr[expr] = states
	}
	if deviceIndex < len(states) {
		states[deviceIndex] = state
	}
}

// ForgetSlice drops what the cache keeps for one version of a slice (UID
// and metadata.generation), and keeps that version and older ones from
// being cached again: call it when the slice changes or is deleted, so
// that entries of versions no Allocator will see again do not wait for
// the bound. An Allocator still holding such a version (a cycle in
// flight) works on without caching it.
func (c *Cache) ForgetSlice(uid types.UID, generation int64) {
	for {
		old, loaded := c.forgotten.LoadOrStore(uid, generation)
		if !loaded {
			if c.numForgotten.Add(1) > maxForgotten {
				c.forgotten.Clear()
				c.numForgotten.Store(0)
			}
			break
		}
		if old.(int64) >= generation || c.forgotten.CompareAndSwap(uid, old, generation) {
			break
		}
	}
	for _, listTypes := range []bool{false, true} {
		c.forgetKey(sliceKey{uid: uid, generation: generation, listTypes: listTypes})
	}
}

// forgetKey drops one slice entry.
func (c *Cache) forgetKey(key sliceKey) {
	if _, loaded := c.slices.LoadAndDelete(key); loaded {
		c.numSlices.Add(-1)
	}
}

// ForgetNode drops the cached device lists of a node: call it when the
// node is deleted.
func (c *Cache) ForgetNode(name string) {
	c.nodes.Range(func(key, _ any) bool {
		if key.(nodeKey).name == name {
			if _, loaded := c.nodes.LoadAndDelete(key); loaded {
				c.numNodes.Add(-1)
			}
		}
		return true
	})
}

// Size returns how many slice versions and node device lists the cache
// holds.
func (c *Cache) Size() (slices, nodes int) {
	return int(c.numSlices.Load()), int(c.numNodes.Load())
}

// node returns the cached device list of a node, or nil.
func (c *Cache) node(key nodeKey) *nodeStatic {
	if st, ok := c.nodes.Load(key); ok {
		return st.(*nodeStatic)
	}
	return nil
}

// storeNode caches a node's device list.
func (c *Cache) storeNode(key nodeKey, st *nodeStatic) {
	if _, loaded := c.nodes.Swap(key, st); loaded {
		return
	}
	if c.numNodes.Add(1) > maxCachedNodes {
		c.nodes.Clear()
		c.numNodes.Store(0)
	}
}
