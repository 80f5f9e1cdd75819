package topologydra

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	resourcev1client "k8s.io/client-go/kubernetes/typed/resource/v1"
	cgotesting "k8s.io/client-go/testing"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"
)

// laggingWatch passes a watch's events on, each after the delay that is
// set when the event arrives.
type laggingWatch struct {
	watch.Interface
	out   chan watch.Event
	delay *atomic.Int64
}

func (w *laggingWatch) ResultChan() <-chan watch.Event { return w.out }

// lagClaimWatch makes the harness's claim informers see every claim event
// after the delay that is set when the event arrives.
func lagClaimWatch(h *harness, delay *atomic.Int64) {
	h.client.PrependWatchReactor("resourceclaims", func(action cgotesting.Action) (bool, watch.Interface, error) {
		w, err := h.client.Tracker().Watch(action.GetResource(), action.GetNamespace())
		if err != nil {
			return true, nil, err
		}
		lw := &laggingWatch{Interface: w, out: make(chan watch.Event, 100), delay: delay}
		go func() {
			defer close(lw.out)
			for ev := range w.ResultChan() {
				time.Sleep(time.Duration(delay.Load()))
				lw.out <- ev
			}
		}()
		return true, lw, nil
	})
}

// loseStatusReplies makes claim status writes fail with err while lose is
// set, after the API stored them (stored) or not.
func loseStatusReplies(h *harness, lose *atomic.Bool, stored bool, err error) {
	h.client.PrependReactor("update", "resourceclaims", func(action cgotesting.Action) (bool, runtime.Object, error) {
		u := action.(cgotesting.UpdateAction)
		if u.GetSubresource() != "status" || !lose.Load() {
			return false, nil, nil
		}
		if stored {
			obj := u.GetObject().(*resourceapi.ResourceClaim).DeepCopy()
			obj.ResourceVersion = "1000000" // newer than any the harness gave out
			if err := h.client.Tracker().Update(action.GetResource(), obj, action.GetNamespace(), metav1.UpdateOptions{}); err != nil {
				return true, nil, err
			}
		}
		return true, nil, err
	})
}

// preconditionReactor refuses claim updates whose UID or resourceVersion
// is not the stored claim's with a conflict, as the API server does (the
// fake tracker does not).
func preconditionReactor(h *harness) {
	h.client.PrependReactor("update", "resourceclaims", func(action cgotesting.Action) (bool, runtime.Object, error) {
		obj := action.(cgotesting.UpdateAction).GetObject().(*resourceapi.ResourceClaim)
		stored, err := h.client.Tracker().Get(action.GetResource(), obj.Namespace, obj.Name)
		if err != nil {
			return false, nil, nil
		}
		if s := stored.(*resourceapi.ResourceClaim); s.UID != obj.UID || (obj.ResourceVersion != "" && s.ResourceVersion != obj.ResourceVersion) {
			return true, nil, apierrors.NewConflict(resourceapi.Resource("resourceclaims"), obj.Name, errors.New("the object has been modified"))
		}
		return false, nil, nil
	})
}

// recreateClaim deletes the claim in the API and creates it again under
// the same name, asking for count GPUs, and returns the new claim's UID.
func (h *harness) recreateClaim(name string, count int64) types.UID {
	h.tCtx.Helper()
	h.tCtx.ExpectNoError(h.client.ResourceV1().ResourceClaims(testNS).Delete(h.tCtx, name, metav1.DeleteOptions{}), "delete claim "+name)
	c := testClaim(name, count)
	c.UID = types.UID("uid-recreated-" + name)
	_, err := h.client.ResourceV1().ResourceClaims(testNS).Create(h.tCtx, c, metav1.CreateOptions{})
	h.tCtx.ExpectNoError(err, "create claim "+name+" again")
	return c.UID
}

// TestPreBindClaimRecreated: claim a is deleted and created again (same
// name, another spec) between Reserve and PreBind. PreBind must not write
// the allocation made for the deleted claim onto the new one, and its
// devices must be free again after Unreserve.
func TestPreBindClaimRecreated(t *testing.T) {
	h := newHarnessWith(t, preconditionReactor, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 4),
		testClaim("a", 1), testClaim("q", 4))
	h.waitForClaim("a", func(*resourceapi.ResourceClaim) bool { return true })
	h.waitForClaim("q", func(*resourceapi.ResourceClaim) bool { return true })
	pod := testPod("p", "a")
	cs := h.reserve(pod, "node-a")
	oldUID := h.apiClaim("a").UID
	h.recreateClaim("a", 3)
	st := h.pl.PreBind(h.tCtx, cs, pod, "node-a")
	if st.IsSuccess() || !strings.Contains(st.Message(), "deleted and created again") {
		t.Errorf("PreBind after the claim was created again: %v, want an error that says so", st)
	}
	if a := h.apiClaim("a"); a.Status.Allocation != nil || len(a.Status.ReservedFor) != 0 {
		t.Errorf("the new claim a got the deleted claim's allocation %v, reserved for %v", a.Status.Allocation, a.Status.ReservedFor)
	}
	h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
	if h.pl.draManager.ResourceClaims().GetPendingAllocation(oldUID) != nil {
		t.Errorf("the in-flight allocation of the deleted claim is still held after Unreserve")
	}
	h.waitForClaim("a", func(c *resourceapi.ResourceClaim) bool { return c.UID != oldUID })
	if _, st := h.cycle(testPod("q", "q"), "node-a"); code(st["node-a"]) != fwk.Success {
		t.Errorf("node-a's GPUs are still taken after the deleted claim's attempt was undone: %v", st["node-a"])
	}
}

