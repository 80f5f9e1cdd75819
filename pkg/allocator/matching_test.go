package allocator

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"
)

// TestCountDevices: a node with four "h100" and four "a100" GPUs, two
// NICs and a network-attached GPU pool; gpu-1 (an h100) and gpu-5 are
// allocated. Every claim sees all 8 GPUs (6 free) and both NICs of the
// node. A claim for h100s matches the four h100s (three free) and
// nothing of the NIC driver; a firstAvailable request counts both of its
// subrequests; a second claim for NICs adds them; the network-attached
// GPUs never count. A claim with a field the package does not interpret
// leaves the matching counts at 0 and says so; an unknown class is an
// input error.
func TestCountDevices(t *testing.T) {
	ctx := quietContext(t)
	var gpus []resourceapi.Device
	for i := range 8 {
		model := "h100"
		if i >= 4 {
			model = "a100"
		}
		gpus = append(gpus, device(fmt.Sprintf("gpu-%d", i), attrs{"model": str(model)}))
	}
	network := slice("fabric", gpuDriver, device("remote-0", attrs{"model": str("h100")}))
	network.Spec.NodeName = nil
	network.Spec.AllNodes = ptr.To(true)
	slices := []*resourceapi.ResourceSlice{
		slice("n", gpuDriver, gpus...),
		slice("n", nicDriver, device("nic-0", nil), device("nic-1", nil)),
		network,
	}
	const broken = `device.attributes["x"].nosuchfunc()`
	classes := classes(
		class("gpu", `device.driver == "`+gpuDriver+`"`),
		class("nic", `device.driver == "`+nicDriver+`"`),
		class("broken", broken),
	)
	a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "n", "gpu-1", "gpu-5"),
		ClassLister: classes, Slices: slices, CELCache: newCELCache(), Policy: DefaultPolicy()})
	if err != nil {
		t.Fatal(err)
	}
	h100 := `device.attributes["` + gpuDriver + `"].model == "h100"`
	a100 := `device.attributes["` + gpuDriver + `"].model == "a100"`
	firstAvailable := claim("either").obj()
	firstAvailable.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "gpu", FirstAvailable: []resourceapi.DeviceSubRequest{
		{Name: "h100", DeviceClassName: "gpu", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 4, Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: h100}}}},
		{Name: "a100", DeviceClassName: "gpu", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 2, Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: a100}}}},
	}}}
	brokenLater := claim("later").obj()
	brokenLater.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "gpu", FirstAvailable: []resourceapi.DeviceSubRequest{
		{Name: "h100", DeviceClassName: "gpu", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 4, Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: h100}}}},
		{Name: "newer", DeviceClassName: "gpu", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1, Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: broken}}}},
	}}}
	constrained := claim("k").request("gpu", "gpu", 1).obj()
	constrained.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{}} // neither match nor distinct: not interpreted here
	gpu := func(matching, free int) DeviceCount {
		return DeviceCount{Devices: 8, Free: 6, Matching: matching, MatchingFree: free}
	}
	nic := func(matching, free int) DeviceCount {
		return DeviceCount{Devices: 2, Free: 2, Matching: matching, MatchingFree: free}
	}
	for name, tc := range map[string]struct {
		claims      []*resourceapi.ResourceClaim
		want        map[string]DeviceCount
		wantMatched bool
	}{
		"h100s":          {claims: []*resourceapi.ResourceClaim{claim("h").request("gpu", "gpu", 4, h100).obj()}, want: map[string]DeviceCount{gpuDriver: gpu(4, 3), nicDriver: nic(0, 0)}, wantMatched: true},
		"any GPU":        {claims: []*resourceapi.ResourceClaim{claim("g").request("gpu", "gpu", 8).obj()}, want: map[string]DeviceCount{gpuDriver: gpu(8, 6), nicDriver: nic(0, 0)}, wantMatched: true},
		"firstAvailable": {claims: []*resourceapi.ResourceClaim{firstAvailable}, want: map[string]DeviceCount{gpuDriver: gpu(8, 6), nicDriver: nic(0, 0)}, wantMatched: true},
		"two claims": {claims: []*resourceapi.ResourceClaim{claim("h").request("gpu", "gpu", 4, h100).obj(), claim("n").request("nic", "nic", 1).obj()},
			want: map[string]DeviceCount{gpuDriver: gpu(4, 3), nicDriver: nic(2, 2)}, wantMatched: true},
		"not interpreted": {claims: []*resourceapi.ResourceClaim{constrained}, want: map[string]DeviceCount{gpuDriver: gpu(0, 0), nicDriver: nic(0, 0)}},
		// Upstream allocates nothing for a request whose selector does
		// not compile: it fails on the first device it evaluates it on.
		"selector does not compile":         {claims: []*resourceapi.ResourceClaim{claim("b").request("gpu", "gpu", 1, broken).obj()}, want: map[string]DeviceCount{gpuDriver: gpu(0, 0), nicDriver: nic(0, 0)}, wantMatched: true},
		"class selector does not compile":   {claims: []*resourceapi.ResourceClaim{claim("bc").request("gpu", "broken", 1).obj()}, want: map[string]DeviceCount{gpuDriver: gpu(0, 0), nicDriver: nic(0, 0)}, wantMatched: true},
		"later subrequest does not compile": {claims: []*resourceapi.ResourceClaim{brokenLater}, want: map[string]DeviceCount{gpuDriver: gpu(4, 3), nicDriver: nic(0, 0)}, wantMatched: true},
	} {
		t.Run(name, func(t *testing.T) {
			got, matched, err := a.CountDevices(ctx, tc.claims, sets.New("n", "fabric"))
			if err != nil || matched != tc.wantMatched {
				t.Fatalf("CountDevices: matched %v, err %v; want matched %v", matched, err, tc.wantMatched)
			}
			if fmt.Sprint(got) != fmt.Sprint(map[string]map[string]DeviceCount{"n": tc.want}) {
				t.Errorf("CountDevices = %v, want %v on node n", got, tc.want)
			}
		})
	}
	_, _, err = a.CountDevices(ctx, []*resourceapi.ResourceClaim{claim("x").request("gpu", "no-such-class", 1).obj()}, sets.New("n"))
	var inputErr *InputError
	if !errors.As(err, &inputErr) {
		t.Errorf("unknown class: err %v, want an *InputError", err)
	}
}

