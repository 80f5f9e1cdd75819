package agent_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/scheme"
	cgotesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/tools/reference"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/checkpoint"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
)

// TestAgentWaitsForDriver starts an agent on a node whose NVML library is
// not there yet (a driver container still installing): the agent is not
// ready and says why on the Node; once the library appears it publishes the
// GPUs without a restart and becomes ready.
func TestAgentWaitsForDriver(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	var installed atomic.Bool
	var opens atomic.Int32
	// Like the command's loader: "not in the driver root" wraps ErrNoGPU,
	// which the agent treats as "not yet".
	lazy := discovery.NewLazy(func() (nvml.Interface, error) {
		opens.Add(1)
		if !installed.Load() {
			return nil, fmt.Errorf("%w: libnvidia-ml.so.1 not found in driver root /driver-root", discovery.ErrNoGPU)
		}
		return e.machine.NVML(), nil
	}, discovery.NVMLOptions{Sysfs: e.machine.Sysfs()})
	recorder := events.NewFakeRecorder(10)
	a, err := agent.New(ctx, agent.Options{
		NodeName:       nodeName,
		KubeClient:     e.client,
		Discovery:      lazy,
		PublishOnly:    true,
		Recorder:       recorder,
		RescanInterval: time.Hour,
		NoGPURetry:     10 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Stop)

	if err := a.NoGPU(); !errors.Is(err, discovery.ErrNoGPU) {
		t.Errorf("without a driver: NoGPU() = %v, want an error wrapping ErrNoGPU", err)
	}
	// Ready all the same: a node without GPUs must not hold up a rolling
	// update of the DaemonSet.
	if err := a.Ready(); err != nil {
		t.Errorf("not ready without a driver: %v", err)
	}
	if got := expectEvent(t, recorder); !strings.Contains(got, "Warning "+agent.ReasonNoGPU) || !strings.Contains(got, "libnvidia-ml.so.1") {
		t.Errorf("event %q, want a %s warning naming the library", got, agent.ReasonNoGPU)
	}
	// It retries (with backoff well below the hour-long rescan interval).
	if err := wait.PollUntilContextTimeout(ctx, 5*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return opens.Load() >= 3, nil
	}); err != nil {
		t.Fatalf("NVML load retried %d times: %v", opens.Load(), err)
	}

	installed.Store(true)
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
		slices, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil || len(slices.Items) != 1 {
			return false, nil
		}
		return len(slices.Items[0].Spec.Devices) == 8, nil
	}); err != nil {
		t.Fatalf("GPUs not published after the driver appeared: %v", err)
	}
	if err := a.NoGPU(); err != nil {
		t.Errorf("with GPUs: NoGPU() = %v", err)
	}
	if err := a.Ready(); err != nil {
		t.Errorf("not ready with GPUs: %v", err)
	}
	if got := expectEvent(t, recorder); !strings.Contains(got, "Normal "+agent.ReasonGPUsFound) {
		t.Errorf("event %q, want %s", got, agent.ReasonGPUsFound)
	}
}

func expectEvent(t *testing.T, r *events.FakeRecorder) string {
	t.Helper()
	select {
	case ev := <-r.Events:
		return ev
	case <-time.After(10 * time.Second):
		t.Fatal("no event")
		return ""
	}
}

// TestCheckpointAfterReboot prepares a claim, "reboots" the node (new boot
// id) and restarts the agent: the claim and its CDI spec are gone, and the
// GPU can be prepared for another claim. A restart without reboot keeps it.
func TestCheckpointAfterReboot(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	c := claim("before", gpus("gpus", "gpu-2")...)
	a := e.start(ctx, t)
	if err := prepareOne(ctx, t, a, c); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	specPath := readSpecPath(t, e, c.UID)
	a.Stop()

	// Restart, same boot: still prepared, another claim is refused.
	a = e.start(ctx, t)
	other := claim("after", gpus("gpus", "gpu-2")...)
	res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{other})
	if err != nil || !errors.Is(res[other.UID].Err, agent.ErrDeviceInUse) {
		t.Fatalf("same boot: want ErrDeviceInUse, got %v %v", err, res[other.UID].Err)
	}
	if msg := res[other.UID].Err.Error(); !strings.Contains(msg, "prepared for claim before ("+string(c.UID)+")") || !strings.Contains(msg, "--stale-claim-grace") {
		t.Errorf("same namespace: %q does not name claim before and the remedy", msg)
	}
	// The message goes to the pod's events: a claim of another namespace
	// is not named there.
	elsewhere := claim("elsewhere", gpus("gpus", "gpu-2")...)
	elsewhere.Namespace = "tenant-b"
	res, err = a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{elsewhere})
	if err != nil || !errors.Is(res[elsewhere.UID].Err, agent.ErrDeviceInUse) {
		t.Fatalf("another namespace: want ErrDeviceInUse, got %v %v", err, res[elsewhere.UID].Err)
	}
	if msg := res[elsewhere.UID].Err.Error(); strings.Contains(msg, "claim before") || !strings.Contains(msg, "a claim of another namespace (UID "+string(c.UID)+")") {
		t.Errorf("another namespace: %q names the other claim, or not by its UID", msg)
	}
	a.Stop()

	if err := os.WriteFile(e.bootIDFile, []byte("boot-2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	a = e.start(ctx, t)
	if _, err := os.Stat(specPath); !os.IsNotExist(err) {
		t.Errorf("CDI spec of the claim from the previous boot still there: %v", err)
	}
	res, err = a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{other})
	if err != nil || res[other.UID].Err != nil {
		t.Errorf("after reboot gpu-2 is free, got %v %v", err, res[other.UID].Err)
	}
}

