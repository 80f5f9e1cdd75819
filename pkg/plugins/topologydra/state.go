package topologydra

import (
	"errors"
	"slices"
	"sync"
	"sync/atomic"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/topodra/topodra/pkg/allocator"
)

// stateKey is the one key under which the plugin keeps its cycle state.
const stateKey fwk.StateKey = Name

// stateData is the plugin's per-pod scheduling cycle state.
type stateData struct {
	// extended is the pod's extended resource claim, one of claims (see
	// extended.go); nil when the pod has none. Written by PreFilter; its
	// own fields say who writes them after.
	extended *extendedClaim

	// claims are the pod's ResourceClaims in pod.spec.resourceClaims order.
	// Written by PreFilter; PreBind replaces entries with the updated
	// objects it got back from the API (Unreserve needs them). Read by all.
	// PreBind runs after Filter and Score are done, so no lock is needed.
	claims []*resourceapi.ResourceClaim

	// toAllocate are the indexes into claims of the claims that this cycle
	// allocates (not allocated yet); an in-memory extended resource claim
	// comes last. Written by PreFilter, read-only after.
	toAllocate []int

	// allocClaims are the claims of toAllocate, in that order, as handed
	// to the allocator (copies carrying the owned-taint toleration).
	// Written by PreFilter, read-only after.
	allocClaims []*resourceapi.ResourceClaim

	// availableOnNodes holds, per claim index, the node selector of an
	// existing allocation (nil when not allocated or allocated for all
	// nodes). Written by PreFilter, read-only after.
	availableOnNodes []*nodeaffinity.NodeSelector

	// headroom holds, per driver, the node-local devices of the nodes the
	// pod may use and how many are free (in all and per node), for a pod
	// whose claims to allocate ask for half a whole node or more devices of
	// one class while smallPodHeadroomPercent is on; zero otherwise.
	// Written by PreFilter, read-only after.
	headroom headroom

	// unusable holds, per claim index, why an existing allocation cannot
	// be used on any node (its device binding failed or timed out); nil
	// when usable. Written by PreFilter, read-only after: Filter rejects
	// every node and marks the claim for PostFilter.
	unusable []error

	// needsNodeOperations marks, per claim index, an existing allocation
	// with a device result that skips node operations
	// (skipNodeOperations): only nodes that declare the
	// DRAOptionalNodeOperations feature can use it. Written by PreFilter,
	// read-only after.
	needsNodeOperations []bool

	// allocator is built in PreFilter when toAllocate is not empty and used
	// concurrently by Filter (it is thread-safe).
	allocator *allocator.Allocator

	// reportOnce limits the warning event for a claim error to one per
	// cycle (Filter runs for many nodes).
	reportOnce sync.Once
	// heldOnce counts the cycle once in headroomHolds, however many
	// nodes the headroom turned down.
	heldOnce sync.Once
	// rejected counts the nodes Filter turned the pod down on, by why;
	// PostFilter counts the attempt by the most common.
	rejected nodeRejections
	// preemptible is set where Filter turned the pod down on a node where
	// preemption may free devices for it (Filter's unschedulable, not
	// unresolvable).
	preemptible atomic.Bool
	// poolsOnce limits the log of the resource pools a node's allocation
	// left out to one line per cycle at V(2) (the others at V(5)).
	poolsOnce sync.Once

	// mu guards results and unavailableClaims, which Filter writes
	// concurrently for many nodes.
	mu sync.Mutex
	// results maps node name to the allocation chosen on that node
	// (feasible nodes only). Read by PreScore, Score and Reserve after
	// Filter is done.
	results map[string]*allocator.Result
	// pinned are the nodes whose result was found with the pods nominated
	// to them added; Filter without them keeps it (see trialData).
	pinned sets.Set[string]
	// unavailableClaims are indexes of allocated claims whose allocation
	// does not fit some node; PostFilter may deallocate them.
	unavailableClaims sets.Set[int]

	// allocations holds, per claim index, the allocation Reserve chose for
	// the node (nil for claims allocated earlier). Written by Reserve, read
	// by PreBind and Unreserve.
	allocations []*resourceapi.AllocationResult
	// scorePolicy is the policy whose ScoreOn ranks the nodes this cycle,
	// and draining the nodes it ranks as draining (nil: none). Written by
	// PreScore, read by Score.
	scorePolicy allocator.Policy
	draining    sets.Set[string]
	// ages are the nodes' ages (see agesOf); empty unless the policy
	// weighs age. Written by PreScore, read by Score.
	ages nodeAges
	// sparesNICs is true where NICRootTrade applies to this pod's
	// placements (see nicRootPairsWanted). Written by PreScore, read by
	// Score.
	sparesNICs bool
	// nicReserve is what PreScore found for NICReservePercent (see
	// nicReserveOf); read by Score.
	nicReserve nicReserve
	// choiceLevels is the largest sum of subrequest indexes the claims to
	// allocate can reach (0: no prioritized list to rank by). Written by
	// PreScore, read by Score.
	choiceLevels int

	// leavingSets are the devices of claims whose pods are leaving (see
	// leaving), read on the first trial that needs them.
	leavingOnce sync.Once
	leavingSets leavingSets

	// nodeName and result are the node Reserve picked and its result.
	nodeName string
	result   *allocator.Result
}

