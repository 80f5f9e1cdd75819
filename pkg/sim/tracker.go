package sim

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/measure"
	"github.com/topodra/topodra/pkg/topology"
)

const mockNICDriver = mockgpu.NICDriverName

// device is one published device, with its topology.
type device struct {
	Key    string // driver/pool/name
	Driver string
	Node   string
	Name   string
	Index  int // numeric suffix of the name, for ordering
	GPU    bool
	NUMA   string
	Root   string
	Clique string
	// UUID is the GPU's uuid attribute; empty for NICs.
	UUID string
}

// podState is what the tracker knows about one workload pod.
type podState struct {
	Name          string
	Job           int
	NodeSelector  map[string]string
	Claims        int // number of pod claims
	Created       time.Time
	CreatedTick   int
	Bound         bool
	BoundAt       time.Time
	BoundTick     int
	Node          string
	Unschedulable bool
	// Message is the scheduler's latest reason for not placing the pod
	// (its PodScheduled condition), MessageAt when the simulator saw it.
	Message   string
	MessageAt time.Time
	Deleting  bool
	Gone      bool
	// Priority is the pod's priority (from its PriorityClass, as the API
	// server set it).
	Priority int32
	// Nominated is the node the scheduler nominated the pod to (it
	// preempted pods there); empty for the others.
	Nominated string
	// Evicted is set when someone else than the simulator deleted the
	// pod (the scheduler's preemption); EvictedBy is the reason of its
	// DisruptionTarget condition, where it has one.
	Evicted   bool
	EvictedBy string
	// Demand is what the pod's claims ask for, when that is simple enough
	// to check against free device counts (see demandOf).
	Demand *demand
	// GPUs is how many GPUs the pod's claims ask for (see gpusAsked),
	// also where Demand is nil: the size its wait is counted under.
	GPUs int
	// WaitSize and WaitCause say, for a pod not bound once the pods of
	// its tick had been scheduled, what it asks for and what the cluster
	// lacked then (see judgeWaits); empty for the others.
	WaitSize, WaitCause string
}

// demand is a pod's total ExactCount request of GPUs and NICs. SameRoot:
// its one claim requires all its devices on one PCIe root.
type demand struct {
	GPUs, NICs int
	SameRoot   bool
}

// claimState is an allocated claim.
type claimState struct {
	Pod     string
	Devices []string // device keys
}

// tracker follows pods and claims of one run through informers and keeps
// the free/used state of every device. All methods are safe for concurrent
// use.
type tracker struct {
	namespace string

	mu          sync.Mutex
	tick        int
	devices     map[string]*device
	nodeDevices map[string][]*device // per node, GPUs by index then NICs by index
	nodeLabels  map[string]labels.Set
	pods        map[string]*podState
	claims      map[types.UID]*claimState
	placements  []Placement
	// placed is the index in placements of each claim's latest
	// allocation: a claim deallocated and allocated again (PostFilter,
	// a failed binding) counts once, as placed the last time.
	placed map[types.UID]int
	errs   []string
	// conflicts are devices that a claim was seen allocated while
	// another pod's claim still held them here, by device key. After the
	// claim informer lists anew (it lost its watch), it delivers the
	// claims it lists before the deletions it missed, so a device given
	// back and allocated again meanwhile looks held twice until the
	// deletion comes; a conflict that the earlier holder's release then
	// explains goes (see release), the others are double allocations.
	conflicts map[string]conflict
	// reordered counts the conflicts that a release explained.
	reordered int

	// inv holds the same devices and who uses them (owner: pod name);
	// placements are judged on it.
	inv *measure.Inventory

	// headroomPercent is TopologyDRA's smallPodHeadroomPercent: a pod
	// that needs half a node or more starts only if the headroom of the
	// GPUs of the nodes it may use stays free (topologydra.HeadroomFor);
	// 0: none.
	headroomPercent int32
	// wholeNode is TopologyDRA's wholeNodeDevices.
	wholeNode int

	// tainted is, for each device that has a NoSchedule or NoExecute
	// taint in its ResourceSlice, when the tracker saw the taint and its
	// key=value; such a device is unhealthy in inv and counts as free
	// nowhere.
	tainted map[string]seenTaint
	// taintedAllocations describe the allocations of devices that were
	// tainted when the tracker saw the allocation.
	taintedAllocations []TaintedAllocation

	// sentinels are pods of the namespace that are not the workload's,
	// named sentinelPrefix..., that the pod informer has seen: after a
	// fault, the simulator creates one and waits for it, to know that
	// the informer watches again.
	sentinels map[string]bool
}