// TestPreBindClaimAllocatedAgain: pod p's shared claim c is allocated on
// node-a when p's node is chosen; before PreBind writes p's reservation, c
// is deallocated (its last pod gone) and allocated again on node-b for
// another pod. PreBind fails instead of binding p to node-a, where its
// devices are not; once it is tried again, p goes to node-b.
func TestPreBindClaimAllocatedAgain(t *testing.T) {
	h := newHarnessWith(t, preconditionReactor, []*v1.Node{testNode("node-a"), testNode("node-b")}, testDeviceClass(),
		testSlice("node-a", 2), testSlice("node-b", 2), allocatedOn(testClaim("c", 1), "node-a", "gpu-0"))
	h.waitForClaim("c", func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation != nil })
	pod := testPod("p", "c")
	cs := h.reserve(pod, "node-a")
	c := h.apiClaim("c")
	c.Status.Allocation = nil
	c, err := h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(h.tCtx, c, metav1.UpdateOptions{})
	h.tCtx.ExpectNoError(err)
	c.Status.Allocation = allocatedOn(testClaim("c", 1), "node-b", "gpu-1").Status.Allocation
	c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: "other", UID: "uid-other"}}
	_, err = h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(h.tCtx, c, metav1.UpdateOptions{})
	h.tCtx.ExpectNoError(err)

	st := h.pl.PreBind(h.tCtx, cs, pod, "node-a")
	if st.IsSuccess() || !strings.Contains(st.Message(), "allocated again") {
		t.Errorf("PreBind on node-a after claim c was allocated again on node-b: %v, want an error that says so", st)
	}
	if got := h.apiClaim("c"); resourceclaim.IsReservedForPod(pod, got, false) {
		t.Errorf("claim c, allocated on node-b, is reserved for pod p bound to node-a: %v", got.Status.ReservedFor)
	}
	h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
	h.waitForClaim("c", func(c *resourceapi.ResourceClaim) bool { return len(c.Status.ReservedFor) == 1 })
	if _, st := h.cycle(pod, "node-a", "node-b"); st["node-a"].IsSuccess() || !st["node-b"].IsSuccess() {
		t.Errorf("the next attempt: node-a %v, node-b %v; want node-b only", st["node-a"], st["node-b"])
	}
}

// TestUnreserveGivesBackWrittenAllocation: pod p names claims a and b;
// PreBind writes a's allocation and then fails on b (deleted and created
// again). Unreserve removes a's allocation, not only p's reservation:
// nothing else would give a's GPU back once p is deleted. A claim that was
// allocated before the cycle keeps its allocation, and so does one that
// another pod reserved after the write.
func TestUnreserveGivesBackWrittenAllocation(t *testing.T) {
	h := newHarnessWith(t, preconditionReactor, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 4),
		testClaim("a", 1), testClaim("b", 1), testClaim("d", 1), allocatedOn(testClaim("kept", 1), "node-a", "gpu-3"))
	for _, name := range []string{"a", "b", "d", "kept"} {
		h.waitForClaim(name, func(*resourceapi.ResourceClaim) bool { return true })
	}
	pod := testPod("p", "kept", "a", "b")
	cs := h.reserve(pod, "node-a")
	h.recreateClaim("b", 1)
	if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); st.IsSuccess() {
		t.Fatal("PreBind succeeded although claim b was created again")
	}
	if a := h.apiClaim("a"); a.Status.Allocation == nil || !resourceclaim.IsReservedForPod(pod, a, false) {
		t.Fatalf("PreBind did not write claim a before it failed: %+v", a.Status)
	}
	h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
	if a := h.apiClaim("a"); a.Status.Allocation != nil || len(a.Status.ReservedFor) != 0 {
		t.Errorf("claim a after Unreserve: allocated %v, reserved for %v; want neither", a.Status.Allocation != nil, a.Status.ReservedFor)
	}
	if kept := h.apiClaim("kept"); kept.Status.Allocation == nil || len(kept.Status.ReservedFor) != 0 {
		t.Errorf("claim kept after Unreserve: allocated %v, reserved for %v; want its allocation kept and p's reservation gone", kept.Status.Allocation != nil, kept.Status.ReservedFor)
	}

	// Another pod reserved claim a after p3's write: a stays allocated for
	// it, and only p3's reservation goes.
	pod = testPod("p3", "a", "d")
	pod2 := testPod("p2", "a")
	pod2.UID = "uid-p2"
	h.waitForClaim("a", func(c *resourceapi.ResourceClaim) bool { return c.Status.Allocation == nil })
	cs = h.reserve(pod, "node-a")
	h.recreateClaim("d", 1)
	if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); st.IsSuccess() {
		t.Fatal("PreBind succeeded although claim d was created again")
	}
	a := h.apiClaim("a")
	a.Status.ReservedFor = append(a.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{Resource: "pods", Name: pod2.Name, UID: pod2.UID})
	_, err := h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(h.tCtx, a, metav1.UpdateOptions{})
	h.tCtx.ExpectNoError(err)
	h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
	if a := h.apiClaim("a"); a.Status.Allocation == nil || resourceclaim.IsReservedForPod(pod, a, false) || !resourceclaim.IsReservedForPod(pod2, a, false) {
		t.Errorf("claim a that p2 reserved after p3's write: allocated %v, reserved for %v; want it allocated for p2 only", a.Status.Allocation != nil, a.Status.ReservedFor)
	}
}

