package allocator

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

const (
	gpuDriver = topology.DriverName
	nicDriver = "nic.example.com"
)

// allFeatures enables every DRA feature the upstream allocator knows.
var allFeatures = structured.Features{
	AdminAccess:             true,
	ConsumableCapacity:      true,
	DeviceBindingAndStatus:  true,
	DeviceTaints:            true,
	FractionalCapacityRange: true,
	ListTypeAttributes:      true,
	PartitionableDevices:    true,
	PrioritizedList:         true,
}

func newCELCache() *cel.Cache {
	return cel.NewCache(100, cel.Features{EnableConsumableCapacity: true, EnableListTypeAttributes: true})
}

// classLister is an in-memory DeviceClassLister.
type classLister map[string]*resourceapi.DeviceClass

func (l classLister) List() ([]*resourceapi.DeviceClass, error) {
	var classes []*resourceapi.DeviceClass
	for _, c := range l {
		classes = append(classes, c)
	}
	return classes, nil
}

func (l classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	if c, ok := l[name]; ok {
		return c, nil
	}
	return nil, apierrors.NewNotFound(resourceapi.Resource("deviceclasses"), name)
}

func class(name string, exprs ...string) *resourceapi.DeviceClass {
	c := &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: name}}
	for _, e := range exprs {
		c.Spec.Selectors = append(c.Spec.Selectors, resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: e}})
	}
	return c
}

func classes(cs ...*resourceapi.DeviceClass) classLister {
	l := classLister{}
	for _, c := range cs {
		l[c.Name] = c
	}
	return l
}

var defaultClasses = classes(
	class("gpu", `device.driver == "`+gpuDriver+`"`),
	class("nic", `device.driver == "`+nicDriver+`"`),
)

// Device attribute helpers.
type attrs map[resourceapi.QualifiedName]resourceapi.DeviceAttribute

func str(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: &s} }
func num(i int64) resourceapi.DeviceAttribute  { return resourceapi.DeviceAttribute{IntValue: &i} }
func nums(is ...int64) resourceapi.DeviceAttribute {
	return resourceapi.DeviceAttribute{IntValues: is}
}

func device(name string, a attrs) resourceapi.Device {
	return resourceapi.Device{Name: name, Attributes: a}
}

func node(name string) *v1.Node {
	return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubernetes.io/hostname": name}}}
}

// slice builds a complete one-slice pool named after node and driver.
func slice(nodeName, driver string, devices ...resourceapi.Device) *resourceapi.ResourceSlice {
	name := nodeName + "-" + strings.ReplaceAll(driver, ".", "-")
	return &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID(fmt.Sprintf("uid-%s-%d", name, sliceUIDs.Add(1))), Generation: 1},
		Spec: resourceapi.ResourceSliceSpec{
			Driver:   driver,
			NodeName: ptr.To(nodeName),
			Pool:     resourceapi.ResourcePool{Name: nodeName, Generation: 1, ResourceSliceCount: 1},
			Devices:  devices,
		},
	}
}

// sliceUIDs makes slice UIDs unique, as the API server does: the slice
// memo relies on UID and generation identifying the content.
var sliceUIDs atomic.Int64

// claimBuilder builds ResourceClaims.
type claimBuilder struct{ c *resourceapi.ResourceClaim }

func claim(name string) *claimBuilder {
	return &claimBuilder{c: &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID("claim-" + name)}}}
}

func (b *claimBuilder) request(name, className string, count int64, selectors ...string) *claimBuilder {
	r := resourceapi.DeviceRequest{Name: name, Exactly: &resourceapi.ExactDeviceRequest{
		DeviceClassName: className, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count,
	}}
	for _, s := range selectors {
		r.Exactly.Selectors = append(r.Exactly.Selectors, resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: s}})
	}
	b.c.Spec.Devices.Requests = append(b.c.Spec.Devices.Requests, r)
	return b
}

func (b *claimBuilder) annotate(key, value string) *claimBuilder {
	if b.c.Annotations == nil {
		b.c.Annotations = map[string]string{}
	}
	b.c.Annotations[key] = value
	return b
}

func (b *claimBuilder) obj() *resourceapi.ResourceClaim { return b.c }

// allocated returns an AllocatedState with the named devices of one pool in use.
func allocated(driver, pool string, names ...string) *structured.AllocatedState {
	s := &structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
	for _, n := range names {
		s.AllocatedDevices.Insert(structured.MakeDeviceID(driver, pool, n))
	}
	return s
}

// deviceNames lists the chosen devices of all allocations, sorted, as "pool/device".
func deviceNames(results []resourceapi.AllocationResult) []string {
	var names []string
	for _, r := range results {
		for _, d := range r.Devices.Results {
			names = append(names, d.Device)
		}
	}
	sort.Strings(names)
	return slices.Compact(names)
}

// Machine shapes. Each returns the slices of one node.

