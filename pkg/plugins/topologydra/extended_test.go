package topologydra

import (
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

func TestBacks(t *testing.T) {
	implicit := &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: "gpu.example.com"}}
	explicit := implicit.DeepCopy()
	explicit.Spec.ExtendedResourceName = ptr.To("example.com/gpu")
	for _, tc := range []struct {
		class *resourceapi.DeviceClass
		name  v1.ResourceName
		want  bool
	}{
		{implicit, "deviceclass.resource.kubernetes.io/gpu.example.com", true},
		{implicit, "example.com/gpu", false},
		{explicit, "example.com/gpu", true},
		// The implicit name stays next to an explicit one.
		{explicit, "deviceclass.resource.kubernetes.io/gpu.example.com", true},
		{explicit, "deviceclass.resource.kubernetes.io/other", false},
	} {
		if got := backs(tc.class, tc.name); got != tc.want {
			t.Errorf("class %s (extendedResourceName %v) backs %s: got %v, want %v", tc.class.Name, ptr.Deref(tc.class.Spec.ExtendedResourceName, ""), tc.name, got, tc.want)
		}
	}
}
