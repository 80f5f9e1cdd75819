package framework

import (
	"context"
	"fmt"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
)

// CreateNamespace creates a namespace with a generated name starting with
// prefix and returns its name.
func CreateNamespace(ctx context.Context, client kubernetes.Interface, prefix string) (string, error) {
	ns, err := client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{
		ObjectMeta: metav1.ObjectMeta{GenerateName: prefix + "-"},
	}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("create namespace: %w", err)
	}
	return ns.Name, nil
}

// Device is a compact description of a device for SliceForNode.
type Device struct {
	Name       string
	Attributes map[resourceapi.QualifiedName]resourceapi.DeviceAttribute
	Capacity   map[resourceapi.QualifiedName]resourceapi.DeviceCapacity
}

// SliceForNode returns a one-slice pool named after the node.
func SliceForNode(node, driver string, devices []Device) *resourceapi.ResourceSlice {
	slice := &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: node + "-" + sanitize(driver)},
		Spec: resourceapi.ResourceSliceSpec{
			Driver:   driver,
			NodeName: ptr.To(node),
			Pool:     resourceapi.ResourcePool{Name: node, Generation: 1, ResourceSliceCount: 1},
		},
	}
	for _, d := range devices {
		slice.Spec.Devices = append(slice.Spec.Devices, resourceapi.Device{
			Name: d.Name, Attributes: d.Attributes, Capacity: d.Capacity,
		})
	}
	return slice
}

func sanitize(s string) string {
	out := []byte(s)
	for i, c := range out {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			out[i] = '-'
		}
	}
	return string(out)
}

// ClaimTemplate returns a template with one ExactCount request per entry of
// counts (request names "req-0", "req-1", ...), all from class.
func ClaimTemplate(namespace, name, class string, counts ...int64) *resourceapi.ResourceClaimTemplate {
	tmpl := &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
	}
	for i, n := range counts {
		tmpl.Spec.Spec.Devices.Requests = append(tmpl.Spec.Spec.Devices.Requests, resourceapi.DeviceRequest{
			Name: fmt.Sprintf("req-%d", i),
			Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: class,
				AllocationMode:  resourceapi.DeviceAllocationModeExactCount,
				Count:           n,
			},
		})
	}
	return tmpl
}

// IntAttr, StringAttr and IntListAttr build device attributes.
func IntAttr(v int64) resourceapi.DeviceAttribute {
	return resourceapi.DeviceAttribute{IntValue: ptr.To(v)}
}

// StringAttr builds a string device attribute.
func StringAttr(v string) resourceapi.DeviceAttribute {
	return resourceapi.DeviceAttribute{StringValue: ptr.To(v)}
}
