// Package allocator finds the best valid device allocation for a pod's
// ResourceClaims on one node, with the node's topology in mind.
//
// # Validity
//
// The upstream structured allocator (k8s.io/dynamic-resource-allocation/structured)
// stays the judge of validity: this package only decides preference and
// hands the upstream allocator views of the ResourceSlices in which the
// preferred devices come first, or in which other devices are hidden.
// Upstream's first-fit answer on such a view is a valid allocation (a view
// never adds anything), and it is the preferred one. Views never hide slices
// (pools stay complete), devices that consume counters, or devices of pools
// with duplicate device names (invalid pools stay invalid), and nothing is
// hidden when a request asks for All devices.
//
// # Two paths
//
// Pods whose claims each need a single device (and whose align-with=pod
// group needs at most one) take the ordered path: once per cycle, every
// pool's devices are sorted best-fit (devices in the domains with the fewest
// free devices first, tightest attribute first; emptiest first when
// spreading) and one upstream allocator is built over all slices, as the
// stock plugin builds its own. Since only the order differs, topodra
// allocates exactly when upstream does, at about upstream's cost.
//
// All other pods take the planned path. Free devices that match each request
// (CEL through the cel package, memoised per slice UID and generation) are
// counted per domain; a request that cannot fit by counting fails without an
// upstream call. Each claim (or the align-with=pod group) gets the tightest
// domain that fits, best fit among those, and within it the devices that fill
// as few sub-domains as possible. Then upstream runs on, in order: only the
// picked devices; the chosen domains (for multi-device groups); all devices
// reordered; the node's slices as they are. The last view is upstream's own,
// so topodra allocates exactly when upstream does, except for
// alignment=require.
//
// # Claim annotations
//
//   - topodra.io/alignment: require | prefer | none (default: Policy.Alignment).
//     prefer: aligned if possible, otherwise spanning as few domains as
//     possible (Result.Explanation says why). require: only allocations whose
//     multi-device claims share one value of one of Policy.Attributes;
//     otherwise the node is infeasible, with an explanation. none: upstream's
//     first-fit, on the node's slices as they are (when the pod has no other
//     claims that are aligned).
//   - topodra.io/align-with: pod: all claims of the pod with this annotation
//     are aligned together, e.g. a GPU and a NIC behind one PCIe root.
//
// Invalid annotation values are fatal input errors (ErrInvalidInput).
//
// # Caches
//
// CEL results and per-device data (IDs, topology coordinates) are memoised
// per slice UID and metadata.generation, and the device list of a node per
// node name, validated by the UIDs and generations of its slices; taints are
// always read from the current objects, because the DRA manager patches
// DeviceTaintRules into copies with the same UID and generation. Claims are
// analysed once per Allocator and claim object, so claims must not be
// modified while an Allocator is in use.
package allocator

import (
	"fmt"
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

// Policy is the configurable preference model (architecture decision 4).
type Policy struct {
	// Attributes are the topology attributes that define domains, in
	// priority order (fully qualified names, e.g. topology.AttrPCIeRoot).
	// The first attribute that has a domain fitting a request wins. Nil means
	// DefaultPolicy().Attributes; an empty non-nil list disables topology.
	Attributes []resourceapi.QualifiedName
	// Alignment is the default for claims without the topodra.io/alignment
	// annotation. Empty means prefer.
	Alignment AlignmentMode
	// Packing selects best-fit (MostAllocated-like: fill partly used domains
	// first, keep large aligned blocks free) when true, and spreading
	// (LeastAllocated: use the emptiest domains first) when false.
	Packing bool
}

// DefaultPolicy returns pcieRoot, nvlinkClique, numaNode; prefer; packing.
func DefaultPolicy() Policy {
	return Policy{
		Attributes: append([]resourceapi.QualifiedName(nil), topology.DefaultAttributes...),
		Alignment:  AlignmentPrefer,
		Packing:    true,
	}
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
	// Packing in [0,1]: the mean of how much of the node's matching devices
	// are in use after this allocation and how full, on average, the
	// domains all devices share (every level; a single device shares each
	// of its domains) are afterwards, so best-fit choices score higher: a
	// GPU goes into a half-used NUMA node before a whole free one. For pods
	// that take the ordered path (one device per claim) the devices of the
	// chosen devices' pools stand in for the matching ones.
	Packing float64
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
	// Score in 0..100, higher is better:
	//
	//	Score = round(100 * (0.7*alignment + 0.3*packing))
	//
	// where alignment is Alignment (1 for a single device, Tightness for
	// devices that share a domain, a small value when spanning); packing is Packing with Policy.Packing, 1 - node usage
	// without it (spread).
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
	// chosen subrequest of firstAvailable).
	Claim, Request string
	// Matching counts the devices that match the class and selectors,
	// Free those of them that are also available (not allocated, taints
	// tolerated), Needed how many the request asks for.
	Matching, Free, Needed int
	// BestDomain is the domain with the most free matching devices.
	BestDomain     string
	BestDomainFree int
	// Reason is a short user-facing explanation.
	Reason string
}

// String returns one short user-facing sentence that does not mention the
// node, e.g. "claim gpu-claim request gpus: only 1 free device matches (needs 2)".
func (e *Explanation) String() string {
	if e == nil || len(e.Requests) == 0 {
		return ""
	}
	parts := make([]string, 0, len(e.Requests))
	for _, r := range e.Requests {
		parts = append(parts, fmt.Sprintf("claim %s request %s: %s", r.Claim, r.Request, r.Reason))
	}
	return strings.Join(parts, "; ")
}

// Alignment is the alignment part of Score in [0,1] for an allocation of
// numDevices devices under a policy with levels attributes: 1 for a single
// device; Tightness for devices that share a domain; 0.5/(levels*
// DomainsSpanned)/levels, less than any shared domain gives, for devices
// that span domains. The scheduler plugin weighs it against packing.
func (q Quality) Alignment(levels, numDevices int) float64 {
	if levels == 0 || numDevices <= 1 {
		return 1
	}
	if q.Level < levels {
		return q.Tightness
	}
	return 0.5 / float64(levels*levels*max(q.DomainsSpanned, 1))
}
