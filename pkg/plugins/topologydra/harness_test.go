package topologydra

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	corelisters "k8s.io/client-go/listers/core/v1"
	cgotesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/deviceclass/extendedresourcecache"
	resourceslicetracker "k8s.io/dynamic-resource-allocation/resourceslice/tracker"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	internalcache "k8s.io/kubernetes/pkg/scheduler/backend/cache"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources"
	frameworkruntime "k8s.io/kubernetes/pkg/scheduler/framework/runtime"
	schedmetrics "k8s.io/kubernetes/pkg/scheduler/metrics"
	"k8s.io/kubernetes/pkg/scheduler/util/assumecache"
	"k8s.io/kubernetes/test/utils/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

// harness runs the plugin on the scheduler's own framework runtime and DRA
// manager (claim assume cache, slice tracker with DeviceTaintRules), fed by
// informers on a fake clientset.
type harness struct {
	tCtx     ktesting.TContext
	client   *fake.Clientset
	recorder *events.FakeRecorder
	// eventRecorder, where a clientHook sets it, records the plugin's
	// events instead of recorder.
	eventRecorder events.EventRecorderLogger
	pl            *TopologyDRA
	nodes         map[string]fwk.NodeInfo
	// podLister is the plugin's pod lister for deleted pods, which the
	// harness takes out of the plugin (see newHarnessWith).
	podLister corelisters.PodLister
	// activated records the pods the plugin moved to the active queue.
	activated *recordingActivator
	// nominator is the scheduler's record of nominations.
	nominator *nominator

	// delivered holds the last version of each claim that the claim
	// cache's event handlers have been given, nil after a delete. Its
	// handler is registered after the DRA manager's and the plugin's, and
	// the cache delivers events to its handlers in registration order, so
	// once a version is here the manager's allocated-device tracker has
	// seen it too. The cache's Get is updated before any handler runs.
	mu        sync.Mutex
	delivered map[string]*resourceapi.ResourceClaim
}

const (
	testNS    = "ns"
	testClass = "gpu"
)

// newHarness creates the nodes and objects through the fake API (so that the reactor
// gives them UIDs and resource versions), starts the informers, waits for
// the DRA manager to see everything and builds the plugin with default args.
func newHarness(t testing.TB, nodes []*v1.Node, objs ...runtime.Object) *harness {
	return newHarnessWith(t, nil, nodes, objs...)
}