// TestPreFilterUncertainClaimRecreated: claim c's allocation write has an
// unknown outcome, and the claim is then deleted and created again while
// the claim informer lags. The pod's next PreFilter reads the claim: the
// new claim is not the one written, so the write is settled (the in-flight
// entry goes) and the attempt fails instead of going on with the deleted
// claim.
func TestPreFilterUncertainClaimRecreated(t *testing.T) {
	h, pod, oldUID, unreadable := failWriteUnreadable(t, false, time.Hour, preconditionReactor)
	if !h.pl.uncertain.has(oldUID) {
		t.Fatal("the write of claim c is not uncertain")
	}
	unreadable.Store(false)
	h.recreateClaim("c", 1)
	if _, st := h.pl.PreFilter(h.tCtx, framework.NewCycleState(), pod, nil); code(st) != fwk.Error || !strings.Contains(st.Message(), "deleted") {
		t.Errorf("PreFilter of the pod whose claim was created again: %v, want an error that says the claim was deleted", st)
	}
	if h.pl.uncertain.has(oldUID) || h.pl.draManager.ResourceClaims().GetPendingAllocation(oldUID) != nil {
		t.Errorf("the deleted claim's write is still uncertain, or its in-flight allocation still held")
	}
}

// TestPreBindFailureKeepsWrittenClaims: PreBind writes claim a and fails
// on claim b while the claim informer lags behind the API, and Unreserve
// cannot remove a's allocation (refused). Unreserve must not put back the
// informer's unallocated copy of a: the devices a holds in the API would
// look free, and another pod would get them too.
func TestPreBindFailureKeepsWrittenClaims(t *testing.T) {
	var delay atomic.Int64
	h := newHarnessWith(t, func(h *harness) { lagClaimWatch(h, &delay) }, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 4),
		testClaim("a", 2), testClaim("b", 2), testClaim("q", 4))
	for _, n := range []string{"a", "b", "q"} {
		h.waitForClaim(n, func(*resourceapi.ResourceClaim) bool { return true })
	}
	pod := testPod("p", "a", "b")
	cs := h.reserve(pod, "node-a")
	delay.Store(int64(2 * time.Second))
	h.client.PrependReactor("update", "resourceclaims", func(action cgotesting.Action) (bool, runtime.Object, error) {
		u := action.(cgotesting.UpdateAction)
		c := u.GetObject().(*resourceapi.ResourceClaim)
		if u.GetSubresource() == "status" && (c.Name == "b" || c.Status.Allocation == nil) {
			return true, nil, apierrors.NewForbidden(resourceapi.Resource("resourceclaims"), c.Name, errors.New("denied by an admission webhook"))
		}
		return false, nil, nil
	})
	if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); st.IsSuccess() {
		t.Fatal("PreBind succeeded although writing claim b failed")
	}
	if h.apiClaim("a").Status.Allocation == nil {
		t.Fatal("claim a was not written")
	}
	h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
	state, err := h.pl.gatherAllocatedState(h.tCtx)
	h.tCtx.ExpectNoError(err)
	if n := state.AllocatedDevices.Len(); n != 2 {
		t.Errorf("after Unreserve the scheduler counts %d devices allocated, want the 2 that claim a holds in the API", n)
	}
	q := testPod("q", "q")
	if _, st := h.cycle(q, "node-a"); code(st["node-a"]) == fwk.Success {
		t.Errorf("a 4-GPU pod fits on node-a while claim a holds 2 of its 4 GPUs")
	}
}

// TestPreBindRetryAfterUnreserveReservesAgain: PreBind writes claim a and
// fails on claim b; Unreserve takes the pod out of a's reservedFor while
// the claim informer lags behind the API. The pod's next attempt must
// reserve a for the pod again: bound without that reservation, the pod is
// refused by the kubelet.
func TestPreBindRetryAfterUnreserveReservesAgain(t *testing.T) {
	var delay atomic.Int64
	var refuseB atomic.Bool
	h := newHarnessWith(t, func(h *harness) { lagClaimWatch(h, &delay) }, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 4),
		testClaim("a", 2), testClaim("b", 2))
	for _, n := range []string{"a", "b"} {
		h.waitForClaim(n, func(*resourceapi.ResourceClaim) bool { return true })
	}
	pod := testPod("p", "a", "b")
	cs := h.reserve(pod, "node-a")
	delay.Store(int64(2 * time.Second))
	h.client.PrependReactor("update", "resourceclaims", func(action cgotesting.Action) (bool, runtime.Object, error) {
		u := action.(cgotesting.UpdateAction)
		if refuseB.Load() && u.GetSubresource() == "status" && u.GetObject().(*resourceapi.ResourceClaim).Name == "b" {
			return true, nil, apierrors.NewBadRequest("refused")
		}
		return false, nil, nil
	})
	refuseB.Store(true)
	if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); st.IsSuccess() {
		t.Fatal("PreBind succeeded although writing claim b was refused")
	}
	h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
	if r := h.apiClaim("a").Status.ReservedFor; len(r) != 0 {
		t.Fatalf("claim a still reserved for %v after Unreserve", r)
	}
	refuseB.Store(false)
	cs = h.reserve(pod, "node-a")
	st := h.pl.PreBind(h.tCtx, cs, pod, "node-a")
	reserved := slices.ContainsFunc(h.apiClaim("a").Status.ReservedFor, func(r resourceapi.ResourceClaimConsumerReference) bool { return r.UID == pod.UID })
	if st.IsSuccess() && !reserved {
		t.Errorf("PreBind of the next attempt succeeded, but claim a is not reserved for the pod in the API")
	}
}

