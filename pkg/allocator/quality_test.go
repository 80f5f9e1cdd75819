package allocator

import (
	"math"
	"reflect"
	"slices"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/topodra/topodra/pkg/topology"
)

// mixedDGX is a DGX whose pool also holds GPUs of another model: GPUs 0, 1,
// 4 and 5 are A100s, the others H100s.
func mixedDGX(nodeName string) []*resourceapi.ResourceSlice {
	s := dgx(nodeName)
	for _, i := range []int{0, 1, 4, 5} {
		s[0].Spec.Devices[i].Attributes["model"] = str("A100")
	}
	return s
}

// TestQualityOneFormula checks that the counted and the ordered strategy
// measure equal allocations alike: one-device pods can take either, and
// the node score must not depend on which one decided.
func TestQualityOneFormula(t *testing.T) {
	h100 := `device.attributes["` + gpuDriver + `"].model == "H100"`
	testcases := map[string]struct {
		slices    func(string) []*resourceapi.ResourceSlice
		inUse     []string
		selectors []string
		policy    Policy
	}{
		"dgx empty":               {slices: dgx},
		"dgx half used":           {slices: dgx, inUse: []string{"gpu-0", "gpu-2", "gpu-5", "gpu-7"}},
		"dgx one free":            {slices: dgx, inUse: []string{"gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6"}},
		"pcie box":                {slices: pcieBox, inUse: []string{"gpu-1", "gpu-4"}},
		"plain GPUs":              {slices: func(n string) []*resourceapi.ResourceSlice { return plainGPUs(n, 4) }, inUse: []string{"gpu-2"}},
		"mixed pool, one model":   {slices: mixedDGX, inUse: []string{"gpu-2"}, selectors: []string{h100}},
		"mixed pool, all models":  {slices: mixedDGX, inUse: []string{"gpu-0", "gpu-6"}},
		"dgx spreading":           {slices: dgx, inUse: []string{"gpu-0", "gpu-3"}, policy: Policy{Packing: false, Alignment: AlignmentPrefer}},
		"dgx other weights":       {slices: dgx, inUse: []string{"gpu-1"}, policy: Policy{Packing: true, RoomWeight: 1, PackingWeight: 3}},
		"dgx numaNode only":       {slices: dgx, inUse: []string{"gpu-1"}, policy: Policy{Packing: true, Attributes: []resourceapi.QualifiedName{topology.AttrNUMANode}}},
		"mixed pool, half in use": {slices: mixedDGX, inUse: []string{"gpu-2", "gpu-3", "gpu-6"}, selectors: []string{h100}},
	}
	ctx := quietContext(t)
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			const nodeName = "node-0"
			policy := tc.policy
			if policy.Alignment == "" {
				policy = DefaultPolicy()
			}
			claims := []*resourceapi.ResourceClaim{claim("c").request("gpu", "gpu", 1, tc.selectors...).obj()}
			a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, nodeName, tc.inUse...),
				ClassLister: defaultClasses, Slices: tc.slices(nodeName), CELCache: newCELCache(), Policy: policy})
			if err != nil {
				t.Fatal(err)
			}
			counted := &podNode{a: a, node: node(nodeName), claims: claims}
			ordered := &podNode{a: a, node: node(nodeName), claims: claims}
			if !(countedStrategy{}).applies(counted) || !(orderedStrategy{}).applies(ordered) {
				t.Fatal("both strategies should apply to a one-device pod")
			}
			byCounting, err := countedStrategy{}.allocate(ctx, counted)
			if err != nil || byCounting == nil || byCounting.Allocations == nil {
				t.Fatalf("counted: %+v, %v", byCounting, err)
			}
			byOrder, err := orderedStrategy{}.allocate(ctx, ordered)
			if err != nil || byOrder == nil || byOrder.Allocations == nil {
				t.Fatalf("ordered: %+v, %v", byOrder, err)
			}
			if c, o := deviceNames(byCounting.Allocations), deviceNames(byOrder.Allocations); !slices.Equal(c, o) {
				t.Fatalf("different allocations: counted %v, ordered %v", c, o)
			}
			if !reflect.DeepEqual(byCounting.Quality, byOrder.Quality) {
				t.Errorf("quality differs:\ncounted %+v\nordered %+v", byCounting.Quality, byOrder.Quality)
			}
			if want := a.policy.Score(byOrder.Quality); byOrder.Quality.Score != want {
				t.Errorf("Quality.Score %d, Policy.Score %d", byOrder.Quality.Score, want)
			}
		})
	}
}

