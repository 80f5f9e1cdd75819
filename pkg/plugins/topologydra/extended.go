package topologydra

import (
	"fmt"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	resourcehelper "k8s.io/component-helpers/resource"
	fwk "k8s.io/kube-scheduler/framework"
	v1helper "k8s.io/kubernetes/pkg/apis/core/v1/helper"
	"k8s.io/utils/ptr"
)

// Extended resources backed by DRA (a DeviceClass with extendedResourceName,
// or the implicit deviceclass.resource.kubernetes.io/<class>) are allocated
// by the stock DynamicResources plugin, which TopologyDRA replaces in its
// profile. NodeResourcesFit leaves such a resource to DRA on nodes whose
// allocatable lacks it; without a check the pod would be bound with no
// device behind the resource. TopologyDRA therefore rejects those nodes and
// says what to do instead. Nodes that offer the resource through a device
// plugin are left to NodeResourcesFit.

// draExtended is one extended resource of the pod that a DeviceClass backs.
type draExtended struct {
	name  v1.ResourceName
	class string
}

// draExtendedResources lists the extended resources the pod requests that
// DeviceClasses back, by resource name.
func (pl *TopologyDRA) draExtendedResources(pod *v1.Pod) ([]draExtended, error) {
	var requested []v1.ResourceName
	for name, q := range resourcehelper.PodRequests(pod, resourcehelper.PodResourcesOptions{}) {
		// The implicit names are in a kubernetes.io domain, so not
		// "extended" by the core helper's definition.
		draName := v1helper.IsExtendedResourceName(name) || strings.HasPrefix(string(name), resourceapi.ResourceDeviceClassPrefix)
		if draName && !q.IsZero() {
			requested = append(requested, name)
		}
	}
	if len(requested) == 0 {
		return nil, nil
	}
	slices.Sort(requested)
	classOf := func(name v1.ResourceName) (string, error) {
		if resolver := pl.draManager.DeviceClassResolver(); resolver != nil {
			if class := resolver.GetDeviceClass(name); class != nil {
				return class.Name, nil
			}
			return "", nil
		}
		classes, err := pl.draManager.DeviceClasses().List()
		if err != nil {
			return "", err
		}
		for _, class := range classes {
			if backs(class, name) {
				return class.Name, nil
			}
		}
		return "", nil
	}
	var result []draExtended
	for _, name := range requested {
		class, err := classOf(name)
		if err != nil {
			return nil, fmt.Errorf("list device classes: %w", err)
		}
		if class != "" {
			result = append(result, draExtended{name: name, class: class})
		}
	}
	return result, nil
}

// backs reports whether class provides the extended resource name: its
// extendedResourceName, or the implicit deviceclass.resource.kubernetes.io/
// <class name> that every class has.
func backs(class *resourceapi.DeviceClass, name v1.ResourceName) bool {
	if explicit := ptr.Deref(class.Spec.ExtendedResourceName, ""); explicit != "" && v1.ResourceName(explicit) == name {
		return true
	}
	return v1.ResourceName(resourceapi.ResourceDeviceClassPrefix+class.Name) == name
}

// checkExtended rejects a node on which the pod's DRA-backed extended
// resources would need a DRA allocation.
func checkExtended(extended []draExtended, nodeInfo fwk.NodeInfo) *fwk.Status {
	for _, e := range extended {
		if nodeInfo.GetAllocatable().GetScalarResources()[e.name] > 0 {
			continue // a device plugin offers it here
		}
		return unresolvable(fmt.Sprintf("extended resource %s is provided through DRA (device class %s), which topodra-scheduler does not allocate for extended resources: request the devices with a ResourceClaim, or schedule the pod with the default scheduler", e.name, e.class))
	}
	return nil
}
