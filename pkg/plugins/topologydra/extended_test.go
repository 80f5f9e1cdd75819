package topologydra

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	cgotesting "k8s.io/client-go/testing"
	featuregatetesting "k8s.io/component-base/featuregate/testing"
	"k8s.io/component-base/metrics/testutil"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/features"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	schedmetrics "k8s.io/kubernetes/pkg/scheduler/metrics"
	"k8s.io/utils/ptr"
)

func TestBacks(t *testing.T) {
	implicit := &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: "gpu.example.com"}}
	explicit := implicit.DeepCopy()
	explicit.Spec.ExtendedResourceName = ptr.To("example.com/gpu")
	for _, tc := range []struct {
		class *resourceapi.DeviceClass
		name  v1.ResourceName
		want  bool
	}{
		{implicit, "deviceclass.resource.kubernetes.io/gpu.example.com", true},
		{implicit, "example.com/gpu", false},
		{explicit, "example.com/gpu", true},
		// The implicit name stays next to an explicit one.
		{explicit, "deviceclass.resource.kubernetes.io/gpu.example.com", true},
		{explicit, "deviceclass.resource.kubernetes.io/other", false},
	} {
		if got := backs(tc.class, tc.name); got != tc.want {
			t.Errorf("class %s (extendedResourceName %v) backs %s: got %v, want %v", tc.class.Name, ptr.Deref(tc.class.Spec.ExtendedResourceName, ""), tc.name, got, tc.want)
		}
	}
}

// extClass backs example.com/gpu with the harness's GPUs.
func extClass() *resourceapi.DeviceClass {
	c := testDeviceClass()
	c.Spec.ExtendedResourceName = ptr.To("example.com/gpu")
	return c
}

// extPod asks for n example.com/gpu in one container "main".
func extPod(name string, n int64) *v1.Pod {
	p := testPod(name)
	p.Spec.Containers = []v1.Container{{Name: "main", Resources: v1.ResourceRequirements{
		Requests: v1.ResourceList{"example.com/gpu": *resource.NewQuantity(n, resource.DecimalSI)},
		Limits:   v1.ResourceList{"example.com/gpu": *resource.NewQuantity(n, resource.DecimalSI)},
	}}}
	return p
}

func TestExtendedRequests(t *testing.T) {
	gpus := func(n int64) v1.ResourceRequirements {
		return v1.ResourceRequirements{Requests: v1.ResourceList{
			v1.ResourceCPU: resource.MustParse("1"), "example.com/gpu": *resource.NewQuantity(n, resource.DecimalSI),
		}}
	}
	req := func(name string, n int64) resourceapi.DeviceRequest {
		return *exactRequest(name, "gpu", n)
	}
	m := func(container, request string) v1.ContainerExtendedResourceRequest {
		return v1.ContainerExtendedResourceRequest{ContainerName: container, ResourceName: "example.com/gpu", RequestName: request}
	}
	always := ptr.To(v1.ContainerRestartPolicyAlways)
	tests := map[string]struct {
		init, containers []v1.Container
		wantRequests     []resourceapi.DeviceRequest
		wantMappings     []v1.ContainerExtendedResourceRequest
	}{
		"one container": {
			containers:   []v1.Container{{Name: "a", Resources: gpus(2)}},
			wantRequests: []resourceapi.DeviceRequest{req("container-0-request-1", 2)},
			wantMappings: []v1.ContainerExtendedResourceRequest{m("a", "container-0-request-1")},
		},
		"two containers, one without": {
			containers:   []v1.Container{{Name: "a", Resources: gpus(1)}, {Name: "b"}, {Name: "c", Resources: gpus(3)}},
			wantRequests: []resourceapi.DeviceRequest{req("container-0-request-1", 1), req("container-2-request-1", 3)},
			wantMappings: []v1.ContainerExtendedResourceRequest{m("a", "container-0-request-1"), m("c", "container-2-request-1")},
		},
		"init container reuses the containers' devices": {
			init:         []v1.Container{{Name: "i", Resources: gpus(2)}},
			containers:   []v1.Container{{Name: "a", Resources: gpus(2)}},
			wantRequests: []resourceapi.DeviceRequest{req("container-1-request-1", 2)},
			wantMappings: []v1.ContainerExtendedResourceRequest{m("a", "container-1-request-1"), m("i", "container-1-request-1")},
		},
		"init containers share one request for what the containers lack": {
			init:       []v1.Container{{Name: "i0", Resources: gpus(3)}, {Name: "i1", Resources: gpus(4)}},
			containers: []v1.Container{{Name: "a", Resources: gpus(1)}},
			wantRequests: []resourceapi.DeviceRequest{
				req("container-1-request-1", 3), req("container-2-request-1", 1),
			},
			wantMappings: []v1.ContainerExtendedResourceRequest{
				m("a", "container-2-request-1"),
				m("i0", "container-2-request-1"), m("i0", "container-1-request-1"),
				m("i1", "container-2-request-1"), m("i1", "container-1-request-1"),
			},
		},
		"a sidecar keeps its own devices, earlier init containers reuse them": {
			init:         []v1.Container{{Name: "i", Resources: gpus(1)}, {Name: "side", RestartPolicy: always, Resources: gpus(1)}},
			containers:   []v1.Container{{Name: "a", Resources: gpus(1)}},
			wantRequests: []resourceapi.DeviceRequest{req("container-1-request-1", 1), req("container-2-request-1", 1)},
			wantMappings: []v1.ContainerExtendedResourceRequest{
				m("side", "container-1-request-1"), m("a", "container-2-request-1"), m("i", "container-1-request-1"),
			},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			pod := &v1.Pod{Spec: v1.PodSpec{InitContainers: tc.init, Containers: tc.containers}}
			reqs, mappings := extendedRequests(pod, []draExtended{{name: "example.com/gpu", class: "gpu"}})
			if diff := cmp.Diff(tc.wantRequests, reqs); diff != "" {
				t.Errorf("requests (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tc.wantMappings, mappings); diff != "" {
				t.Errorf("mappings (-want +got):\n%s", diff)
			}
		})
	}
}

