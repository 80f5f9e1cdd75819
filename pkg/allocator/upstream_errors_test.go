package allocator

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

// These tests cover inputs on which upstream's allocator reports an error
// only where its search gets to a request or a device: topodra must then
// allocate where upstream does and fail where upstream fails, whichever
// strategy serves the pod.

// withCounting runs f with counting allowed and with counting skipped.
func withCounting(t *testing.T, opts Options, f func(t *testing.T, opts Options)) {
	for _, counting := range []bool{true, false} {
		t.Run(fmt.Sprintf("counting %v", counting), func(t *testing.T) {
			if !counting {
				opts.SkipCounting = func(string) bool { return true }
			}
			f(t, opts)
		})
	}
}

// TestUncompilableSelectorFailsOnlyWhereUpstreamEvaluatesIt: upstream
// compiles a selector when its search first evaluates it, so one that does
// not compile in a later firstAvailable subrequest (or in the class that
// only a later subrequest uses) fails nothing while an earlier subrequest
// fits. Where upstream does get to it, the error names the claim, request
// and expression.
func TestUncompilableSelectorFailsOnlyWhereUpstreamEvaluatesIt(t *testing.T) {
	const broken = `device.attributes["x"].nosuchfunc()`
	cls := classes(
		class("gpu", `device.driver == "`+gpuDriver+`"`),
		class("nic", `device.driver == "`+nicDriver+`"`),
		class("broken", `device.driver == "`+gpuDriver+`"`, broken),
	)
	sub := func(name, className string, count int64, selectors ...string) resourceapi.DeviceSubRequest {
		s := resourceapi.DeviceSubRequest{Name: name, DeviceClassName: className, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count}
		for _, e := range selectors {
			s.Selectors = append(s.Selectors, resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: e}})
		}
		return s
	}
	prioritized := func(subs ...resourceapi.DeviceSubRequest) *resourceapi.ResourceClaim {
		c := claim("c").obj()
		c.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "r", FirstAvailable: subs}}
		return c
	}
	testcases := map[string]struct {
		claim   *resourceapi.ResourceClaim
		wantErr []string // what the error names; nil: no error
	}{
		"later subrequest's selector":              {claim: prioritized(sub("s0", "gpu", 1), sub("s1", "gpu", 1, broken))},
		"later subrequest's class":                 {claim: prioritized(sub("s0", "gpu", 2), sub("s1", "broken", 1))},
		"two devices, later subrequest's selector": {claim: prioritized(sub("s0", "gpu", 2), sub("s1", "gpu", 1, broken))},
		"first subrequest does not fit": {claim: prioritized(sub("s0", "gpu", 9), sub("s1", "gpu", 1, broken)),
			wantErr: []string{"default/c", "r/s1", "selector #0", broken}},
		"only request": {claim: claim("c").request("r", "gpu", 1, broken).obj(),
			wantErr: []string{"default/c", "request r:", "selector #0", broken}},
		"only request's class": {claim: claim("c").request("r", "broken", 1).obj(),
			wantErr: []string{"default/c", "request r:", "device class broken: selector #1", broken}},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			opts := Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "node-a", "gpu-1"), ClassLister: cls,
				Slices: gpuNIC("node-a"), CELCache: newCELCache(), Policy: DefaultPolicy()}
			withCounting(t, opts, func(t *testing.T, opts Options) {
				ctx := quietContext(t)
				claims := []*resourceapi.ResourceClaim{tc.claim}
				err := allocateLikeUpstream(ctx, t, opts, claims, tc.wantErr != nil)
				if err == nil {
					return
				}
				var inputErr *InputError
				if !errors.As(err, &inputErr) {
					t.Errorf("error %q is not an *InputError", err)
				}
				for _, want := range tc.wantErr {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("error %q does not name %q", err, want)
					}
				}
				// The Allocator still serves other pods.
				a, nerr := New(ctx, opts)
				if nerr != nil {
					t.Fatal(nerr)
				}
				if _, err := a.Allocate(ctx, node("node-a"), claims); err == nil {
					t.Fatal("no error the second time")
				}
				res, err := a.Allocate(ctx, node("node-a"), []*resourceapi.ResourceClaim{claim("other").request("r", "gpu", 1).obj()})
				if err != nil || res.Allocations == nil {
					t.Errorf("another pod after the error: %v, %+v", err, res)
				}
			})
		})
	}
}