func readSpecPath(t *testing.T, e *env, uid types.UID) string {
	t.Helper()
	entries, err := os.ReadDir(e.cdiDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, entry := range entries {
		if strings.Contains(entry.Name(), string(uid)) {
			return e.cdiDir + "/" + entry.Name()
		}
	}
	t.Fatalf("no CDI spec for %s", uid)
	return ""
}

func TestPrepareRefusesOpaqueConfig(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	a := e.start(ctx, t)
	config := func(driver string, source resourceapi.AllocationConfigSource, requests ...string) resourceapi.DeviceAllocationConfiguration {
		return resourceapi.DeviceAllocationConfiguration{
			Source:   source,
			Requests: requests,
			DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
				Driver: driver, Parameters: runtime.RawExtension{Raw: []byte(`{"sharing":"timeSlicing"}`)},
			}},
		}
	}
	testcases := map[string]struct {
		config  resourceapi.DeviceAllocationConfiguration
		wantErr string
	}{
		"ours, whole claim":    {config: config("gpu.topodra.io", resourceapi.AllocationConfigSourceClaim), wantErr: "from the claim"},
		"ours, from the class": {config: config("gpu.topodra.io", resourceapi.AllocationConfigSourceClass, "gpus"), wantErr: "from its DeviceClass"},
		"ours, other request":  {config: config("gpu.topodra.io", resourceapi.AllocationConfigSourceClaim, "nic")},
		"other driver":         {config: config("gpu.nvidia.com", resourceapi.AllocationConfigSourceClaim)},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			c := claim("cfg-"+strings.ReplaceAll(strings.ReplaceAll(name, " ", ""), ",", ""), gpus("gpus", "gpu-5")...)
			c.Status.Allocation.Devices.Config = []resourceapi.DeviceAllocationConfiguration{tc.config}
			res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{c})
			if err != nil {
				t.Fatal(err)
			}
			got := res[c.UID].Err
			if tc.wantErr == "" {
				if got != nil {
					t.Errorf("unexpected error: %v", got)
				}
				unprepareOne(ctx, t, a, c)
				return
			}
			if !errors.Is(got, agent.ErrConfigNotSupported) || !strings.Contains(got.Error(), tc.wantErr) {
				t.Errorf("error %v, want ErrConfigNotSupported mentioning %q", got, tc.wantErr)
			}
		})
	}
}

// TestCleanupDeallocatedClaim: a prepared claim that the API server still
// has, with the same UID, but no longer allocated (its pods went and it
// was given back without the kubelet unpreparing it) keeps its GPU within
// the grace period, with a TopodraPreparedClaimGone Warning saying so, and
// is then dropped like a deleted claim, so that the GPU can be prepared
// for another claim; an allocated claim stays.
func TestCleanupDeallocatedClaim(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e, recorder, a := startStale(ctx, t)
	kept := claim("kept", gpus("gpus", "gpu-0")...)
	given := claim("given-back", gpus("gpus", "gpu-1")...)
	res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{kept, given})
	if err != nil {
		t.Fatal(err)
	}
	for uid, r := range res {
		if r.Err != nil {
			t.Fatalf("prepare %s: %v", uid, r.Err)
		}
	}
	deallocated := given.DeepCopy()
	deallocated.Status.Allocation = nil
	for _, c := range []*resourceapi.ResourceClaim{kept, deallocated} {
		if _, err := e.client.ResourceV1().ResourceClaims(c.Namespace).Create(ctx, c, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	e.kubelet.run("default", "server", "kept")
	if removed, err := a.CleanupStaleClaims(ctx); err != nil || len(removed) != 0 {
		t.Errorf("first check: removed %v (%v), want none", removed, err)
	}
	evs := drainEvents(recorder)
	if len(evs) != 1 || !strings.HasPrefix(evs[0], "Warning "+agent.ReasonPreparedClaimGone) || !strings.Contains(evs[0], "default/given-back") || !strings.Contains(evs[0], "no longer allocated") {
		t.Errorf("events %q, want one %s naming default/given-back as no longer allocated", evs, agent.ReasonPreparedClaimGone)
	}
	removed, err := a.CleanupStaleClaims(ctx)
	if err != nil || !slices.Equal(removed, []types.UID{given.UID}) {
		t.Errorf("after the grace period: removed %v (%v), want %s", removed, err, given.UID)
	}
	res, err = a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{claim("next", gpus("gpus", "gpu-1")...), claim("clash", gpus("gpus", "gpu-0")...)})
	if err != nil {
		t.Fatal(err)
	}
	if r := res["uid-next"]; r.Err != nil {
		t.Errorf("gpu-1 of the dropped claim: %v, want it prepared", r.Err)
	}
	if r := res["uid-clash"]; !errors.Is(r.Err, agent.ErrDeviceInUse) {
		t.Errorf("gpu-0 of an allocated claim: %v, want ErrDeviceInUse", r.Err)
	}
}