// TestExtendedDevicePluginNode: on a node whose allocatable offers the
// resource (a device plugin), the pod is left to NodeResourcesFit: no
// allocation, no claim. On a node without it, the claim asks for the
// devices and Filter allocates an aligned pair.
func TestExtendedDevicePluginNode(t *testing.T) {
	plugin := testNode("plugin")
	plugin.Status.Allocatable = v1.ResourceList{"example.com/gpu": resource.MustParse("4")}
	h := newHarness(t, []*v1.Node{plugin, testNode("dra")}, extClass(), testSlice("dra", 4))
	pod := extPod("p", 2)
	cs, st := h.cycle(pod, "plugin", "dra")
	for n, s := range st {
		if !s.IsSuccess() {
			t.Fatalf("Filter on %s: %v", n, s)
		}
	}
	s, err := getState(cs)
	h.tCtx.ExpectNoError(err)
	if s.getResult("plugin") != nil {
		t.Errorf("allocation on the device-plugin node: %v", s.getResult("plugin"))
	}
	res := s.getResult("dra")
	if res == nil || len(res.Allocations) != 1 {
		t.Fatalf("allocation on the DRA node: %+v", res)
	}
	if got := devicesOf(res.Allocations[0]); len(got) != 2 || !sameRoot(got) {
		t.Errorf("devices on the DRA node: %v, want a pair on one PCIe root", got)
	}
	if st := h.pl.Reserve(h.tCtx, cs, pod, "plugin"); !st.IsSuccess() {
		t.Fatalf("Reserve: %v", st)
	}
	if st := h.pl.PreBind(h.tCtx, cs, pod, "plugin"); !st.IsSuccess() {
		t.Fatalf("PreBind: %v", st)
	}
	claims, err := h.client.ResourceV1().ResourceClaims(testNS).List(h.tCtx, metav1.ListOptions{})
	h.tCtx.ExpectNoError(err)
	if len(claims.Items) != 0 {
		t.Errorf("claims created for a device-plugin node: %v", claims.Items)
	}
}

// sameRoot: testSlice puts gpu-0/1 and gpu-2/3 on one PCIe root each.
func sameRoot(devices []string) bool {
	root := func(d string) int { return int(d[len(d)-1]-'0') / 2 }
	for _, d := range devices {
		if root(d) != root(devices[0]) {
			return false
		}
	}
	return true
}

