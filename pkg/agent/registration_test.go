package agent_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/topology"
)

// TestReadyOnceKubeletRegisters: an agent that serves the kubelet is not
// ready until the kubelet registers its plugin, warns on the Node when the
// kubelet has not done so in time (naming the socket it has not used),
// stops being live while the kubelet refuses it, and says on the Node when
// the kubelet registers it after all. The registration calls are the
// plugin watcher's, over the registration socket.
func TestReadyOnceKubeletRegisters(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	base := socketDirs(t)
	recorder := events.NewFakeRecorder(10)
	opts := e.options(t)
	opts.PublishOnly = false
	opts.PluginDataDir = filepath.Join(base, "p")
	opts.RegistrarDir = filepath.Join(base, "r")
	opts.RegistrationTimeout = 200 * time.Millisecond
	opts.Recorder = recorder
	a, err := agent.New(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Stop)
	socket := filepath.Join(opts.RegistrarDir, topology.DriverName+"-reg.sock")

	if err := a.Ready(); err == nil || !strings.Contains(err.Error(), "not registered") || !strings.Contains(err.Error(), socket) {
		t.Errorf("before registration: Ready() = %v, want an error naming the registration socket", err)
	}
	if err := a.Live(); err != nil {
		t.Errorf("before registration: Live() = %v; waiting for the kubelet is no reason to restart", err)
	}
	ev := expectEventWithPrefix(t, recorder, "Warning "+agent.ReasonNotRegistered)
	for _, want := range []string{socket, "--kubelet-dir"} {
		if !strings.Contains(ev, want) {
			t.Errorf("event %q does not name %q", ev, want)
		}
	}
	if a.Registered() {
		t.Error("Registered() before the kubelet registered the plugin")
	}

	watcher := pluginWatcher(t, socket)
	callCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	info, err := watcher.GetInfo(callCtx, &registerapi.InfoRequest{})
	if err != nil {
		t.Fatalf("GetInfo: %v", err)
	}
	if info.Name != topology.DriverName {
		t.Errorf("GetInfo names %q, want %q", info.Name, topology.DriverName)
	}

	// Refused: not live (the agent restarts to register again), a warning
	// with the kubelet's reason.
	if _, err := watcher.NotifyRegistrationStatus(callCtx, &registerapi.RegistrationStatus{PluginRegistered: false, Error: "no supported version"}); err == nil {
		t.Error("a refused registration's notification succeeded")
	}
	if err := a.Live(); err == nil || !strings.Contains(err.Error(), "no supported version") {
		t.Errorf("refused: Live() = %v, want the kubelet's reason", err)
	}
	if err := a.Ready(); err == nil {
		t.Error("refused: ready")
	}
	if ev := expectEventWithPrefix(t, recorder, "Warning "+agent.ReasonNotRegistered); !strings.Contains(ev, "no supported version") {
		t.Errorf("event %q, want the kubelet's reason", ev)
	}

	// Registered: ready and live, and the Node says so.
	if _, err := watcher.NotifyRegistrationStatus(callCtx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatalf("NotifyRegistrationStatus: %v", err)
	}
	if err := a.Ready(); err != nil {
		t.Errorf("registered: Ready() = %v", err)
	}
	if err := a.Live(); err != nil {
		t.Errorf("registered: Live() = %v", err)
	}
	if !a.Registered() {
		t.Error("Registered() false after the kubelet registered the plugin")
	}
	expectEventWithPrefix(t, recorder, "Normal "+agent.ReasonRegistered)

	// The kubelet's plugin directories wiped: the sockets are gone, the
	// kubelet deregisters the driver and would never call it again. Not
	// live, so that a restart creates them.
	if err := os.RemoveAll(opts.RegistrarDir); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(opts.RegistrarDir, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := a.Live(); err == nil || !strings.Contains(err.Error(), socket) {
		t.Errorf("registration socket removed: Live() = %v, want an error naming it", err)
	}
}

// TestPublishOnlyReadyWithoutKubelet: a publish-only agent (simulators,
// tests) needs no registration to be ready, and never warns about one.
func TestPublishOnlyReadyWithoutKubelet(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	recorder := events.NewFakeRecorder(10)
	opts := e.options(t)
	opts.RegistrationTimeout = time.Millisecond
	opts.Recorder = recorder
	a, err := agent.New(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Stop)
	time.Sleep(100 * time.Millisecond)
	if err := a.Ready(); err != nil {
		t.Errorf("Ready() = %v", err)
	}
	for _, ev := range drainEvents(recorder) {
		if strings.Contains(ev, agent.ReasonNotRegistered) {
			t.Errorf("publish-only agent warns: %q", ev)
		}
	}
}

// TestRegistrationEventsKeepTheirNotes: the warning that the kubelet has
// not registered the plugin and the one with the kubelet's reason for
// refusing it both reach the API server with their own notes (the events
// broadcaster would count the second as a repeat of the first, and keep
// the first note, if they had the same reason and action).
func TestRegistrationEventsKeepTheirNotes(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	broadcastEvents(ctx, t, e)
	base := socketDirs(t)
	opts := e.options(t)
	opts.PublishOnly = false
	opts.PluginDataDir = filepath.Join(base, "p")
	opts.RegistrarDir = filepath.Join(base, "r")
	opts.RegistrationTimeout = 100 * time.Millisecond
	a, err := agent.New(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Stop)
	waitForStoredEvent(ctx, t, e, agent.ReasonNotRegistered, "Node", "has not registered")
	watcher := pluginWatcher(t, filepath.Join(opts.RegistrarDir, topology.DriverName+"-reg.sock"))
	if _, err := watcher.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: false, Error: "no supported version"}); err == nil {
		t.Error("a refused registration's notification succeeded")
	}
	waitForStoredEvent(ctx, t, e, agent.ReasonNotRegistered, "Node", "refused", "no supported version")
}

// pluginWatcher connects to a registration socket as the kubelet's plugin
// watcher does.
func pluginWatcher(t *testing.T, socket string) registerapi.RegistrationClient {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return registerapi.NewRegistrationClient(conn)
}
