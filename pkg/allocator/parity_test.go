package allocator

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

var (
	parityCases = flag.Int("parity.cases", 2000, "number of random cases in TestParityWithUpstream")
	paritySeed  = flag.Uint64("parity.seed", 1, "seed of TestParityWithUpstream")
)

// parityCase is one random cluster, pod and allocation state.
type parityCase struct {
	node     *v1.Node
	slices   []*resourceapi.ResourceSlice
	classes  classLister
	claims   []*resourceapi.ResourceClaim
	state    *structured.AllocatedState
	features structured.Features
	policy   Policy
	// kinds names what the case exercises, for the coverage summary.
	kinds []string
}

// describe renders a case for failure messages.
func (pc *parityCase) describe() string {
	var b strings.Builder
	fmt.Fprintf(&b, "features %v\n", sets.List(pc.features.Set()))
	for _, s := range pc.slices {
		fmt.Fprintf(&b, "slice %s driver=%s pool=%s gen=%d count=%d node=%v all=%v sel=%v counters=%d:", s.Name, s.Spec.Driver, s.Spec.Pool.Name,
			s.Spec.Pool.Generation, s.Spec.Pool.ResourceSliceCount, ptr.Deref(s.Spec.NodeName, ""), ptr.Deref(s.Spec.AllNodes, false), s.Spec.NodeSelector != nil, len(s.Spec.SharedCounters))
		for _, cs := range s.Spec.SharedCounters {
			fmt.Fprintf(&b, " set %s", cs.Name)
		}
		for _, d := range s.Spec.Devices {
			fmt.Fprintf(&b, " %s{", d.Name)
			keys := make([]string, 0, len(d.Attributes))
			for k := range d.Attributes {
				keys = append(keys, string(k))
			}
			sort.Strings(keys)
			for _, k := range keys {
				v, _ := topology.DomainValue(d.Attributes[resourceapi.QualifiedName(k)])
				fmt.Fprintf(&b, "%s=%s ", k, v)
			}
			if len(d.Taints) > 0 {
				fmt.Fprintf(&b, "tainted ")
			}
			if d.NodeName != nil {
				fmt.Fprintf(&b, "node=%s ", *d.NodeName)
			}
			if d.NodeSelector != nil {
				fmt.Fprintf(&b, "nodeSelector=%v ", d.NodeSelector.NodeSelectorTerms[0].MatchExpressions)
			}
			for _, c := range d.ConsumesCounters {
				fmt.Fprintf(&b, "counters=%s%v ", c.CounterSet, c.CompatibilityGroups)
			}
			if ptr.Deref(d.AllowMultipleAllocations, false) {
				fmt.Fprintf(&b, "shareable ")
			}
			capNames := make([]string, 0, len(d.Capacity))
			for name := range d.Capacity {
				capNames = append(capNames, string(name))
			}
			sort.Strings(capNames)
			for _, name := range capNames {
				c := d.Capacity[resourceapi.QualifiedName(name)]
				fmt.Fprintf(&b, "capacity %s=%s", name, c.Value.String())
				if c.RequestPolicy != nil && c.RequestPolicy.Default != nil {
					fmt.Fprintf(&b, "(default %s)", c.RequestPolicy.Default.String())
				}
				if c.RequestPolicy != nil && len(c.RequestPolicy.ValidValues) > 0 {
					fmt.Fprintf(&b, "(valid %v)", c.RequestPolicy.ValidValues)
				}
				b.WriteString(" ")
			}
			b.WriteString("}")
		}
		b.WriteString("\n")
	}
	for id := range pc.state.AllocatedDevices {
		fmt.Fprintf(&b, "allocated %s\n", id)
	}
	for _, c := range pc.claims {
		fmt.Fprintf(&b, "claim %s annotations=%v constraints=%d:", c.Name, c.Annotations, len(c.Spec.Devices.Constraints))
		for _, r := range c.Spec.Devices.Requests {
			if r.Exactly != nil {
				fmt.Fprintf(&b, " %s(%s %s x%d sel=%d admin=%v tol=%d", r.Name, r.Exactly.DeviceClassName, r.Exactly.AllocationMode, r.Exactly.Count, len(r.Exactly.Selectors), ptr.Deref(r.Exactly.AdminAccess, false), len(r.Exactly.Tolerations))
				if r.Exactly.Capacity != nil {
					for name, q := range r.Exactly.Capacity.Requests {
						fmt.Fprintf(&b, " capacity %s=%s", name, q.String())
					}
				}
				b.WriteString(")")
			}
			for _, s := range r.FirstAvailable {
				fmt.Fprintf(&b, " %s/%s(%s %s x%d sel=%d)", r.Name, s.Name, s.DeviceClassName, s.AllocationMode, s.Count, len(s.Selectors))
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}

// genCase builds a random case. Everything comes from rnd.
func genCase(rnd *rand.Rand) *parityCase {
	pc := &parityCase{
		node: node("node-a"),
		classes: classes(class("gpu", `device.driver == "`+gpuDriver+`"`), class("nic", `device.driver == "`+nicDriver+`"`), class("any"), class("fast", `"mem" in device.attributes["`+gpuDriver+`"] && device.attributes["`+gpuDriver+`"].mem >= 40`),
			class("multi", `"model" in device.attributes["`+gpuDriver+`"] && device.attributes["`+gpuDriver+`"].model == "m"`)),
		features: allFeatures,
		policy:   DefaultPolicy(),
		state:    allocated(gpuDriver, "none"),
	}
	pc.node.Labels["zone"] = []string{"z1", "z2"}[rnd.IntN(2)]
	if rnd.IntN(6) == 0 {
		pc.features.PartitionableDevices = false
	}
	if rnd.IntN(6) == 0 {
		pc.features.DeviceTaints = false
	}
	if rnd.IntN(6) == 0 {
		pc.features.ListTypeAttributes = false
	}
	if rnd.IntN(6) == 0 {
		pc.features.DeviceBindingAndStatus = false
	}
	if rnd.IntN(2) == 0 {
		pc.features.CompatibilityGroups = true
	}
	stable := rnd.IntN(10) == 0
	if stable {
		pc.kinds = append(pc.kinds, "stable allocator")
		// Only what upstream's "stable" allocator implements: it is the
		// one that runs then, and it gathers counter sets differently.
		pc.features = structured.Features{AdminAccess: true, PrioritizedList: true, PartitionableDevices: rnd.IntN(4) > 0, DeviceTaints: true}
	}
	if rnd.IntN(4) == 0 {
		pc.policy.Packing = false
	}
	if rnd.IntN(5) == 0 {
		pc.policy.Attributes = []resourceapi.QualifiedName{topology.AttrNUMANode, topology.AttrPCIeRoot}
	}
	listAttrs := false
	// Some cases have devices with odd capacities.
	oddCapacities := rnd.IntN(8) == 0
	uid := 0
	newSlice := func(name, driver, pool string, nodeName string, gen, count int64) *resourceapi.ResourceSlice {
		uid++
		s := &resourceapi.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID(fmt.Sprintf("%s-%d-%d", name, rnd.Uint64(), uid)), Generation: 1},
			Spec: resourceapi.ResourceSliceSpec{
				Driver: driver,
				Pool:   resourceapi.ResourcePool{Name: pool, Generation: gen, ResourceSliceCount: count},
			},
		}
		if nodeName != "" {
			s.Spec.NodeName = ptr.To(nodeName)
		}
		return s
	}
	randDevice := func(driver, name string) resourceapi.Device {
		a := attrs{}
		switch k := rnd.IntN(3); {
		case rnd.IntN(12) == 0:
			// The same value, typed differently: never equal upstream.
			a[topology.AttrPCIeRoot] = num(int64(k))
		case rnd.IntN(5) > 0:
			a[topology.AttrPCIeRoot] = str(fmt.Sprintf("pci%d", k))
		}
		switch rnd.IntN(4) {
		case 0:
		case 1:
			a[topology.AttrNUMANode] = nums(int64(rnd.IntN(2)), int64(rnd.IntN(2)))
			listAttrs = true
		default:
			a[topology.AttrNUMANode] = num(int64(rnd.IntN(2)))
		}
		if driver == gpuDriver {
			if rnd.IntN(3) > 0 {
				a["nvlinkClique"] = str(fmt.Sprintf("c%d", rnd.IntN(2)))
			}
			a["mem"] = num([]int64{24, 40, 80}[rnd.IntN(3)])
			a["model"] = str([]string{"a", "b"}[rnd.IntN(2)])
		}
		d := resourceapi.Device{Name: name, Attributes: a}
		if rnd.IntN(8) == 0 {
			d.Taints = []resourceapi.DeviceTaint{{Key: "health", Value: "bad", Effect: []resourceapi.DeviceTaintEffect{resourceapi.DeviceTaintEffectNoSchedule, resourceapi.DeviceTaintEffectNoExecute, resourceapi.DeviceTaintEffectNone}[rnd.IntN(3)]}}
		}
		if driver == nicDriver && rnd.IntN(3) == 0 && pc.features.ConsumableCapacity {
			// Consumable capacity: a shareable NIC.
			d.AllowMultipleAllocations = ptr.To(true)
			d.Capacity = map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"bandwidth": {Value: resource.MustParse("100")}}
		}
		if oddCapacities && rnd.IntN(6) == 0 {
			// Capacities that objects stored before stricter validation
			// may have.
			name := resourceapi.QualifiedName([]string{"bandwidth", "mem"}[rnd.IntN(2)])
			var c resourceapi.DeviceCapacity
			switch rnd.IntN(4) {
			case 0, 1:
				// A negative value: with consumable capacity, upstream's
				// capacity check fails on the device where its search
				// selects it.
				pc.kinds = append(pc.kinds, "negative capacity")
				c = resourceapi.DeviceCapacity{Value: resource.MustParse("-1")}
			case 2:
				// A negative default, for requests that ask for none.
				pc.kinds = append(pc.kinds, "negative capacity")
				c = resourceapi.DeviceCapacity{Value: resource.MustParse("100"), RequestPolicy: &resourceapi.CapacityRequestPolicy{Default: ptr.To(resource.MustParse("-10"))}}
			case 3:
				// A request policy that the value breaks, also on a
				// device that may not be shared: upstream's capacity
				// check passes over the device for requests that ask
				// for none.
				pc.kinds = append(pc.kinds, "capacity request policy")
				c = resourceapi.DeviceCapacity{Value: resource.MustParse("100"), RequestPolicy: &resourceapi.CapacityRequestPolicy{ValidValues: []resource.Quantity{resource.MustParse("10")}}}
			}
			if d.Capacity == nil {
				d.Capacity = map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{}
			}
			d.Capacity[name] = c
		}
		return d
	}
	shareable := sets.New[structured.DeviceID]()
	var allDevices []structured.DeviceID
	addDevices := func(s *resourceapi.ResourceSlice, n int, prefix string) {
		for i := range n {
			name := fmt.Sprintf("%s%d", prefix, i)
			if rnd.IntN(60) == 0 && i > 0 {
				name = fmt.Sprintf("%s%d", prefix, i-1) // duplicate name: invalid pool
			}
			d := randDevice(s.Spec.Driver, name)
			s.Spec.Devices = append(s.Spec.Devices, d)
			id := structured.MakeDeviceID(s.Spec.Driver, s.Spec.Pool.Name, name)
			allDevices = append(allDevices, id)
			if ptr.Deref(d.AllowMultipleAllocations, false) {
				shareable.Insert(id)
			}
		}
	}

	// GPU pool of node-a: one or two slices, maybe partitionable with
	// counters, maybe incomplete, maybe with an outdated slice.
	nSlices := int64(1 + rnd.IntN(2))
	count := nSlices
	if rnd.IntN(15) == 0 {
		count++ // incomplete
	}
	withCounters := rnd.IntN(4) == 0
	// invalidKind makes the counters of the pool invalid upstream, or
	// (compatibility groups) incomplete while that feature is off.
	invalidKind := 0
	if withCounters {
		invalidKind = rnd.IntN(10)
		count++
		cs := newSlice("a-gpu-counters", gpuDriver, "node-a", "node-a", 2, count)
		cs.Spec.SharedCounters = []resourceapi.CounterSet{{Name: "gpu-mem", Counters: map[string]resourceapi.Counter{"mem": {Value: resource.MustParse(fmt.Sprintf("%d", 80+rnd.IntN(80)))}}}}
		if rnd.IntN(10) == 0 {
			// A node selector that cannot be parsed: the stable
			// allocator never parses it, the others fail every node.
			pc.kinds = append(pc.kinds, "unparsable counter-set node selector")
			cs.Spec.NodeName = nil
			cs.Spec.NodeSelector = &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{{Key: "zone", Operator: v1.NodeSelectorOpGt, Values: []string{"z1"}}}}}}
		}
		pc.slices = append(pc.slices, cs)
		if invalidKind == 1 {
			// A second counter set of the same name.
			count++
			dup := newSlice("a-gpu-counters-2", gpuDriver, "node-a", "", 2, count)
			dup.Spec.AllNodes = ptr.To(true)
			dup.Spec.SharedCounters = []resourceapi.CounterSet{{Name: "gpu-mem", Counters: map[string]resourceapi.Counter{"mem": {Value: resource.MustParse("80")}}}}
			pc.slices = append(pc.slices, dup)
		}
	}
	var gpuSlices []*resourceapi.ResourceSlice
	for i := range nSlices {
		s := newSlice(fmt.Sprintf("a-gpu-%d", i), gpuDriver, "node-a", "node-a", 2, count)
		addDevices(s, 2+rnd.IntN(7), fmt.Sprintf("gpu-%d-", i))
		if withCounters {
			// Partitions (model "p", 24 GB) consume counters; whole
			// GPUs do not, so that counting decides for pods that
			// select whole GPUs.
			for j := range s.Spec.Devices {
				if j == 0 || rnd.IntN(2) == 0 {
					s.Spec.Devices[j].Attributes["model"] = str("p")
					s.Spec.Devices[j].Attributes["mem"] = num(24)
					s.Spec.Devices[j].ConsumesCounters = []resourceapi.DeviceCounterConsumption{{CounterSet: "gpu-mem", Counters: map[string]resourceapi.Counter{"mem": {Value: resource.MustParse("40")}}}}
				}
			}
		}
		pc.slices = append(pc.slices, s)
		gpuSlices = append(gpuSlices, s)
	}
	if withCounters {
		// One partition, which may or may not match the pod's requests.
		s := gpuSlices[rnd.IntN(len(gpuSlices))]
		d := &s.Spec.Devices[0]
		pc.kinds = append(pc.kinds, []string{"counters", "duplicate counter set", "missing counter set", "missing counter", "compatibility groups", "compatibility groups", "counters", "counters", "counters", "counters"}[invalidKind])
		switch invalidKind {
		case 2:
			d.ConsumesCounters[0].CounterSet = "gone"
		case 3:
			d.ConsumesCounters[0].Counters = map[string]resourceapi.Counter{"bandwidth": {Value: resource.MustParse("1")}}
		case 4, 5:
			d.ConsumesCounters[0].CompatibilityGroups = []string{"g1"}
		}
	}
	if rnd.IntN(5) == 0 {
		// A pool across two nodes whose driver publishes a generation
		// per node: node-a's may be older, newer, complete on its own or
		// not.
		want := int64(1 + rnd.IntN(2))
		pc.kinds = append(pc.kinds, "generation per node")
		for _, n := range []string{"node-a", "node-b"} {
			s := newSlice("multi-"+n, gpuDriver, "multi", n, int64(1+rnd.IntN(2)), want)
			addDevices(s, 1+rnd.IntN(3), "m-"+n+"-")
			for j := range s.Spec.Devices {
				s.Spec.Devices[j].Attributes["model"] = str("m")
			}
			pc.slices = append(pc.slices, s)
		}
	}
	if rnd.IntN(6) == 0 {
		old := newSlice("a-gpu-old", gpuDriver, "node-a", "node-a", 1, 1)
		addDevices(old, 2, "old-")
		pc.slices = append(pc.slices, old)
	}
	// NIC pool of node-a, maybe with binding conditions (such pools come
	// last in upstream's order).
	if rnd.IntN(3) > 0 {
		s := newSlice("a-nic", nicDriver, "node-a", "node-a", 1, 1)
		addDevices(s, 1+rnd.IntN(3), "nic-")
		if rnd.IntN(6) == 0 {
			for j := range s.Spec.Devices {
				s.Spec.Devices[j].BindingConditions = []string{"attached"}
				s.Spec.Devices[j].BindingFailureConditions = []string{"failed"}
			}
		}
		pc.slices = append(pc.slices, s)
	}
	// Another node's pool, which must never be used.
	other := newSlice("b-gpu", gpuDriver, "node-b", "node-b", 1, 1)
	addDevices(other, 2, "gpu-")
	pc.slices = append(pc.slices, other)
	// Network-attached devices: all nodes, or a zone by node selector.
	if rnd.IntN(3) == 0 {
		s := newSlice("net-all", nicDriver, "net", "", 1, 1)
		s.Spec.AllNodes = ptr.To(true)
		addDevices(s, 1+rnd.IntN(2), "net-")
		pc.slices = append(pc.slices, s)
	}
	if rnd.IntN(3) == 0 {
		s := newSlice("zone-gpus", gpuDriver, "zone", "", 1, 1)
		s.Spec.NodeSelector = &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{{Key: "zone", Operator: v1.NodeSelectorOpIn, Values: []string{"z1"}}}}}}
		addDevices(s, 1+rnd.IntN(2), "zgpu-")
		pc.slices = append(pc.slices, s)
	}
	if rnd.IntN(4) == 0 {
		// Per-device node selection: a pool shared by node-a and node-b.
		s := newSlice("per-device", gpuDriver, "per-device", "", 1, 1)
		s.Spec.PerDeviceNodeSelection = ptr.To(true)
		addDevices(s, 2+rnd.IntN(4), "pd-")
		for j := range s.Spec.Devices {
			switch rnd.IntN(8) {
			case 0, 1:
				s.Spec.Devices[j].NodeName = ptr.To("node-a")
			case 2, 3:
				s.Spec.Devices[j].NodeName = ptr.To("node-b")
			case 4:
				// The device's own node selector: node-a's zone or not.
				pc.kinds = append(pc.kinds, "device node selector")
				s.Spec.Devices[j].NodeSelector = &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{{Key: "zone", Operator: v1.NodeSelectorOpIn, Values: []string{"z1"}}}}}}
				if rnd.IntN(5) == 0 && !stable {
					// One that cannot be parsed: upstream fails where it
					// gets to the device (which depends on the order of
					// pools, a map's for the stable allocator).
					pc.kinds = append(pc.kinds, "unparsable device node selector")
					s.Spec.Devices[j].NodeSelector.NodeSelectorTerms[0].MatchExpressions[0] = v1.NodeSelectorRequirement{Key: "zone", Operator: v1.NodeSelectorOpGt, Values: []string{"z1"}}
				}
			default:
				s.Spec.Devices[j].AllNodes = ptr.To(true)
			}
		}
		pc.slices = append(pc.slices, s)
	}
	rnd.Shuffle(len(pc.slices), func(i, j int) { pc.slices[i], pc.slices[j] = pc.slices[j], pc.slices[i] })
	if listAttrs && pc.features.ListTypeAttributes {
		pc.kinds = append(pc.kinds, "list-type attributes")
	}
	if slices.Contains(pc.kinds, "compatibility groups") && !pc.features.CompatibilityGroups {
		pc.kinds = append(pc.kinds, "compatibility groups, feature off")
	}
	if slices.Contains(pc.kinds, "negative capacity") && pc.features.ConsumableCapacity {
		pc.kinds = append(pc.kinds, "negative capacity, consumable capacity")
	}
	if slices.Contains(pc.kinds, "capacity request policy") && pc.features.ConsumableCapacity {
		pc.kinds = append(pc.kinds, "capacity request policy, consumable capacity")
	}
	if slices.ContainsFunc(pc.slices, func(s *resourceapi.ResourceSlice) bool { return len(s.Spec.SharedCounters) > 0 }) && !pc.features.PartitionableDevices {
		pc.kinds = append(pc.kinds, "counter sets, feature off")
	}

	// Prior allocations.
	for _, id := range allDevices {
		switch {
		case shareable.Has(id) && rnd.IntN(2) == 0:
			// Partly consumed by an earlier claim.
			uid := types.UID(fmt.Sprintf("share-%d", rnd.IntN(1000)))
			pc.state.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(id, &uid))
			q := resource.MustParse(fmt.Sprintf("%d", 20+rnd.IntN(70)))
			pc.state.AggregatedCapacity[id] = structured.ConsumedCapacity{"bandwidth": &q}
		case !shareable.Has(id) && rnd.IntN(6) == 0:
			pc.state.AllocatedDevices.Insert(id)
		}
	}

	// Claims.
	nClaims := []int{1, 1, 2, 2, 3}[rnd.IntN(5)]
	for ci := range nClaims {
		b := claim(fmt.Sprintf("claim-%d", ci))
		switch rnd.IntN(6) {
		case 0:
			b.annotate(topology.AnnotationAlignment, "none")
		case 1:
			b.annotate(topology.AnnotationAlignWith, "pod")
		}
		nReq := []int{1, 1, 1, 2}[rnd.IntN(4)]
		for ri := range nReq {
			name := fmt.Sprintf("req-%d", ri)
			cls := []string{"gpu", "gpu", "gpu", "gpu", "nic", "any", "fast", "fast", "multi"}[rnd.IntN(9)]
			var sels []string
			if rnd.IntN(4) == 0 {
				sels = append(sels, `"model" in device.attributes["`+gpuDriver+`"] && device.attributes["`+gpuDriver+`"].model == "a"`)
			}
			if rnd.IntN(5) == 0 && pc.features.PrioritizedList {
				pc.kinds = append(pc.kinds, "firstAvailable")
				r := resourceapi.DeviceRequest{Name: name}
				for si := range 2 {
					r.FirstAvailable = append(r.FirstAvailable, resourceapi.DeviceSubRequest{
						Name: fmt.Sprintf("s%d", si), DeviceClassName: cls,
						AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: int64(2 - si + rnd.IntN(2)),
					})
				}
				if rnd.IntN(5) == 0 && !stable {
					// Upstream compiles it only where its search gets to
					// the later subrequest (which depends on the order of
					// pools, as above).
					pc.kinds = append(pc.kinds, "uncompilable later subrequest")
					r.FirstAvailable[1].Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: `device.attributes["` + gpuDriver + `"].nosuchfunc()`}}}
				}
				b.c.Spec.Devices.Requests = append(b.c.Spec.Devices.Requests, r)
				continue
			}
			b.request(name, cls, []int64{1, 1, 2, 2, 3, 4}[rnd.IntN(6)], sels...)
			r := b.c.Spec.Devices.Requests[len(b.c.Spec.Devices.Requests)-1].Exactly
			// The stable allocator orders pools by map iteration, and an
			// All request that breaks a constraint is a fatal error there,
			// so whether it errors depends on that order.
			if rnd.IntN(12) == 0 && !stable {
				r.AllocationMode = resourceapi.DeviceAllocationModeAll
				r.Count = 0
			}
			if rnd.IntN(60) == 0 {
				// An object that the API server did not default.
				pc.kinds = append(pc.kinds, "unset allocation mode")
				r.AllocationMode = ""
			}
			if rnd.IntN(4) == 0 {
				r.Tolerations = []resourceapi.DeviceToleration{{Key: "health", Operator: resourceapi.DeviceTolerationOpExists}}
			}
			if rnd.IntN(25) == 0 {
				r.AdminAccess = ptr.To(true)
			}
			if cls == "nic" && rnd.IntN(2) == 0 && pc.features.ConsumableCapacity {
				r.Capacity = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{
					"bandwidth": resource.MustParse(fmt.Sprintf("%d", 10+rnd.IntN(60))),
				}}
			}
		}
		if len(b.c.Spec.Devices.Requests) > 1 || rnd.IntN(3) == 0 {
			var names []string
			for _, r := range b.c.Spec.Devices.Requests {
				names = append(names, r.Name)
			}
			switch rnd.IntN(8) {
			case 3:
				// Naming all requests is the same as naming none.
				b.c.Spec.Devices.Constraints = append(b.c.Spec.Devices.Constraints, resourceapi.DeviceConstraint{Requests: names, MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(topology.AttrPCIeRoot))})
			case 4:
				// Only the first request is constrained.
				b.c.Spec.Devices.Constraints = append(b.c.Spec.Devices.Constraints, resourceapi.DeviceConstraint{Requests: names[:1], MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(topology.AttrPCIeRoot))})
			case 5:
				// Two attributes; nvlinkClique is published by its
				// short name in the GPU driver's slices.
				b.c.Spec.Devices.Constraints = append(b.c.Spec.Devices.Constraints,
					resourceapi.DeviceConstraint{MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(topology.AttrPCIeRoot))},
					resourceapi.DeviceConstraint{MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(gpuDriver + "/nvlinkClique"))})
			}
			switch rnd.IntN(5) {
			case 0:
				b.c.Spec.Devices.Constraints = append(b.c.Spec.Devices.Constraints, resourceapi.DeviceConstraint{MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(topology.AttrPCIeRoot))})
			case 1:
				b.c.Spec.Devices.Constraints = append(b.c.Spec.Devices.Constraints, resourceapi.DeviceConstraint{MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(topology.AttrNUMANode))})
			case 2:
				if !pc.features.ConsumableCapacity {
					// The API server drops the field while the feature is off.
					break
				}
				b.c.Spec.Devices.Constraints = append(b.c.Spec.Devices.Constraints, resourceapi.DeviceConstraint{DistinctAttribute: ptr.To(resourceapi.FullyQualifiedName(gpuDriver + "/model"))})
			}
		}
		pc.claims = append(pc.claims, b.obj())
	}
	return pc
}

