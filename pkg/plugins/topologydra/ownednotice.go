package topologydra

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/allocator"
	"github.com/topodra/topodra/pkg/eventnote"
)

// OwnedNoticeReason is the reason of the Warning event that tells the
// author of a pod of another scheduler that its claims ask for devices only
// TopologyDRA may hand out.
const OwnedNoticeReason = "TopodraSchedulerNeeded"

// stockCannotAllocate is what the stock DynamicResources plugin says in a
// pod's PodScheduled condition where it found no allocation of the pod's
// claims on a node: it names neither a taint nor a scheduler.
const stockCannotAllocate = "cannot allocate all claims"

// ownedNoticeRetries bounds how often writing one pod's notice is retried.
const ownedNoticeRetries = 5

// ownedNotices tells the authors of pods that another scheduler cannot
// place because their claims ask for devices that only this profile may
// hand out: every device that a request matches carries the owned taint,
// which the claim does not tolerate and which only TopologyDRA adds. Such a
// pod stays pending with the stock plugin's "cannot allocate all claims"
// (stockCannotAllocate in its PodScheduled condition), and the pod's
// scheduler cannot be changed. The pod gets one Warning event
// (OwnedNoticeReason) that names the claims and requests and says to
// create the pod again with spec.schedulerName set to this profile.
//
// Every replica of the scheduler watches pods, the standby ones too: the
// event has one name per pod (noticeName), so that the first replica to
// write it wins and the pod gets it once. A replica writes it at most once
// per pod over its life; a pod is judged again on later updates while it
// has no notice (its claims may be created or its devices published
// later). Safe for concurrent use.
type ownedNotices struct {
	pl       *TopologyDRA
	profile  string
	instance string
	client   kubernetes.Interface
	pods     corelisters.PodLister
	queue    workqueue.TypedRateLimitingInterface[cache.ObjectName]

	// view is the latest devicesView (currentView).
	view *devicesView

	mu sync.Mutex
	// sent holds the pods noticed, by UID, until they are deleted (also
	// where the deletion was handled while the notice was written).
	sent sets.Set[types.UID]
}

// newOwnedNotices returns the notices of pl's profile, written with pl's
// client about the pods of pl's pod lister; run runs them.
func newOwnedNotices(pl *TopologyDRA, profile string) *ownedNotices {
	instance, err := os.Hostname()
	if err != nil || instance == "" {
		instance = profile
	}
	return &ownedNotices{
		pl:       pl,
		profile:  profile,
		instance: instance,
		client:   pl.client,
		pods:     pl.pods,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[cache.ObjectName](),
			workqueue.TypedRateLimitingQueueConfig[cache.ObjectName]{Name: "topodra_owned_notices"}),
		sent: sets.New[types.UID](),
	}
}

// handler queues the pods that may need a notice and forgets deleted ones.
func (n *ownedNotices) handler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    n.consider,
		UpdateFunc: func(_, obj any) { n.consider(obj) },
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			if pod, ok := obj.(*v1.Pod); ok {
				n.mu.Lock()
				n.sent.Delete(pod.UID)
				n.mu.Unlock()
			}
		},
	}
}

func (n *ownedNotices) consider(obj any) {
	if pod, ok := obj.(*v1.Pod); ok && n.candidate(pod) {
		n.queue.Add(cache.MetaObjectToName(pod))
	}
}

// topologyProfiles holds the names of the profiles of this scheduler
// process that run TopologyDRA (registered by New): their pods are not
// other schedulers' pods. A profile of another TopologyDRA process is not
// known here.
var topologyProfiles sync.Map