// TestExtendedPreBind: PreBind creates the claim (owned by the pod, with
// the annotation, the node's requests), writes its allocation and
// reservation and names it in the pod's status; Unreserve after that
// deletes it and releases its devices.
func TestExtendedPreBind(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("node-a")}, extClass(), testSlice("node-a", 4))
	pod := extPod("p", 2)
	created, err := h.client.CoreV1().Pods(testNS).Create(h.tCtx, pod, metav1.CreateOptions{})
	h.tCtx.ExpectNoError(err)
	pod = created
	cs := h.reserve(pod, "node-a")
	schedmetrics.Register() // with DRAExtendedResource on, the claim creation counter
	creates := schedmetrics.ResourceClaimCreatesTotal.WithLabelValues("success", "false", "", "Pod")
	before, err := testutil.GetCounterMetricValue(creates)
	h.tCtx.ExpectNoError(err)
	if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); !st.IsSuccess() {
		t.Fatalf("PreBind: %v", st)
	}
	if after, _ := testutil.GetCounterMetricValue(creates); after != before+1 {
		t.Errorf("dynamic_resource_allocation_resourceclaim_creates_total{status=success}: %v after PreBind, want %v", after, before+1)
	}
	claims, err := h.client.ResourceV1().ResourceClaims(testNS).List(h.tCtx, metav1.ListOptions{})
	h.tCtx.ExpectNoError(err)
	if len(claims.Items) != 1 {
		t.Fatalf("want one claim, got %d", len(claims.Items))
	}
	claim := claims.Items[0]
	if !strings.HasPrefix(claim.Name, "p-extended-resources-") {
		t.Errorf("claim name %q", claim.Name)
	}
	if claim.Annotations[resourceapi.ExtendedResourceClaimAnnotation] != "true" {
		t.Errorf("claim annotations %v", claim.Annotations)
	}
	if err := resourceclaim.IsForPod(pod, &claim, false); err != nil {
		t.Errorf("claim owner: %v", err)
	}
	if diff := cmp.Diff([]resourceapi.DeviceRequest{*exactRequest("container-0-request-0", testClass, 2)}, claim.Spec.Devices.Requests); diff != "" {
		t.Errorf("claim requests (-want +got):\n%s", diff)
	}
	if claim.Status.Allocation == nil || len(devicesOf(*claim.Status.Allocation)) != 2 || !sameRoot(devicesOf(*claim.Status.Allocation)) {
		t.Errorf("claim allocation %+v, want a pair on one PCIe root", claim.Status.Allocation)
	}
	if !resourceclaim.IsReservedForPod(pod, &claim, false) {
		t.Errorf("claim reservedFor %v", claim.Status.ReservedFor)
	}
	got, err := h.client.CoreV1().Pods(testNS).Get(h.tCtx, pod.Name, metav1.GetOptions{})
	h.tCtx.ExpectNoError(err)
	want := &v1.PodExtendedResourceClaimStatus{ResourceClaimName: claim.Name, RequestMappings: []v1.ContainerExtendedResourceRequest{
		{ContainerName: "main", ResourceName: "example.com/gpu", RequestName: "container-0-request-0"},
	}}
	if diff := cmp.Diff(want, got.Status.ExtendedResourceClaimStatus); diff != "" {
		t.Errorf("pod status.extendedResourceClaimStatus (-want +got):\n%s", diff)
	}

	h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
	if _, err := h.client.ResourceV1().ResourceClaims(testNS).Get(h.tCtx, claim.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("claim after Unreserve: %v, want it deleted", err)
	}
	h.waitForClaimGone(claim.Name)
	// All four devices are free again: a pod for four fits.
	if _, st := h.cycle(extPod("q", 4), "node-a"); !st["node-a"].IsSuccess() {
		t.Errorf("Filter of a four-GPU pod after Unreserve: %v", st["node-a"])
	}
}

// TestExtendedUnreserveBeforeCreate: Unreserve before PreBind drops the
// in-flight allocation and creates or deletes nothing.
func TestExtendedUnreserveBeforeCreate(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("node-a")}, extClass(), testSlice("node-a", 4))
	pod := extPod("p", 2)
	cs := h.reserve(pod, "node-a")
	if _, st := h.cycle(extPod("q", 4), "node-a"); code(st["node-a"]) == fwk.Success {
		t.Errorf("a four-GPU pod fits while two GPUs are in flight")
	}
	h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
	if _, st := h.cycle(extPod("q", 4), "node-a"); !st["node-a"].IsSuccess() {
		t.Errorf("Filter of a four-GPU pod after Unreserve: %v", st["node-a"])
	}
}

