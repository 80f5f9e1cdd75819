package cluster

import (
	"context"
	"fmt"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
)

// CreateReadyNode creates a schedulable node with a Ready condition and room
// for plenty of pods. Nodes have no kubelet here; the scheduler only reads
// their status.
func CreateReadyNode(ctx context.Context, client kubernetes.Interface, name string, labels map[string]string) (*v1.Node, error) {
	return CreateReadyNodeWithCPU(ctx, client, name, labels, "256")
}

// CreateReadyNodeWithCPU is CreateReadyNode with a given CPU capacity. Small
// nodes make the stock scheduler's CPU spreading (NodeResourcesFit,
// LeastAllocated, default requests) deterministic.
func CreateReadyNodeWithCPU(ctx context.Context, client kubernetes.Interface, name string, labels map[string]string, cpu string) (*v1.Node, error) {
	if labels == nil {
		labels = map[string]string{}
	}
	labels["kubernetes.io/hostname"] = name
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
	node, err := client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create node %s: %w", name, err)
	}
	node.Status = v1.NodeStatus{
		Capacity: v1.ResourceList{
			v1.ResourceCPU:    resource.MustParse(cpu),
			v1.ResourceMemory: resource.MustParse("2Ti"),
			v1.ResourcePods:   resource.MustParse("1000"),
		},
		Allocatable: v1.ResourceList{
			v1.ResourceCPU:    resource.MustParse(cpu),
			v1.ResourceMemory: resource.MustParse("2Ti"),
			v1.ResourcePods:   resource.MustParse("1000"),
		},
		Conditions: []v1.NodeCondition{{
			Type: v1.NodeReady, Status: v1.ConditionTrue, Reason: "KubeletReady",
			LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now(),
		}},
		Phase: v1.NodeRunning,
	}
	node, err = client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("set status of node %s: %w", name, err)
	}
	return node, nil
}

// DeviceClass returns a class selecting every device of one driver, plus
// extra CEL selectors.
func DeviceClass(name, driver string, extraSelectors ...string) *resourceapi.DeviceClass {
	class := &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: name}}
	exprs := append([]string{fmt.Sprintf("device.driver == %q", driver)}, extraSelectors...)
	for _, expr := range exprs {
		class.Spec.Selectors = append(class.Spec.Selectors, resourceapi.DeviceSelector{
			CEL: &resourceapi.CELDeviceSelector{Expression: expr},
		})
	}
	return class
}

// PodWithClaims returns a pod for schedulerName whose claims come from the
// named templates (pod claim names "claim-0", ...).
func PodWithClaims(namespace, name, schedulerName string, templates ...string) *v1.Pod {
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
		Spec: v1.PodSpec{
			SchedulerName: schedulerName,
			Containers: []v1.Container{{
				Name:  "main",
				Image: "registry.k8s.io/pause:3.10",
			}},
		},
	}
	for i, tmpl := range templates {
		claimName := fmt.Sprintf("claim-%d", i)
		pod.Spec.ResourceClaims = append(pod.Spec.ResourceClaims, v1.PodResourceClaim{
			Name: claimName, ResourceClaimTemplateName: ptr.To(tmpl),
		})
		pod.Spec.Containers[0].Resources.Claims = append(pod.Spec.Containers[0].Resources.Claims, v1.ResourceClaim{Name: claimName})
	}
	return pod
}
