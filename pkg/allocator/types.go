package allocator

import (
	"fmt"
	"math"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/topodra/topodra/pkg/topology"
)

// AlignmentMode says how strictly the devices of a claim must share one
// topology domain.
type AlignmentMode string

const (
	// AlignmentPrefer chooses an aligned allocation when one exists and
	// otherwise falls back to the best spanning one. The default.
	AlignmentPrefer AlignmentMode = "prefer"
	// AlignmentRequire only accepts allocations in which the claim's devices
	// share one value of one of the configured attributes.
	AlignmentRequire AlignmentMode = "require"
	// AlignmentNone allocates like upstream first-fit.
	AlignmentNone AlignmentMode = "none"
)

// Policy is the configurable preference model: which attributes define
// domains, how strictly to align, whether to pack or spread, and the rule
// by which Quality.Score ranks placements (alignment first, then room and
// packing; see Score).
type Policy struct {
	// Attributes are the topology attributes that define domains, in
	// priority order (fully qualified names, e.g. topology.AttrPCIeRoot).
	// nil means topology.DefaultAttributes; an empty non-nil slice means
	// none (alignment does not matter, only packing or spreading).
	Attributes []resourceapi.QualifiedName
	// Alignment is the default for claims without the topodra.io/alignment
	// annotation. Empty means prefer.
	Alignment AlignmentMode
	// Packing selects best-fit (MostAllocated-like: fill partly used nodes
	// and domains first, keep large aligned blocks free) when true, and
	// spreading (LeastAllocated: use the emptiest domains first) when
	// false. Quality.Room and WholeNodeTrade only count when packing.
	Packing bool
	// WholeNode is how many devices make a whole node: a free block of
	// WholeNode or more devices is a whole free node that a whole-node job
	// needs (Quality.BreaksNode; BlockCost). 0 means WholeNodeBlock;
	// below 2 is invalid.
	WholeNode int
	// WholeNodeTrade is how many alignment ranks (Quality.Shared) a
	// placement that breaks up a whole free node (a free block of
	// WholeNode or more devices) loses in Score, so that a looser
	// placement that keeps the node whole can win. A placement is never
	// lowered below rank 1: trading never makes an aligned placement lose
	// to one that shares no domain. 0 keeps alignment strictly first;
	// negative is invalid.
	WholeNodeTrade int
	// DrainTrade is how many alignment ranks a placement loses on a
	// draining node: one that a pending whole-node pod is expected to get
	// next (the caller says which, see ScoreOn). As with WholeNodeTrade, a
	// placement is never lowered below rank 1, and only when packing. 0
	// ignores draining; negative is invalid.
	DrainTrade int
	// NICRootTrade is how many alignment ranks an allocation marked
	// Quality.StrandsNICs (by the caller) loses. Unlike the other trades it
	// may fall to rank 0, and within its rank such an allocation comes
	// last (its room, packing and age count as 0), so that a looser
	// allocation that leaves the NICs usable wins. Only when packing; 0
	// ignores it; negative is invalid.
	NICRootTrade int
	// AgeWeight is the weight of Quality.Settled beside RoomWeight and
	// PackingWeight (packing only; 0: not counted).
	AgeWeight float64
	// RoomWeight and PackingWeight mix Quality's Room and Packing into the
	// part of Score that ranks placements of equal alignment rank; only
	// their ratio matters. Both zero means DefaultPolicy's; negative
	// weights are invalid. Only when packing: spreading ranks by
	// emptiness alone.
	RoomWeight, PackingWeight float64
}

// DefaultPolicy returns topology.DefaultAttributes (nvlinkClique, pcieRoot,
// numaNode), alignment prefer, packing, WholeNodeTrade 0 (alignment
// strictly first), and room and packing weights 70 and 30.
//
// A pod then takes the tightest kind of domain it can get on any node,
// and among those the placement that breaks the fewest free blocks and
// packs best. With WholeNodeTrade 1 or more (the scheduler plugin raises
// it while a pod that needs a whole node is pending), a placement which
// breaks up a whole free node ranks level with (or below) placements one
// kind looser: then a node in use that offers the looser placement wins
// on room, and the free node stays whole for a whole-node pod. On a DGX, four GPUs that span the NUMA nodes
// of a busy node (inside its NVSwitch clique) beat four GPUs in one NUMA
// node of an empty node; two GPUs in one NUMA node of a busy node beat a
// PCIe-root pair of an empty node.
func DefaultPolicy() Policy {
	return Policy{
		Attributes:     append([]resourceapi.QualifiedName(nil), topology.DefaultAttributes...),
		Alignment:      AlignmentPrefer,
		Packing:        true,
		WholeNodeTrade: 0,
		RoomWeight:     70,
		PackingWeight:  30,
	}
}