// conflict is a device seen allocated to claim (of pod) while pod other
// held it, and the resourceVersion of claim that allocated it.
type conflict struct {
	claim, pod, other string
	version           uint64
}

// seenTaint is a device taint as the tracker saw it: when, the taints'
// key=value, and the resourceVersion of the slice that first had it.
type seenTaint struct {
	Since time.Time
	What  string
	RV    uint64
}

// sentinelPrefix starts the names of the pods by which the simulator
// finds out that its pod informer watches again.
const sentinelPrefix = "sim-sentinel-"

// sees reports whether the pod informer has seen the sentinel pod name.
func (t *tracker) sees(name string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.sentinels[name]
}

// setHeadroom sets TopologyDRA's smallPodHeadroomPercent and
// wholeNodeDevices.
func (t *tracker) setHeadroom(percent int32, whole int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.headroomPercent, t.wholeNode = percent, whole
}

func newTracker(namespace string) *tracker {
	return &tracker{
		namespace:   namespace,
		devices:     map[string]*device{},
		nodeDevices: map[string][]*device{},
		nodeLabels:  map[string]labels.Set{},
		pods:        map[string]*podState{},
		claims:      map[types.UID]*claimState{},
		placed:      map[types.UID]int{},
		conflicts:   map[string]conflict{},
		inv:         measure.NewInventory(),
		tainted:     map[string]seenTaint{},
		sentinels:   map[string]bool{},
	}
}

// loadDevices records the devices of the simulated nodes.
func (t *tracker) loadDevices(slices_ []resourceapi.ResourceSlice, nodes []*v1.Node) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, n := range nodes {
		t.nodeLabels[n.Name] = labels.Set(n.Labels)
	}
	for _, s := range slices_ {
		if s.Spec.NodeName == nil {
			continue
		}
		driver := s.Spec.Driver
		for i := range s.Spec.Devices {
			d := &s.Spec.Devices[i]
			dev := &device{
				Key:    driver + "/" + s.Spec.Pool.Name + "/" + d.Name,
				Driver: driver,
				Node:   *s.Spec.NodeName,
				Name:   d.Name,
				Index:  nameIndex(d.Name),
				GPU:    driver == topology.DriverName,
			}
			if a, ok := topology.LookupAttribute(driver, d.Attributes, topology.AttrNUMANode); ok {
				dev.NUMA, _ = topology.DomainValue(a)
			}
			if a, ok := topology.LookupAttribute(driver, d.Attributes, topology.AttrPCIeRoot); ok {
				dev.Root, _ = topology.DomainValue(a)
			}
			if a, ok := topology.LookupAttribute(driver, d.Attributes, topology.AttrNVLinkClique); ok {
				dev.Clique, _ = topology.DomainValue(a)
			}
			if a, ok := d.Attributes[discovery.AttrUUID]; ok && dev.GPU && a.StringValue != nil {
				dev.UUID = *a.StringValue
			}
			t.devices[dev.Key] = dev
			t.nodeDevices[dev.Node] = append(t.nodeDevices[dev.Node], dev)
		}
	}
	for _, devs := range t.nodeDevices {
		slices.SortFunc(devs, func(a, b *device) int {
			if a.GPU != b.GPU {
				if a.GPU {
					return -1
				}
				return 1
			}
			if a.Index != b.Index {
				return a.Index - b.Index
			}
			return strings.Compare(a.Name, b.Name)
		})
		for _, d := range devs {
			t.inv.Add(measure.Device{Key: d.Key, Name: d.Name, Node: d.Node, NIC: !d.GPU, NVLink: d.Clique, PCIeRoot: d.Root, NUMA: d.NUMA})
		}
	}
}

