package agent

import (
	"context"
	"errors"
	"fmt"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
)

// ReasonNodeRecreated (Normal, on the Node): the Node was deleted and
// created again under the same name; the agent now publishes its devices
// owned by the new Node.
const ReasonNodeRecreated = "TopodraNodeRecreated"

// followNode makes the Node as read the owner of the published slices.
//
// The slices name the Node by UID in their owner reference, and the
// resourceslice controller keeps the UID it started with. Once the Node
// has been deleted and created again, the garbage collector deletes every
// slice that names the old UID, and a controller that still names it
// would create them again only to see them deleted: the node's devices
// would flicker in and out of the API until the agent restarts. So the
// agent stops that controller, deletes its slices owned by another Node
// (the garbage collector would, later), and starts a controller owned by
// the new Node, which publishes the same devices. Claims prepared on the
// node are not touched.
func (a *Agent) followNode(ctx context.Context, node *v1.Node) error {
	a.publishMutex.Lock()
	defer a.publishMutex.Unlock()
	old := a.ownerUID
	if node.UID == "" || node.UID == old || a.ctx.Err() != nil {
		// Nothing new, or the agent stops (Stop has stopped the
		// publisher already).
		return nil
	}
	a.mutex.Lock()
	resources := a.published
	a.mutex.Unlock()
	if resources == nil {
		// Nothing published yet: the next publish names this Node.
		a.ownerUID = node.UID
		return nil
	}
	logger := klog.FromContext(ctx)
	// unknown: the agent could not read the Node when it started
	// publishing, so the controller looked it up itself, and the Node
	// may have been created again since. The slices say which one it
	// took where it has written them; where they name no other Node it
	// most likely took this one, but it may also have looked up one
	// deleted since and not written yet. The controller is started again
	// owned by this Node either way, which writes nothing where the
	// slices are already its own.
	unknown := old == ""
	if unknown {
		stale, err := a.ownSlicesOwnedByOthers(ctx, node.UID)
		if err != nil {
			return err // ownerUID stays unknown: the next check looks again
		}
		old = "unknown"
		if len(stale) == 0 {
			logger.V(2).Info("Publishing owned by the Node as read now", "uid", node.UID)
		} else {
			unknown = false
		}
	}
	if !unknown {
		logger.Info("The Node was created again, publishing the devices owned by the new Node", "uid", node.UID, "previousUID", old)
	}
	a.publisher.Stop() // nil after a failed start below: a no-op
	a.setPublisherLocked(nil)
	deleted, delErr := a.deleteSlicesOwnedByOthers(ctx, node.UID)
	publisher, err := publishStatic(a.ctx, a.opts.KubeClient, a.opts.DriverName, a.opts.NodeName, node.UID, *resources, a.publishHooks())
	if err != nil {
		// ownerUID stays the old one: the next node check tries again.
		return errors.Join(delErr, err)
	}
	a.ownerUID = node.UID
	a.setPublisherLocked(publisher)
	if unknown && deleted == 0 {
		return delErr
	}
	a.nodeEvent(v1.EventTypeNormal, ReasonNodeRecreated, "Publish",
		"the Node was deleted and created again (UID %s, before %s): %s devices are published owned by the new Node (%d slices owned by the old one deleted)",
		node.UID, old, a.opts.DriverName, deleted)
	return delErr
}

// ownSlicesOwnedByOthers lists the agent's slices on its node (its
// driver, its node name) that a Node other than uid owns.
func (a *Agent) ownSlicesOwnedByOthers(ctx context.Context, uid types.UID) ([]resourceapi.ResourceSlice, error) {
	list, err := a.listOwnSlices(ctx)
	if err != nil {
		return nil, fmt.Errorf("list the slices of node %s: %w", a.opts.NodeName, err)
	}
	var out []resourceapi.ResourceSlice
	for _, slice := range list.Items {
		if ownedByOtherNode(&slice, a.opts.NodeName, uid) {
			out = append(out, slice)
		}
	}
	return out, nil
}

// deleteSlicesOwnedByOthers deletes the agent's slices that a Node other
// than uid owns (see ownSlicesOwnedByOthers), each by its own UID, so
// that a slice created meanwhile is left alone.
func (a *Agent) deleteSlicesOwnedByOthers(ctx context.Context, uid types.UID) (int, error) {
	stale, err := a.ownSlicesOwnedByOthers(ctx, uid)
	if err != nil {
		return 0, err
	}
	deleted := 0
	var errs []error
	for _, slice := range stale {
		err := a.opts.KubeClient.ResourceV1().ResourceSlices().Delete(ctx, slice.Name, metav1.DeleteOptions{
			Preconditions: &metav1.Preconditions{UID: &slice.UID},
		})
		switch {
		case err == nil:
			deleted++
		case apierrors.IsNotFound(err), apierrors.IsConflict(err):
			// Gone already (the garbage collector), or replaced.
		default:
			errs = append(errs, fmt.Errorf("delete slice %s owned by the previous Node: %w", slice.Name, err))
		}
	}
	return deleted, errors.Join(errs...)
}

// ownedByOtherNode reports whether slice names a Node of nodeName as its
// owner with another UID than uid.
func ownedByOtherNode(slice *resourceapi.ResourceSlice, nodeName string, uid types.UID) bool {
	for _, ref := range slice.OwnerReferences {
		if ref.APIVersion == "v1" && ref.Kind == "Node" && ref.Name == nodeName && ref.UID != uid {
			return true
		}
	}
	return false
}
