package agent

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2/ktesting"
)

// TestSyncState: the publisher's slices count as synced only after a sync
// that began once the latest resources were handed over, wrote them
// without error and had no field dropped; a failed sync of a pool that is
// no longer wanted (its slices are still there) counts too.
func TestSyncState(t *testing.T) {
	resources := func(pools ...string) *resourceslice.DriverResources {
		r := &resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{}}
		for _, p := range pools {
			r.Pools[p] = resourceslice.Pool{}
		}
		return r
	}
	// Steps: "update <pools>", "begin", "fail", "drop", "end <pool>"; what
	// synced says after each step follows it after "=".
	testcases := map[string][]string{
		"first sync":                    {"begin=false", "end node-1=true"},
		"failed sync":                   {"begin=false", "fail=false", "end node-1=false", "begin=false", "end node-1=true"},
		"resources changed, not synced": {"begin=false", "end node-1=true", "update node-1=false", "begin=false", "end node-1=true"},
		"sync began before the update":  {"begin=false", "update node-1=false", "end node-1=false", "begin=false", "end node-1=true"},
		"fields dropped":                {"begin=false", "drop=false", "end node-1=false", "begin=false", "end node-1=false", "update node-1=false", "begin=false", "end node-1=true"},
		"fields dropped again":          {"begin=false", "drop=false", "end node-1=false", "update node-1=false", "begin=false", "drop=false", "end node-1=false"},
		"old pool's slices not deleted": {"begin=false", "end node-1=true", "begin=true", "fail=true", "end old=false", "begin=false", "end old=true"},
		"another pool wanted":           {"begin=false", "end node-1=true", "update node-1 nics=false", "begin=false", "end node-1=false", "begin=false", "end nics=true"},
	}
	for name, steps := range testcases {
		t.Run(name, func(t *testing.T) {
			s := newSyncState(resources("node-1"))
			for i, step := range steps {
				op, want, _ := strings.Cut(step, "=")
				fields := strings.Fields(op)
				var got bool
				switch fields[0] {
				case "update":
					s.update(resources(fields[1:]...))
					got = s.synced()
				case "begin":
					s.begin()
					got = s.synced()
				case "fail":
					s.report(errors.New("update resource slice: refused"))
					got = s.synced()
				case "drop":
					s.report(&resourceslice.DroppedFieldsError{PoolName: "node-1"})
					got = s.synced()
				case "end":
					got = s.end(fields[1])
					if s.synced() != got {
						t.Fatalf("step %d %q: end says %v, synced %v", i, op, got, s.synced())
					}
				}
				if (want == "true") != got {
					t.Fatalf("step %d %q: synced %v, want %s (steps %q)", i, op, got, want, steps)
				}
			}
		})
	}
}

// TestPublishRetryCapped: a sync that keeps failing (the API server is
// down for half an hour) is retried at least once a minute, so that a
// taint reaches the API within a minute of the API server coming back.
func TestPublishRetryCapped(t *testing.T) {
	limiter := publishRateLimiter()
	var delay time.Duration
	for range 40 {
		delay = limiter.When("node-1")
	}
	if delay > time.Minute || delay < 30*time.Second {
		t.Errorf("retry after 40 failures in %v, want between 30 s and a minute", delay)
	}
}

