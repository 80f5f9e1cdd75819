package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/go-cmp/cmp"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	kubeletdra "k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/test/utils/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// kubeletWipingDelay is how long the kubelet waits after the last plugin
// of a driver has become unusable before it deletes the driver's slices
// of the node (the kubelet DRA manager's defaultWipingDelay).
const kubeletWipingDelay = 30 * time.Second

// TestAgentRollingUpdate replaces a node's agent as a DaemonSet rolling
// update with maxSurge does, each agent with its pod's UID: the new agent
// registers with the kubelet while the old one runs and is ready without
// the lock on the state directory; the kubelet's calls to it wait until
// the old agent has stopped; then it serves them with the old agent's
// checkpoint, and the node's slices are never written or wiped, not even
// after the kubelet's wiping delay. The old agent runs with its pod's UID,
// or without (an agent before rolling updates, replaced by the first
// rollout that sets POD_UID).
func TestAgentRollingUpdate(t *testing.T) {
	for name, oldUID := range map[string]types.UID{
		"old agent with its pod's UID":    "old-agent-pod",
		"old agent without its pod's UID": "",
	} {
		t.Run(name, func(t *testing.T) { testRollingUpdate(t, oldUID) })
	}
}

func testRollingUpdate(t *testing.T, oldUID types.UID) {
	tCtx := ktesting.Init(t)
	r := newRollingNode(tCtx, "rolling", "tu")
	e, nodeName, registryDir, cdiDir, manager, recorder := r.env, r.nodeName, r.registryDir, r.cdiDir, r.manager, r.recorder
	options := r.options
	newUID := types.UID("new-agent-pod")
	oldSocket := filepath.Join(registryDir, topology.DriverName+"-reg.sock")
	if oldUID != "" {
		oldSocket = filepath.Join(registryDir, kubeletplugin.RollingUpdateRegistrarSocketFile(registryDir, topology.DriverName, oldUID))
	}
	newSocket := filepath.Join(registryDir, kubeletplugin.RollingUpdateRegistrarSocketFile(registryDir, topology.DriverName, newUID))

	// 1. The old agent publishes; the kubelet prepares a pod through it.
	old, _ := startMockAgent(tCtx, nodeName, options(oldUID))
	defer func() { old.Stop() }()
	slice := waitForSlice(tCtx, t, cp.Client, topology.DriverName, nodeName, "8 devices", func(s *resourceapi.ResourceSlice) bool {
		return len(s.Spec.Devices) == 8
	})
	if _, err := os.Stat(oldSocket); err != nil {
		t.Fatalf("the old agent's registration socket: %v", err)
	}
	startTopodra(tCtx)
	template := e.template(1, nil)
	e.pod("before", topodraName, "rolling", template)
	before := e.waitScheduled("before")
	beforeIDs := kubeletPrepare(tCtx, manager, before)
	cdiWriter, err := cdi.New(cdiDir)
	tCtx.ExpectNoError(err)
	beforeSpec := cdiWriter.SpecPath(e.onlyClaim(before).UID)

	list, err := cp.Client.ResourceV1().ResourceSlices().List(tCtx, metav1.ListOptions{FieldSelector: nodeSliceSelector(nodeName)})
	tCtx.ExpectNoError(err)
	watcher, err := cp.Client.ResourceV1().ResourceSlices().Watch(tCtx, metav1.ListOptions{FieldSelector: nodeSliceSelector(nodeName), ResourceVersion: list.ResourceVersion})
	tCtx.ExpectNoError(err)
	defer watcher.Stop()

	// 2. The new agent starts beside it: its own sockets, registered by
	// the kubelet, ready, but not started while the old one holds the
	// lock.
	newOpts, _ := mockAgentOptions(tCtx, nodeName, options(newUID))
	replacement, err := agent.Start(tCtx, newOpts)
	tCtx.ExpectNoError(err, "start the new agent")
	defer replacement.Stop()
	var readyErr error
	if err := wait.PollUntilContextTimeout(tCtx, 50*time.Millisecond, waitTimeout, true, func(context.Context) (bool, error) {
		readyErr = replacement.Ready()
		return readyErr == nil, nil
	}); err != nil {
		t.Fatalf("the new agent is not ready while the old one runs (a rollout with maxSurge would stall): %v", readyErr)
	}
	for _, socket := range []string{oldSocket, newSocket} {
		if _, err := os.Stat(socket); err != nil {
			t.Errorf("registration socket while both agents run: %v", err)
		}
	}
	select {
	case <-replacement.Started():
		t.Fatal("the new agent started while the old one holds the lock on the state directory")
	default:
	}

	// 3. A pod scheduled now: its claim prepared through the new agent
	// directly waits until the new agent has started.
	e.pod("during", topodraName, "rolling", template)
	during := e.waitScheduled("during")
	duringClaim := e.onlyClaim(during)
	type answer struct {
		result kubeletplugin.PrepareResult
		err    error
		at     time.Time
	}
	direct := make(chan answer, 1)
	go func() {
		results, err := replacement.PrepareResourceClaims(tCtx, []*resourceapi.ResourceClaim{duringClaim})
		direct <- answer{result: results[duringClaim.UID], err: err, at: time.Now()}
	}()
	select {
	case a := <-direct:
		t.Fatalf("Prepare of the new agent answered before the old agent stopped: %+v", a)
	case <-time.After(time.Second):
	}

	// 4. The rollout stops the old agent.
	old.Stop()
	stopped := time.Now()
	select {
	case <-replacement.Started():
	case <-time.After(waitTimeout):
		t.Fatal("the new agent did not start after the old one stopped")
	}
	var got answer
	select {
	case got = <-direct:
	case <-time.After(waitTimeout):
		t.Fatal("the waiting Prepare did not answer after the new agent started")
	}
	tCtx.ExpectNoError(got.err, "prepare through the new agent")
	tCtx.ExpectNoError(got.result.Err, "prepare claim "+duringClaim.Name)
	if got.at.Before(stopped) {
		t.Errorf("the waiting Prepare answered %s before the old agent stopped", stopped.Sub(got.at))
	}
	t.Logf("the waiting Prepare answered %s after the old agent stopped", got.at.Sub(stopped).Round(time.Millisecond))
	if _, err := os.Stat(oldSocket); !os.IsNotExist(err) {
		t.Errorf("the old agent's registration socket is still there after it stopped: %v", err)
	}

	// 5. The kubelet reaches the new agent: it prepares the waiting pod
	// (the same devices as the direct call), unprepares the pod that the
	// old agent prepared, and prepares that pod again with the same ids.
	var directIDs []string
	for _, d := range got.result.Devices {
		directIDs = append(directIDs, d.CDIDeviceIDs...)
	}
	if diff := cmp.Diff(directIDs, kubeletPrepare(tCtx, manager, during)); diff != "" {
		t.Errorf("the kubelet's Prepare answers differently from the direct call (-direct +kubelet):\n%s", diff)
	}
	unprepareOnKubelet(tCtx, manager, before, beforeSpec)
	if diff := cmp.Diff(beforeIDs, kubeletPrepare(tCtx, manager, before)); diff != "" {
		t.Errorf("the pod prepared by the old agent gets other devices from the new one (-old +new):\n%s", diff)
	}

	// 6. Nothing was written to the node's slices, and the kubelet, which
	// always had a usable plugin of the driver, did not wipe them past its
	// wiping delay.
	deadline := time.After(time.Until(stopped.Add(kubeletWipingDelay + 3*time.Second)))
	var changes []string
watch:
	for {
		select {
		case ev, ok := <-watcher.ResultChan():
			if !ok {
				t.Fatalf("slice watch ended; changes so far: %v", changes)
			}
			if s, isSlice := ev.Object.(*resourceapi.ResourceSlice); isSlice {
				changes = append(changes, fmt.Sprintf("%s %s@%s", ev.Type, s.Name, s.ResourceVersion))
			} else {
				changes = append(changes, fmt.Sprintf("%s %T", ev.Type, ev.Object))
			}
		case <-deadline:
			break watch
		}
	}
	if len(changes) > 0 {
		t.Errorf("the node's slices changed during the rolling update: %v", changes)
	}
	slices, err := nodeSlices(tCtx, cp.Client, topology.DriverName, nodeName)
	tCtx.ExpectNoError(err)
	if len(slices) != 1 || slices[0].UID != slice.UID {
		t.Errorf("after the rolling update the node has %s, want the original slice %s", describeSlices(slices), slice.Name)
	}

	// 7. A wait shorter than the patience is not reported on the Node.
	for len(recorder.Events) > 0 {
		if ev := <-recorder.Events; strings.Contains(ev, agent.ReasonStateLocked) {
			t.Errorf("event during a rolling update that took %s: %s", time.Since(stopped), ev)
		}
	}
	e.expectClean()
}

