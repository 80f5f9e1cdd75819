package topologydra

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/util/retry"
	resourcehelper "k8s.io/component-helpers/resource"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	v1helper "k8s.io/kubernetes/pkg/apis/core/v1/helper"
	schedmetrics "k8s.io/kubernetes/pkg/scheduler/metrics"
	"k8s.io/kubernetes/pkg/scheduler/util/assumecache"
	"k8s.io/utils/ptr"
)

// Extended resources backed by DRA (a DeviceClass with extendedResourceName,
// or the implicit deviceclass.resource.kubernetes.io/<class>): on a node
// whose allocatable lacks such a resource (no device plugin offers it),
// the devices come from DRA, through one ResourceClaim per pod that the
// scheduler writes (the "extended resource claim"). TopologyDRA keeps that
// claim in the cycle like any other claim to allocate, so that its
// devices are placed with the pod's other claims and with topology in
// mind:
//
//   - PreFilter adds it to the pod's claims: a claim that exists only in
//     the cycle (inMemoryClaimName, a random UID) with a request per
//     container and resource (see extendedRequests); claims of earlier
//     attempts are deleted, never reused (deleteLeftoverExtendedClaims);
//   - Filter hands the allocator, on each node, the requests of the
//     resources that the node's allocatable lacks; a node that offers them
//     all through a device plugin gets none of them (NodeResourcesFit
//     counts them there);
//   - Reserve marks its allocation in flight under the random UID;
//   - PreBind creates the claim (owned by the pod, with the annotation
//     resourceapi.ExtendedResourceClaimAnnotation), writes its allocation
//     and reservation like any claim's, and then names it in the pod's
//     status.extendedResourceClaimStatus;
//   - Unreserve deletes a claim that PreBind created and then drops the
//     in-flight allocation (where the delete fails, the allocation stays
//     in flight until the claim is gone or the informer shows its state,
//     see uncertainWrites).
//
// Once written, status.extendedResourceClaimStatus stays: the API server
// puts the old value back when a write leaves it out or sets it to null.
// The kubelet looks up the claim it names, so a pod whose status names a
// claim of an earlier attempt (deleted since) cannot run on a node whose
// device plugins offer all of its extended resources: Filter rejects such
// nodes (earlierStatusMessage), and PreBind checks the pod as the API has
// it where an earlier attempt may have written the status unseen.

// inMemoryClaimName names the extended resource claim until PreBind creates
// it. Not a valid object name, so it never matches a claim in the API; the
// scheduler's claim tracker knows the name (SignalClaimPendingAllocation
// does not look such a claim up in its cache).
const inMemoryClaimName = "<extended-resources>"

// extendedClaimCacheTimeout bounds PreBind's wait for the created claim to
// reach the claim cache (see awaitCached).
const extendedClaimCacheTimeout = 2 * time.Minute

// draExtended is one extended resource of the pod that a DeviceClass backs.
type draExtended struct {
	name  v1.ResourceName
	class string
}

// draExtendedResources lists the extended resources the pod requests that
// DeviceClasses back, by resource name.
func (pl *TopologyDRA) draExtendedResources(pod *v1.Pod) ([]draExtended, error) {
	var requested []v1.ResourceName
	for name, q := range resourcehelper.PodRequests(pod, resourcehelper.PodResourcesOptions{}) {
		if isDRAExtendedName(name) && !q.IsZero() {
			requested = append(requested, name)
		}
	}
	if len(requested) == 0 {
		return nil, nil
	}
	slices.Sort(requested)
	classOf := func(name v1.ResourceName) (string, error) {
		if resolver := pl.draManager.DeviceClassResolver(); resolver != nil {
			if class := resolver.GetDeviceClass(name); class != nil {
				return class.Name, nil
			}
			return "", nil
		}
		classes, err := pl.draManager.DeviceClasses().List()
		if err != nil {
			return "", err
		}
		for _, class := range classes {
			if backs(class, name) {
				return class.Name, nil
			}
		}
		return "", nil
	}
	var result []draExtended
	for _, name := range requested {
		class, err := classOf(name)
		if err != nil {
			return nil, fmt.Errorf("list device classes: %w", err)
		}
		if class != "" {
			result = append(result, draExtended{name: name, class: class})
		}
	}
	return result, nil
}

