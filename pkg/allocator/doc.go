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
// never adds anything), and it is the preferred one.
//
// The node's devices are gathered by upstream's pool rules (pools.go): the
// generation a pool has among the node's own slices counts while those
// slices are the whole pool; incomplete pools, invalid pools (duplicate
// device names, duplicate counter sets, consumed counters that do not
// exist) and slices upstream ignores (compatibility groups or counter sets
// while their features are off) give no devices. Views and Verify only
// hide devices that upstream may allocate and that consume no counters,
// never slices, so that no pool turns complete or valid in a view, and
// nothing is hidden when a request asks for All devices.
//
// # Three strategies
//
// Allocate gathers the node's devices and analyses the claims once (both
// lazily) and hands that to the first of three strategies that applies; a
// strategy that cannot decide exactly declines, and the next one gets the
// same data.
//
// Counted: pods whose claims ask for ExactCount devices of one class per
// request, without constraints other than matchAttribute, admin access,
// shared or counter-consuming devices. For them the free devices that match
// are exactly what upstream could allocate, so the best devices are chosen
// by counting, without an upstream call per node; the Result is Unverified
// and Verify asks upstream once, on the chosen node only, with just those
// devices visible.
//
// Ordered: pods whose claims each need a single device (and whose
// align-with=pod group needs at most one). Once per cycle, every pool's
// devices are sorted best-fit (devices in the domains with the fewest free
// devices first, tightest attribute first; emptiest first when spreading)
// and one upstream allocator is built over all slices, as the stock plugin
// builds its own. Since only the order differs, topodra allocates exactly
// when upstream does, at about upstream's cost.
//
// Views: all other pods. Free devices that match each request
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
// Invalid annotation values are fatal input errors (*InputError, which
// wraps ErrInvalidInput).
//
// # Caches
//
// A Cache (Options.Cache) keeps CEL results and per-device data (IDs,
// topology coordinates) per slice UID and metadata.generation, and the
// device list of a node per node name, topology attributes and features,
// validated by the UIDs and generations of its slices; taints are
// always read from the current objects, because the DRA manager patches
// DeviceTaintRules into copies with the same UID and generation. Claims are
// analysed once per Allocator and claim object, so claims must not be
// modified while an Allocator is in use.
package allocator
