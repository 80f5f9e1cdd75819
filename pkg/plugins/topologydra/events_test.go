package topologydra

import (
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/utils/ptr"
)

func TestClaimQueueingHint(t *testing.T) {
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p"},
		Spec:       v1.PodSpec{ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: ptr.To("mine")}}},
	}
	claim := func(name string, allocated bool, reserved int) *resourceapi.ResourceClaim {
		c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name}}
		if allocated {
			c.Status.Allocation = &resourceapi.AllocationResult{}
		}
		for range reserved {
			c.Status.ReservedFor = append(c.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{Resource: "pods", Name: "x"})
		}
		return c
	}
	pl := &TopologyDRA{}
	tests := map[string]struct {
		old, new *resourceapi.ResourceClaim
		want     fwk.QueueingHint
	}{
		"own claim created":                 {new: claim("mine", false, 0), want: fwk.Queue},
		"own claim status changed":          {old: claim("mine", false, 0), new: claim("mine", true, 0), want: fwk.Queue},
		"own claim unchanged status":        {old: claim("mine", true, 1), new: claim("mine", true, 1), want: fwk.QueueSkip},
		"other claim allocated":             {old: claim("other", false, 0), new: claim("other", true, 1), want: fwk.QueueSkip},
		"other claim deallocated":           {old: claim("other", true, 0), new: claim("other", false, 0), want: fwk.Queue},
		"other allocated claim deleted":     {old: claim("other", true, 0), want: fwk.Queue},
		"other unallocated claim deleted":   {old: claim("other", false, 0), want: fwk.QueueSkip},
		"claim in other namespace, my name": {new: &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "x", Name: "mine"}}, want: fwk.QueueSkip},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var oldObj, newObj any
			if tc.old != nil {
				oldObj = tc.old
			}
			if tc.new != nil {
				newObj = tc.new
			}
			got, err := pl.isSchedulableAfterClaimChange(klog.Background(), pod, oldObj, newObj)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("hint = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestSliceQueueingHint(t *testing.T) {
	pl := &TopologyDRA{}
	a := &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: "s", ResourceVersion: "1"}, Spec: resourceapi.ResourceSliceSpec{Driver: "d"}}
	metaOnly := a.DeepCopy()
	metaOnly.ResourceVersion = "2"
	withDevice := a.DeepCopy()
	withDevice.Spec.Devices = []resourceapi.Device{{Name: "gpu-0"}}
	for name, tc := range map[string]struct {
		old, new *resourceapi.ResourceSlice
		want     fwk.QueueingHint
	}{
		"new slice":       {new: a, want: fwk.Queue},
		"metadata-only":   {old: a, new: metaOnly, want: fwk.QueueSkip},
		"devices changed": {old: a, new: withDevice, want: fwk.Queue},
	} {
		t.Run(name, func(t *testing.T) {
			var oldObj any
			if tc.old != nil {
				oldObj = tc.old
			}
			got, err := pl.isSchedulableAfterSliceChange(klog.Background(), nil, oldObj, tc.new)
			if err != nil || got != tc.want {
				t.Errorf("hint = %v (%v), want %v", got, err, tc.want)
			}
		})
	}
}
