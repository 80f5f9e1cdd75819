package agent_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/google/go-cmp/cmp"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/checkpoint"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/topology"
)

const nodeName = "node-1"

type env struct {
	machine  *mockgpu.Machine
	stateDir string
	cdiDir   string
	client   *fake.Clientset
	// devRoot holds /dev/nvidia0..7 and /dev/nvidiactl as character
	// devices (no nvidia-uvm) when devNodes is true.
	devRoot  string
	devNodes bool
	// bootIDFile stands for /proc/sys/kernel/random/boot_id.
	bootIDFile string
	// recorder, if set, receives the agent's events.
	recorder events.EventRecorder
	// devicePlugin is Options.DevicePluginResources.
	devicePlugin []string
	// otherDriverCheck is Options.OtherDriverCheck.
	otherDriverCheck bool
	// generator is Options.CDIGenerator; default: cdi.Static on devRoot.
	generator cdi.Generator
	// staleClaimGrace is Options.StaleClaimGrace.
	staleClaimGrace time.Duration
	// ownedTaint is Options.OwnedTaint.
	ownedTaint bool
	// rescanInterval is Options.RescanInterval; zero: no rescans.
	rescanInterval time.Duration
	// toolkitConfig is Options.ToolkitConfig.
	toolkitConfig string
	// kubelet serves the PodResources API at Options.PodResourcesSocket.
	kubelet *fakeKubelet
}

// fakeDevRoot makes a tree with the device nodes of an 8-GPU machine whose
// nvidia-uvm module is not loaded. Creating device nodes needs CAP_MKNOD;
// without it the tree stays empty and ok is false.
func fakeDevRoot(t *testing.T) (string, bool) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "dev"), 0o755); err != nil {
		t.Fatal(err)
	}
	nodes := map[string]int{"nvidiactl": 255}
	for i := range 8 {
		nodes[fmt.Sprintf("nvidia%d", i)] = i
	}
	for name, minor := range nodes {
		if err := unix.Mknod(filepath.Join(root, "dev", name), unix.S_IFCHR|0o666, int(unix.Mkdev(195, uint32(minor)))); err != nil {
			t.Logf("cannot create device nodes (%v): testing CDI specs without them", err)
			return root, false
		}
	}
	return root, true
}

func newEnv(t *testing.T) *env {
	m, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: nodeName})
	if err != nil {
		t.Fatal(err)
	}
	devRoot, devNodes := fakeDevRoot(t)
	bootID := filepath.Join(t.TempDir(), "boot_id")
	if err := os.WriteFile(bootID, []byte("boot-1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return &env{
		machine:    m,
		stateDir:   t.TempDir(),
		cdiDir:     t.TempDir(),
		client:     fake.NewClientset(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName, UID: "node-uid"}}),
		devRoot:    devRoot,
		devNodes:   devNodes,
		bootIDFile: bootID,
		kubelet:    startFakeKubelet(t),
	}
}

// start runs a publish-only agent with state, as after a (re)start.
func (e *env) start(ctx context.Context, t *testing.T) *agent.Agent {
	t.Helper()
	return startWith(ctx, t, e.options(t))
}

// startWith runs an agent with opts until the test ends.
func startWith(ctx context.Context, t *testing.T, opts agent.Options) *agent.Agent {
	t.Helper()
	a, err := agent.New(ctx, opts)
	if err != nil {
		t.Fatalf("start agent: %v", err)
	}
	t.Cleanup(a.Stop)
	return a
}

// options are the Options that start uses.
func (e *env) options(t *testing.T) agent.Options {
	t.Helper()
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: e.machine.NVML(), Sysfs: e.machine.Sysfs()})
	if err != nil {
		t.Fatal(err)
	}
	var generator cdi.Generator = cdi.Static{DevRoot: e.devRoot}
	if e.generator != nil {
		generator = e.generator
	}
	rescan := time.Duration(-1)
	if e.rescanInterval != 0 {
		rescan = e.rescanInterval
	}
	return agent.Options{
		NodeName:       nodeName,
		KubeClient:     e.client,
		Discovery:      disc,
		PublishOnly:    true,
		StateDir:       e.stateDir,
		CDIDir:         e.cdiDir,
		CDIGenerator:   generator,
		BootIDPath:     e.bootIDFile,
		RescanInterval: rescan,
		Recorder:       e.recorder,

		DevicePluginResources: e.devicePlugin,
		OtherDriverCheck:      e.otherDriverCheck,
		StaleClaimGrace:       e.staleClaimGrace,
		OwnedTaint:            e.ownedTaint,
		ToolkitConfig:         e.toolkitConfig,
		PodResourcesSocket:    e.kubelet.socket,
	}
}

