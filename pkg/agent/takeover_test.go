package agent_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2/ktesting"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/topology"
)

// hangingDiscovery hangs in Discover, ignoring its context as NVML does,
// while hang is set.
type hangingDiscovery struct {
	discovery.Interface
	hang    atomic.Bool
	release chan struct{}
}

func (d *hangingDiscovery) Discover(ctx context.Context) (*discovery.Inventory, error) {
	if d.hang.Load() {
		<-d.release
	}
	return d.Interface.Discover(ctx)
}

// TestTakeOverWaitsForWorkingDiscovery: in a rolling update, a new agent
// whose discovery fails, hangs or leaves out GPUs that the running agent
// publishes (a bad build) does not register with the kubelet: it stays
// unready with a TopodraTakeOverBlocked Warning naming the cause, the
// running agent keeps its sockets and its slice, and once discovery works
// the new agent registers, is ready, and takes over when the running one
// stops. Where the running agent publishes nothing usable (a node without
// GPUs or driver, NVML broken for it too) or no agent runs, a failing
// discovery does not hold the new agent back.
func TestTakeOverWaitsForWorkingDiscovery(t *testing.T) {
	agent.SetTakeOverDiscoveryTimeout(t, 200*time.Millisecond)
	// A broken NVML: the library is there and cannot be initialized.
	brokenNVML := func(e *env, fixed *atomic.Bool) discovery.Interface {
		broken := e.machine.Library("")
		broken.Break()
		return discovery.NewLazy(func() (nvml.Interface, error) {
			if fixed.Load() {
				return e.machine.Library(""), nil
			}
			return broken, nil
		}, discovery.NVMLOptions{Sysfs: e.machine.Sysfs()})
	}
	// No NVML library: discovery.ErrNoGPU.
	noLibrary := func(e *env, fixed *atomic.Bool) discovery.Interface {
		return discovery.NewLazy(func() (nvml.Interface, error) {
			if fixed.Load() {
				return e.machine.Library(""), nil
			}
			return nil, fmt.Errorf("%w: libnvidia-ml.so.1 not found in driver root /driver-root", discovery.ErrNoGPU)
		}, discovery.NVMLOptions{Sysfs: e.machine.Sysfs()})
	}
	type testcase struct {
		// running starts the running agent with opts (nil: none runs).
		running func(ctx context.Context, t *testing.T, e *env, opts agent.Options) *agent.Agent
		// published is what the running agent publishes (see
		// sliceDevices).
		published string
		// replacement returns the new agent's discovery and what makes
		// it work.
		replacement func(e *env) (discovery.Interface, func())
		// blocked is what the warning names where the new agent must
		// not take over; empty: it takes over.
		blocked string
	}
	working := func(ctx context.Context, t *testing.T, e *env, opts agent.Options) *agent.Agent {
		return startWith(ctx, t, opts)
	}
	breakable := func(broken func(*env, *atomic.Bool) discovery.Interface) func(*env) (discovery.Interface, func()) {
		return func(e *env) (discovery.Interface, func()) {
			var fixed atomic.Bool
			return broken(e, &fixed), func() { fixed.Store(true) }
		}
	}
	eight := func(taints ...string) string {
		var out []string
		for i := range 8 {
			out = append(out, fmt.Sprintf("gpu-%d%v", i, taints))
		}
		return strings.Join(out, " ")
	}
	testcases := map[string]testcase{
		"NVML cannot be initialized": {
			running:     working,
			published:   eight(),
			replacement: breakable(brokenNVML),
			blocked:     "discovery fails: NVML cannot be initialized",
		},
		"no NVML library": {
			running:     working,
			published:   eight(),
			replacement: breakable(noLibrary),
			blocked:     "discovery finds no GPU",
		},
		"a GPU left out": {
			running:   working,
			published: eight(),
			replacement: func(e *env) (discovery.Interface, func()) {
				e.machine.FailUUID(3, nvml.ERROR_UNKNOWN)
				disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: e.machine.NVML(), Sysfs: e.machine.Sysfs()})
				if err != nil {
					panic(err)
				}
				return disc, func() { e.machine.FailUUID(3, nvml.SUCCESS) }
			},
			blocked: "would not publish 1 of the 8 devices that the running agent publishes (gpu-3)",
		},
		"discovery hangs": {
			running:   working,
			published: eight(),
			replacement: func(e *env) (discovery.Interface, func()) {
				disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: e.machine.NVML(), Sysfs: e.machine.Sysfs()})
				if err != nil {
					panic(err)
				}
				d := &hangingDiscovery{Interface: disc, release: make(chan struct{})}
				d.hang.Store(true)
				return d, sync.OnceFunc(func() { d.hang.Store(false); close(d.release) })
			},
			blocked: "has not returned within",
		},
		"node without GPUs": {
			running: func(ctx context.Context, t *testing.T, e *env, opts agent.Options) *agent.Agent {
				opts.Discovery = noLibrary(e, new(atomic.Bool))
				return startWith(ctx, t, opts)
			},
			replacement: breakable(noLibrary),
		},
		"NVML broken for the running agent too": {
			running: func(ctx context.Context, t *testing.T, e *env, opts agent.Options) *agent.Agent {
				// Published by an agent before, tainted by the running one.
				startWith(ctx, t, e.options(t)).Stop()
				opts.Discovery = brokenNVML(e, new(atomic.Bool))
				a := startWith(ctx, t, opts)
				if a.NVMLUnusable() == nil {
					t.Fatal("the running agent can use the broken NVML")
				}
				return a
			},
			published:   eight(agent.NVMLUnusableTaintKey),
			replacement: breakable(brokenNVML),
		},
		"no running agent": {
			replacement: breakable(brokenNVML),
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			e := newEnv(t)
			rolling, registry := rollingOptions(t, e)
			options := func(uid types.UID) agent.Options {
				opts := rolling(uid)
				opts.NoGPURetry = 10 * time.Millisecond
				return opts
			}
			socket := func(uid types.UID) string {
				return filepath.Join(registry, kubeletplugin.RollingUpdateRegistrarSocketFile(registry, topology.DriverName, uid))
			}
			var running *agent.Agent
			if tc.running != nil {
				running = tc.running(ctx, t, e, options("running-pod"))
			}
			var before string
			if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
				before = e.sliceDevices(ctx, t)
				return before == tc.published, nil
			}); err != nil {
				t.Fatalf("the running agent publishes %q, want %q", before, tc.published)
			}

			disc, fix := tc.replacement(e)
			t.Cleanup(fix)
			recorder := events.NewFakeRecorder(100)
			opts := options("new-pod")
			opts.Discovery, opts.Recorder = disc, recorder
			replacement, err := agent.Start(ctx, opts)
			if err != nil {
				t.Fatalf("start the new agent: %v", err)
			}
			t.Cleanup(replacement.Stop)

			if tc.blocked != "" {
				// Until it says why it waits, or has registered after all.
				if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
					_, err := os.Lstat(socket("new-pod"))
					ready := replacement.Ready()
					return err == nil || (ready != nil && strings.Contains(ready.Error(), tc.blocked)), nil
				}); err != nil {
					t.Fatalf("Ready() = %v, want an error saying %q", replacement.Ready(), tc.blocked)
				}
				if _, err := os.Lstat(socket("new-pod")); !os.IsNotExist(err) {
					t.Fatalf("registration socket of the agent that does not take over: %v", err)
				}
				if err := replacement.Ready(); err == nil || !strings.Contains(err.Error(), "take over") {
					t.Errorf("Ready() = %v, want an error saying that it does not take over", err)
				}
				if err := replacement.Live(); err != nil {
					t.Errorf("Live() = %v while it waits to take over", err)
				}
				ev := expectEventWithPrefix(t, recorder, "Warning "+agent.ReasonTakeOverBlocked)
				if !strings.Contains(ev, tc.blocked) {
					t.Errorf("event %q does not say %q", ev, tc.blocked)
				}
				if err := running.Err(); err != nil {
					t.Errorf("the running agent stopped: %v", err)
				}
				if _, err := os.Lstat(socket("running-pod")); err != nil {
					t.Errorf("the running agent's registration socket: %v", err)
				}
				if after := e.sliceDevices(ctx, t); after != before {
					t.Errorf("published devices while the new agent waits: %s, before %s", after, before)
				}
				select {
				case <-replacement.Started():
					t.Fatal("the new agent started")
				default:
				}
				fix()
			}

			// It registers and becomes ready.
			if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
				_, err := os.Lstat(socket("new-pod"))
				return err == nil, nil
			}); err != nil {
				t.Fatalf("the new agent did not start its registration socket: %v; Ready() = %v", err, replacement.Ready())
			}
			watcher := pluginWatcher(t, socket("new-pod"))
			if _, err := watcher.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
				t.Fatalf("NotifyRegistrationStatus: %v", err)
			}
			if err := replacement.Ready(); err != nil {
				t.Errorf("registered: Ready() = %v", err)
			}

			// It takes over once the running agent stops.
			if running != nil {
				running.Stop()
			}
			select {
			case <-replacement.Started():
			case <-replacement.Done():
				t.Fatalf("the new agent stopped: %v", replacement.Err())
			case <-time.After(30 * time.Second):
				t.Fatal("the new agent did not start")
			}
		})
	}
}

// sliceDevices describes the devices of the node's published slices,
// with their taints.
func (e *env) sliceDevices(ctx context.Context, t *testing.T) string {
	t.Helper()
	list, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, s := range list.Items {
		for _, d := range s.Spec.Devices {
			var taints []string
			for _, taint := range d.Taints {
				taints = append(taints, taint.Key)
			}
			out = append(out, d.Name+fmt.Sprint(taints))
		}
	}
	return strings.Join(out, " ")
}