// TestExtendedUnreserveDeleteFails: PreBind creates the extended resource
// claim, and its allocation write fails without an answer; Unreserve then
// cannot delete the claim (the API server is unreachable). The claim's
// devices stay taken while the API may hold its allocation, and are free
// again once the claim is gone: deleted by the pod's next PreFilter, or
// by someone else (the garbage collector, after the pod is deleted), as
// the claim informer shows.
func TestExtendedUnreserveDeleteFails(t *testing.T) {
	for name, byPreFilter := range map[string]bool{"deleted by the next PreFilter": true, "deletion seen by the informer": false} {
		t.Run(name, func(t *testing.T) {
			var lose, apiDown atomic.Bool
			hook := func(h *harness) {
				loseStatusReplies(h, &lose, false, apierrors.NewTimeoutError("request did not complete within requested timeout", 1))
				h.client.PrependReactor("*", "resourceclaims", func(action cgotesting.Action) (bool, runtime.Object, error) {
					if apiDown.Load() && action.GetVerb() != "list" && action.GetVerb() != "watch" {
						return true, nil, apierrors.NewServiceUnavailable("apiserver unreachable")
					}
					return false, nil, nil
				})
			}
			h := newHarnessWith(t, hook, []*v1.Node{testNode("node-a")}, extClass(), testSlice("node-a", 2))
			pod := extPod("p", 2)
			cs := h.reserve(pod, "node-a")
			lose.Store(true)
			if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); st.IsSuccess() {
				t.Fatal("PreBind succeeded although the allocation write failed")
			}
			lose.Store(false)
			s, err := getState(cs)
			h.tCtx.ExpectNoError(err)
			created, pendingUID := s.extended.created, s.extended.pendingUID
			if created == nil {
				t.Fatal("PreBind did not create the extended resource claim")
			}
			apiDown.Store(true)
			h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
			apiDown.Store(false)
			if _, st := h.cycle(extPod("q", 2), "node-a"); code(st["node-a"]) == fwk.Success {
				t.Errorf("a 2-GPU pod fits on node-a while the undeleted claim %s may hold both GPUs", created.Name)
			}

			if byPreFilter {
				h.waitForClaim(created.Name, func(*resourceapi.ResourceClaim) bool { return true })
				h.cycle(pod, "node-a")
				if h.pl.draManager.ResourceClaims().GetPendingAllocation(pendingUID) != nil {
					t.Errorf("the in-flight allocation of claim %s is still held after the pod's next PreFilter deleted it", created.Name)
				}
			} else {
				h.tCtx.ExpectNoError(h.client.ResourceV1().ResourceClaims(testNS).Delete(h.tCtx, created.Name, metav1.DeleteOptions{}))
				err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
					return h.pl.draManager.ResourceClaims().GetPendingAllocation(pendingUID) == nil, nil
				})
				h.tCtx.ExpectNoError(err, "the in-flight allocation of the deleted claim is still held")
			}
			if _, err := h.client.ResourceV1().ResourceClaims(testNS).Get(h.tCtx, created.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				t.Errorf("claim %s: %v, want it deleted", created.Name, err)
			}
			if h.pl.uncertain.has(created.UID) {
				t.Errorf("claim %s is still uncertain after its deletion", created.Name)
			}
			if _, st := h.cycle(extPod("q", 2), "node-a"); !st["node-a"].IsSuccess() {
				t.Errorf("Filter of a 2-GPU pod after claim %s was deleted: %v", created.Name, st["node-a"])
			}
		})
	}
}

// refusing makes a harness's API refuse every verb request on resource
// with err.
func refusing(verb, resource string, err error) func(*harness) {
	return func(h *harness) {
		h.client.PrependReactor(verb, resource, func(cgotesting.Action) (bool, runtime.Object, error) {
			return true, nil, err
		})
	}
}

// expectEvent fails the test unless an event with reason was recorded
// (the oldest one not yet read).
func (h *harness) expectEvent(t *testing.T, reason string) {
	t.Helper()
	select {
	case ev := <-h.recorder.Events:
		if !strings.Contains(ev, reason) {
			t.Errorf("event %q, want one with reason %s", ev, reason)
		}
	default:
		t.Errorf("no event on the pod, want one with reason %s", reason)
	}
}

