package invariant

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// ownedKey is the key of topodra's NoSchedule taint on the devices it
// allocates (manifests/base/ownership.yaml).
const ownedKey = "gpu.topodra.io/topodra-only"

// allocatedAt is when the claims of allocatedTaintClaim were allocated.
var allocatedAt = time.Date(2024, 6, 1, 12, 0, 0, 0, time.UTC)

// taint is a taint of key with effect, added at added (no timeAdded if
// zero).
func taint(key string, effect resourceapi.DeviceTaintEffect, added time.Time) resourceapi.DeviceTaint {
	t := resourceapi.DeviceTaint{Key: key, Effect: effect}
	if !added.IsZero() {
		t.TimeAdded = &metav1.Time{Time: added}
	}
	return t
}

// tainted is device name with the taints.
func tainted(name string, taints ...resourceapi.DeviceTaint) resourceapi.Device {
	return resourceapi.Device{Name: name, Taints: taints}
}

// allocatedTaintClaim is claim name allocated the devices of pool
// "node-a" at allocatedAt, its results with the tolerations.
func allocatedTaintClaim(name string, tolerations []resourceapi.DeviceToleration, deviceNames ...string) *resourceapi.ResourceClaim {
	c := claim(name, "node-a", "", deviceNames...)
	c.Status.Allocation.AllocationTimestamp = &metav1.Time{Time: allocatedAt}
	for i := range c.Status.Allocation.Devices.Results {
		c.Status.Allocation.Devices.Results[i].Tolerations = tolerations
	}
	return c
}

// taintRule is a DeviceTaintRule created at created with selector and
// taint.
func taintRule(name string, created time.Time, selector *resourceapi.DeviceTaintSelector, t resourceapi.DeviceTaint) *resourceapi.DeviceTaintRule {
	return &resourceapi.DeviceTaintRule{
		ObjectMeta: metav1.ObjectMeta{Name: name, CreationTimestamp: metav1.NewTime(created)},
		Spec:       resourceapi.DeviceTaintRuleSpec{DeviceSelector: selector, Taint: t},
	}
}

// changedAt records a change of rule at when in its managed fields, of
// the subresource ("" for the spec).
func changedAt(rule *resourceapi.DeviceTaintRule, when time.Time, subresource string) *resourceapi.DeviceTaintRule {
	rule.ManagedFields = append(rule.ManagedFields, metav1.ManagedFieldsEntry{Manager: "kubectl", Operation: metav1.ManagedFieldsOperationUpdate, Time: &metav1.Time{Time: when}, Subresource: subresource})
	return rule
}