// TestPreBindWriteOutcomeUnknown: the API server stores claim c's
// allocation but the reply is lost (a timeout). PreBind fails and learns
// from a read that the write was stored; Unreserve removes the allocation
// and the reservation, as after a write that succeeded. Where that removal
// is refused, the scheduler must go on counting c's devices, and the pod
// is taken out of c's reservedFor.
func TestPreBindWriteOutcomeUnknown(t *testing.T) {
	for name, refuseRemoval := range map[string]bool{"removed": false, "removal refused": true} {
		t.Run(name, func(t *testing.T) {
			var lag atomic.Int64
			var lose atomic.Bool
			hook := func(h *harness) {
				lagClaimWatch(h, &lag)
				loseStatusReplies(h, &lose, true, errors.New("apiserver: timeout"))
				h.client.PrependReactor("update", "resourceclaims", func(action cgotesting.Action) (bool, runtime.Object, error) {
					u := action.(cgotesting.UpdateAction)
					if refuseRemoval && u.GetSubresource() == "status" && u.GetObject().(*resourceapi.ResourceClaim).Status.Allocation == nil {
						return true, nil, apierrors.NewForbidden(resourceapi.Resource("resourceclaims"), "c", errors.New("denied by an admission webhook"))
					}
					return false, nil, nil
				})
			}
			h := newHarnessWith(t, hook, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 2), testClaim("c", 2), testClaim("q", 2))
			h.waitForClaim("c", func(*resourceapi.ResourceClaim) bool { return true })
			h.waitForClaim("q", func(*resourceapi.ResourceClaim) bool { return true })
			pod := testPod("p", "c")
			cs := h.reserve(pod, "node-a")
			lag.Store(int64(2 * time.Second))
			lose.Store(true)
			if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); st.IsSuccess() {
				t.Fatal("PreBind succeeded although the reply was lost")
			}
			lose.Store(false)
			if c := h.apiClaim("c"); c.Status.Allocation == nil {
				t.Fatal("the lost write did not reach the API")
			}
			h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
			c := h.apiClaim("c")
			if len(c.Status.ReservedFor) != 0 {
				t.Errorf("claim c still reserved for %v after Unreserve", c.Status.ReservedFor)
			}
			if (c.Status.Allocation != nil) != refuseRemoval {
				t.Errorf("claim c allocated after Unreserve: %v, want %v", c.Status.Allocation != nil, refuseRemoval)
			}
			_, st := h.cycle(testPod("q", "q"), "node-a")
			if fits := code(st["node-a"]) == fwk.Success; fits == refuseRemoval {
				t.Errorf("a 2-GPU pod fits on node-a: %v; want it to fit only where claim c holds no devices in the API (%v)", fits, st["node-a"])
			}
		})
	}
}

// ctxClient fails the claim requests whose context is done, before
// sending them, as a real client does (the fake clientset ignores
// contexts). With hangGets, claim reads hang until their context ends,
// as a read from an API server that does not answer does.
type ctxClient struct {
	kubernetes.Interface
	hangGets bool
}

func (c ctxClient) ResourceV1() resourcev1client.ResourceV1Interface {
	return ctxResourceV1{c.Interface.ResourceV1(), c.hangGets}
}

type ctxResourceV1 struct {
	resourcev1client.ResourceV1Interface
	hangGets bool
}

func (c ctxResourceV1) ResourceClaims(namespace string) resourcev1client.ResourceClaimInterface {
	return ctxClaims{c.ResourceV1Interface.ResourceClaims(namespace), c.hangGets}
}

type ctxClaims struct {
	resourcev1client.ResourceClaimInterface
	hangGets bool
}

func requestErr(ctx context.Context, verb string) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%s \"https://apiserver/apis/resource.k8s.io/v1/...\": %w", verb, err)
	}
	return nil
}

func (c ctxClaims) Get(ctx context.Context, name string, opts metav1.GetOptions) (*resourceapi.ResourceClaim, error) {
	if c.hangGets {
		<-ctx.Done()
	}
	if err := requestErr(ctx, "Get"); err != nil {
		return nil, err
	}
	return c.ResourceClaimInterface.Get(ctx, name, opts)
}

func (c ctxClaims) Update(ctx context.Context, claim *resourceapi.ResourceClaim, opts metav1.UpdateOptions) (*resourceapi.ResourceClaim, error) {
	if err := requestErr(ctx, "Put"); err != nil {
		return nil, err
	}
	return c.ResourceClaimInterface.Update(ctx, claim, opts)
}

func (c ctxClaims) UpdateStatus(ctx context.Context, claim *resourceapi.ResourceClaim, opts metav1.UpdateOptions) (*resourceapi.ResourceClaim, error) {
	if err := requestErr(ctx, "Put"); err != nil {
		return nil, err
	}
	return c.ResourceClaimInterface.UpdateStatus(ctx, claim, opts)
}

func (c ctxClaims) Patch(ctx context.Context, name string, pt types.PatchType, data []byte, opts metav1.PatchOptions, subresources ...string) (*resourceapi.ResourceClaim, error) {
	if err := requestErr(ctx, "Patch"); err != nil {
		return nil, err
	}
	return c.ResourceClaimInterface.Patch(ctx, name, pt, data, opts, subresources...)
}

