package cluster

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
)

// PollInterval is how often waits re-check their condition.
const PollInterval = 100 * time.Millisecond

// WaitForPod polls a pod until cond returns true or an error, or the timeout
// passes; the error then says what the pod looked like last.
func WaitForPod(ctx context.Context, client kubernetes.Interface, namespace, name string, timeout time.Duration, what string, cond func(*v1.Pod) (bool, error)) (*v1.Pod, error) {
	var last *v1.Pod
	err := wait.PollUntilContextTimeout(ctx, PollInterval, timeout, true, func(ctx context.Context) (bool, error) {
		pod, err := client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil // transient; keep polling until the timeout
		}
		last = pod
		return cond(pod)
	})
	if err != nil {
		return last, fmt.Errorf("pod %s/%s: waiting for %s: %w; last status: %s", namespace, name, what, err, describePod(last))
	}
	return last, nil
}

// WaitForPodScheduled waits until the pod is bound to a node.
func WaitForPodScheduled(ctx context.Context, client kubernetes.Interface, namespace, name string, timeout time.Duration) (*v1.Pod, error) {
	return WaitForPod(ctx, client, namespace, name, timeout, "scheduled", func(p *v1.Pod) (bool, error) {
		return p.Spec.NodeName != "", nil
	})
}

// WaitForPodUnschedulable waits until the scheduler has marked the pod
// unschedulable, and returns it (its PodScheduled condition carries the
// scheduler's message).
func WaitForPodUnschedulable(ctx context.Context, client kubernetes.Interface, namespace, name string, timeout time.Duration) (*v1.Pod, error) {
	return WaitForPod(ctx, client, namespace, name, timeout, "unschedulable", func(p *v1.Pod) (bool, error) {
		if p.Spec.NodeName != "" {
			return false, fmt.Errorf("pod was scheduled to %s", p.Spec.NodeName)
		}
		c := PodScheduledCondition(p)
		return c != nil && c.Status == v1.ConditionFalse && c.Reason == v1.PodReasonUnschedulable, nil
	})
}

// PodScheduledCondition returns the pod's PodScheduled condition, or nil.
func PodScheduledCondition(p *v1.Pod) *v1.PodCondition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == v1.PodScheduled {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

func describePod(p *v1.Pod) string {
	if p == nil {
		return "<not found>"
	}
	s := fmt.Sprintf("node=%q", p.Spec.NodeName)
	if c := PodScheduledCondition(p); c != nil {
		s += fmt.Sprintf(" PodScheduled=%s reason=%s message=%q", c.Status, c.Reason, c.Message)
	}
	return s
}
