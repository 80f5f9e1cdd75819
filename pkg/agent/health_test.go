package agent_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/checkpoint"
)

// waitForHealthReport returns, by device name, the first health report
// that the kubelet would get for which ok holds; what says what ok waits
// for.
func waitForHealthReport(ctx context.Context, t *testing.T, a *agent.Agent, what string, ok func(map[string]kubeletplugin.DeviceHealth) bool) map[string]kubeletplugin.DeviceHealth {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	reports := make(chan kubeletplugin.DeviceHealthReport)
	go func() { _ = a.WatchHealthStatus(ctx, reports) }()
	deadline := time.After(30 * time.Second)
	var last map[string]kubeletplugin.DeviceHealth
	for {
		select {
		case r := <-reports:
			last = map[string]kubeletplugin.DeviceHealth{}
			for _, d := range r.Devices {
				last[d.DeviceName] = d
			}
			if ok(last) {
				return last
			}
		case <-deadline:
			t.Fatalf("no health report with %s, last %+v", what, last)
		}
	}
}

// TestWatchHealthStatusUnwatched: a GPU whose health events cannot be
// registered is Unknown to the kubelet, with a message that says why, for
// as long as registering fails (watching is retried every rescan interval,
// without another Warning); the watched GPUs are Healthy until a fault
// makes one Unhealthy. The Node gets a Warning that names the unwatched
// GPU. Once registering succeeds, a retry watches every GPU: the GPU is
// Healthy, the Node gets a Normal event, and an XID taints it.
func TestWatchHealthStatusUnwatched(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(20)
	e.recorder = recorder
	e.rescanInterval = 20 * time.Millisecond
	e.machine.FailEventRegistration(2, nvml.ERROR_UNKNOWN)
	a := e.start(ctx, t)
	unwatched := a.Inventory().GPUs[2].Name
	const wantMessage = "health not watched: NVML RegisterEvents failed: ERROR_UNKNOWN"

	check := func(h map[string]kubeletplugin.DeviceHealth, unwatched, unhealthy string) {
		t.Helper()
		if len(h) != 8 {
			t.Errorf("health of %d devices, want 8: %+v", len(h), h)
		}
		for name, d := range h {
			want, msg := kubeletplugin.HealthStatusHealthy, ""
			switch name {
			case unwatched:
				want, msg = kubeletplugin.HealthStatusUnknown, wantMessage
			case unhealthy:
				want, msg = kubeletplugin.HealthStatusUnhealthy, d.Message
			}
			if d.Health != want || d.Message != msg {
				t.Errorf("%s: %s %q, want %s %q", name, d.Health, d.Message, want, msg)
			}
		}
	}

	// Every device is Unknown until the watcher says what it watches.
	h := waitForHealthReport(ctx, t, a, "gpu-0 watched", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h["gpu-0"].Health == kubeletplugin.HealthStatusHealthy
	})
	check(h, unwatched, "")
	// Retries that watch no more than the watcher change nothing.
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return e.machine.EventSets() >= 4, nil
	}); err != nil {
		t.Fatalf("health watching retried %d times: %v", e.machine.EventSets()-1, err)
	}
	h = waitForHealthReport(ctx, t, a, "a report", func(map[string]kubeletplugin.DeviceHealth) bool { return true })
	check(h, unwatched, "")

	if err := e.machine.InjectXID(3, 79); err != nil {
		t.Fatal(err)
	}
	faulty := a.Inventory().GPUs[3].Name
	h = waitForHealthReport(ctx, t, a, faulty+" Unhealthy", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h[faulty].Health == kubeletplugin.HealthStatusUnhealthy
	})
	check(h, unwatched, faulty)

	evs := drainEvents(recorder)
	var partly []string
	for _, ev := range evs {
		if strings.HasPrefix(ev, "Warning "+agent.ReasonHealthPartlyWatched) {
			partly = append(partly, ev)
		}
	}
	if len(partly) != 1 || !strings.Contains(partly[0], unwatched+" (NVML RegisterEvents failed: ERROR_UNKNOWN)") || !strings.Contains(partly[0], "1 of 8") {
		t.Errorf("%s events %q, want one naming %s and why", agent.ReasonHealthPartlyWatched, partly, unwatched)
	}

	e.machine.FailEventRegistration(2, nvml.SUCCESS)
	h = waitForHealthReport(ctx, t, a, unwatched+" watched", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h[unwatched].Health == kubeletplugin.HealthStatusHealthy
	})
	check(h, "", faulty)
	if got := expectEventWithPrefix(t, recorder, "Normal "+agent.ReasonHealthWatched); !strings.Contains(got, "all 8 GPUs") {
		t.Errorf("event %q, want it to name all 8 GPUs", got)
	}
	injectXIDOnceWatched(ctx, t, e, 2, 79)
	waitForHealthTaint(ctx, t, a, unwatched, "xid-79")
}