type alloc struct {
	request, device string
	pool, driver    string
	admin           bool
}

func claim(name string, allocs ...alloc) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, UID: types.UID("uid-" + name)},
		Status: resourceapi.ResourceClaimStatus{
			Allocation: &resourceapi.AllocationResult{},
		},
	}
	for _, a := range allocs {
		r := resourceapi.DeviceRequestAllocationResult{
			Request: a.request, Driver: topology.DriverName, Pool: nodeName, Device: a.device,
		}
		if a.driver != "" {
			r.Driver = a.driver
		}
		if a.pool != "" {
			r.Pool = a.pool
		}
		if a.admin {
			r.AdminAccess = ptr.To(true)
		}
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results, r)
		if !slices.ContainsFunc(c.Spec.Devices.Requests, func(req resourceapi.DeviceRequest) bool { return req.Name == a.request }) {
			c.Spec.Devices.Requests = append(c.Spec.Devices.Requests, resourceapi.DeviceRequest{
				Name: a.request, Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.topodra.io", AdminAccess: ptr.To(a.admin)},
			})
		}
	}
	return c
}

func gpus(request string, devices ...string) []alloc {
	var out []alloc
	for _, d := range devices {
		out = append(out, alloc{request: request, device: d})
	}
	return out
}

func ref(c *resourceapi.ResourceClaim) kubeletplugin.NamespacedObject {
	return kubeletplugin.NamespacedObject{NamespacedName: types.NamespacedName{Namespace: c.Namespace, Name: c.Name}, UID: c.UID}
}

func readSpec(t *testing.T, e *env, uid types.UID) *cdispec.Spec {
	t.Helper()
	w, err := cdi.New(e.cdiDir)
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(w.SpecPath(uid))
	if err != nil {
		t.Fatalf("read CDI spec: %v", err)
	}
	var spec cdispec.Spec
	if err := json.Unmarshal(data, &spec); err != nil {
		t.Fatal(err)
	}
	return &spec
}

func TestPrepareWritesCDISpec(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	a := e.start(ctx, t)
	c := claim("train", append(gpus("gpus", "gpu-0", "gpu-3"), alloc{request: "nic", device: "nic-0", driver: mockgpu.NICDriverName})...)

	result, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{c})
	if err != nil {
		t.Fatal(err)
	}
	want := kubeletplugin.PrepareResult{Devices: []kubeletplugin.Device{
		{Requests: []string{"gpus"}, PoolName: nodeName, DeviceName: "gpu-0", CDIDeviceIDs: []string{"gpu.topodra.io/gpu=uid-train-gpu-0"}},
		{Requests: []string{"gpus"}, PoolName: nodeName, DeviceName: "gpu-3", CDIDeviceIDs: []string{"gpu.topodra.io/gpu=uid-train-gpu-3"}},
	}}
	if diff := cmp.Diff(map[types.UID]kubeletplugin.PrepareResult{c.UID: want}, result); diff != "" {
		t.Errorf("result (-want +got):\n%s", diff)
	}

	// Device nodes that exist are listed, nvidia-uvm (module not loaded)
	// is not.
	nodes := func(paths ...string) []*cdispec.DeviceNode {
		if !e.devNodes {
			return nil
		}
		var out []*cdispec.DeviceNode
		for _, p := range paths {
			out = append(out, &cdispec.DeviceNode{Path: p})
		}
		return out
	}
	wantSpec := &cdispec.Spec{
		Version: readSpec(t, e, c.UID).Version,
		Kind:    "gpu.topodra.io/gpu",
		Devices: []cdispec.Device{
			{Name: "uid-train-gpu-0", ContainerEdits: cdispec.ContainerEdits{Env: []string{"TOPODRA_GPU_0=" + e.machine.UUID(0)}, DeviceNodes: nodes("/dev/nvidia0")}},
			{Name: "uid-train-gpu-3", ContainerEdits: cdispec.ContainerEdits{Env: []string{"TOPODRA_GPU_3=" + e.machine.UUID(3)}, DeviceNodes: nodes("/dev/nvidia3")}},
		},
		ContainerEdits: cdispec.ContainerEdits{
			Env:         []string{"NVIDIA_VISIBLE_DEVICES=" + e.machine.UUID(0) + "," + e.machine.UUID(3)},
			DeviceNodes: nodes("/dev/nvidiactl"),
		},
	}
	if wantSpec.Version == "" {
		t.Error("CDI spec has no cdiVersion")
	}
	if diff := cmp.Diff(wantSpec, readSpec(t, e, c.UID)); diff != "" {
		t.Errorf("CDI spec (-want +got):\n%s", diff)
	}
}

