// Package topologydra is the TopologyDRA scheduler framework plugin. It
// replaces the stock DynamicResources plugin in a profile: it allocates the
// devices of a pod's ResourceClaims with exactly the upstream semantics
// (pkg/allocator asks the upstream structured allocator), but among all
// valid allocations it picks the best aligned and best packed one, scores
// nodes by that quality, and writes the allocation back to the claims.
// Extended resources backed by DRA get their claim as with the stock plugin
// (see extended.go).
//
// Deliberately not supported (the stock plugin handles them; use the
// default profile for such pods): claims of PodGroups (GenericWorkload),
// node-allocatable DRA resources.
package topologydra

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/apimachinery/pkg/util/wait"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	policylisters "k8s.io/client-go/listers/policy/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/feature"

	"github.com/topodra/topodra/pkg/allocator"
	"github.com/topodra/topodra/pkg/plugins/topologydra/apis/config"
	v1 "github.com/topodra/topodra/pkg/plugins/topologydra/apis/config/v1"
	_ "github.com/topodra/topodra/pkg/plugins/topologydra/apis/scheme"
	"github.com/topodra/topodra/pkg/topology"
)

// Name is the plugin name used in scheduler configuration.
const Name = "TopologyDRA"

// TopologyDRA is the plugin. Its fields are set in New; those whose state
// changes later (the memos, trackers and sets) are safe for concurrent
// use.
type TopologyDRA struct {
	// attempts counts the attempts this profile turns down, by reason.
	attempts attemptCounters
	// The pod-independent parts of queueing hints, once per event.
	nodeEventMemo  eventMemo[corev1.Node]
	sliceEventMemo eventMemo[resourceapi.ResourceSlice]
	podDeleteMemo  eventMemo[corev1.Pod]

	args   config.TopologyDRAArgs
	policy allocator.Policy
	// waitingPolicy is policy with WholeNodeTradeWhileWaiting: it ranks
	// the nodes while a pod that needs a whole node is pending.
	waitingPolicy allocator.Policy
	// pending indexes the pending pods with claims; nil where neither
	// WholeNodeTradeWhileWaiting nor DrainTrade makes scoring look at
	// pending pods.
	pending *pendingIndex
	// rootPairs holds the claims that need devices of several classes on
	// one PCIe root; nil without an informer factory (then PreScore lists
	// the claim cache).
	rootPairs *rootPairClaims
	// bindClock times the bindings of pods for AgeWeight; nil without it.
	bindClock  *bindClock
	features   structured.Features
	draManager fwk.SharedDRAManager
	// holders keeps the devices that the DRA manager's set of allocated
	// devices lost although a claim holds them (see deviceHolders); nil
	// without a claim informer.
	holders  *deviceHolders
	client   kubernetes.Interface
	handle   fwk.Handle
	celCache *cel.Cache
	// cache keeps the allocator's per-slice and per-node data across
	// scheduling cycles of this profile.
	cache *allocator.Cache
	// freed counts free devices for the queueing hint of claims that give
	// devices back; nodes tells it which nodes a waiting pod may use (nil:
	// no informer factory, every node).
	freed freedDevices
	nodes corelisters.NodeLister
	// ownedToleration is added to every request so that devices tainted
	// with the owned taint key are available to topodra; nil if disabled.
	ownedToleration *resourceapi.DeviceToleration
	// unownedWarned holds the drivers whose devices without the owned
	// taint were logged (noteUnowned).
	unownedWarned  sync.Map
	bindingTimeout time.Duration
	// filterTimeout limits one node's allocation in Filter and the
	// verification in Reserve (args.FilterTimeout while the
	// DRASchedulerFilterTimeout gate is on); 0: no limit.
	filterTimeout time.Duration
	// headroomPercent is args.SmallPodHeadroomPercent (headroom.go).
	headroomPercent int32
	// heldBack holds the pods the headroom held back at their latest
	// attempt, for the freed-devices hint.
	heldBack heldBack
	// nodeSets interns the sets of node names recorded for pending pods
	// (unfit nodes, nodes a narrow headroom's requests match nothing on).
	nodeSets nodeSets
	// nicReservePercent is args.NICReservePercent (see nicReserveOf).
	nicReservePercent int32
	// taintOps is the TaintTolerationComparisonOperators feature: how
	// podMayUseNode matches a pod's tolerations.
	taintOps bool
	// pods lists the pods the scheduler knows (nil without an informer
	// factory), for activateWaiting.
	pods corelisters.PodLister
	// pdbs lists PodDisruptionBudgets (nil: not known): preemption does
	// not evict a pod they cover for alignment alone.
	pdbs policylisters.PodDisruptionBudgetLister
	// lastTrialFit is when (Unix nanoseconds) a pod last fit in a
	// preemption trial; 0 never (see mayBeNominated).
	lastTrialFit atomic.Int64
	// skipResizeDeferred is the InPlacePodVerticalScalingSchedulerPreemption
	// feature: with it the scheduler queues bound pods whose resize is
	// deferred, to find room by preemption; their claims are in use and
	// stay as they are (PreFilter skips them).
	skipResizeDeferred bool
	// released holds the pods whose in-flight allocations Unreserve
	// dropped, for the hint of their binding failure.
	released releasedPods
	// untimed holds when allocations without a timestamp were first
	// waited for (binding.go).
	untimed untimedWaits
	// uncertain holds the claims whose allocation write has an unknown
	// outcome (uncertain.go).
	uncertain uncertainWrites
	// skipCounting holds, per node name, until when Filter allocates that
	// node with the upstream allocator directly (see skipCountingOn).
	skipCounting sync.Map
}