func nameIndex(name string) int {
	i := strings.LastIndexByte(name, '-')
	n, err := strconv.Atoi(name[i+1:])
	if err != nil {
		return 1 << 30
	}
	return n
}

// start runs pod and claim informers for the namespace and a ResourceSlice
// informer until ctx ends and waits for their caches to sync.
func (t *tracker) start(ctx context.Context, client kubernetes.Interface) error {
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(t.namespace))
	podInformer := factory.Core().V1().Pods().Informer()
	claimInformer := factory.Resource().V1().ResourceClaims().Informer()
	sliceInformer := factory.Resource().V1().ResourceSlices().Informer()
	if _, err := sliceInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    t.onSlice,
		UpdateFunc: func(_, obj any) { t.onSlice(obj) },
	}); err != nil {
		return err
	}
	if _, err := podInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { t.onPod(obj, false) },
		UpdateFunc: func(_, obj any) { t.onPod(obj, false) },
		DeleteFunc: func(obj any) { t.onPod(obj, true) },
	}); err != nil {
		return err
	}
	if _, err := claimInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { t.onClaim(obj, false) },
		UpdateFunc: func(_, obj any) { t.onClaim(obj, false) },
		DeleteFunc: func(obj any) { t.onClaim(obj, true) },
	}); err != nil {
		return err
	}
	factory.Start(ctx.Done())
	go func() {
		<-ctx.Done()
		factory.Shutdown()
	}()
	for typ, ok := range factory.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("cache for %v did not sync", typ)
		}
	}
	return nil
}

func (t *tracker) setTick(tick int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.tick = tick
}

// created registers a pod just before it is created.
func (t *tracker) created(pod *v1.Pod, job int, d *demand, gpus int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.pods[pod.Name] = &podState{
		Demand:       d,
		GPUs:         gpus,
		Name:         pod.Name,
		Job:          job,
		NodeSelector: pod.Spec.NodeSelector,
		Claims:       len(pod.Spec.ResourceClaims),
		Created:      time.Now(),
		CreatedTick:  t.tick,
	}
}

func (t *tracker) onPod(obj any, deleted bool) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	pod, ok := obj.(*v1.Pod)
	if !ok {
		return
	}
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	ps := t.pods[pod.Name]
	if ps == nil {
		if strings.HasPrefix(pod.Name, sentinelPrefix) && !deleted {
			t.sentinels[pod.Name] = true
		}
		return // not ours
	}
	if pod.Spec.Priority != nil {
		ps.Priority = *pod.Spec.Priority
	}
	ps.Nominated = pod.Status.NominatedNodeName
	if (pod.DeletionTimestamp != nil || deleted) && !ps.Deleting && !ps.Evicted {
		ps.Evicted = true
		for _, c := range pod.Status.Conditions {
			if c.Type == v1.DisruptionTarget && c.Status == v1.ConditionTrue {
				ps.EvictedBy = c.Reason
			}
		}
	}
	if deleted {
		ps.Gone = true
		return
	}
	if pod.Spec.NodeName != "" && !ps.Bound {
		ps.Bound = true
		ps.BoundAt = now
		ps.BoundTick = t.tick
		ps.Node = pod.Spec.NodeName
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse && c.Reason == v1.PodReasonUnschedulable {
			ps.Unschedulable = true
			if c.Message != ps.Message || ps.MessageAt.IsZero() {
				ps.MessageAt = now
			}
			ps.Message = c.Message
		}
	}
}

func claimPod(claim *resourceapi.ResourceClaim) string {
	for _, ref := range claim.OwnerReferences {
		if ref.Kind == "Pod" {
			return ref.Name
		}
	}
	for _, ref := range claim.Status.ReservedFor {
		if ref.Resource == "pods" {
			return ref.Name
		}
	}
	return ""
}

