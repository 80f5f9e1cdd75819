package agent

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent/discovery"
)

// blockedDiscovery hangs in Discover until release is closed, as NVML can.
type blockedDiscovery struct {
	entered chan struct{}
	once    sync.Once
	release chan struct{}
}

func (d *blockedDiscovery) Discover(ctx context.Context) (*discovery.Inventory, error) {
	d.once.Do(func() { close(d.entered) })
	select {
	case <-d.release:
		return &discovery.Inventory{}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// TestStartHangsNotLive: while the agent starts it is live and says in
// Ready what it does; waiting for another agent's lock keeps it live for
// as long as that takes, a step that hangs longer than maxStartStep
// (discovery) makes it not live, so that its liveness probe restarts it.
func TestStartHangsNotLive(t *testing.T) {
	defer func(d time.Duration) { maxStartStep = d }(maxStartStep)
	maxStartStep = 100 * time.Millisecond
	_, ctx := ktesting.NewTestContext(t)
	stateDir := t.TempDir()

	// Another agent holds the lock.
	lock, err := os.OpenFile(filepath.Join(stateDir, LockFileName), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Close() }()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	disc := &blockedDiscovery{entered: make(chan struct{}), release: make(chan struct{})}
	release := sync.OnceFunc(func() { close(disc.release) })
	defer release()
	a, err := Start(ctx, Options{
		NodeName:       "node-1",
		KubeClient:     fake.NewClientset(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1", UID: "node-uid"}}),
		Discovery:      disc,
		PublishOnly:    true,
		StateDir:       stateDir,
		CDIDir:         t.TempDir(),
		RescanInterval: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Stop()

	time.Sleep(5 * maxStartStep)
	if err := a.Live(); err != nil {
		t.Errorf("not live while it waits for another agent's lock: %v", err)
	}
	if err := a.Ready(); err == nil || !strings.Contains(err.Error(), "waiting for the lock") {
		t.Errorf("Ready() = %v, want it to say that it waits for the lock", err)
	}

	_ = lock.Close() // releases the lock
	select {
	case <-disc.entered:
	case <-time.After(30 * time.Second):
		t.Fatal("discovery did not start after the lock was released")
	}
	if err := a.Live(); err != nil {
		t.Errorf("not live as discovery begins: %v", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for a.Live() == nil && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if err := a.Live(); err == nil || !strings.Contains(err.Error(), "discovering GPUs") {
		t.Errorf("Live() = %v with discovery hanging longer than %s, want an error naming discovery", err, maxStartStep)
	}

	release()
	select {
	case <-a.Started():
	case <-a.Done():
		t.Fatalf("stopped: %v", a.Err())
	case <-time.After(30 * time.Second):
		t.Fatal("did not start after discovery returned")
	}
	if err := a.Live(); err != nil {
		t.Errorf("not live once started: %v", err)
	}
	if err := a.Ready(); err != nil {
		t.Errorf("not ready once started: %v", err)
	}
}