// perDeviceSlice returns a per-device-node-selection slice of the GPU
// driver with the given devices.
func perDeviceSlice(devices ...resourceapi.Device) *resourceapi.ResourceSlice {
	s := slice("shared", gpuDriver, devices...)
	s.Spec.NodeName = nil
	s.Spec.Pool.Name = "shared"
	s.Spec.PerDeviceNodeSelection = ptr.To(true)
	return s
}

// TestUnparsableDeviceNodeSelectorFailsOnlyWhereUpstreamReachesIt: in a
// per-device-node-selection slice, upstream checks a device's own node
// selector only when its search selects the device for a request, and
// not at all in a slice it ignores (partitionable devices off). A node
// selector it cannot parse fails the node only there, and a view of the
// node that topodra prefers or verifies with must not move it before the
// node's devices.
func TestUnparsableDeviceNodeSelectorFailsOnlyWhereUpstreamReachesIt(t *testing.T) {
	unparsable := &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{
		{Key: "gen", Operator: v1.NodeSelectorOpGt, Values: []string{"abc"}}}}}}
	everywhere := func(name string) resourceapi.Device {
		d := device(name, attrs{topology.AttrPCIeRoot: str("pci0"), "model": str("a")})
		d.AllNodes = ptr.To(true)
		return d
	}
	good, good2 := everywhere("pd-0"), everywhere("pd-2")
	// Alone in its PCIe root: best fit sorts it first.
	bad := device("pd-1", attrs{topology.AttrPCIeRoot: str("pci1")})
	bad.NodeSelector = unparsable
	nic := slice("node-a", nicDriver, device("nic-0", attrs{topology.AttrPCIeRoot: str("pci0")}))
	noPartitions := allFeatures
	noPartitions.PartitionableDevices = false
	testcases := map[string]struct {
		slices   []*resourceapi.ResourceSlice
		features structured.Features
		class    string
		count    int64
		selector string
		wantErr  bool
		// inputErr is what an *InputError must name; "": any error.
		inputErr string
	}{
		"device found before the unparsable one": {slices: []*resourceapi.ResourceSlice{perDeviceSlice(good, good2, bad), nic}, class: "gpu", count: 1},
		"request that does not match it":         {slices: []*resourceapi.ResourceSlice{perDeviceSlice(good, good2, bad), nic}, class: "nic", count: 1},
		"search gets to it":                      {slices: []*resourceapi.ResourceSlice{perDeviceSlice(good, good2, bad), nic}, class: "gpu", count: 3, wantErr: true},
		"selector fails on it": {slices: []*resourceapi.ResourceSlice{perDeviceSlice(good, good2, bad), nic}, class: "gpu", count: 3,
			selector: `device.attributes["` + gpuDriver + `"].model == "a"`, wantErr: true, inputErr: gpuDriver + "/shared/pd-1"},
		"unparsable device first":                     {slices: []*resourceapi.ResourceSlice{perDeviceSlice(bad, good), nic}, class: "gpu", count: 1, wantErr: true},
		"slice ignored without partitionable devices": {slices: []*resourceapi.ResourceSlice{perDeviceSlice(bad), nic}, features: noPartitions, class: "nic", count: 1},
		"ignored slice, its driver's request":         {slices: []*resourceapi.ResourceSlice{perDeviceSlice(bad), nic}, features: noPartitions, class: "gpu", count: 1},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			features := allFeatures
			if tc.features != (structured.Features{}) {
				features = tc.features
			}
			opts := Options{Features: features, AllocatedState: allocated(gpuDriver, "none"), ClassLister: defaultClasses,
				Slices: tc.slices, CELCache: newCELCache(), Policy: DefaultPolicy()}
			withCounting(t, opts, func(t *testing.T, opts Options) {
				ctx := quietContext(t)
				var selectors []string
				if tc.selector != "" {
					selectors = append(selectors, tc.selector)
				}
				claims := []*resourceapi.ResourceClaim{claim("c").request("r", tc.class, tc.count, selectors...).obj()}
				err := allocateLikeUpstream(ctx, t, opts, claims, tc.wantErr)
				if tc.inputErr != "" && (!errors.Is(err, ErrInvalidInput) || !strings.Contains(err.Error(), tc.inputErr)) {
					t.Errorf("error %q is not an input error that names %s", err, tc.inputErr)
				}
				// Upstream confirms a counted allocation as it is.
				countedConfirmed(ctx, t, opts, claims)
			})
		})
	}
}