// TestPreBindCancelledSettlesWrite: PreBind's context is cancelled (another
// plugin's PreBind failed, or the pod was preempted) before claim c's
// write is sent, or while its reply is awaited after the API stored it.
// The claim can still be read, so the outcome is known: after Unreserve
// the claim is not allocated, and its devices are free, whether the write
// was stored (Unreserve removes the allocation) or not.
func TestPreBindCancelledSettlesWrite(t *testing.T) {
	for name, stored := range map[string]bool{"not sent": false, "stored, reply lost": true} {
		t.Run(name, func(t *testing.T) {
			var lose atomic.Bool
			var cancelWrite context.CancelFunc
			hook := func(h *harness) {
				loseStatusReplies(h, &lose, true, fmt.Errorf("Put \"https://apiserver/apis/resource.k8s.io/v1/...\": %w", context.Canceled))
				h.client.PrependReactor("update", "resourceclaims", func(action cgotesting.Action) (bool, runtime.Object, error) {
					if lose.Load() && action.GetSubresource() == "status" {
						cancelWrite()
					}
					return false, nil, nil
				})
			}
			h := newHarnessWith(t, hook, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 2), testClaim("c", 2), testClaim("q", 2))
			h.pl.client = ctxClient{Interface: h.client}
			h.waitForClaim("c", func(*resourceapi.ResourceClaim) bool { return true })
			h.waitForClaim("q", func(*resourceapi.ResourceClaim) bool { return true })
			pod := testPod("p", "c")
			cs := h.reserve(pod, "node-a")
			uid := h.apiClaim("c").UID
			ctx, cancel := context.WithCancel(h.tCtx)
			cancelWrite = cancel
			if stored {
				lose.Store(true)
			} else {
				cancel()
			}
			if st := h.pl.PreBind(ctx, cs, pod, "node-a"); st.IsSuccess() {
				t.Fatal("PreBind succeeded although its context was cancelled")
			}
			lose.Store(false)
			h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
			if h.pl.uncertain.has(uid) {
				t.Errorf("the write of claim c is uncertain although the claim could be read")
			}
			c := h.apiClaim("c")
			if c.Status.Allocation != nil || len(c.Status.ReservedFor) != 0 {
				t.Fatalf("claim c in the API: allocation %v, reserved for %v; want neither", c.Status.Allocation, c.Status.ReservedFor)
			}
			if _, st := h.cycle(testPod("q", "q"), "node-a"); code(st["node-a"]) != fwk.Success {
				t.Errorf("a 2-GPU pod does not fit on node-a although claim c holds no devices in the API: %v", st["node-a"])
			}
		})
	}
}

// TestPreBindWriteOutcomeUnreadable: claim c's allocation write fails
// without an answer (a timeout), stored or not, and the claim cannot be
// read afterwards either. Until the claim can be read, its devices stay
// taken (no other pod gets them) and the pod's next attempt is an error
// (a retry after backoff); once it can be read, that attempt settles the
// claim: the pod goes on with the stored allocation, or the devices are
// free again.
func TestPreBindWriteOutcomeUnreadable(t *testing.T) {
	type testCase struct{ stored, informer bool }
	for name, tc := range map[string]testCase{
		"stored":                         {stored: true},
		"not stored":                     {},
		"stored, seen by the informer":   {stored: true, informer: true},
		"not stored, claim then labeled": {informer: true},
	} {
		stored := tc.stored
		t.Run(name, func(t *testing.T) {
			// The claim informer lags far behind (only reads settle c),
			// or a little.
			lag := time.Hour
			if tc.informer {
				lag = 300 * time.Millisecond
			}
			h, pod, uid, unreadable := failWriteUnreadable(t, stored, lag)
			if _, st := h.cycle(testPod("q", "q"), "node-a"); code(st["node-a"]) == fwk.Success {
				t.Errorf("a 2-GPU pod fits on node-a while claim c may hold both GPUs")
			}
			if _, st := h.pl.PreFilter(h.tCtx, framework.NewCycleState(), pod, nil); code(st) != fwk.Error || !strings.Contains(st.Message(), "cannot be read") {
				t.Errorf("PreFilter of the pod while its claim cannot be read: %v, want an error that says so", st)
			}

			if tc.informer {
				// The informer catches up (with another change of the
				// claim where the write was not stored), the API stays
				// unreadable.
				if !stored {
					obj, err := h.client.Tracker().Get(resourceapi.SchemeGroupVersion.WithResource("resourceclaims"), testNS, "c")
					h.tCtx.ExpectNoError(err)
					c := obj.(*resourceapi.ResourceClaim)
					c.Labels = map[string]string{"seen": "yes"}
					_, err = h.client.ResourceV1().ResourceClaims(testNS).Update(h.tCtx, c, metav1.UpdateOptions{})
					h.tCtx.ExpectNoError(err)
				}
				err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
					return !h.pl.uncertain.has(uid), nil
				})
				h.tCtx.ExpectNoError(err, "the claim informer's event did not settle claim c")
			}
			unreadable.Store(false)
			// Readable and unchanged since the write, which the API server
			// may still store: the pod's next attempt sends the write
			// again, and it is stored.
			resent := !stored && !tc.informer
			cs, st := h.cycle(pod, "node-a")
			if stored || resent {
				// c is allocated and reserved for p: nothing to allocate.
				if !st["node-a"].IsSuccess() {
					t.Fatalf("Filter of the pod whose allocation was stored: %v", st["node-a"])
				}
				if s, err := getState(cs); err != nil || len(s.toAllocate) != 0 {
					t.Errorf("the pod allocates its claim again although the API holds its allocation (state %v)", err)
				}
				if _, st := h.cycle(testPod("q", "q"), "node-a"); code(st["node-a"]) == fwk.Success {
					t.Errorf("a 2-GPU pod fits on node-a while claim c holds both GPUs")
				}
			} else {
				if !st["node-a"].IsSuccess() {
					t.Fatalf("Filter of the pod whose allocation was not stored: %v", st["node-a"])
				}
				if _, st := h.cycle(testPod("q", "q"), "node-a"); code(st["node-a"]) != fwk.Success {
					t.Errorf("node-a's GPUs are still taken after the claim was read without an allocation: %v", st["node-a"])
				}
			}
			if h.pl.uncertain.has(h.apiClaim("c").UID) {
				t.Error("claim c is still uncertain after it was read")
			}
			if c := h.apiClaim("c"); resent && (c.Status.Allocation == nil || len(c.Status.ReservedFor) != 1 || c.Status.ReservedFor[0].UID != pod.UID) {
				t.Errorf("claim c in the API: allocation %v, reserved for %v; want the write sent again stored, reserved for pod p", c.Status.Allocation, c.Status.ReservedFor)
			}
		})
	}
}