// checkValid verifies a topodra allocation independently of how it was
// found: every claim got results for its requests, no device is on another
// node or already in use (without admin access), and upstream allocates the
// same devices when only those devices are visible.
func checkValid(ctx context.Context, pc *parityCase, results []resourceapi.AllocationResult) error {
	if len(results) != len(pc.claims) {
		return fmt.Errorf("%d results for %d claims", len(results), len(pc.claims))
	}
	onlyNodeB := sets.New[structured.DeviceID]()
	for _, s := range pc.slices {
		for _, d := range s.Spec.Devices {
			if ptr.Deref(d.NodeName, "") == "node-b" {
				onlyNodeB.Insert(structured.MakeDeviceID(s.Spec.Driver, s.Spec.Pool.Name, d.Name))
			}
		}
	}
	chosen := sets.New[structured.DeviceID]()
	shared := false
	for ci, r := range results {
		admin := map[string]bool{}
		for _, req := range pc.claims[ci].Spec.Devices.Requests {
			if req.Exactly != nil && ptr.Deref(req.Exactly.AdminAccess, false) {
				admin[req.Name] = true
			}
		}
		for _, d := range r.Devices.Results {
			id := structured.MakeDeviceID(d.Driver, d.Pool, d.Device)
			if d.Pool == "node-b" {
				return fmt.Errorf("device %s belongs to another node", id)
			}
			if onlyNodeB.Has(id) {
				return fmt.Errorf("device %s is selected for node-b only", id)
			}
			if d.ShareID != nil {
				shared = true
			}
			if pc.state.AllocatedDevices.Has(id) && !admin[d.Request] {
				return fmt.Errorf("device %s is already allocated", id)
			}
			chosen.Insert(id)
		}
	}
	// Upstream, with only the chosen devices visible. Devices with
	// compatibility groups stay while that feature is off: upstream then
	// ignores their slices, and hiding them would change which slices and
	// generations it reads (it never allocates them).
	var restricted []*resourceapi.ResourceSlice
	for _, s := range pc.slices {
		c := *s
		c.Spec.Devices = nil
		for _, d := range s.Spec.Devices {
			compat := slices.ContainsFunc(d.ConsumesCounters, func(c resourceapi.DeviceCounterConsumption) bool { return len(c.CompatibilityGroups) > 0 })
			if chosen.Has(structured.MakeDeviceID(s.Spec.Driver, s.Spec.Pool.Name, d.Name)) || (compat && !pc.features.CompatibilityGroups) {
				c.Spec.Devices = append(c.Spec.Devices, d)
			}
		}
		restricted = append(restricted, &c)
	}
	up, err := structured.NewAllocator(ctx, pc.features, *pc.state, pc.classes, restricted, newCELCache())
	if err != nil {
		return err
	}
	// Pin firstAvailable requests to the subrequest topodra chose: with
	// fewer devices visible, upstream's first solution could otherwise
	// settle for a later subrequest.
	pinned := make([]*resourceapi.ResourceClaim, len(pc.claims))
	for ci, c := range pc.claims {
		c = c.DeepCopy()
		for ri := range c.Spec.Devices.Requests {
			req := &c.Spec.Devices.Requests[ri]
			for _, d := range results[ci].Devices.Results {
				for _, sub := range req.FirstAvailable {
					if d.Request == req.Name+"/"+sub.Name {
						req.Exactly = &resourceapi.ExactDeviceRequest{
							DeviceClassName: sub.DeviceClassName, Selectors: sub.Selectors,
							AllocationMode: sub.AllocationMode, Count: sub.Count, Tolerations: sub.Tolerations,
						}
					}
				}
			}
			req.FirstAvailable = nil
		}
		pinned[ci] = c
	}
	again, err := up.Allocate(ctx, pc.node, pinned)
	if err != nil {
		return fmt.Errorf("upstream on the chosen devices: %w", err)
	}
	if again == nil {
		return errors.New("upstream cannot allocate the claims with only the chosen devices")
	}
	againSet := sets.New[structured.DeviceID]()
	for _, r := range again {
		for _, d := range r.Devices.Results {
			againSet.Insert(structured.MakeDeviceID(d.Driver, d.Pool, d.Device))
		}
	}
	// Admin access may share devices with other requests, so upstream
	// can find a solution with fewer distinct devices there.
	anyAdmin := false
	for _, c := range pc.claims {
		for _, r := range c.Spec.Devices.Requests {
			anyAdmin = anyAdmin || (r.Exactly != nil && ptr.Deref(r.Exactly.AdminAccess, false))
		}
	}
	if !anyAdmin && !shared && !againSet.Equal(chosen) {
		return fmt.Errorf("upstream on the chosen devices picks %v, topodra %v", againSet.UnsortedList(), chosen.UnsortedList())
	}
	return nil
}

