// Package v1 is the versioned (user-facing) form of the TopologyDRA
// plugin's arguments, in group kubescheduler.config.k8s.io/v1:
//
//	pluginConfig:
//	- name: TopologyDRA
//	  args:
//	    scoringStrategy: MostAllocated
//	    topologyAttributes: [gpu.topodra.io/nvlinkClique, resource.kubernetes.io/pcieRoot, resource.kubernetes.io/numaNode]
package v1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/conversion"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/kubernetes/pkg/features"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/plugins/topologydra/apis/config"
	"github.com/topodra/topodra/pkg/topology"
)

// SchemeGroupVersion is kubescheduler.config.k8s.io/v1.
var SchemeGroupVersion = schema.GroupVersion{Group: config.GroupName, Version: "v1"}

// TopologyDRAArgs are the arguments of the TopologyDRA plugin. Every field
// is optional; see config.TopologyDRAArgs for the meaning and SetDefaults
// for the defaults.
type TopologyDRAArgs struct {
	metav1.TypeMeta `json:",inline"`

	// TopologyAttributes: nil means the defaults, an empty list no
	// topology at all, so an empty list is encoded too.
	TopologyAttributes         []string `json:"topologyAttributes"`
	ScoringStrategy            *string  `json:"scoringStrategy,omitempty"`
	WholeNodeTrade             *int32   `json:"wholeNodeTrade,omitempty"`
	WholeNodeTradeWhileWaiting *int32   `json:"wholeNodeTradeWhileWaiting,omitempty"`
	DrainTrade                 *int32   `json:"drainTrade,omitempty"`
	RoomWeight                 *int32   `json:"roomWeight,omitempty"`
	PackingWeight              *int32   `json:"packingWeight,omitempty"`
	AgeWeight                  *int32   `json:"ageWeight,omitempty"`
	SmallPodHeadroomPercent    *int32   `json:"smallPodHeadroomPercent,omitempty"`
	WholeNodeDevices           *int32   `json:"wholeNodeDevices,omitempty"`
	NICRootTrade               *int32   `json:"nicRootTrade,omitempty"`
	NICReservePercent          *int32   `json:"nicReservePercent,omitempty"`
	Alignment                  *string  `json:"alignment,omitempty"`
	OwnedTaintKey              *string  `json:"ownedTaintKey,omitempty"`
	BindingTimeoutSeconds      *int64   `json:"bindingTimeoutSeconds,omitempty"`
	// FilterTimeout has the name and form of the stock plugin's
	// (DynamicResourcesArgs.filterTimeout), e.g. "10s".
	FilterTimeout *metav1.Duration `json:"filterTimeout,omitempty"`
}

// DeepCopyObject implements runtime.Object.
func (a *TopologyDRAArgs) DeepCopyObject() runtime.Object {
	if a == nil {
		return nil
	}
	out := &TopologyDRAArgs{TypeMeta: a.TypeMeta}
	out.TopologyAttributes = append([]string(nil), a.TopologyAttributes...)
	out.ScoringStrategy = copyPtr(a.ScoringStrategy)
	out.WholeNodeTrade = copyPtr(a.WholeNodeTrade)
	out.WholeNodeTradeWhileWaiting = copyPtr(a.WholeNodeTradeWhileWaiting)
	out.DrainTrade = copyPtr(a.DrainTrade)
	out.RoomWeight = copyPtr(a.RoomWeight)
	out.PackingWeight = copyPtr(a.PackingWeight)
	out.AgeWeight = copyPtr(a.AgeWeight)
	out.SmallPodHeadroomPercent = copyPtr(a.SmallPodHeadroomPercent)
	out.WholeNodeDevices = copyPtr(a.WholeNodeDevices)
	out.NICRootTrade = copyPtr(a.NICRootTrade)
	out.NICReservePercent = copyPtr(a.NICReservePercent)
	out.Alignment = copyPtr(a.Alignment)
	out.OwnedTaintKey = copyPtr(a.OwnedTaintKey)
	out.BindingTimeoutSeconds = copyPtr(a.BindingTimeoutSeconds)
	out.FilterTimeout = copyPtr(a.FilterTimeout)
	return out
}