// Clone implements fwk.StateData. The state is only written by this
// plugin's own extension points of one cycle, so sharing is safe; what a
// trial of preemption changes is kept apart (trialData).
func (s *stateData) Clone() fwk.StateData { return s }

func getState(cs fwk.CycleState) (*stateData, error) {
	data, err := cs.Read(stateKey)
	if err != nil {
		return nil, err
	}
	s, ok := data.(*stateData)
	if !ok {
		return nil, errors.New("internal error: unexpected cycle state type")
	}
	return s, nil
}

// setResult keeps the node's result; pinned says it was found with the
// pods nominated to the node added, and a result found without them does
// not replace it.
func (s *stateData) setResult(node string, r *allocator.Result, pinned bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !pinned && s.pinned.Has(node) {
		return
	}
	s.results[node] = r
	if pinned {
		if s.pinned == nil {
			s.pinned = sets.New[string]()
		}
		s.pinned.Insert(node)
	}
}

func (s *stateData) getResult(node string) *allocator.Result {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.results[node]
}

func (s *stateData) markUnavailable(index int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.unavailableClaims.Insert(index)
}

// claimsWith returns the claims to allocate on a node whose variant of the
// in-memory extended resource claim is v (see extendedForNode), as
// indexes into claims and as the allocator's claims: toAllocate and
// allocClaims, with v in place of the in-memory claim, or without it where
// v is nil. Without an in-memory claim they are toAllocate and
// allocClaims.
func (s *stateData) claimsWith(v *extendedVariant) ([]int, []*resourceapi.ResourceClaim) {
	if s.extended == nil {
		return s.toAllocate, s.allocClaims
	}
	last := len(s.toAllocate) - 1
	if v == nil {
		return s.toAllocate[:last], s.allocClaims[:last]
	}
	return s.toAllocate, append(slices.Clone(s.allocClaims[:last]), v.allocClaim)
}

// claimsOn is claimsWith for the variant that Filter used on the node.
func (s *stateData) claimsOn(node string) ([]int, []*resourceapi.ResourceClaim) {
	var v *extendedVariant
	if s.extended != nil {
		v, _ = s.extended.onNode(node)
	}
	return s.claimsWith(v)
}

// isExtendedInMemory reports whether claims[i] is the extended resource
// claim that PreFilter built in memory (see extendedClaim), created by
// PreBind or not.
func (s *stateData) isExtendedInMemory(i int) bool {
	return s.extended != nil && i == s.extended.index
}