// skipCountingFor is how long a node where Verify refused a counted
// allocation is allocated by upstream directly.
const skipCountingFor = 5 * time.Minute

// skipCountingOn makes Filter allocate the node with the upstream allocator
// directly for skipCountingFor. Entries that expired go at the same time,
// also of nodes that are never filtered again (deleted).
func (pl *TopologyDRA) skipCountingOn(node string) {
	now := time.Now()
	pl.skipCounting.Range(func(key, until any) bool {
		if now.After(until.(time.Time)) {
			pl.skipCounting.CompareAndDelete(key, until)
		}
		return true
	})
	pl.skipCounting.Store(node, now.Add(skipCountingFor))
}

// countingSkipped reports whether Filter must not count on the node. Safe
// for concurrent use.
func (pl *TopologyDRA) countingSkipped(node string) bool {
	until, ok := pl.skipCounting.Load(node)
	if !ok {
		return false
	}
	if time.Now().After(until.(time.Time)) {
		pl.skipCounting.Delete(node)
		return false
	}
	return true
}

var (
	_ fwk.PreEnqueuePlugin  = &TopologyDRA{}
	_ fwk.PreFilterPlugin   = &TopologyDRA{}
	_ fwk.FilterPlugin      = &TopologyDRA{}
	_ fwk.PostFilterPlugin  = &TopologyDRA{}
	_ fwk.PreScorePlugin    = &TopologyDRA{}
	_ fwk.ScorePlugin       = &TopologyDRA{}
	_ fwk.ReservePlugin     = &TopologyDRA{}
	_ fwk.PreBindPlugin     = &TopologyDRA{}
	_ fwk.EnqueueExtensions = &TopologyDRA{}
)

