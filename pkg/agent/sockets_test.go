package agent_test

import (
	"net"
	"os"
	"path/filepath"
	"testing"

	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
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
