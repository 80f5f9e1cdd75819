package invariant

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	clienttesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"
)

// fakeRead is what one read of a fake cluster sees.
type fakeRead struct {
	state State
	// err, if set, is the error of the read's claim list.
	err error
	// nodesErr, if set, is the error of the read's node list.
	nodesErr error
	// classesErr, if set, is the error of the read's device class list.
	classesErr error
	// rulesErr, if set, is the error of the read's device taint rule
	// list.
	rulesErr error
}

// fakeCluster is a client whose n-th read (pods, claims and slices listed
// in this order) sees reads[n-1], and every later read the last of
// reads; a read whose state has no DeviceClasses sees gpuClass, the class
// of the claims of claim(). A list with a limit is served in pages of
// that size.
type fakeCluster struct {
	*fake.Clientset
	reads []fakeRead
	// n counts the reads begun: the first pages of the pod list.
	n int
	// limits has the limit of every list request, by resource.
	limits map[string][]int64
}

func newFakeCluster(reads ...fakeRead) *fakeCluster {
	c := &fakeCluster{Clientset: fake.NewClientset(), reads: reads, limits: map[string][]int64{}}
	c.PrependReactor("list", "*", func(a clienttesting.Action) (bool, runtime.Object, error) {
		opts := a.(clienttesting.ListActionImpl).GetListOptions()
		resource := a.GetResource().Resource
		c.limits[resource] = append(c.limits[resource], opts.Limit)
		if resource == "pods" && opts.Continue == "" {
			c.n++
		}
		read := c.reads[min(c.n, len(c.reads))-1]
		start, _ := strconv.Atoi(opts.Continue)
		var items []runtime.Object
		switch resource {
		case "pods":
			for _, p := range read.state.Pods {
				items = append(items, p)
			}
		case "resourceclaims":
			if read.err != nil {
				return true, nil, read.err
			}
			for _, c := range read.state.Claims {
				items = append(items, c)
			}
		case "resourceslices":
			for _, s := range read.state.Slices {
				items = append(items, s)
			}
		case "nodes":
			if read.nodesErr != nil {
				return true, nil, read.nodesErr
			}
			for _, n := range read.state.Nodes {
				items = append(items, n)
			}
		case "deviceclasses":
			if read.classesErr != nil {
				return true, nil, read.classesErr
			}
			classes := read.state.DeviceClasses
			if classes == nil {
				classes = []*resourceapi.DeviceClass{gpuClass()}
			}
			for _, c := range classes {
				items = append(items, c)
			}
		case "devicetaintrules":
			if read.rulesErr != nil {
				return true, nil, read.rulesErr
			}
			for _, r := range read.state.DeviceTaintRules {
				items = append(items, r)
			}
		}
		end := len(items)
		var next string
		if opts.Limit > 0 && start+int(opts.Limit) < end {
			end = start + int(opts.Limit)
			next = strconv.Itoa(end)
		}
		page := items[min(start, len(items)):end]
		meta := metav1.ListMeta{Continue: next}
		switch resource {
		case "pods":
			l := &v1.PodList{ListMeta: meta}
			for _, o := range page {
				l.Items = append(l.Items, *o.(*v1.Pod))
			}
			return true, l, nil
		case "resourceclaims":
			l := &resourceapi.ResourceClaimList{ListMeta: meta}
			for _, o := range page {
				l.Items = append(l.Items, *o.(*resourceapi.ResourceClaim))
			}
			return true, l, nil
		case "resourceslices":
			l := &resourceapi.ResourceSliceList{ListMeta: meta}
			for _, o := range page {
				l.Items = append(l.Items, *o.(*resourceapi.ResourceSlice))
			}
			return true, l, nil
		case "nodes":
			l := &v1.NodeList{ListMeta: meta}
			for _, o := range page {
				l.Items = append(l.Items, *o.(*v1.Node))
			}
			return true, l, nil
		case "deviceclasses":
			l := &resourceapi.DeviceClassList{ListMeta: meta}
			for _, o := range page {
				l.Items = append(l.Items, *o.(*resourceapi.DeviceClass))
			}
			return true, l, nil
		case "devicetaintrules":
			l := &resourceapi.DeviceTaintRuleList{ListMeta: meta}
			for _, o := range page {
				l.Items = append(l.Items, *o.(*resourceapi.DeviceTaintRule))
			}
			return true, l, nil
		}
		return false, nil, nil
	})
	return c
}

// noGets fails the test for every get request the client saw: re-reads
// list, so their cost does not grow with the violations found.
func (c *fakeCluster) noGets(t *testing.T) {
	t.Helper()
	for _, a := range c.Actions() {
		if a.GetVerb() == "get" {
			t.Errorf("unexpected get of %s", a.GetResource().Resource)
		}
	}
}

// poolSlice is slice name of pool "node-a", at generation, one of count.
func poolSlice(name string, generation, count int64, devs ...resourceapi.Device) *resourceapi.ResourceSlice {
	s := slice("node-a", generation, devs...)
	s.Name = name
	s.Spec.Pool.ResourceSliceCount = count
	return s
}

// withShareID gives every allocation of c a share ID.
func withShareID(c *resourceapi.ResourceClaim) *resourceapi.ResourceClaim {
	for i := range c.Status.Allocation.Devices.Results {
		c.Status.Allocation.Devices.Results[i].ShareID = ptr.To(c.UID + "-share")
	}
	return c
}