// Rank is the alignment rank of an allocation of quality q under the
// policy on a node that is not draining: RankOn(q, false).
func (p Policy) Rank(q Quality) int { return p.RankOn(q, false) }

// RankOn is the alignment rank of an allocation of quality q on a node
// that is draining or not: q.Shared, lowered (not below 1, and only when
// the policy packs) by WholeNodeTrade where the allocation breaks up a
// whole free node, by DrainTrade where the node is draining and by one
// where an allocation of half a whole node's devices or more
// (WholeNodeSize) takes devices kept beside free devices of other drivers
// (q.InNICReserve); then, where q.StrandsNICs, by NICRootTrade (not below
// 0). A smaller allocation in that reserve has rank 0 when the policy
// packs: it comes after every allocation of rank 1 or more outside the
// reserve.
func (p Policy) RankOn(q Quality, draining bool) int {
	r := q.Shared
	if !p.Packing {
		return r
	}
	trade := 0
	if q.InNICReserve {
		if p.smallForReserve(q) {
			return 0
		}
		trade++
	}
	if q.BreaksNode {
		trade += p.WholeNodeTrade
	}
	if draining {
		trade += p.DrainTrade
	}
	if trade > 0 && r > 1 {
		r = max(1, r-trade)
	}
	if p.strands(q) {
		r = max(0, r-p.NICRootTrade)
	}
	return r
}

// WholeNodeSize is WholeNode, or its default (WholeNodeBlock) where it is
// 0.
func (p Policy) WholeNodeSize() int {
	if p.WholeNode > 0 {
		return p.WholeNode
	}
	return WholeNodeBlock
}

// smallForReserve reports whether an allocation of quality q in the NIC
// reserve scores in the lowest band (fewer than half of WholeNodeSize
// devices) rather than giving up one rank.
func (p Policy) smallForReserve(q Quality) bool {
	return 2*len(q.Devices) < p.WholeNodeSize()
}

// strands reports whether NICRootTrade applies to q.
func (p Policy) strands(q Quality) bool {
	return p.Packing && q.StrandsNICs && p.NICRootTrade > 0
}

// Score is the score of an allocation of quality q, in 0..100, higher is
// better. It ranks lexicographically, first by alignment, then by room and
// packing:
//
//	band  = 100 / (len(Attributes) + 1)
//	score = round(band * (Rank(q) + 0.96 * (RoomWeight*room + PackingWeight*packing + AgeWeight*settled) / (RoomWeight + PackingWeight + AgeWeight)))
//
// so a higher Rank always scores higher (the second term stays below one
// band). room is q.Room and packing q.Packing when Packing is set; when
// spreading, the second term is 1-q.Packing alone (RoomWeight, AgeWeight
// and the value of PackingWeight do not apply). The score is
// proportional: it is not stretched between nodes, so other score plugins
// (users' preferred affinities, topology spread) keep their say. The allocator uses it for Quality.Score and the
// scheduler plugin for node scores. RoomWeight and PackingWeight both
// zero mean DefaultPolicy's.
func (p Policy) Score(q Quality) int64 { return p.ScoreOn(q, false) }

