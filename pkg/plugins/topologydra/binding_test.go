package topologydra

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	fwk "k8s.io/kube-scheduler/framework"
	schedmetrics "k8s.io/kubernetes/pkg/scheduler/metrics"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/invariant"
	"github.com/topodra/topodra/pkg/topology"
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
	// poolSlice is slice name of pool d/p, at generation, one of count.
	poolSlice := func(name string, generation, count int64, devices ...string) *resourceapi.ResourceSlice {
		s := &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: name}}
		s.Spec.Driver = "d"
		s.Spec.Pool = resourceapi.ResourcePool{Name: "p", Generation: generation, ResourceSliceCount: count}
		for _, d := range devices {
			s.Spec.Devices = append(s.Spec.Devices, resourceapi.Device{Name: d})
		}
		return s
	}
	pl := &TopologyDRA{bindingTimeout: 10 * time.Minute}
	tests := map[string]struct {
		claim     *resourceapi.ResourceClaim
		now       time.Time
		wantReady bool
		wantErr   error
		// resourceSlices, if not nil, tell which devices are published,
		// pending or gone.
		resourceSlices []*resourceapi.ResourceSlice
		// presenceErr, if set, is the error of reading the slices.
		presenceErr error
	}{
		"pending, within the timeout": {claim: claim(), now: allocatedAt.Add(time.Minute)},
		"pending, past the timeout":   {claim: claim(), now: allocatedAt.Add(11 * time.Minute), wantErr: errBindingTimeout},
		"ready":                       {claim: claim("Attached"), now: allocatedAt.Add(11 * time.Minute), wantReady: true},
		"failed":                      {claim: claim("AttachFailed"), now: allocatedAt.Add(time.Minute), wantErr: errBindingFailed},
		"failure wins over success":   {claim: claim("Attached", "AttachFailed"), now: allocatedAt, wantErr: errBindingFailed},
		"unallocated":                 {claim: &resourceapi.ResourceClaim{}, now: allocatedAt},
		"pending, device published": {claim: claim(), now: allocatedAt,
			resourceSlices: []*resourceapi.ResourceSlice{poolSlice("a", 1, 1, "plain", "bound")}},
		"pending, device vanished": {claim: claim(), now: allocatedAt,
			resourceSlices: []*resourceapi.ResourceSlice{poolSlice("a", 1, 1, "plain")}, wantErr: errDeviceVanished},
		"pending, device vanished in a complete new generation": {claim: claim(), now: allocatedAt,
			resourceSlices: []*resourceapi.ResourceSlice{poolSlice("a", 2, 2, "plain"), poolSlice("b", 2, 2), poolSlice("b-old", 1, 2, "bound")}, wantErr: errDeviceVanished},
		"pending, pool republished slice by slice": {claim: claim(), now: allocatedAt,
			resourceSlices: []*resourceapi.ResourceSlice{poolSlice("a", 2, 2, "plain"), poolSlice("b", 1, 2, "bound")}},
		"pending, pool without slices": {claim: claim(), now: allocatedAt,
			resourceSlices: []*resourceapi.ResourceSlice{}, wantErr: errDeviceVanished},
		"pending, slices unreadable": {claim: claim(), now: allocatedAt, presenceErr: errors.New("list resource slices: cache not synced")},
		"ready, device vanished since": {claim: claim("Attached"), now: allocatedAt, wantReady: true,
			resourceSlices: []*resourceapi.ResourceSlice{}},
		"no timestamp: no timeout counted": {claim: func() *resourceapi.ResourceClaim {
			c := claim()
			c.Status.Allocation.AllocationTimestamp = nil
			return c
		}(), now: allocatedAt.Add(time.Hour)},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var presence func(invariant.Device) (invariant.Presence, error)
			switch {
			case tc.presenceErr != nil:
				presence = func(invariant.Device) (invariant.Presence, error) { return invariant.DeviceGone, tc.presenceErr }
			case tc.resourceSlices != nil:
				publication := invariant.Publish(tc.resourceSlices)
				presence = func(d invariant.Device) (invariant.Presence, error) { return publication.Presence(d), nil }
			}
			ready, err := pl.bindingState(tc.claim, tc.now, presence)
			if ready != tc.wantReady || !errors.Is(err, tc.wantErr) || (tc.wantErr == nil && err != nil) {
				t.Errorf("got ready %v, err %v; want ready %v, err %v", ready, err, tc.wantReady, tc.wantErr)
			}
		})
	}
}

