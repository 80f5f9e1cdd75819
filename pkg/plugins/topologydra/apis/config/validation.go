package config

import (
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/api/validate/content"
	metav1validation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/feature"
)

// ValidateTopologyDRAArgs checks the arguments; path is where they sit in
// the configuration (for error messages). As for the stock plugin's args,
// a timeout set while the feature it applies to is off (fts) is an error:
// it would have no effect.
func ValidateTopologyDRAArgs(path *field.Path, args *TopologyDRAArgs, fts feature.Features) field.ErrorList {
	var errs field.ErrorList
	seen := sets.New[string]()
	for i, attr := range args.TopologyAttributes {
		p := path.Child("topologyAttributes").Index(i)
		if attrErrs := validateFullyQualifiedAttribute(attr, p); len(attrErrs) > 0 {
			errs = append(errs, attrErrs...)
		} else if seen.Has(attr) {
			errs = append(errs, field.Duplicate(p, attr))
		}
		seen.Insert(attr)
	}
	switch args.ScoringStrategy {
	case MostAllocated, LeastAllocated:
	default:
		errs = append(errs, field.NotSupported(path.Child("scoringStrategy"), args.ScoringStrategy, []ScoringStrategy{MostAllocated, LeastAllocated}))
	}
	switch args.Alignment {
	case AlignmentRequire:
		if len(args.TopologyAttributes) == 0 {
			errs = append(errs, field.Invalid(path.Child("alignment"), args.Alignment, "needs topologyAttributes, which are empty"))
		}
	case AlignmentPrefer, AlignmentNone:
	default:
		errs = append(errs, field.NotSupported(path.Child("alignment"), args.Alignment, []AlignmentPolicy{AlignmentPrefer, AlignmentRequire, AlignmentNone}))
	}
	if args.WholeNodeTrade < 0 {
		errs = append(errs, field.Invalid(path.Child("wholeNodeTrade"), args.WholeNodeTrade, "must not be negative"))
	}
	if args.WholeNodeTradeWhileWaiting < args.WholeNodeTrade {
		errs = append(errs, field.Invalid(path.Child("wholeNodeTradeWhileWaiting"), args.WholeNodeTradeWhileWaiting, "must not be less than wholeNodeTrade"))
	}
	if args.AgeWeight < 0 {
		errs = append(errs, field.Invalid(path.Child("ageWeight"), args.AgeWeight, "must not be negative"))
	}
	if args.SmallPodHeadroomPercent < 0 || args.SmallPodHeadroomPercent > 50 {
		errs = append(errs, field.Invalid(path.Child("smallPodHeadroomPercent"), args.SmallPodHeadroomPercent, "must be between 0 and 50"))
	}
	if args.WholeNodeDevices < 2 || args.WholeNodeDevices > 1024 {
		errs = append(errs, field.Invalid(path.Child("wholeNodeDevices"), args.WholeNodeDevices, "must be between 2 and 1024"))
	}
	if args.NICReservePercent < 0 || args.NICReservePercent > 50 {
		errs = append(errs, field.Invalid(path.Child("nicReservePercent"), args.NICReservePercent, "must be between 0 and 50"))
	}
	if args.NICRootTrade < 0 {
		errs = append(errs, field.Invalid(path.Child("nicRootTrade"), args.NICRootTrade, "must not be negative"))
	}
	if args.DrainTrade < 0 {
		errs = append(errs, field.Invalid(path.Child("drainTrade"), args.DrainTrade, "must not be negative"))
	}
	if args.RoomWeight < 0 {
		errs = append(errs, field.Invalid(path.Child("roomWeight"), args.RoomWeight, "must not be negative"))
	}
	if args.PackingWeight < 0 {
		errs = append(errs, field.Invalid(path.Child("packingWeight"), args.PackingWeight, "must not be negative"))
	}
	if args.RoomWeight+args.PackingWeight == 0 {
		errs = append(errs, field.Invalid(path.Child("roomWeight"), args.RoomWeight, "roomWeight and packingWeight must not both be zero"))
	}
	if args.OwnedTaintKey != "" {
		// The toleration for this key goes into every allocation result
		// the plugin writes, where the API server validates it as it
		// validates a device toleration's key.
		errs = append(errs, metav1validation.ValidateLabelName(args.OwnedTaintKey, path.Child("ownedTaintKey"))...)
	}
	switch {
	case !fts.EnableDRADeviceBindingConditions || !fts.EnableDRAResourceClaimDeviceStatus:
		// Unset (0) unless given: the defaults leave it out.
		if args.BindingTimeoutSeconds != 0 {
			errs = append(errs, field.Forbidden(path.Child("bindingTimeoutSeconds"), "DRADeviceBindingConditions or DRAResourceClaimDeviceStatus feature gate is disabled"))
		}
	case args.BindingTimeoutSeconds <= 0 || args.BindingTimeoutSeconds > MaxBindingTimeoutSeconds:
		errs = append(errs, field.Invalid(path.Child("bindingTimeoutSeconds"), args.BindingTimeoutSeconds, fmt.Sprintf("must be positive and at most %d (one day)", MaxBindingTimeoutSeconds)))
	}
	switch {
	case !fts.EnableDRASchedulerFilterTimeout:
		// 0 (no limit) is what the feature's absence amounts to.
		if args.FilterTimeout != 0 {
			errs = append(errs, field.Forbidden(path.Child("filterTimeout"), "DRASchedulerFilterTimeout feature gate is disabled"))
		}
	case args.FilterTimeout < 0:
		errs = append(errs, field.Invalid(path.Child("filterTimeout"), args.FilterTimeout.String(), "must not be negative (0 means no limit)"))
	}
	return errs
}

