package perf

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
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
	shape     []deviceSpec
	index     map[string]int // driver/device -> index into shape
	onBind    func(*v1.Pod)  // called for each newly bound measured pod

	mu        sync.Mutex // guards the fields below, up to stop
	binds     []time.Time
	bound     map[string]bool        // measured pods seen bound, by UID
	claims    map[string][]devicePos // allocated claims by namespace/name
	used      map[string][]bool      // node -> device index -> in use
	aligned   int                    // measured multi-device claims in one domain
	eligible  int                    // ... that had an aligned option, or were aligned
	misplaced []string               // examples of eligible claims not aligned
	stop      context.CancelFunc
	factory   informers.SharedInformerFactory
}

type devicePos struct {
	node  string
	index int
}

func newTracker(namespace string, shape Shape, nodes int, onBind func(*v1.Pod)) *tracker {
	t := &tracker{
		namespace: namespace,
		shape:     shapeDevices(shape),
		index:     map[string]int{},
		onBind:    onBind,
		bound:     map[string]bool{},
		claims:    map[string][]devicePos{},
		used:      map[string][]bool{},
	}
	for i, d := range t.shape {
		t.index[d.driver+"/"+d.name] = i
	}
	for i := range nodes {
		t.used[nodeName(i)] = make([]bool, len(t.shape))
	}
	return t
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
		for _, p := range t.claims[key] {
			t.used[p.node][p.index] = false
		}
		delete(t.claims, key)
		return
	}
	if _, seen := t.claims[key]; seen {
		return
	}
	var pos []devicePos
	for _, r := range claim.Status.Allocation.Devices.Results {
		i, ok := t.index[r.Driver+"/"+r.Device]
		if !ok || t.used[r.Pool] == nil {
			continue // not a device of the benchmark's nodes
		}
		pos = append(pos, devicePos{node: r.Pool, index: i})
	}
	if claim.Namespace == t.namespace {
		t.judge(key, pos)
	}
	for _, p := range pos {
		t.used[p.node][p.index] = true
	}
	t.claims[key] = pos
}

// judge records whether a measured claim's devices share the tightest
// domain that can hold them (PCIe root, else NUMA node), and whether any
// node had such a domain free before this claim was allocated. Claims of
// one device, or too big for any domain (8 GPUs), are not counted.
func (t *tracker) judge(key string, pos []devicePos) {
	if len(pos) < 2 {
		return
	}
	var gpus, nics int
	for _, p := range pos {
		if t.shape[p.index].nic {
			nics++
		} else {
			gpus++
		}
	}
	levels := []func(d deviceSpec) int{
		func(d deviceSpec) int { return d.root },
		func(d deviceSpec) int { return d.numa },
	}
	for _, level := range levels {
		// Capacity of the largest domain of this level.
		capG, capN := map[int]int{}, map[int]int{}
		for _, d := range t.shape {
			if d.nic {
				capN[level(d)]++
			} else {
				capG[level(d)]++
			}
		}
		fits := false
		for v := range capG {
			if capG[v] >= gpus && capN[v] >= nics {
				fits = true
			}
		}
		if !fits {
			continue
		}
		aligned := true
		for _, p := range pos {
			if level(t.shape[p.index]) != level(t.shape[pos[0].index]) {
				aligned = false
			}
		}
		if aligned {
			t.aligned++
			t.eligible++
			return
		}
		if option := t.alignedOption(level, gpus, nics); option != "" {
			t.eligible++
			if len(t.misplaced) < 5 {
				var names []string
				for _, p := range pos {
					names = append(names, t.shape[p.index].name)
				}
				t.misplaced = append(t.misplaced, fmt.Sprintf("%s got %s on %s while %s was free", key, strings.Join(names, ","), pos[0].node, option))
			}
		}
		return
	}
}

// alignedOption names a free domain of the level with room for gpus
// and nics, or returns "".
func (t *tracker) alignedOption(level func(deviceSpec) int, gpus, nics int) string {
	freeG, freeN := map[int]int{}, map[int]int{}
	for node, used := range t.used {
		clear(freeG)
		clear(freeN)
		for i, d := range t.shape {
			if used[i] {
				continue
			}
			if d.nic {
				freeN[level(d)]++
			} else {
				freeG[level(d)]++
			}
		}
		for v, g := range freeG {
			if g >= gpus && freeN[v] >= nics {
				var names []string
				for i, d := range t.shape {
					if !used[i] && level(d) == v {
						names = append(names, d.name)
					}
				}
				return node + " " + strings.Join(names, ",")
			}
		}
	}
	return ""
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
