package topologydra

import (
	"fmt"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/topodra/topodra/pkg/eventnote"
)

// Every failure goes through one of these helpers.

// unschedulable: the pod does not fit (this node, or for now). It is
// retried when one of the registered cluster events may have changed that.
func unschedulable(msg string) *fwk.Status {
	return fwk.NewStatus(fwk.Unschedulable, msg)
}

// unresolvable: the pod cannot fit until the user changes something that
// another scheduling attempt cannot fix (an invalid CEL selector, a claim
// pinned to another node). Registered events still requeue it.
func unresolvable(msg string) *fwk.Status {
	return fwk.NewStatus(fwk.UnschedulableAndUnresolvable, msg)
}

// internalError: a fault of the scheduler or the API (conflict, lost cache
// entry); the pod goes to backoff and is retried. The framework logs the
// error with the pod ("Error scheduling pod; retrying"); this adds the
// plugin's context at V(2).
func internalError(logger klog.Logger, err error, kv ...any) *fwk.Status {
	logger.V(2).Info("TopologyDRA failed; the pod is retried after backoff", append([]any{"err", err}, kv...)...)
	return fwk.AsStatus(fmt.Errorf("%s: %w", Name, err))
}

// inputError: a claim says something no node can serve, found only while
// allocating on some node (a CEL selector that fails at run time on a
// device). Like the stock plugin, the whole scheduling cycle fails (Error),
// so the pod is not placed on another node where the selector happens not
// to fail; it goes to backoff and is retried until the claim is fixed.
func inputError(logger klog.Logger, err error, kv ...any) *fwk.Status {
	logger.V(2).Info("Claim cannot be allocated", append([]any{"err", err}, kv...)...)
	return fwk.AsStatus(err)
}

// event records an event on obj through the scheduler's recorder, its
// note cut to what the API server accepts (eventnote.Limit): a placement
// of many devices on a node with a long name, or a long CEL expression
// quoted with its error, would otherwise be refused and lost.
func (pl *TopologyDRA) event(obj runtime.Object, eventtype, reason, action, note string, args ...any) {
	pl.handle.EventRecorder().Eventf(obj, nil, eventtype, reason, action, "%s", eventnote.Format(note, args...))
}