// TestCountDevicesTainted: a device with a NoSchedule or NoExecute taint
// that the pod's request matching it does not tolerate (a health taint)
// is not free, whatever a request for other devices tolerates; one whose
// taint that request tolerates (the owned taint) is.
func TestCountDevicesTainted(t *testing.T) {
	ctx := quietContext(t)
	gpus := []resourceapi.Device{device("gpu-0", nil), device("gpu-1", nil), device("gpu-2", nil), device("gpu-3", nil)}
	gpus[1].Taints = []resourceapi.DeviceTaint{{Key: "example.com/unhealthy", Value: "xid-48", Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	gpus[2].Taints = []resourceapi.DeviceTaint{{Key: "example.com/owned", Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	gpus[3].Taints = []resourceapi.DeviceTaint{{Key: "example.com/note", Effect: resourceapi.DeviceTaintEffectNone}}
	a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "n"),
		ClassLister: defaultClasses, Slices: []*resourceapi.ResourceSlice{slice("n", gpuDriver, gpus...)}, CELCache: newCELCache(), Policy: DefaultPolicy()})
	if err != nil {
		t.Fatal(err)
	}
	tolerant := claim("nic").request("nic", "nic", 1).obj()
	tolerant.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{Operator: resourceapi.DeviceTolerationOpExists}}
	owned := claim("owned").request("gpu", "gpu", 1).obj()
	owned.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{Key: "example.com/owned", Operator: resourceapi.DeviceTolerationOpExists}}
	for name, tc := range map[string]struct {
		claims []*resourceapi.ResourceClaim
		want   DeviceCount
	}{
		"no toleration":                            {claims: []*resourceapi.ResourceClaim{claim("plain").request("gpu", "gpu", 1).obj()}, want: DeviceCount{Devices: 4, Free: 2, Matching: 4, MatchingFree: 2}},
		"owned taint tolerated":                    {claims: []*resourceapi.ResourceClaim{owned}, want: DeviceCount{Devices: 4, Free: 3, Matching: 4, MatchingFree: 3}},
		"one of two requests":                      {claims: []*resourceapi.ResourceClaim{owned, claim("nic").request("nic", "nic", 1).obj()}, want: DeviceCount{Devices: 4, Free: 3, Matching: 4, MatchingFree: 3}},
		"a request of another class tolerates all": {claims: []*resourceapi.ResourceClaim{claim("plain").request("gpu", "gpu", 1).obj(), tolerant}, want: DeviceCount{Devices: 4, Free: 2, Matching: 4, MatchingFree: 2}},
	} {
		t.Run(name, func(t *testing.T) {
			got, _, err := a.CountDevices(ctx, tc.claims, sets.New("n"))
			if err != nil {
				t.Fatal(err)
			}
			if got["n"][gpuDriver] != tc.want {
				t.Errorf("CountDevices = %+v, want %+v", got["n"][gpuDriver], tc.want)
			}
		})
	}
}