// TestWriteRefused: only an answer that refuses the write, or a request
// that never left (no connection could be made), proves a write not
// stored.
func TestWriteRefused(t *testing.T) {
	dial := &url.Error{Op: "Put", URL: "https://apiserver/apis/resource.k8s.io/v1/...", Err: &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}}
	reset := &url.Error{Op: "Put", URL: "https://apiserver/apis/resource.k8s.io/v1/...", Err: &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}}
	for name, tc := range map[string]struct {
		err  error
		want bool
	}{
		"connection refused":  {fmt.Errorf("write allocation: %w", dial), true},
		"conflict":            {apierrors.NewConflict(resourceapi.Resource("resourceclaims"), "c", errors.New("modified")), true},
		"forbidden":           {apierrors.NewForbidden(resourceapi.Resource("resourceclaims"), "c", errors.New("denied")), true},
		"connection reset":    {reset, false},
		"timeout":             {apierrors.NewTimeoutError("request did not complete within requested timeout", 1), false},
		"server error":        {apierrors.NewInternalError(errors.New("etcd")), false},
		"context cancelled":   {fmt.Errorf("Put: %w", context.Canceled), false},
		"service unavailable": {apierrors.NewServiceUnavailable("etcd leader changed"), false},
	} {
		if got := writeRefused(tc.err); got != tc.want {
			t.Errorf("%s: writeRefused(%v) = %v, want %v", name, tc.err, got, tc.want)
		}
	}
}

// TestPreBindWriteNotStoredYet: claim c's allocation write fails with a
// timeout that the API server has not acted on yet (it may still store
// the write), and the claim reads as unchanged. PreBind must not take
// that read for "not stored": it sends the write again from the same
// resourceVersion, so that at most one of the two is stored, and learns
// the outcome from that. Where PreBind's context was cancelled (the
// scheduler may be stopping), it writes nothing more: the pod's next
// attempt sends the write again, and the claim's devices stay taken
// meanwhile. Otherwise Unreserve removes the allocation that is known to
// be stored. Either way the first write, landing late, cannot give the
// devices to a second claim.
func TestPreBindWriteNotStoredYet(t *testing.T) {
	for name, tc := range map[string]struct{ lateFirst, cancelled bool }{
		"the first write lands after the second":               {},
		"the first write lands before the second":              {lateFirst: true},
		"PreBind cancelled, the pod's next attempt settles it": {cancelled: true},
	} {
		t.Run(name, func(t *testing.T) {
			var first atomic.Pointer[resourceapi.ResourceClaim]
			var h *harness
			land := func() error {
				late := first.Swap(nil)
				if late == nil {
					return nil
				}
				_, err := h.client.ResourceV1().ResourceClaims(testNS).UpdateStatus(context.Background(), late, metav1.UpdateOptions{})
				return err
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var writes atomic.Int32
			hook := func(hh *harness) {
				h = hh
				preconditionReactor(hh)
				hh.client.PrependReactor("update", "resourceclaims", func(action cgotesting.Action) (bool, runtime.Object, error) {
					u := action.(cgotesting.UpdateAction)
					obj := u.GetObject().(*resourceapi.ResourceClaim)
					if u.GetSubresource() != "status" || obj.Name != "c" || obj.Status.Allocation == nil {
						return false, nil, nil
					}
					switch writes.Add(1) {
					case 1:
						// Kept for later, as an API server still at work
						// on it after the client gave up.
						first.Store(obj.DeepCopy())
						if tc.cancelled {
							cancel()
						}
						return true, nil, apierrors.NewTimeoutError("request did not complete within requested timeout", 1)
					case 2:
						if late := first.Swap(nil); tc.lateFirst && late != nil {
							// Stored by the API server just before the
							// second write arrives (straight into the
							// tracker: the fake client's reactors cannot
							// call it).
							late.ResourceVersion = "1000000" // newer than any the harness gave out
							if err := hh.client.Tracker().Update(action.GetResource(), late, testNS, metav1.UpdateOptions{}); err != nil {
								return true, nil, err
							}
						} else if late != nil {
							first.Store(late)
						}
					}
					return false, nil, nil
				})
			}
			fastSettleReads(t)
			h = newHarnessWith(t, hook, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 2), testClaim("c", 2), testClaim("q", 2))
			h.waitForClaim("c", func(*resourceapi.ResourceClaim) bool { return true })
			h.waitForClaim("q", func(*resourceapi.ResourceClaim) bool { return true })
			pod := testPod("p", "c")
			cs := h.reserve(pod, "node-a")
			uid := h.apiClaim("c").UID
			if st := h.pl.PreBind(ctx, cs, pod, "node-a"); st.IsSuccess() {
				t.Fatal("PreBind succeeded although the write timed out")
			}
			h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
			if h.pl.uncertain.has(uid) != tc.cancelled {
				t.Errorf("the write of claim c is uncertain: %v, want %v", h.pl.uncertain.has(uid), tc.cancelled)
			}
			if _, st := h.cycle(testPod("q", "q"), "node-a"); tc.cancelled && code(st["node-a"]) == fwk.Success {
				t.Errorf("a 2-GPU pod fits on node-a while claim c's write may still be stored")
			}
			reservedFor := 0
			if tc.cancelled {
				if writes.Load() != 1 {
					t.Errorf("%d writes of claim c's allocation, want 1: a cancelled PreBind writes nothing more", writes.Load())
				}
				if _, st := h.pl.PreFilter(h.tCtx, framework.NewCycleState(), pod, nil); !st.IsSuccess() {
					t.Fatalf("PreFilter of the pod's next attempt: %v", st)
				}
				if h.pl.uncertain.has(uid) {
					t.Error("the write of claim c is still uncertain after the pod's next attempt")
				}
				reservedFor = 1
			}
			// The first write, where it has not landed yet, tries now.
			if err := land(); !tc.lateFirst && !apierrors.IsConflict(err) {
				t.Errorf("the first write, landing after the second: %v, want a conflict", err)
			}
			c := h.apiClaim("c")
			if !tc.cancelled {
				if c.Status.Allocation != nil || len(c.Status.ReservedFor) != 0 {
					t.Errorf("claim c in the API: allocation %v, reserved for %v; want neither after Unreserve", c.Status.Allocation, c.Status.ReservedFor)
				}
				if _, st := h.cycle(testPod("q", "q"), "node-a"); code(st["node-a"]) != fwk.Success {
					t.Errorf("a 2-GPU pod does not fit on node-a although claim c holds no devices: %v", st["node-a"])
				}
				return
			}
			if c.Status.Allocation == nil || len(c.Status.ReservedFor) != reservedFor {
				t.Errorf("claim c in the API: allocation %v, reserved for %v; want allocated, reserved for %d pod(s)", c.Status.Allocation, c.Status.ReservedFor, reservedFor)
			}
			if _, st := h.cycle(testPod("q", "q"), "node-a"); code(st["node-a"]) == fwk.Success {
				t.Errorf("a 2-GPU pod fits on node-a while claim c holds both GPUs")
			}
		})
	}
}