// TestPreBindStopsWaitingForDeletedClaim: the pod waits in PreBind for the
// binding conditions of its devices; its claim is deleted meanwhile. PreBind
// must give up with an error that names the claim, instead of binding the
// pod once the driver confirms, or waiting out the binding timeout.
func TestPreBindStopsWaitingForDeletedClaim(t *testing.T) {
	h, _, done := waitingInPreBind(t)
	claim := h.apiClaim("c")
	claim.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	_, err := h.client.ResourceV1().ResourceClaims(testNS).Update(h.tCtx, claim, metav1.UpdateOptions{})
	h.tCtx.ExpectNoError(err)
	expectPreBindEnds(t, done, "claim c is being deleted")
}

// TestPreBindStopsWaitingForDeletedPod: the pod waits in PreBind for the
// binding conditions of its devices and is deleted meanwhile. PreBind gives
// up with an error naming the pod, instead of waiting out the binding
// timeout for devices nothing would use.
func TestPreBindStopsWaitingForDeletedPod(t *testing.T) {
	h, pod, done := waitingInPreBind(t)
	h.tCtx.ExpectNoError(h.client.CoreV1().Pods(testNS).Delete(h.tCtx, pod.Name, metav1.DeleteOptions{}))
	expectPreBindEnds(t, done, "was deleted while waiting for binding conditions")
}

// TestPreBindStopsWaitingForTaintedDevice: the pod waits in PreBind for
// the binding conditions of its device, which gets a health taint
// meanwhile. PreBind gives up with an error naming the device and the
// taint, instead of binding the pod to it once the driver confirms.
func TestPreBindStopsWaitingForTaintedDevice(t *testing.T) {
	h, _, done := waitingInPreBind(t)
	alloc := h.apiClaim("c").Status.Allocation
	if alloc == nil || len(alloc.Devices.Results) != 1 {
		t.Fatalf("claim c allocated %v, want one device", alloc)
	}
	device := alloc.Devices.Results[0].Device
	h.taintDevice("node-a", device, healthKey)
	expectPreBindEnds(t, done, device+" has the taint "+healthKey+"=xid-79:NoSchedule")
}

// waitingInPreBind starts PreBind for pod "p", whose claim "c" got a
// device with binding conditions that the driver never reports on node-a,
// and returns once the claim is reserved for the pod (PreBind waits then);
// done receives PreBind's status.
func waitingInPreBind(t *testing.T) (*harness, *v1.Pod, <-chan *fwk.Status) {
	t.Helper()
	schedmetrics.Register() // PreBind records the binding-condition metrics.
	slice := testSlice("node-a", 2)
	for i := range slice.Spec.Devices {
		slice.Spec.Devices[i].BindsToNode = ptr.To(true)
		slice.Spec.Devices[i].BindingConditions = []string{"Attached"}
		slice.Spec.Devices[i].BindingFailureConditions = []string{"AttachFailed"}
	}
	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), slice, testClaim("c", 1))
	if !h.pl.features.DeviceBindingAndStatus {
		t.Fatal("binding conditions are disabled by the feature gates; this test needs them")
	}
	pod := h.createSeen(testPod("p", "c"))
	cs, _ := h.cycle(pod, "node-a")
	if st := h.pl.Reserve(h.tCtx, cs, pod, "node-a"); !st.IsSuccess() {
		t.Fatalf("Reserve: %v", st)
	}
	done := make(chan *fwk.Status, 1)
	go func() { done <- h.pl.PreBind(h.tCtx, cs, pod, "node-a") }()
	h.waitForClaim("c", func(c *resourceapi.ResourceClaim) bool { return len(c.Status.ReservedFor) == 1 })
	return h, pod, done
}