// TestCleanupStaleClaims: a prepared claim that was deleted from the API
// (or recreated under the same name) keeps its GPU, as its pod's
// containers may still run: another claim on that GPU is refused, and the
// Node gets one Warning per claim naming it and its GPU. After the grace
// period the agent drops such a claim once the kubelet has reported it
// unused in two checks in a row, not while a container on the node uses
// it or the kubelet cannot be reached. A claim that exists stays.
func TestCleanupStaleClaims(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(20)
	e.recorder = recorder
	// The fake client's reactors must not change while the agent uses it:
	// this one fails claim reads only while its flag is set.
	var failing atomic.Bool
	e.client.PrependReactor("get", "resourceclaims", func(cgotesting.Action) (bool, runtime.Object, error) {
		if failing.Load() {
			return true, nil, apierrors.NewInternalError(errors.New("etcd unavailable"))
		}
		return false, nil, nil
	})
	a := e.start(ctx, t)
	live := claim("live", gpus("gpus", "gpu-0")...)
	gone := claim("gone", gpus("gpus", "gpu-1")...)
	recreated := claim("recreated", gpus("gpus", "gpu-2")...)
	for _, c := range []*resourceapi.ResourceClaim{live, recreated} {
		obj := c.DeepCopy()
		if c == recreated {
			obj.UID = "uid-recreated-2"
		}
		if _, err := e.client.ResourceV1().ResourceClaims(c.Namespace).Create(ctx, obj, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{live, gone, recreated})
	if err != nil {
		t.Fatal(err)
	}
	for uid, r := range res {
		if r.Err != nil {
			t.Fatalf("prepare %s: %v", uid, r.Err)
		}
	}
	// While the API server fails to answer, nothing is stale.
	failing.Store(true)
	if removed, err := a.CleanupStaleClaims(ctx); err != nil || len(removed) != 0 {
		t.Errorf("with the API failing: removed %v (%v), want none", removed, err)
	}
	if ev := drainEvents(recorder); len(ev) != 0 {
		t.Errorf("events with the API failing: %q", ev)
	}
	failing.Store(false)

	// Gone from the API: kept, reported once each.
	for range 2 {
		if removed, err := a.CleanupStaleClaims(ctx); err != nil || len(removed) != 0 {
			t.Errorf("within the grace period: removed %v (%v), want none", removed, err)
		}
	}
	evs := drainEvents(recorder)
	if len(evs) != 2 {
		t.Errorf("events %q, want one %s per gone claim", evs, agent.ReasonPreparedClaimGone)
	}
	for _, c := range []struct{ name, gpu string }{{"default/gone", "gpu-1 (" + e.machine.UUID(1) + ")"}, {"default/recreated", "gpu-2 (" + e.machine.UUID(2) + ")"}} {
		if !slices.ContainsFunc(evs, func(ev string) bool {
			return strings.HasPrefix(ev, "Warning "+agent.ReasonPreparedClaimGone) && strings.Contains(ev, c.name) && strings.Contains(ev, c.gpu)
		}) {
			t.Errorf("no %s Warning naming %s and %s in %q", agent.ReasonPreparedClaimGone, c.name, c.gpu, evs)
		}
	}
	res, err = a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{claim("next", gpus("gpus", "gpu-1")...), claim("clash", gpus("gpus", "gpu-0")...)})
	if err != nil {
		t.Fatal(err)
	}
	if r := res["uid-next"]; !errors.Is(r.Err, agent.ErrDeviceInUse) {
		t.Errorf("gpu-1 of a claim gone from the API: %v, want ErrDeviceInUse", r.Err)
	}
	if r := res["uid-clash"]; !errors.Is(r.Err, agent.ErrDeviceInUse) {
		t.Errorf("gpu-0 of a live claim: %v, want ErrDeviceInUse", r.Err)
	}

	// After the grace period (here 1ns, counted from the checks before
	// the agent restarted): a container on the node that uses "gone"
	// keeps it; "recreated" goes once the kubelet has reported it unused
	// twice, a check in which it cannot be reached not counting.
	a.Stop()
	e.staleClaimGrace = time.Nanosecond
	a = e.start(ctx, t)
	e.kubelet.run("default", "server", "live")
	e.kubelet.run("default", "here", "gone")
	for _, step := range []struct {
		what string
		err  error
		want []types.UID
	}{
		{what: "kubelet unreachable", err: status.Error(codes.Unavailable, "connection refused")},
		{what: "first check the kubelet answers"},
		{what: "kubelet unreachable again", err: status.Error(codes.Unavailable, "connection refused")},
		{what: "first check the kubelet answers again"},
		{what: "second check the kubelet answers", want: []types.UID{recreated.UID}},
	} {
		e.kubelet.fail(step.err)
		if removed, err := a.CleanupStaleClaims(ctx); err != nil || !slices.Equal(removed, step.want) {
			t.Errorf("%s: removed %v (%v), want %v", step.what, removed, err, step.want)
		}
	}
	e.kubelet.stop("default", "here")
	if removed, err := a.CleanupStaleClaims(ctx); err != nil || len(removed) != 0 {
		t.Errorf("first check after its pod is gone: removed %v (%v), want none", removed, err)
	}
	removed, err := a.CleanupStaleClaims(ctx)
	if err != nil || !slices.Equal(removed, []types.UID{gone.UID}) {
		t.Errorf("second check after its pod is gone: removed %v (%v), want %s", removed, err, gone.UID)
	}
	evs = drainEvents(recorder)
	if n := countPrefix(evs, "Normal "+agent.ReasonPreparedClaimDropped); n != 2 {
		t.Errorf("events %q, want two %s", evs, agent.ReasonPreparedClaimDropped)
	}
	// gpu-1 is free again, gpu-0 is not.
	res, err = a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{claim("next", gpus("gpus", "gpu-1")...), claim("clash", gpus("gpus", "gpu-0")...)})
	if err != nil {
		t.Fatal(err)
	}
	if r := res["uid-next"]; r.Err != nil {
		t.Errorf("gpu-1 after its claim was dropped: %v", r.Err)
	}
	if r := res["uid-clash"]; !errors.Is(r.Err, agent.ErrDeviceInUse) {
		t.Errorf("gpu-0 of a live claim: %v, want ErrDeviceInUse", r.Err)
	}
}