// candidate reports whether pod is one that another scheduler failed to
// place for its claims, with no notice yet.
func (n *ownedNotices) candidate(pod *v1.Pod) bool {
	if pod.Spec.SchedulerName == n.profile || pod.Spec.NodeName != "" || pod.DeletionTimestamp != nil || len(pod.Spec.ResourceClaims) == 0 {
		return false
	}
	if _, ours := topologyProfiles.Load(pod.Spec.SchedulerName); ours {
		return false
	}
	scheduled := false
	for _, c := range pod.Status.Conditions {
		if c.Type == v1.PodScheduled {
			scheduled = c.Status == v1.ConditionFalse && c.Reason == v1.PodReasonUnschedulable && strings.Contains(c.Message, stockCannotAllocate)
			break
		}
	}
	if !scheduled {
		return false
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return !n.sent.Has(pod.UID)
}

// run writes notices until ctx is done.
func (n *ownedNotices) run(ctx context.Context) {
	go func() {
		<-ctx.Done()
		n.queue.ShutDown()
	}()
	for n.next(ctx) {
	}
}

// next judges one queued pod; false once the queue is shut down.
func (n *ownedNotices) next(ctx context.Context) bool {
	key, quit := n.queue.Get()
	if quit {
		return false
	}
	defer n.queue.Done(key)
	if err := n.notice(ctx, key); err != nil {
		if n.queue.NumRequeues(key) < ownedNoticeRetries {
			klog.FromContext(ctx).V(4).Info("Notice of the scheduler a pod needs not written, retrying", "pod", key, "err", err)
			n.queue.AddRateLimited(key)
			return true
		}
		klog.FromContext(ctx).Error(err, "Notice of the scheduler a pod needs not written", "pod", key, "scheduler", n.profile)
	}
	n.queue.Forget(key)
	return true
}

// notice writes the pod's notice where it needs one.
func (n *ownedNotices) notice(ctx context.Context, key cache.ObjectName) error {
	pod, err := n.pods.Pods(key.Namespace).Get(key.Name)
	if err != nil || !n.candidate(pod) {
		return nil
	}
	view, err := n.currentView(ctx)
	if err != nil || view == nil {
		return err
	}
	blocked, err := n.pl.ownedOnly(ctx, pod, view)
	if err != nil || len(blocked) == 0 {
		return err
	}
	// ownedOnly names requests only where the profile has an owned key.
	owned := n.pl.ownedToleration.Key
	scheduler := pod.Spec.SchedulerName
	if scheduler == "" {
		scheduler = v1.DefaultSchedulerName
	}
	what, match := blocked[0], "it matches"
	if len(blocked) > 1 {
		what, match = strings.Join(blocked[:len(blocked)-1], ", ")+" and "+blocked[len(blocked)-1], "they match"
	}
	note := eventnote.Format("%s cannot allocate the devices of %s: every device %s carries the taint %s, which only %s tolerates. "+
		"Create the pod again with spec.schedulerName: %s (a pod's scheduler cannot be changed; for a Deployment, Job or StatefulSet set it in the pod template)",
		scheduler, what, match, owned, n.profile, n.profile)
	ev := &eventsv1.Event{
		ObjectMeta:          metav1.ObjectMeta{Name: noticeName(pod), Namespace: pod.Namespace},
		EventTime:           metav1.NewMicroTime(time.Now()),
		ReportingController: n.profile,
		ReportingInstance:   n.instance,
		Action:              "Scheduling",
		Reason:              OwnedNoticeReason,
		Type:                v1.EventTypeWarning,
		Note:                note,
		Regarding: v1.ObjectReference{
			Kind: "Pod", APIVersion: "v1", Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID, ResourceVersion: pod.ResourceVersion,
		},
	}
	_, err = n.client.EventsV1().Events(pod.Namespace).Create(ctx, ev, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	if err == nil {
		klog.FromContext(ctx).V(2).Info("Told a pod of another scheduler that its claims need this one", "pod", klog.KObj(pod), "podScheduler", scheduler, "requests", blocked)
	}
	n.mu.Lock()
	n.sent.Insert(pod.UID)
	n.mu.Unlock()
	// Deleted while the notice was written: the delete handler may have
	// run before the insert, and no later event would drop the pod.
	if p, err := n.pods.Pods(pod.Namespace).Get(pod.Name); apierrors.IsNotFound(err) || err == nil && p.UID != pod.UID {
		n.mu.Lock()
		n.sent.Delete(pod.UID)
		n.mu.Unlock()
	}
	return nil
}

// noticeName is the name of a pod's notice event: one per pod, the same
// in every replica.
func noticeName(pod *v1.Pod) string {
	name := pod.Name
	if len(name) > 200 {
		name = name[:200]
	}
	return fmt.Sprintf("%s.topodra-%s", name, pod.UID)
}

// ownedOnly lists, as "claim <name> request <name>", the requests of the
// pod's unallocated claims that match devices of this cluster only with
// the owned taint tolerated: no device they match could be allocated to
// them as they are, whatever is in use, while one could with the owned
// toleration that TopologyDRA adds. Each request is judged alone, without
// the claim's constraints. Requests it cannot judge by counting (fields
// the allocator does not interpret, input errors) are left out, as are
// claims that do not exist yet. view holds the devices to judge by; nil
// builds one.
func (pl *TopologyDRA) ownedOnly(ctx context.Context, pod *v1.Pod, view *devicesView) ([]string, error) {
	if pl.ownedToleration == nil {
		return nil, nil
	}
	claims, err := pl.podClaims(pod)
	if err != nil {
		return nil, nil
	}
	if view == nil {
		if view, err = pl.newDevicesView(ctx); err != nil || view == nil {
			return nil, err
		}
	}
	a, nodes := view.allocator, view.nodes
	servable := func(claim *resourceapi.ResourceClaim) (yes, known bool) {
		counts, matched, err := a.CountDevices(ctx, []*resourceapi.ResourceClaim{claim}, nodes)
		if err != nil || !matched {
			return false, false
		}
		for _, byDriver := range counts {
			for _, c := range byDriver {
				if c.MatchingFree > 0 {
					return true, true
				}
			}
		}
		return false, true
	}
	var blocked []string
	for _, claim := range claims {
		if claim.Status.Allocation != nil {
			continue
		}
		for i := range claim.Spec.Devices.Requests {
			// The request alone: constraints and config name the
			// claim's other requests too.
			one := claim.DeepCopy()
			one.Spec.Devices.Requests = one.Spec.Devices.Requests[i : i+1]
			one.Spec.Devices.Constraints = nil
			one.Spec.Devices.Config = nil
			if yes, known := servable(one); yes || !known {
				continue
			}
			if yes, _ := servable(pl.withOwnedToleration(one)); yes {
				blocked = append(blocked, fmt.Sprintf("claim %s request %s", claim.Name, claim.Spec.Devices.Requests[i].Name))
			}
		}
	}
	return blocked, nil
}

// devicesView is an Allocator over the cluster's slices with nothing
// allocated, and the nodes with slices: what ownedOnly judges requests
// with.
type devicesView struct {
	allocator *allocator.Allocator
	nodes     sets.Set[string]
	built     time.Time
}

// viewReuse is how long the notices judge pods with one devicesView: a
// burst of pods is judged without indexing every slice for each.
const viewReuse = 10 * time.Second

// newDevicesView builds a devicesView from the slices as the scheduler
// sees them now; nil where the allocator cannot be built.
func (pl *TopologyDRA) newDevicesView(ctx context.Context) (*devicesView, error) {
	slices, err := pl.draManager.ResourceSlices().ListWithDeviceTaintRules()
	if err != nil {
		return nil, fmt.Errorf("list resource slices: %w", err)
	}
	a, err := allocator.New(ctx, allocator.Options{
		Features:    pl.features,
		ClassLister: pl.draManager.DeviceClasses(),
		Slices:      slices,
		CELCache:    pl.celCache,
		Cache:       pl.cache,
		Policy:      pl.policy,
	})
	if err != nil {
		return nil, nil
	}
	nodes := sets.New[string]()
	for _, s := range slices {
		if s.Spec.NodeName != nil && *s.Spec.NodeName != "" {
			nodes.Insert(*s.Spec.NodeName)
		}
	}
	return &devicesView{allocator: a, nodes: nodes, built: time.Now()}, nil
}

// currentView returns the view built within viewReuse, or a new one. Only
// the notices' one worker calls it.
func (n *ownedNotices) currentView(ctx context.Context) (*devicesView, error) {
	if n.view != nil && time.Since(n.view.built) < viewReuse {
		return n.view, nil
	}
	view, err := n.pl.newDevicesView(ctx)
	n.view = view
	return view, err
}