// expectPreBindEnds waits for PreBind's status on done and wants an error
// that contains want.
func expectPreBindEnds(t *testing.T, done <-chan *fwk.Status, want string) {
	t.Helper()
	select {
	case st := <-done:
		if st.IsSuccess() || !strings.Contains(st.Message(), want) {
			t.Errorf("PreBind: %v, want an error containing %q", st, want)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("PreBind still waits for binding conditions; want it to end with %q", want)
	}
}

// TestBindingWaitWithoutTimestamp: a claim with binding conditions that
// another writer allocated without an allocation timestamp, whose driver
// never reports. PreBind's wait ends after bindingTimeout, as a timeout.
func TestBindingWaitWithoutTimestamp(t *testing.T) {
	c := allocatedOn(testClaim("c", 1), "node-a", "gpu-0")
	c.Status.Allocation.Devices.Results[0].BindingConditions = []string{"Attached"}
	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 2), c)
	h.waitForClaim("c", func(*resourceapi.ResourceClaim) bool { return true })
	if !h.pl.features.DeviceBindingAndStatus {
		t.Fatal("DRADeviceBindingConditions is off in this build's feature defaults")
	}
	schedmetrics.Register() // the wait records the binding-condition metrics.
	h.pl.bindingTimeout = 300 * time.Millisecond
	s := &stateData{claims: []*resourceapi.ResourceClaim{h.apiClaim("c")}}
	st := h.pl.waitForBindingConditions(h.tCtx, h.createSeen(testPod("p", "c")), "node-a", s)
	if st.IsSuccess() || !strings.Contains(st.Message(), "binding timeout") {
		t.Errorf("PreBind's wait: %v, want a binding timeout", st)
	}
}

// TestBindingTimeoutOfAllocationWithoutTimestamp: the same claim, through
// the pod's attempts. The allocation is immutable, so it stays without a
// timestamp; the timeout counts from the first wait for it, so the next
// attempt after the timeout finds the allocation unusable (PostFilter
// then gives it back) instead of waiting it out again on every attempt.
// Once the claim is deallocated, the first wait is forgotten.
func TestBindingTimeoutOfAllocationWithoutTimestamp(t *testing.T) {
	c := allocatedOn(testClaim("c", 1), "node-a", "gpu-0")
	c.Status.Allocation.Devices.Results[0].BindingConditions = []string{"Attached"}
	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 2), c)
	h.waitForClaim("c", func(*resourceapi.ResourceClaim) bool { return true })
	schedmetrics.Register()
	h.pl.bindingTimeout = 200 * time.Millisecond
	pod := h.createSeen(testPod("p", "c"))
	cs := h.reserve(pod, "node-a")
	if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); st.IsSuccess() || !strings.Contains(st.Message(), "binding timeout") {
		t.Fatalf("first attempt, PreBind: %v, want a binding timeout", st)
	}
	h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
	claim := h.apiClaim("c")
	if claim.Status.Allocation.AllocationTimestamp != nil {
		t.Error("the allocation was changed (stamped); the API refuses changes of an allocation")
	}
	if _, st := h.cycle(pod, "node-a"); st["node-a"].IsSuccess() || !strings.Contains(st["node-a"].Message(), "binding timeout") {
		t.Errorf("second attempt, Filter: %v, want the allocation unusable after its binding timeout", st["node-a"])
	}

	claim.Status.Allocation = nil
	claim.Status.ReservedFor = nil
	_, err := h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(h.tCtx, claim, metav1.UpdateOptions{})
	h.tCtx.ExpectNoError(err)
	err = wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		_, waited := h.pl.untimed.since(claim.UID)
		return !waited, nil
	})
	h.tCtx.ExpectNoError(err, "the first wait of a deallocated claim is still recorded")
}