// switchedGenerator fails while fail is set, and otherwise asks Generator.
type switchedGenerator struct {
	cdi.Generator
	fail atomic.Bool
}

func (g *switchedGenerator) CommonEdits() (cdispec.ContainerEdits, error) {
	if g.fail.Load() {
		return cdispec.ContainerEdits{}, errors.New("generator broken")
	}
	return g.Generator.CommonEdits()
}

// TestPrepareRegeneratesCDISpec prepares a claim that is already prepared,
// as the kubelet does after it restarted: the claim's spec is generated
// again, so that a device node that appeared since (nvidia-uvm, created
// when the module is loaded) gets in, and the checkpoint stays as it was.
// A spec that comes out the same is not rewritten, also after an agent
// restart; where generating fails, the spec written before stays and the
// claim stays prepared.
func TestPrepareRegeneratesCDISpec(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	gen := &switchedGenerator{Generator: cdi.Static{DevRoot: e.devRoot}}
	e.generator = gen
	a := e.start(ctx, t)
	c := claim("train", gpus("gpus", "gpu-0")...)
	prepare := func(step string) kubeletplugin.PrepareResult {
		t.Helper()
		result, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{c})
		if err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		if result[c.UID].Err != nil {
			t.Fatalf("%s: %v", step, result[c.UID].Err)
		}
		return result[c.UID]
	}
	w, err := cdi.New(e.cdiDir)
	if err != nil {
		t.Fatal(err)
	}
	checkpointPath := filepath.Join(e.stateDir, checkpoint.FileName)
	stat := func(path string) (time.Time, []byte) {
		t.Helper()
		info, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		return info.ModTime(), data
	}
	hasNode := func(path string) bool {
		for _, n := range readSpec(t, e, c.UID).ContainerEdits.DeviceNodes {
			if n.Path == path {
				return true
			}
		}
		return false
	}
	// Modification times of files written within one clock tick compare
	// equal; set the first ones back so that every rewrite shows.
	past := time.Now().Add(-time.Hour).Truncate(time.Second)

	first := prepare("first prepare")
	if hasNode("/dev/nvidia-uvm") {
		t.Fatal("spec lists /dev/nvidia-uvm, which does not exist yet")
	}
	for _, p := range []string{checkpointPath, w.SpecPath(c.UID)} {
		if err := os.Chtimes(p, past, past); err != nil {
			t.Fatal(err)
		}
	}
	checkpointTime, checkpointData := stat(checkpointPath)

	// Nothing changed: nothing is rewritten, also by a restarted agent.
	prepare("unchanged")
	a.Stop()
	a = e.start(ctx, t)
	prepare("unchanged after a restart")
	if mtime, _ := stat(w.SpecPath(c.UID)); !mtime.Equal(past) {
		t.Errorf("unchanged CDI spec rewritten (modified %s)", mtime)
	}

	// 0:0 is the character device that any process may create.
	if err := unix.Mknod(filepath.Join(e.devRoot, "dev", "nvidia-uvm"), unix.S_IFCHR|0o666, 0); err != nil {
		t.Fatal(err)
	}
	again := prepare("after nvidia-uvm appeared")
	if diff := cmp.Diff(first, again); diff != "" {
		t.Errorf("result changed (-first +again):\n%s", diff)
	}
	if !hasNode("/dev/nvidia-uvm") {
		t.Error("spec not regenerated: /dev/nvidia-uvm missing")
	}
	if mtime, data := stat(checkpointPath); !mtime.Equal(checkpointTime) || string(data) != string(checkpointData) {
		t.Errorf("checkpoint rewritten for a claim prepared before (modified %s)", mtime)
	}

	gen.fail.Store(true)
	_, before := stat(w.SpecPath(c.UID))
	prepare("with a broken generator")
	if _, after := stat(w.SpecPath(c.UID)); string(after) != string(before) {
		t.Error("spec changed although it could not be generated")
	}
	if err := os.Remove(w.SpecPath(c.UID)); err != nil {
		t.Fatal(err)
	}
	result, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{c})
	if err != nil {
		t.Fatal(err)
	}
	if result[c.UID].Err == nil {
		t.Error("claim whose lost spec cannot be generated reported prepared")
	}
}