// isDRAExtendedName reports whether a DeviceClass may back the resource:
// an extended resource name, or an implicit class name (which is in a
// kubernetes.io domain, so not "extended" by the core helper's definition).
func isDRAExtendedName(name v1.ResourceName) bool {
	return v1helper.IsExtendedResourceName(name) || strings.HasPrefix(string(name), resourceapi.ResourceDeviceClassPrefix)
}

// backs reports whether class provides the extended resource name: its
// extendedResourceName, or the implicit deviceclass.resource.kubernetes.io/
// <class name> that every class has.
func backs(class *resourceapi.DeviceClass, name v1.ResourceName) bool {
	if explicit := ptr.Deref(class.Spec.ExtendedResourceName, ""); explicit != "" && v1.ResourceName(explicit) == name {
		return true
	}
	return v1.ResourceName(resourceapi.ResourceDeviceClassPrefix+class.Name) == name
}

// extendedClaim is the pod's extended resource claim in the cycle state.
// Its fields are written by PreFilter and read-only after, except where a
// field says otherwise.
type extendedClaim struct {
	// index is the claim's index in stateData.claims (the last one).
	index int
	// resources are the pod's DRA-backed extended resources.
	resources []draExtended
	// earlier: the pod's status names a claim of an earlier attempt, or
	// PreFilter found one left over. PreBind then checks, on a node that
	// needs no claim, that the pod's status names none.
	earlier bool
	// pendingUID is the UID under which Reserve marks the allocation in
	// flight: the random UID of the claim built by PreFilter.
	pendingUID types.UID
	// pod is the pod whose containers the requests come from.
	pod *v1.Pod

	// mu guards variants and nodes, which Filter writes concurrently.
	mu sync.Mutex
	// variants holds the claim built for each set of resources that DRA
	// serves (keyed by their names), nil where it is empty.
	variants map[string]*extendedVariant
	// nodes holds the variant Filter used on each node it accepted.
	nodes map[string]*extendedVariant

	// created is the claim PreBind created in the API (nil before).
	// Written by PreBind, read by Unreserve.
	created *resourceapi.ResourceClaim
}

// extendedVariant is the extended resource claim as one node needs it: the
// requests of the resources that the node's allocatable lacks.
type extendedVariant struct {
	// claim is what PreBind creates (without its random UID).
	claim *resourceapi.ResourceClaim
	// allocClaim is claim as the allocator sees it (withOwnedToleration).
	allocClaim *resourceapi.ResourceClaim
	// mappings say which request serves which container's resource.
	mappings []v1.ContainerExtendedResourceRequest
}

// extendedClaimOf returns the pod's extended resource claim for PreFilter,
// built in memory for this attempt, or nil when the pod has none. A claim
// of an earlier attempt, named in the pod's status or not, is never
// reused: its allocation was made for a node and for the resources that
// node's allocatable lacked, and the claim cache may still show it after
// Unreserve deleted it. PreFilter deletes it (deleteLeftoverExtendedClaims)
// and PreBind names the new one in the pod's status.
func (pl *TopologyDRA) extendedClaimOf(pod *v1.Pod, resources []draExtended) *resourceapi.ResourceClaim {
	if len(resources) == 0 {
		return nil
	}
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{
			Namespace:    pod.Namespace,
			Name:         inMemoryClaimName,
			GenerateName: pod.Name + "-extended-resources-",
			UID:          uuid.NewUUID(),
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: "v1", Kind: "Pod", Name: pod.Name, UID: pod.UID, Controller: ptr.To(true),
			}},
			Annotations: map[string]string{resourceapi.ExtendedResourceClaimAnnotation: "true"},
		},
		Spec: extendedSpec(pod, resources),
	}
}

// extendedSpec is the claim spec for the resources.
func extendedSpec(pod *v1.Pod, resources []draExtended) resourceapi.ResourceClaimSpec {
	reqs, _ := extendedRequests(pod, resources)
	return resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: reqs}}
}

// extendedForNode returns the variant of the in-memory claim (template)
// for the node (nil: a device plugin offers every resource there) and
// records it for Reserve.
func (pl *TopologyDRA) extendedForNode(e *extendedClaim, template *resourceapi.ResourceClaim, nodeInfo fwk.NodeInfo) *extendedVariant {
	allocatable := nodeInfo.GetAllocatable().GetScalarResources()
	var served []draExtended
	var names []string
	for _, r := range e.resources {
		if allocatable[r.name] > 0 {
			continue // a device plugin offers it here
		}
		served = append(served, r)
		names = append(names, string(r.name))
	}
	key := strings.Join(names, ",")
	e.mu.Lock()
	defer e.mu.Unlock()
	v, ok := e.variants[key]
	if !ok {
		if len(served) > 0 {
			reqs, mappings := extendedRequests(e.pod, served)
			claim := template.DeepCopy()
			claim.Spec = resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: reqs}}
			v = &extendedVariant{claim: claim, allocClaim: pl.withOwnedToleration(claim), mappings: mappings}
		}
		e.variants[key] = v
	}
	e.nodes[nodeInfo.Node().Name] = v
	return v
}