// quietContext logs only V(1) and below: the random tests run upstream
// thousands of times.
func quietContext(t *testing.T) context.Context {
	return klog.NewContext(context.Background(), ktesting.NewLogger(t, ktesting.NewConfig(ktesting.Verbosity(1))))
}

// parityOutcome is what one case showed.
type parityOutcome struct {
	skipped, bothErr, infeasible, matchInfeasible, feasible, improved, countedMatch, verified, shared int
	took                                                                                              time.Duration
}

// runParityCase runs upstream and topodra on one case and returns an
// error if they disagree on feasibility or errors, if topodra's allocation
// is not valid, or if Verify does not confirm a counted allocation as it is.
func runParityCase(ctx context.Context, pc *parityCase) (parityOutcome, error) {
	var out parityOutcome
	up, err := structured.NewAllocator(ctx, pc.features, *pc.state, pc.classes, pc.slices, newCELCache())
	if err != nil {
		return out, err
	}
	// Upstream's search is exponential on some random inputs (the stock
	// plugin bounds it with a filter timeout); skip those.
	upCtx, cancel := context.WithTimeout(ctx, time.Second)
	upResult, upErr := up.Allocate(upCtx, pc.node, pc.claims)
	timedOut := upCtx.Err() != nil
	cancel()
	if timedOut {
		out.skipped++
		return out, nil
	}
	// A failure of this node only; an All request refused for an
	// incomplete or invalid pool of the node is one too (Allocate says
	// so, where upstream's allocator does not mark it).
	if errors.Is(upErr, structured.ErrFailedAllocationOnNode) || refusesAllForPool(upErr) {
		upResult, upErr = nil, nil
	}

	a, err := New(ctx, Options{Features: pc.features, AllocatedState: pc.state, ClassLister: pc.classes, Slices: pc.slices, CELCache: newCELCache(), Policy: pc.policy})
	if err != nil {
		return out, err
	}
	start := time.Now()
	res, err := a.Allocate(ctx, pc.node, pc.claims)
	out.took = time.Since(start)
	switch {
	case upErr != nil || err != nil:
		if (upErr == nil) != (err == nil) {
			var got []string
			if res != nil {
				got = deviceNames(res.Allocations)
			}
			return out, fmt.Errorf("upstream error %v, topodra error %v (topodra allocates %v)", upErr, err, got)
		}
		out.bothErr++
		return out, nil
	case res == nil:
		return out, errors.New("nil result without error")
	}
	if (upResult == nil) != (res.Allocations == nil) {
		return out, fmt.Errorf("upstream allocates %v, topodra %v (explanation: %s)\nupstream: %v", upResult != nil, res.Allocations != nil, res.Explanation, deviceNames(upResult))
	}
	if res.Allocations == nil {
		out.infeasible++
		if res.Explanation == nil || res.Explanation.String() == "" {
			return out, errors.New("infeasible without explanation")
		}
		if strings.Contains(res.Explanation.String(), "no single value of") {
			out.matchInfeasible++
		}
		return out, nil
	}
	out.feasible++
	if res.Unverified && slices.ContainsFunc(pc.claims, func(c *resourceapi.ResourceClaim) bool { return len(c.Spec.Devices.Constraints) > 0 }) {
		out.countedMatch++
	}
	if err := checkValid(ctx, pc, res.Allocations); err != nil {
		return out, fmt.Errorf("invalid topodra allocation %v: %w", deviceNames(res.Allocations), err)
	}
	if res.Unverified {
		// What the plugin does in Reserve: the counted allocation must be
		// confirmed by upstream as it is.
		verified, err := a.Verify(ctx, pc.node, pc.claims, res)
		switch {
		case err != nil:
			return out, fmt.Errorf("verify: %w", err)
		case verified.CountingRefused || verified.Allocations == nil:
			return out, fmt.Errorf("upstream refused the counted allocation %v", deviceNames(res.Allocations))
		}
		if err := checkValid(ctx, pc, verified.Allocations); err != nil {
			return out, fmt.Errorf("invalid verified allocation %v: %w", deviceNames(verified.Allocations), err)
		}
		out.verified++
	}
	if !slices.Equal(deviceNames(res.Allocations), deviceNames(upResult)) {
		out.improved++
	}
	for _, r := range res.Allocations {
		for _, d := range r.Devices.Results {
			if d.ShareID != nil {
				out.shared++
			}
		}
	}
	return out, nil
}