// TestStaleClaimNeverDropped: with a negative grace period a prepared
// claim gone from the API keeps its GPU until the kubelet unprepares it.
func TestStaleClaimNeverDropped(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	e.staleClaimGrace = -1
	a := e.start(ctx, t)
	gone := claim("gone", gpus("gpus", "gpu-1")...)
	if err := prepareOne(ctx, t, a, gone); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	for range 3 {
		if removed, err := a.CleanupStaleClaims(ctx); err != nil || len(removed) != 0 {
			t.Errorf("removed %v (%v), want none", removed, err)
		}
	}
	next := claim("next", gpus("gpus", "gpu-1")...)
	if err := prepareOne(ctx, t, a, next); !errors.Is(err, agent.ErrDeviceInUse) {
		t.Errorf("gpu-1 of the gone claim: %v, want ErrDeviceInUse", err)
	}
	unprepareOne(ctx, t, a, gone)
	if err := prepareOne(ctx, t, a, next); err != nil {
		t.Errorf("gpu-1 after the kubelet unprepared the gone claim: %v", err)
	}
}

// drainEvents returns the events recorded so far.
func drainEvents(r *events.FakeRecorder) []string {
	var out []string
	for {
		select {
		case ev := <-r.Events:
			out = append(out, ev)
		default:
			return out
		}
	}
}

func countPrefix(evs []string, prefix string) int {
	n := 0
	for _, ev := range evs {
		if strings.HasPrefix(ev, prefix) {
			n++
		}
	}
	return n
}

// TestPrepareReallocatedClaim: a prepared claim that was allocated again
// (other devices, or another allocation time) is refused with
// ErrReallocated naming the old and new devices, with a warning event on
// the claim, instead of getting the devices of the earlier allocation;
// once the kubelet unprepared it, the new allocation prepares.
func TestPrepareReallocatedClaim(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(10)
	e.recorder = recorder
	a := e.start(ctx, t)
	at := func(c *resourceapi.ResourceClaim, sec int64) *resourceapi.ResourceClaim {
		c.Status.Allocation.AllocationTimestamp = &metav1.Time{Time: time.Unix(sec, 0)}
		return c
	}
	first := at(claim("x", gpus("gpus", "gpu-0")...), 1000)
	if err := prepareOne(ctx, t, a, first); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	testcases := map[string]struct {
		claim   *resourceapi.ResourceClaim
		wantErr []string
	}{
		"same allocation":         {claim: at(claim("x", gpus("gpus", "gpu-0")...), 1000)},
		"allocation time unknown": {claim: claim("x", gpus("gpus", "gpu-0")...)},
		"other GPU":               {claim: at(claim("x", gpus("gpus", "gpu-3")...), 2000), wantErr: []string{"gpu-0", "gpu-3"}},
		"other GPU, time unknown": {claim: claim("x", gpus("gpus", "gpu-3")...), wantErr: []string{"gpu-0", "gpu-3"}},
		"same GPU, allocated again": {claim: at(claim("x", gpus("gpus", "gpu-0")...), 2000),
			wantErr: []string{time.Unix(1000, 0).UTC().Format(time.RFC3339), time.Unix(2000, 0).UTC().Format(time.RFC3339)}},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{tc.claim})
			if err != nil {
				t.Fatal(err)
			}
			r := res[tc.claim.UID]
			if tc.wantErr == nil {
				if r.Err != nil || len(r.Devices) != 1 || r.Devices[0].DeviceName != "gpu-0" {
					t.Errorf("got %+v, want gpu-0", r)
				}
				return
			}
			if !errors.Is(r.Err, agent.ErrReallocated) {
				t.Fatalf("got %+v, want ErrReallocated", r)
			}
			for _, want := range tc.wantErr {
				if !strings.Contains(r.Err.Error(), want) {
					t.Errorf("error %q does not name %s", r.Err, want)
				}
			}
			if ev := expectEvent(t, recorder); !strings.HasPrefix(ev, "Warning "+agent.ReasonReallocated) || !strings.Contains(ev, tc.wantErr[0]) {
				t.Errorf("event %q, want a %s warning", ev, agent.ReasonReallocated)
			}
		})
	}
	unprepareOne(ctx, t, a, first)
	again := at(claim("x", gpus("gpus", "gpu-3")...), 2000)
	res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{again})
	if r := res[again.UID]; err != nil || r.Err != nil || len(r.Devices) != 1 || r.Devices[0].DeviceName != "gpu-3" {
		t.Errorf("after unprepare: %v %+v, want gpu-3", err, r)
	}
}