func TestPrepareUnprepare(t *testing.T) {
	a01 := claim("a", gpus("gpus", "gpu-0", "gpu-1")...)
	b1 := claim("b", gpus("gpus", "gpu-1")...)
	c2 := claim("c", gpus("gpus", "gpu-2")...)
	admin1 := claim("admin", alloc{request: "monitor", device: "gpu-1", admin: true})
	admin1b := claim("admin-b", alloc{request: "monitor", device: "gpu-1", admin: true})
	// One request with admin access and one without, both allocated gpu-1.
	mixed1 := claim("mixed", alloc{request: "monitor", device: "gpu-1", admin: true}, alloc{request: "work", device: "gpu-1"})
	// A result marked admin access whose request does not ask for it (the
	// API server does not compare the two): an exclusive use.
	forged1 := claim("forged", alloc{request: "gpus", device: "gpu-1", admin: true})
	forged1.Spec.Devices.Requests[0].Exactly.AdminAccess = nil

	// step is one call; wantErr maps claim names to the error they must get
	// (errAny: any error); all other claims must succeed.
	errAny := errors.New("any error")
	type step struct {
		prepare   []*resourceapi.ResourceClaim
		unprepare []*resourceapi.ResourceClaim
		restart   bool
		// deleteCDI removes the spec of a claim before the step.
		deleteCDI *resourceapi.ResourceClaim
		wantErr   map[string]error
		// wantPrepared lists the claims in the checkpoint after the step.
		wantPrepared []string
	}
	testcases := map[string][]step{
		"prepare twice is idempotent": {
			{prepare: []*resourceapi.ResourceClaim{a01}, wantPrepared: []string{"a"}},
			{prepare: []*resourceapi.ResourceClaim{a01}, wantPrepared: []string{"a"}},
		},
		"lost CDI spec is restored": {
			{prepare: []*resourceapi.ResourceClaim{a01}, wantPrepared: []string{"a"}},
			{deleteCDI: a01, prepare: []*resourceapi.ResourceClaim{a01}, wantPrepared: []string{"a"}},
		},
		"device prepared for another claim is refused": {
			{prepare: []*resourceapi.ResourceClaim{a01}, wantPrepared: []string{"a"}},
			{prepare: []*resourceapi.ResourceClaim{b1, c2}, wantErr: map[string]error{"b": agent.ErrDeviceInUse}, wantPrepared: []string{"a", "c"}},
		},
		"conflict inside one call is refused": {
			{prepare: []*resourceapi.ResourceClaim{a01, b1}, wantErr: map[string]error{"b": agent.ErrDeviceInUse}, wantPrepared: []string{"a"}},
		},
		"refusal survives a restart": {
			{prepare: []*resourceapi.ResourceClaim{a01}, wantPrepared: []string{"a"}},
			{restart: true, prepare: []*resourceapi.ResourceClaim{b1}, wantErr: map[string]error{"b": agent.ErrDeviceInUse}, wantPrepared: []string{"a"}},
			{prepare: []*resourceapi.ResourceClaim{a01}, wantPrepared: []string{"a"}},
		},
		// Admin access (monitoring) overlaps any allocation, as the
		// scheduler allocates it: beside a workload's claim, before or
		// after it, and beside other admin claims.
		"admin access its request does not ask for is exclusive": {
			{prepare: []*resourceapi.ResourceClaim{a01}, wantPrepared: []string{"a"}},
			{prepare: []*resourceapi.ResourceClaim{forged1}, wantErr: map[string]error{"forged": agent.ErrDeviceInUse}, wantPrepared: []string{"a"}},
		},
		"admin access shares with any claim": {
			{prepare: []*resourceapi.ResourceClaim{admin1, admin1b}, wantPrepared: []string{"admin", "admin-b"}},
			{prepare: []*resourceapi.ResourceClaim{b1}, wantPrepared: []string{"admin", "admin-b", "b"}},
			{unprepare: []*resourceapi.ResourceClaim{admin1, admin1b}, wantPrepared: []string{"b"}},
			{prepare: []*resourceapi.ResourceClaim{admin1}, wantPrepared: []string{"admin", "b"}},
			{prepare: []*resourceapi.ResourceClaim{a01}, wantErr: map[string]error{"a": agent.ErrDeviceInUse}, wantPrepared: []string{"admin", "b"}},
		},
		// A claim holds a device exclusively where any of its results
		// does, whichever comes first; across a restart too.
		"admin access and an ordinary request of one claim": {
			{prepare: []*resourceapi.ResourceClaim{mixed1}, wantPrepared: []string{"mixed"}},
			{prepare: []*resourceapi.ResourceClaim{b1}, wantErr: map[string]error{"b": agent.ErrDeviceInUse}, wantPrepared: []string{"mixed"}},
			{restart: true, prepare: []*resourceapi.ResourceClaim{b1}, wantErr: map[string]error{"b": agent.ErrDeviceInUse}, wantPrepared: []string{"mixed"}},
			{prepare: []*resourceapi.ResourceClaim{admin1}, wantPrepared: []string{"admin", "mixed"}},
		},
		"unprepare frees the device, twice is fine": {
			{prepare: []*resourceapi.ResourceClaim{a01}, wantPrepared: []string{"a"}},
			{unprepare: []*resourceapi.ResourceClaim{a01}},
			{unprepare: []*resourceapi.ResourceClaim{a01}},
			{prepare: []*resourceapi.ResourceClaim{b1}, wantPrepared: []string{"b"}},
		},
		"unprepare of an unknown claim is fine": {
			{unprepare: []*resourceapi.ResourceClaim{c2}},
		},
		"unknown device, foreign pool, unallocated claim": {
			{
				prepare: []*resourceapi.ResourceClaim{
					claim("missing", gpus("gpus", "gpu-9")...),
					claim("foreign", alloc{request: "gpus", device: "gpu-0", pool: "node-2"}),
					{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "unallocated", UID: "uid-unallocated"}},
				},
				wantErr: map[string]error{"missing": errAny, "foreign": errAny, "unallocated": errAny},
			},
		},
	}
	for name, steps := range testcases {
		t.Run(name, func(t *testing.T) {
			t.Parallel() // each case has its own directories and agent
			_, ctx := ktesting.NewTestContext(t)
			e := newEnv(t)
			a := e.start(ctx, t)
			for i, s := range steps {
				if s.restart {
					a.Stop()
					a = e.start(ctx, t)
				}
				if s.deleteCDI != nil {
					w, _ := cdi.New(e.cdiDir)
					if err := os.Remove(w.SpecPath(s.deleteCDI.UID)); err != nil {
						t.Fatal(err)
					}
				}
				if len(s.prepare) > 0 {
					result, err := a.PrepareResourceClaims(ctx, s.prepare)
					if err != nil {
						t.Fatalf("step %d: prepare: %v", i, err)
					}
					for _, c := range s.prepare {
						r, ok := result[c.UID]
						if !ok {
							t.Errorf("step %d: no result for %s", i, c.Name)
							continue
						}
						want := s.wantErr[c.Name]
						switch {
						case want == nil && r.Err != nil:
							t.Errorf("step %d: %s: unexpected error %v", i, c.Name, r.Err)
						case want == errAny && r.Err == nil, want != nil && want != errAny && !errors.Is(r.Err, want):
							t.Errorf("step %d: %s: want error %v, got %v", i, c.Name, want, r.Err)
						case r.Err == nil:
							if len(r.Devices) == 0 {
								t.Errorf("step %d: %s: no devices", i, c.Name)
							}
							spec := readSpec(t, e, c.UID)
							if len(spec.Devices) != len(r.Devices) {
								t.Errorf("step %d: %s: CDI spec has %d devices, result %d", i, c.Name, len(spec.Devices), len(r.Devices))
							}
						}
					}
				}
				if len(s.unprepare) > 0 {
					refs := make([]kubeletplugin.NamespacedObject, 0, len(s.unprepare))
					for _, c := range s.unprepare {
						refs = append(refs, ref(c))
					}
					result, err := a.UnprepareResourceClaims(ctx, refs)
					if err != nil {
						t.Fatalf("step %d: unprepare: %v", i, err)
					}
					for _, c := range s.unprepare {
						if err, ok := result[c.UID]; !ok || err != nil {
							t.Errorf("step %d: unprepare %s: ok=%v err=%v", i, c.Name, ok, err)
						}
						w, _ := cdi.New(e.cdiDir)
						if _, err := os.Stat(w.SpecPath(c.UID)); !os.IsNotExist(err) {
							t.Errorf("step %d: CDI spec of %s still exists: %v", i, c.Name, err)
						}
					}
				}
				got := preparedNames(t, e)
				if diff := cmp.Diff(s.wantPrepared, got, cmpSorted); diff != "" {
					t.Errorf("step %d: prepared claims (-want +got):\n%s", i, diff)
				}
			}
		})
	}
}