// TestUnsetAllocationModeIsUpstreamsError: a request whose allocation mode
// is unset (an object that the API server did not default) is refused by
// upstream on every node; topodra does not read it as ExactCount, and
// reports upstream's error from Allocate (not from Verify, later).
func TestUnsetAllocationModeIsUpstreamsError(t *testing.T) {
	exact := claim("c").request("r", "gpu", 1).obj()
	exact.Spec.Devices.Requests[0].Exactly.AllocationMode = ""
	prioritized := firstAvailableClaim(1, 2)
	prioritized.Spec.Devices.Requests[0].FirstAvailable[1].AllocationMode = ""
	for name, c := range map[string]*resourceapi.ResourceClaim{"exact": exact, "later subrequest": prioritized} {
		t.Run(name, func(t *testing.T) {
			opts := Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "none"), ClassLister: defaultClasses,
				Slices: dgx("node-a"), CELCache: newCELCache(), Policy: DefaultPolicy()}
			withCounting(t, opts, func(t *testing.T, opts Options) {
				ctx := quietContext(t)
				claims := []*resourceapi.ResourceClaim{c}
				allocateLikeUpstream(ctx, t, opts, claims, true)
				a, err := New(ctx, opts)
				if err != nil {
					t.Fatal(err)
				}
				res, err := a.Allocate(ctx, node("node-a"), claims)
				if err == nil || !strings.Contains(err.Error(), "unsupported count mode") {
					t.Errorf("Allocate: %v, %+v; want upstream's error", err, res)
				}
			})
		})
	}
}

// TestCapacityErrorOnlyWhereUpstreamReachesIt: with consumable capacity,
// upstream checks the capacity of every device its search selects, and a
// capacity it cannot use (a negative value stored before stricter
// validation) is an error there. topodra's preferred order may get to
// such a device before upstream's does; it allocates where upstream does
// and fails where upstream fails.
func TestCapacityErrorOnlyWhereUpstreamReachesIt(t *testing.T) {
	negative := resource.MustParse("-1")
	gpus := func(badIndex int) []*resourceapi.ResourceSlice {
		var devs []resourceapi.Device
		for i, root := range []string{"pci0", "pci1", "pci1", "pci0"} {
			d := device(fmt.Sprintf("gpu-%d", i), attrs{topology.AttrPCIeRoot: str(root)})
			if i == badIndex {
				d.Capacity = map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"mem": {Value: negative}}
			}
			devs = append(devs, d)
		}
		return []*resourceapi.ResourceSlice{slice("node-a", gpuDriver, devs...)}
	}
	testcases := map[string]struct {
		slices  []*resourceapi.ResourceSlice
		inUse   []string
		count   int64
		wantErr bool
	}{
		// Best fit prefers gpu-1, the last free device of pci1.
		"preferred device, upstream finds another first": {slices: gpus(1), inUse: []string{"gpu-2"}, count: 1},
		"upstream's first device":                        {slices: gpus(0), inUse: []string{"gpu-2"}, count: 1, wantErr: true},
		"two devices, upstream gets to it":               {slices: gpus(1), count: 2, wantErr: true},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			opts := Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "node-a", tc.inUse...), ClassLister: defaultClasses,
				Slices: tc.slices, CELCache: newCELCache(), Policy: DefaultPolicy()}
			withCounting(t, opts, func(t *testing.T, opts Options) {
				claims := []*resourceapi.ResourceClaim{claim("c").request("r", "gpu", tc.count).obj()}
				allocateLikeUpstream(quietContext(t), t, opts, claims, tc.wantErr)
			})
		})
	}
}