// onNode returns the variant Filter used on the node.
func (e *extendedClaim) onNode(node string) (*extendedVariant, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	v, ok := e.nodes[node]
	return v, ok
}

// extendedRequests builds the device requests of the extended resource
// claim for the resources, and which container's resource each serves.
//
// Containers are numbered across init containers and then containers.
// Containers that run for the pod's lifetime (regular containers and
// restartable init containers) get a request each for the devices they
// ask for. An init container that runs to completion first counts on the
// devices of the lifetime containers that start after it, in order; it
// asks only for what those lack, and all such init containers share one
// request, the largest (they run one after another). A request is named
// container-<container number>-request-<index of the resource among the
// container's requested resource names, sorted>, and counts the
// container's whole-number request. Requests are sorted by name.
func extendedRequests(pod *v1.Pod, resources []draExtended) ([]resourceapi.DeviceRequest, []v1.ContainerExtendedResourceRequest) {
	containers := append(slices.Clone(pod.Spec.InitContainers), pod.Spec.Containers...)
	lifetime := func(i int) bool {
		return i >= len(pod.Spec.InitContainers) || ptr.Deref(containers[i].RestartPolicy, "") == v1.ContainerRestartPolicyAlways
	}
	var requests []resourceapi.DeviceRequest
	var mappings []v1.ContainerExtendedResourceRequest
	for _, r := range resources {
		// Lifetime containers first: their requests, by container.
		own := make([]*resourceapi.DeviceRequest, len(containers))
		var lifetimeMappings, initMappings []v1.ContainerExtendedResourceRequest
		for i := range containers {
			if !lifetime(i) {
				continue
			}
			if n := containerCount(&containers[i], r.name); n > 0 {
				own[i] = exactRequest(requestName(&containers[i], i, r.name), r.class, n)
				lifetimeMappings = append(lifetimeMappings, mapping(&containers[i], r.name, own[i].Name))
			}
		}
		// Init containers that complete: the devices of the later
		// lifetime containers, then one shared request for the rest.
		var shared *resourceapi.DeviceRequest
		var sharedNames []string
		for i := range containers {
			if lifetime(i) {
				continue
			}
			need := containerCount(&containers[i], r.name)
			if need == 0 {
				continue
			}
			have := int64(0)
			for _, later := range own[i:] {
				if later == nil || have >= need {
					continue
				}
				have += later.Exactly.Count
				initMappings = append(initMappings, mapping(&containers[i], r.name, later.Name))
			}
			if have >= need {
				continue
			}
			req := exactRequest(requestName(&containers[i], i, r.name), r.class, need-have)
			initMappings = append(initMappings, mapping(&containers[i], r.name, req.Name))
			sharedNames = append(sharedNames, req.Name)
			if shared == nil || req.Exactly.Count > shared.Exactly.Count {
				shared = req
			}
		}
		if shared != nil {
			for j := range initMappings {
				if slices.Contains(sharedNames, initMappings[j].RequestName) {
					initMappings[j].RequestName = shared.Name
				}
			}
			requests = append(requests, *shared)
		}
		for _, req := range own {
			if req != nil {
				requests = append(requests, *req)
			}
		}
		mappings = append(mappings, lifetimeMappings...)
		mappings = append(mappings, initMappings...)
	}
	slices.SortFunc(requests, func(a, b resourceapi.DeviceRequest) int { return strings.Compare(a.Name, b.Name) })
	return requests, mappings
}

// checkExtendedCounts returns an error naming the first container whose
// request for one of resources is not a whole number of devices that fits
// an int64 (the API server accepts larger quantities): no claim can ask
// for it.
func checkExtendedCounts(pod *v1.Pod, resources []draExtended) error {
	for _, list := range [][]v1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for i := range list {
			for _, r := range resources {
				q, ok := list[i].Resources.Requests[r.name]
				if !ok {
					continue
				}
				if n, ok := q.AsInt64(); !ok || n < 0 {
					return fmt.Errorf("container %s requests %s of extended resource %s (device class %s): not a number of devices a claim can ask for", list[i].Name, q.String(), r.name, r.class)
				}
			}
		}
	}
	return nil
}