// ScoreOn is the score of an allocation of quality q on a node that is
// draining or not: Score with RankOn(q, draining) as the rank and, on a
// draining node, room 0 (the node is spoken for, as a whole free node
// is), so that among placements of equal rank the draining node comes
// last. An allocation of fewer than half a whole node's devices marked
// q.InNICReserve scores in the lowest band (rank 0): the bands of its
// rank outside the reserve are scaled into that band, so any allocation
// of rank 1 or more outside the reserve wins over it, and among
// allocations in the reserve the better aligned wins, as outside it. A
// larger one gives up one rank there, as a trade (not below rank 1): it
// ties with an allocation one rank looser elsewhere, which room, packing
// and age then decide, and wins over a looser one.
func (p Policy) ScoreOn(q Quality, draining bool) int64 {
	reserve := p.Packing && q.InNICReserve && p.smallForReserve(q)
	if reserve {
		q.InNICReserve = false
	}
	wr, wp := p.RoomWeight, p.PackingWeight
	if wr == 0 && wp == 0 {
		def := DefaultPolicy()
		wr, wp = def.RoomWeight, def.PackingWeight
	}
	pack := q.Packing
	wa := p.AgeWeight
	if !p.Packing {
		// Spreading: only the emptiness counts, whatever the weights.
		pack = 1 - q.Packing
		wr, wp, wa = 0, 1, 0
	}
	room := q.Room
	if draining {
		// The node is spoken for, as a whole free node is: nothing is
		// left unbroken there.
		room = 0
	}
	tie := 0.0
	if wr+wp+wa > 0 && !p.strands(q) {
		tie = (wr*room + wp*pack + wa*q.Settled) / (wr + wp + wa)
	}
	band := 100 / float64(len(p.Attributes)+1)
	rank := p.RankOn(q, draining)
	points := band * (float64(rank) + 0.96*tie)
	if reserve {
		// The ranks scaled into the lowest band, each tie part a little
		// smaller than outside it, so that rounding keeps a rank above
		// the one below it.
		points = 0.96 * band * (float64(rank) + 0.9*tie) / float64(len(p.Attributes)+1)
	}
	score := int64(math.Round(points))
	return max(0, min(100, score))
}

// WholeNodeBlock is Policy.WholeNode's default: the size from which a
// free block counts as a whole free node, one that a whole-node (8-GPU)
// job needs.
const WholeNodeBlock = 8

// BlockCost is what breaking up a free aligned block of size devices costs
// Quality.Room, where whole devices make a whole node (Policy.WholeNode):
// 1 from whole devices (a whole node for the largest jobs), 0.3 from half
// of that, rounded up (on 8-GPU nodes four, a NUMA node), 0.05 for two or more,
// nothing for a single device. Larger blocks cost far more, so among
// placements of one rank a pod goes where it breaks the smallest blocks.
func BlockCost(size, whole int) float64 {
	switch {
	case size >= whole:
		return 1
	case size >= 2 && 2*size >= whole:
		return 0.3
	case size >= 2:
		return 0.05
	}
	return 0
}

// ParseAlignmentMode parses the value of the topodra.io/alignment annotation.
func ParseAlignmentMode(value string) (AlignmentMode, error) {
	switch mode := AlignmentMode(value); mode {
	case AlignmentPrefer, AlignmentRequire, AlignmentNone:
		return mode, nil
	}
	return "", fmt.Errorf("invalid alignment %q (want %s, %s or %s)", value, AlignmentPrefer, AlignmentRequire, AlignmentNone)
}

// Result is the outcome of Allocate on one node.
type Result struct {
	// Allocations has one entry per claim, in the order of the input claims.
	// Nil means the claims do not fit on this node.
	Allocations []resourceapi.AllocationResult
	// Quality describes the chosen allocation; zero when infeasible.
	Quality Quality
	// DevicesConsidered is the number of the node's devices (all drivers,
	// including non-node-local slices) the allocator looked at; 0 where
	// upstream alone decided.
	DevicesConsidered int
	// Unverified is set when Allocations were decided by counting free
	// matching devices, without the upstream allocator: they name the
	// chosen devices, and Verify must turn them into upstream's
	// allocation before they are used (the scheduler plugin does so in
	// Reserve, for the chosen node only).
	Unverified bool
	// CountingRefused is set by Verify when upstream did not confirm the
	// devices that counting chose: counting and upstream disagree on this
	// node. The result then comes from a strategy whose results upstream
	// made (or is infeasible).
	CountingRefused bool
	// Explanation is set when infeasible, and when alignment=prefer could
	// not be met.
	Explanation *Explanation
}

