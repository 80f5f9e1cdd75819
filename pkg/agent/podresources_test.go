package agent_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/topodra/topodra/pkg/agent"
)

// fakeKubelet serves the List call of the kubelet's PodResources API on a
// unix socket, as a kubelet answers it for its active pods: each pod it
// runs has one container that uses the claims (of the pod's namespace)
// given to run.
type fakeKubelet struct {
	podresourcesv1.UnimplementedPodResourcesListerServer
	socket string

	mutex sync.Mutex
	pods  map[types.NamespacedName][]string
	err   error
	lists int
	// noClaims leaves out the claims of containers, as a kubelet whose
	// feature gate KubeletPodResourcesDynamicResources is off.
	noClaims bool
}

func startFakeKubelet(t *testing.T) *fakeKubelet {
	t.Helper()
	// A short directory: unix socket paths are limited to about 108 bytes.
	dir, err := os.MkdirTemp("", "kpr")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	k := &fakeKubelet{socket: filepath.Join(dir, "kubelet.sock"), pods: map[types.NamespacedName][]string{}}
	l, err := net.Listen("unix", k.socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	podresourcesv1.RegisterPodResourcesListerServer(srv, k)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	return k
}

func (k *fakeKubelet) List(context.Context, *podresourcesv1.ListPodResourcesRequest) (*podresourcesv1.ListPodResourcesResponse, error) {
	k.mutex.Lock()
	defer k.mutex.Unlock()
	k.lists++
	if k.err != nil {
		return nil, k.err
	}
	resp := &podresourcesv1.ListPodResourcesResponse{}
	for pod, claims := range k.pods {
		container := &podresourcesv1.ContainerResources{Name: "main"}
		for _, c := range claims {
			if k.noClaims {
				break
			}
			container.DynamicResources = append(container.DynamicResources, &podresourcesv1.DynamicResource{ClaimName: c, ClaimNamespace: pod.Namespace})
		}
		resp.PodResources = append(resp.PodResources, &podresourcesv1.PodResources{
			Name: pod.Name, Namespace: pod.Namespace, Containers: []*podresourcesv1.ContainerResources{container},
		})
	}
	return resp, nil
}

// run lists the pod, whose container uses claims.
func (k *fakeKubelet) run(namespace, pod string, claims ...string) {
	k.mutex.Lock()
	defer k.mutex.Unlock()
	k.pods[types.NamespacedName{Namespace: namespace, Name: pod}] = claims
}

// stop no longer lists the pod.
func (k *fakeKubelet) stop(namespace, pod string) {
	k.mutex.Lock()
	defer k.mutex.Unlock()
	delete(k.pods, types.NamespacedName{Namespace: namespace, Name: pod})
}

// fail has List fail with err; nil: answer again.
func (k *fakeKubelet) fail(err error) {
	k.mutex.Lock()
	defer k.mutex.Unlock()
	k.err = err
}

// restart stands for a kubelet that has just started: it lists no pods
// until run is called for them again.
func (k *fakeKubelet) restart() {
	k.mutex.Lock()
	defer k.mutex.Unlock()
	clear(k.pods)
	k.err = nil
}

// reportClaims sets whether List reports the claims of containers.
func (k *fakeKubelet) reportClaims(report bool) {
	k.mutex.Lock()
	defer k.mutex.Unlock()
	k.noClaims = !report
}

func (k *fakeKubelet) listCalls() int {
	k.mutex.Lock()
	defer k.mutex.Unlock()
	return k.lists
}

// TestStaleClaimKeptWhileKubeletReportsItUsed: a prepared claim that the
// API server no longer has is dropped after its grace period only once the
// kubelet's PodResources API has reported, in two checks in a row, no
// container on the node using it. A container using a claim of the same
// name in another namespace does not keep it; a kubelet that cannot be
// reached, or that has just started and lists no pods yet, keeps it.
func TestStaleClaimKeptWhileKubeletReportsItUsed(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	e.staleClaimGrace = time.Nanosecond
	a := e.start(ctx, t)
	held := claim("held", gpus("gpus", "gpu-1")...)
	if err := prepareOne(ctx, t, a, held); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	e.kubelet.run("default", "trainer", "other", "held")
	e.kubelet.run("team-b", "lookalike", "held")
	check := func(what string, want ...types.UID) {
		t.Helper()
		checkRemoved(ctx, t, a, what, want...)
	}
	for range 3 {
		check("a container uses it")
	}
	if n := e.kubelet.listCalls(); n != 3 {
		t.Errorf("the kubelet was asked %d times in three checks, want 3", n)
	}

	// The kubelet restarts: unreachable, then it lists no pods until it
	// has read them, then the trainer again.
	e.kubelet.fail(status.Error(codes.Unavailable, "connection refused"))
	check("kubelet unreachable")
	e.kubelet.restart()
	check("kubelet just started, lists no pods")
	e.kubelet.run("default", "trainer", "held")
	e.kubelet.run("team-b", "lookalike", "held")
	check("the started kubelet lists its pods")

	// The trainer is gone; the pod in team-b does not keep the claim.
	e.kubelet.stop("default", "trainer")
	check("first check that finds it unused")
	check("second check that finds it unused", held.UID)
	if err := prepareOne(ctx, t, a, claim("next", gpus("gpus", "gpu-1")...)); err != nil {
		t.Errorf("gpu-1 after its claim was dropped: %v", err)
	}
}

// TestStaleClaimKeptWithoutKubelet: where the kubelet's PodResources API
// is not there (no socket), a prepared claim that the API server no longer
// has is never dropped, and the checks go on without an error.
func TestStaleClaimKeptWithoutKubelet(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	e.staleClaimGrace = time.Nanosecond
	opts := e.options(t)
	opts.PodResourcesSocket = filepath.Join(t.TempDir(), "kubelet.sock")
	a := startWith(ctx, t, opts)
	held := claim("held", gpus("gpus", "gpu-1")...)
	if err := prepareOne(ctx, t, a, held); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	for range 3 {
		if removed, err := a.CleanupStaleClaims(ctx); err != nil || len(removed) != 0 {
			t.Fatalf("no kubelet: removed %v (%v), want none", removed, err)
		}
	}
}

// TestStaleClaimNeedsKubeletToListAgentPod: where the agent knows its own
// pod, an answer of the kubelet that does not list it (a kubelet that has
// not read the node's pods yet, however long that takes) never counts
// towards dropping a claim.
func TestStaleClaimNeedsKubeletToListAgentPod(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	e.staleClaimGrace = time.Nanosecond
	opts := e.options(t)
	opts.Pod = types.NamespacedName{Namespace: "kube-system", Name: "topodra-node-agent-x7k2p"}
	a := startWith(ctx, t, opts)
	held := claim("held", gpus("gpus", "gpu-1")...)
	if err := prepareOne(ctx, t, a, held); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	check := func(what string, want ...types.UID) {
		t.Helper()
		checkRemoved(ctx, t, a, what, want...)
	}
	for range 4 {
		check("the kubelet lists no pods")
	}
	e.kubelet.run("kube-system", "topodra-node-agent-other")
	check("the kubelet lists another agent's pod only")
	e.kubelet.run("kube-system", "topodra-node-agent-x7k2p")
	check("the kubelet lists the agent's pod, once")
	check("twice", held.UID)
}

// TestPodResourcesUnavailableEvent: a claim past its grace period that is
// kept because the kubelet cannot be asked gets a Warning on the Node
// naming the socket, once until a check reaches the kubelet again. The
// log (at the agent's --v=2) says that the kubelet cannot be asked when
// that starts, when a claim is kept past its grace period because of it,
// and again after the kubelet answered, not at every check.
func TestPodResourcesUnavailableEvent(t *testing.T) {
	logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.Verbosity(2), ktesting.BufferLogs(true)))
	ctx, cancel := context.WithCancel(klog.NewContext(context.Background(), logger))
	t.Cleanup(cancel)
	logged := func() int {
		return strings.Count(logger.GetSink().(ktesting.Underlier).GetBuffer().String(), "Cannot learn from the kubelet")
	}
	e, recorder, a := startStale(ctx, t)
	held := claim("held", gpus("gpus", "gpu-1")...)
	if err := prepareOne(ctx, t, a, held); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	e.kubelet.run("default", "trainer", "held")
	e.kubelet.fail(status.Error(codes.Unavailable, "connection refused"))
	unavailable := func(what string, want, wantLogged int) {
		t.Helper()
		if removed, err := a.CleanupStaleClaims(ctx); err != nil || len(removed) != 0 {
			t.Fatalf("%s: removed %v (%v), want none", what, removed, err)
		}
		evs := drainEvents(recorder)
		got := countPrefix(evs, "Warning "+agent.ReasonPodResourcesUnavailable)
		if got != want {
			t.Errorf("%s: events %q, want %d %s", what, evs, want, agent.ReasonPodResourcesUnavailable)
		}
		for _, ev := range evs {
			if strings.HasPrefix(ev, "Warning "+agent.ReasonPodResourcesUnavailable) && !strings.Contains(ev, e.kubelet.socket) {
				t.Errorf("%s: event %q does not name the socket %s", what, ev, e.kubelet.socket)
			}
		}
		if got := logged(); got != wantLogged {
			t.Errorf("%s: the log said %d times in all that the kubelet cannot be asked, want %d", what, got, wantLogged)
		}
	}
	unavailable("within the grace period", 0, 1)
	unavailable("past the grace period", 1, 2)
	unavailable("again", 0, 2)
	unavailable("and again", 0, 2)
	e.kubelet.fail(nil)
	unavailable("the kubelet answers", 0, 2)
	e.kubelet.fail(status.Error(codes.Unavailable, "connection refused"))
	unavailable("unavailable once more", 1, 3)
}

