package agent_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilrand "k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/apimachinery/pkg/util/wait"
	cgotesting "k8s.io/client-go/testing"
	"k8s.io/component-base/metrics"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
)

// refuseSliceWrites makes the fake API server answer every create, update
// and delete of a ResourceSlice with the error that refusal holds, while
// it holds one.
func refuseSliceWrites(e *env) *atomic.Pointer[error] {
	var refusal atomic.Pointer[error]
	e.client.PrependReactor("*", "resourceslices", func(action cgotesting.Action) (bool, runtime.Object, error) {
		switch action.GetVerb() {
		case "create", "update", "delete":
			if err := refusal.Load(); err != nil {
				return true, nil, *err
			}
		}
		return false, nil, nil
	})
	return &refusal
}

// healthTainted says whether the API's slices have a device named device
// with the health taint.
func healthTainted(ctx context.Context, t *testing.T, e *env, device string) bool {
	t.Helper()
	list, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range list.Items {
		for _, d := range s.Spec.Devices {
			if d.Name == device && hasTaint(d.Taints, agent.HealthTaintKey) {
				return true
			}
		}
	}
	return false
}

// TestPublishRefused: the API server refuses the agent's slice writes
// (its RBAC, an admission policy, an outage) when a GPU reports a
// critical XID. The agent's metrics say that the GPU is unhealthy and
// that the API does not have what the agent publishes, and count the
// errors by reason; a refusal that retrying does not fix gets one
// TopodraPublishFailed Warning on the Node naming the cause and what to
// check, however often the write is retried. Once the API server accepts
// the writes the taint is published, the metrics say so, and the Node
// gets a TopodraPublished event where it got the Warning.
func TestPublishRefused(t *testing.T) {
	gr := schema.GroupResource{Group: "resource.k8s.io", Resource: "resourceslices"}
	policy := &apierrors.StatusError{ErrStatus: metav1.Status{
		Status:  metav1.StatusFailure,
		Code:    http.StatusUnprocessableEntity,
		Reason:  metav1.StatusReasonInvalid,
		Message: `resourceslices.resource.k8s.io "node-1-gpu.topodra.io-x" is forbidden: ValidatingAdmissionPolicy 'topodra-node-agent-own-slices' with binding 'topodra-node-agent-own-slices' denied request: the topodra-node-agent identity has no node`,
	}}
	testcases := map[string]struct {
		err    error
		reason string
		// check is what the Warning says to check; empty: no Warning.
		check string
	}{
		"RBAC": {
			err:    apierrors.NewForbidden(gr, "node-1-gpu.topodra.io-x", errors.New(`User "system:serviceaccount:kube-system:topodra-node-agent" cannot update resource "resourceslices"`)),
			reason: agent.PublishErrorForbidden,
			check:  "ClusterRole topodra-node-agent",
		},
		"admission policy": {
			err:    policy,
			reason: agent.PublishErrorInvalid,
			check:  "ServiceAccountTokenPodNodeInfo",
		},
		"API server unavailable": {
			err:    apierrors.NewServiceUnavailable("etcd cluster is unavailable"),
			reason: agent.PublishErrorUnavailable,
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			e := newEnv(t)
			refusal := refuseSliceWrites(e)
			recorder := &noteRecorder{}
			e.recorder = recorder
			a := e.start(ctx, t)
			registry := metrics.NewKubeRegistry()
			registry.CustomMustRegister(a.MetricsCollector())
			waitForHealthReport(ctx, t, a, "GPUs watched", func(h map[string]kubeletplugin.DeviceHealth) bool {
				return h["gpu-5"].Health == kubeletplugin.HealthStatusHealthy
			})
			expectMetrics(ctx, t, registry, map[string]float64{
				agent.MetricSlicesSynced:                                   1,
				agent.MetricPublishErrors + `{reason="` + tc.reason + `"}`: 0,
			})

			refusal.Store(&tc.err)
			injectXIDOnceWatched(ctx, t, e, 5, 79)
			errorsOf := agent.MetricPublishErrors + `{reason="` + tc.reason + `"}`
			// Several retries, each refused.
			if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
				return agentMetrics(t, registry)[errorsOf] >= 4, nil
			}); err != nil {
				t.Fatalf("%s = %v, want at least 4 refused writes: %v", errorsOf, agentMetrics(t, registry)[errorsOf], err)
			}
			expectMetrics(ctx, t, registry, map[string]float64{
				agent.MetricGPUs + `{state="unhealthy"}`: 1,
				agent.MetricSlicesSynced:                 0,
			})
			if healthTainted(ctx, t, e, "gpu-5") {
				t.Fatal("the API has the health taint of gpu-5 although every write is refused")
			}
			failed := recorder.notes("Warning " + agent.ReasonPublishFailed)
			switch {
			case tc.check == "" && len(failed) > 0:
				t.Errorf("%s Warnings %q for an error that retrying fixes", agent.ReasonPublishFailed, failed)
			case tc.check != "" && len(failed) != 1:
				t.Errorf("%d %s Warnings %q after %v refused writes, want one", len(failed), agent.ReasonPublishFailed, failed, agentMetrics(t, registry)[errorsOf])
			case tc.check != "" && (!strings.Contains(failed[0], tc.check) || !strings.Contains(failed[0], agent.HealthTaintKey) || !strings.Contains(failed[0], apiMessage(tc.err))):
				t.Errorf("%s Warning %q does not say what to check (%q), the health taint and the API server's message %q", agent.ReasonPublishFailed, failed[0], tc.check, apiMessage(tc.err))
			}

			refusal.Store(nil)
			expectMetrics(ctx, t, registry, map[string]float64{
				agent.MetricGPUs + `{state="unhealthy"}`: 1,
				agent.MetricSlicesSynced:                 1,
			})
			if !healthTainted(ctx, t, e, "gpu-5") {
				t.Error("the API lacks the health taint of gpu-5 once writes are accepted")
			}
			want := 0
			if tc.check != "" {
				want = 1
			}
			if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
				return len(recorder.notes("Normal "+agent.ReasonPublished)) == want, nil
			}); err != nil {
				t.Errorf("%d %s events, want %d", len(recorder.notes("Normal "+agent.ReasonPublished)), agent.ReasonPublished, want)
			}
		})
	}
}

