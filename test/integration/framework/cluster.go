package framework

import (
	"context"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/topodra/topodra/pkg/cluster"
)

// The builders and waits below are pkg/cluster's, under the names the
// tests use.

// PollInterval is how often waits re-check their condition.
const PollInterval = cluster.PollInterval

// CreateReadyNode creates a schedulable node (see cluster.CreateReadyNode).
func CreateReadyNode(ctx context.Context, client kubernetes.Interface, name string, labels map[string]string) (*v1.Node, error) {
	return cluster.CreateReadyNode(ctx, client, name, labels)
}

// CreateReadyNodeWithCPU is CreateReadyNode with a given CPU capacity.
func CreateReadyNodeWithCPU(ctx context.Context, client kubernetes.Interface, name string, labels map[string]string, cpu string) (*v1.Node, error) {
	return cluster.CreateReadyNodeWithCPU(ctx, client, name, labels, cpu)
}

// DeviceClass returns a class selecting every device of one driver, plus
// extra CEL selectors.
func DeviceClass(name, driver string, extraSelectors ...string) *resourceapi.DeviceClass {
	return cluster.DeviceClass(name, driver, extraSelectors...)
}

// PodWithClaims returns a pod for schedulerName whose claims come from the
// named templates (see cluster.PodWithClaims).
func PodWithClaims(namespace, name, schedulerName string, templates ...string) *v1.Pod {
	return cluster.PodWithClaims(namespace, name, schedulerName, templates...)
}

// WaitForPod polls a pod until cond holds (see cluster.WaitForPod).
func WaitForPod(ctx context.Context, client kubernetes.Interface, namespace, name string, timeout time.Duration, what string, cond func(*v1.Pod) (bool, error)) (*v1.Pod, error) {
	return cluster.WaitForPod(ctx, client, namespace, name, timeout, what, cond)
}

// WaitForPodScheduled waits until the pod is bound to a node.
func WaitForPodScheduled(ctx context.Context, client kubernetes.Interface, namespace, name string, timeout time.Duration) (*v1.Pod, error) {
	return cluster.WaitForPodScheduled(ctx, client, namespace, name, timeout)
}

// WaitForPodUnschedulable waits until the scheduler has marked the pod
// unschedulable.
func WaitForPodUnschedulable(ctx context.Context, client kubernetes.Interface, namespace, name string, timeout time.Duration) (*v1.Pod, error) {
	return cluster.WaitForPodUnschedulable(ctx, client, namespace, name, timeout)
}

// PodScheduledCondition returns the pod's PodScheduled condition, or nil.
func PodScheduledCondition(p *v1.Pod) *v1.PodCondition {
	return cluster.PodScheduledCondition(p)
}
