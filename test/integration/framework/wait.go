package framework

import (
	"context"
	"fmt"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// PodClaims returns the ResourceClaims of a pod, in pod.spec.resourceClaims
// order, resolving generated names through pod.status.resourceClaimStatuses.
func PodClaims(ctx context.Context, client kubernetes.Interface, pod *v1.Pod) ([]*resourceapi.ResourceClaim, error) {
	var claims []*resourceapi.ResourceClaim
	for _, pc := range pod.Spec.ResourceClaims {
		name := ""
		if pc.ResourceClaimName != nil {
			name = *pc.ResourceClaimName
		}
		for _, st := range pod.Status.ResourceClaimStatuses {
			if st.Name == pc.Name && st.ResourceClaimName != nil {
				name = *st.ResourceClaimName
			}
		}
		if name == "" {
			return nil, fmt.Errorf("pod %s/%s: claim %s not created yet", pod.Namespace, pod.Name, pc.Name)
		}
		claim, err := client.ResourceV1().ResourceClaims(pod.Namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("get claim %s: %w", name, err)
		}
		claims = append(claims, claim)
	}
	return claims, nil
}

// AllocatedDevices lists the device names of a claim's allocation.
func AllocatedDevices(claim *resourceapi.ResourceClaim) []string {
	if claim.Status.Allocation == nil {
		return nil
	}
	var out []string
	for _, r := range claim.Status.Allocation.Devices.Results {
		out = append(out, r.Device)
	}
	return out
}