// TestBindingWaitsThroughPoolUpdate: a claim waits for the binding
// conditions of a device in the second of the two slices of its pool. The
// driver republishes the pool slice by slice; while only the first slice
// is at the new generation, the device is in no slice of it yet, but the
// pool is incomplete, so the device is not gone: Filter keeps the
// allocation, and PreBind waits (here until the binding timeout). Once the
// new generation is complete without the device, it is gone, and Filter
// refuses the allocation so that PostFilter can release it.
func TestBindingWaitsThroughPoolUpdate(t *testing.T) {
	first := testSlice("node-a", 2)
	first.Spec.Pool.ResourceSliceCount = 2
	second := testSlice("node-a", 4)
	second.Name = "node-a-gpus-2"
	second.Spec.Pool.ResourceSliceCount = 2
	second.Spec.Devices = second.Spec.Devices[2:]
	// Without a timestamp, the binding timeout counts from PreBind's first
	// wait, so the cycles before it see no timeout.
	c := allocatedOn(testClaim("c", 1), "node-a", "gpu-2")
	c.Status.Allocation.Devices.Results[0].BindingConditions = []string{"Attached"}
	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), first, second, c)
	h.waitForClaim("c", func(*resourceapi.ResourceClaim) bool { return true })
	if !h.pl.features.DeviceBindingAndStatus {
		t.Fatal("DRADeviceBindingConditions is off in this build's feature defaults")
	}
	schedmetrics.Register() // PreBind records the binding-condition metrics.
	republish := func(s *resourceapi.ResourceSlice, devices ...string) {
		t.Helper()
		s.Spec.Pool.Generation = 2
		s.Spec.Devices = slices.DeleteFunc(s.Spec.Devices, func(d resourceapi.Device) bool { return !slices.Contains(devices, d.Name) })
		_, err := h.client.ResourceV1().ResourceSlices().Update(h.tCtx, s, metav1.UpdateOptions{})
		h.tCtx.ExpectNoError(err)
		err = wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
			cached, err := h.pl.draManager.ResourceSlices().ListWithDeviceTaintRules()
			return slices.ContainsFunc(cached, func(c *resourceapi.ResourceSlice) bool {
				return c.Name == s.Name && c.Spec.Pool.Generation == 2
			}), err
		})
		h.tCtx.ExpectNoError(err, "slice "+s.Name+" at generation 2 in the plugin's slice cache")
	}
	pod := h.createSeen(testPod("p", "c"))

	republish(first, "gpu-0", "gpu-1")
	cs := h.reserve(pod, "node-a")
	h.pl.bindingTimeout = 600 * time.Millisecond
	if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); st.IsSuccess() || !strings.Contains(st.Message(), "binding timeout") {
		t.Errorf("pool being republished, PreBind: %v, want a wait until the binding timeout", st)
	}
	h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
	h.pl.bindingTimeout = 10 * time.Minute

	republish(second, "gpu-3")
	if _, st := h.cycle(pod, "node-a"); st["node-a"].IsSuccess() || !strings.Contains(st["node-a"].Message(), "no longer exists") {
		t.Errorf("pool republished without gpu-2, Filter: %v, want the allocated device gone", st["node-a"])
	}
}

// BenchmarkBindingPresence measures one poll's question of PreBind's wait
// for binding conditions, whether a device not ready yet is still
// published, on 1,000 nodes of 8 GPUs: a lookup per poll, one question.
func BenchmarkBindingPresence(b *testing.B) {
	var nodes []*v1.Node
	var objs []runtime.Object
	for n := range 1000 {
		name := fmt.Sprintf("node-%d", n)
		nodes = append(nodes, testNode(name))
		objs = append(objs, testSlice(name, 8))
	}
	h := newHarness(b, nodes, objs...)
	device := invariant.Device{Driver: topology.DriverName, Pool: "node-500", Name: "gpu-3"}
	for b.Loop() {
		if p, err := h.pl.newPublishedLookup().presence(device); err != nil || p != invariant.DevicePublished {
			b.Fatalf("presence of %v = %v, %v; want published", device, p, err)
		}
	}
}