// TestRebootMovedGPU prepares two claims, then "reboots" the node with the
// minor numbers of GPUs 2 and 3 swapped, so that the device name gpu-2 now
// names the other GPU. The kubelet prepares both claims again: the one on
// gpu-2 is refused with ErrGPUMoved, naming both UUIDs, and a warning event
// on the claim; the one on gpu-5, whose GPU kept its name, prepares
// normally; a new claim on gpu-2 prepares normally.
func TestRebootMovedGPU(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	moved := claim("moved", gpus("gpus", "gpu-2")...)
	moved2 := claim("moved2", gpus("gpus", "gpu-3")...)
	kept := claim("kept", gpus("gpus", "gpu-5")...)
	a := e.start(ctx, t)
	res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{moved, moved2, kept})
	if err != nil || res[moved.UID].Err != nil || res[moved2.UID].Err != nil || res[kept.UID].Err != nil {
		t.Fatalf("prepare: %v %v", err, res)
	}
	a.Stop()

	if err := os.WriteFile(e.bootIDFile, []byte("boot-2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	e.machine.SetMinor(2, 3)
	e.machine.SetMinor(3, 2)
	recorder := events.NewFakeRecorder(10)
	e.recorder = recorder
	a = e.start(ctx, t)
	res, err = a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{moved, kept})
	if err != nil {
		t.Fatal(err)
	}
	got := res[moved.UID].Err
	if !errors.Is(got, agent.ErrGPUMoved) || !strings.Contains(got.Error(), e.machine.UUID(2)) || !strings.Contains(got.Error(), e.machine.UUID(3)) || !strings.Contains(got.Error(), "recreated") {
		t.Errorf("claim on the moved GPU: got %v, want ErrGPUMoved naming %s and %s", got, e.machine.UUID(2), e.machine.UUID(3))
	}
	if r := res[kept.UID]; r.Err != nil || len(r.Devices) != 1 {
		t.Errorf("claim on a GPU that kept its name: %+v", r)
	}
	if ev := expectEvent(t, recorder); !strings.Contains(ev, "Warning "+agent.ReasonGPUMoved) || !strings.Contains(ev, e.machine.UUID(2)) {
		t.Errorf("event %q, want a %s warning", ev, agent.ReasonGPUMoved)
	}
	// A restart does not forget it: the kubelet keeps retrying.
	a.Stop()
	a = e.start(ctx, t)
	res, err = a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{moved})
	if err != nil || !errors.Is(res[moved.UID].Err, agent.ErrGPUMoved) {
		t.Errorf("after a restart: %v %v, want ErrGPUMoved", err, res[moved.UID].Err)
	}
	// The recreated pod's claim is another claim: gpu-2 is free for it.
	again := claim("again", gpus("gpus", "gpu-2")...)
	res, err = a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{again})
	if err != nil || res[again.UID].Err != nil {
		t.Errorf("new claim on gpu-2: %v %v", err, res[again.UID].Err)
	}
	// Unprepare (the kubelet gave up on the pod) forgets the old GPU too.
	if err := prepareOne(ctx, t, a, moved2); !errors.Is(err, agent.ErrGPUMoved) {
		t.Errorf("moved2 before unprepare: %v, want ErrGPUMoved", err)
	}
	unprepareOne(ctx, t, a, moved2)
	if err := prepareOne(ctx, t, a, moved2); err != nil {
		t.Errorf("moved2 after unprepare: %v", err)
	}
	if spec := readSpec(t, e, again.UID); len(spec.Devices) != 1 || !strings.Contains(spec.ContainerEdits.Env[0], e.machine.UUID(3)) {
		t.Errorf("new claim's CDI spec: %+v, want GPU %s", spec, e.machine.UUID(3))
	}
	unprepareOne(ctx, t, a, again)
	// Once the claim is deallocated (its pod deleted), a new allocation
	// of the same claim is not the one prepared before the reboot.
	deallocated := moved.DeepCopy()
	deallocated.Status.Allocation = nil
	if _, err := e.client.ResourceV1().ResourceClaims(moved.Namespace).Create(ctx, deallocated, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.CleanupStaleClaims(ctx); err != nil {
		t.Fatal(err)
	}
	res, err = a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{moved})
	if err != nil || res[moved.UID].Err != nil {
		t.Errorf("reallocated claim: %v %v", err, res[moved.UID].Err)
	}
}

// idleHealth watches health without ever reporting anything.
type idleHealth struct{}

func (h *idleHealth) WatchHealth(ctx context.Context, _ *discovery.Inventory, watching func(discovery.Unwatched), _ chan<- discovery.HealthEvent) error {
	watching(nil)
	<-ctx.Done()
	return nil
}

func hasTaint(taints []resourceapi.DeviceTaint, key string) bool {
	for _, t := range taints {
		if t.Key == key {
			return true
		}
	}
	return false
}

// healthTaint returns the value of a device's health taint in what the
// agent publishes, "" if it has none.
func healthTaint(t *testing.T, a *agent.Agent, device string) string {
	t.Helper()
	for _, pool := range a.Resources().Pools {
		for _, d := range pool.Slices[0].Devices {
			if d.Name != device {
				continue
			}
			for _, taint := range d.Taints {
				if taint.Key == agent.HealthTaintKey {
					return taint.Value
				}
			}
		}
	}
	return ""
}

func waitForHealthTaint(ctx context.Context, t *testing.T, a *agent.Agent, device, want string) {
	t.Helper()
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return healthTaint(t, a, device) == want, nil
	}); err != nil {
		t.Fatalf("%s: health taint %q, want %q", device, healthTaint(t, a, device), want)
	}
}