// TestExtendedCreateFailure: a refused claim creation fails PreBind with
// a Warning event on the pod and counts as a failed creation in the stock
// plugin's counter.
func TestExtendedCreateFailure(t *testing.T) {
	h := newHarnessWith(t, refusing("create", "resourceclaims", apierrors.NewForbidden(resourceapi.Resource("resourceclaims"), "", errors.New("quota exceeded"))),
		[]*v1.Node{testNode("node-a")}, extClass(), testSlice("node-a", 4))
	pod := extPod("p", 2)
	cs := h.reserve(pod, "node-a")
	schedmetrics.Register() // with DRAExtendedResource on, the claim creation counter
	failures := schedmetrics.ResourceClaimCreatesTotal.WithLabelValues("failure", "false", "", "Pod")
	before, err := testutil.GetCounterMetricValue(failures)
	h.tCtx.ExpectNoError(err)
	if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); st.IsSuccess() || !strings.Contains(st.Message(), "quota exceeded") {
		t.Fatalf("PreBind: %v, want a failure with the API server's reason", st)
	}
	if after, _ := testutil.GetCounterMetricValue(failures); after != before+1 {
		t.Errorf("dynamic_resource_allocation_resourceclaim_creates_total{status=failure}: %v after PreBind, want %v", after, before+1)
	}
	h.expectEvent(t, "FailedExtendedResourceClaim")
}

// TestExtendedPatchFailure: a failed pod status write fails PreBind with a
// message and an event on the pod; Unreserve deletes the claim created.
func TestExtendedPatchFailure(t *testing.T) {
	h := newHarnessWith(t, refusing("patch", "pods", apierrors.NewForbidden(v1.Resource("pods"), "p", errors.New("no"))),
		[]*v1.Node{testNode("node-a")}, extClass(), testSlice("node-a", 4))
	pod := extPod("p", 2)
	cs := h.reserve(pod, "node-a")
	st := h.pl.PreBind(h.tCtx, cs, pod, "node-a")
	if st.IsSuccess() || !strings.Contains(st.Message(), "status.extendedResourceClaimStatus") {
		t.Fatalf("PreBind: %v, want a failure naming the pod status field", st)
	}
	h.expectEvent(t, "FailedExtendedResourceClaim")
	h.pl.Unreserve(h.tCtx, cs, pod, "node-a")
	claims, err := h.client.ResourceV1().ResourceClaims(testNS).List(h.tCtx, metav1.ListOptions{})
	h.tCtx.ExpectNoError(err)
	if len(claims.Items) != 0 {
		t.Errorf("claims after Unreserve: %d, want the created one deleted", len(claims.Items))
	}
}

// TestExtendedEarlierClaimReplaced: a claim of an earlier attempt that the
// pod's status names (allocated on node-a, where binding failed) is not
// reused: PreFilter deletes it, the pod may go to any node, and PreBind
// creates a new claim and names it in the status.
func TestExtendedEarlierClaimReplaced(t *testing.T) {
	pod := extPod("p", 2)
	claim := allocatedOn(testClaim("p-extended-resources-x", 2), "node-a", "gpu-2", "gpu-3")
	claim.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Pod", Name: pod.Name, UID: pod.UID, Controller: ptr.To(true)}}
	claim.Annotations = map[string]string{resourceapi.ExtendedResourceClaimAnnotation: "true"}
	claim.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: pod.Name, UID: pod.UID}}
	h := newHarness(t, []*v1.Node{testNode("node-a"), testNode("node-b")}, extClass(), testSlice("node-a", 4), testSlice("node-b", 4), claim)
	pod.Status.ExtendedResourceClaimStatus = &v1.PodExtendedResourceClaimStatus{ResourceClaimName: claim.Name}
	created, err := h.client.CoreV1().Pods(testNS).Create(h.tCtx, pod, metav1.CreateOptions{})
	h.tCtx.ExpectNoError(err)
	pod = created
	cs, st := h.cycle(pod, "node-a", "node-b")
	if !st["node-b"].IsSuccess() {
		t.Errorf("Filter on node-b: %v, want the pod free to go there", st["node-b"])
	}
	if _, err := h.client.ResourceV1().ResourceClaims(testNS).Get(h.tCtx, claim.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("earlier claim after PreFilter: %v, want it deleted", err)
	}
	if st := h.pl.Reserve(h.tCtx, cs, pod, "node-b"); !st.IsSuccess() {
		t.Fatalf("Reserve: %v", st)
	}
	if st := h.pl.PreBind(h.tCtx, cs, pod, "node-b"); !st.IsSuccess() {
		t.Fatalf("PreBind: %v", st)
	}
	claims, err := h.client.ResourceV1().ResourceClaims(testNS).List(h.tCtx, metav1.ListOptions{})
	h.tCtx.ExpectNoError(err)
	if len(claims.Items) != 1 || claims.Items[0].Name == claim.Name {
		t.Fatalf("claims: %v, want one new claim", claims.Items)
	}
	got, err := h.client.CoreV1().Pods(testNS).Get(h.tCtx, pod.Name, metav1.GetOptions{})
	h.tCtx.ExpectNoError(err)
	if status := got.Status.ExtendedResourceClaimStatus; status == nil || status.ResourceClaimName != claims.Items[0].Name {
		t.Errorf("pod status names %+v, want the new claim %s", status, claims.Items[0].Name)
	}
}