func TestParityWithUpstream(t *testing.T) {
	ctx := quietContext(t)
	rnd := rand.New(rand.NewPCG(*paritySeed, 42))
	var total parityOutcome
	var slowest time.Duration
	slowestCase := -1
	kinds := map[string]int{}
	for i := range *parityCases {
		pc := genCase(rnd)
		for _, k := range sets.List(sets.New(pc.kinds...)) {
			kinds[k]++
		}
		out, err := runParityCase(ctx, pc)
		if err != nil {
			t.Fatalf("case %d: %v\n%s", i, err, pc.describe())
		}
		if out.took > slowest {
			slowest, slowestCase = out.took, i
		}
		total.skipped += out.skipped
		total.bothErr += out.bothErr
		total.infeasible += out.infeasible
		total.matchInfeasible += out.matchInfeasible
		total.feasible += out.feasible
		total.improved += out.improved
		total.countedMatch += out.countedMatch
		total.verified += out.verified
		total.shared += out.shared
	}
	t.Logf("slowest topodra Allocate: case %d, %v; %d shared (consumable capacity) devices allocated; %d counted allocations confirmed by Verify", slowestCase, slowest, total.shared, total.verified)
	t.Logf("%d cases: %d feasible (%d with other devices than upstream, %d with matchAttribute decided by counting), %d infeasible (%d for matchAttribute by counting), %d errors on both sides, %d skipped (upstream took over 1s)", *parityCases, total.feasible, total.improved, total.countedMatch, total.infeasible, total.matchInfeasible, total.bothErr, total.skipped)
	t.Logf("cases by kind: %v", kinds)
	for _, k := range []string{"stable allocator", "duplicate counter set", "missing counter set", "missing counter", "compatibility groups, feature off", "counter sets, feature off", "generation per node", "firstAvailable", "list-type attributes",
		"uncompilable later subrequest", "device node selector", "unparsable device node selector", "unset allocation mode",
		"unparsable counter-set node selector", "negative capacity", "negative capacity, consumable capacity", "capacity request policy, consumable capacity"} {
		if kinds[k] == 0 {
			t.Errorf("the generator made no case of kind %q", k)
		}
	}
	// Skipped cases are compared on nothing: where many are skipped (a
	// generator that makes upstream's search explode, a machine far too
	// slow), the comparison covers too little to pass.
	if total.skipped > *parityCases/50 {
		t.Errorf("%d of %d cases skipped (upstream took over 1s): the comparison covers too few", total.skipped, *parityCases)
	}
	if total.feasible < *parityCases/5 || total.infeasible == 0 || total.improved == 0 || total.countedMatch == 0 || total.matchInfeasible == 0 || total.verified == 0 {
		t.Errorf("the generator does not cover enough: %d feasible, %d infeasible, %d different, %d feasible and %d infeasible matchAttribute by counting, %d verified", total.feasible, total.infeasible, total.improved, total.countedMatch, total.matchInfeasible, total.verified)
	}
}

