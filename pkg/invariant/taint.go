package invariant

import (
	"fmt"
	"slices"
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
)

// AllocationLag is how much older than an allocation's
// allocationTimestamp a device taint must be for UntoleratedDeviceTaint:
// a scheduler picks devices in Filter and Reserve, from a view that may
// lag the API server, and stamps the allocation later, in PreBind, after
// the Permit wait (at most 15 minutes in the scheduling framework) and
// the PreBind plugins before it (volume binding waits up to 10 minutes by
// default). A taint added in that time may have been missed legally, and
// a ResourceSlice changed in that time may have changed after the devices
// were chosen (see AllocationMismatch).
const AllocationLag = 30 * time.Minute

// deviceTaint is a taint of a device and where it comes from.
type deviceTaint struct {
	resourceapi.DeviceTaint
	// rule is the DeviceTaintRule that adds it; nil for a taint of the
	// device's ResourceSlice.
	rule *resourceapi.DeviceTaintRule
}

// since is when the taint has been as it is, as far as its objects tell:
// its timeAdded, and for a rule also the rule's last change of its spec
// (the API server keeps timeAdded while a rule's key, value or selector
// change). Zero where the taint records no timeAdded.
func (t deviceTaint) since() time.Time {
	if t.TimeAdded == nil {
		return time.Time{}
	}
	since := t.TimeAdded.Time
	if t.rule != nil {
		since = latest(since, specChanged(t.rule.ObjectMeta))
	}
	return since
}

func (t deviceTaint) String() string {
	s := string(t.Effect) + " taint " + t.Key
	if t.Value != "" {
		s += "=" + t.Value
	}
	if t.rule != nil {
		return s + " (DeviceTaintRule " + t.rule.Name + ")"
	}
	return s + " (its ResourceSlice)"
}

// ruleSelects tells whether rule taints device d, as the upstream
// allocator and eviction controller match a DeviceTaintRule: a rule
// without a selector selects nothing, an empty one everything, and each
// of driver, pool and device that is set must equal the device's.
func ruleSelects(rule *resourceapi.DeviceTaintRule, d Device) bool {
	sel := rule.Spec.DeviceSelector
	return sel != nil &&
		(sel.Driver == nil || *sel.Driver == d.Driver) &&
		(sel.Pool == nil || *sel.Pool == d.Pool) &&
		(sel.Device == nil || *sel.Device == d.Name)
}

// blocksAllocation tells whether taint t keeps a device from a result
// with tolerations, as for the upstream allocator: a NoSchedule or
// NoExecute taint (other effects, None among them, are ignored) that no
// toleration tolerates.
func blocksAllocation(t resourceapi.DeviceTaint, tolerations []resourceapi.DeviceToleration) bool {
	if t.Effect != resourceapi.DeviceTaintEffectNoSchedule && t.Effect != resourceapi.DeviceTaintEffectNoExecute {
		return false
	}
	return !slices.ContainsFunc(tolerations, func(tol resourceapi.DeviceToleration) bool {
		return resourceclaim.ToleratesTaint(tol, t)
	})
}

// untoleratedTaints finds the allocated devices with a NoSchedule or
// NoExecute taint, of their ResourceSlice (the newest generation of their
// pool) or of a DeviceTaintRule among rules, that their result's
// tolerations do not tolerate and that is older than the allocation by
// more than AllocationLag: no allocator that honours taints allocates
// such a device. A taint added later is legal (a NoSchedule taint leaves
// allocated devices alone; a NoExecute taint has the eviction controller
// evict the claim's pods, which is not judged). Where the allocation or
// the taint records no time, it is not judged and comes back as a note;
// slice taints of devices that are not published are not judged (the
// device kinds report those devices).
func untoleratedTaints(claims []*resourceapi.ResourceClaim, rules []*resourceapi.DeviceTaintRule, published pools) ([]finding, []string) {
	var out []finding
	skipped := unjudged{}
	for _, c := range claims {
		alloc := c.Status.Allocation
		if alloc == nil {
			continue
		}
		name := c.Namespace + "/" + c.Name
		for _, r := range alloc.Devices.Results {
			d := Device{r.Driver, r.Pool, r.Device}
			var taints []deviceTaint
			if spec := published.devices[d]; spec != nil {
				for _, t := range spec.Taints {
					taints = append(taints, deviceTaint{DeviceTaint: t})
				}
			}
			for _, rule := range rules {
				if ruleSelects(rule, d) {
					taints = append(taints, deviceTaint{DeviceTaint: rule.Spec.Taint, rule: rule})
				}
			}
			var older []string
			for _, t := range taints {
				if !blocksAllocation(t.DeviceTaint, r.Tolerations) {
					continue
				}
				since := t.since()
				switch {
				case alloc.AllocationTimestamp == nil:
					skipped.add("the allocation records no allocationTimestamp (the scheduler sets it only with the DRADeviceBindingConditions and DRAResourceClaimDeviceStatus feature gates), so untolerated device taints cannot be told from taints added after it", name)
				case since.IsZero():
					skipped.add("a device taint that the allocation does not tolerate records no timeAdded, so it cannot be told from a taint added after the allocation", name)
				case since.Add(AllocationLag).Before(alloc.AllocationTimestamp.Time):
					older = append(older, fmt.Sprintf("%s, in place since %s", t, since.UTC().Format(time.RFC3339)))
				}
			}
			if len(older) == 0 {
				continue
			}
			what := "a taint"
			if len(older) > 1 {
				what = "taints"
			}
			out = append(out, finding{identity: name + "|" + string(c.UID) + "|" + d.String(), Violation: Violation{
				Kind: UntoleratedDeviceTaint, Device: &d, Claims: []string{name},
				Message: fmt.Sprintf("claim %s was allocated device %s at %s, although the device had %s that the allocation's tolerations do not tolerate: %s; no scheduler that honours device taints allocates it so (was it allocated by another scheduler, or by a client that ignores taints? the device may be in use twice)",
					name, d, alloc.AllocationTimestamp.UTC().Format(time.RFC3339), what, strings.Join(older, "; ")),
			}})
		}
	}
	return out, skipped.notes(string(UntoleratedDeviceTaint) + " not judged")
}

// specChanged is when the spec of an object was last changed, as far as
// its metadata tells: its creation or its latest managed-fields entry
// that is not of a subresource (status).
func specChanged(m metav1.ObjectMeta) time.Time {
	last := m.CreationTimestamp.Time
	for _, f := range m.ManagedFields {
		if f.Time != nil && f.Subresource == "" {
			last = latest(last, f.Time.Time)
		}
	}
	return last
}

func latest(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