// newHarnessWith is newHarness with clientHook, if not nil, called on the
// harness before any informer starts (to add reactors to h.client).
func newHarnessWith(t testing.TB, clientHook func(*harness), nodes []*v1.Node, objs ...runtime.Object) *harness {
	tCtx := ktesting.Init(t)
	h := &harness{tCtx: tCtx, client: fake.NewClientset(), recorder: events.NewFakeRecorder(100), nodes: map[string]fwk.NodeInfo{},
		delivered: map[string]*resourceapi.ResourceClaim{}}
	h.client.PrependReactor("*", "*", versionReactor(h.client.Tracker()))
	if clientHook != nil {
		clientHook(h)
	}
	factory := informers.NewSharedInformerFactory(h.client, 0)
	tracker, err := resourceslicetracker.StartTracker(tCtx, resourceslicetracker.Options{
		EnableDeviceTaintRules: true,
		SliceInformer:          factory.Resource().V1().ResourceSlices(),
		TaintInformer:          factory.Resource().V1().DeviceTaintRules(),
		KubeClient:             h.client,
	})
	tCtx.ExpectNoError(err, "start slice tracker")
	claims := assumecache.NewAssumeCache(tCtx.Logger(), factory.Resource().V1().ResourceClaims().Informer(), "resource claim", "", nil)
	claimsSynced := claims.AddEventHandler(cache.ResourceEventHandlerFuncs{})
	manager := dynamicresources.NewDRAManager(tCtx, claims, tracker, factory)
	// The scheduler feeds the manager's extended resource names
	// (DeviceClassResolver) from the DeviceClass informer.
	// Setup waits for the cache's handler to have seen the initial
	// classes, not only for the informer's store.
	synced := []cache.DoneChecker{tracker.HasSyncedChecker(), claimsSynced.HasSyncedChecker()}
	if resolver, ok := manager.DeviceClassResolver().(*extendedresourcecache.ExtendedResourceCache); ok && resolver != nil {
		reg, err := factory.Resource().V1().DeviceClasses().Informer().AddEventHandler(resolver)
		tCtx.ExpectNoError(err, "register the extended resource cache")
		synced = append(synced, reg.HasSyncedChecker())
	}
	h.activated = &recordingActivator{}
	h.nominator = &nominator{}
	// The framework's Parallelizer (PreFilter counts nodes with it)
	// records the scheduler's metrics, which scheduler.New registers.
	schedmetrics.Register()
	fh, err := frameworkruntime.NewFramework(tCtx, nil, nil,
		frameworkruntime.WithPodActivator(h.activated),
		frameworkruntime.WithPodNominator(h.nominator),
		frameworkruntime.WithClientSet(h.client),
		frameworkruntime.WithInformerFactory(factory),
		frameworkruntime.WithEventRecorder(cmp.Or[events.EventRecorderLogger](h.eventRecorder, h.recorder)),
		frameworkruntime.WithSharedDRAManager(manager),
		frameworkruntime.WithSnapshotSharedLister(internalcache.NewSnapshot(nil, nodes)),
	)
	tCtx.ExpectNoError(err, "create framework")
	pl, err := New(tCtx, nil, fh)
	tCtx.ExpectNoError(err, "create plugin")
	h.pl = pl.(*TopologyDRA)
	// Most tests schedule pods that they never create in the API, which
	// the plugin's check for deleted pods (heldBack.lister) would take
	// for pods deleted during their attempt; TestHeldBackForgetsDeletedPod
	// puts it back.
	h.podLister, h.pl.heldBack.lister = h.pl.heldBack.lister, nil
	deliveredSynced := claims.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { h.deliver(obj, false) },
		UpdateFunc: func(_, obj any) { h.deliver(obj, false) },
		DeleteFunc: func(obj any) { h.deliver(obj, true) },
	})
	for _, n := range nodes {
		h.create(n)
	}
	for _, obj := range objs {
		h.create(obj)
	}
	factory.Start(tCtx.Done())
	t.Cleanup(func() {
		tCtx.Cancel("test is done")
		factory.Shutdown()
		frameworkruntime.WaitForShutdown(fh)
	})
	factory.WaitForCacheSync(tCtx.Done())
	cache.WaitFor(tCtx, "handlers", append(synced, deliveredSynced.HasSyncedChecker())...)
	for _, n := range nodes {
		info := framework.NewNodeInfo()
		info.SetNode(n)
		h.nodes[n.Name] = info
	}
	return h
}

func (h *harness) create(obj runtime.Object) {
	h.tCtx.Helper()
	var err error
	switch o := obj.(type) {
	case *resourceapi.ResourceClaim:
		_, err = h.client.ResourceV1().ResourceClaims(o.Namespace).Create(h.tCtx, o, metav1.CreateOptions{})
	case *resourceapi.ResourceSlice:
		_, err = h.client.ResourceV1().ResourceSlices().Create(h.tCtx, o, metav1.CreateOptions{})
	case *resourceapi.DeviceClass:
		_, err = h.client.ResourceV1().DeviceClasses().Create(h.tCtx, o, metav1.CreateOptions{})
	case *v1.Node:
		_, err = h.client.CoreV1().Nodes().Create(h.tCtx, o, metav1.CreateOptions{})
	case *policyv1.PodDisruptionBudget:
		_, err = h.client.PolicyV1().PodDisruptionBudgets(o.Namespace).Create(h.tCtx, o, metav1.CreateOptions{})
	default:
		err = fmt.Errorf("unsupported object %T", obj)
	}
	h.tCtx.ExpectNoError(err)
}

func (h *harness) deliver(obj any, deleted bool) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	claim, ok := obj.(*resourceapi.ResourceClaim)
	if !ok {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if deleted {
		h.delivered[claim.Name] = nil
		return
	}
	h.delivered[claim.Name] = claim
}

// waitForClaim waits until the plugin's claim cache, and every consumer of
// its events (the allocated-device tracker among them), holds a version of
// the claim for which cond is true.
func (h *harness) waitForClaim(name string, cond func(*resourceapi.ResourceClaim) bool) {
	h.tCtx.Helper()
	err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		h.mu.Lock()
		c := h.delivered[name]
		h.mu.Unlock()
		return c != nil && cond(c), nil
	})
	h.tCtx.ExpectNoError(err, "claim "+name+" in the plugin's cache")
}

// waitForClaimGone waits until the deletion of a claim has reached every
// consumer of the claim cache's events.
func (h *harness) waitForClaimGone(name string) {
	h.tCtx.Helper()
	err := wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		h.mu.Lock()
		defer h.mu.Unlock()
		c, seen := h.delivered[name]
		return seen && c == nil, nil
	})
	h.tCtx.ExpectNoError(err, "claim "+name+" still cached")
}