// onSlice follows the taints of the devices of a ResourceSlice: a device
// with a NoSchedule or NoExecute taint (the agent's health taint, say) is
// unhealthy until a later version of its slice has none. A deleted slice
// changes nothing: its devices are not published meanwhile, and its
// agent publishes them again.
func (t *tracker) onSlice(obj any) {
	slice, ok := obj.(*resourceapi.ResourceSlice)
	if !ok {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range slice.Spec.Devices {
		d := &slice.Spec.Devices[i]
		key := slice.Spec.Driver + "/" + slice.Spec.Pool.Name + "/" + d.Name
		if t.devices[key] == nil {
			continue
		}
		var what []string
		for _, taint := range d.Taints {
			if taint.Effect == resourceapi.DeviceTaintEffectNoSchedule || taint.Effect == resourceapi.DeviceTaintEffectNoExecute {
				what = append(what, taint.Key+"="+taint.Value)
			}
		}
		switch seen, ok := t.tainted[key]; {
		case len(what) == 0:
			delete(t.tainted, key)
		case !ok:
			rv, _ := strconv.ParseUint(slice.ResourceVersion, 10, 64)
			t.tainted[key] = seenTaint{Since: time.Now(), What: strings.Join(what, ","), RV: rv}
		default:
			seen.What = strings.Join(what, ",")
			t.tainted[key] = seen
		}
		t.inv.SetUnhealthy(key, len(what) > 0)
	}
}

// allocatedAfter reports whether the claim's allocation was written after
// the slice version that first had the taint: both come from one etcd,
// whose resourceVersions grow with every write. Where either cannot be
// read, the order in which the informers delivered them decides (the
// claim came later).
func allocatedAfter(claim *resourceapi.ResourceClaim, seen seenTaint) bool {
	rv, err := strconv.ParseUint(claim.ResourceVersion, 10, 64)
	if err != nil || seen.RV == 0 {
		return true
	}
	return rv > seen.RV
}

// healthyGPUs lists the UUIDs of the GPUs of a node that have no taint,
// in the order of their names' indexes.
func (t *tracker) healthyGPUs(node string) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for _, d := range t.nodeDevices[node] {
		if d.GPU && d.UUID != "" && !t.inv.Unhealthy(d.Key) {
			out = append(out, d.UUID)
		}
	}
	return out
}

// taintedGPU returns the key of the GPU with uuid on node, whether the
// tracker has seen a taint on it, and when it first saw it.
func (t *tracker) taintedGPU(node, uuid string) (string, bool, time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, d := range t.nodeDevices[node] {
		if d.GPU && d.UUID == uuid {
			seen, ok := t.tainted[d.Key]
			return d.Key, ok, seen.Since
		}
	}
	return "", false, time.Time{}
}

func (t *tracker) onClaim(obj any, deleted bool) {
	// A deletion that the informer missed while it did not watch: when
	// the claim went, relative to other claims' allocations, is unknown.
	_, missed := obj.(cache.DeletedFinalStateUnknown)
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	claim, ok := obj.(*resourceapi.ResourceClaim)
	if !ok {
		return
	}
	version, _ := strconv.ParseUint(claim.ResourceVersion, 10, 64)
	t.mu.Lock()
	defer t.mu.Unlock()
	cs := t.claims[claim.UID]
	if deleted || claim.Status.Allocation == nil {
		if cs != nil {
			t.release(cs, version, missed)
			delete(t.claims, claim.UID)
		}
		return
	}
	// The allocated devices that exist, and those that do not.
	var keys, missing []string
	for _, r := range claim.Status.Allocation.Devices.Results {
		if key := r.Driver + "/" + r.Pool + "/" + r.Device; t.devices[key] != nil {
			keys = append(keys, key)
		} else {
			missing = append(missing, key)
		}
	}
	if cs != nil {
		if slices.Equal(keys, cs.Devices) {
			return // already recorded
		}
		// Allocated anew while the informer did not watch (after an API
		// server restart): its deallocation, at a version unknown, was
		// never seen.
		t.release(cs, version, true)
		delete(t.claims, claim.UID)
	}
	pod := claimPod(claim)
	for _, key := range missing {
		t.errs = append(t.errs, fmt.Sprintf("claim %s of pod %s: allocated device %s does not exist", claim.Name, pod, key))
	}
	for _, key := range keys {
		if other, used := t.inv.Owner(key); used {
			t.conflicts[key] = conflict{claim: claim.Name, pod: pod, other: other, version: version}
		}
		if seen, ok := t.tainted[key]; ok && allocatedAfter(claim, seen) {
			t.taintedAllocations = append(t.taintedAllocations, TaintedAllocation{Claim: claim.Name, Pod: pod, Device: key, Taint: seen.What, After: time.Since(seen.Since)})
		}
	}
	if i, ok := t.placed[claim.UID]; ok {
		t.placements[i] = t.judge(claim.Name, pod, keys)
	} else {
		t.placed[claim.UID] = len(t.placements)
		t.placements = append(t.placements, t.judge(claim.Name, pod, keys))
	}
	for _, key := range keys {
		t.inv.Use(key, pod)
	}
	t.claims[claim.UID] = &claimState{Pod: pod, Devices: keys}
}