var cmpSorted = cmp.Transformer("sort", func(in []string) []string {
	out := append([]string(nil), in...)
	for i := range out {
		for j := i + 1; j < len(out); j++ {
			if out[j] < out[i] {
				out[i], out[j] = out[j], out[i]
			}
		}
	}
	if len(out) == 0 {
		return nil
	}
	return out
})

func TestUnprepareRemovesOrphanedCDISpec(t *testing.T) {
	// A crash after writing the CDI spec but before saving the checkpoint
	// leaves a spec for a claim the checkpoint does not know.
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	a := e.start(ctx, t)
	w, err := cdi.New(e.cdiDir)
	if err != nil {
		t.Fatal(err)
	}
	orphan := claim("orphan", gpus("gpus", "gpu-4")...)
	if _, err := w.WriteClaimSpec(orphan.UID, []cdi.Device{{Name: "gpu-4", UUID: e.machine.UUID(4), Minor: 4}}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.UnprepareResourceClaims(ctx, []kubeletplugin.NamespacedObject{ref(orphan)}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(w.SpecPath(orphan.UID)); !os.IsNotExist(err) {
		t.Errorf("orphaned CDI spec not removed: %v", err)
	}
}

func TestPublishOnlyWithoutStateCannotPrepare(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	s, err := agent.StartSimulated(ctx, agent.SimulatedOptions{NodeName: nodeName, Machine: e.machine, KubeClient: e.client})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	if _, err := s.Agent.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{claim("a", gpus("gpus", "gpu-0")...)}); !errors.Is(err, agent.ErrNoState) {
		t.Errorf("want ErrNoState, got %v", err)
	}
}

func TestBuildResourcesTaints(t *testing.T) {
	at := time.Date(2026, 11, 30, 1, 2, 3, 400, time.UTC)
	testcases := map[string]struct {
		owned        bool
		nvmlUnusable bool
		effect       resourceapi.DeviceTaintEffect
		unhealthy    map[string]discovery.HealthEvent
		// fabric is the fabric state of gpu-1; set changes gpu-1 further.
		fabric *discovery.FabricNotReady
		set    func(g *discovery.GPU)
		want   map[string][]resourceapi.DeviceTaint
	}{
		"no taints": {},
		"reset required, compute prohibited: that GPU": {
			set: func(g *discovery.GPU) {
				g.ResetRequired = discovery.PageRetirementPending
				g.ComputeProhibited = true
			},
			want: map[string][]resourceapi.DeviceTaint{
				"gpu-1": {
					{Key: agent.ResetRequiredTaintKey, Value: "page-retirement-pending", Effect: resourceapi.DeviceTaintEffectNoSchedule},
					{Key: agent.ComputeProhibitedTaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule},
				},
			},
		},
		"row remap failure: the health taint with its effect": {
			effect: resourceapi.DeviceTaintEffectNoExecute,
			set:    func(g *discovery.GPU) { g.RowRemapFailed = true },
			want: map[string][]resourceapi.DeviceTaint{
				"gpu-1": {{Key: agent.HealthTaintKey, Value: "row-remap-failure", Effect: resourceapi.DeviceTaintEffectNoExecute}},
			},
		},
		"row remap failure of a faulty GPU: the fault's taint only": {
			set:       func(g *discovery.GPU) { g.RowRemapFailed = true },
			unhealthy: map[string]discovery.HealthEvent{"gpu-1": {Device: "gpu-1", Reason: "xid-79", Time: at}},
			want: map[string][]resourceapi.DeviceTaint{
				"gpu-1": {{Key: agent.HealthTaintKey, Value: "xid-79", Effect: resourceapi.DeviceTaintEffectNoSchedule, TimeAdded: &metav1.Time{Time: at.Truncate(time.Second)}}},
			},
		},
		"fabric not ready: that GPU, beside the owned taint": {
			owned:  true,
			fabric: &discovery.FabricNotReady{State: discovery.FabricInProgress},
			want: map[string][]resourceapi.DeviceTaint{
				"gpu-0": {{Key: topology.DefaultTaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule}},
				"gpu-1": {
					{Key: topology.DefaultTaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule},
					{Key: agent.FabricNotReadyTaintKey, Value: "in-progress", Effect: resourceapi.DeviceTaintEffectNoSchedule},
				},
			},
		},
		"owned taint on every device": {
			owned: true,
			want: map[string][]resourceapi.DeviceTaint{
				"gpu-0": {{Key: topology.DefaultTaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule}},
				"gpu-1": {{Key: topology.DefaultTaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule}},
			},
		},
		"health taint on the faulty device only": {
			unhealthy: map[string]discovery.HealthEvent{"gpu-1": {Device: "gpu-1", Reason: "xid-79", Time: at}},
			want: map[string][]resourceapi.DeviceTaint{
				"gpu-1": {{Key: agent.HealthTaintKey, Value: "xid-79", Effect: resourceapi.DeviceTaintEffectNoSchedule, TimeAdded: &metav1.Time{Time: at.Truncate(time.Second)}}},
			},
		},
		"health taint NoExecute, the owned taint NoSchedule": {
			owned:     true,
			effect:    resourceapi.DeviceTaintEffectNoExecute,
			unhealthy: map[string]discovery.HealthEvent{"gpu-1": {Device: "gpu-1", Reason: "xid-79", Time: at}},
			want: map[string][]resourceapi.DeviceTaint{
				"gpu-0": {{Key: topology.DefaultTaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule}},
				"gpu-1": {
					{Key: topology.DefaultTaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule},
					{Key: agent.HealthTaintKey, Value: "xid-79", Effect: resourceapi.DeviceTaintEffectNoExecute, TimeAdded: &metav1.Time{Time: at.Truncate(time.Second)}},
				},
			},
		},
		"NVML unusable: every device, beside a health taint": {
			nvmlUnusable: true,
			unhealthy:    map[string]discovery.HealthEvent{"gpu-1": {Device: "gpu-1", Reason: "xid-79", Time: at}},
			want: map[string][]resourceapi.DeviceTaint{
				"gpu-0": {{Key: agent.NVMLUnusableTaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule}},
				"gpu-1": {
					{Key: agent.NVMLUnusableTaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule},
					{Key: agent.HealthTaintKey, Value: "xid-79", Effect: resourceapi.DeviceTaintEffectNoSchedule, TimeAdded: &metav1.Time{Time: at.Truncate(time.Second)}},
				},
			},
		},
		"both": {
			owned:     true,
			unhealthy: map[string]discovery.HealthEvent{"gpu-0": {Reason: "gpu-lost", Time: at}},
			want: map[string][]resourceapi.DeviceTaint{
				"gpu-0": {
					{Key: topology.DefaultTaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule},
					{Key: agent.HealthTaintKey, Value: "gpu-lost", Effect: resourceapi.DeviceTaintEffectNoSchedule, TimeAdded: &metav1.Time{Time: at.Truncate(time.Second)}},
				},
				"gpu-1": {{Key: topology.DefaultTaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule}},
			},
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			m, err := mockgpu.New(mockgpu.ProfileWorkstation2GPU, mockgpu.Options{NodeName: nodeName})
			if err != nil {
				t.Fatal(err)
			}
			d, err := discovery.NewNVML(discovery.NVMLOptions{Lib: m.NVML(), Sysfs: m.Sysfs()})
			if err != nil {
				t.Fatal(err)
			}
			inv, err := d.Discover(ctx)
			if err != nil {
				t.Fatal(err)
			}
			inv.GPU("gpu-1").Fabric = tc.fabric
			if tc.set != nil {
				tc.set(inv.GPU("gpu-1"))
			}
			res := agent.BuildResources(inv, "pool", tc.unhealthy, agent.TaintOptions{Owned: tc.owned, NVMLUnusable: tc.nvmlUnusable, Unhealthy: tc.effect})
			if len(res.Pools) != 1 || len(res.Pools["pool"].Slices) != 1 {
				t.Fatalf("want one pool with one slice, got %+v", res)
			}
			got := map[string][]resourceapi.DeviceTaint{}
			for _, dev := range res.Pools["pool"].Slices[0].Devices {
				if len(dev.Taints) > 0 {
					got[dev.Name] = dev.Taints
				}
			}
			if tc.want == nil {
				tc.want = map[string][]resourceapi.DeviceTaint{}
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("taints (-want +got):\n%s", diff)
			}
		})
	}
}