// failWriteUnreadable reserves node-a's two GPUs for pod p (claim c; claim
// q asks for two more) and runs p's PreBind while the claim informer lags
// by lag, the allocation write's reply is lost (the write stored or not)
// and claims cannot be read, then Unreserve. reactors are installed on
// the fake API before those that lose the reply and refuse reads. It
// returns the harness, the pod, c's UID and the switch that keeps claims
// unreadable (still on).
func failWriteUnreadable(t *testing.T, stored bool, lag time.Duration, reactors ...func(*harness)) (*harness, *v1.Pod, types.UID, *atomic.Bool) {
	t.Helper()
	var lagged atomic.Int64
	var lose, unreadable atomic.Bool
	hook := func(h *harness) {
		lagClaimWatch(h, &lagged)
		for _, r := range reactors {
			r(h)
		}
		loseStatusReplies(h, &lose, stored, apierrors.NewTimeoutError("request did not complete within requested timeout", 1))
		unreadableClaims(h, &unreadable)
	}
	fastSettleReads(t)
	h := newHarnessWith(t, hook, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 2), testClaim("c", 2), testClaim("q", 2))
	h.waitForClaim("c", func(*resourceapi.ResourceClaim) bool { return true })
	h.waitForClaim("q", func(*resourceapi.ResourceClaim) bool { return true })
	pod := testPod("p", "c")
	cs := h.reserve(pod, "node-a")
	uid := h.apiClaim("c").UID
	lagged.Store(int64(lag))
	lose.Store(true)
	unreadable.Store(true)
	if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); st.IsSuccess() {
		t.Fatal("PreBind succeeded although the write failed")
	}
	lose.Store(false)
	h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
	return h, pod, uid, &unreadable
}

// unreadableClaims makes every get of a claim fail as unavailable while
// unreadable is set.
func unreadableClaims(h *harness, unreadable *atomic.Bool) {
	h.client.PrependReactor("get", "resourceclaims", func(action cgotesting.Action) (bool, runtime.Object, error) {
		if unreadable.Load() {
			return true, nil, apierrors.NewServiceUnavailable("etcd leader changed")
		}
		return false, nil, nil
	})
}

// fastSettleReads shortens the pause between PreBind's reads of a claim
// whose write failed, for the test.
func fastSettleReads(t *testing.T) {
	reads := settleReads
	settleReads.Duration = time.Millisecond
	t.Cleanup(func() { settleReads = reads })
}