// TestUntoleratedDeviceTaint: a device allocated although it had a
// NoSchedule or NoExecute taint, of its slice or of a DeviceTaintRule
// that selects it, that the allocation result does not tolerate is
// reported where the taint is older than the allocation by more than
// AllocationLag; a tolerated taint, a taint added later, another effect
// or a rule that does not select the device is clean, and a taint or an
// allocation without a time is not judged and noted.
func TestUntoleratedDeviceTaint(t *testing.T) {
	hourBefore := allocatedAt.Add(-time.Hour)
	owned := taint(ownedKey, resourceapi.DeviceTaintEffectNoSchedule, hourBefore)
	exists := []resourceapi.DeviceToleration{{Key: ownedKey, Operator: resourceapi.DeviceTolerationOpExists}}
	gpu0 := &Device{driver, "node-a", "gpu-0"}
	sliceWith := func(taints ...resourceapi.DeviceTaint) []*resourceapi.ResourceSlice {
		return []*resourceapi.ResourceSlice{slice("node-a", 1, tainted("gpu-0", taints...), tainted("gpu-1"))}
	}
	untainted := sliceWith()
	tests := map[string]struct {
		state State
		want  []Violation
		// notes are substrings of the notes, one each, in order.
		notes []string
	}{
		"owned taint an hour before the allocation, not tolerated": {
			state: State{Slices: sliceWith(owned), Claims: []*resourceapi.ResourceClaim{allocatedTaintClaim("a", nil, "gpu-0")}},
			want:  []Violation{{Kind: UntoleratedDeviceTaint, Device: gpu0, Claims: []string{"ns/a"}}},
		},
		"owned taint tolerated with Exists": {
			state: State{Slices: sliceWith(owned), Claims: []*resourceapi.ResourceClaim{allocatedTaintClaim("a", exists, "gpu-0")}},
		},
		"owned taint tolerated by key and value": {
			state: State{Slices: sliceWith(owned), Claims: []*resourceapi.ResourceClaim{allocatedTaintClaim("a", []resourceapi.DeviceToleration{{Key: ownedKey, Operator: resourceapi.DeviceTolerationOpEqual, Effect: resourceapi.DeviceTaintEffectNoSchedule}}, "gpu-0")}},
		},
		"toleration of another value or effect": {
			state: State{Slices: sliceWith(owned), Claims: []*resourceapi.ResourceClaim{
				allocatedTaintClaim("value", []resourceapi.DeviceToleration{{Key: ownedKey, Operator: resourceapi.DeviceTolerationOpEqual, Value: "yes"}}, "gpu-0"),
				allocatedTaintClaim("effect", []resourceapi.DeviceToleration{{Key: ownedKey, Operator: resourceapi.DeviceTolerationOpExists, Effect: resourceapi.DeviceTaintEffectNoExecute}}, "gpu-0"),
			}},
			want: []Violation{
				{Kind: DoubleAllocation, Device: gpu0, Claims: []string{"ns/effect", "ns/value"}},
				{Kind: UntoleratedDeviceTaint, Device: gpu0, Claims: []string{"ns/effect"}},
				{Kind: UntoleratedDeviceTaint, Device: gpu0, Claims: []string{"ns/value"}},
			},
		},
		"taint added after the allocation": {
			state: State{Slices: sliceWith(taint(ownedKey, resourceapi.DeviceTaintEffectNoSchedule, allocatedAt.Add(time.Minute))), Claims: []*resourceapi.ResourceClaim{allocatedTaintClaim("a", nil, "gpu-0")}},
		},
		"taint added within the allocation lag": {
			state: State{Slices: sliceWith(taint(ownedKey, resourceapi.DeviceTaintEffectNoSchedule, allocatedAt.Add(-AllocationLag))), Claims: []*resourceapi.ResourceClaim{allocatedTaintClaim("a", nil, "gpu-0")}},
		},
		"NoExecute taint before the allocation, and a None taint": {
			state: State{Slices: sliceWith(taint("broken", resourceapi.DeviceTaintEffectNoExecute, hourBefore), taint("info", resourceapi.DeviceTaintEffectNone, hourBefore)), Claims: []*resourceapi.ResourceClaim{allocatedTaintClaim("a", nil, "gpu-0")}},
			want:  []Violation{{Kind: UntoleratedDeviceTaint, Device: gpu0, Claims: []string{"ns/a"}}},
		},
		"None taint only": {
			state: State{Slices: sliceWith(taint("info", resourceapi.DeviceTaintEffectNone, hourBefore)), Claims: []*resourceapi.ResourceClaim{allocatedTaintClaim("a", nil, "gpu-0")}},
		},
		"admin access is judged": {
			state: State{Slices: sliceWith(owned), Claims: []*resourceapi.ResourceClaim{adminAccess(allocatedTaintClaim("a", nil, "gpu-0"))}},
			want:  []Violation{{Kind: UntoleratedDeviceTaint, Device: gpu0, Claims: []string{"ns/a"}}},
		},
		"DeviceTaintRule of the driver": {
			state: State{Slices: untainted, Claims: []*resourceapi.ResourceClaim{allocatedTaintClaim("a", nil, "gpu-0")}, DeviceTaintRules: []*resourceapi.DeviceTaintRule{
				taintRule("owns", hourBefore, &resourceapi.DeviceTaintSelector{Driver: ptr.To(driver)}, owned),
			}},
			want: []Violation{{Kind: UntoleratedDeviceTaint, Device: gpu0, Claims: []string{"ns/a"}}},
		},
		"DeviceTaintRule of the device, status written after the allocation": {
			state: State{Slices: untainted, Claims: []*resourceapi.ResourceClaim{allocatedTaintClaim("a", nil, "gpu-0")}, DeviceTaintRules: []*resourceapi.DeviceTaintRule{
				changedAt(taintRule("device", hourBefore, &resourceapi.DeviceTaintSelector{Driver: ptr.To(driver), Pool: ptr.To("node-a"), Device: ptr.To("gpu-0")}, owned), allocatedAt.Add(time.Hour), "status"),
			}},
			want: []Violation{{Kind: UntoleratedDeviceTaint, Device: gpu0, Claims: []string{"ns/a"}}},
		},
		"DeviceTaintRule tolerated": {
			state: State{Slices: untainted, Claims: []*resourceapi.ResourceClaim{allocatedTaintClaim("a", exists, "gpu-0")}, DeviceTaintRules: []*resourceapi.DeviceTaintRule{
				taintRule("owns", hourBefore, &resourceapi.DeviceTaintSelector{Driver: ptr.To(driver)}, owned),
			}},
		},
		"DeviceTaintRules that do not select the device": {
			state: State{Slices: untainted, Claims: []*resourceapi.ResourceClaim{allocatedTaintClaim("a", nil, "gpu-0")}, DeviceTaintRules: []*resourceapi.DeviceTaintRule{
				taintRule("no-selector", hourBefore, nil, owned),
				taintRule("other-driver", hourBefore, &resourceapi.DeviceTaintSelector{Driver: ptr.To("nic.example.com")}, owned),
				taintRule("other-pool", hourBefore, &resourceapi.DeviceTaintSelector{Pool: ptr.To("node-b")}, owned),
				taintRule("other-device", hourBefore, &resourceapi.DeviceTaintSelector{Device: ptr.To("gpu-1")}, owned),
			}},
		},
		"DeviceTaintRule changed after the allocation": {
			state: State{Slices: untainted, Claims: []*resourceapi.ResourceClaim{allocatedTaintClaim("a", nil, "gpu-0")}, DeviceTaintRules: []*resourceapi.DeviceTaintRule{
				changedAt(taintRule("retargeted", hourBefore, &resourceapi.DeviceTaintSelector{Driver: ptr.To(driver)}, owned), allocatedAt.Add(time.Hour), ""),
			}},
		},
		"no allocation timestamp": {
			state: State{Slices: sliceWith(owned), Claims: []*resourceapi.ResourceClaim{func() *resourceapi.ResourceClaim {
				c := allocatedTaintClaim("a", nil, "gpu-0")
				c.Status.Allocation.AllocationTimestamp = nil
				return c
			}()}},
			notes: []string{"UntoleratedDeviceTaint not judged for ns/a: the allocation records no allocationTimestamp"},
		},
		"no timeAdded": {
			state: State{Slices: sliceWith(taint(ownedKey, resourceapi.DeviceTaintEffectNoSchedule, time.Time{})), Claims: []*resourceapi.ResourceClaim{allocatedTaintClaim("a", nil, "gpu-0")}},
			notes: []string{"UntoleratedDeviceTaint not judged for ns/a: a device taint that the allocation does not tolerate records no timeAdded"},
		},
		"no timestamps, tolerated": {
			state: State{Slices: sliceWith(taint(ownedKey, resourceapi.DeviceTaintEffectNoSchedule, time.Time{})), Claims: []*resourceapi.ResourceClaim{func() *resourceapi.ResourceClaim {
				c := allocatedTaintClaim("a", exists, "gpu-0")
				c.Status.Allocation.AllocationTimestamp = nil
				return c
			}()}},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			tc.state.DeviceClasses = []*resourceapi.DeviceClass{gpuClass()}
			found, notes := find(newJudge(context.Background()), tc.state)
			var got []Violation
			for _, f := range found {
				got = append(got, f.Violation)
			}
			expectViolations(t, got, tc.want)
			if len(notes) != len(tc.notes) {
				t.Fatalf("notes %q, want %d", notes, len(tc.notes))
			}
			for i, want := range tc.notes {
				if !strings.Contains(notes[i], want) {
					t.Errorf("note %q, want it to contain %q", notes[i], want)
				}
			}
		})
	}
}