func TestWatchHealthStatus(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	a := e.start(ctx, t)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	reports := make(chan kubeletplugin.DeviceHealthReport)
	done := make(chan error, 1)
	go func() { done <- a.WatchHealthStatus(ctx, reports) }()

	health := func(r kubeletplugin.DeviceHealthReport) map[string]kubeletplugin.HealthStatus {
		out := map[string]kubeletplugin.HealthStatus{}
		for _, d := range r.Devices {
			out[d.DeviceName] = d.Health
		}
		return out
	}
	allHealthy := func(h map[string]kubeletplugin.HealthStatus) bool {
		for _, status := range h {
			if status != kubeletplugin.HealthStatusHealthy {
				return false
			}
		}
		return len(h) == 8
	}
	// Devices are Unknown until the watcher says that it watches them.
	deadline := time.After(30 * time.Second)
	for watched := false; !watched; {
		select {
		case r := <-reports:
			watched = allHealthy(health(r))
		case <-deadline:
			t.Fatal("devices never reported healthy")
		}
	}
	if err := e.machine.InjectXID(5, 79); err != nil {
		t.Fatal(err)
	}
	for {
		select {
		case r := <-reports:
			h := health(r)
			if h["gpu-5"] != kubeletplugin.HealthStatusUnhealthy {
				continue
			}
			for dev, status := range h {
				if dev != "gpu-5" && status != kubeletplugin.HealthStatusHealthy {
					t.Errorf("%s: %s", dev, status)
				}
			}
			cancel()
			if err := <-done; err != nil {
				t.Errorf("WatchHealthStatus: %v", err)
			}
			return
		case <-deadline:
			t.Fatal("gpu-5 never reported unhealthy")
		}
	}
}