// TestExtendedEarlierStatusKeepsPodOffDevicePluginNodes: a pod whose
// status names the extended resource claim of an earlier attempt (which
// the API server never lets go and the kubelet looks up) is rejected on a
// node whose device plugin offers its resources, and gets a new claim on a
// node where DRA provides them; where the scheduler's copy of the pod does
// not show the status yet, PreBind on the device-plugin node finds it in
// the API and fails.
func TestExtendedEarlierStatusKeepsPodOffDevicePluginNodes(t *testing.T) {
	plugin := testNode("plugin")
	plugin.Status.Allocatable = v1.ResourceList{"example.com/gpu": resource.MustParse("4")}
	h := newHarness(t, []*v1.Node{plugin, testNode("dra")}, extClass(), testSlice("dra", 4))
	earlier := &v1.PodExtendedResourceClaimStatus{ResourceClaimName: "p-extended-resources-gone",
		RequestMappings: []v1.ContainerExtendedResourceRequest{{ContainerName: "main", ResourceName: "example.com/gpu", RequestName: "container-0-request-0"}}}

	pod := extPod("p", 2)
	pod.Status.ExtendedResourceClaimStatus = earlier
	created, err := h.client.CoreV1().Pods(testNS).Create(h.tCtx, pod, metav1.CreateOptions{})
	h.tCtx.ExpectNoError(err)
	pod = created
	cs, st := h.cycle(pod, "plugin", "dra")
	if code(st["plugin"]) != fwk.UnschedulableAndUnresolvable || !strings.Contains(st["plugin"].Message(), earlier.ResourceClaimName) {
		t.Errorf("Filter on the device-plugin node: %v, want the node rejected naming claim %s", st["plugin"], earlier.ResourceClaimName)
	}
	if !st["dra"].IsSuccess() {
		t.Fatalf("Filter on the DRA node: %v", st["dra"])
	}
	if st := h.pl.Reserve(h.tCtx, cs, pod, "dra"); !st.IsSuccess() {
		t.Fatalf("Reserve: %v", st)
	}
	if st := h.pl.PreBind(h.tCtx, cs, pod, "dra"); !st.IsSuccess() {
		t.Fatalf("PreBind: %v", st)
	}
	got, err := h.client.CoreV1().Pods(testNS).Get(h.tCtx, pod.Name, metav1.GetOptions{})
	h.tCtx.ExpectNoError(err)
	if got.Status.ExtendedResourceClaimStatus == nil || got.Status.ExtendedResourceClaimStatus.ResourceClaimName == earlier.ResourceClaimName {
		t.Errorf("pod status.extendedResourceClaimStatus %+v on the DRA node, want the new claim named", got.Status.ExtendedResourceClaimStatus)
	}

	// The scheduler's copy lacks the status that the API has, and a claim
	// of the earlier attempt is left over.
	q := extPod("q", 2)
	q.UID = "uid-q"
	q.Status.ExtendedResourceClaimStatus = &v1.PodExtendedResourceClaimStatus{ResourceClaimName: "q-extended-resources-old", RequestMappings: earlier.RequestMappings}
	_, err = h.client.CoreV1().Pods(testNS).Create(h.tCtx, q, metav1.CreateOptions{})
	h.tCtx.ExpectNoError(err)
	leftover := testClaim("q-extended-resources-old", 2)
	leftover.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Pod", Name: q.Name, UID: q.UID, Controller: ptr.To(true)}}
	leftover.Annotations = map[string]string{resourceapi.ExtendedResourceClaimAnnotation: "true"}
	h.create(leftover)
	h.waitForClaim(leftover.Name, func(*resourceapi.ResourceClaim) bool { return true })
	seen := q.DeepCopy()
	seen.Status.ExtendedResourceClaimStatus = nil
	cs = h.reserve(seen, "plugin")
	if st := h.pl.PreBind(h.tCtx, cs, seen, "plugin"); st.IsSuccess() || !strings.Contains(st.Message(), "q-extended-resources-old") {
		t.Errorf("PreBind on the device-plugin node: %v, want a failure naming the claim in the pod's status", st)
	}
}

