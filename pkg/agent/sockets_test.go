package agent_test

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/checkpoint"
	"github.com/topodra/topodra/pkg/topology"
)

// TestStaleSocketsRemoved: an agent with its pod's UID removes, once it
// holds the state directory, the driver's kubelet sockets that refuse
// connections (left by an agent pod killed before it could remove them),
// and leaves alone its own, one that a process serves, another driver's
// and a file that is not a socket.
func TestStaleSocketsRemoved(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	base := socketDirs(t)
	registry, plugins := filepath.Join(base, "r"), filepath.Join(base, "p")
	// stale leaves a socket file that nothing listens on.
	stale := func(path string) {
		l, err := net.Listen("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		l.(*net.UnixListener).SetUnlinkOnClose(false)
		_ = l.Close()
	}
	driver := topology.DriverName
	gone := []string{
		filepath.Join(registry, kubeletplugin.RollingUpdateRegistrarSocketFile(registry, driver, "killed-pod")),
		filepath.Join(registry, driver+"-reg.sock"),
		filepath.Join(plugins, "dra-killed-pod.sock"),
		filepath.Join(plugins, "dra.sock"),
	}
	for _, path := range gone {
		stale(path)
	}
	foreign := filepath.Join(registry, "other.example.com-killed-pod-reg.sock")
	stale(foreign)
	served := filepath.Join(registry, kubeletplugin.RollingUpdateRegistrarSocketFile(registry, driver, "running-pod"))
	l, err := net.Listen("unix", served)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	notSocket := filepath.Join(registry, driver+"-file-reg.sock")
	if err := os.WriteFile(notSocket, nil, 0o600); err != nil {
		t.Fatal(err)
	}

	opts := e.options(t)
	opts.PublishOnly = false
	opts.PluginDataDir, opts.RegistrarDir = plugins, registry
	opts.RollingUpdateUID = "this-pod"
	a, err := agent.New(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Stop()
	for _, path := range gone {
		if _, err := os.Lstat(path); !os.IsNotExist(err) {
			t.Errorf("stale socket %s not removed: %v", path, err)
		}
	}
	// No kubelet here: not ready, naming the pod's own socket.
	own := filepath.Join(registry, kubeletplugin.RollingUpdateRegistrarSocketFile(registry, driver, "this-pod"))
	if err := a.Ready(); err == nil || !strings.Contains(err.Error(), own) {
		t.Errorf("Ready() = %v, want an error naming the registration socket %s", err, own)
	}
	for _, path := range []string{
		foreign, served, notSocket,
		filepath.Join(registry, kubeletplugin.RollingUpdateRegistrarSocketFile(registry, driver, "this-pod")),
		filepath.Join(plugins, "dra-this-pod.sock"),
	} {
		if _, err := os.Lstat(path); err != nil {
			t.Errorf("%s: %v", path, err)
		}
	}
}

// TestLongSocketPaths: where the pod's UID makes the DRA socket's path
// too long for a unix socket, the socket is named by a hash of the UID
// instead (and the agent starts); where even dra.sock does not fit, Start
// fails naming the path, rather than with the helper's "bind: invalid
// argument".
func TestLongSocketPaths(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	base := socketDirs(t)
	// dir: a directory whose path has length n.
	dir := func(n int) string {
		path := filepath.Join(base, "p")
		path += "/" + strings.Repeat("x", n-len(path)-1)
		if err := os.MkdirAll(path, 0o750); err != nil {
			t.Fatal(err)
		}
		return path
	}
	uid := "f4b3c2a1-0d9e-4f8a-b7c6-d5e4f3a2b1c0"
	opts := e.options(t)
	opts.PublishOnly = false
	opts.PluginDataDir, opts.RegistrarDir = dir(80), filepath.Join(base, "r")
	opts.RollingUpdateUID = types.UID(uid)
	a, err := agent.New(ctx, opts)
	if err != nil {
		t.Fatalf("agent with a long plugin data directory: %v", err)
	}
	defer a.Stop()
	entries, err := os.ReadDir(opts.PluginDataDir)
	if err != nil {
		t.Fatal(err)
	}
	var sockets []string
	for _, entry := range entries {
		if entry.Type()&os.ModeSocket != 0 {
			sockets = append(sockets, entry.Name())
		}
	}
	if len(sockets) != 1 || strings.Contains(sockets[0], uid) || len(filepath.Join(opts.PluginDataDir, sockets[0])) > 107 {
		t.Errorf("DRA sockets %q in a directory of %d bytes, want one named without the UID that fits", sockets, len(opts.PluginDataDir))
	}

	opts = e.options(t)
	opts.PublishOnly = false
	opts.PluginDataDir, opts.RegistrarDir = dir(104), filepath.Join(base, "r")
	if a, err := agent.Start(ctx, opts); err == nil {
		a.Stop()
		t.Error("agent started where its DRA socket cannot be created")
	} else if !errors.Is(err, agent.ErrSocketPath) || !strings.Contains(err.Error(), opts.PluginDataDir) {
		t.Errorf("error %v, want ErrSocketPath naming the directory", err)
	}
}

// TestNoTakeOverWithoutState: an agent with its pod's UID that cannot read
// the checkpoint the running agent left (a rollback to a build that
// cannot read a newer one), or cannot write CDI specs, fails to start
// before it registers with the kubelet: the kubelet keeps calling the
// running agent, and the rollout stops at this node's unready pod.
func TestNoTakeOverWithoutState(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	options, registry := rollingOptions(t, e)
	running, err := agent.New(ctx, options("running-pod"))
	if err != nil {
		t.Fatal(err)
	}
	defer running.Stop()
	socket := func(uid types.UID) string {
		return filepath.Join(registry, kubeletplugin.RollingUpdateRegistrarSocketFile(registry, topology.DriverName, uid))
	}

	// A CDI directory that cannot be written.
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	opts := options("no-cdi-pod")
	opts.CDIDir = file
	if a, err := agent.Start(ctx, opts); err == nil {
		a.Stop()
		t.Error("an agent that cannot write CDI specs started")
	} else if !errors.Is(err, agent.ErrCDIDir) {
		t.Errorf("error %v, want ErrCDIDir", err)
	}
	if _, err := os.Lstat(socket("no-cdi-pod")); !os.IsNotExist(err) {
		t.Errorf("registration socket of the agent that cannot write CDI specs: %v", err)
	}

	// A checkpoint written by a newer agent.
	if err := os.WriteFile(filepath.Join(e.stateDir, checkpoint.FileName), []byte(`{"version":"v99","checksum":0,"data":{}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	recorder := events.NewFakeRecorder(10)
	opts = options("rolled-back-pod")
	opts.Recorder = recorder
	if a, err := agent.Start(ctx, opts); err == nil {
		a.Stop()
		t.Fatal("an agent that cannot read the checkpoint started")
	} else if !errors.Is(err, agent.ErrCheckpoint) {
		t.Errorf("error %v, want ErrCheckpoint", err)
	}
	if ev := expectEvent(t, recorder); !strings.Contains(ev, "Warning "+agent.ReasonCheckpointUnreadable) || !strings.Contains(ev, "does not take over") {
		t.Errorf("event %q, want a %s warning that it does not take over", ev, agent.ReasonCheckpointUnreadable)
	}
	if _, err := os.Lstat(socket("rolled-back-pod")); !os.IsNotExist(err) {
		t.Errorf("registration socket of the agent that cannot read the checkpoint: %v", err)
	}
	if _, err := os.Lstat(socket("running-pod")); err != nil {
		t.Errorf("the running agent's registration socket: %v", err)
	}
	if err := running.Err(); err != nil {
		t.Errorf("the running agent stopped: %v", err)
	}
}

// rollingOptions returns the options of e's agents in the pod with a UID,
// serving the kubelet through sockets in the registration directory it
// returns (short paths, for socket names), as in a rolling update.
func rollingOptions(t *testing.T, e *env) (options func(uid types.UID) agent.Options, registry string) {
	base := socketDirs(t)
	registry, plugins := filepath.Join(base, "r"), filepath.Join(base, "p")
	return func(uid types.UID) agent.Options {
		opts := e.options(t)
		opts.PublishOnly = false
		opts.PluginDataDir, opts.RegistrarDir = plugins, registry
		opts.RollingUpdateUID = uid
		return opts
	}, registry
}