// release gives back the devices of a claim (cs) that was deallocated or
// deleted at resourceVersion version, or at a version unknown (missed). A
// device that another pod's claim was seen allocating meanwhile stays
// that pod's: where the claim gave it back before that allocation, or
// when is unknown, the two were seen out of order and hold no conflict.
// Caller holds mu.
func (t *tracker) release(cs *claimState, version uint64, missed bool) {
	for _, key := range cs.Devices {
		owner, used := t.inv.Owner(key)
		if !used || owner == cs.Pod {
			t.inv.Release(key)
			continue
		}
		if c, ok := t.conflicts[key]; ok && c.other == cs.Pod && (missed || version < c.version) {
			delete(t.conflicts, key)
			t.reordered++
		}
	}
}

// conflictErrors describes the devices held twice. Caller holds mu.
func (t *tracker) conflictErrors() []string {
	var out []string
	for key, c := range t.conflicts {
		out = append(out, fmt.Sprintf("claim %s of pod %s: device %s is already allocated to pod %s", c.claim, c.pod, key, c.other))
	}
	slices.Sort(out)
	return out
}

// judge rates an allocation against the state just before it. Caller holds
// mu.
func (t *tracker) judge(claim, pod string, keys []string) Placement {
	p := Placement{Pod: pod, Claim: claim, Tick: t.tick}
	var gpus, nics []string
	for _, key := range keys {
		d := t.devices[key]
		if d.GPU {
			gpus = append(gpus, key)
			p.GPUs = append(p.GPUs, d.Name)
		} else {
			nics = append(nics, key)
			p.NICs = append(p.NICs, d.Name)
		}
		p.Node = d.Node
	}
	// Where could the pod have gone? Nodes matching its nodeSelector.
	// Devices of the pod's own earlier claims count as free: a pair is
	// judged as of the pod's first claim.
	scope := measure.Scope{Owner: pod}
	if ps := t.pods[pod]; ps != nil && len(ps.NodeSelector) > 0 {
		selector := labels.SelectorFromSet(ps.NodeSelector)
		scope.Node = func(node string) bool { return selector.Matches(t.nodeLabels[node]) }
	}
	if len(gpus) >= 2 {
		p.MultiGPU = true
		clique := t.inv.Judge(gpus, measure.LevelNVLink, scope)
		root := t.inv.Judge(gpus, measure.LevelPCIeRoot, scope)
		numa := t.inv.Judge(gpus, measure.LevelNUMA, scope)
		p.InClique, p.CliquePossible = clique.Aligned, clique.Possible
		p.InRoot, p.RootPossible = root.Aligned, root.Possible
		p.InNUMA, p.NUMAPossible = numa.Aligned, numa.Possible
		p.CliqueTrivial = p.InClique && t.oneDomain(p.Node, measure.LevelNVLink, false)
		p.RootTrivial = p.InRoot && t.oneDomain(p.Node, measure.LevelPCIeRoot, false)
		p.NUMATrivial = p.InNUMA && t.oneDomain(p.Node, measure.LevelNUMA, false)
	}
	// Did the claim break into a node that no other pod used, although a
	// node in use offered a placement as tight (the same kind of domain)?
	if len(gpus) > 0 && len(nics) == 0 {
		busy := func(node string) bool {
			for _, d := range t.nodeDevices[node] {
				if user, used := t.inv.Owner(d.Key); used && user != pod && d.GPU {
					return true
				}
			}
			return false
		}
		if !busy(p.Node) {
			p.OpenedNode = true
			level := measure.LevelNode
			switch {
			case p.InRoot:
				level = measure.LevelPCIeRoot
			case p.InNUMA:
				level = measure.LevelNUMA
			case p.InClique:
				level = measure.LevelNVLink
			}
			for dom, free := range t.inv.Free(level, scope) {
				if free.GPUs >= len(gpus) && dom.Node != p.Node && busy(dom.Node) {
					p.BusyNodeHadRoom = true
					break
				}
			}
		}
	}
	// GPU+NIC pairs: within this claim, or, for a pod with several claims
	// (say one GPU claim and one NIC claim with topodra.io/align-with:
	// pod), over all its claims once the last one is allocated.
	if ps := t.pods[pod]; ps != nil && ps.Claims > 1 && t.allocatedClaims(pod)+1 == ps.Claims {
		gpus, nics = nil, nil
		for _, cs := range t.claims {
			if cs.Pod == pod {
				keys = append(slices.Clone(keys), cs.Devices...)
			}
		}
		for _, key := range keys {
			if t.devices[key].GPU {
				gpus = append(gpus, key)
			} else {
				nics = append(nics, key)
			}
		}
		p.PodLevel = true
	}
	if len(gpus) > 0 && len(nics) > 0 {
		p.GPUNIC = true
		v := t.inv.Judge(slices.Concat(gpus, nics), measure.LevelPCIeRoot, scope)
		p.NICSameRoot, p.NICPossible = v.Aligned, v.Possible
		p.NICRootTrivial = p.NICSameRoot && t.oneDomain(t.devices[gpus[0]].Node, measure.LevelPCIeRoot, true)
	}
	return p
}