// TestStaleClaimKeptWhileKubeletReportsNoClaims: a kubelet that does not
// report the claims of containers (its feature gate
// KubeletPodResourcesDynamicResources off) lists the containers of a claim
// that the API server no longer has without it. While the agent holds a
// prepared claim that the API server still has and the kubelet lists no
// container using any such claim, its answers do not count: the gone
// claim is kept, with a TopodraPodResourcesUnavailable Warning naming the
// feature gate. Once the kubelet reports the live claim's container, the
// gone claim is dropped at the second check.
func TestStaleClaimKeptWhileKubeletReportsNoClaims(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e, recorder, a := startStale(ctx, t)
	live := claim("live", gpus("gpus", "gpu-1")...)
	gone := claim("gone", gpus("gpus", "gpu-2")...)
	if _, err := e.client.ResourceV1().ResourceClaims(live.Namespace).Create(ctx, live, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []*resourceapi.ResourceClaim{live, gone} {
		if err := prepareOne(ctx, t, a, c); err != nil {
			t.Fatalf("prepare %s: %v", c.Name, err)
		}
	}
	e.kubelet.reportClaims(false)
	e.kubelet.run("default", "server", "live")
	e.kubelet.run("default", "trainer", "gone")
	for i := range 4 {
		checkRemoved(ctx, t, a, fmt.Sprintf("check %d of a kubelet that reports no claims", i+1))
	}
	evs := drainEvents(recorder)
	if n := countPrefix(evs, "Warning "+agent.ReasonPodResourcesUnavailable); n != 1 {
		t.Errorf("events %q, want one %s", evs, agent.ReasonPodResourcesUnavailable)
	}
	for _, ev := range evs {
		if strings.HasPrefix(ev, "Warning "+agent.ReasonPodResourcesUnavailable) && !strings.Contains(ev, "KubeletPodResourcesDynamicResources") {
			t.Errorf("event %q does not name the feature gate", ev)
		}
	}

	e.kubelet.reportClaims(true)
	e.kubelet.stop("default", "trainer")
	checkRemoved(ctx, t, a, "first check that finds it unused")
	checkRemoved(ctx, t, a, "second check that finds it unused", gone.UID)
}

// checkRemoved runs a stale-claim check and fails the test unless it
// drops exactly want.
func checkRemoved(ctx context.Context, t *testing.T, a *agent.Agent, what string, want ...types.UID) {
	t.Helper()
	removed, err := a.CleanupStaleClaims(ctx)
	if err != nil || !slices.Equal(removed, want) {
		t.Fatalf("%s: removed %v (%v), want %v", what, removed, err, want)
	}
}

// startStale starts an agent of a new env that drops a gone claim as soon
// as the kubelet reports it unused (grace 1 ns), recording its events.
func startStale(ctx context.Context, t *testing.T) (*env, *events.FakeRecorder, *agent.Agent) {
	e := newEnv(t)
	recorder := events.NewFakeRecorder(20)
	e.recorder = recorder
	e.staleClaimGrace = time.Nanosecond
	return e, recorder, e.start(ctx, t)
}