// TestCheckDeviceTaintRules: CheckWith reads DeviceTaintRules and reports
// a device that a rule taints; where rules may not be listed, the taints
// of slices are still judged and the report, and topodra-check on
// stderr, say that the taints of rules were not; any other error of the
// rule list fails the read.
func TestCheckDeviceTaintRules(t *testing.T) {
	hourBefore := allocatedAt.Add(-time.Hour)
	owned := taint(ownedKey, resourceapi.DeviceTaintEffectNoSchedule, hourBefore)
	state := State{
		Slices: []*resourceapi.ResourceSlice{slice("node-a", 1, tainted("gpu-0", owned), tainted("gpu-1"))},
		Claims: []*resourceapi.ResourceClaim{
			allocatedTaintClaim("by-slice", nil, "gpu-0"),
			allocatedTaintClaim("by-rule", nil, "gpu-1"),
		},
		DeviceTaintRules: []*resourceapi.DeviceTaintRule{taintRule("owns", hourBefore, &resourceapi.DeviceTaintSelector{Driver: ptr.To(driver)}, owned)},
	}
	gpu0, gpu1 := &Device{driver, "node-a", "gpu-0"}, &Device{driver, "node-a", "gpu-1"}

	report, err := CheckWith(context.Background(), newFakeCluster(fakeRead{state: state}), CheckOptions{Interval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	expectViolations(t, report.Violations, []Violation{
		{Kind: UntoleratedDeviceTaint, Device: gpu0, Claims: []string{"ns/by-slice"}},
		{Kind: UntoleratedDeviceTaint, Device: gpu1, Claims: []string{"ns/by-rule"}},
	})
	if len(report.NotJudged) != 0 {
		t.Errorf("not judged: %q, want nothing", report.NotJudged)
	}

	forbidden := apierrors.NewForbidden(resourceapi.Resource("devicetaintrules"), "", errors.New("no list on devicetaintrules"))
	report, err = CheckWith(context.Background(), newFakeCluster(fakeRead{state: state, rulesErr: forbidden}), CheckOptions{Interval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	expectViolations(t, report.Violations, []Violation{{Kind: UntoleratedDeviceTaint, Device: gpu0, Claims: []string{"ns/by-slice"}}})
	if len(report.NotJudged) != 1 || !strings.Contains(report.NotJudged[0], "UntoleratedDeviceTaint: the taints of DeviceTaintRules not checked") {
		t.Errorf("not judged: %q, want one line on the taints of DeviceTaintRules", report.NotJudged)
	}

	var stdout, stderr bytes.Buffer
	if code := check(context.Background(), newFakeCluster(fakeRead{state: State{Slices: state.Slices}, rulesErr: forbidden}), CheckOptions{Interval: time.Millisecond}, "text", &stdout, &stderr); code != ExitClean ||
		!strings.Contains(stderr.String(), "the taints of DeviceTaintRules not checked") || !strings.Contains(stderr.String(), "list on devicetaintrules.resource.k8s.io") {
		t.Errorf("topodra-check: exit %d, stderr %q; want %d and a note that the taints of rules were not checked, naming the permission", code, stderr.String(), ExitClean)
	}

	unavailable := apierrors.NewServiceUnavailable("etcd is down")
	if _, err := CheckWith(context.Background(), newFakeCluster(fakeRead{state: state, rulesErr: unavailable}), CheckOptions{Interval: time.Millisecond}); !apierrors.IsServiceUnavailable(err) {
		t.Errorf("error %v, want the rule list's", err)
	}
}