// TestCheckWith: a violation is reported only if every read finds it;
// one that may be an artefact of a pool being republished slice by slice
// is pending while its device is pending, and a failed re-read returns
// what the reads before it found with an IncompleteError.
func TestCheckWith(t *testing.T) {
	gpu2 := &Device{driver, "node-a", "gpu-2"}
	link := &Device{driver, "node-a", "link"}
	shared := resourceapi.Device{Name: "link", AllowMultipleAllocations: ptr.To(true)}
	// The pool node-a of two slices: "first" with gpu-0 and gpu-1,
	// "second" with gpu-2, gpu-3 and link.
	complete := []*resourceapi.ResourceSlice{
		poolSlice("first", 2, 2, devices("gpu-0", "gpu-1")...),
		poolSlice("second", 2, 2, append(devices("gpu-2", "gpu-3"), shared)...),
	}
	// The driver has republished "first" under generation 2, not yet
	// "second".
	midRepublish := []*resourceapi.ResourceSlice{
		poolSlice("first", 2, 2, devices("gpu-0", "gpu-1")...),
		poolSlice("second", 1, 2, append(devices("gpu-2", "gpu-3"), shared)...),
	}
	// The driver has republished the pool without gpu-2 and link.
	withoutGPU2 := []*resourceapi.ResourceSlice{
		poolSlice("first", 2, 2, devices("gpu-0", "gpu-1")...),
		poolSlice("second", 2, 2, devices("gpu-3")...),
	}
	onGPU2 := []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-2")}
	// Reserved for a pod that does not exist.
	staleOnGPU2 := []*resourceapi.ResourceClaim{claim("a", "node-a", "gone-uid", "gpu-2")}
	twiceOnGPU2 := []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-2"), claim("b", "node-a", "", "gpu-2")}
	sharesOfLink := []*resourceapi.ResourceClaim{withShareID(claim("a", "node-a", "", "link")), withShareID(claim("b", "node-a", "", "link"))}
	unreachable := apierrors.NewServiceUnavailable("etcd is down")
	bound := pod("p", "p-uid", "node-a", "a")
	// Reserved for a pod that succeeded at finished.
	staleOfDone := func(finished time.Time) State {
		p := finishedPod("done", "done-uid", "node-a", finished, "a")
		return State{Slices: complete, Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "done-uid", "gpu-2")}, Pods: []*v1.Pod{p}}
	}
	// Pool node-a with gpu-2 and gpu-3 in the cliques named, and a claim
	// of both under a matchAttribute constraint on the clique.
	cliques := func(gpu2, gpu3 string) []*resourceapi.ResourceSlice {
		return []*resourceapi.ResourceSlice{slice("node-a", 1, gpu("gpu-2", "gpu", gpu2), gpu("gpu-3", "gpu", gpu3))}
	}
	oneClique := claim("a", "node-a", "", "gpu-2", "gpu-3")
	oneClique.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{sameClique()}
	// Allocated by a scheduler (with the allocation's finalizer) and
	// reserved for no one: its pod's binding cycle failed.
	unreserved := claim("a", "node-a", "", "gpu-2")
	unreserved.Finalizers = []string{resourceapi.Finalizer}
	pending := pod("waiting", "waiting-uid", "", "a")
	succeeded := finishedPod("done", "done-uid", "node-a", time.Now().Add(-time.Hour), "a")
	tests := map[string]struct {
		reads []fakeRead
		// staleAfter is CheckOptions.StaleAfter.
		staleAfter time.Duration
		// unpublishedAfter is CheckOptions.UnpublishedAfter.
		unpublishedAfter time.Duration
		want             []Violation
		wantPending      []Violation
		wantReads        int
		// wantIncomplete: the error is an IncompleteError after
		// wantReads reads.
		wantIncomplete bool
		wantErr        bool
	}{
		"clean cluster is read once": {
			reads:     []fakeRead{{state: State{Slices: complete, Claims: onGPU2}}},
			wantReads: 1,
		},
		"violation found again is reported": {
			reads:     []fakeRead{{state: State{Slices: complete, Claims: twiceOnGPU2}}},
			want:      []Violation{{Kind: DoubleAllocation, Device: gpu2, Claims: []string{"ns/a", "ns/b"}}},
			wantReads: 2,
		},
		"device violation gone at the re-read": {
			reads: []fakeRead{
				{state: State{Slices: complete, Claims: twiceOnGPU2}},
				{state: State{Slices: complete, Claims: onGPU2}},
			},
			wantReads: 2,
		},
		"pod violation gone at the re-read": {
			reads: []fakeRead{
				{state: State{Slices: complete, Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-2")}, Pods: []*v1.Pod{bound}}},
				{state: State{Slices: complete, Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "p-uid", "gpu-2")}, Pods: []*v1.Pod{bound}}},
			},
			wantReads: 2,
		},
		"pod violation found again is reported": {
			reads:     []fakeRead{{state: State{Slices: complete, Claims: onGPU2, Pods: []*v1.Pod{bound}}}},
			want:      []Violation{{Kind: PodClaimNotReserved, Pod: "ns/p", Claims: []string{"ns/a"}}},
			wantReads: 2,
		},
		"pod on another node than its claim's devices is reported": {
			reads: []fakeRead{{state: State{
				Slices: complete,
				Claims: []*resourceapi.ResourceClaim{onNode(claim("a", "node-a", "p-uid", "gpu-2"), "node-a")},
				Pods:   []*v1.Pod{pod("p", "p-uid", "node-b", "a")},
				Nodes:  []*v1.Node{{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}}, {ObjectMeta: metav1.ObjectMeta{Name: "node-b"}}},
			}}},
			want:      []Violation{{Kind: PodClaimOnOtherNode, Pod: "ns/p", Claims: []string{"ns/a"}}},
			wantReads: 2,
		},
		"stale reservation repaired after the first re-read": {
			reads: []fakeRead{
				{state: State{Slices: complete, Claims: staleOnGPU2}},
				{state: State{Slices: complete, Claims: staleOnGPU2}},
				{state: State{Slices: complete, Claims: onGPU2}},
			},
			wantReads: 3,
		},
		"stale reservation for another pod at each read is not reported": {
			// Pods created between the pod list and the claim list of
			// each read: the controller would find them.
			reads: []fakeRead{
				{state: State{Slices: complete, Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "new-1", "gpu-2")}}},
				{state: State{Slices: complete, Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "new-2", "gpu-2")}}},
			},
			wantReads: 2,
		},
		"device held twice by other claims at each read is reported": {
			reads: []fakeRead{
				{state: State{Slices: complete, Claims: twiceOnGPU2}},
				{state: State{Slices: complete, Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-2"), claim("c", "node-a", "", "gpu-2")}}},
			},
			want:      []Violation{{Kind: DoubleAllocation, Device: gpu2, Claims: []string{"ns/a", "ns/c"}}},
			wantReads: 2,
		},
		"stale reservation of a gone pod through every read is pending": {
			// The reads span 2 ms, far less than the default StaleAfter:
			// the pod may have gone just before the first.
			reads:       []fakeRead{{state: State{Slices: complete, Claims: staleOnGPU2}}},
			wantPending: []Violation{{Kind: StaleReservation, Claims: []string{"ns/a"}}},
			wantReads:   DefaultReads,
		},
		"stale reservation of a gone pod through reads spanning stale-after is reported": {
			// Two waits of at least 1 ms each.
			reads:      []fakeRead{{state: State{Slices: complete, Claims: staleOnGPU2}}},
			staleAfter: 2 * time.Millisecond,
			want:       []Violation{{Kind: StaleReservation, Claims: []string{"ns/a"}}},
			wantReads:  DefaultReads,
		},
		"stale reservation without a wait is reported": {
			reads:      []fakeRead{{state: State{Slices: complete, Claims: staleOnGPU2}}},
			staleAfter: -1,
			want:       []Violation{{Kind: StaleReservation, Claims: []string{"ns/a"}}},
			wantReads:  DefaultReads,
		},
		"stale reservation of a pod that just succeeded is pending": {
			reads:       []fakeRead{{state: staleOfDone(time.Now())}},
			wantPending: []Violation{{Kind: StaleReservation, Claims: []string{"ns/a"}}},
			wantReads:   DefaultReads,
		},
		"stale reservation of a pod that succeeded long ago is reported": {
			reads:     []fakeRead{{state: staleOfDone(time.Now().Add(-2 * DefaultStaleAfter))}},
			want:      []Violation{{Kind: StaleReservation, Claims: []string{"ns/a"}}},
			wantReads: DefaultReads,
		},
		"stale reservation of a pod that succeeded 10 minutes ago, stale after 2 minutes": {
			reads:      []fakeRead{{state: staleOfDone(time.Now().Add(-10 * time.Minute))}},
			staleAfter: 2 * time.Minute,
			want:       []Violation{{Kind: StaleReservation, Claims: []string{"ns/a"}}},
			wantReads:  DefaultReads,
		},
		"device of a slice not yet republished is pending": {
			reads:       []fakeRead{{state: State{Slices: midRepublish, Claims: onGPU2}}},
			wantPending: []Violation{{Kind: VanishedDevice, Device: gpu2, Claims: []string{"ns/a"}}},
			wantReads:   DefaultReads,
		},
		"devices of a pool without slices are pending": {
			// The kubelet has removed the node's slices (it starts, or
			// the driver unregistered) or the node was deleted.
			reads: []fakeRead{{state: State{
				Slices: []*resourceapi.ResourceSlice{slice("node-b", 1, devices("gpu-0")...)},
				Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-2", "gpu-3"), claim("b", "node-a", "", "gpu-0")},
			}}},
			wantPending: []Violation{{Kind: UnpublishedPool, Pool: driver + "/node-a", Claims: []string{"ns/a", "ns/b"}}},
			wantReads:   DefaultReads,
		},
		"devices of a pool without slices through reads spanning unpublished-after are reported": {
			// Two waits of at least 1 ms each.
			reads: []fakeRead{{state: State{
				Slices: []*resourceapi.ResourceSlice{slice("node-b", 1, devices("gpu-0")...)},
				Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-2", "gpu-3"), claim("b", "node-a", "", "gpu-0")},
			}}},
			unpublishedAfter: 2 * time.Millisecond,
			want:             []Violation{{Kind: UnpublishedPool, Pool: driver + "/node-a", Claims: []string{"ns/a", "ns/b"}}},
			wantReads:        DefaultReads,
		},
		"devices of a pool without slices without a wait are reported": {
			reads:            []fakeRead{{state: State{Claims: onGPU2}}},
			unpublishedAfter: -1,
			want:             []Violation{{Kind: UnpublishedPool, Pool: driver + "/node-a", Claims: []string{"ns/a"}}},
			wantReads:        DefaultReads,
		},
		"a pool without slices published again at the last read": {
			// Every read must find it, also without a wait.
			reads: []fakeRead{
				{state: State{Claims: onGPU2}},
				{state: State{Claims: onGPU2}},
				{state: State{Slices: complete, Claims: onGPU2}},
			},
			unpublishedAfter: -1,
			wantReads:        DefaultReads,
		},
		"a pool without slices published again": {
			reads: []fakeRead{
				{state: State{Claims: onGPU2}},
				{state: State{Slices: complete, Claims: onGPU2}},
			},
			wantReads: 2,
		},
		"republish completes between reads": {
			reads: []fakeRead{
				{state: State{Slices: midRepublish, Claims: onGPU2}},
				{state: State{Slices: complete, Claims: onGPU2}},
			},
			wantReads: 2,
		},
		"republish completes without the device": {
			reads: []fakeRead{
				{state: State{Slices: midRepublish, Claims: onGPU2}},
				{state: State{Slices: withoutGPU2, Claims: onGPU2}},
			},
			want:      []Violation{{Kind: VanishedDevice, Device: gpu2, Claims: []string{"ns/a"}}},
			wantReads: 2,
		},
		"shares of a device of a slice not yet republished are pending": {
			reads:       []fakeRead{{state: State{Slices: midRepublish, Claims: sharesOfLink}}},
			wantPending: []Violation{{Kind: VanishedDevice, Device: link, Claims: []string{"ns/a", "ns/b"}}},
			wantReads:   DefaultReads,
		},
		"shares of a device republished away: vanished, not held twice": {
			reads:     []fakeRead{{state: State{Slices: withoutGPU2, Claims: sharesOfLink}}},
			want:      []Violation{{Kind: VanishedDevice, Device: link, Claims: []string{"ns/a", "ns/b"}}},
			wantReads: 2,
		},
		"device of a slice not yet republished held twice": {
			reads:       []fakeRead{{state: State{Slices: midRepublish, Claims: twiceOnGPU2}}},
			want:        []Violation{{Kind: DoubleAllocation, Device: gpu2, Claims: []string{"ns/a", "ns/b"}}},
			wantPending: []Violation{{Kind: VanishedDevice, Device: gpu2, Claims: []string{"ns/a", "ns/b"}}},
			wantReads:   DefaultReads,
		},
		"allocation mismatch found again is reported": {
			reads:     []fakeRead{{state: State{Slices: cliques("a", "b"), Claims: []*resourceapi.ResourceClaim{oneClique}}}},
			want:      []Violation{{Kind: AllocationMismatch, Claims: []string{"ns/a"}}},
			wantReads: 2,
		},
		"allocation mismatch gone at the re-read": {
			// The driver republished the attribute.
			reads: []fakeRead{
				{state: State{Slices: cliques("a", "b"), Claims: []*resourceapi.ResourceClaim{oneClique}}},
				{state: State{Slices: cliques("a", "a"), Claims: []*resourceapi.ResourceClaim{oneClique}}},
			},
			wantReads: 2,
		},
		"allocation reserved for no one, used by no pod, is reported after stale-after": {
			reads:      []fakeRead{{state: State{Slices: complete, Claims: []*resourceapi.ResourceClaim{unreserved}, Pods: []*v1.Pod{succeeded}}}},
			staleAfter: -1,
			want:       []Violation{{Kind: UnreservedAllocation, Claims: []string{"ns/a"}}},
			wantReads:  3,
		},
		"allocation reserved for no one is pending before stale-after": {
			reads:       []fakeRead{{state: State{Slices: complete, Claims: []*resourceapi.ResourceClaim{unreserved}}}},
			wantPending: []Violation{{Kind: UnreservedAllocation, Claims: []string{"ns/a"}}},
			wantReads:   3,
		},
		"allocation reserved for no one that a pending pod uses": {
			reads:      []fakeRead{{state: State{Slices: complete, Claims: []*resourceapi.ResourceClaim{unreserved}, Pods: []*v1.Pod{pending}}}},
			staleAfter: -1,
			wantReads:  1,
		},
		"allocation reserved for no one without the finalizer (written ahead of its pods)": {
			reads:      []fakeRead{{state: State{Slices: complete, Claims: onGPU2}}},
			staleAfter: -1,
			wantReads:  1,
		},
		"re-read fails": {
			reads: []fakeRead{
				{state: State{Slices: complete, Claims: twiceOnGPU2}},
				{err: unreachable},
			},
			want:           []Violation{{Kind: DoubleAllocation, Device: gpu2, Claims: []string{"ns/a", "ns/b"}}},
			wantReads:      1,
			wantIncomplete: true,
		},
		"first read fails": {
			reads:   []fakeRead{{err: unreachable}},
			wantErr: true,
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			client := newFakeCluster(tc.reads...)
			report, err := CheckWith(context.Background(), client, CheckOptions{Interval: time.Millisecond, StaleAfter: tc.staleAfter, UnpublishedAfter: tc.unpublishedAfter})
			var incomplete *IncompleteError
			switch {
			case tc.wantIncomplete:
				if !errors.As(err, &incomplete) || incomplete.Reads != tc.wantReads || !apierrors.IsServiceUnavailable(err) {
					t.Errorf("error %v, want an IncompleteError after %d reads that wraps the read's error", err, tc.wantReads)
				}
			case tc.wantErr:
				if err == nil || errors.As(err, &incomplete) {
					t.Errorf("error %v, want one that is not an IncompleteError", err)
				}
			case err != nil:
				t.Fatalf("unexpected error: %v", err)
			}
			if !tc.wantErr && report.Reads != tc.wantReads {
				t.Errorf("%d reads, want %d", report.Reads, tc.wantReads)
			}
			expectViolations(t, report.Violations, tc.want)
			t.Log("pending:")
			expectViolations(t, pendingViolations(t, report.Pending), tc.wantPending)
			client.noGets(t)
		})
	}
}