// TestAgentRollingUpdateBadBuild: a new agent whose discovery fails on a
// node where the old agent's works (a bad build: here NVML cannot be
// initialized) does not register with the kubelet and stays unready, with
// a TopodraTakeOverBlocked Warning, so that a rollout stops at this node
// with the old agent serving: the kubelet prepares and unprepares a pod
// through it meanwhile and the node's slice stays. Once discovery works
// the new agent registers, is ready, and takes over when the old one
// stops, with the same slice.
func TestAgentRollingUpdateBadBuild(t *testing.T) {
	tCtx := ktesting.Init(t)
	r := newRollingNode(tCtx, "badbuild", "tb")
	e, nodeName, registryDir, cdiDir, manager, recorder := r.env, r.nodeName, r.registryDir, r.cdiDir, r.manager, r.recorder
	options := func(podUID types.UID) agent.Options {
		opts := r.options(podUID)
		opts.NoGPURetry = 100 * time.Millisecond
		return opts
	}
	newUID := types.UID("new-agent-pod")
	newSocket := filepath.Join(registryDir, kubeletplugin.RollingUpdateRegistrarSocketFile(registryDir, topology.DriverName, newUID))

	old, _ := startMockAgent(tCtx, nodeName, options("old-agent-pod"))
	defer func() { old.Stop() }()
	slice := waitForSlice(tCtx, t, cp.Client, topology.DriverName, nodeName, "8 devices", func(s *resourceapi.ResourceSlice) bool {
		return len(s.Spec.Devices) == 8
	})
	startTopodra(tCtx)
	template := e.template(1, nil)

	// The new agent's NVML cannot be initialized until fixed is set.
	newOpts, machine := mockAgentOptions(tCtx, nodeName, options(newUID))
	broken := machine.Library("")
	broken.Break()
	var fixed atomic.Bool
	newOpts.Discovery = discovery.NewLazy(func() (nvml.Interface, error) {
		if fixed.Load() {
			return machine.Library(""), nil
		}
		return broken, nil
	}, discovery.NVMLOptions{Sysfs: machine.Sysfs()})
	replacement, err := agent.Start(tCtx, newOpts)
	tCtx.ExpectNoError(err, "start the new agent")
	defer replacement.Stop()

	// 1. Not ready, not registered, and it says why.
	var readyErr error
	if err := wait.PollUntilContextTimeout(tCtx, 50*time.Millisecond, waitTimeout, true, func(context.Context) (bool, error) {
		readyErr = replacement.Ready()
		_, statErr := os.Stat(newSocket)
		return statErr == nil || (readyErr != nil && strings.Contains(readyErr.Error(), "NVML cannot be initialized")), nil
	}); err != nil {
		t.Fatalf("Ready() = %v, want an error naming NVML", readyErr)
	}
	if _, err := os.Stat(newSocket); !os.IsNotExist(err) {
		t.Fatalf("the new agent, whose discovery fails, started its registration socket: %v", err)
	}
	var warning string
	for warning == "" {
		select {
		case ev := <-recorder.Events:
			if strings.Contains(ev, agent.ReasonTakeOverBlocked) {
				warning = ev
			}
		case <-time.After(waitTimeout):
			t.Fatalf("no %s event", agent.ReasonTakeOverBlocked)
		}
	}
	if !strings.Contains(warning, "keeps serving") {
		t.Errorf("event %q does not say that the running agent keeps serving", warning)
	}

	// 2. The old agent serves: the kubelet prepares and unprepares through it.
	e.pod("during", topodraName, "badbuild", template)
	during := e.waitScheduled("during")
	kubeletPrepare(tCtx, manager, during)
	cdiWriter, err := cdi.New(cdiDir)
	tCtx.ExpectNoError(err)
	unprepareOnKubelet(tCtx, manager, during, cdiWriter.SpecPath(e.onlyClaim(during).UID))
	if err := replacement.Ready(); err == nil {
		t.Error("the new agent became ready while its discovery fails")
	}
	tCtx.ExpectNoError(old.Err(), "the old agent")

	// 3. Discovery works: the new agent registers, is ready and takes
	// over once the old one stops.
	fixed.Store(true)
	if err := wait.PollUntilContextTimeout(tCtx, 50*time.Millisecond, waitTimeout, true, func(context.Context) (bool, error) {
		readyErr = replacement.Ready()
		return readyErr == nil, nil
	}); err != nil {
		t.Fatalf("the new agent is not ready once its discovery works: %v", readyErr)
	}
	old.Stop()
	select {
	case <-replacement.Started():
	case <-replacement.Done():
		t.Fatalf("the new agent stopped: %v", replacement.Err())
	case <-time.After(waitTimeout):
		t.Fatal("the new agent did not start after the old one stopped")
	}
	kubeletPrepare(tCtx, manager, during)
	slices, err := nodeSlices(tCtx, cp.Client, topology.DriverName, nodeName)
	tCtx.ExpectNoError(err)
	if len(slices) != 1 || slices[0].UID != slice.UID {
		t.Errorf("after the rolling update the node has %s, want the original slice %s", describeSlices(slices), slice.Name)
	}
	e.expectClean()
}