// TestCapacityCheckFailsWhereUpstreamErrs: capacityCheckFails is true for
// every device and request on which upstream's capacity check reports an
// error (upstream allocates the one device or errs), and false for
// ordinary capacities.
func TestCapacityCheckFailsWhereUpstreamErrs(t *testing.T) {
	q := resource.MustParse
	qp := func(s string) *resource.Quantity { v := q(s); return &v }
	rangePolicy := func(min, step string) *resourceapi.CapacityRequestPolicy {
		p := &resourceapi.CapacityRequestPolicy{ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: qp(min)}}
		if step != "" {
			p.ValidRange.Step = qp(step)
		}
		return p
	}
	testcases := map[string]struct {
		capacity resourceapi.DeviceCapacity
		request  string // "": none
		want     bool
	}{
		"plain":                               {capacity: resourceapi.DeviceCapacity{Value: q("80Gi")}},
		"plain, requested":                    {capacity: resourceapi.DeviceCapacity{Value: q("80Gi")}, request: "10Gi"},
		"negative value":                      {capacity: resourceapi.DeviceCapacity{Value: q("-1")}, want: true},
		"negative value, requested":           {capacity: resourceapi.DeviceCapacity{Value: q("-1")}, request: "1"},
		"negative default":                    {capacity: resourceapi.DeviceCapacity{Value: q("10"), RequestPolicy: &resourceapi.CapacityRequestPolicy{Default: qp("-1")}}, want: true},
		"negative request":                    {capacity: resourceapi.DeviceCapacity{Value: q("10")}, request: "-1", want: true},
		"range with step":                     {capacity: resourceapi.DeviceCapacity{Value: q("100"), RequestPolicy: rangePolicy("10", "10")}, request: "15"},
		"range, request past int64":           {capacity: resourceapi.DeviceCapacity{Value: q("100"), RequestPolicy: rangePolicy("10", "10")}, request: "10e18", want: true},
		"fractional range, sub-milli request": {capacity: resourceapi.DeviceCapacity{Value: q("100"), RequestPolicy: rangePolicy("0.5", "0.5")}, request: "1.0001", want: true},
		"valid values":                        {capacity: resourceapi.DeviceCapacity{Value: q("100"), RequestPolicy: &resourceapi.CapacityRequestPolicy{ValidValues: []resource.Quantity{q("10"), q("50")}}}, request: "20"},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			ctx := quietContext(t)
			d := device("gpu-0", attrs{})
			d.AllowMultipleAllocations = ptr.To(true)
			d.Capacity = map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"mem": tc.capacity}
			c := claim("c").request("r", "gpu", 1).obj()
			var request *resourceapi.CapacityRequirements
			if tc.request != "" {
				request = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{"mem": q(tc.request)}}
				c.Spec.Devices.Requests[0].Exactly.Capacity = request
			}
			up, err := structured.NewAllocator(ctx, allFeatures, *allocated(gpuDriver, "none"), defaultClasses, []*resourceapi.ResourceSlice{slice("node-a", gpuDriver, d)}, newCELCache())
			if err != nil {
				t.Fatal(err)
			}
			_, upErr := up.Allocate(ctx, node("node-a"), []*resourceapi.ResourceClaim{c})
			got := capacityCheckFails(request, d.Capacity)
			t.Logf("upstream error: %v", upErr)
			if upErr != nil && !got {
				t.Errorf("upstream errs, capacityCheckFails is false")
			}
			if got != tc.want {
				t.Errorf("capacityCheckFails = %v, want %v", got, tc.want)
			}
		})
	}
}

// stableOnly enables only what upstream's "stable" allocator implements,
// so that NewAllocator picks it.
var stableOnly = structured.Features{AdminAccess: true, PrioritizedList: true, PartitionableDevices: true, DeviceTaints: true}