// TestFaultsSurviveRestartNotReboot: a GPU's fault is kept in the
// checkpoint, so that a restarted agent (a rolling update) still taints the
// GPU; a reboot resets the GPU and clears it.
func TestFaultsSurviveRestartNotReboot(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	a := e.start(ctx, t)
	if err := e.machine.InjectXID(5, 48); err != nil {
		t.Fatal(err)
	}
	waitForHealthTaint(ctx, t, a, "gpu-5", "xid-48")
	a.Stop()

	a = e.start(ctx, t)
	if got := healthTaint(t, a, "gpu-5"); got != "xid-48" {
		t.Errorf("after a restart: health taint %q, want xid-48", got)
	}
	if got := healthTaint(t, a, "gpu-4"); got != "" {
		t.Errorf("healthy gpu-4 tainted %q", got)
	}
	a.Stop()

	if err := os.WriteFile(e.bootIDFile, []byte("boot-2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	a = e.start(ctx, t)
	if got := healthTaint(t, a, "gpu-5"); got != "" {
		t.Errorf("after a reboot: health taint %q, want none", got)
	}
}

// hidingDiscovery leaves out the GPU with UUID hide, as a GPU that fell off
// the bus is missing from NVML.
type hidingDiscovery struct {
	*discovery.NVML
	hide atomic.Value
}

func (d *hidingDiscovery) Discover(ctx context.Context) (*discovery.Inventory, error) {
	inv, err := d.NVML.Discover(ctx)
	if err != nil {
		return nil, err
	}
	hide, _ := d.hide.Load().(string)
	out := &discovery.Inventory{Skipped: inv.Skipped}
	for _, g := range inv.GPUs {
		if g.UUID != hide {
			out.GPUs = append(out.GPUs, g)
		}
	}
	return out, nil
}

// TestFaultKeptWhileGPUIsMissing: a faulty GPU that is missing from one
// rescan and comes back is still tainted; while it is missing the kubelet
// still gets it as Unhealthy.
func TestFaultKeptWhileGPUIsMissing(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	nv, err := discovery.NewNVML(discovery.NVMLOptions{Lib: e.machine.NVML(), Sysfs: e.machine.Sysfs()})
	if err != nil {
		t.Fatal(err)
	}
	disc := &hidingDiscovery{NVML: nv}
	a, err := agent.New(ctx, agent.Options{NodeName: nodeName, KubeClient: e.client, Discovery: disc, PublishOnly: true, RescanInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Stop)
	if err := e.machine.InjectXID(3, 79); err != nil {
		t.Fatal(err)
	}
	waitForHealthTaint(ctx, t, a, "gpu-3", "xid-79")

	disc.hide.Store(e.machine.UUID(3))
	if err := a.Rescan(ctx); err != nil {
		t.Fatal(err)
	}
	if a.Inventory().GPU("gpu-3") != nil {
		t.Fatal("gpu-3 still discovered")
	}
	// The kubelet keeps seeing it Unhealthy, not Unknown.
	h := waitForHealthReport(ctx, t, a, "gpu-2 watched again", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h["gpu-2"].Health == kubeletplugin.HealthStatusHealthy
	})
	if got, ok := h["gpu-3"]; !ok || got.Health != kubeletplugin.HealthStatusUnhealthy || !strings.Contains(got.Message, e.machine.UUID(3)) {
		t.Errorf("missing gpu-3 in the kubelet's health report: %v %+v, want Unhealthy naming %s", ok, got, e.machine.UUID(3))
	}
	if len(h) != 8 || h["gpu-2"].Health != kubeletplugin.HealthStatusHealthy {
		t.Errorf("health report %+v, want 8 devices, the others Healthy", h)
	}
	disc.hide.Store("")
	if err := a.Rescan(ctx); err != nil {
		t.Fatal(err)
	}
	if got := healthTaint(t, a, "gpu-3"); got != "xid-79" {
		t.Errorf("gpu-3 back: health taint %q, want xid-79", got)
	}
}

// refRecorder records the object reference of every event, as the event
// broadcaster computes it.
type refRecorder struct {
	mutex sync.Mutex
	refs  map[string][]*v1.ObjectReference
}

func (r *refRecorder) Eventf(regarding, _ runtime.Object, _, reason, _, _ string, _ ...any) {
	ref, err := reference.GetReference(scheme.Scheme, regarding)
	if err != nil {
		panic(err)
	}
	r.mutex.Lock()
	defer r.mutex.Unlock()
	r.refs[reason] = append(r.refs[reason], ref)
}

// TestDeviceUnhealthyEventOnNode: the DeviceUnhealthy event refers to the
// Node as kubectl describe node looks for its events (UID = node name).
func TestDeviceUnhealthyEventOnNode(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := &refRecorder{refs: map[string][]*v1.ObjectReference{}}
	e.recorder = recorder
	a := e.start(ctx, t)
	if err := e.machine.InjectXID(1, 79); err != nil {
		t.Fatal(err)
	}
	waitForHealthTaint(ctx, t, a, "gpu-1", "xid-79")
	var nodeRefs []*v1.ObjectReference
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		recorder.mutex.Lock()
		defer recorder.mutex.Unlock()
		nodeRefs = nil
		for _, ref := range recorder.refs[agent.ReasonDeviceUnhealthy] {
			if ref.Kind == "Node" {
				nodeRefs = append(nodeRefs, ref)
			}
		}
		return len(nodeRefs) > 0, nil
	}); err != nil {
		t.Fatal("no DeviceUnhealthy event on the Node")
	}
	if ref := nodeRefs[0]; ref.Name != nodeName || ref.UID != types.UID(nodeName) {
		t.Errorf("event refers to %+v, want Node %s with UID %s", ref, nodeName, nodeName)
	}
}