// TestPublishRefusedAgainAfterSuccess: a refusal reported on the Node is
// reported again once the slices were published in between, and a
// refusal for another cause is reported at once.
func TestPublishRefusedAgainAfterSuccess(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	refusal := refuseSliceWrites(e)
	recorder := &noteRecorder{}
	e.recorder = recorder
	a := e.start(ctx, t)
	registry := metrics.NewKubeRegistry()
	registry.CustomMustRegister(a.MetricsCollector())
	waitForHealthReport(ctx, t, a, "GPUs watched", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h["gpu-1"].Health == kubeletplugin.HealthStatusHealthy
	})
	gr := schema.GroupResource{Group: "resource.k8s.io", Resource: "resourceslices"}
	rbac := apierrors.NewForbidden(gr, "x", errors.New("no update"))
	other := apierrors.NewForbidden(gr, "x", errors.New("no update either"))
	warnings := func(what string, want int) {
		t.Helper()
		if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			return len(recorder.notes("Warning "+agent.ReasonPublishFailed)) == want, nil
		}); err != nil {
			t.Fatalf("%s: %s Warnings %q, want %d", what, agent.ReasonPublishFailed, recorder.notes("Warning "+agent.ReasonPublishFailed), want)
		}
	}
	steps := []struct {
		what    string
		refusal error
		xid     int
		want    int
	}{
		{what: "refused", refusal: rbac, xid: 1, want: 1},
		{what: "refused for another cause", refusal: other, xid: 2, want: 2},
		{what: "accepted", xid: 3, want: 2},
		{what: "refused again", refusal: rbac, xid: 4, want: 3},
	}
	for _, step := range steps {
		if step.refusal != nil {
			refusal.Store(&step.refusal)
		} else {
			refusal.Store(nil)
		}
		injectXIDOnceWatched(ctx, t, e, step.xid, 79)
		warnings(step.what, step.want)
		if step.refusal == nil {
			expectMetrics(ctx, t, registry, map[string]float64{agent.MetricSlicesSynced: 1})
		}
	}
}