// containerCount is the container's whole-number request of the resource
// (0: none, or not a whole number).
func containerCount(c *v1.Container, name v1.ResourceName) int64 {
	q, ok := c.Resources.Requests[name]
	if !ok {
		return 0
	}
	n, ok := q.AsInt64()
	if !ok || n < 0 {
		return 0
	}
	return n
}

func requestName(c *v1.Container, index int, name v1.ResourceName) string {
	names := make([]string, 0, len(c.Resources.Requests))
	for n := range c.Resources.Requests {
		names = append(names, string(n))
	}
	slices.Sort(names)
	return fmt.Sprintf("container-%d-request-%d", index, slices.Index(names, string(name)))
}

func exactRequest(name, class string, count int64) *resourceapi.DeviceRequest {
	return &resourceapi.DeviceRequest{Name: name, Exactly: &resourceapi.ExactDeviceRequest{
		DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count,
	}}
}

func mapping(c *v1.Container, name v1.ResourceName, request string) v1.ContainerExtendedResourceRequest {
	return v1.ContainerExtendedResourceRequest{ContainerName: c.Name, ResourceName: string(name), RequestName: request}
}

// createExtendedClaim creates the claim of the variant in the API. A
// failure is reported on the pod (a Warning event) and returned.
func (pl *TopologyDRA) createExtendedClaim(ctx context.Context, pod *v1.Pod, v *extendedVariant) (*resourceapi.ResourceClaim, error) {
	claim := v.claim.DeepCopy()
	claim.Name, claim.UID = "", ""
	created, err := pl.client.ResourceV1().ResourceClaims(pod.Namespace).Create(ctx, claim, metav1.CreateOptions{})
	// The stock plugin's counter (registered by the scheduler while
	// DRAExtendedResource is on), with its labels: the claim has no admin
	// access and is owned by a Pod.
	status := "success"
	if err != nil {
		status = "failure"
	}
	schedmetrics.ResourceClaimCreatesTotal.WithLabelValues(status, "false", "", "Pod").Inc()
	if err != nil {
		err = fmt.Errorf("create the resource claim for extended resources %s: %w", extendedNames(v.mappings), err)
		pl.event(pod, v1.EventTypeWarning, "FailedExtendedResourceClaim", "Binding", "%s", err.Error())
		return nil, err
	}
	klog.FromContext(ctx).V(5).Info("Created extended resource claim", "pod", klog.KObj(pod), "claim", klog.KObj(created))
	return created, nil
}

// awaitCached waits (at most extendedClaimCacheTimeout, or until ctx
// ends) until the claim cache has the created claim and stores the claim
// written in it, and reports whether it did: until then, the claim's
// devices are known to the scheduler only as the in-flight allocation,
// which must stay.
func (pl *TopologyDRA) awaitCached(ctx context.Context, claim *resourceapi.ResourceClaim) bool {
	err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, extendedClaimCacheTimeout, true, func(context.Context) (bool, error) {
		err := pl.draManager.ResourceClaims().AssumeClaimAfterAPICall(claim)
		if errors.Is(err, assumecache.ErrNotFound) {
			return false, nil
		}
		// Any other error: the cache has a newer version already.
		return true, nil
	})
	if err != nil {
		klog.FromContext(ctx).V(2).Info("Extended resource claim not in the claim cache in time", "claim", klog.KObj(claim), "err", err)
		return false
	}
	return true
}

// setExtendedStatus writes the pod's status.extendedResourceClaimStatus:
// the claim PreBind created and which request serves which container. A
// failure is reported on the pod (a Warning event) and returned.
func (pl *TopologyDRA) setExtendedStatus(ctx context.Context, pod *v1.Pod, status *v1.PodExtendedResourceClaimStatus) error {
	patch, err := json.Marshal(map[string]any{"status": map[string]any{"extendedResourceClaimStatus": status}})
	if err == nil {
		_, err = pl.client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
	}
	if err != nil {
		err = fmt.Errorf("name resource claim %s in the pod's status.extendedResourceClaimStatus: %w", status.ResourceClaimName, err)
		pl.event(pod, v1.EventTypeWarning, "FailedExtendedResourceClaim", "Binding", "%s", err.Error())
		return err
	}
	return nil
}