// pendingViolations returns the violations of pending, and checks that
// each says why it is pending.
func pendingViolations(t *testing.T, pending []PendingViolation) []Violation {
	t.Helper()
	var out []Violation
	for _, p := range pending {
		t.Logf("pending because %s", p.Why)
		if p.Why == "" {
			t.Errorf("pending %s does not say why", p.Kind)
		}
		out = append(out, p.Violation)
	}
	return out
}

// finishedPod returns a pod bound to node that succeeded at finished, as
// its container's state and its Ready condition record it.
func finishedPod(name string, uid types.UID, node string, finished time.Time, claimNames ...string) *v1.Pod {
	p := pod(name, uid, node, claimNames...)
	p.Status.Phase = v1.PodSucceeded
	p.Status.ContainerStatuses = []v1.ContainerStatus{{Name: "main", State: v1.ContainerState{Terminated: &v1.ContainerStateTerminated{FinishedAt: metav1.NewTime(finished)}}}}
	p.Status.Conditions = []v1.PodCondition{{Type: v1.PodReady, Status: v1.ConditionFalse, LastTransitionTime: metav1.NewTime(finished)}}
	return p
}

// TestPodDoneSince: a pod that succeeded or failed is done since the
// latest time its containers and conditions record, a pod deleted before
// it was bound since its deletionTimestamp, and a pod that records none
// since an unknown time (zero).
func TestPodDoneSince(t *testing.T) {
	hourAgo := metav1.NewTime(time.Now().Add(-time.Hour).Truncate(time.Second))
	minuteAgo := metav1.NewTime(time.Now().Add(-time.Minute).Truncate(time.Second))
	terminated := func(at metav1.Time) v1.ContainerState {
		return v1.ContainerState{Terminated: &v1.ContainerStateTerminated{FinishedAt: at}}
	}
	tests := map[string]struct {
		status   v1.PodStatus
		deletion *metav1.Time
		want     time.Time
	}{
		"containers": {
			status: v1.PodStatus{Phase: v1.PodSucceeded,
				InitContainerStatuses: []v1.ContainerStatus{{State: terminated(hourAgo)}},
				ContainerStatuses:     []v1.ContainerStatus{{State: terminated(minuteAgo)}, {State: terminated(hourAgo)}},
			},
			want: minuteAgo.Time,
		},
		"a condition changed after the containers": {
			status: v1.PodStatus{Phase: v1.PodFailed,
				ContainerStatuses: []v1.ContainerStatus{{State: terminated(hourAgo)}},
				Conditions:        []v1.PodCondition{{Type: v1.DisruptionTarget, LastTransitionTime: minuteAgo}},
			},
			want: minuteAgo.Time,
		},
		"conditions only": {
			status: v1.PodStatus{Phase: v1.PodFailed, Conditions: []v1.PodCondition{{Type: v1.PodReady, LastTransitionTime: hourAgo}}},
			want:   hourAgo.Time,
		},
		"no time recorded": {
			status: v1.PodStatus{Phase: v1.PodFailed},
		},
		"deleted before it was bound": {
			deletion: &minuteAgo,
			want:     minuteAgo.Time,
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			p := &v1.Pod{Status: tc.status}
			p.DeletionTimestamp = tc.deletion
			if got := podDoneSince(p); !got.Equal(tc.want) {
				t.Errorf("done since %s, want %s", got, tc.want)
			}
		})
	}
}