// refuseSliceCreates makes the fake API server answer every create of a
// ResourceSlice with the error that refusal returns for the slice's name,
// while it holds a function. Like the API server it generates the name of
// a slice created with generateName before it refuses the create, so the
// name differs on each create. It returns the number of creates refused.
func refuseSliceCreates(e *env) (*atomic.Pointer[func(name string) error], *atomic.Int64) {
	var refusal atomic.Pointer[func(name string) error]
	var refused atomic.Int64
	e.client.PrependReactor("create", "resourceslices", func(action cgotesting.Action) (bool, runtime.Object, error) {
		refuse := refusal.Load()
		if refuse == nil {
			return false, nil, nil
		}
		slice := action.(cgotesting.CreateAction).GetObject().(*resourceapi.ResourceSlice)
		name := slice.Name
		if name == "" {
			name = slice.GenerateName + utilrand.String(5)
		}
		refused.Add(1)
		return true, nil, (*refuse)(name)
	})
	return &refusal, &refused
}

// TestPublishRefusedGeneratedNames: the API server refuses the agent's
// slice creates (an admission policy, validation), and its message names
// the slice by the name that it generated for that create. However many
// creates it refuses, the Node gets one TopodraPublishFailed Warning per
// cause, with the API server's message and what to check; another cause
// gets another, and once the slices were published a refusal is reported
// again.
func TestPublishRefusedGeneratedNames(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	gr := schema.GroupResource{Group: "resource.k8s.io", Resource: "resourceslices"}
	// policy is the refusal of a ValidatingAdmissionPolicy, as the API
	// server's admission builds it.
	policy := func(name string) error {
		message := "ValidatingAdmissionPolicy 'topodra-node-agent-own-slices' with binding 'topodra-node-agent-own-slices' denied request: the topodra-node-agent identity has no node"
		err := apierrors.NewForbidden(gr, name, errors.New(message))
		err.ErrStatus.Reason = metav1.StatusReasonInvalid
		err.ErrStatus.Code = http.StatusUnprocessableEntity
		err.ErrStatus.Details.Causes = append(err.ErrStatus.Details.Causes, metav1.StatusCause{Message: message})
		return err
	}
	// invalid is the API server's validation error, which names the
	// slice twice.
	invalid := func(name string) error {
		return apierrors.NewInvalid(schema.GroupKind{Group: "resource.k8s.io", Kind: "ResourceSlice"}, name, field.ErrorList{
			field.Invalid(field.NewPath("metadata", "name"), name, "must be no more than 63 characters"),
		})
	}
	e := newEnv(t)
	refusal, refused := refuseSliceCreates(e)
	refusal.Store(&policy)
	recorder := &noteRecorder{}
	e.recorder = recorder
	a := e.start(ctx, t)
	registry := metrics.NewKubeRegistry()
	registry.CustomMustRegister(a.MetricsCollector())

	// expectWarnings waits for more than creates refused creates (the
	// controller's one worker handles a refusal before it creates again),
	// then expects want Warnings, the last one with the API server's
	// message (of which it has message) and check.
	expectWarnings := func(what string, creates int64, want int, message, check string) {
		t.Helper()
		if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			return refused.Load() > creates, nil
		}); err != nil {
			t.Fatalf("%s: %d creates refused, want more than %d", what, refused.Load(), creates)
		}
		failed := recorder.notes("Warning " + agent.ReasonPublishFailed)
		if len(failed) != want {
			t.Fatalf("%s: %d %s Warnings after %d refused creates, want %d: %q", what, len(failed), agent.ReasonPublishFailed, refused.Load(), want, failed)
		}
		if last := failed[want-1]; !strings.Contains(last, check) || !strings.Contains(last, message) {
			t.Errorf("%s: %s Warning %q does not say what to check (%q) and the API server's message (%q)", what, agent.ReasonPublishFailed, last, check, message)
		}
	}
	expectWarnings("refused by the admission policy", 6, 1, "identity has no node", "ServiceAccountTokenPodNodeInfo")
	refusal.Store(&invalid)
	expectWarnings("refused as invalid", refused.Load()+3, 2, "must be no more than 63 characters", "--owned-taint-key")

	refusal.Store(nil)
	expectMetrics(ctx, t, registry, map[string]float64{agent.MetricSlicesSynced: 1})
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return len(recorder.notes("Normal "+agent.ReasonPublished)) == 1, nil
	}); err != nil {
		t.Fatalf("%d %s events once the slices are published, want 1", len(recorder.notes("Normal "+agent.ReasonPublished)), agent.ReasonPublished)
	}

	// The slices are gone, and the policy refuses them again.
	refusal.Store(&policy)
	list, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, slice := range list.Items {
		if err := e.client.ResourceV1().ResourceSlices().Delete(ctx, slice.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	injectXIDOnceWatched(ctx, t, e, 2, 79)
	expectWarnings("refused by the admission policy again", refused.Load()+2, 3, "identity has no node", "ServiceAccountTokenPodNodeInfo")
}

// apiMessage is the message of the API server's answer err.
func apiMessage(err error) string {
	var status apierrors.APIStatus
	if errors.As(err, &status) {
		return status.Status().Message
	}
	return err.Error()
}

// noteRecorder is an events.EventRecorder that keeps every event as
// "<type> <reason> <note>", for tests that look for some among many.
type noteRecorder struct {
	mutex  sync.Mutex
	events []string
}

func (r *noteRecorder) Eventf(_, _ runtime.Object, eventtype, reason, _, note string, args ...any) {
	r.mutex.Lock()
	defer r.mutex.Unlock()
	r.events = append(r.events, eventtype+" "+reason+" "+fmt.Sprintf(note, args...))
}

// notes returns the events of a type and reason ("Warning Reason").
func (r *noteRecorder) notes(typeAndReason string) []string {
	r.mutex.Lock()
	defer r.mutex.Unlock()
	var out []string
	for _, ev := range r.events {
		if strings.HasPrefix(ev, typeAndReason+" ") {
			out = append(out, ev)
		}
	}
	return out
}

// TestMetricsWhileSlicesUnreadable: while the agent's first publish waits
// for the API server to list its slices (an outage at start), a scrape of
// its metrics answers, saying that the slices are not published.
func TestMetricsWhileSlicesUnreadable(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	e.client.PrependReactor("list", "resourceslices", func(cgotesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewServiceUnavailable("etcd cluster is unavailable")
	})
	a, err := agent.Start(ctx, e.options(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Stop)
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		err := a.Ready()
		return err != nil && strings.Contains(err.Error(), "publishing"), nil
	}); err != nil {
		t.Fatalf("the agent does not wait to publish: Ready() = %v", a.Ready())
	}
	registry := metrics.NewKubeRegistry()
	registry.CustomMustRegister(a.MetricsCollector())
	scraped := make(chan map[string]float64, 1)
	go func() { scraped <- agentMetrics(t, registry) }()
	select {
	case got := <-scraped:
		if v, ok := got[agent.MetricSlicesSynced]; !ok || v != 0 {
			t.Errorf("%s = %v (reported: %v), want 0", agent.MetricSlicesSynced, v, ok)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a scrape of the metrics waits for the API server")
	}
}