// Quality describes how well an allocation fits the node's topology.
type Quality struct {
	// Level is the index into Policy.Attributes of the tightest attribute
	// whose single value is shared by all devices of the pod (multi-device
	// allocations); len(Policy.Attributes) means the devices span domains
	// (node level only). A single-device allocation has level 0.
	Level int
	// LevelName is the attribute name of Level, "device" for a single
	// device, or "node".
	LevelName string
	// DomainsSpanned is 1 for an aligned pod; otherwise the fewest domains of
	// one attribute that hold all its devices (a device without the
	// attribute counts as a domain of its own).
	DomainsSpanned int
	// NodeDevices is how many of the node's devices match the pod's
	// requests; NodeInUse how many of them other pods hold (before this
	// allocation).
	NodeDevices, NodeInUse int
	// Packing in [0,1]: the mean of how much of the node's matching devices
	// are in use after this allocation and how full, on average, the
	// domains all devices share (every level; a single device shares each
	// of its domains) are afterwards, so best-fit choices score higher: a
	// GPU goes into a half-used NUMA node before a whole free one.
	// "Matching" means matching any request of the pod.
	Packing float64
	// Room in [0,1]: 1 minus the cost of the free aligned blocks this
	// allocation breaks up (see BlockCost), at least 0. A block is the
	// whole node or one domain of a configured attribute, counted over the
	// devices that match the pod's requests; it is free when none of them
	// is in use, and broken when the allocation takes any of them. Blocks
	// with the same devices count once. 1 when nothing free is broken.
	Room float64
	// Settled in [0,1] is how long the node's current device pods have
	// run, compared with the other nodes a pod can go to: the age of the
	// node's oldest pod with claims over the largest such age (0 for a
	// node without such pods). Pods that have run long tend to run on, so
	// small pods placed beside them leave the other nodes free to empty
	// out. Set by the scheduler plugin for node scores; the allocator
	// leaves it 0 (it is the same for every placement on one node).
	Settled float64
	// Shared is the alignment rank: how many of the configured attributes
	// have one value for all devices (devices without the attribute share
	// none). A single device, or none, shares every attribute. 0 means the
	// devices share no domain.
	Shared int
	// StrandedRoots counts the PCIe roots (pcieRoot must be one of
	// Policy.Attributes) on which the allocation takes the last free
	// device that matches the pod's requests while a device of another
	// driver, one that none of the matching devices has, stays free
	// there: for a pod that asks for GPUs only, the NICs it leaves without
	// a free GPU on their PCIe root. Counted only for allocations of
	// WholeNodeBlock or more devices, the ones Policy.NICRootTrade
	// concerns; 0 for smaller ones.
	StrandedRoots int
	// StrandsNICs marks an allocation that Policy.NICRootTrade applies
	// to. The scheduler plugin sets it (it sees which pods wait and run);
	// the allocator leaves it false.
	StrandsNICs bool
	// OtherDevices counts the node's own devices (not network-attached
	// ones) of the drivers that none of the devices matching the pod's
	// requests has, on the PCIe roots of those matching devices (for a
	// pod that asks for GPUs only: the NICs beside the node's GPUs, not a
	// CPU driver's devices; 0 where pcieRoot is not one of
	// Policy.Attributes), and OtherFree those of them no claim holds. They describe the node, not the allocation: the same
	// for every allocation of the pod there.
	OtherDevices, OtherFree int
	// InNICReserve marks an allocation that takes devices the scheduler
	// keeps for pods that also need the node's other devices (see
	// Policy.ScoreOn). The scheduler plugin sets it (it sees all nodes);
	// the allocator leaves it false.
	InNICReserve bool
	// BreaksNode is true when the allocation takes devices from a free
	// block of Policy.WholeNode or more devices (see Room): it uses up a
	// whole free node that a whole-node job could have had.
	BreaksNode bool
	// Tightness in [0,1]: over the configured attributes, the mean of
	// devices/size of the domain the devices share at that attribute (0
	// where they share none; size counts devices that match the pod's
	// requests). 1 for a single device. Sharing more, and smaller,
	// domains is tighter.
	Tightness float64
	// Aligned is true if every multi-device claim (and the align-with=pod
	// group) was placed inside one domain of some attribute.
	Aligned bool
	// Devices are the chosen devices as "driver/pool/device".
	Devices []string
	// Domain is the shared domain, e.g. "resource.kubernetes.io/pcieRoot=pci0000:00";
	// empty if the devices span domains.
	Domain string
	// Score is Policy.Score of this Quality under the Allocator's policy:
	// in 0..100, higher is better. Among allocations on one node the
	// allocator prefers the higher Score.
	Score int64
}

// Explanation says why claims did not fit on a node (or why alignment could
// not be met), per request.
type Explanation struct {
	Requests []RequestExplanation
}