// expectEventWithPrefix returns the next event that starts with prefix,
// skipping others.
func expectEventWithPrefix(t *testing.T, r *events.FakeRecorder, prefix string) string {
	t.Helper()
	deadline := time.After(30 * time.Second)
	var skipped []string
	for {
		select {
		case ev := <-r.Events:
			if strings.HasPrefix(ev, prefix) {
				return ev
			}
			skipped = append(skipped, ev)
		case <-deadline:
			t.Fatalf("no event %q, got %q", prefix, skipped)
			return ""
		}
	}
}

// injectXIDOnceWatched injects an XID once the watchers that retries
// replaced are gone (see mockgpu.Machine.EventSetsOpen).
func injectXIDOnceWatched(ctx context.Context, t *testing.T, e *env, gpu int, xid uint64) {
	t.Helper()
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return e.machine.EventSetsOpen() == 1, nil
	}); err != nil {
		t.Fatalf("%d NVML event sets open, want the one of the watcher: %v", e.machine.EventSetsOpen(), err)
	}
	if err := e.machine.InjectXID(gpu, xid); err != nil {
		t.Fatal(err)
	}
}

// TestHealthWatchingRetried: where health watching fails for every GPU at
// start, every GPU is Unknown; once NVML registers the events again, a
// retry (every rescan interval) watches them, and an XID taints its GPU.
func TestHealthWatchingRetried(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(20)
	e.recorder = recorder
	e.rescanInterval = 20 * time.Millisecond
	for i := range 8 {
		e.machine.FailEventRegistration(i, nvml.ERROR_UNKNOWN)
	}
	a := e.start(ctx, t)
	h := waitForHealthReport(ctx, t, a, "a message on gpu-0", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h["gpu-0"].Message != ""
	})
	for name, d := range h {
		if d.Health != kubeletplugin.HealthStatusUnknown || !strings.Contains(d.Message, "NVML RegisterEvents failed: ERROR_UNKNOWN") {
			t.Errorf("%s: %s %q, want Unknown naming the failed call", name, d.Health, d.Message)
		}
	}

	for i := range 8 {
		e.machine.FailEventRegistration(i, nvml.SUCCESS)
	}
	waitForHealthReport(ctx, t, a, "every GPU Healthy", func(h map[string]kubeletplugin.DeviceHealth) bool {
		for _, d := range h {
			if d.Health != kubeletplugin.HealthStatusHealthy {
				return false
			}
		}
		return len(h) == 8
	})
	expectEventWithPrefix(t, recorder, "Normal "+agent.ReasonHealthWatched)
	injectXIDOnceWatched(ctx, t, e, 3, 79)
	waitForHealthTaint(ctx, t, a, a.Inventory().GPUs[3].Name, "xid-79")
}

// TestWatchHealthStatusNoneWatched: where no GPU's health events can be
// registered, every GPU is Unknown to the kubelet with a message that
// names why for each, and no partly-watched Warning is sent.
func TestWatchHealthStatusNoneWatched(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(10)
	e.recorder = recorder
	for i := range 8 {
		e.machine.FailEventRegistration(i, nvml.ERROR_NOT_SUPPORTED)
	}
	a := e.start(ctx, t)
	h := waitForHealthReport(ctx, t, a, "a message on gpu-0", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h["gpu-0"].Message != ""
	})
	for name, d := range h {
		if d.Health != kubeletplugin.HealthStatusUnknown || !strings.Contains(d.Message, "health not watched: device health cannot be watched") ||
			!strings.Contains(d.Message, "gpu-7: NVML RegisterEvents failed: ERROR_NOT_SUPPORTED") {
			t.Errorf("%s: %s %q, want Unknown with a message naming why for every GPU", name, d.Health, d.Message)
		}
	}
	for _, ev := range drainEvents(recorder) {
		if strings.HasPrefix(ev, "Warning "+agent.ReasonHealthPartlyWatched) {
			t.Errorf("unexpected event %q", ev)
		}
	}
}