// Lengths of the parts of a fully qualified device attribute name, as the
// resource API limits them (resourceapi.DeviceMaxDomainLength and
// DeviceMaxIDLength).
const (
	maxAttributeDomainLength = 63
	maxAttributeIDLength     = 32
)

// validateFullyQualifiedAttribute checks attr as the resource API checks a
// fully qualified device attribute name (a matchAttribute constraint's): a
// domain that is a DNS subdomain (compared in lower case) of at most 63
// characters, one slash, and a C identifier of at most 32 characters. Only
// such names can name an attribute that a ResourceSlice publishes. Every
// error names the entry (p) and its value.
func validateFullyQualifiedAttribute(attr string, p *field.Path) field.ErrorList {
	domain, name, ok := strings.Cut(attr, "/")
	if !ok {
		return field.ErrorList{field.Invalid(p, attr, "must be a fully qualified attribute name, <domain>/<name>")}
	}
	var errs field.ErrorList
	switch {
	case domain == "":
		errs = append(errs, field.Invalid(p, attr, "the domain must not be empty (want <domain>/<name>)"))
	case len(domain) > maxAttributeDomainLength:
		errs = append(errs, field.Invalid(p, attr, fmt.Sprintf("the domain must be at most %d characters", maxAttributeDomainLength)))
	default:
		for _, msg := range content.IsDNS1123Subdomain(strings.ToLower(domain)) {
			errs = append(errs, field.Invalid(p, attr, "the domain: "+msg))
		}
	}
	switch {
	case name == "":
		errs = append(errs, field.Invalid(p, attr, "the name must not be empty (want <domain>/<name>)"))
	case strings.Contains(name, "/"):
		errs = append(errs, field.Invalid(p, attr, "must contain one slash only (want <domain>/<name>)"))
	case len(name) > maxAttributeIDLength:
		errs = append(errs, field.Invalid(p, attr, fmt.Sprintf("the name must be at most %d characters", maxAttributeIDLength)))
	default:
		for _, msg := range content.IsCIdentifier(name) {
			errs = append(errs, field.Invalid(p, attr, "the name: "+msg))
		}
	}
	return errs
}