// apiClaim reads a claim from the fake API.
func (h *harness) apiClaim(name string) *resourceapi.ResourceClaim {
	h.tCtx.Helper()
	c, err := h.client.ResourceV1().ResourceClaims(testNS).Get(h.tCtx, name, metav1.GetOptions{})
	h.tCtx.ExpectNoError(err)
	return c
}

// versionReactor gives created objects a UID (and a name from their
// generateName) and every write a new resource version, newer than the
// version of the object it replaces (which a test may have stored in the
// tracker directly), as the API server does; the fake tracker does none
// of that.
func versionReactor(tracker cgotesting.ObjectTracker) cgotesting.ReactionFunc {
	var mu sync.Mutex
	version := 0
	return func(action cgotesting.Action) (bool, runtime.Object, error) {
		mu.Lock()
		defer mu.Unlock()
		var obj runtime.Object
		switch a := action.(type) {
		case cgotesting.CreateAction:
			obj = a.GetObject()
		case cgotesting.UpdateAction:
			obj = a.GetObject()
		default:
			return false, nil, nil
		}
		meta, err := metaOf(obj)
		if err != nil {
			return false, nil, nil
		}
		if action.GetVerb() == "create" && meta.GetName() == "" && meta.GetGenerateName() != "" {
			meta.SetName(fmt.Sprintf("%s%d", meta.GetGenerateName(), version))
		}
		if action.GetVerb() == "create" && meta.GetUID() == "" {
			meta.SetUID(types.UID(fmt.Sprintf("uid-%s-%s", meta.GetNamespace(), meta.GetName())))
		}
		if action.GetVerb() == "update" {
			if stored, err := tracker.Get(action.GetResource(), meta.GetNamespace(), meta.GetName()); err == nil {
				if m, err := metaOf(stored); err == nil {
					if v, err := strconv.Atoi(m.GetResourceVersion()); err == nil && v > version {
						version = v
					}
				}
			}
		}
		version++
		meta.SetResourceVersion(strconv.Itoa(version))
		return false, nil, nil
	}
}

func metaOf(obj runtime.Object) (metav1.Object, error) {
	m, ok := obj.(metav1.Object)
	if !ok {
		return nil, fmt.Errorf("%T has no object meta", obj)
	}
	return m, nil
}

func testNode(name string) *v1.Node {
	return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubernetes.io/hostname": name}}}
}

func testDeviceClass() *resourceapi.DeviceClass {
	return &resourceapi.DeviceClass{
		ObjectMeta: metav1.ObjectMeta{Name: testClass},
		Spec: resourceapi.DeviceClassSpec{Selectors: []resourceapi.DeviceSelector{{
			CEL: &resourceapi.CELDeviceSelector{Expression: fmt.Sprintf("device.driver == %q", topology.DriverName)},
		}}},
	}
}

// testSlice publishes n GPUs on node, two per PCIe root.
func testSlice(node string, n int) *resourceapi.ResourceSlice {
	s := &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: node + "-gpus"},
		Spec: resourceapi.ResourceSliceSpec{
			Driver:   topology.DriverName,
			NodeName: ptr.To(node),
			Pool:     resourceapi.ResourcePool{Name: node, ResourceSliceCount: 1},
		},
	}
	for i := range n {
		s.Spec.Devices = append(s.Spec.Devices, resourceapi.Device{
			Name: fmt.Sprintf("gpu-%d", i),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				topology.AttrPCIeRoot: {StringValue: ptr.To(fmt.Sprintf("pci-%d", i/2))},
			},
		})
	}
	return s
}

// testClaim asks for count GPUs of testClass.
func testClaim(name string, count int64, selectors ...string) *resourceapi.ResourceClaim {
	req := resourceapi.ExactDeviceRequest{DeviceClassName: testClass, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count}
	for _, s := range selectors {
		req.Selectors = append(req.Selectors, resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: s}})
	}
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNS, Name: name},
		Spec:       resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &req}}}},
	}
}

// allocatedOn returns claim allocated to devices of node (reserved for
// nobody).
func allocatedOn(claim *resourceapi.ResourceClaim, node string, devices ...string) *resourceapi.ResourceClaim {
	claim.Finalizers = []string{resourceapi.Finalizer}
	claim.Status.Allocation = &resourceapi.AllocationResult{
		NodeSelector: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{
			MatchFields: []v1.NodeSelectorRequirement{{Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{node}}},
		}}},
	}
	for _, d := range devices {
		claim.Status.Allocation.Devices.Results = append(claim.Status.Allocation.Devices.Results, resourceapi.DeviceRequestAllocationResult{
			Request: "gpu", Driver: topology.DriverName, Pool: node, Device: d,
		})
	}
	return claim
}