// blockingGenerator blocks CDI spec generation, as nvcdi does where an
// NVML call hangs, until release is closed; entered receives a value when
// a generation starts.
type blockingGenerator struct {
	entered chan struct{}
	release chan struct{}
}

func (g *blockingGenerator) CommonEdits() (cdispec.ContainerEdits, error) {
	select {
	case g.entered <- struct{}{}:
	default:
	}
	<-g.release
	return cdispec.ContainerEdits{}, nil
}

func (g *blockingGenerator) DeviceEdits(cdi.Device) (cdispec.ContainerEdits, error) {
	return cdispec.ContainerEdits{}, nil
}

// startBlocked starts e's agent with a blockingGenerator; the returned
// function releases it, and the test's cleanup does so before it stops
// the agent.
func startBlocked(ctx context.Context, t *testing.T, e *env) (*agent.Agent, *blockingGenerator, func()) {
	t.Helper()
	gen := &blockingGenerator{entered: make(chan struct{}, 1), release: make(chan struct{})}
	e.generator = gen
	a := e.start(ctx, t)
	release := sync.OnceFunc(func() { close(gen.release) })
	t.Cleanup(release) // registered after e.start's Stop: runs first
	return a, gen, release
}

// awaitEntered waits until a generation has started.
func (g *blockingGenerator) awaitEntered(t *testing.T) {
	t.Helper()
	select {
	case <-g.entered:
	case <-time.After(30 * time.Second):
		t.Fatal("Prepare did not start generating the CDI spec")
	}
}

// TestHealthTaintNotDelayedByPrepare: a critical XID on one GPU is
// published as a health taint while a Prepare of another GPU hangs in CDI
// spec generation, and the checkpoint ends up with both the fault and the
// claim.
func TestHealthTaintNotDelayedByPrepare(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	a, gen, release := startBlocked(ctx, t, e)
	waitForHealthReport(ctx, t, a, "gpu-0 watched", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h["gpu-0"].Health == kubeletplugin.HealthStatusHealthy
	})

	held := claim("held", gpus("gpus", "gpu-0")...)
	prepared := make(chan error, 1)
	go func() {
		res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{held})
		if err == nil {
			err = res[held.UID].Err
		}
		prepared <- err
	}()
	gen.awaitEntered(t)
	if err := e.machine.InjectXID(5, 79); err != nil {
		t.Fatal(err)
	}
	tainted := func(ctx context.Context) (bool, error) {
		list, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for _, s := range list.Items {
			for _, d := range s.Spec.Devices {
				if d.Name == "gpu-5" && hasTaint(d.Taints, agent.HealthTaintKey) {
					return true, nil
				}
			}
		}
		return false, nil
	}
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, tainted); err != nil {
		t.Fatalf("gpu-5 not tainted while a Prepare of gpu-0 generates its CDI spec: %v", err)
	}

	release()
	if err := <-prepared; err != nil {
		t.Fatalf("prepare: %v", err)
	}
	store, err := checkpoint.New(e.stateDir)
	if err != nil {
		t.Fatal(err)
	}
	// The fault may be recorded just after the taint is published.
	var cp *checkpoint.Checkpoint
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		cp, err = store.Load()
		return err == nil && cp.Faults[e.machine.UUID(5)].Reason == "xid-79", nil
	}); err != nil {
		t.Fatalf("checkpoint %+v (%v), want the fault of gpu-5", cp, err)
	}
	if _, ok := cp.Claims[held.UID]; !ok {
		t.Errorf("checkpoint %+v lacks claim %s", cp, held.Name)
	}
}