// oneDomain reports whether every GPU of node, and every NIC too where
// nics, is in one and the same domain of level: no allocation of those
// devices there can miss the level. Caller holds mu.
func (t *tracker) oneDomain(node string, level measure.Level, nics bool) bool {
	value := ""
	for _, d := range t.inv.NodeDevices(node) {
		if d.NIC && !nics {
			continue
		}
		v := d.Domain(level)
		if v == "" || (value != "" && v != value) {
			return false
		}
		value = v
	}
	return value != ""
}

// settled reports whether every named pod is bound with all its claims
// allocated, or marked unschedulable.
func (t *tracker) settled(names []string) (bool, string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, name := range names {
		ps := t.pods[name]
		if ps.Bound {
			if n := t.allocatedClaims(name); n < ps.Claims {
				return false, fmt.Sprintf("pod %s bound to %s, %d of %d claims allocated", name, ps.Node, n, ps.Claims)
			}
			continue
		}
		if !ps.Unschedulable {
			return false, fmt.Sprintf("pod %s neither bound nor marked unschedulable", name)
		}
	}
	return true, ""
}

// released reports whether the named pods are gone and their claims
// deallocated or deleted.
func (t *tracker) released(names []string) (bool, string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, name := range names {
		if !t.pods[name].Gone {
			return false, fmt.Sprintf("pod %s not deleted yet", name)
		}
		if n := t.allocatedClaims(name); n > 0 {
			return false, fmt.Sprintf("pod %s deleted, %d claims still allocated", name, n)
		}
	}
	return true, ""
}

func (t *tracker) allocatedClaims(pod string) int {
	n := 0
	for _, cs := range t.claims {
		if cs.Pod == pod {
			n++
		}
	}
	return n
}

// evicted returns the pods that someone else deleted (preemption) and
// that are not gone yet; they are marked as being deleted by the
// simulator, which finishes their deletion as a kubelet would.
func (t *tracker) evicted() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for _, ps := range t.pods {
		if ps.Evicted && !ps.Deleting && !ps.Gone {
			ps.Deleting = true
			out = append(out, ps.Name)
		}
	}
	slices.Sort(out)
	return out
}

// undoEvicted lets evicted return the pod again (its deletion failed).
func (t *tracker) undoEvicted(name string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if ps := t.pods[name]; ps != nil && ps.Evicted {
		ps.Deleting = false
	}
}