// dgx: 8 GPUs, NUMA 0/1 with 4 each, PCIe roots in pairs, one NVLink clique
// (published short-named, as the topodra agent does).
func dgx(nodeName string) []*resourceapi.ResourceSlice {
	var devs []resourceapi.Device
	for i := range 8 {
		devs = append(devs, device(fmt.Sprintf("gpu-%d", i), attrs{
			topology.AttrPCIeRoot: str(fmt.Sprintf("pci%04x:00", i/2)),
			topology.AttrNUMANode: num(int64(i / 4)),
			"nvlinkClique":        str("clique-0"),
			"model":               str("H100"),
		}))
	}
	return []*resourceapi.ResourceSlice{slice(nodeName, gpuDriver, devs...)}
}

// pcieBox: 8 GPUs behind two PCIe roots (one per NUMA node), joined by
// NVLink bridges in pairs.
func pcieBox(nodeName string) []*resourceapi.ResourceSlice {
	var devs []resourceapi.Device
	for i := range 8 {
		devs = append(devs, device(fmt.Sprintf("gpu-%d", i), attrs{
			topology.AttrPCIeRoot:     str(fmt.Sprintf("pci%04x:00", i/4)),
			topology.AttrNUMANode:     num(int64(i / 4)),
			topology.AttrNVLinkClique: str(fmt.Sprintf("bridge-%d", i/2)),
		}))
	}
	return []*resourceapi.ResourceSlice{slice(nodeName, gpuDriver, devs...)}
}

// gpuNIC: 4 GPUs in two PCIe roots and two NICs, one per root, listed in
// the opposite order so that first-fit pairs them wrongly.
func gpuNIC(nodeName string) []*resourceapi.ResourceSlice {
	var gpus []resourceapi.Device
	for i := range 4 {
		gpus = append(gpus, device(fmt.Sprintf("gpu-%d", i), attrs{
			topology.AttrPCIeRoot: str(fmt.Sprintf("pci%04x:00", i/2)),
			topology.AttrNUMANode: num(0),
		}))
	}
	nics := []resourceapi.Device{
		device("nic-0", attrs{topology.AttrPCIeRoot: str("pci0001:00"), topology.AttrNUMANode: num(0)}),
		device("nic-1", attrs{topology.AttrPCIeRoot: str("pci0000:00"), topology.AttrNUMANode: num(0)}),
	}
	return []*resourceapi.ResourceSlice{slice(nodeName, gpuDriver, gpus...), slice(nodeName, nicDriver, nics...)}
}

// plainGPUs: n GPUs without any topology attribute.
func plainGPUs(nodeName string, n int) []*resourceapi.ResourceSlice {
	var devs []resourceapi.Device
	for i := range n {
		devs = append(devs, device(fmt.Sprintf("gpu-%d", i), attrs{"model": str("L4")}))
	}
	return []*resourceapi.ResourceSlice{slice(nodeName, gpuDriver, devs...)}
}

// numaNICs: 8 GPUs in two NUMA nodes (pairs on PCIe roots, no NVLink) and
// two NICs that only publish numaNode, as a list whose first entry is the
// physical node; NIC 0 sits on NUMA 1.
func numaNICs(nodeName string) []*resourceapi.ResourceSlice {
	var gpus []resourceapi.Device
	for i := range 8 {
		gpus = append(gpus, device(fmt.Sprintf("gpu-%d", i), attrs{
			topology.AttrPCIeRoot: str(fmt.Sprintf("pci%04x:00", i/2)),
			topology.AttrNUMANode: num(int64(i / 4)),
		}))
	}
	nics := []resourceapi.Device{
		device("nic-0", attrs{topology.AttrNUMANode: nums(1, 0)}),
		device("nic-1", attrs{topology.AttrNUMANode: nums(0, 1)}),
	}
	return []*resourceapi.ResourceSlice{slice(nodeName, gpuDriver, gpus...), slice(nodeName, nicDriver, nics...)}
}

// allocateBoth runs topodra's Allocate and upstream's allocator on the same
// node, slices and state (nil: nothing in use); it fails the test on errors.
func allocateBoth(ctx context.Context, t *testing.T, nodeName string, slices []*resourceapi.ResourceSlice, state *structured.AllocatedState, policy Policy, claims []*resourceapi.ResourceClaim) (*Allocator, *Result, []resourceapi.AllocationResult) {
	t.Helper()
	if state == nil {
		state = allocated(gpuDriver, nodeName)
	}
	a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses,
		Slices: slices, CELCache: newCELCache(), Policy: policy})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	res, err := a.Allocate(ctx, node(nodeName), claims)
	if err != nil {
		t.Fatalf("Allocate: %v", err)
	}
	if res == nil {
		t.Fatal("Allocate returned a nil result")
	}
	up, err := structured.NewAllocator(ctx, allFeatures, *state, defaultClasses, slices, newCELCache())
	if err != nil {
		t.Fatal(err)
	}
	upResult, err := up.Allocate(ctx, node(nodeName), claims)
	if err != nil {
		t.Fatalf("upstream: %v", err)
	}
	return a, res, upResult
}