// TestUnparsableCounterSetSliceSelectorLikeUpstream: upstream's stable
// allocator reads every slice with shared counters, on every node, without
// looking at its node selection, so a node selector there that it cannot
// parse fails nothing; the other allocators select such a slice by node
// like any other, and the node selector fails every node.
func TestUnparsableCounterSetSliceSelectorLikeUpstream(t *testing.T) {
	unparsable := &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{
		{Key: "gen", Operator: v1.NodeSelectorOpGt, Values: []string{"abc"}}}}}}
	counterSet := func(pool string, count int64) *resourceapi.ResourceSlice {
		s := slice(pool, gpuDriver)
		s.Name += "-counters"
		s.Spec.NodeName = nil
		s.Spec.NodeSelector = unparsable
		s.Spec.Pool.ResourceSliceCount = count
		s.Spec.SharedCounters = []resourceapi.CounterSet{{Name: "mem", Counters: map[string]resourceapi.Counter{"mem": {Value: resource.MustParse("80")}}}}
		return s
	}
	// node-a's GPU pool: a whole GPU and a partition that consumes the
	// pool's counters.
	partitioned := func() []*resourceapi.ResourceSlice {
		whole := device("gpu-0", attrs{topology.AttrPCIeRoot: str("pci0")})
		part := device("gpu-0-p0", attrs{topology.AttrPCIeRoot: str("pci0")})
		part.ConsumesCounters = []resourceapi.DeviceCounterConsumption{{CounterSet: "mem", Counters: map[string]resourceapi.Counter{"mem": {Value: resource.MustParse("40")}}}}
		devices := slice("node-a", gpuDriver, whole, part)
		devices.Spec.Pool.ResourceSliceCount = 2
		return []*resourceapi.ResourceSlice{devices, counterSet("node-a", 2)}
	}
	// node-a's plain GPU pool and a pool of counter sets only.
	counterSetPool := func(count int64) []*resourceapi.ResourceSlice {
		return append(plainGPUs("node-a", 2), counterSet("elsewhere", count))
	}
	testcases := map[string]struct {
		slices   []*resourceapi.ResourceSlice
		features structured.Features
		count    int64 // 0: All
		wantErr  bool
		// refused: upstream refuses the All request for an incomplete
		// pool, which topodra reports as the node's failure.
		refused bool
	}{
		"stable, the node's pool":                     {slices: partitioned(), features: stableOnly, count: 2},
		"stable, a pool of counter sets":              {slices: counterSetPool(1), features: stableOnly, count: 1},
		"stable, incomplete pool of counter sets":     {slices: counterSetPool(2), features: stableOnly, count: 1},
		"stable, all devices":                         {slices: counterSetPool(1), features: stableOnly},
		"stable, all devices, incomplete pool":        {slices: counterSetPool(2), features: stableOnly, refused: true},
		"stable, without partitionable devices":       {slices: counterSetPool(1), features: structured.Features{AdminAccess: true, PrioritizedList: true, DeviceTaints: true}, count: 1},
		"other allocators, the node's pool":           {slices: partitioned(), features: allFeatures, count: 1, wantErr: true},
		"other allocators, a pool of counter sets":    {slices: counterSetPool(1), features: allFeatures, count: 1, wantErr: true},
		"other allocators, partitionable devices off": {slices: counterSetPool(1), features: func() structured.Features { f := allFeatures; f.PartitionableDevices = false; return f }(), count: 1},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			opts := Options{Features: tc.features, AllocatedState: allocated(gpuDriver, "none"), ClassLister: defaultClasses,
				Slices: tc.slices, CELCache: newCELCache(), Policy: DefaultPolicy()}
			withCounting(t, opts, func(t *testing.T, opts Options) {
				c := claim("c").request("r", "gpu", tc.count).obj()
				if tc.count == 0 {
					c.Spec.Devices.Requests[0].Exactly.AllocationMode = resourceapi.DeviceAllocationModeAll
				}
				if tc.refused {
					ctx := quietContext(t)
					up, err := structured.NewAllocator(ctx, opts.Features, *opts.AllocatedState, opts.ClassLister, opts.Slices, newCELCache())
					if err != nil {
						t.Fatal(err)
					}
					if _, err := up.Allocate(ctx, node("node-a"), []*resourceapi.ResourceClaim{c}); !refusesAllForPool(err) {
						t.Fatalf("upstream: %v; the case expects a refusal for the pool", err)
					}
					a, err := New(ctx, opts)
					if err != nil {
						t.Fatal(err)
					}
					res, err := a.Allocate(ctx, node("node-a"), []*resourceapi.ResourceClaim{c})
					if err != nil {
						t.Fatalf("topodra: %v; want no allocation on the node, without error", err)
					}
					if res.Allocations != nil {
						t.Errorf("topodra allocates %v; want no allocation on the node", deviceNames(res.Allocations))
					}
					return
				}
				allocateLikeUpstream(quietContext(t), t, opts, []*resourceapi.ResourceClaim{c}, tc.wantErr)
			})
		})
	}
}

