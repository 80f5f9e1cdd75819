package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/topology"
)

// OtherDriverTaintKey is the NoSchedule device taint on each device whose
// GPU another DRA driver publishes on the node as well (see
// Options.OtherDriverCheck), with that driver's name as value: neither
// scheduler allocates it then (topology.OtherDriverTaintKey).
const OtherDriverTaintKey = topology.OtherDriverTaintKey

// DefaultOtherDriverCheck is the node agent command's default for
// Options.OtherDriverCheck.
const DefaultOtherDriverCheck = true

// Event reasons on the Node about other DRA drivers.
const (
	// ReasonOtherDriver (Warning, once per distinct set): another DRA
	// driver publishes GPUs that the agent publishes; the note names the
	// driver and its devices, the devices named in the event's FieldPath
	// are tainted OtherDriverTaintKey.
	ReasonOtherDriver = "TopodraOtherDriverConflict"
	// ReasonOtherDriverGone (Normal): no other driver publishes them any
	// more; the taints are gone.
	ReasonOtherDriverGone = "TopodraOtherDriverGone"
)

// ErrOtherDriverConflict is the per-claim error for a claim that is not
// prepared yet and was allocated a GPU that another DRA driver publishes
// on the node as well (see Options.OtherDriverCheck): the default
// scheduler allocates that driver's devices and its kubelet plugin
// prepares them, so a new container could share the GPU with a pod of
// that driver. Claims prepared before (in this boot) are prepared again
// as before, and claims with admin access are prepared.
var ErrOtherDriverConflict = errors.New("another DRA driver publishes the same GPU")

// ReasonOtherDriverAllocated is the reason of the warning event on a claim
// that is refused with ErrOtherDriverConflict.
const ReasonOtherDriverAllocated = "OtherDriverGPUAllocated"

// foreignDevice is a device of another driver on the agent's node, with
// what identifies its GPU: the standard PCI bus id attribute
// (canonical), and a UUID attribute.
type foreignDevice struct {
	driver, pool, name string
	pciBusID, uuid     string
}

// String names the device as "driver device pool/name".
func (d foreignDevice) String() string {
	return fmt.Sprintf("%s device %s/%s", d.driver, d.pool, d.name)
}

// isGPU says whether d is gpu: the same PCI bus id or the same UUID.
func (d foreignDevice) isGPU(gpu *discovery.GPU) bool {
	return d.pciBusID != "" && d.pciBusID == gpu.PCIBusID || d.uuid != "" && d.uuid == gpu.UUID
}

// foreignDevices lists the devices of the slices on node of drivers other
// than own that carry resource.kubernetes.io/pciBusID or a uuid attribute
// (in the driver's domain, as NVIDIA's gpu.nvidia.com publishes it),
// sorted by driver, pool and name.
func foreignDevices(items []*resourceapi.ResourceSlice, node, own string) []foreignDevice {
	var out []foreignDevice
	for _, s := range items {
		if s.Spec.Driver == own || ptr.Deref(s.Spec.NodeName, "") != node {
			continue
		}
		for _, d := range s.Spec.Devices {
			f := foreignDevice{driver: s.Spec.Driver, pool: s.Spec.Pool.Name, name: d.Name}
			if id := d.Attributes[deviceattribute.StandardDeviceAttributePCIBusID].StringValue; id != nil {
				f.pciBusID = discovery.CanonicalPCIBusID(*id)
			}
			for _, name := range []resourceapi.QualifiedName{discovery.AttrUUID, resourceapi.QualifiedName(s.Spec.Driver + "/" + string(discovery.AttrUUID))} {
				if uuid := d.Attributes[name].StringValue; uuid != nil {
					f.uuid = *uuid
				}
			}
			if f.pciBusID != "" || f.uuid != "" {
				out = append(out, f)
			}
		}
	}
	slices.SortFunc(out, func(a, b foreignDevice) int {
		return cmp.Or(cmp.Compare(a.driver, b.driver), cmp.Compare(a.pool, b.pool), cmp.Compare(a.name, b.name))
	})
	return out
}

// otherDriverMatches maps the name of each GPU of inv that a device of
// foreign is to those devices.
func otherDriverMatches(inv *discovery.Inventory, foreign []foreignDevice) map[string][]foreignDevice {
	matches := map[string][]foreignDevice{}
	if inv == nil {
		return matches
	}
	for i := range inv.GPUs {
		for _, f := range foreign {
			if f.isGPU(&inv.GPUs[i]) {
				matches[inv.GPUs[i].Name] = append(matches[inv.GPUs[i].Name], f)
			}
		}
	}
	return matches
}

// otherDriverTaintsLocked maps the name of each GPU that another driver
// publishes to that driver (the first by name where there are more), for
// TaintOptions.OtherDriver. The caller holds a.mutex.
func (a *Agent) otherDriverTaintsLocked() map[string]string {
	taints := map[string]string{}
	for name, devices := range otherDriverMatches(a.inventory, a.foreign) {
		taints[name] = devices[0].driver
	}
	return taints
}

// otherDriverDevices lists the devices of other drivers that are gpu.
func (a *Agent) otherDriverDevices(gpu *discovery.GPU) []foreignDevice {
	a.mutex.Lock()
	defer a.mutex.Unlock()
	var out []foreignDevice
	for _, f := range a.foreign {
		if f.isGPU(gpu) {
			out = append(out, f)
		}
	}
	return out
}

