package allocator

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
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
	// Cache keeps selector results and per-node device lists across
	// scheduling cycles; pass the same Cache to the Allocators of every
	// cycle. Nil means a private cache, which only lasts as long as this
	// Allocator.
	Cache *Cache
	// Policy is the preference model. A zero Alignment means prefer, nil
	// Attributes mean the default attributes, zero weights the default
	// weights.
	Policy Policy
	// SkipCounting, if set, names nodes on which Allocate must not decide
	// by counting but ask upstream directly (for example nodes where
	// Verify found counting refused). It is called concurrently.
	SkipCounting func(nodeName string) bool
	// Parallelize, if set, runs work for the pieces 0 to pieces-1
	// concurrently and returns when all are done or ctx is done (as the
	// scheduler framework's Parallelizer.Until does). CountDevices counts
	// nodes with it. Nil means one after another.
	Parallelize func(ctx context.Context, pieces int, work func(piece int))
}

// Allocator finds the best valid allocation of a pod's claims on one node at
// a time. It is built once per scheduling cycle and is safe for concurrent
// use by many goroutines (one per node).
type Allocator struct {
	features    structured.Features
	state       structured.AllocatedState
	classLister structured.DeviceClassLister
	celCache    *cel.Cache
	cache       *Cache
	policy      Policy
	// skipCounting: see Options.SkipCounting; nil means never.
	skipCounting func(nodeName string) bool
	// parallelize: see Options.Parallelize; nil means one after another.
	parallelize func(ctx context.Context, pieces int, work func(piece int))

	// inUse holds every device that has any committed allocation: fully
	// allocated, or shared with consumed capacity.
	inUse sets.Set[structured.DeviceID]
	// freed and taken adjust state.AllocatedDevices for a trial run (see
	// Adjusted); nil for the cycle's own Allocator.
	freed, taken sets.Set[structured.DeviceID]

	// Slices indexed once (see sliceIndex; shared with other Allocators,
	// never changed): by node name, the ones without a node name (node
	// selector, all nodes, per-device selection), and by pool.
	byNode map[string][]*resourceapi.ResourceSlice
	shared []*resourceapi.ResourceSlice
	byPool map[poolKey][]*resourceapi.ResourceSlice
	// poolGen is the newest generation of each pool.
	poolGen map[poolKey]int64
	// stableVariant is true when upstream's "stable" allocator serves
	// the features (see gatherPool).
	stableVariant bool
	// attrsKey identifies Policy.Attributes in the cache; orderKey
	// identifies the device order of the ordered view (attributes and
	// packing).
	attrsKey, orderKey string
	// static caches what Allocate derives from a claim alone
	// (*resourceapi.ResourceClaim -> *claimStatic); the claims of a pod are
	// the same objects for every node of a cycle.
	static sync.Map
	// ordered is the claim-independent best-fit view (strategy_ordered.go).
	ordered   orderedState
	numSlices int
}

type poolKey struct{ driver, pool string }

// ErrInvalidInput is wrapped by errors about claims, requests or classes that
// cannot be allocated anywhere (invalid CEL, unknown class, bad annotation).
// Such errors are of type *InputError.
var ErrInvalidInput = errors.New("invalid input")

// InputError is a problem with a claim that no node can fix: an invalid
// topodra annotation, an unknown DeviceClass, a CEL selector that does not
// compile or that fails on a device. errors.Is(err, ErrInvalidInput) holds
// for it.
type InputError struct {
	// Claim is the claim as "namespace/name".
	Claim string
	// Request is the request ("request/subrequest" for a subrequest of
	// firstAvailable); empty for problems of the claim as a whole.
	Request string
	// Detail names what is wrong: the annotation, class or expression.
	Detail string
	// Err is the underlying error, if any.
	Err error
}

func (e *InputError) Error() string {
	var b strings.Builder
	b.WriteString(ErrInvalidInput.Error())
	b.WriteString(": claim ")
	b.WriteString(e.Claim)
	if e.Request != "" {
		b.WriteString(", request ")
		b.WriteString(e.Request)
	}
	b.WriteString(": ")
	b.WriteString(e.Detail)
	if e.Err != nil {
		b.WriteString(": ")
		b.WriteString(e.Err.Error())
	}
	return b.String()
}