// TestExtendedCountTooLarge: a request that no claim can ask for (beyond
// an int64) is refused with a message naming the container.
func TestExtendedCountTooLarge(t *testing.T) {
	h := newHarness(t, []*v1.Node{testNode("node-a")}, extClass(), testSlice("node-a", 4))
	pod := extPod("p", 1)
	pod.Spec.Containers[0].Resources.Requests["example.com/gpu"] = resource.MustParse("10E")
	_, st := h.pl.PreFilter(h.tCtx, framework.NewCycleState(), pod, nil)
	if code(st) != fwk.UnschedulableAndUnresolvable || !strings.Contains(st.Message(), "container main requests 10E") {
		t.Errorf("PreFilter: %v, want the pod refused naming its container and request", st)
	}
}

// TestExtendedLeftoverClaimDeleted: an extended resource claim of an
// earlier attempt that the pod's status does not name (the status write
// and Unreserve's delete both failed) is deleted when the pod is tried
// again, and the pod gets a new claim; another pod's claim stays.
func TestExtendedLeftoverClaimDeleted(t *testing.T) {
	pod := extPod("p", 2)
	extendedOf := func(name string, owner *v1.Pod) *resourceapi.ResourceClaim {
		c := allocatedOn(testClaim(name, 2), "node-a", "gpu-0", "gpu-1")
		c.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Pod", Name: owner.Name, UID: owner.UID, Controller: ptr.To(true)}}
		c.Annotations = map[string]string{resourceapi.ExtendedResourceClaimAnnotation: "true"}
		c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: owner.Name, UID: owner.UID}}
		return c
	}
	other := extPod("other", 1)
	other.UID = "uid-other"
	leftover, kept := extendedOf("p-extended-resources-old", pod), extendedOf("other-extended-resources-x", other)
	kept.Status.Allocation.Devices.Results = kept.Status.Allocation.Devices.Results[:1]
	kept.Status.Allocation.Devices.Results[0].Device = "gpu-3"
	h := newHarness(t, []*v1.Node{testNode("node-a")}, extClass(), testSlice("node-a", 4), leftover, kept)
	h.cycle(pod, "node-a")
	claims, err := h.client.ResourceV1().ResourceClaims(testNS).List(h.tCtx, metav1.ListOptions{})
	h.tCtx.ExpectNoError(err)
	var names []string
	for _, c := range claims.Items {
		names = append(names, c.Name)
	}
	if slices.Contains(names, leftover.Name) || !slices.Contains(names, kept.Name) {
		t.Errorf("claims after the attempt: %v, want %s deleted and %s kept", names, leftover.Name, kept.Name)
	}
}