// BenchmarkCountDevices counts the devices an 8-GPU claim matches on
// 500 and 5,000 DGX nodes (8 GPUs each) with the selector cache warm, as
// the plugin's PreFilter does for a pod that keeps a headroom; each round
// builds the Allocator as a scheduling cycle does. "parallel" counts with
// kube-scheduler's default parallelism (16), as the plugin does.
func BenchmarkCountDevices(b *testing.B) {
	ctx := context.Background()
	for _, size := range []int{500, 5000} {
		slices, names := dgxCluster(size)
		cache := NewCache()
		cel := newCELCache()
		c := []*resourceapi.ResourceClaim{claim("c").request("gpu", "gpu", 8).obj()}
		for _, mode := range []string{"sequential", "parallel"} {
			var parallelize func(context.Context, int, func(int))
			if mode == "parallel" {
				parallelize = parallelSixteen
			}
			b.Run(fmt.Sprintf("nodes=%d/%s", size, mode), func(b *testing.B) {
				for b.Loop() {
					a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "n1", "gpu-1"), ClassLister: defaultClasses, Slices: slices, CELCache: cel, Cache: cache, Policy: DefaultPolicy(), Parallelize: parallelize})
					if err != nil {
						b.Fatal(err)
					}
					if _, _, err := a.CountDevices(ctx, c, names); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// dgxCluster returns the slices of n DGX nodes, n0 to n<n-1>, and their
// names.
func dgxCluster(n int) ([]*resourceapi.ResourceSlice, sets.Set[string]) {
	var slices []*resourceapi.ResourceSlice
	names := sets.New[string]()
	for i := range n {
		name := fmt.Sprintf("n%d", i)
		slices = append(slices, dgx(name)...)
		names.Insert(name)
	}
	return slices, names
}

// parallelSixteen runs work on 16 goroutines, as the scheduler framework's
// Parallelizer does with kube-scheduler's default parallelism (it also
// records the scheduler's goroutine metrics, which need registering).
func parallelSixteen(ctx context.Context, pieces int, work func(int)) {
	workqueue.ParallelizeUntil(ctx, 16, pieces, work)
}

// TestCountDevicesInParallel: counting the nodes concurrently gives the
// counts of counting them one after another, with devices allocated on
// some nodes; a cancelled context is an error, not partial counts.
func TestCountDevicesInParallel(t *testing.T) {
	ctx := quietContext(t)
	slices, names := dgxCluster(200)
	state := allocated(gpuDriver, "n7", "gpu-0", "gpu-3")
	for _, id := range []structured.DeviceID{structured.MakeDeviceID(gpuDriver, "n1", "gpu-1"), structured.MakeDeviceID(gpuDriver, "n150", "gpu-7")} {
		state.AllocatedDevices.Insert(id)
	}
	c := []*resourceapi.ResourceClaim{claim("c").request("gpu", "gpu", 4).obj()}
	count := func(ctx context.Context, parallelize func(context.Context, int, func(int))) (map[string]map[string]DeviceCount, error) {
		a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: slices, Policy: DefaultPolicy(), Parallelize: parallelize})
		if err != nil {
			t.Fatal(err)
		}
		counts, _, err := a.CountDevices(ctx, c, names)
		return counts, err
	}
	want, err := count(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err := count(ctx, parallelSixteen)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("parallel counts differ (-sequential +parallel):\n%s", diff)
	}
	if n := got["n7"][gpuDriver]; n.Devices != 8 || n.Free != 6 || n.MatchingFree != 6 {
		t.Errorf("n7: %+v, want 8 devices, 6 free and matching", n)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if counts, err := count(cancelled, parallelSixteen); err == nil {
		t.Errorf("cancelled: counts of %d nodes, no error", len(counts))
	}
}

// TestDeviceHasTaint: a device of the newest generation of its pool, with
// and without the taint; the older generation's copy of the pool (its
// slice listed first), where gpu-0 was untainted, gpu-1 tainted and gpu-8
// published, does not count; an unknown device is not found.
func TestDeviceHasTaint(t *testing.T) {
	ctx := quietContext(t)
	old := slice("n", gpuDriver, device("gpu-0", nil), device("gpu-1", nil), device("gpu-8", nil))
	old.Name = "a-old-" + old.Name
	old.Spec.Devices[1].Taints = []resourceapi.DeviceTaint{{Key: "example.com/owned", Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	current := slice("n", gpuDriver, device("gpu-0", nil), device("gpu-1", nil))
	current.Spec.Pool.Generation = 2
	current.Spec.Devices[0].Taints = []resourceapi.DeviceTaint{{Key: "example.com/owned", Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	a, err := New(ctx, Options{Features: allFeatures, ClassLister: defaultClasses, Slices: []*resourceapi.ResourceSlice{current, old}, Policy: DefaultPolicy()})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		device         string
		found, tainted bool
	}{{"gpu-0", true, true}, {"gpu-1", true, false}, {"gpu-8", false, false}, {"gpu-9", false, false}} {
		if found, tainted := a.DeviceHasTaint(gpuDriver, "n", tc.device, "example.com/owned"); found != tc.found || tainted != tc.tainted {
			t.Errorf("DeviceHasTaint(%s) = %v, %v; want %v, %v", tc.device, found, tainted, tc.found, tc.tainted)
		}
	}
}

// TestExplanationNamesTaints: a node whose free GPUs carry taints the
// claim does not tolerate says which: the keys, once each, sorted; a
// GPU in use does not add its taint.
func TestExplanationNamesTaints(t *testing.T) {
	ctx := quietContext(t)
	taint := func(key string) []resourceapi.DeviceTaint {
		return []resourceapi.DeviceTaint{{Key: key, Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	}
	gpus := []resourceapi.Device{device("gpu-0", nil), device("gpu-1", nil), device("gpu-2", nil), device("gpu-3", nil)}
	gpus[0].Taints = taint("gpu.topodra.io/device-plugin")
	gpus[1].Taints = taint("example.com/broken")
	gpus[2].Taints = taint("gpu.topodra.io/device-plugin")
	gpus[3].Taints = taint("example.com/in-use")
	a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "n", "gpu-3"), ClassLister: defaultClasses,
		Slices: []*resourceapi.ResourceSlice{slice("n", gpuDriver, gpus...)}, Policy: DefaultPolicy()})
	if err != nil {
		t.Fatal(err)
	}
	res, err := a.Allocate(ctx, node("n"), []*resourceapi.ResourceClaim{claim("c").request("gpu", "gpu", 1).obj()})
	if err != nil || res.Allocations != nil || res.Explanation == nil || len(res.Explanation.Requests) != 1 {
		t.Fatalf("Allocate: %v, %+v; want no allocation with an explanation", err, res)
	}
	devicePlugin := "gpu.topodra.io/device-plugin (NVIDIA's device plugin also hands out these GPUs; a cluster admin must disable it on the node as docs/install.md says; no claim may tolerate this taint)"
	want := "no free device matches once tainted devices are left out (needs 1); taints: untolerated example.com/broken; " + devicePlugin
	if got := res.Explanation.Requests[0].Reason; got != want {
		t.Errorf("reason %q, want %q", got, want)
	}
	if got := res.Explanation.String(); strings.Contains(got, ",") {
		t.Errorf("explanation %q has a comma, which kube-scheduler's summary of nodes uses as separator", got)
	}
	// Asking for more than are not in use, tainted or not: the taints are
	// named as well, as they keep the devices once others are given back.
	res, err = a.Allocate(ctx, node("n"), []*resourceapi.ResourceClaim{claim("c").request("gpu", "gpu", 4).obj()})
	if err != nil || res.Allocations != nil || res.Explanation == nil || len(res.Explanation.Requests) != 1 {
		t.Fatalf("Allocate of 4: %v, %+v; want no allocation with an explanation", err, res)
	}
	want = "only 3 free devices match (needs 4); 3 of them tainted: untolerated example.com/broken; " + devicePlugin
	if got := res.Explanation.Requests[0].Reason; got != want {
		t.Errorf("reason for 4 %q, want %q", got, want)
	}
}

// TestExplanationOfAgentTaints: the node agent's taints, which no claim
// should tolerate, are named with what they mean rather than as
// untolerated taints, alone or beside others.
func TestExplanationOfAgentTaints(t *testing.T) {
	ctx := quietContext(t)
	for name, tc := range map[string]struct {
		keys []string
		want string
	}{
		"health": {
			keys: []string{"gpu.topodra.io/unhealthy"},
			want: "no free device matches once tainted devices are left out (needs 1); taints: gpu.topodra.io/unhealthy (a GPU fault that the node agent reported; the taint's value names it)",
		},
		"nvml": {
			keys: []string{"gpu.topodra.io/nvml-unusable"},
			want: "no free device matches once tainted devices are left out (needs 1); taints: gpu.topodra.io/nvml-unusable (the node agent cannot read the node's GPUs through NVML; a cluster admin must repair the node's NVIDIA driver or reboot the node)",
		},
		"other driver": {
			keys: []string{"gpu.topodra.io/other-driver"},
			want: "no free device matches once tainted devices are left out (needs 1); taints: gpu.topodra.io/other-driver (another DRA driver (the taint's value names it) also publishes these GPUs; a cluster admin must remove that driver from the node as docs/install.md says; no claim may tolerate this taint)",
		},
		"fabric": {
			keys: []string{"gpu.topodra.io/fabric-not-ready"},
			want: "no free device matches once tainted devices are left out (needs 1); taints: gpu.topodra.io/fabric-not-ready (the GPU's NVLink fabric is not ready so CUDA cannot start on it; a cluster admin must get the NVIDIA fabric manager on the node running (systemctl status nvidia-fabricmanager); no claim may tolerate this taint)",
		},
		"other keys": {
			keys: []string{"example.com/b", "example.com/a"},
			want: "no free device matches once tainted devices are left out (needs 1); taints: untolerated example.com/a and example.com/b",
		},
	} {
		t.Run(name, func(t *testing.T) {
			var gpus []resourceapi.Device
			for i, key := range tc.keys {
				d := device(fmt.Sprintf("gpu-%d", i), nil)
				d.Taints = []resourceapi.DeviceTaint{{Key: key, Value: "xid-79", Effect: resourceapi.DeviceTaintEffectNoSchedule}}
				gpus = append(gpus, d)
			}
			a, err := New(ctx, Options{Features: allFeatures, ClassLister: defaultClasses, Slices: []*resourceapi.ResourceSlice{slice("n", gpuDriver, gpus...)}, Policy: DefaultPolicy()})
			if err != nil {
				t.Fatal(err)
			}
			res, err := a.Allocate(ctx, node("n"), []*resourceapi.ResourceClaim{claim("c").request("gpu", "gpu", 1).obj()})
			if err != nil || res.Allocations != nil || res.Explanation == nil || len(res.Explanation.Requests) != 1 {
				t.Fatalf("Allocate: %v, %+v; want no allocation with an explanation", err, res)
			}
			if got := res.Explanation.Requests[0].Reason; got != tc.want {
				t.Errorf("reason %q, want %q", got, tc.want)
			}
			if got := res.Explanation.String(); strings.Contains(got, ",") {
				t.Errorf("explanation %q has a comma, which kube-scheduler's summary of nodes uses as separator", got)
			}
		})
	}
}

// TestCountDevicesWithPartitions: on a node whose GPUs share their memory
// with a partition each, a GPU whose partition is allocated is not free
// (its counters are used up), for the driver and for a pod that asks for
// whole GPUs.
func TestCountDevicesWithPartitions(t *testing.T) {
	ctx := quietContext(t)
	whole := []*resourceapi.ResourceClaim{claim("c").request("gpu", "gpu", 1, `device.attributes["`+gpuDriver+`"].kind == "gpu"`).obj()}
	for _, tc := range []struct {
		allocated []string
		want      DeviceCount
	}{
		{nil, DeviceCount{Devices: 4, Free: 4, Matching: 2, MatchingFree: 2}},
		{[]string{"gpu-0-half"}, DeviceCount{Devices: 4, Free: 2, Matching: 2, MatchingFree: 1}},
		{[]string{"gpu-1"}, DeviceCount{Devices: 4, Free: 2, Matching: 2, MatchingFree: 1}},
	} {
		a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "n", tc.allocated...),
			ClassLister: defaultClasses, Slices: partitionedGPUs("n"), CELCache: newCELCache(), Policy: DefaultPolicy()})
		if err != nil {
			t.Fatal(err)
		}
		got, _, err := a.CountDevices(ctx, whole, sets.New("n"))
		if err != nil {
			t.Fatal(err)
		}
		if got["n"][gpuDriver] != tc.want {
			t.Errorf("%v allocated: %+v, want %+v", tc.allocated, got["n"][gpuDriver], tc.want)
		}
	}
}

// TestSliceIndexFollowsSlices: Allocators built from the same slice
// objects share one index; a changed slice (a new object, as informers
// replace it), a removed or an added one makes the next Allocator index
// the slices again, and it sees the change.
func TestSliceIndexFollowsSlices(t *testing.T) {
	ctx := quietContext(t)
	list, _ := dgxCluster(3)
	cache := NewCache()
	build := func(list []*resourceapi.ResourceSlice) *Allocator {
		t.Helper()
		a, err := New(ctx, Options{Features: allFeatures, ClassLister: defaultClasses, Slices: list, Cache: cache, Policy: DefaultPolicy()})
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	first := build(list)
	reordered := []*resourceapi.ResourceSlice{list[2], list[0], list[1]}
	if again := build(reordered); indexOf(again) != indexOf(first) {
		t.Error("the same slices, listed in another order, were indexed again")
	}

	newer := list[1].DeepCopy()
	newer.Spec.Pool.Generation++
	newer.Spec.Devices = newer.Spec.Devices[:4]
	changed := build([]*resourceapi.ResourceSlice{list[0], newer, list[2]})
	if indexOf(changed) == indexOf(first) {
		t.Fatal("a changed slice did not make a new index")
	}
	if got := changed.poolGen[poolKey{gpuDriver, "n1"}]; got != newer.Spec.Pool.Generation {
		t.Errorf("pool n1 generation %d, want %d", got, newer.Spec.Pool.Generation)
	}
	if got := len(changed.byNode["n1"][0].Spec.Devices); got != 4 {
		t.Errorf("node n1 has %d devices, want the changed slice's 4", got)
	}

	if removed := build(list[:2]); len(removed.byNode) != 2 || removed.byNode["n2"] != nil {
		t.Errorf("a removed slice: nodes %v, want n0 and n1", slices.Collect(maps.Keys(removed.byNode)))
	}
	extra, _ := dgxCluster(4)
	if added := build(append(slices.Clone(list), extra[3])); len(added.byNode) != 4 {
		t.Errorf("an added slice: %d nodes, want 4", len(added.byNode))
	}
}

// indexOf identifies the slice index a was built with (its byNode map).
func indexOf(a *Allocator) uintptr { return reflect.ValueOf(a.byNode).Pointer() }