// Unwrap returns ErrInvalidInput and the underlying error.
func (e *InputError) Unwrap() []error {
	if e.Err == nil {
		return []error{ErrInvalidInput}
	}
	return []error{ErrInvalidInput, e.Err}
}

// New indexes the cluster's slices and prepares allocation for one
// scheduling cycle. It only fails for missing required options and an
// invalid Policy.
func New(ctx context.Context, opts Options) (*Allocator, error) {
	if opts.ClassLister == nil {
		return nil, errors.New("allocator: ClassLister is required")
	}
	policy, err := opts.Policy.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("allocator: policy: %w", err)
	}
	celCache := opts.CELCache
	if celCache == nil {
		celCache = cel.NewCache(100, cel.Features{
			EnableConsumableCapacity: opts.Features.ConsumableCapacity,
			EnableListTypeAttributes: opts.Features.ListTypeAttributes,
		})
	}
	cache := opts.Cache
	if cache == nil {
		cache = NewCache()
	}
	a := &Allocator{
		features:     opts.Features,
		classLister:  opts.ClassLister,
		celCache:     celCache,
		cache:        cache,
		policy:       policy,
		skipCounting: opts.SkipCounting,
		parallelize:  opts.Parallelize,
	}
	a.stableVariant = stableFeatures.IsSuperset(opts.Features.Set())
	if opts.AllocatedState != nil {
		a.state = *opts.AllocatedState
	}
	// A device with shares allocated counts as in use for every claim
	// that cannot share it, also where its slice no longer lets it be
	// shared (the upstream allocator would then hand it out whole beside
	// the shares: this is stricter than upstream on purpose).
	a.inUse = sets.New[structured.DeviceID]()
	for id := range a.state.AllocatedSharedDeviceIDs {
		a.inUse.Insert(id.GetDeviceID())
	}
	for id := range a.state.AggregatedCapacity {
		a.inUse.Insert(id)
	}
	idx := cache.sliceIndexOf(opts.Slices)
	a.byNode, a.shared, a.byPool, a.poolGen, a.numSlices = idx.byNode, idx.shared, idx.byPool, idx.poolGen, idx.numSlices
	attrNames := make([]string, len(policy.Attributes))
	for i, attr := range policy.Attributes {
		attrNames[i] = string(attr)
	}
	a.attrsKey = strings.Join(attrNames, ",")
	a.orderKey = a.attrsKey + "|spread"
	if policy.Packing {
		a.orderKey = a.attrsKey + "|pack"
	}
	klog.FromContext(ctx).V(5).Info("Indexed resource slices", "slices", len(opts.Slices), "nodes", len(a.byNode), "pools", len(a.byPool))
	return a, nil
}

// Adjusted returns an Allocator of the same cycle that takes the devices in
// freed as not allocated and those in taken as allocated (either may be
// nil): preemption's trial runs ask whether a pod would fit with some pods
// gone, or with a nominated pod placed. Only devices allocated whole can
// be freed; a device with allocated shares stays in use. Allocations with
// nothing freed are valid as they are; allocations with devices freed are
// answers to the trial only. It is cheap: the slice index, caches and
// policy are shared, and the adjustment is looked up per device.
func (a *Allocator) Adjusted(freed, taken sets.Set[structured.DeviceID]) *Allocator {
	return &Allocator{
		features:      a.features,
		state:         a.state,
		classLister:   a.classLister,
		celCache:      a.celCache,
		cache:         a.cache,
		policy:        a.policy,
		skipCounting:  a.skipCounting,
		parallelize:   a.parallelize,
		inUse:         a.inUse,
		freed:         freed,
		taken:         taken,
		byNode:        a.byNode,
		shared:        a.shared,
		byPool:        a.byPool,
		poolGen:       a.poolGen,
		stableVariant: a.stableVariant,
		attrsKey:      a.attrsKey,
		orderKey:      a.orderKey,
		numSlices:     a.numSlices,
	}
}

