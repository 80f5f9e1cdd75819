package topologydra

import (
	"errors"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestBindingState(t *testing.T) {
	allocatedAt := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	claim := func(conditions ...string) *resourceapi.ResourceClaim {
		c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "c"}}
		c.Status.Allocation = &resourceapi.AllocationResult{AllocationTimestamp: &metav1.Time{Time: allocatedAt}}
		c.Status.Allocation.Devices.Results = []resourceapi.DeviceRequestAllocationResult{
			{Request: "r", Driver: "d", Pool: "p", Device: "plain"},
			{Request: "r", Driver: "d", Pool: "p", Device: "bound", BindingConditions: []string{"Attached"}, BindingFailureConditions: []string{"AttachFailed"}},
		}
		st := resourceapi.AllocatedDeviceStatus{Driver: "d", Pool: "p", Device: "bound"}
		for _, cond := range conditions {
			st.Conditions = append(st.Conditions, metav1.Condition{Type: cond, Status: metav1.ConditionTrue})
		}
		c.Status.Devices = []resourceapi.AllocatedDeviceStatus{st}
		return c
	}
	pl := &TopologyDRA{bindingTimeout: 10 * time.Minute}
	tests := map[string]struct {
		claim     *resourceapi.ResourceClaim
		now       time.Time
		wantReady bool
		wantErr   error
	}{
		"pending, within the timeout": {claim: claim(), now: allocatedAt.Add(time.Minute)},
		"pending, past the timeout":   {claim: claim(), now: allocatedAt.Add(11 * time.Minute), wantErr: errBindingTimeout},
		"ready":                       {claim: claim("Attached"), now: allocatedAt.Add(11 * time.Minute), wantReady: true},
		"failed":                      {claim: claim("AttachFailed"), now: allocatedAt.Add(time.Minute), wantErr: errBindingFailed},
		"failure wins over success":   {claim: claim("Attached", "AttachFailed"), now: allocatedAt, wantErr: errBindingFailed},
		"unallocated":                 {claim: &resourceapi.ResourceClaim{}, now: allocatedAt},
		"no timestamp: no timeout counted": {claim: func() *resourceapi.ResourceClaim {
			c := claim()
			c.Status.Allocation.AllocationTimestamp = nil
			return c
		}(), now: allocatedAt.Add(time.Hour)},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			ready, err := pl.bindingState(tc.claim, tc.now)
			if ready != tc.wantReady || !errors.Is(err, tc.wantErr) || (tc.wantErr == nil && err != nil) {
				t.Errorf("got ready %v, err %v; want ready %v, err %v", ready, err, tc.wantReady, tc.wantErr)
			}
		})
	}
}