// TestExtendedLeftoverNotDeletedStopsAttempt: where the extended resource
// claim of an earlier attempt, still reserved for the pod, cannot be
// deleted, the attempt stops with an error naming it (the pod would
// otherwise be bound with a new claim while the leftover keeps two more
// GPUs for as long as it runs); once the delete works, the pod is
// scheduled with one claim.
func TestExtendedLeftoverNotDeletedStopsAttempt(t *testing.T) {
	pod := extPod("p", 2)
	leftover := allocatedOn(testClaim("p-extended-resources-old", 2), "node-a", "gpu-0", "gpu-1")
	leftover.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Pod", Name: pod.Name, UID: pod.UID, Controller: ptr.To(true)}}
	leftover.Annotations = map[string]string{resourceapi.ExtendedResourceClaimAnnotation: "true"}
	leftover.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: pod.Name, UID: pod.UID}}
	var refuse atomic.Bool
	refuse.Store(true)
	h := newHarnessWith(t, func(h *harness) {
		h.client.PrependReactor("delete", "resourceclaims", func(cgotesting.Action) (bool, runtime.Object, error) {
			if refuse.Load() {
				return true, nil, apierrors.NewServiceUnavailable("etcd leader changed")
			}
			return false, nil, nil
		})
	}, []*v1.Node{testNode("node-a")}, extClass(), testSlice("node-a", 4), leftover)
	h.waitForClaim(leftover.Name, func(*resourceapi.ResourceClaim) bool { return true })
	created, err := h.client.CoreV1().Pods(testNS).Create(h.tCtx, pod, metav1.CreateOptions{})
	h.tCtx.ExpectNoError(err)
	pod = created

	_, st := h.pl.PreFilter(h.tCtx, framework.NewCycleState(), pod, nil)
	if code(st) != fwk.Error || !strings.Contains(st.Message(), leftover.Name) {
		t.Fatalf("PreFilter while the leftover cannot be deleted: %v, want an error naming %s", st, leftover.Name)
	}

	refuse.Store(false)
	h.waitForClaim(leftover.Name, func(*resourceapi.ResourceClaim) bool { return true })
	cs := h.reserve(pod, "node-a")
	if st := h.pl.PreBind(h.tCtx, cs, pod, "node-a"); !st.IsSuccess() {
		t.Fatalf("PreBind once the leftover could be deleted: %v", st)
	}
	claims, err := h.client.ResourceV1().ResourceClaims(testNS).List(h.tCtx, metav1.ListOptions{})
	h.tCtx.ExpectNoError(err)
	held := 0
	for _, c := range claims.Items {
		if c.Name == leftover.Name {
			t.Errorf("the leftover %s is still there", c.Name)
		}
		if c.Status.Allocation != nil {
			held += len(c.Status.Allocation.Devices.Results)
		}
	}
	if held != 2 {
		t.Errorf("the pod's claims hold %d GPUs, want its 2", held)
	}
}

// TestResizeDeferredPodLeftAlone: with InPlacePodVerticalScalingSchedulerPreemption
// the scheduler queues a bound pod whose resize is deferred, to find room
// by preemption. Its claims are in use: PreFilter skips it, so its
// extended resource claim is not taken for a leftover and deleted, and
// PostFilter, finding no state, deallocates nothing. Without the feature
// no such pod is queued, and a pod that carries the condition is handled
// as any other.
func TestResizeDeferredPodLeftAlone(t *testing.T) {
	for _, gate := range []bool{true, false} {
		t.Run(fmt.Sprintf("feature %v", gate), func(t *testing.T) {
			featuregatetesting.SetFeatureGatesDuringTest(t, utilfeature.DefaultFeatureGate, featuregatetesting.FeatureOverrides{
				features.InPlacePodVerticalScaling:                    true,
				features.InPlacePodVerticalScalingSchedulerPreemption: gate,
			})
			pod := extPod("p", 2)
			pod.Spec.NodeName = "node-a"
			pod.Status.Conditions = []v1.PodCondition{{Type: v1.PodResizePending, Status: v1.ConditionTrue, Reason: v1.PodReasonDeferred}}
			inUse := allocatedOn(testClaim("p-extended-resources-old", 2), "node-a", "gpu-0", "gpu-1")
			inUse.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Pod", Name: pod.Name, UID: pod.UID, Controller: ptr.To(true)}}
			inUse.Annotations = map[string]string{resourceapi.ExtendedResourceClaimAnnotation: "true"}
			inUse.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: pod.Name, UID: pod.UID}}
			h := newHarness(t, []*v1.Node{testNode("node-a")}, extClass(), testSlice("node-a", 4), inUse)
			h.waitForClaim(inUse.Name, func(*resourceapi.ResourceClaim) bool { return true })
			cs := framework.NewCycleState()
			_, st := h.pl.PreFilter(h.tCtx, cs, pod, []fwk.NodeInfo{h.nodes["node-a"]})
			if gate {
				if st.Code() != fwk.Skip {
					t.Fatalf("PreFilter: %v, want Skip", st)
				}
				if _, st := h.pl.PostFilter(h.tCtx, cs, pod, nil); st.Code() != fwk.Unschedulable {
					t.Errorf("PostFilter: %v, want Unschedulable", st)
				}
			} else if !st.IsSuccess() {
				t.Fatalf("PreFilter: %v, want success", st)
			}
			_, err := h.client.ResourceV1().ResourceClaims(testNS).Get(h.tCtx, inUse.Name, metav1.GetOptions{})
			switch {
			case gate && err != nil:
				t.Errorf("claim in use by the pod: %v, want it kept", err)
			case !gate && !apierrors.IsNotFound(err):
				t.Errorf("claim of the pod's earlier attempt without the feature: %v, want it deleted as a leftover", err)
			}
		})
	}
}