// TestWholeNodeOfFourDevices: on an empty node of 4 GPUs (gpuNIC's, two
// per PCIe root, without the NICs), a 1-GPU
// placement breaks a whole free node where Policy.WholeNode is 4, and
// only a block of two (a PCIe root) by the default of 8; a policy with a
// whole node of fewer than 2 devices is refused.
func TestWholeNodeOfFourDevices(t *testing.T) {
	ctx := quietContext(t)
	one := []*resourceapi.ResourceClaim{claim("c").request("gpu", "gpu", 1).obj()}
	for _, tc := range []struct {
		whole      int
		wantBreaks bool
		wantRoom   float64
	}{
		{whole: 4, wantBreaks: true, wantRoom: 0},               // 1 (the node) + 0.3 (its root's pair)
		{whole: 0, wantBreaks: false, wantRoom: 1 - 0.3 - 0.05}, // 4 GPUs: half a node; the root's pair
	} {
		policy := DefaultPolicy()
		policy.WholeNode = tc.whole
		_, res, _ := allocateBoth(ctx, t, "n", gpuNIC("n")[:1], nil, policy, one)
		if q := res.Quality; q.BreaksNode != tc.wantBreaks || math.Abs(q.Room-tc.wantRoom) > 1e-9 {
			t.Errorf("whole node %d: BreaksNode %v, Room %.3f; want %v, %.3f", tc.whole, q.BreaksNode, q.Room, tc.wantBreaks, tc.wantRoom)
		}
	}
	policy := DefaultPolicy()
	policy.WholeNode = 1
	if _, err := New(ctx, Options{ClassLister: defaultClasses, Policy: policy}); err == nil {
		t.Error("a whole node of 1 device: New succeeded, want an error")
	}
}

// TestQualityCountsPartitionedGPUsAsTaken: a node of two GPUs whose
// memory is a shared counter set each, with a half partition of gpu-0
// allocated. A pod of one whole GPU sees gpu-0 as taken (it cannot have
// it): the node has one of its two GPUs in use and gpu-1 is no whole free
// node; with no partition allocated, both are free.
// partitionedGPUs are the slices of a node of two GPUs whose memory is a
// shared counter set each (80), with a partition of half of each
// (attribute kind: gpu or part).
func partitionedGPUs(node string) []*resourceapi.ResourceSlice {
	mem := func(set, gb string) []resourceapi.DeviceCounterConsumption {
		return []resourceapi.DeviceCounterConsumption{{CounterSet: set, Counters: map[string]resourceapi.Counter{"gb": {Value: resource.MustParse(gb)}}}}
	}
	devices := []resourceapi.Device{
		device("gpu-0", attrs{"kind": str("gpu")}), device("gpu-1", attrs{"kind": str("gpu")}),
		device("gpu-0-half", attrs{"kind": str("part")}), device("gpu-1-half", attrs{"kind": str("part")}),
	}
	devices[0].ConsumesCounters, devices[1].ConsumesCounters = mem("gpu-0", "80"), mem("gpu-1", "80")
	devices[2].ConsumesCounters, devices[3].ConsumesCounters = mem("gpu-0", "40"), mem("gpu-1", "40")
	gpus := slice(node, gpuDriver, devices...)
	gpus.Spec.Pool.ResourceSliceCount = 2
	counters := slice(node, gpuDriver)
	counters.Name = node + "-counters"
	counters.Spec.Pool.ResourceSliceCount = 2
	counters.Spec.SharedCounters = []resourceapi.CounterSet{
		{Name: "gpu-0", Counters: map[string]resourceapi.Counter{"gb": {Value: resource.MustParse("80")}}},
		{Name: "gpu-1", Counters: map[string]resourceapi.Counter{"gb": {Value: resource.MustParse("80")}}},
	}
	return []*resourceapi.ResourceSlice{gpus, counters}
}

func TestQualityCountsPartitionedGPUsAsTaken(t *testing.T) {
	ctx := quietContext(t)
	whole := []*resourceapi.ResourceClaim{claim("c").request("gpu", "gpu", 1, `device.attributes["`+gpuDriver+`"].kind == "gpu"`).obj()}
	for _, tc := range []struct {
		allocated []string
		wantInUse int
		wantDev   string
	}{
		{allocated: []string{"gpu-0-half"}, wantInUse: 1, wantDev: gpuDriver + "/n/gpu-1"},
		{allocated: nil, wantInUse: 0},
	} {
		_, res, _ := allocateBoth(ctx, t, "n", partitionedGPUs("n"), allocated(gpuDriver, "n", tc.allocated...), DefaultPolicy(), whole)
		if res.Allocations == nil {
			t.Fatalf("%v allocated: no allocation: %+v", tc.allocated, res.Explanation)
		}
		q := res.Quality
		if q.NodeDevices != 2 || q.NodeInUse != tc.wantInUse || tc.wantDev != "" && (len(q.Devices) != 1 || q.Devices[0] != tc.wantDev) {
			t.Errorf("%v allocated: node devices %d, in use %d, devices %v; want 2, %d, [%s]", tc.allocated, q.NodeDevices, q.NodeInUse, q.Devices, tc.wantInUse, tc.wantDev)
		}
	}
}

// TestBlockCost: a whole node costs 1, half a node or more (rounded up)
// 0.3, a pair or more 0.05, one device nothing, for nodes of eight and
// of five devices.
func TestBlockCost(t *testing.T) {
	for _, tc := range []struct {
		size, whole int
		want        float64
	}{
		{8, 8, 1}, {4, 8, 0.3}, {3, 8, 0.05}, {2, 8, 0.05}, {1, 8, 0},
		{5, 5, 1}, {3, 5, 0.3}, {2, 5, 0.05}, {1, 5, 0},
		{2, 4, 0.3}, {2, 2, 1}, {1, 2, 0},
	} {
		if got := BlockCost(tc.size, tc.whole); got != tc.want {
			t.Errorf("BlockCost(%d, %d) = %v, want %v", tc.size, tc.whole, got, tc.want)
		}
	}
}