// TestCapacityRequestPolicyOfUnshareableDevice: with consumable capacity,
// upstream's capacity check passes over a device without an error where
// the capacity that a request without capacity requests would consume
// breaks the capacity's request policy or exceeds its value. API
// validation allows request policies only on devices that allow multiple
// allocations, which counting leaves to upstream; a stored device that
// has one all the same is left to upstream too, so that Verify confirms
// what Allocate chose.
func TestCapacityRequestPolicyOfUnshareableDevice(t *testing.T) {
	qp := func(s string) *resource.Quantity { return ptr.To(resource.MustParse(s)) }
	gpus := func(c resourceapi.DeviceCapacity) []*resourceapi.ResourceSlice {
		var devs []resourceapi.Device
		for i, root := range []string{"pci0", "pci1", "pci1", "pci0"} {
			d := device(fmt.Sprintf("gpu-%d", i), attrs{topology.AttrPCIeRoot: str(root)})
			if i == 0 {
				// Counting picks it for one device.
				d.Capacity = map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"mem": c}
			}
			devs = append(devs, d)
		}
		return []*resourceapi.ResourceSlice{slice("node-a", gpuDriver, devs...)}
	}
	testcases := map[string]struct {
		capacity resourceapi.DeviceCapacity
		count    int64
	}{
		"value not a valid value": {capacity: resourceapi.DeviceCapacity{Value: resource.MustParse("80"),
			RequestPolicy: &resourceapi.CapacityRequestPolicy{ValidValues: []resource.Quantity{resource.MustParse("10")}}}, count: 1},
		"value beyond the valid range": {capacity: resourceapi.DeviceCapacity{Value: resource.MustParse("80"),
			RequestPolicy: &resourceapi.CapacityRequestPolicy{ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: qp("10"), Max: qp("40")}}}, count: 1},
		"default beyond the value": {capacity: resourceapi.DeviceCapacity{Value: resource.MustParse("80"),
			RequestPolicy: &resourceapi.CapacityRequestPolicy{Default: qp("100")}}, count: 1},
		"three devices": {capacity: resourceapi.DeviceCapacity{Value: resource.MustParse("80"),
			RequestPolicy: &resourceapi.CapacityRequestPolicy{Default: qp("100")}}, count: 3},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			opts := Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "node-a", "gpu-2"), ClassLister: defaultClasses,
				Slices: gpus(tc.capacity), CELCache: newCELCache(), Policy: DefaultPolicy()}
			withCounting(t, opts, func(t *testing.T, opts Options) {
				ctx := quietContext(t)
				claims := []*resourceapi.ResourceClaim{claim("c").request("r", "gpu", tc.count).obj()}
				allocateLikeUpstream(ctx, t, opts, claims, false)
				countedConfirmed(ctx, t, opts, claims)
			})
		})
	}
}

// countedConfirmed checks that upstream's allocator, through Verify,
// confirms an allocation that counting makes on node-a as it is.
func countedConfirmed(ctx context.Context, t *testing.T, opts Options, claims []*resourceapi.ResourceClaim) {
	t.Helper()
	a, err := New(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	res, err := a.Allocate(ctx, node("node-a"), claims)
	if err != nil || !res.Unverified {
		return
	}
	if v, err := a.Verify(ctx, node("node-a"), claims, res); err != nil || v.CountingRefused {
		t.Errorf("upstream refused the counted allocation %v: %v", deviceNames(res.Allocations), err)
	}
}