func copyPtr[T any](p *T) *T {
	if p == nil {
		return nil
	}
	return ptr.To(*p)
}

// DefaultSmallPodHeadroomPercent is smallPodHeadroomPercent's default.
const DefaultSmallPodHeadroomPercent = 12

// DefaultWholeNodeDevices is wholeNodeDevices' default: the GPUs of a
// DGX-class node (allocator.WholeNodeBlock).
const DefaultWholeNodeDevices = 8

// DefaultNICReservePercent is nicReservePercent's default.
const DefaultNICReservePercent = 5

// SetDefaults fills in every unset field, except, as the stock plugin's
// defaults do, the timeouts of features that are off: filterTimeout
// without the DRASchedulerFilterTimeout feature gate, and
// bindingTimeoutSeconds without DRADeviceBindingConditions and
// DRAResourceClaimDeviceStatus. Those stay unset (0 once converted), and
// validation refuses them set.
func SetDefaults(a *TopologyDRAArgs) {
	if a.TopologyAttributes == nil {
		for _, attr := range topology.DefaultAttributes {
			a.TopologyAttributes = append(a.TopologyAttributes, string(attr))
		}
	}
	if a.ScoringStrategy == nil {
		a.ScoringStrategy = ptr.To(string(config.MostAllocated))
	}
	if a.WholeNodeTrade == nil {
		a.WholeNodeTrade = ptr.To[int32](0)
	}
	if a.WholeNodeTradeWhileWaiting == nil {
		a.WholeNodeTradeWhileWaiting = ptr.To[int32](2)
	}
	if a.DrainTrade == nil {
		a.DrainTrade = ptr.To[int32](1)
	}
	if a.AgeWeight == nil {
		a.AgeWeight = ptr.To[int32](30)
	}
	if a.SmallPodHeadroomPercent == nil {
		a.SmallPodHeadroomPercent = ptr.To[int32](DefaultSmallPodHeadroomPercent)
	}
	if a.WholeNodeDevices == nil {
		a.WholeNodeDevices = ptr.To[int32](DefaultWholeNodeDevices)
	}
	if a.NICRootTrade == nil {
		a.NICRootTrade = ptr.To[int32](1)
	}
	if a.NICReservePercent == nil {
		a.NICReservePercent = ptr.To[int32](DefaultNICReservePercent)
	}
	if a.RoomWeight == nil {
		a.RoomWeight = ptr.To[int32](70)
	}
	if a.PackingWeight == nil {
		a.PackingWeight = ptr.To[int32](30)
	}
	if a.Alignment == nil {
		a.Alignment = ptr.To(string(config.AlignmentPrefer))
	}
	if a.OwnedTaintKey == nil {
		a.OwnedTaintKey = ptr.To(topology.DefaultTaintKey)
	}
	gates := utilfeature.DefaultFeatureGate
	if a.BindingTimeoutSeconds == nil && gates.Enabled(features.DRADeviceBindingConditions) && gates.Enabled(features.DRAResourceClaimDeviceStatus) {
		a.BindingTimeoutSeconds = ptr.To[int64](600)
	}
	if a.FilterTimeout == nil && gates.Enabled(features.DRASchedulerFilterTimeout) {
		a.FilterTimeout = &metav1.Duration{Duration: config.DefaultFilterTimeout}
	}
}