// otherDriverSelector selects the slices of other drivers on the node.
func (a *Agent) otherDriverSelector() string {
	return fields.AndSelectors(
		fields.OneTermEqualSelector(resourceapi.ResourceSliceSelectorNodeName, a.opts.NodeName),
		fields.OneTermNotEqualSelector(resourceapi.ResourceSliceSelectorDriver, a.opts.DriverName),
	).String()
}

// listOtherDrivers reads the slices of other drivers on the node once,
// at start before the first publish, so that a GPU that another driver
// publishes is never published untainted. Where they cannot be read, the
// GPUs are published as they are and the watch (watchOtherDrivers) reads
// them once it can.
func (a *Agent) listOtherDrivers(ctx context.Context) {
	list, err := a.opts.KubeClient.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: a.otherDriverSelector()})
	if err != nil {
		utilruntime.HandleErrorWithContext(ctx, err, "cannot read the ResourceSlices of other drivers on the node at start, the watch reads them once it can")
		return
	}
	items := make([]*resourceapi.ResourceSlice, 0, len(list.Items))
	for i := range list.Items {
		items = append(items, &list.Items[i])
	}
	a.setForeign(ctx, foreignDevices(items, a.opts.NodeName, a.opts.DriverName))
}

// watchOtherDrivers watches the slices of other drivers on the node until
// ctx ends, and republishes where the GPUs they publish change.
func (a *Agent) watchOtherDrivers(ctx context.Context) {
	factory := informers.NewSharedInformerFactoryWithOptions(a.opts.KubeClient, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = a.otherDriverSelector()
	}))
	informer := factory.Resource().V1().ResourceSlices().Informer()
	changed := make(chan struct{}, 1)
	notify := func() {
		select {
		case changed <- struct{}{}:
		default: // a read is due already
		}
	}
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { notify() },
		UpdateFunc: func(any, any) { notify() },
		DeleteFunc: func(any) { notify() },
	}); err != nil {
		utilruntime.HandleErrorWithContext(ctx, err, "cannot watch the ResourceSlices of other drivers on the node")
		return
	}
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
		return
	}
	for {
		var items []*resourceapi.ResourceSlice
		for _, obj := range informer.GetStore().List() {
			if s, ok := obj.(*resourceapi.ResourceSlice); ok {
				items = append(items, s)
			}
		}
		if a.setForeign(ctx, foreignDevices(items, a.opts.NodeName, a.opts.DriverName)) {
			if err := a.publish(ctx); err != nil && ctx.Err() == nil {
				utilruntime.HandleErrorWithContext(ctx, err, "publishing after a change of other drivers' devices failed")
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
		}
	}
}

// setForeign records the devices of other drivers on the node and
// reports a change of the GPUs they publish (see reportOtherDrivers),
// saying whether there was one.
func (a *Agent) setForeign(ctx context.Context, foreign []foreignDevice) bool {
	a.mutex.Lock()
	a.foreign = foreign
	a.mutex.Unlock()
	return a.reportOtherDrivers(ctx)
}

// reportOtherDrivers compares the GPUs that other drivers publish, by the
// current inventory, with those of the last call and reports a change in
// the log and on the Node: a ReasonOtherDriver Warning naming the
// drivers and devices, or a ReasonOtherDriverGone Normal event once there
// are none after some. It says whether they changed.
func (a *Agent) reportOtherDrivers(ctx context.Context) bool {
	a.mutex.Lock()
	matches := otherDriverMatches(a.inventory, a.foreign)
	var names, descs []string
	drivers := map[string]bool{}
	for name, devices := range matches {
		names = append(names, name)
		gpu := a.inventory.GPU(name)
		var others []string
		for _, d := range devices {
			others = append(others, d.String())
			drivers[d.driver] = true
		}
		descs = append(descs, fmt.Sprintf("%s (UUID %s, PCI bus id %s) is %s", name, gpu.UUID, orUnknown(gpu.PCIBusID), strings.Join(others, " and ")))
	}
	slices.Sort(names)
	slices.Sort(descs)
	key := strings.Join(descs, "\n")
	prev := a.otherDrivers
	a.otherDrivers = key
	a.mutex.Unlock()
	if key == prev {
		return false
	}
	logger := klog.FromContext(ctx)
	if len(names) == 0 {
		logger.Info("No other DRA driver publishes the agent's GPUs any more, removing the taint", "taint", OtherDriverTaintKey)
		a.nodeEvent(v1.EventTypeNormal, ReasonOtherDriverGone, "Publish", "no other DRA driver publishes the GPUs that %s publishes on this node: they are no longer tainted %s", a.opts.DriverName, OtherDriverTaintKey)
		return true
	}
	driverList := make([]string, 0, len(drivers))
	for d := range drivers {
		driverList = append(driverList, d)
	}
	slices.Sort(driverList)
	logger.Info("Another DRA driver publishes GPUs that the agent publishes, tainting them", "drivers", driverList, "devices", descs, "taint", OtherDriverTaintKey)
	a.devicesNodeEvent(names, v1.EventTypeWarning, ReasonOtherDriver, "Publish",
		"DRA driver %s publishes %d GPUs that %s publishes on this node: %s; the default scheduler allocates that driver's devices and its kubelet plugin prepares them, so a GPU could go to two pods: they are tainted %s (NoSchedule) and not prepared for new claims until no other driver's ResourceSlice lists them; a cluster admin must remove the other driver from this node (NVIDIA's DRA driver: its kubelet plugin must not run there, see \"Beside NVIDIA's DRA driver\" in docs/install.md)",
		strings.Join(driverList, " and "), len(names), a.opts.DriverName, strings.Join(descs, "; "), OtherDriverTaintKey)
	return true
}