type noHealthDiscovery struct{ discovery.Interface }

func TestWatchHealthStatusNotSupported(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: e.machine.NVML(), Sysfs: e.machine.Sysfs()})
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(ctx, agent.Options{
		NodeName: nodeName, KubeClient: e.client, Discovery: noHealthDiscovery{disc}, PublishOnly: true, RescanInterval: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Stop()
	err = a.WatchHealthStatus(ctx, make(chan kubeletplugin.DeviceHealthReport))
	if !errors.Is(err, kubeletplugin.ErrHealthNotSupported) {
		t.Errorf("want ErrHealthNotSupported, got %v", err)
	}
}

// unsupportedHealth is a health source that cannot watch (as the lazy NVML
// discovery before the driver is there).
type unsupportedHealth struct{}

func (unsupportedHealth) WatchHealth(context.Context, *discovery.Inventory, func(discovery.Unwatched), chan<- discovery.HealthEvent) error {
	return discovery.ErrHealthUnsupported
}

// TestWatchHealthStatusNotWatching: with a health source that is not
// watching, the kubelet's stream stays open and reports every device as
// Unknown; it does not end with ErrHealthNotSupported, after which the
// kubelet would not ask again while the agent stays registered.
func TestWatchHealthStatusNotWatching(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: e.machine.NVML(), Sysfs: e.machine.Sysfs()})
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(ctx, agent.Options{
		NodeName: nodeName, KubeClient: e.client, Discovery: disc, Health: unsupportedHealth{}, PublishOnly: true, RescanInterval: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Stop()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	reports := make(chan kubeletplugin.DeviceHealthReport)
	done := make(chan error, 1)
	go func() { done <- a.WatchHealthStatus(ctx, reports) }()
	// The first report may come before the source has given up.
	deadline := time.After(30 * time.Second)
	for unknown := false; !unknown; {
		select {
		case r := <-reports:
			unknown = len(r.Devices) == 8
			for _, d := range r.Devices {
				unknown = unknown && d.Health == kubeletplugin.HealthStatusUnknown
			}
		case err := <-done:
			t.Fatalf("health stream ended: %v", err)
		case <-deadline:
			t.Fatal("devices never reported Unknown")
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("WatchHealthStatus: %v", err)
	}
}

func TestOptionsRequired(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: e.machine.NVML(), Sysfs: e.machine.Sysfs()})
	if err != nil {
		t.Fatal(err)
	}
	testcases := map[string]agent.Options{
		"no node name":            {KubeClient: e.client, Discovery: disc},
		"no client":               {NodeName: nodeName, Discovery: disc},
		"no discovery":            {NodeName: nodeName, KubeClient: e.client},
		"invalid owned taint key": {NodeName: nodeName, KubeClient: e.client, Discovery: disc, OwnedTaint: true, OwnedTaintKey: "-topodra-only"},
	}
	for name, opts := range testcases {
		t.Run(name, func(t *testing.T) {
			opts.PublishOnly = true
			if a, err := agent.New(ctx, opts); err == nil {
				a.Stop()
				t.Error("want error")
			}
		})
	}
}

// preparedNames returns the names of the claims in e's checkpoint, sorted.
func preparedNames(t *testing.T, e *env) []string {
	t.Helper()
	store, err := checkpoint.New(e.stateDir)
	if err != nil {
		t.Fatal(err)
	}
	cp, err := store.Load()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, c := range cp.Claims {
		names = append(names, c.Name)
	}
	slices.Sort(names)
	return names
}
