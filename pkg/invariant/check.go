package invariant

import (
	"context"
	"fmt"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Check lists slices, claims and pods of all namespaces and returns the
// violations among them. The lists are not one snapshot: a pod may be bound
// or deleted between them. So every pod violation is confirmed by reading
// the pod and its claims again, and only those that still hold are
// returned. Device violations come from the claim list alone, which is one
// consistent read. An error means the cluster could not be read; the
// violations are then nil.
func Check(ctx context.Context, client kubernetes.Interface) ([]Violation, error) {
	state, err := List(ctx, client)
	if err != nil {
		return nil, err
	}
	var out []Violation
	for _, v := range Find(state) {
		if v.Pod == "" {
			out = append(out, v)
			continue
		}
		holds, err := confirm(ctx, client, v)
		if err != nil {
			return nil, err
		}
		if holds {
			out = append(out, v)
		}
	}
	return out, nil
}

// List reads the objects the invariants are judged on.
func List(ctx context.Context, client kubernetes.Interface) (State, error) {
	var s State
	pods, err := client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
	if err != nil {
		return s, fmt.Errorf("list pods: %w", err)
	}
	claims, err := client.ResourceV1().ResourceClaims(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
	if err != nil {
		return s, fmt.Errorf("list resource claims: %w", err)
	}
	resourceSlices, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		return s, fmt.Errorf("list resource slices: %w", err)
	}
	for i := range pods.Items {
		s.Pods = append(s.Pods, &pods.Items[i])
	}
	for i := range claims.Items {
		s.Claims = append(s.Claims, &claims.Items[i])
	}
	for i := range resourceSlices.Items {
		s.Slices = append(s.Slices, &resourceSlices.Items[i])
	}
	return s, nil
}

// confirm reads the pod of a pod violation and its claims again and reports
// whether the pod still violates an invariant.
func confirm(ctx context.Context, client kubernetes.Interface, v Violation) (bool, error) {
	namespace, name, _ := strings.Cut(v.Pod, "/")
	pod, err := client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("get pod %s: %w", v.Pod, err)
	}
	var claims []*resourceapi.ResourceClaim
	for _, ref := range PodClaimNames(pod) {
		if ref.Name == "" {
			continue
		}
		c, err := client.ResourceV1().ResourceClaims(namespace).Get(ctx, ref.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			continue
		}
		if err != nil {
			return false, fmt.Errorf("get claim %s/%s: %w", namespace, ref.Name, err)
		}
		claims = append(claims, c)
	}
	return len(podViolations([]*v1.Pod{pod}, claims)) > 0, nil
}