// Convert copies a defaulted versioned object into the internal type.
func Convert(in *TopologyDRAArgs, out *config.TopologyDRAArgs) {
	out.TopologyAttributes = append([]string(nil), in.TopologyAttributes...)
	out.ScoringStrategy = config.ScoringStrategy(ptr.Deref(in.ScoringStrategy, ""))
	out.WholeNodeTrade = ptr.Deref(in.WholeNodeTrade, 0)
	out.WholeNodeTradeWhileWaiting = ptr.Deref(in.WholeNodeTradeWhileWaiting, 0)
	out.DrainTrade = ptr.Deref(in.DrainTrade, 0)
	out.AgeWeight = ptr.Deref(in.AgeWeight, 0)
	out.SmallPodHeadroomPercent = ptr.Deref(in.SmallPodHeadroomPercent, 0)
	out.WholeNodeDevices = ptr.Deref(in.WholeNodeDevices, 0)
	out.NICRootTrade = ptr.Deref(in.NICRootTrade, 0)
	out.NICReservePercent = ptr.Deref(in.NICReservePercent, 0)
	out.RoomWeight = ptr.Deref(in.RoomWeight, 0)
	out.PackingWeight = ptr.Deref(in.PackingWeight, 0)
	out.Alignment = config.AlignmentPolicy(ptr.Deref(in.Alignment, ""))
	out.OwnedTaintKey = ptr.Deref(in.OwnedTaintKey, "")
	out.BindingTimeoutSeconds = ptr.Deref(in.BindingTimeoutSeconds, 0)
	out.FilterTimeout = ptr.Deref(in.FilterTimeout, metav1.Duration{}).Duration
}

// ConvertBack copies the internal type into a versioned object.
func ConvertBack(in *config.TopologyDRAArgs, out *TopologyDRAArgs) {
	// The internal args are defaulted: no attributes means none at all,
	// which the versioned type spells as an empty list (nil would mean
	// the defaults).
	out.TopologyAttributes = append([]string{}, in.TopologyAttributes...)
	out.ScoringStrategy = ptr.To(string(in.ScoringStrategy))
	out.WholeNodeTrade = ptr.To(in.WholeNodeTrade)
	out.WholeNodeTradeWhileWaiting = ptr.To(in.WholeNodeTradeWhileWaiting)
	out.DrainTrade = ptr.To(in.DrainTrade)
	out.AgeWeight = ptr.To(in.AgeWeight)
	out.SmallPodHeadroomPercent = ptr.To(in.SmallPodHeadroomPercent)
	out.WholeNodeDevices = ptr.To(in.WholeNodeDevices)
	out.NICRootTrade = ptr.To(in.NICRootTrade)
	out.NICReservePercent = ptr.To(in.NICReservePercent)
	out.RoomWeight = ptr.To(in.RoomWeight)
	out.PackingWeight = ptr.To(in.PackingWeight)
	out.Alignment = ptr.To(string(in.Alignment))
	out.OwnedTaintKey = ptr.To(in.OwnedTaintKey)
	// 0 is never a valid binding timeout: it stands for none set (its
	// feature gates are off).
	if in.BindingTimeoutSeconds != 0 {
		out.BindingTimeoutSeconds = ptr.To(in.BindingTimeoutSeconds)
	}
	out.FilterTimeout = &metav1.Duration{Duration: in.FilterTimeout}
}

// AddToScheme registers the versioned type, its defaults and conversions.
func AddToScheme(s *runtime.Scheme) error {
	s.AddKnownTypes(SchemeGroupVersion, &TopologyDRAArgs{})
	s.AddTypeDefaultingFunc(&TopologyDRAArgs{}, func(obj any) { SetDefaults(obj.(*TopologyDRAArgs)) })
	if err := s.AddConversionFunc((*TopologyDRAArgs)(nil), (*config.TopologyDRAArgs)(nil), func(a, b any, _ conversion.Scope) error {
		Convert(a.(*TopologyDRAArgs), b.(*config.TopologyDRAArgs))
		return nil
	}); err != nil {
		return err
	}
	if err := s.AddConversionFunc((*config.TopologyDRAArgs)(nil), (*TopologyDRAArgs)(nil), func(a, b any, _ conversion.Scope) error {
		ConvertBack(a.(*config.TopologyDRAArgs), b.(*TopologyDRAArgs))
		return nil
	}); err != nil {
		return err
	}
	return nil
}