// testPod uses the named claims directly.
func testPod(name string, claims ...string) *v1.Pod {
	p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: testNS, Name: name, UID: types.UID("pod-" + name)}}
	for _, c := range claims {
		p.Spec.ResourceClaims = append(p.Spec.ResourceClaims, v1.PodResourceClaim{Name: c, ResourceClaimName: ptr.To(c)})
	}
	return p
}

// createSeen creates pod in the API and returns it (with the UID the API
// gave it) once the plugin's pod lister has it.
func (h *harness) createSeen(pod *v1.Pod) *v1.Pod {
	h.tCtx.Helper()
	created, err := h.client.CoreV1().Pods(testNS).Create(h.tCtx, pod, metav1.CreateOptions{})
	h.tCtx.ExpectNoError(err, "create pod "+pod.Name)
	err = wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		_, err := h.pl.pods.Pods(testNS).Get(pod.Name)
		return err == nil, nil
	})
	h.tCtx.ExpectNoError(err, "the pod lister never saw pod "+pod.Name)
	return created
}

// createPending creates pod in the API and waits until the plugin's
// pending-pod index has it.
func (h *harness) createPending(pod *v1.Pod) {
	h.tCtx.Helper()
	_, err := h.client.CoreV1().Pods(testNS).Create(h.tCtx, pod, metav1.CreateOptions{})
	h.tCtx.ExpectNoError(err, "create pod "+pod.Name)
	err = wait.PollUntilContextTimeout(h.tCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		h.pl.pending.mu.Lock()
		defer h.pl.pending.mu.Unlock()
		return h.pl.pending.pods[pod.Spec.SchedulerName][pod.UID] != nil, nil
	})
	h.tCtx.ExpectNoError(err, "the pending index never saw pod "+pod.Name)
}

// draining runs pod's cycle on nodes (PreFilter, Filter, PreScore) and
// returns the nodes PreScore marked draining.
func (h *harness) draining(pod *v1.Pod, nodes ...string) sets.Set[string] {
	h.tCtx.Helper()
	cs, _ := h.cycle(pod, nodes...)
	var infos []fwk.NodeInfo
	for _, n := range nodes {
		infos = append(infos, h.nodes[n])
	}
	if st := h.pl.PreScore(h.tCtx, cs, pod, infos); !st.IsSuccess() {
		h.tCtx.Fatalf("PreScore: %v", st)
	}
	s, err := getState(cs)
	h.tCtx.ExpectNoError(err, "cycle state")
	return s.draining
}

// recordingActivator is the scheduling queue's PodActivator for the
// harness: it records the pods it is asked to activate.
type recordingActivator struct {
	mu   sync.Mutex
	pods []string
}

func (r *recordingActivator) Activate(_ klog.Logger, pods map[string]*v1.Pod) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, p := range pods {
		r.pods = append(r.pods, p.Namespace+"/"+p.Name)
	}
}

// activatedPods returns the pods activated so far.
func (r *recordingActivator) activatedPods() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.pods)
}

// nominator is the scheduler's record of nominations (fwk.PodNominator),
// which the scheduling queue keeps; tests fill it with AddNominatedPod.
type nominator struct {
	mu     sync.Mutex
	byNode map[string][]fwk.PodInfo
}

func (n *nominator) AddNominatedPod(_ klog.Logger, pi fwk.PodInfo, ni *fwk.NominatingInfo) {
	n.DeleteNominatedPodIfExists(pi.GetPod())
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.byNode == nil {
		n.byNode = map[string][]fwk.PodInfo{}
	}
	if ni != nil && ni.NominatedNodeName != "" {
		n.byNode[ni.NominatedNodeName] = append(n.byNode[ni.NominatedNodeName], pi)
	}
}

func (n *nominator) DeleteNominatedPodIfExists(pod *v1.Pod) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for node, pods := range n.byNode {
		n.byNode[node] = slices.DeleteFunc(pods, func(pi fwk.PodInfo) bool { return pi.GetPod().UID == pod.UID })
	}
}

func (n *nominator) UpdateNominatedPod(_ klog.Logger, _ *v1.Pod, _ fwk.PodInfo) {}

func (n *nominator) NominatedPodsForNode(node string) []fwk.PodInfo {
	n.mu.Lock()
	defer n.mu.Unlock()
	return slices.Clone(n.byNode[node])
}