// TestAgentStopsForNewDriver: NVML losing its driver, noticed by health
// watching or by a rescan, stops the agent with an error that says so,
// after a warning on the Node, so that its container restarts and loads
// the new library; the published GPUs are not withdrawn meanwhile.
func TestAgentStopsForNewDriver(t *testing.T) {
	for name, idle := range map[string]bool{"noticed by health watching": false, "noticed by a rescan": true} {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			e := newEnv(t)
			old := e.machine.Library("550.54.15")
			lazy := discovery.NewLazy(func() (nvml.Interface, error) { return old, nil }, discovery.NVMLOptions{Sysfs: e.machine.Sysfs()})
			recorder := events.NewFakeRecorder(20)
			opts := agent.Options{
				NodeName:       nodeName,
				KubeClient:     e.client,
				Discovery:      lazy,
				PublishOnly:    true,
				Recorder:       recorder,
				RescanInterval: time.Hour,
			}
			if idle {
				// Only a rescan can notice.
				opts.Health = &idleHealth{}
				opts.RescanInterval = 20 * time.Millisecond
			}
			a, err := agent.New(ctx, opts)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(a.Stop)
			if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
				slices, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
				return err == nil && len(slices.Items) == 1, nil
			}); err != nil {
				t.Fatalf("GPUs not published: %v", err)
			}
			if !idle {
				if err := wait.PollUntilContextTimeout(ctx, time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
					return old.EventSets() > 0, nil
				}); err != nil {
					t.Fatalf("health watching did not start: %v", err)
				}
			}
			old.Break()
			select {
			case <-a.Done():
			case <-time.After(10 * time.Second):
				t.Fatal("the agent kept running after NVML lost its driver")
			}
			if err := a.Err(); !errors.Is(err, discovery.ErrDriverChanged) {
				t.Errorf("Err() = %v, want it to wrap discovery.ErrDriverChanged", err)
			}
			if got := expectEvent(t, recorder); !strings.Contains(got, "Warning "+agent.ReasonNVMLReload) || !strings.Contains(got, "restarting the agent") {
				t.Errorf("event %q, want a %s warning saying the agent restarts", got, agent.ReasonNVMLReload)
			}
			slices, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
			if err != nil || len(slices.Items) != 1 {
				t.Errorf("published slices after the stop: %d (%v), want the one kept", len(slices.Items), err)
			}
		})
	}
}

// publishedDevices returns the devices of the slices in the API by name,
// nil where they cannot be listed.
func publishedDevices(ctx context.Context, e *env) map[string]resourceapi.Device {
	list, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil
	}
	devices := map[string]resourceapi.Device{}
	for _, s := range list.Items {
		for _, d := range s.Spec.Devices {
			devices[d.Name] = d
		}
	}
	return devices
}

// waitForPublished waits until the devices in the API are the node's 8
// GPUs and, if unusable, all carry the NVMLUnusableTaintKey taint, none
// otherwise; gpu-5 carries the health taint.
func waitForPublished(ctx context.Context, t *testing.T, e *env, unusable bool) {
	t.Helper()
	var devices map[string]resourceapi.Device
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		devices = publishedDevices(ctx, e)
		if len(devices) != 8 {
			return false, nil
		}
		for name, d := range devices {
			if hasTaint(d.Taints, agent.NVMLUnusableTaintKey) != unusable || hasTaint(d.Taints, agent.HealthTaintKey) != (name == "gpu-5") {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		t.Fatalf("published devices %+v, want 8 with taint %s: %v, gpu-5 with %s", devices, agent.NVMLUnusableTaintKey, unusable, agent.HealthTaintKey)
	}
}

// TestAgentStartsWithUnusableNVML: an agent whose NVML cannot be
// initialized (after a driver upgrade without a reboot the library
// belongs to another driver version than the kernel module) starts all
// the same, so that the kubelet can unprepare claims. It keeps the devices
// that were published before, with their health taints and tainted so
// that no new claim gets them, says why on the Node, refuses to prepare a
// new claim, prepares a claim that it prepared before again (as after a
// kubelet restart) and unprepares claims. Once NVML can be initialized it
// publishes the GPUs without that taint and prepares claims again.
func TestAgentStartsWithUnusableNVML(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(20)
	e.recorder = recorder
	a := e.start(ctx, t)
	held := claim("held", gpus("gpus", "gpu-0")...)
	if err := prepareOne(ctx, t, a, held); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	if err := e.machine.InjectXID(5, 79); err != nil {
		t.Fatal(err)
	}
	// Reported once the fault is in the checkpoint.
	expectEventWithPrefix(t, recorder, "Warning "+agent.ReasonDeviceUnhealthy)
	waitForPublished(ctx, t, e, false)
	a.Stop()

	broken := e.machine.Library("")
	broken.Break()
	var lib atomic.Pointer[mockgpu.Library]
	lib.Store(broken)
	opts := e.options(t)
	opts.Discovery = discovery.NewLazy(func() (nvml.Interface, error) { return lib.Load(), nil }, discovery.NVMLOptions{Sysfs: e.machine.Sysfs()})
	opts.RescanInterval = time.Hour
	opts.NoGPURetry = 10 * time.Millisecond
	a, err := agent.New(ctx, opts)
	if err != nil {
		t.Fatalf("agent with an unusable NVML does not start, the kubelet cannot unprepare claims: %v", err)
	}
	t.Cleanup(a.Stop)
	if err := a.NVMLUnusable(); !errors.Is(err, discovery.ErrNVMLUnusable) || !errors.Is(err, nvml.ERROR_LIB_RM_VERSION_MISMATCH) {
		t.Errorf("NVMLUnusable() = %v, want it to wrap ErrNVMLUnusable and ERROR_LIB_RM_VERSION_MISMATCH", err)
	}
	if err := a.Ready(); err != nil {
		t.Errorf("not ready: %v", err)
	}
	if got := expectEventWithPrefix(t, recorder, "Warning "+agent.ReasonNVMLUnusable); !strings.Contains(got, "ERROR_LIB_RM_VERSION_MISMATCH") || !strings.Contains(got, "8 published GPUs stay") {
		t.Errorf("event %q, want it to name the NVML error and the published GPUs", got)
	}
	waitForPublished(ctx, t, e, true)

	if err := prepareOne(ctx, t, a, claim("new", gpus("gpus", "gpu-1")...)); !errors.Is(err, discovery.ErrNVMLUnusable) {
		t.Errorf("prepare of a new claim: %v, want an error wrapping ErrNVMLUnusable", err)
	}
	if err := prepareOne(ctx, t, a, held); err != nil {
		t.Errorf("prepare of the prepared claim again: %v", err)
	}
	res, err := a.UnprepareResourceClaims(ctx, []kubeletplugin.NamespacedObject{ref(held)})
	if err != nil || res[held.UID] != nil {
		t.Fatalf("unprepare: %v %v", err, res)
	}
	store, err := checkpoint.New(e.stateDir)
	if err != nil {
		t.Fatal(err)
	}
	if cp, err := store.Load(); err != nil || len(cp.Claims) != 0 {
		t.Errorf("checkpoint after unprepare: %+v (%v), want no claims", cp, err)
	}

	lib.Store(e.machine.Library(""))
	waitForPublished(ctx, t, e, false)
	expectEventWithPrefix(t, recorder, "Normal "+agent.ReasonGPUsFound)
	if err := a.NVMLUnusable(); err != nil {
		t.Errorf("NVMLUnusable() = %v once NVML works", err)
	}
	if err := prepareOne(ctx, t, a, claim("new", gpus("gpus", "gpu-1")...)); err != nil {
		t.Errorf("prepare once NVML works: %v", err)
	}
}

// TestUnusableNVMLPublishedDevicesUnreadable: an agent that cannot use
// NVML and cannot read the devices it published before publishes nothing
// (an empty pool would withdraw devices that claims hold) until it can
// read them, then publishes them tainted.
func TestUnusableNVMLPublishedDevicesUnreadable(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	a := e.start(ctx, t)
	if err := e.machine.InjectXID(5, 79); err != nil {
		t.Fatal(err)
	}
	waitForHealthTaint(ctx, t, a, "gpu-5", "xid-79")
	waitForPublished(ctx, t, e, false)
	a.Stop()

	var listFails atomic.Bool
	listFails.Store(true)
	e.client.PrependReactor("list", "resourceslices", func(cgotesting.Action) (bool, runtime.Object, error) {
		if listFails.Load() {
			return true, nil, apierrors.NewInternalError(errors.New("etcd unavailable"))
		}
		return false, nil, nil
	})
	broken := e.machine.Library("")
	broken.Break()
	opts := e.options(t)
	opts.Discovery = discovery.NewLazy(func() (nvml.Interface, error) { return broken, nil }, discovery.NVMLOptions{Sysfs: e.machine.Sysfs()})
	opts.RescanInterval = time.Hour
	opts.NoGPURetry = 10 * time.Millisecond
	// Publishing would wait for the list to work.
	started := make(chan error, 1)
	go func() {
		var err error
		a, err = agent.New(ctx, opts)
		started <- err
	}()
	select {
	case err := <-started:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("New blocked: it publishes although the published devices cannot be read")
	}
	t.Cleanup(a.Stop)
	if _, ok := a.PublishStatus(); ok {
		t.Error("publishing while the published devices cannot be read")
	}
	listFails.Store(false)
	waitForPublished(ctx, t, e, true)
}

// prepareOne prepares c alone and returns the error of its result; an
// error of the call itself fails the test.
func prepareOne(ctx context.Context, t *testing.T, a *agent.Agent, c *resourceapi.ResourceClaim) error {
	t.Helper()
	res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{c})
	if err != nil {
		t.Fatalf("prepare %s: %v", c.Name, err)
	}
	return res[c.UID].Err
}