// RequestExplanation describes one request of one claim on one node.
type RequestExplanation struct {
	// Claim and Request name the request ("request/subrequest" for the
	// chosen subrequest of firstAvailable; several joined by ","). An
	// explanation of the align-with=pod group as a whole has no Request,
	// and Claim names its claims ("a and b").
	Claim, Request string
	// Matching counts the devices that match the class and selectors,
	// Free those of them that are also available (not allocated, taints
	// tolerated), Needed how many the request asks for.
	Matching, Free, Needed int
	// BestDomain is the domain with the most free matching devices.
	BestDomain     string
	BestDomainFree int
	// Reason is a short user-facing explanation that names no pool, so
	// that it reads the same on nodes that fail alike.
	Reason string
	// UnusablePools names the node's pools that nothing was allocated
	// from, and why (incomplete, invalid); for logs. Empty if none.
	UnusablePools string
	// Cause classifies Reason for metrics; empty counts as CauseOther.
	Cause Cause
}

// Cause classifies why a request does not fit on a node. Its values are
// metric label values: lowercase, stable.
type Cause string

const (
	// CauseNoMatch: fewer of the node's devices match the request's class
	// and selectors than it needs, in use or not.
	CauseNoMatch Cause = "no_matching_devices"
	// CausePools: a resource pool of the node is incomplete or invalid,
	// and what is usable does not serve the request.
	CausePools Cause = "pools_unusable"
	// CauseTainted: enough devices match and are not allocated, but taints
	// the claim does not tolerate keep too many of them from it.
	CauseTainted Cause = "devices_tainted"
	// CauseInUse: enough devices match, but too few are not allocated.
	CauseInUse Cause = "devices_in_use"
	// CauseConstraints: enough devices are free, but no combination meets
	// the claims' constraints (matchAttribute, alignment=require, counters,
	// the pod's other requests) together.
	CauseConstraints Cause = "constraints"
	// CauseOther: none of the above.
	CauseOther Cause = "other"
)

// causeOrder ranks causes from the one that says most about the node to
// the one that says least: a request with no matching device explains a
// node better than another request's constraints.
var causeOrder = []Cause{CauseNoMatch, CausePools, CauseTainted, CauseInUse, CauseConstraints, CauseOther}

// Cause returns the first of the requests' causes in causeOrder, or
// CauseOther for an explanation without requests.
func (e *Explanation) Cause() Cause {
	if e == nil {
		return CauseOther
	}
	best := len(causeOrder) - 1
	for _, r := range e.Requests {
		c := r.Cause
		if c == "" {
			c = CauseOther
		}
		if i := slices.Index(causeOrder, c); i >= 0 && i < best {
			best = i
		}
	}
	return causeOrder[best]
}

// Freeable reports whether giving back allocated devices could make the
// claims fit on the node: every request explained has as many matching
// devices as it needs, and some of them are in use. An explanation without
// counts (a pool the node cannot use) is not freeable; a nil one is.
func (e *Explanation) Freeable() bool {
	if e == nil || len(e.Requests) == 0 {
		return true
	}
	inUse := false
	for _, r := range e.Requests {
		if r.Needed == 0 || r.Matching < r.Needed {
			return false
		}
		inUse = inUse || r.Free < r.Matching
	}
	return inUse
}

// String returns one short user-facing sentence that does not mention the
// node, e.g. "claim gpu-claim request gpus: only 1 free device matches (needs 2)".
func (e *Explanation) String() string {
	if e == nil || len(e.Requests) == 0 {
		return ""
	}
	parts := make([]string, 0, len(e.Requests))
	for _, r := range e.Requests {
		if r.Request == "" {
			parts = append(parts, fmt.Sprintf("claims %s: %s", r.Claim, r.Reason))
			continue
		}
		parts = append(parts, fmt.Sprintf("claim %s request %s: %s", r.Claim, r.Request, r.Reason))
	}
	return strings.Join(parts, "; ")
}

// Alignment measures in [0,1] how tight an allocation of numDevices
// devices is under a policy with levels attributes: 1 for a single
// device; Tightness for devices that share a domain; 0.5/(levels*
// DomainsSpanned)/levels, less than any shared domain gives, for devices
// that span domains. It reports how tight an allocation is; Policy.Score
// ranks by Shared instead.
func (q Quality) Alignment(levels, numDevices int) float64 {
	if levels == 0 || numDevices <= 1 {
		return 1
	}
	if q.Level < levels {
		return q.Tightness
	}
	return 0.5 / float64(levels*levels*max(q.DomainsSpanned, 1))
}