// TestFindIsStrictMidRepublish: Find judges a cluster at rest, and reports
// an allocated device that the pool's newest generation lacks even while
// that generation is incomplete.
func TestFindIsStrictMidRepublish(t *testing.T) {
	s := State{
		Slices: []*resourceapi.ResourceSlice{poolSlice("first", 2, 2, devices("gpu-0")...), poolSlice("second", 1, 2, devices("gpu-2")...)},
		Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-2")},
	}
	expectViolations(t, Find(s), []Violation{{Kind: VanishedDevice, Device: &Device{driver, "node-a", "gpu-2"}, Claims: []string{"ns/a"}}})
}

// TestCheckReadsInPages: every list asks for pages of the page size, and
// the objects of every page are judged.
func TestCheckReadsInPages(t *testing.T) {
	var s State
	for i := range 5 {
		name := strconv.Itoa(i)
		s.Slices = append(s.Slices, poolSlice("slice-"+name, 1, 5, devices("gpu-"+name)...))
		s.Claims = append(s.Claims, claim("c-"+name, "node-a", "", "gpu-"+name))
		s.Pods = append(s.Pods, pod("p-"+name, "", "", "c-"+name))
		s.Nodes = append(s.Nodes, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n-" + name}})
	}
	// On the last page of each list: a pod bound to a node with a claim
	// that is not reserved for it, which is allocated a device twice and
	// for another node.
	s.Pods[4] = pod("p-4", "p-4-uid", "n-4", "c-4")
	s.Claims[4] = onNode(claim("c-4", "node-a", "", "gpu-4", "gpu-4"), "node-a")
	client := newFakeCluster(fakeRead{state: s})
	report, err := CheckWith(context.Background(), client, CheckOptions{Interval: time.Millisecond, PageSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	gpu4 := &Device{driver, "node-a", "gpu-4"}
	expectViolations(t, report.Violations, []Violation{
		{Kind: DoubleAllocation, Device: gpu4, Claims: []string{"ns/c-4", "ns/c-4"}},
		{Kind: PodClaimNotReserved, Pod: "ns/p-4", Claims: []string{"ns/c-4"}},
		{Kind: PodClaimOnOtherNode, Pod: "ns/p-4", Claims: []string{"ns/c-4"}},
	})
	for _, resource := range []string{"pods", "resourceclaims", "resourceslices", "nodes"} {
		limits := client.limits[resource]
		// Two reads of three pages each.
		if len(limits) != 6 {
			t.Errorf("%s: %d list requests, want 6 (two reads of three pages)", resource, len(limits))
		}
		for _, l := range limits {
			if l != 2 {
				t.Errorf("%s: a list request with limit %d, want 2", resource, l)
			}
		}
	}
}

// TestListDropsManagedFields: a read drops the managed fields of the
// pods, claims and nodes, on every page, and keeps those of the
// ResourceSlices, DeviceClasses and DeviceTaintRules, which the judges
// read.
func TestListDropsManagedFields(t *testing.T) {
	managed := []metav1.ManagedFieldsEntry{{Manager: "kubectl", Operation: metav1.ManagedFieldsOperationUpdate, Time: ptr.To(metav1.Now())}}
	var s State
	for i := range 3 {
		name := strconv.Itoa(i)
		s.Pods = append(s.Pods, pod("p-"+name, "", ""))
		s.Claims = append(s.Claims, claim("c-"+name, "node-a", "", "gpu-"+name))
		s.Nodes = append(s.Nodes, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n-" + name}})
		s.Slices = append(s.Slices, poolSlice("slice-"+name, 1, 3, devices("gpu-"+name)...))
		s.DeviceClasses = append(s.DeviceClasses, deviceClass("class-"+name, "true"))
		s.DeviceTaintRules = append(s.DeviceTaintRules, &resourceapi.DeviceTaintRule{ObjectMeta: metav1.ObjectMeta{Name: "rule-" + name}})
	}
	for _, o := range slices.Concat(objects(s.Pods), objects(s.Claims), objects(s.Nodes), objects(s.Slices), objects(s.DeviceClasses), objects(s.DeviceTaintRules)) {
		o.SetManagedFields(managed)
	}
	got, err := list(context.Background(), newFakeCluster(fakeRead{state: s}), 2)
	if err != nil {
		t.Fatal(err)
	}
	check := func(kind string, objs []metav1.Object, keep bool) {
		t.Helper()
		if len(objs) != 3 {
			t.Errorf("%d %s read, want 3", len(objs), kind)
		}
		for _, o := range objs {
			if kept := len(o.GetManagedFields()) > 0; kept != keep {
				t.Errorf("%s %s: managed fields kept %v, want %v", kind, o.GetName(), kept, keep)
			}
		}
	}
	check("pods", objects(got.Pods), false)
	check("claims", objects(got.Claims), false)
	check("nodes", objects(got.Nodes), false)
	check("slices", objects(got.Slices), true)
	check("device classes", objects(got.DeviceClasses), true)
	check("device taint rules", objects(got.DeviceTaintRules), true)
}

// objects is objs as metav1.Objects.
func objects[T any, P interface {
	*T
	metav1.Object
}](objs []P) []metav1.Object {
	out := make([]metav1.Object, 0, len(objs))
	for _, o := range objs {
		out = append(out, o)
	}
	return out
}

// TestCheckOptions: options out of range are refused before the cluster
// is read.
func TestCheckOptions(t *testing.T) {
	for name, opts := range map[string]CheckOptions{
		"negative interval":  {Interval: -time.Second},
		"one read":           {Reads: 1},
		"negative page size": {PageSize: -1},
	} {
		t.Run(name, func(t *testing.T) {
			client := newFakeCluster(fakeRead{})
			if _, err := CheckWith(context.Background(), client, opts); err == nil {
				t.Error("no error")
			}
			if n := len(client.Actions()); n > 0 {
				t.Errorf("%d requests, want none", n)
			}
		})
	}
}

// TestCommandCheck: the command prints confirmed violations on stdout,
// notes pending ones on stderr without changing the exit code, and when a
// re-read fails prints what it found, marked unconfirmed in text and in
// JSON, and exits with ExitError, the reason on stderr.
func TestCommandCheck(t *testing.T) {
	twice := []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-0"), claim("b", "node-a", "", "gpu-0")}
	slices := []*resourceapi.ResourceSlice{poolSlice("first", 1, 1, devices("gpu-0")...)}
	midRepublish := []*resourceapi.ResourceSlice{poolSlice("first", 2, 2, devices("gpu-0")...), poolSlice("second", 1, 2, devices("gpu-2")...)}
	failed := apierrors.NewInternalError(errors.New("boom"))
	tests := map[string]struct {
		reads []fakeRead
		// output is -o; empty: text.
		output     string
		wantCode   int
		wantStdout []string
		wantStderr []string
	}{
		"clean": {
			reads:      []fakeRead{{state: State{Slices: slices}}},
			wantCode:   ExitClean,
			wantStdout: []string{"no violations"},
		},
		"violation": {
			reads:      []fakeRead{{state: State{Slices: slices, Claims: twice}}},
			wantCode:   ExitViolations,
			wantStdout: []string{"DoubleAllocation", "1 violation(s)\n"},
		},
		"violation, json": {
			reads:      []fakeRead{{state: State{Slices: slices, Claims: twice}}},
			output:     "json",
			wantCode:   ExitViolations,
			wantStdout: []string{`"kind": "DoubleAllocation"`, `"claims": [`, `"message": "`, `"confirmed": true`, `"pending": false`},
		},
		"pending only, json": {
			reads:      []fakeRead{{state: State{Slices: midRepublish, Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-2")}}}},
			output:     "json",
			wantCode:   ExitClean,
			wantStdout: []string{`"kind": "VanishedDevice"`, `"pending": true`, `"pendingReason": "its pool is being republished"`, `"confirmed": true`},
			wantStderr: []string{"being republished", "VanishedDevice", "gpu-2"},
		},
		"violation and a pool without slices, json": {
			reads:      []fakeRead{{state: State{Claims: twice}}},
			output:     "json",
			wantCode:   ExitViolations,
			wantStdout: []string{`"kind": "DoubleAllocation"`, `"kind": "UnpublishedPool"`, `"pool": "gpu.example.com/node-a"`, `"pending": true`, `"pendingReason": "its pool may be published again`, "less than the unpublished-after time 5m0s"},
			wantStderr: []string{"not reported, its pool may be published again", "UnpublishedPool"},
		},
		"clean, json": {
			reads:      []fakeRead{{state: State{Slices: slices}}},
			output:     "json",
			wantCode:   ExitClean,
			wantStdout: []string{"[]\n"},
		},
		"pending only": {
			reads:      []fakeRead{{state: State{Slices: midRepublish, Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-2")}}}},
			wantCode:   ExitClean,
			wantStdout: []string{"no violations"},
			wantStderr: []string{"being republished", "VanishedDevice", "gpu-2"},
		},
		"re-read fails": {
			reads:      []fakeRead{{state: State{Slices: slices, Claims: twice}}, {err: failed}},
			wantCode:   ExitError,
			wantStdout: []string{"DoubleAllocation", "1 violation(s), unconfirmed: a re-read failed\n"},
			wantStderr: []string{"incomplete", "not confirmed", "boom"},
		},
		"re-read fails, json": {
			reads:      []fakeRead{{state: State{Slices: slices, Claims: twice}}, {err: failed}},
			output:     "json",
			wantCode:   ExitError,
			wantStdout: []string{`"kind": "DoubleAllocation"`, `"confirmed": false`},
			wantStderr: []string{"incomplete", "not confirmed", "boom"},
		},
		"devices of a pool without slices": {
			reads:      []fakeRead{{state: State{Claims: twice}}},
			wantCode:   ExitViolations,
			wantStdout: []string{"DoubleAllocation", "1 violation(s)\n"},
			wantStderr: []string{"not reported, its pool may be published again", "kubelet removes a node's slices", "UnpublishedPool: pool gpu.example.com/node-a has no ResourceSlices, but its devices gpu-0 are allocated to ns/a, ns/b"},
		},
		"a selector that fails to evaluate": {
			reads: []fakeRead{{state: State{Slices: slices, Claims: []*resourceapi.ResourceClaim{func() *resourceapi.ResourceClaim {
				c := claim("a", "node-a", "", "gpu-0")
				c.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: `device.attributes["` + driver + `"].model == "x"`}}}
				return c
			}()}}}},
			wantCode:   ExitClean,
			wantStdout: []string{"no violations"},
			wantStderr: []string{`AllocationMismatch not judged in part for ns/a: selector #0 of request "req" fails on device gpu.example.com/node-a/gpu-0: no such key: model`},
		},
		"stale reservation of a pod that just succeeded": {
			reads: []fakeRead{{state: State{
				Slices: slices,
				Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "done-uid", "gpu-0")},
				Pods:   []*v1.Pod{finishedPod("done", "done-uid", "node-a", time.Now(), "a")},
			}}},
			wantCode:   ExitClean,
			wantStdout: []string{"no violations"},
			wantStderr: []string{"not reported, its pods stopped", "less than the stale-after time 10m0s", "StaleReservation", "ns/a"},
		},
		"re-read fails with only a pending one": {
			reads:      []fakeRead{{state: State{Slices: midRepublish, Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-2")}}}, {err: failed}},
			wantCode:   ExitError,
			wantStdout: []string{"no violations, unconfirmed: a re-read failed\n"},
			wantStderr: []string{"being republished", "incomplete", "boom"},
		},
		"first read fails": {
			reads:      []fakeRead{{err: failed}},
			wantCode:   ExitError,
			wantStderr: []string{"list resource claims", "boom"},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			output := tc.output
			if output == "" {
				output = "text"
			}
			code := check(context.Background(), newFakeCluster(tc.reads...), CheckOptions{Interval: time.Millisecond}, output, &stdout, &stderr)
			t.Logf("stdout:\n%sstderr:\n%s", stdout.String(), stderr.String())
			if code != tc.wantCode {
				t.Errorf("exit code %d, want %d", code, tc.wantCode)
			}
			for _, w := range tc.wantStdout {
				if !strings.Contains(stdout.String(), w) {
					t.Errorf("stdout does not contain %q", w)
				}
			}
			for _, w := range tc.wantStderr {
				if !strings.Contains(stderr.String(), w) {
					t.Errorf("stderr does not contain %q", w)
				}
			}
			if len(tc.wantStderr) == 0 && stderr.Len() > 0 {
				t.Errorf("stderr %q, want nothing", stderr.String())
			}
		})
	}
}

// TestCommandJSONClaimsArray: in -o json, "claims" is an array even for a
// violation without a claim (a pod bound while its claim from a template
// was never created), so that a consumer can iterate it.
func TestCommandJSONClaimsArray(t *testing.T) {
	p := pod("t", "uid-t", "node-a")
	p.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To("tmpl")}}
	var stdout, stderr bytes.Buffer
	code := check(context.Background(), newFakeCluster(fakeRead{state: State{Pods: []*v1.Pod{p}}}), CheckOptions{Interval: time.Millisecond}, "json", &stdout, &stderr)
	t.Logf("stdout:\n%sstderr:\n%s", stdout.String(), stderr.String())
	if code != ExitViolations {
		t.Errorf("exit code %d, want %d", code, ExitViolations)
	}
	var got []map[string]json.RawMessage
	if err := json.Unmarshal(stdout.Bytes(), &got); err != nil {
		t.Fatalf("stdout is not a JSON array of objects: %v", err)
	}
	if len(got) != 1 {
		t.Fatalf("%d violations, want 1", len(got))
	}
	if claims := string(got[0]["claims"]); claims != "[]" {
		t.Errorf(`"claims": %s, want []`, claims)
	}
}

// TestCommandJSONPending: -o json lists the confirmed violations, each
// with "pending": false, then the pending ones, each with "pending": true
// and why in "pendingReason"; only the confirmed ones set the exit code.
func TestCommandJSONPending(t *testing.T) {
	twice := []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-0"), claim("b", "node-b", "", "gpu-0")}
	// Pool node-a is published, node-b is not.
	state := State{Slices: []*resourceapi.ResourceSlice{poolSlice("first", 1, 1, devices("gpu-0")...)}, Claims: append(twice, claim("c", "node-a", "", "gpu-0"))}
	var stdout, stderr bytes.Buffer
	code := check(context.Background(), newFakeCluster(fakeRead{state: state}), CheckOptions{Interval: time.Millisecond}, "json", &stdout, &stderr)
	t.Logf("stdout:\n%sstderr:\n%s", stdout.String(), stderr.String())
	if code != ExitViolations {
		t.Errorf("exit code %d, want %d", code, ExitViolations)
	}
	var got []struct {
		Kind          Kind   `json:"kind"`
		Pool          string `json:"pool"`
		Pending       *bool  `json:"pending"`
		PendingReason string `json:"pendingReason"`
		Confirmed     bool   `json:"confirmed"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &got); err != nil {
		t.Fatalf("stdout is not a JSON array of objects: %v", err)
	}
	if len(got) != 2 {
		t.Fatalf("%d entries, want the DoubleAllocation and the pending UnpublishedPool", len(got))
	}
	if v := got[0]; v.Kind != DoubleAllocation || v.Pending == nil || *v.Pending || v.PendingReason != "" || !v.Confirmed {
		t.Errorf("first entry %+v, want a confirmed DoubleAllocation with \"pending\": false", v)
	}
	if p := got[1]; p.Kind != UnpublishedPool || p.Pool != driver+"/node-b" || p.Pending == nil || !*p.Pending ||
		!strings.Contains(p.PendingReason, "unpublished-after") || !p.Confirmed {
		t.Errorf("second entry %+v, want UnpublishedPool of %s/node-b with \"pending\": true and why", p, driver)
	}
}

// TestCheckWithoutClassList: where device classes may not be listed, the
// selectors of classes are not judged and the report, and topodra-check
// on stderr, say so; the rest of an allocation is still judged. Any other
// error of the class list fails the read.
func TestCheckWithoutClassList(t *testing.T) {
	slices := []*resourceapi.ResourceSlice{slice("node-a", 1, gpu("gpu-0", "gpu", "a"), gpu("gpu-1", "gpu", "a"), gpu("cpu-0", "cpu", "a"))}
	// cpu-0 is not of the class; claim b has one device too many.
	notOfClass := claim("a", "node-a", "", "cpu-0")
	notOfClass.Spec.Devices.Requests[0].Exactly.DeviceClassName = "typed"
	overCount := claim("b", "node-a", "", "gpu-0", "gpu-1")
	overCount.Spec.Devices.Requests[0].Exactly.Count = 1
	classes := []*resourceapi.DeviceClass{deviceClass("typed", `device.attributes["`+driver+`"].type == "gpu"`)}
	state := State{Slices: slices, Claims: []*resourceapi.ResourceClaim{notOfClass, overCount}, DeviceClasses: classes}

	report, err := CheckWith(context.Background(), newFakeCluster(fakeRead{state: state}), CheckOptions{Interval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	expectViolations(t, report.Violations, []Violation{{Kind: AllocationMismatch, Claims: []string{"ns/a"}}, {Kind: AllocationMismatch, Claims: []string{"ns/b"}}})

	forbidden := apierrors.NewForbidden(resourceapi.Resource("deviceclasses"), "", errors.New("no list on deviceclasses"))
	report, err = CheckWith(context.Background(), newFakeCluster(fakeRead{state: state, classesErr: forbidden}), CheckOptions{Interval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	expectViolations(t, report.Violations, []Violation{{Kind: AllocationMismatch, Claims: []string{"ns/b"}}})
	if len(report.NotJudged) != 1 || !strings.Contains(report.NotJudged[0], "AllocationMismatch: the selectors of DeviceClasses not checked") {
		t.Errorf("not judged: %q, want one line on the selectors of DeviceClasses", report.NotJudged)
	}

	var stdout, stderr bytes.Buffer
	if code := check(context.Background(), newFakeCluster(fakeRead{state: State{Slices: slices}, classesErr: forbidden}), CheckOptions{Interval: time.Millisecond}, "text", &stdout, &stderr); code != ExitClean ||
		!strings.Contains(stderr.String(), "the selectors of DeviceClasses not checked") || !strings.Contains(stderr.String(), "no list on deviceclasses") {
		t.Errorf("topodra-check: exit %d, stderr %q; want %d and a note that class selectors were not checked", code, stderr.String(), ExitClean)
	}

	unavailable := apierrors.NewServiceUnavailable("etcd is down")
	if _, err := CheckWith(context.Background(), newFakeCluster(fakeRead{state: state, classesErr: unavailable}), CheckOptions{Interval: time.Millisecond}); !apierrors.IsServiceUnavailable(err) {
		t.Errorf("error %v, want the class list's", err)
	}
}

// TestCheckWithoutNodeList: where nodes may not be listed, the other kinds
// are still judged and the report, and topodra-check on stderr, say that
// pods on another node than their claims' devices were not looked for;
// any other error of the node list fails the read.
func TestCheckWithoutNodeList(t *testing.T) {
	slices := []*resourceapi.ResourceSlice{poolSlice("first", 1, 1, devices("gpu-0", "gpu-1")...)}
	state := State{
		Slices: slices,
		Claims: []*resourceapi.ResourceClaim{
			onNode(claim("a", "node-a", "p-uid", "gpu-0"), "node-a"),
			claim("b", "node-a", "", "gpu-0"),
		},
		Pods: []*v1.Pod{pod("p", "p-uid", "node-b", "a")},
	}
	forbidden := apierrors.NewForbidden(v1.Resource("nodes"), "", errors.New("no list on nodes"))
	client := newFakeCluster(fakeRead{state: state, nodesErr: forbidden})
	report, err := CheckWith(context.Background(), client, CheckOptions{Interval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	expectViolations(t, report.Violations, []Violation{{Kind: DoubleAllocation, Device: &Device{driver, "node-a", "gpu-0"}, Claims: []string{"ns/a", "ns/b"}}})
	if len(report.NotJudged) != 1 || !strings.Contains(report.NotJudged[0], string(PodClaimOnOtherNode)) {
		t.Errorf("not judged: %q, want one line on %s", report.NotJudged, PodClaimOnOtherNode)
	}

	var stdout, stderr bytes.Buffer
	clean := State{Slices: slices}
	if code := check(context.Background(), newFakeCluster(fakeRead{state: clean, nodesErr: forbidden}), CheckOptions{Interval: time.Millisecond}, "text", &stdout, &stderr); code != ExitClean ||
		!strings.Contains(stderr.String(), "PodClaimOnOtherNode not looked for") {
		t.Errorf("topodra-check: exit %d, stderr %q; want %d and a note that %s was not looked for", code, stderr.String(), ExitClean, PodClaimOnOtherNode)
	}

	unavailable := apierrors.NewServiceUnavailable("etcd is down")
	if _, err := CheckWith(context.Background(), newFakeCluster(fakeRead{state: state, nodesErr: unavailable}), CheckOptions{Interval: time.Millisecond}); !apierrors.IsServiceUnavailable(err) {
		t.Errorf("error %v, want the node list's", err)
	}
}
