package perf

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/topodra/topodra/pkg/measure"
)

// tracker follows one run through informers: when each measured pod got
// bound, which devices are in use (all claims of the cluster), and whether
// each multi-device claim of the measured namespace was placed in one
// topology domain when such a placement existed.
//
// Alignment is judged in the order the claim informer delivers
// allocations, against the devices in use just before. The scheduler
// decides one pod at a time and writes allocations in PreBind, in parallel
// for pods whose binding overlaps, so this is the order and the state it
// decided in except where two writes overtook each other; such a swap can
// only make the judgement of the two claims involved stricter or looser by
// the devices of the other one.
type tracker struct {
	namespace string
	onBind    func(*v1.Pod) // called for each newly bound measured pod

	mu        sync.Mutex // guards the fields below, up to stop
	binds     []time.Time
	bound     map[string]bool     // measured pods seen bound, by UID
	claims    map[string][]string // device keys of allocated claims by namespace/name
	devices   *measure.Inventory  // the nodes' devices; owner: claim namespace/name
	aligned   int                 // measured multi-device claims in one domain
	eligible  int                 // ... that had an aligned option, or were aligned
	misplaced []string            // examples of eligible claims not aligned
	stop      context.CancelFunc
	factory   informers.SharedInformerFactory
}

func newTracker(namespace string, shape Shape, nodes int, onBind func(*v1.Pod)) *tracker {
	t := &tracker{
		namespace: namespace,
		onBind:    onBind,
		bound:     map[string]bool{},
		claims:    map[string][]string{},
		devices:   measure.NewInventory(),
	}
	for i := range nodes {
		node := nodeName(i)
		for _, d := range shapeDevices(shape) {
			t.devices.Add(measure.Device{
				Key:      deviceKey(node, d.driver, d.name),
				Name:     d.name,
				Node:     node,
				NIC:      d.nic,
				PCIeRoot: strconv.Itoa(d.root),
				NUMA:     strconv.Itoa(d.numa),
			})
		}
	}
	return t
}

// deviceKey identifies a device of the benchmark's nodes (one pool per
// node, named after it).
func deviceKey(pool, driver, device string) string {
	return pool + "/" + driver + "/" + device
}

// start starts the informers and waits for them to sync.
func (t *tracker) start(ctx context.Context, client kubernetes.Interface) error {
	ctx, cancel := context.WithCancel(ctx)
	t.stop = cancel
	t.factory = informers.NewSharedInformerFactory(client, 0)
	claims := t.factory.Resource().V1().ResourceClaims().Informer()
	if _, err := claims.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { t.onClaim(obj, false) },
		UpdateFunc: func(_, obj any) { t.onClaim(obj, false) },
		DeleteFunc: func(obj any) { t.onClaim(obj, true) },
	}); err != nil {
		cancel()
		return err
	}
	podFactory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(t.namespace))
	pods := podFactory.Core().V1().Pods().Informer()
	if _, err := pods.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { t.onPod(obj) },
		UpdateFunc: func(_, obj any) { t.onPod(obj) },
	}); err != nil {
		cancel()
		return err
	}
	t.factory.Start(ctx.Done())
	podFactory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), claims.HasSynced, pods.HasSynced) {
		cancel()
		return fmt.Errorf("tracker informers did not sync")
	}
	prev := t.stop
	t.stop = func() {
		prev()
		t.factory.Shutdown()
		podFactory.Shutdown()
	}
	return nil
}

func (t *tracker) shutdown() {
	if t.stop != nil {
		t.stop()
	}
}

func (t *tracker) onPod(obj any) {
	pod, ok := obj.(*v1.Pod)
	if !ok || pod.Spec.NodeName == "" || pod.DeletionTimestamp != nil {
		return
	}
	t.mu.Lock()
	if t.bound[string(pod.UID)] {
		t.mu.Unlock()
		return
	}
	t.bound[string(pod.UID)] = true
	t.binds = append(t.binds, time.Now())
	t.mu.Unlock()
	if t.onBind != nil {
		t.onBind(pod)
	}
}

func (t *tracker) onClaim(obj any, deleted bool) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	claim, ok := obj.(*resourceapi.ResourceClaim)
	if !ok {
		return
	}
	key := claim.Namespace + "/" + claim.Name
	t.mu.Lock()
	defer t.mu.Unlock()
	if deleted || claim.Status.Allocation == nil {
		for _, dev := range t.claims[key] {
			t.devices.Release(dev)
		}
		delete(t.claims, key)
		return
	}
	if _, seen := t.claims[key]; seen {
		return
	}
	var devs []string
	for _, r := range claim.Status.Allocation.Devices.Results {
		dev := deviceKey(r.Pool, r.Driver, r.Device)
		if _, ok := t.devices.Device(dev); !ok {
			continue // not a device of the benchmark's nodes
		}
		devs = append(devs, dev)
	}
	if claim.Namespace == t.namespace {
		t.judge(key, devs)
	}
	for _, dev := range devs {
		t.devices.Use(dev, key)
	}
	t.claims[key] = devs
}

// judgeLevels are the domains a measured claim is judged by, tightest
// first.
var judgeLevels = []measure.Level{measure.LevelPCIeRoot, measure.LevelNUMA}

// judge records whether a measured claim's devices share the tightest
// domain that can hold them (PCIe root, else NUMA node), and whether any
// node had such a domain free before this claim was allocated. Claims of
// one device, or too big for any domain (8 GPUs), are not counted.
func (t *tracker) judge(key string, devs []string) {
	if len(devs) < 2 {
		return
	}
	want := t.devices.Count(devs)
	for _, level := range judgeLevels {
		if !t.devices.Fits(level, want) {
			continue
		}
		v := t.devices.Judge(devs, level, measure.Scope{})
		switch {
		case v.Aligned:
			t.aligned++
			t.eligible++
		case v.Possible:
			t.eligible++
			if len(t.misplaced) < 5 {
				var names []string
				node := ""
				for _, dev := range devs {
					d, _ := t.devices.Device(dev)
					names = append(names, d.Name)
					node = d.Node
				}
				free := t.devices.FreeNames(level, v.Option, measure.Scope{})
				t.misplaced = append(t.misplaced, fmt.Sprintf("%s got %s on %s while %s %s was free", key, strings.Join(names, ","), node, v.Option.Node, strings.Join(free, ",")))
			}
		}
		return
	}
}

// bindTimes returns when each measured pod was seen bound.
func (t *tracker) bindTimes() []time.Time {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]time.Time(nil), t.binds...)
}

func (t *tracker) boundCount() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.binds)
}

// alignment returns the aligned and eligible measured claims and a few
// examples of eligible claims that were not aligned.
func (t *tracker) alignment() (aligned, eligible int, examples []string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.aligned, t.eligible, append([]string(nil), t.misplaced...)
}
