// Package config holds the internal type of the TopologyDRA plugin's
// arguments. The versioned type users write is in ./v1; both are registered
// in the kube-scheduler's configuration scheme (group
// kubescheduler.config.k8s.io) by the scheme package, so the scheduler
// decodes pluginConfig args strictly and applies defaults like it does for
// its own plugins.
package config

import (
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// GroupName is the kube-scheduler configuration group.
const GroupName = "kubescheduler.config.k8s.io"

// SchemeGroupVersion is the internal version.
var SchemeGroupVersion = schema.GroupVersion{Group: GroupName, Version: runtime.APIVersionInternal}

// ScoringStrategy says how device usage on a node affects its score.
type ScoringStrategy string

const (
	// MostAllocated prefers nodes and domains whose devices are already in
	// use (bin packing): large aligned blocks stay free for big jobs.
	MostAllocated ScoringStrategy = "MostAllocated"
	// LeastAllocated prefers the emptiest nodes and domains (spreading).
	LeastAllocated ScoringStrategy = "LeastAllocated"
)

// AlignmentPolicy is the default alignment for claims without the
// topodra.io/alignment annotation.
type AlignmentPolicy string

const (
	AlignmentPrefer  AlignmentPolicy = "prefer"
	AlignmentRequire AlignmentPolicy = "require"
	AlignmentNone    AlignmentPolicy = "none"
)

// TopologyDRAArgs are the arguments of the TopologyDRA plugin.
type TopologyDRAArgs struct {
	metav1.TypeMeta

	// TopologyAttributes define topology domains (fully qualified device
	// attribute names). The smallest domain that fits is preferred; the
	// order breaks ties.
	TopologyAttributes []string
	// ScoringStrategy: MostAllocated (default) or LeastAllocated.
	ScoringStrategy ScoringStrategy
	// WholeNodeTrade, RoomWeight and PackingWeight are the rule by which a
	// node's score (allocator.Policy.Score) ranks placements
	// (docs/placement.md): alignment first (how many topology attributes
	// the devices share), then room (how few free aligned blocks — whole
	// nodes, NUMA nodes, pairs — the placement breaks up) and packing (how
	// full the node and domains become), mixed by RoomWeight and
	// PackingWeight (only their ratio matters; under LeastAllocated only
	// the emptiness counts, whatever the weights).
	// WholeNodeTrade is how many alignment ranks a placement that breaks
	// up a whole free node gives up (never below the loosest aligned
	// rank); 0 keeps alignment strictly first. WholeNodeTradeWhileWaiting
	// replaces it while a pod of this scheduler that needs a whole node
	// (allocator.WholeNodeBlock devices or more) is pending; it is never
	// less than WholeNodeTrade.
	WholeNodeTrade             int32
	WholeNodeTradeWhileWaiting int32
	// DrainTrade concerns pods smaller than a whole node while k pods of
	// this scheduler that need a whole node are pending: the k nodes with
	// WholeNodeBlock or more matching devices that have the fewest of them
	// in use (ties: by name) are draining. A placement there has room 0
	// (last within its alignment rank) and gives up DrainTrade alignment
	// ranks (never below the loosest aligned rank), so that small pods
	// leave the node to empty out; a pod that asks for devices of several
	// classes (a GPU and a NIC) gives up no rank, since its looser
	// placement would split them across PCIe roots. For a pod of several
	// devices of one class whose every node would be draining, none is
	// (there is nowhere else to send it). Scoring only: a
	// draining node stays feasible. Draining nodes are chosen whenever
	// demand awareness is on (WholeNodeTradeWhileWaiting above
	// WholeNodeTrade, or DrainTrade above 0).
	DrainTrade    int32
	RoomWeight    int32
	PackingWeight int32
	// AgeWeight weighs, beside RoomWeight and PackingWeight, how long the
	// node's current device pods have run (allocator.Quality.Settled):
	// small pods go beside pods that have run long, which tend to run on,
	// and leave nodes of young pods to empty out. Where it is above 0,
	// draining nodes are also chosen by age: the nodes whose oldest device
	// pod is youngest (then fewest devices in use). 0: not counted.
	AgeWeight int32
	// SmallPodHeadroomPercent keeps devices free for smaller pods: a pod
	// whose claims take allocator.WholeNodeBlock or more devices of one
	// driver on a node starts only if at least this share (rounded up) of
	// that driver's devices on the nodes the pod may use (its required
	// node selector and affinity) stay free after it, and one that takes
	// half as many or more only if a quarter of that share stays free.
	// Free devices count only on nodes left with two or more of them
	// free: a single free device on a node is no room for a 2-device pod.
	// Where the share amounts to less than WholeNodeBlock devices (fewer
	// than about 8 / share nodes) it does not apply, so a small cluster
	// runs as many whole-node pods as it has nodes. 0: off.
	SmallPodHeadroomPercent int32
	// WholeNodeDevices is how many devices of one class make a whole
	// node (default 8, a DGX's GPUs; set 4 where the nodes have 4 GPUs):
	// a pod that asks for this many or more is a whole-node pod (the
	// drain trade and WholeNodeTradeWhileWaiting wait for it, and it keeps
	// the full SmallPodHeadroomPercent, a pod of half as many a quarter of
	// it), and a free block of this many is a whole free node
	// (allocator.Policy.WholeNode: WholeNodeTrade, Room). Between 2 and
	// 1024.
	WholeNodeDevices int32
	// NICRootTrade concerns pods whose claims take WholeNodeBlock or more
	// devices of one class and no NICs, while pods of any scheduler whose
	// claim needs devices of two or more classes on one PCIe root (a
	// matchAttribute on resource.kubernetes.io/pcieRoot: a GPU and a NIC
	// beside it) run or wait. A placement that takes the last free GPU of
	// a PCIe root whose NIC stays free (allocator.Quality.StrandedRoots)
	// gives up this many alignment ranks, down to 0 unlike the other
	// trades, and comes last within its rank: a whole-node pod then takes
	// a free node without NICs before a free node with them, and leaves
	// the GPUs beside NICs to the pods that can only use those. Scoring
	// only. It needs resource.kubernetes.io/pcieRoot among
	// TopologyAttributes. 0: off.
	NICRootTrade int32
	// NICReservePercent keeps GPUs beside free NICs for the pods that ask
	// for both. Among the nodes a pod passed Filter on, those with a free
	// device of a driver the pod does not ask for (for a GPU-only pod: a
	// free NIC) hold a number of free devices of the pod's own drivers;
	// a placement on such a node that would leave fewer of those free
	// than this share (rounded up) of the pod's own devices on the nodes
	// with other devices (allocator.Quality.InNICReserve) scores, for a
	// pod of fewer than half of WholeNodeDevices, in the lowest band, as
	// rank 0 (better aligned placements in it still first): such a pod
	// goes to a node without free NICs wherever its devices there share a
	// clique, a PCIe root or a NUMA node, and takes the last GPUs beside
	// free NICs otherwise; a larger pod's placement gives up one
	// alignment rank, never below rank 1 if it had one. Where the pod's
	// placement on every node it passed Filter on would take them,
	// nothing is kept. Pods that ask for devices of every driver of a
	// node are not affected. Scoring only. 0: off.
	NICReservePercent int32
	// Alignment is the default alignment policy: prefer, require or none.
	Alignment AlignmentPolicy
	// OwnedTaintKey is the device taint key that marks devices only topodra
	// hands out; topodra tolerates it. Empty disables the toleration.
	OwnedTaintKey string
	// BindingTimeoutSeconds bounds how long PreBind waits for device
	// binding conditions: 1 to MaxBindingTimeoutSeconds. It applies while
	// the DRADeviceBindingConditions and DRAResourceClaimDeviceStatus
	// feature gates are on (the default); without them it must be unset
	// (0).
	BindingTimeoutSeconds int64
	// FilterTimeout bounds one node's allocation in Filter and the
	// verification of the chosen devices in Reserve, as the stock
	// plugin's filterTimeout does; a node that runs out of time fails the
	// scheduling attempt with an error, and the pod retries with backoff.
	// It applies while the DRASchedulerFilterTimeout feature gate is on
	// (the default); 0 means no limit. Without the gate it must be unset
	// (0).
	FilterTimeout time.Duration
}

// MaxBindingTimeoutSeconds is the largest BindingTimeoutSeconds: a day,
// far beyond any device's binding and far below what a time.Duration holds.
const MaxBindingTimeoutSeconds = 24 * 60 * 60

// DefaultFilterTimeout is the stock plugin's default filterTimeout.
const DefaultFilterTimeout = 10 * time.Second

// DeepCopyObject implements runtime.Object.
func (a *TopologyDRAArgs) DeepCopyObject() runtime.Object {
	if a == nil {
		return nil
	}
	out := *a
	out.TopologyAttributes = append([]string(nil), a.TopologyAttributes...)
	return &out
}

// AddToScheme registers the internal type.
func AddToScheme(s *runtime.Scheme) error {
	s.AddKnownTypes(SchemeGroupVersion, &TopologyDRAArgs{})
	return nil
}