// New builds the plugin from its (already decoded and defaulted) args.
func New(ctx context.Context, obj runtime.Object, h fwk.Handle) (fwk.Plugin, error) {
	args, err := argsFrom(obj)
	if err != nil {
		return nil, err
	}
	fts := feature.NewSchedulerFeaturesFromGates(utilfeature.DefaultFeatureGate)
	if errs := config.ValidateTopologyDRAArgs(field.NewPath("args"), args, fts); len(errs) > 0 {
		return nil, fmt.Errorf("invalid %s args: %w", Name, errs.ToAggregate())
	}
	if h.SharedDRAManager() == nil {
		return nil, fmt.Errorf("%s needs the scheduler's DRA manager (DynamicResourceAllocation feature disabled?)", Name)
	}
	features := dynamicresources.AllocatorFeatures(fts)
	if !features.DeviceTaints {
		klog.FromContext(ctx).Info("Warning: the DRADeviceTaints feature gate is off: " + Name + " allocates devices whatever their taints, gpu.topodra.io/unhealthy included; turn it on, as it is by default")
	}
	pl := &TopologyDRA{
		args:     *args,
		features: features,
		// The CEL environment follows the feature gates, as the stock
		// plugin's does (list-type attributes, consumable capacity).
		celCache: cel.NewCache(1000, cel.Features{
			EnableConsumableCapacity: features.ConsumableCapacity,
			EnableListTypeAttributes: features.ListTypeAttributes,
		}),
		draManager:         h.SharedDRAManager(),
		client:             h.ClientSet(),
		handle:             h,
		attempts:           newAttemptCounters(h.ProfileName()),
		cache:              allocator.NewCache(),
		bindingTimeout:     time.Duration(args.BindingTimeoutSeconds) * time.Second,
		headroomPercent:    args.SmallPodHeadroomPercent,
		nicReservePercent:  args.NICReservePercent,
		taintOps:           fts.EnableTaintTolerationComparisonOperators,
		skipResizeDeferred: fts.EnableInPlacePodVerticalScalingSchedulerPreemption,
	}
	pl.freed.consumableCapacity = features.ConsumableCapacity
	if f := h.SharedInformerFactory(); f != nil {
		pl.nodes = f.Core().V1().Nodes().Lister()
		pl.pods = f.Core().V1().Pods().Lister()
		pl.pdbs = f.Policy().V1().PodDisruptionBudgets().Lister()
		if _, err := f.Resource().V1().ResourceClaims().Informer().AddEventHandler(pl.claimHandler()); err != nil {
			return nil, fmt.Errorf("watch claims: %w", err)
		}
		holders := newDeviceHolders(klog.FromContext(ctx), features.ConsumableCapacity)
		if _, err := f.Resource().V1().ResourceClaims().Informer().AddEventHandler(holders.handler()); err != nil {
			return nil, fmt.Errorf("watch claims: %w", err)
		}
		pl.holders = holders
		rootPairs := newRootPairClaims()
		if _, err := f.Resource().V1().ResourceClaims().Informer().AddEventHandler(rootPairs.handler()); err != nil {
			return nil, fmt.Errorf("watch claims: %w", err)
		}
		pl.rootPairs = rootPairs
		if _, err := f.Resource().V1().ResourceSlices().Informer().AddEventHandler(forgetSlices(pl.cache)); err != nil {
			return nil, fmt.Errorf("watch slices: %w", err)
		}
		if _, err := f.Core().V1().Nodes().Informer().AddEventHandler(forgetNodes(pl.cache)); err != nil {
			return nil, fmt.Errorf("watch nodes: %w", err)
		}
	}
	if fts.EnableDRASchedulerFilterTimeout {
		pl.filterTimeout = args.FilterTimeout
	}
	pl.policy = policyFromArgs(*args)
	pl.waitingPolicy = pl.policy
	pl.waitingPolicy.WholeNodeTrade = int(args.WholeNodeTradeWhileWaiting)
	if pl.policy.Packing && (args.WholeNodeTradeWhileWaiting > args.WholeNodeTrade || args.DrainTrade > 0) {
		f := h.SharedInformerFactory()
		if f == nil {
			return nil, fmt.Errorf("%s needs the scheduler's informer factory to watch pending pods (wholeNodeTradeWhileWaiting, drainTrade)", Name)
		}
		pl.pending = newPendingIndex()
		pl.pending.profile = h.ProfileName()
		pl.pending.taintOps = pl.taintOps
		pl.pending.wholeNode = pl.wholeNode()
		if _, err := f.Core().V1().Pods().Informer().AddEventHandler(pl.pending.handler()); err != nil {
			return nil, fmt.Errorf("watch pending pods: %w", err)
		}
	}
	if pl.headroomPercent > 0 {
		if f := h.SharedInformerFactory(); f != nil {
			if _, err := f.Core().V1().Pods().Informer().AddEventHandler(pl.heldBack.handler()); err != nil {
				return nil, fmt.Errorf("watch deleted pods: %w", err)
			}
			pl.heldBack.lister = f.Core().V1().Pods().Lister()
		}
	}
	if pl.policy.Packing && args.AgeWeight > 0 {
		if f := h.SharedInformerFactory(); f != nil {
			pl.bindClock = newBindClock()
			if _, err := f.Core().V1().Pods().Informer().AddEventHandler(pl.bindClock.handler()); err != nil {
				return nil, fmt.Errorf("watch pod bindings: %w", err)
			}
		}
	}
	if pl.client != nil {
		go wait.UntilWithContext(ctx, func(ctx context.Context) { pl.rereadUncertain(ctx, time.Now()) }, uncertainRereadInterval)
		go warnVersionSkew(ctx, pl.client)
	}
	warnUnusedArgs(klog.FromContext(ctx), args)
	if args.OwnedTaintKey != "" {
		pl.ownedToleration = &resourceapi.DeviceToleration{
			Key:      args.OwnedTaintKey,
			Operator: resourceapi.DeviceTolerationOpExists,
		}
		topologyProfiles.Store(h.ProfileName(), true)
		if f := h.SharedInformerFactory(); f != nil && pl.client != nil {
			notices := newOwnedNotices(pl, h.ProfileName())
			if _, err := f.Core().V1().Pods().Informer().AddEventHandler(notices.handler()); err != nil {
				return nil, fmt.Errorf("watch pods of other schedulers: %w", err)
			}
			go notices.run(ctx)
		}
	}
	return pl, nil
}