// unprepareOne unprepares c as the kubelet does; an error fails the test.
func unprepareOne(ctx context.Context, t *testing.T, a *agent.Agent, c *resourceapi.ResourceClaim) {
	t.Helper()
	if _, err := a.UnprepareResourceClaims(ctx, []kubeletplugin.NamespacedObject{ref(c)}); err != nil {
		t.Fatalf("unprepare %s: %v", c.Name, err)
	}
}

// TestClaimEventNoteLimit: the warning on a claim that was allocated
// again names its old and new devices; with many devices and long request
// names that note is longer than the API server accepts (1024 bytes), so
// it is cut, as on the Node, instead of the event being refused and lost.
func TestClaimEventNoteLimit(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	a, recorder, _ := startRecorded(ctx, t, 10)
	request := strings.Repeat("r", 60)
	at := func(c *resourceapi.ResourceClaim, sec int64) *resourceapi.ResourceClaim {
		c.Status.Allocation.AllocationTimestamp = &metav1.Time{Time: time.Unix(sec, 0)}
		return c
	}
	all := gpus(request, "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6", "gpu-7")
	if err := prepareOne(ctx, t, a, at(claim("long", all...), 1000)); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	again := at(claim("long", all...), 2000)
	res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{again})
	if err != nil {
		t.Fatal(err)
	}
	if r := res[again.UID]; !errors.Is(r.Err, agent.ErrReallocated) || len(r.Err.Error()) <= 1024 {
		t.Fatalf("got %+v, want ErrReallocated with a message over 1024 bytes, to be cut in the event", r)
	}
	ev := expectEvent(t, recorder)
	note := strings.TrimPrefix(ev, "Warning "+agent.ReasonReallocated+" ")
	if note == ev || len(note) > 1024 || !strings.HasSuffix(note, "...") {
		t.Errorf("event of %d bytes, want a %s note of at most 1024 bytes ending in ...: %q", len(note), agent.ReasonReallocated, ev)
	}
}

// startRecorded starts an agent on a new environment whose events go to a
// fake recorder of the given buffer size.
func startRecorded(ctx context.Context, t *testing.T, size int) (*agent.Agent, *events.FakeRecorder, *env) {
	t.Helper()
	e := newEnv(t)
	recorder := events.NewFakeRecorder(size)
	e.recorder = recorder
	return e.start(ctx, t), recorder, e
}