// evictedPods returns every pod that someone else deleted.
func (t *tracker) evictedPods() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for _, ps := range t.pods {
		if ps.Evicted {
			out = append(out, ps.Name)
		}
	}
	slices.Sort(out)
	return out
}

// expired returns the bound pods whose lifetime ends at or before tick.
func (t *tracker) expired(tick int, lifetime func(job int) int) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for _, ps := range t.pods {
		if life := lifetime(ps.Job); ps.Bound && !ps.Deleting && life > 0 && ps.BoundTick+life <= tick {
			ps.Deleting = true
			out = append(out, ps.Name)
		}
	}
	slices.Sort(out)
	return out
}

// pendingWithGPUs counts the pods not bound that ask for gpus or more
// GPUs.
func (t *tracker) pendingWithGPUs(gpus int) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, ps := range t.pods {
		if !ps.Bound && ps.GPUs >= gpus {
			n++
		}
	}
	return n
}

// pendingAsking counts the pods not bound that ask for exactly gpus GPUs.
func (t *tracker) pendingAsking(gpus int) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, ps := range t.pods {
		if !ps.Bound && ps.GPUs == gpus {
			n++
		}
	}
	return n
}

// counts returns placed (ever bound), running and pending pods.
func (t *tracker) counts() (placed, running, pending int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, ps := range t.pods {
		switch {
		case ps.Bound:
			placed++
			if !ps.Gone {
				running++
			}
		default:
			pending++
		}
	}
	return
}

// snapshot copies the device assignment of every node.
func (t *tracker) snapshot(label string) Snapshot {
	t.mu.Lock()
	defer t.mu.Unlock()
	snap := Snapshot{Label: label, Tick: t.tick, Used: map[string]string{}}
	maps.Copy(snap.Used, t.inv.Owners())
	for key, seen := range t.tainted {
		if snap.Unhealthy == nil {
			snap.Unhealthy = map[string]string{}
		}
		snap.Unhealthy[key] = seen.What
	}
	return snap
}

// profileOf reads a node's profile label.
func (t *tracker) profileOf(node string) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.nodeLabels[node][LabelProfile]
}

// gpusAsked counts the GPUs that a pod's claim templates ask for: the
// ExactCount requests of the GPU class and the first subrequest of a
// firstAvailable request, whatever their selectors and constraints.
// Requests for all matching devices count as none: their size depends on
// the node.
func gpusAsked(pod *v1.Pod, templates map[string]*resourceapi.ResourceClaimTemplate) int {
	n := 0
	count := func(class string, mode resourceapi.DeviceAllocationMode, c int64) {
		if class != GPUClassName || mode == resourceapi.DeviceAllocationModeAll {
			return
		}
		n += int(max(c, 1))
	}
	for _, pc := range pod.Spec.ResourceClaims {
		if pc.ResourceClaimTemplateName == nil {
			continue
		}
		tmpl := templates[*pc.ResourceClaimTemplateName]
		if tmpl == nil {
			continue
		}
		for _, r := range tmpl.Spec.Spec.Devices.Requests {
			switch {
			case r.Exactly != nil:
				count(r.Exactly.DeviceClassName, r.Exactly.AllocationMode, r.Exactly.Count)
			case len(r.FirstAvailable) > 0:
				sub := r.FirstAvailable[0]
				count(sub.DeviceClassName, sub.AllocationMode, sub.Count)
			}
		}
	}
	return n
}