// FuzzAllocatorInput drives the case generator of TestParityWithUpstream
// with the fuzzer's bytes instead of a seeded stream, so that mutations
// change one decision of the generator at a time: random slices, pools
// and claims through Allocate and Verify. topodra must not panic, must
// agree with upstream on feasibility and errors, and what it allocates
// must be valid.
func FuzzAllocatorInput(f *testing.F) {
	for _, seed := range [][]byte{
		nil,
		[]byte("topodra"),
		bytes.Repeat([]byte{0xff}, 64),
		bytes.Repeat([]byte{0x00, 0x01, 0x7f, 0x80}, 40),
		[]byte("a DGX with partitions, counters and two pools of generations"),
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		pc := genCase(rand.New(&byteSource{data: data}))
		if _, err := runParityCase(quietContext(t), pc); err != nil {
			t.Fatalf("%v\n%s", err, pc.describe())
		}
	})
}

// byteSource is a rand.Source that reads its numbers from bytes, eight per
// number; once they run out, a PCG stream seeded by their count takes over
// (a constant source would make rand's rejection sampling loop forever).
type byteSource struct {
	data []byte
	rest *rand.PCG
}

func (s *byteSource) Uint64() uint64 {
	if len(s.data) == 0 {
		if s.rest == nil {
			s.rest = rand.NewPCG(0x746f706f647261, 0)
		}
		return s.rest.Uint64()
	}
	var buf [8]byte
	n := copy(buf[:], s.data)
	s.data = s.data[n:]
	return binary.LittleEndian.Uint64(buf[:])
}