// mockAgentOptions returns opts for an agent of nodeName on a mock DGX
// H100, with the node name, the client and the discovery filled in (see
// startMockAgent).
func mockAgentOptions(tCtx ktesting.TContext, nodeName string, opts agent.Options) (agent.Options, *mockgpu.Machine) {
	tCtx.Helper()
	machine, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: nodeName})
	tCtx.ExpectNoError(err)
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: machine.NVML(), Sysfs: machine.Sysfs()})
	tCtx.ExpectNoError(err)
	opts.NodeName, opts.KubeClient, opts.Discovery = nodeName, cp.Client, disc
	return opts, machine
}

// rollingNode is a node for a rolling update of its agent: a Node of its
// own group, the kubelet's DRA manager on its registration directory, and
// the directories and event recorder its agents share.
type rollingNode struct {
	env                                                    *env
	nodeName                                               string
	pluginDir, registryDir, kubeletState, stateDir, cdiDir string
	manager                                                *kubeletdra.Manager
	recorder                                               *events.FakeRecorder
}

// newRollingNode sets up a rollingNode in a namespace of group; prefix
// keeps its directories' paths short (socket paths are limited).
func newRollingNode(tCtx ktesting.TContext, group, prefix string) *rollingNode {
	e := newEnv(tCtx, group)
	r := &rollingNode{env: e, nodeName: e.ns + "-node", recorder: events.NewFakeRecorder(100)}
	_, err := framework.CreateReadyNode(tCtx, cp.Client, r.nodeName, map[string]string{"test": e.ns, "group": group})
	tCtx.ExpectNoError(err)
	dirs := shortDirs(tCtx, prefix, "p", "r", "k", "s", "c")
	r.pluginDir, r.registryDir, r.kubeletState, r.stateDir, r.cdiDir = dirs[0], dirs[1], dirs[2], dirs[3], dirs[4]
	r.manager = startKubeletDRA(tCtx, r.nodeName, r.registryDir, r.kubeletState)
	return r
}

// options are the options of an agent of the node in the pod with podUID.
func (r *rollingNode) options(podUID types.UID) agent.Options {
	opts := kubeletAgentOptions(r.pluginDir, r.registryDir, r.stateDir, r.cdiDir)
	opts.RollingUpdateUID, opts.Recorder = podUID, r.recorder
	return opts
}