// demandOf sums what a pod's claims ask for, or returns nil when some
// request is not a plain ExactCount of the GPU or NIC class (selectors,
// All mode, firstAvailable, other classes) or a constraint is not one
// matchAttribute on pcieRoot over the only claim's requests: then free
// counts say nothing certain about whether the pod fits.
func demandOf(pod *v1.Pod, templates map[string]*resourceapi.ResourceClaimTemplate) *demand {
	d := &demand{}
	for _, pc := range pod.Spec.ResourceClaims {
		if pc.ResourceClaimTemplateName == nil {
			return nil
		}
		tmpl := templates[*pc.ResourceClaimTemplateName]
		if tmpl == nil {
			return nil
		}
		switch cs := tmpl.Spec.Spec.Devices.Constraints; {
		case len(cs) == 0:
		case len(cs) == 1 && len(pod.Spec.ResourceClaims) == 1 && len(cs[0].Requests) == 0 &&
			cs[0].MatchAttribute != nil && *cs[0].MatchAttribute == resourceapi.FullyQualifiedName(topology.AttrPCIeRoot):
			d.SameRoot = true
		default:
			return nil
		}
		for _, r := range tmpl.Spec.Spec.Devices.Requests {
			ex := r.Exactly
			if ex == nil || len(ex.Selectors) > 0 || ex.AllocationMode == resourceapi.DeviceAllocationModeAll || ex.AdminAccess != nil && *ex.AdminAccess {
				return nil
			}
			n := int(ex.Count)
			if n == 0 {
				n = 1
			}
			switch ex.DeviceClassName {
			case GPUClassName:
				d.GPUs += n
			case NICClassName:
				d.NICs += n
			default:
				return nil
			}
		}
	}
	return d
}

// retryable lists the pods that are not bound, though some node they may
// use has enough free GPUs and NICs for them (by count; for a pod that
// needs them on one PCIe root, some root of such a node), leaving out skip.
// Any scheduler that is correct must bind these once it retries them;
// a pod that needs half a node or more counts only if the headroom stays
// free. A pod nominated to a node (it preempted pods there) is listed
// too: it must be bound once its victims are gone.
func (t *tracker) retryable(skip map[string]bool) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	type free struct{ gpus, nics int }
	perNode := map[string]*free{}
	for node, devs := range t.nodeDevices {
		f := &free{}
		for _, d := range devs {
			if !t.inv.Available(d.Key) {
				continue
			}
			if d.GPU {
				f.gpus++
			} else if d.Driver == mockNICDriver {
				f.nics++
			}
		}
		perNode[node] = f
	}
	var out []string
	var rootFree map[measure.DomainID]measure.Count // per PCIe root, computed once needed
	for _, ps := range t.pods {
		if ps.Bound || ps.Gone || skip[ps.Name] {
			continue
		}
		if ps.Nominated != "" {
			// It preempted pods for room on that node: it is placed
			// once they are gone, whatever the counts say now.
			out = append(out, ps.Name)
			continue
		}
		if ps.Demand == nil {
			continue
		}
		selector := labels.SelectorFromSet(ps.NodeSelector)
		if !t.fitsWithHeadroom(selector, ps.Demand.GPUs) {
			continue
		}
		if ps.Demand.SameRoot {
			if rootFree == nil {
				rootFree = t.inv.Free(measure.LevelPCIeRoot, measure.Scope{})
			}
			want := measure.Count{GPUs: ps.Demand.GPUs, NICs: ps.Demand.NICs}
			for dom, c := range rootFree {
				if selector.Matches(t.nodeLabels[dom.Node]) && c.Covers(want) {
					out = append(out, ps.Name)
					break
				}
			}
			continue
		}
		for node, f := range perNode {
			if selector.Matches(t.nodeLabels[node]) && f.gpus >= ps.Demand.GPUs && f.nics >= ps.Demand.NICs {
				out = append(out, ps.Name)
				break
			}
		}
	}
	slices.Sort(out)
	return out
}

// lastWord says what the scheduler last said of a pod it has not placed
// (its PodScheduled condition's message) and how long ago the simulator
// saw that; "" where it said nothing.
func (t *tracker) lastWord(name string) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	ps := t.pods[name]
	if ps == nil || ps.Message == "" {
		return ""
	}
	return fmt.Sprintf("the scheduler said %s ago: %s", time.Since(ps.MessageAt).Round(100*time.Millisecond), ps.Message)
}

// boundWithClaims reports whether every named pod that is bound has all its
// claims allocated in the tracked state.
func (t *tracker) boundWithClaims(names []string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, name := range names {
		if ps := t.pods[name]; ps.Bound && t.allocatedClaims(name) < ps.Claims {
			return false
		}
	}
	return true
}