// TestPrepareRefusesFaultyGPU: a claim allocated a GPU after (or just
// before) it reported a critical XID is refused, with an error and a
// warning on the claim that name the GPU and the fault, and no CDI spec:
// its container would start on a broken GPU. A claim prepared before the
// fault is prepared again (the kubelet does that after it restarts), and
// a claim with admin access (monitoring) is prepared.
func TestPrepareRefusesFaultyGPU(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	a, recorder, e := startRecorded(ctx, t, 100)
	waitForHealthReport(ctx, t, a, "GPUs watched", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h["gpu-4"].Health == kubeletplugin.HealthStatusHealthy && h["gpu-5"].Health == kubeletplugin.HealthStatusHealthy
	})
	before := claim("before", gpus("gpus", "gpu-4")...)
	if err := prepareOne(ctx, t, a, before); err != nil {
		t.Fatalf("prepare before the fault: %v", err)
	}
	injectXIDOnceWatched(ctx, t, e, 4, 79)
	injectXIDOnceWatched(ctx, t, e, 5, 79)
	waitForHealthTaint(ctx, t, a, "gpu-5", "xid-79")
	waitForHealthTaint(ctx, t, a, "gpu-4", "xid-79")

	late := claim("late", gpus("gpus", "gpu-5")...)
	err := prepareOne(ctx, t, a, late)
	if !errors.Is(err, agent.ErrDeviceUnhealthy) || !strings.Contains(err.Error(), "gpu-5") || !strings.Contains(err.Error(), "xid-79") {
		t.Errorf("prepare of a claim on the faulty gpu-5: %v, want ErrDeviceUnhealthy naming gpu-5 and xid-79", err)
	}
	if entries, _ := os.ReadDir(e.cdiDir); slices.ContainsFunc(entries, func(d os.DirEntry) bool { return strings.Contains(d.Name(), string(late.UID)) }) {
		t.Error("a CDI spec was written for the refused claim")
	}
	if ev := expectEventWithPrefix(t, recorder, "Warning "+agent.ReasonUnhealthyDeviceAllocated); !strings.Contains(ev, "gpu-5") {
		t.Errorf("event %q does not name gpu-5", ev)
	}
	if err := prepareOne(ctx, t, a, before); err != nil {
		t.Errorf("prepare again of the claim prepared before the fault: %v", err)
	}
	monitor := claim("monitor", alloc{request: "gpus", device: "gpu-5", admin: true})
	if err := prepareOne(ctx, t, a, monitor); err != nil {
		t.Errorf("prepare of an admin-access claim on the faulty gpu-5: %v", err)
	}
}

// TestFaultKeptThroughUnreadableCheckpoint: a GPU reports a critical XID
// while the checkpoint cannot be read. The agent keeps running, taints
// the GPU, says on the Node that the claims using it are unknown, and
// records the fault once the checkpoint can be read again, so that a
// restarted agent still taints the GPU.
func TestFaultKeptThroughUnreadableCheckpoint(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	a, recorder, e := startRecorded(ctx, t, 100)
	waitForHealthReport(ctx, t, a, "gpu-2 watched", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h["gpu-2"].Health == kubeletplugin.HealthStatusHealthy
	})
	held := claim("held", gpus("gpus", "gpu-2")...)
	if err := prepareOne(ctx, t, a, held); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	path := filepath.Join(e.stateDir, checkpoint.FileName)
	good, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("{not a checkpoint"), 0o600); err != nil {
		t.Fatal(err)
	}

	injectXIDOnceWatched(ctx, t, e, 2, 79)
	waitForHealthTaint(ctx, t, a, "gpu-2", "xid-79")
	ev := expectEventWithPrefix(t, recorder, "Warning "+agent.ReasonDeviceUnhealthy)
	if !strings.Contains(ev, "gpu-2") || !strings.Contains(ev, "unknown") {
		t.Errorf("event %q does not name gpu-2 and say that its claims are unknown", ev)
	}
	if err := a.Err(); err != nil {
		t.Fatalf("the agent stopped: %v", err)
	}

	if err := os.WriteFile(path, good, 0o600); err != nil {
		t.Fatal(err)
	}
	store, err := checkpoint.New(e.stateDir)
	if err != nil {
		t.Fatal(err)
	}
	var cp *checkpoint.Checkpoint
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		cp, err = store.Load()
		return err == nil && cp.Faults[e.machine.UUID(2)].Reason == "xid-79", nil
	}); err != nil {
		t.Fatalf("checkpoint %+v (%v), want the fault of gpu-2", cp, err)
	}
	if _, ok := cp.Claims[held.UID]; !ok {
		t.Errorf("checkpoint %+v lacks claim %s", cp, held.Name)
	}
	if err := a.Err(); err != nil {
		t.Errorf("the agent stopped: %v", err)
	}
}