// earlierStatusMessage says why a node whose device plugins offer all of
// the pod's extended resources cannot take a pod whose status names the
// extended resource claim of an earlier attempt; "" where the status
// names none.
func earlierStatusMessage(status *v1.PodExtendedResourceClaimStatus) string {
	if status == nil {
		return ""
	}
	return fmt.Sprintf("the pod's status.extendedResourceClaimStatus names resource claim %s of an earlier attempt, which the API server keeps once written and the kubelet would look up: the pod can only run where DRA provides its extended resources, not where device plugins offer them all", status.ResourceClaimName)
}

// checkNoEarlierStatus fails where the pod, as the API has it, names the
// extended resource claim of an earlier attempt in its status: the
// scheduler's copy may not show a status written by an attempt that
// failed after writing it.
func (pl *TopologyDRA) checkNoEarlierStatus(ctx context.Context, pod *v1.Pod) error {
	latest, err := pl.client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("read the pod's status.extendedResourceClaimStatus: %w", err)
	}
	if latest.UID != pod.UID {
		return fmt.Errorf("pod %s was replaced", klog.KObj(pod))
	}
	if msg := earlierStatusMessage(latest.Status.ExtendedResourceClaimStatus); msg != "" {
		return errors.New(msg)
	}
	return nil
}

// deleteExtendedClaim removes the finalizer of a claim that PreBind created
// and deletes it.
func (pl *TopologyDRA) deleteExtendedClaim(ctx context.Context, claim *resourceapi.ResourceClaim) error {
	claims := pl.client.ResourceV1().ResourceClaims(claim.Namespace)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		latest, err := claims.Get(ctx, claim.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		i := slices.Index(latest.Finalizers, resourceapi.Finalizer)
		if i < 0 {
			return nil
		}
		latest.Finalizers = slices.Delete(latest.Finalizers, i, i+1)
		_, err = claims.Update(ctx, latest, metav1.UpdateOptions{})
		return err
	})
	if err == nil {
		err = claims.Delete(ctx, claim.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &claim.UID}})
	}
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// deleteLeftoverExtendedClaims deletes the extended resource claims of
// earlier attempts: claims with the extended resource annotation whose
// controller is the pod. PreBind creates one and names it in the pod's
// status, and Unreserve deletes it when a later step fails; one is left
// where that delete failed, or where the scheduler stopped between
// PreBind and Bind. Only called for a pod that is being scheduled, so
// every such claim is left over. It returns an error where one cannot be
// deleted: the attempt must not go on, since the pod would be bound with
// a new claim while the leftover, reserved for it, keeps its devices for
// as long as the pod runs. The devices a deleted one frees count once the
// claim cache has seen the delete (an allocation that Unreserve kept in
// flight for it goes at once).
// It reports whether it found any.
func (pl *TopologyDRA) deleteLeftoverExtendedClaims(ctx context.Context, pod *v1.Pod) (found bool, err error) {
	logger := klog.FromContext(ctx)
	claims, err := pl.draManager.ResourceClaims().List()
	if err != nil {
		return false, fmt.Errorf("list claims for leftover extended resource claims: %w", err)
	}
	for _, claim := range claims {
		if claim.Namespace != pod.Namespace || claim.Annotations[resourceapi.ExtendedResourceClaimAnnotation] != "true" || claim.DeletionTimestamp != nil {
			continue
		}
		if owner := metav1.GetControllerOf(claim); owner == nil || owner.UID != pod.UID {
			continue
		}
		found = true
		if err := pl.deleteExtendedClaim(ctx, claim); err != nil {
			return true, fmt.Errorf("delete the extended resource claim %s of an earlier attempt (it is tried again at the pod's next attempt): %w", claim.Name, err)
		}
		// Its allocation, if Unreserve kept it in flight, is gone too.
		pl.settleGone(claim.UID)
		logger.V(2).Info("Deleted leftover extended resource claim of an earlier attempt", "pod", klog.KObj(pod), "claim", klog.KObj(claim))
	}
	return found, nil
}

// extendedNames lists the resources of mappings, for messages.
func extendedNames(mappings []v1.ContainerExtendedResourceRequest) string {
	var names []string
	for _, m := range mappings {
		if !slices.Contains(names, m.ResourceName) {
			names = append(names, m.ResourceName)
		}
	}
	return strings.Join(names, ", ")
}