// forgetSlices drops the cache's entries of a slice's previous version
// when it changes, and of the slice when it is deleted.
func forgetSlices(c *allocator.Cache) cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(oldObj, newObj any) {
			old, ok1 := oldObj.(*resourceapi.ResourceSlice)
			slice, ok2 := newObj.(*resourceapi.ResourceSlice)
			if ok1 && ok2 && (old.UID != slice.UID || old.Generation != slice.Generation) {
				c.ForgetSlice(old.UID, old.Generation)
			}
		},
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			if slice, ok := obj.(*resourceapi.ResourceSlice); ok {
				c.ForgetSlice(slice.UID, slice.Generation)
			}
		},
	}
}

// forgetNodes drops the cache's device lists of a deleted node.
func forgetNodes(c *allocator.Cache) cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			if node, ok := obj.(*corev1.Node); ok {
				c.ForgetNode(node.Name)
			}
		},
	}
}

// warnUnusedArgs logs the args that are valid but without effect.
// nicRootTrade needs resource.kubernetes.io/pcieRoot among
// topologyAttributes to find the GPUs beside a NIC; it is not refused
// without, since it is on by default and a profile whose devices publish
// no PCIe root would otherwise have to switch it off explicitly.
func warnUnusedArgs(logger klog.Logger, args *config.TopologyDRAArgs) {
	if args.NICRootTrade > 0 && !slices.Contains(args.TopologyAttributes, string(topology.AttrPCIeRoot)) {
		logger.Info("Warning: nicRootTrade has no effect, since topologyAttributes lacks "+string(topology.AttrPCIeRoot)+"; add it, or set nicRootTrade to 0",
			"plugin", Name, "nicRootTrade", args.NICRootTrade, "topologyAttributes", args.TopologyAttributes)
	}
	if args.NICReservePercent > 0 && !slices.Contains(args.TopologyAttributes, string(topology.AttrPCIeRoot)) {
		logger.Info("Warning: nicReservePercent has no effect, since topologyAttributes lacks "+string(topology.AttrPCIeRoot)+"; add it, or set nicReservePercent to 0",
			"plugin", Name, "nicReservePercent", args.NICReservePercent, "topologyAttributes", args.TopologyAttributes)
	}
}

// policyFromArgs is the allocator's preference model for the args. Its
// Score is the node score:
//
//   - alignment (allocator.Quality.Alignment): 1 for a single device or
//     devices that fill the smallest domain they share, less the bigger that
//     domain is compared to the allocation, small when they span domains;
//   - packing: the allocator's Packing (node and domain fullness after this
//     allocation) for MostAllocated, 1-Packing for LeastAllocated;
//
// ranked by alignment (WholeNodeTrade, DrainTrade, NICRootTrade) first, then room,
// packing and the age of the node's pods (Quality.Settled, set by PreScore)
// mixed by RoomWeight, PackingWeight and AgeWeight.
func policyFromArgs(args config.TopologyDRAArgs) allocator.Policy {
	policy := allocator.Policy{
		Attributes:     []resourceapi.QualifiedName{},
		Alignment:      allocator.AlignmentMode(args.Alignment),
		Packing:        args.ScoringStrategy == config.MostAllocated,
		WholeNode:      int(args.WholeNodeDevices),
		WholeNodeTrade: int(args.WholeNodeTrade),
		DrainTrade:     int(args.DrainTrade),
		NICRootTrade:   int(args.NICRootTrade),
		RoomWeight:     float64(args.RoomWeight),
		PackingWeight:  float64(args.PackingWeight),
		AgeWeight:      float64(args.AgeWeight),
	}
	for _, attr := range args.TopologyAttributes {
		policy.Attributes = append(policy.Attributes, resourceapi.QualifiedName(attr))
	}
	return policy
}

// argsFrom accepts the internal type (what the scheduler's config loader
// produces), nil (no pluginConfig entry: defaults) or the versioned type.
func argsFrom(obj runtime.Object) (*config.TopologyDRAArgs, error) {
	switch a := obj.(type) {
	case *config.TopologyDRAArgs:
		return a, nil
	case nil:
		return DefaultArgs(), nil
	case *v1.TopologyDRAArgs:
		out := &config.TopologyDRAArgs{}
		a = a.DeepCopyObject().(*v1.TopologyDRAArgs)
		v1.SetDefaults(a)
		v1.Convert(a, out)
		return out, nil
	default:
		return nil, fmt.Errorf("want args of type TopologyDRAArgs, got %T", obj)
	}
}

// DefaultArgs returns the defaulted internal args under the current
// feature gates (see v1.SetDefaults).
func DefaultArgs() *config.TopologyDRAArgs {
	versioned := &v1.TopologyDRAArgs{}
	v1.SetDefaults(versioned)
	out := &config.TopologyDRAArgs{}
	v1.Convert(versioned, out)
	return out
}

// Name implements fwk.Plugin.
func (pl *TopologyDRA) Name() string { return Name }