// hangingGenerator blocks the CDI spec generation of one device, as nvcdi
// does where an NVML call on a GPU in a bad state hangs, until release is
// closed; entered receives a value when that generation starts.
type hangingGenerator struct {
	device  string
	entered chan struct{}
	release chan struct{}
}

func (g *hangingGenerator) CommonEdits() (cdispec.ContainerEdits, error) {
	return cdispec.ContainerEdits{}, nil
}

func (g *hangingGenerator) DeviceEdits(d cdi.Device) (cdispec.ContainerEdits, error) {
	if d.Name == g.device {
		select {
		case g.entered <- struct{}{}:
		default:
		}
		<-g.release
	}
	return cdispec.ContainerEdits{}, nil
}

// TestOtherClaimsNotHeldUpByHungPrepare: while the Prepare of one claim
// hangs in CDI spec generation, other claims are unprepared and prepared;
// no other claim is prepared with the hung claim's GPU; a second Prepare
// of the hung claim gives up with ErrClaimBusy when its caller does; once
// the generation returns, the claim is prepared.
func TestOtherClaimsNotHeldUpByHungPrepare(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	gen := &hangingGenerator{device: "gpu-0", entered: make(chan struct{}, 1), release: make(chan struct{})}
	e.generator = gen
	a := e.start(ctx, t)
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(gen.release) }) }
	t.Cleanup(release) // before a.Stop

	done := claim("done", gpus("gpus", "gpu-1")...)
	if err := prepareOne(ctx, t, a, done); err != nil {
		t.Fatalf("prepare %s: %v", done.Name, err)
	}
	hung := claim("hung", gpus("gpus", "gpu-0")...)
	prepared := make(chan error, 1)
	go func() {
		res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{hung})
		if err == nil {
			err = res[hung.UID].Err
		}
		prepared <- err
	}()
	select {
	case <-gen.entered:
	case <-time.After(30 * time.Second):
		t.Fatal("Prepare did not start generating the CDI spec")
	}

	within := func(what string, call func(ctx context.Context) error) error {
		t.Helper()
		ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		errs := make(chan error, 1)
		go func() { errs <- call(ctx) }()
		select {
		case err := <-errs:
			return err
		case <-time.After(30 * time.Second):
			t.Fatalf("%s waits for the hung Prepare", what)
			return nil
		}
	}
	if err := within("Unprepare of another claim", func(ctx context.Context) error {
		res, err := a.UnprepareResourceClaims(ctx, []kubeletplugin.NamespacedObject{ref(done)})
		if err == nil {
			err = res[done.UID]
		}
		return err
	}); err != nil {
		t.Errorf("unprepare %s: %v", done.Name, err)
	}
	w, err := cdi.New(e.cdiDir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(w.SpecPath(done.UID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("CDI spec of the unprepared claim: %v, want it removed", err)
	}
	prepare := func(c *resourceapi.ResourceClaim) func(ctx context.Context) error {
		return func(ctx context.Context) error {
			res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{c})
			if err == nil {
				err = res[c.UID].Err
			}
			return err
		}
	}
	other := claim("other", gpus("gpus", "gpu-2")...)
	if err := within("Prepare of another claim", prepare(other)); err != nil {
		t.Errorf("prepare %s: %v", other.Name, err)
	}
	same := claim("same-gpu", gpus("gpus", "gpu-0")...)
	if err := within("Prepare of a claim on the hung claim's GPU", prepare(same)); !errors.Is(err, agent.ErrDeviceInUse) {
		t.Errorf("prepare %s on the GPU being prepared for %s: %v, want ErrDeviceInUse", same.Name, hung.Name, err)
	}
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	_, err = a.PrepareResourceClaims(short, []*resourceapi.ResourceClaim{hung})
	cancel()
	if !errors.Is(err, agent.ErrClaimBusy) {
		t.Errorf("second prepare of %s while the first hangs: %v, want ErrClaimBusy", hung.Name, err)
	}

	release()
	if err := <-prepared; err != nil {
		t.Fatalf("prepare %s: %v", hung.Name, err)
	}
	got := preparedNames(t, e)
	if want := []string{"hung", "other"}; !slices.Equal(got, want) {
		t.Errorf("checkpoint has claims %v, want %v", got, want)
	}
}