// TestRefusalCause: the cause of a refused slice write does not depend on
// the name of the slice, which the API server generates for each create;
// it does on the reason and on the rest of the API server's message.
func TestRefusalCause(t *testing.T) {
	gr := schema.GroupResource{Group: "resource.k8s.io", Resource: "resourceslices"}
	gk := schema.GroupKind{Group: "resource.k8s.io", Kind: "ResourceSlice"}
	policy := func(name, message string) error {
		err := apierrors.NewForbidden(gr, name, errors.New(message))
		err.ErrStatus.Reason = metav1.StatusReasonInvalid
		err.ErrStatus.Code = http.StatusUnprocessableEntity
		return err
	}
	invalid := func(name, message string) error {
		return apierrors.NewInvalid(gk, name, field.ErrorList{field.Invalid(field.NewPath("metadata", "name"), name, message)})
	}
	noDetails := func(message string) error {
		return &apierrors.StatusError{ErrStatus: metav1.Status{
			Status: metav1.StatusFailure, Code: http.StatusForbidden, Reason: metav1.StatusReasonForbidden,
			Message: fmt.Sprintf("admission webhook %q denied the request: %s", "slices.example.com", message),
		}}
	}
	testcases := map[string]struct {
		a, b error
		same bool
	}{
		"policy, generated names": {
			a:    policy("00000-gpu.topodra.io-node-1-abcde", "no node"),
			b:    policy("00000-gpu.topodra.io-node-1-fghij", "no node"),
			same: true,
		},
		"policy, another message": {
			a: policy("00000-gpu.topodra.io-node-1-abcde", "no node"),
			b: policy("00000-gpu.topodra.io-node-1-abcde", "another node"),
		},
		"invalid, generated names named twice": {
			a:    invalid("00000-gpu.topodra.io-node-1-abcde", "too long"),
			b:    invalid("00000-gpu.topodra.io-node-1-fghij", "too long"),
			same: true,
		},
		"invalid, another field error": {
			a: invalid("00000-gpu.topodra.io-node-1-abcde", "too long"),
			b: invalid("00000-gpu.topodra.io-node-1-abcde", "not a DNS subdomain"),
		},
		"no details": {
			a:    noDetails("denied"),
			b:    noDetails("denied"),
			same: true,
		},
		"no details, another message": {
			a: noDetails("denied"),
			b: noDetails("denied again"),
		},
		"not the API server's": {
			a: errors.New("create resource slice: connection refused"),
			b: errors.New("create resource slice: connection reset"),
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			a, b := refusalCause(PublishErrorInvalid, tc.a), refusalCause(PublishErrorInvalid, tc.b)
			if (a == b) != tc.same {
				t.Errorf("causes %q and %q, want the same: %v", a, b, tc.same)
			}
			if other := refusalCause(PublishErrorForbidden, tc.a); other == a {
				t.Errorf("cause %q for both reasons", a)
			}
		})
	}
}

// TestPublishRefusedCapped: refusals whose causes differ every time (a
// webhook's messages that name the generated slice, without the answer's
// details naming it) get at most maxPublishRefused Warnings, and the
// causes held stay as many, until the slices are published; then a
// refusal is reported again.
func TestPublishRefusedCapped(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	recorder := &countingRecorder{}
	a := &Agent{
		opts:           Options{DriverName: "gpu.topodra.io", Recorder: recorder},
		publishRefused: sets.New[string](),
		droppedFields:  map[string]bool{},
	}
	refuse := func(i int) {
		a.publishFailed(ctx, fmt.Errorf("create resource slice: %w", &apierrors.StatusError{ErrStatus: metav1.Status{
			Status: metav1.StatusFailure, Code: http.StatusForbidden, Reason: metav1.StatusReasonForbidden,
			Message: fmt.Sprintf(`admission webhook "slices.example.com" denied the request: slice "00000-gpu.topodra.io-node-1-%05d" is not allowed`, i),
		}}))
	}
	for i := range 10 * maxPublishRefused {
		refuse(i)
	}
	if got := recorder.count(v1.EventTypeWarning, ReasonPublishFailed); got != maxPublishRefused {
		t.Errorf("%d %s Warnings for %d refusals, each for another cause, want %d", got, ReasonPublishFailed, 10*maxPublishRefused, maxPublishRefused)
	}
	if got := a.publishRefused.Len(); got != maxPublishRefused {
		t.Errorf("%d causes held, want %d", got, maxPublishRefused)
	}
	a.publishSynced(ctx)
	if got := recorder.count(v1.EventTypeNormal, ReasonPublished); got != 1 {
		t.Errorf("%d %s events once published, want 1", got, ReasonPublished)
	}
	refuse(0)
	if got := recorder.count(v1.EventTypeWarning, ReasonPublishFailed); got != maxPublishRefused+1 {
		t.Errorf("%d %s Warnings after a refusal once published, want %d", got, ReasonPublishFailed, maxPublishRefused+1)
	}
}

// countingRecorder is an events.EventRecorder that counts the events by
// type and reason.
type countingRecorder struct {
	mutex  sync.Mutex
	events map[string]int
}

func (r *countingRecorder) Eventf(_, _ runtime.Object, eventtype, reason, _, _ string, _ ...any) {
	r.mutex.Lock()
	defer r.mutex.Unlock()
	if r.events == nil {
		r.events = map[string]int{}
	}
	r.events[eventtype+" "+reason]++
}

func (r *countingRecorder) count(eventtype, reason string) int {
	r.mutex.Lock()
	defer r.mutex.Unlock()
	return r.events[eventtype+" "+reason]
}