// AnyOnNode reports whether one of ids is a device of a slice published for
// the node by name.
func (a *Allocator) AnyOnNode(node string, ids sets.Set[structured.DeviceID]) bool {
	if len(ids) == 0 {
		return false
	}
	for _, slice := range a.byNode[node] {
		for i := range slice.Spec.Devices {
			if ids.Has(structured.MakeDeviceID(slice.Spec.Driver, slice.Spec.Pool.Name, slice.Spec.Devices[i].Name)) {
				return true
			}
		}
	}
	return false
}

// ReleasedSince returns the devices this Allocator counts as allocated
// (its AllocatedState, without adjustments) that now, a later state of
// the cluster, does not.
func (a *Allocator) ReleasedSince(now sets.Set[structured.DeviceID]) sets.Set[structured.DeviceID] {
	out := sets.New[structured.DeviceID]()
	for id := range a.state.AllocatedDevices {
		if !now.Has(id) {
			out.Insert(id)
		}
	}
	return out
}

// NodesOf returns the nodes whose node-local slices publish any of ids.
func (a *Allocator) NodesOf(ids sets.Set[structured.DeviceID]) sets.Set[string] {
	out := sets.New[string]()
	for id := range ids {
		for _, slice := range a.byPool[poolKey{id.Driver.String(), id.Pool.String()}] {
			if slice.Spec.NodeName != nil && *slice.Spec.NodeName != "" {
				out.Insert(*slice.Spec.NodeName)
			}
		}
	}
	return out
}

// adjusted reports whether the Allocator is a trial run's (see Adjusted).
func (a *Allocator) adjusted() bool { return a.freed != nil || a.taken != nil }

// stateFor returns the allocated state that upstream sees on view: the
// cycle's, adjusted where the Allocator is (its devices restricted to the
// view's, which are the only ones upstream looks up).
func (a *Allocator) stateFor(view []*resourceapi.ResourceSlice) structured.AllocatedState {
	if !a.adjusted() {
		return a.state
	}
	state := a.state
	state.AllocatedDevices = sets.New[structured.DeviceID]()
	for _, slice := range view {
		for i := range slice.Spec.Devices {
			id := structured.MakeDeviceID(slice.Spec.Driver, slice.Spec.Pool.Name, slice.Spec.Devices[i].Name)
			if a.taken.Has(id) || a.state.AllocatedDevices.Has(id) && !a.freed.Has(id) {
				state.AllocatedDevices.Insert(id)
			}
		}
	}
	return state
}

// withDefaults fills in the defaults of a Policy and checks it.
func (p Policy) withDefaults() (Policy, error) {
	def := DefaultPolicy()
	if p.Attributes == nil {
		p.Attributes = def.Attributes
	}
	if p.Alignment == "" {
		p.Alignment = def.Alignment
	}
	if _, err := ParseAlignmentMode(string(p.Alignment)); err != nil {
		return p, err
	}
	if p.Alignment == AlignmentRequire && len(p.Attributes) == 0 {
		return p, fmt.Errorf("alignment %s needs topology attributes", AlignmentRequire)
	}
	if p.WholeNodeTrade < 0 || p.NICRootTrade < 0 || p.RoomWeight < 0 || p.PackingWeight < 0 || p.AgeWeight < 0 {
		return p, fmt.Errorf("negative trade or weight (whole-node trade %v, NIC root trade %v, room %v, packing %v, age %v)", p.WholeNodeTrade, p.NICRootTrade, p.RoomWeight, p.PackingWeight, p.AgeWeight)
	}
	if p.RoomWeight == 0 && p.PackingWeight == 0 {
		p.RoomWeight, p.PackingWeight = def.RoomWeight, def.PackingWeight
	}
	if p.WholeNode == 0 {
		p.WholeNode = WholeNodeBlock
	}
	if p.WholeNode < 2 {
		return p, fmt.Errorf("a whole node of %d devices: want 2 or more", p.WholeNode)
	}
	return p, nil
}