// TestUncertainWriteSettledWhenNobodyReadsTheClaim: claim c's allocation
// write has an unknown outcome and the claim cannot be read; then its pod
// is deleted, so no PreFilter reads the claim again, and the claim does
// not change, so no informer event settles it. The background re-read
// settles it once the write is older than the API server's request
// timeout: not stored, the GPUs are free again and the pods that wait for
// devices are retried (no claim event tells the queue); stored, they stay
// taken. Before that age it leaves the write alone.
func TestUncertainWriteSettledWhenNobodyReadsTheClaim(t *testing.T) {
	for _, stored := range []bool{false, true} {
		t.Run(fmt.Sprintf("stored %v", stored), func(t *testing.T) {
			h, _, uid, unreadable := failWriteUnreadable(t, stored, time.Hour)
			if !h.pl.uncertain.has(uid) {
				t.Fatal("the write of claim c is not uncertain")
			}
			q := testPod("q", "q")
			// q waits for devices: the release must retry it, as no
			// claim event will.
			if _, err := h.client.CoreV1().Pods(testNS).Create(h.tCtx, q, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			if err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
				_, err := h.pl.pods.Pods(testNS).Get("q")
				return err == nil, nil
			}); err != nil {
				t.Fatalf("the pod lister never saw pod q: %v", err)
			}
			h.pl.rereadUncertain(h.tCtx, time.Now().Add(2*uncertainRereadAge))
			if !h.pl.uncertain.has(uid) {
				t.Fatal("settled while the claim could not be read")
			}
			unreadable.Store(false)
			h.pl.rereadUncertain(h.tCtx, time.Now())
			if !h.pl.uncertain.has(uid) {
				t.Fatal("settled before the write was older than the API server's request timeout")
			}
			if _, st := h.cycle(q, "node-a"); code(st["node-a"]) == fwk.Success {
				t.Fatal("a 2-GPU pod fits on node-a while claim c may hold both GPUs")
			}
			h.pl.rereadUncertain(h.tCtx, time.Now().Add(2*uncertainRereadAge))
			if h.pl.uncertain.has(uid) {
				t.Fatal("the write of claim c is still uncertain after the re-read")
			}
			_, st := h.cycle(q, "node-a")
			activated := h.activated.activatedPods()
			switch {
			case stored && code(st["node-a"]) == fwk.Success:
				t.Errorf("a 2-GPU pod fits on node-a while claim c holds both GPUs in the API")
			case stored && len(activated) > 0:
				t.Errorf("pods %v retried although no devices went free", activated)
			case !stored && code(st["node-a"]) != fwk.Success:
				t.Errorf("node-a's GPUs are still taken after claim c was read without an allocation: %v", st["node-a"])
			case !stored && !slices.Contains(activated, "ns/q"):
				t.Errorf("pods retried: %v, want ns/q, which waits for devices", activated)
			}
		})
	}
}

// TestPreFilterReadOfUncertainClaimIsBounded: PreFilter reads a claim
// whose write is uncertain from the API server on the scheduling cycle;
// where the API server does not answer, the read ends after
// preFilterAPITimeout with an error (the pod retries after backoff), and
// the cycle goes on to other pods.
func TestPreFilterReadOfUncertainClaimIsBounded(t *testing.T) {
	h, pod, uid, _ := failWriteUnreadable(t, false, time.Hour)
	if !h.pl.uncertain.has(uid) {
		t.Fatal("the write of claim c is not uncertain")
	}
	timeout := preFilterAPITimeout
	preFilterAPITimeout = 100 * time.Millisecond
	t.Cleanup(func() { preFilterAPITimeout = timeout })
	h.pl.client = ctxClient{Interface: h.client, hangGets: true}
	done := make(chan *fwk.Status, 1)
	go func() {
		_, st := h.pl.PreFilter(h.tCtx, framework.NewCycleState(), pod, nil)
		done <- st
	}()
	select {
	case st := <-done:
		if code(st) != fwk.Error || !strings.Contains(st.Message(), "cannot be read") || !strings.Contains(st.Message(), "deadline exceeded") {
			t.Errorf("PreFilter: %v, want an error that the claim cannot be read (deadline exceeded)", st)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("PreFilter still waits for the API server after 10 s")
	}
	if !h.pl.uncertain.has(uid) {
		t.Error("the claim's write was settled although the claim was not read")
	}
}

// TestStoredClaimNotYetCachedKeepsDevices: a claim whose uncertain write
// turns out stored is taken into the claim cache and its in-flight
// allocation dropped; where the cache has not seen the claim yet (an
// extended resource claim created in PreBind, its informer behind), the
// in-flight allocation stays until the cache has it, so that its devices
// never look free.
func TestStoredClaimNotYetCachedKeepsDevices(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("node-a")}, testDeviceClass(), testSlice("node-a", 2), testClaim("q", 2))
	h.waitForClaim("q", func(*resourceapi.ResourceClaim) bool { return true })
	x := allocatedOn(testClaim("x", 2), "node-a", "gpu-0", "gpu-1")
	x.UID = "uid-x"
	// In flight as an extended resource claim is before PreBind creates
	// it: under its in-memory name and a UID of its own.
	inMemory := x.DeepCopy()
	inMemory.Name, inMemory.UID = inMemoryClaimName, "in-memory-x"
	h.tCtx.ExpectNoError(h.pl.draManager.ResourceClaims().SignalClaimPendingAllocation(inMemory.UID, inMemory))
	if _, st := h.cycle(testPod("q", "q"), "node-a"); code(st["node-a"]) == fwk.Success {
		t.Fatal("a 2-GPU pod fits beside claim x's in-flight allocation")
	}
	h.pl.takeInStored(klog.Background(), x, inMemory.UID)
	if h.pl.draManager.ResourceClaims().GetPendingAllocation(inMemory.UID) == nil {
		t.Error("the in-flight allocation of claim x went before the claim cache had the claim")
	}
	if _, st := h.cycle(testPod("q", "q"), "node-a"); code(st["node-a"]) == fwk.Success {
		t.Error("a 2-GPU pod fits while claim x, not yet in the claim cache, holds both GPUs")
	}
	// The informer brings the claim: the in-flight allocation goes, and
	// the cache's copy holds the GPUs.
	_, err := h.client.ResourceV1().ResourceClaims(testNS).Create(h.tCtx, x, metav1.CreateOptions{})
	h.tCtx.ExpectNoError(err)
	err = wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return h.pl.draManager.ResourceClaims().GetPendingAllocation(inMemory.UID) == nil, nil
	})
	h.tCtx.ExpectNoError(err, "the in-flight allocation of claim x stayed after the cache had the claim")
	if _, st := h.cycle(testPod("q", "q"), "node-a"); code(st["node-a"]) == fwk.Success {
		t.Error("a 2-GPU pod fits while claim x holds both GPUs in the API")
	}
}
