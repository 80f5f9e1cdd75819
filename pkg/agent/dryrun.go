package agent

import (
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"
)

// SliceObjects renders node-local resources as the ResourceSlice objects
// the resourceslice controller would create for them, minus what only the
// API server and a live cluster know: the generated name suffix, the owner
// reference to the Node (it needs the Node's UID) and the resource version.
// For dry runs and documentation; publishing goes through the controller.
func SliceObjects(driverName, nodeName string, resources resourceslice.DriverResources) []*resourceapi.ResourceSlice {
	var out []*resourceapi.ResourceSlice
	for poolName, pool := range resources.Pools {
		for i, s := range pool.Slices {
			out = append(out, &resourceapi.ResourceSlice{
				TypeMeta: metav1.TypeMeta{APIVersion: resourceapi.SchemeGroupVersion.String(), Kind: "ResourceSlice"},
				ObjectMeta: metav1.ObjectMeta{
					GenerateName: fmt.Sprintf("%x-%s-%s-", i, driverName, nodeName),
				},
				Spec: resourceapi.ResourceSliceSpec{
					Driver:   driverName,
					NodeName: ptr.To(nodeName),
					Pool: resourceapi.ResourcePool{
						Name:               poolName,
						Generation:         max(pool.Generation, 1),
						ResourceSliceCount: int64(len(pool.Slices)),
					},
					Devices:        s.Devices,
					SharedCounters: s.SharedCounters,
				},
			})
		}
	}
	return out
}
