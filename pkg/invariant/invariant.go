// Package invariant checks the allocation invariants that every DRA
// scheduler in a cluster must keep together: no device is allocated to two
// claims (unless it allows multiple allocations), no allocation names a
// device that no longer exists, and no pod is bound while a claim it uses
// is unallocated or not reserved for it.
//
// [Find] judges a set of objects; [Check] lists them from a cluster. Both
// are safe for concurrent use.
package invariant

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Kind names one kind of violation.
type Kind string

const (
	// DoubleAllocation: a device that does not allow multiple
	// allocations is allocated to more than one claim (or twice to one).
	// Allocations with admin access do not count.
	DoubleAllocation Kind = "DoubleAllocation"
	// VanishedDevice: an allocation names a device that no ResourceSlice
	// of the pool's current generation publishes.
	VanishedDevice Kind = "VanishedDevice"
	// PodClaimUnallocated: a pod is bound to a node while one of its
	// claims is missing or unallocated.
	PodClaimUnallocated Kind = "PodClaimUnallocated"
	// PodClaimNotReserved: a pod is bound to a node while one of its
	// allocated claims is not reserved for it.
	PodClaimNotReserved Kind = "PodClaimNotReserved"
)

// Device identifies a device the way an allocation result does.
type Device struct {
	Driver, Pool, Name string
}

func (d Device) String() string { return d.Driver + "/" + d.Pool + "/" + d.Name }

// Violation is one broken invariant.
type Violation struct {
	Kind Kind `json:"kind"`
	// Device is set for DoubleAllocation and VanishedDevice.
	Device *Device `json:"device,omitempty"`
	// Claims are the claims involved, as namespace/name, sorted.
	Claims []string `json:"claims"`
	// Pod is set for the pod kinds, as namespace/name.
	Pod string `json:"pod,omitempty"`
	// Message says what is wrong in words.
	Message string `json:"message"`
}

func (v Violation) String() string { return string(v.Kind) + ": " + v.Message }

// State is what the invariants are judged on. Nil entries are not allowed.
type State struct {
	Slices []*resourceapi.ResourceSlice
	Claims []*resourceapi.ResourceClaim
	Pods   []*v1.Pod
}

// Find returns the violations in s, sorted by kind, then device, then pod.
// It reads s without modifying it.
func Find(s State) []Violation {
	published := PublishedDevices(s.Slices)
	var out []Violation
	out = append(out, deviceViolations(s.Claims, published)...)
	out = append(out, podViolations(s.Pods, s.Claims)...)
	slices.SortFunc(out, func(a, b Violation) int {
		return cmp.Or(cmp.Compare(a.Kind, b.Kind), cmp.Compare(deviceKey(a.Device), deviceKey(b.Device)), cmp.Compare(a.Pod, b.Pod), slices.Compare(a.Claims, b.Claims))
	})
	return out
}

func deviceKey(d *Device) string {
	if d == nil {
		return ""
	}
	return d.String()
}

// PublishedDevices maps every device of the newest generation of each pool
// to whether it allows multiple allocations.
func PublishedDevices(resourceSlices []*resourceapi.ResourceSlice) map[Device]bool {
	type poolID struct{ driver, pool string }
	newest := map[poolID]int64{}
	for _, s := range resourceSlices {
		id := poolID{s.Spec.Driver, s.Spec.Pool.Name}
		if g, ok := newest[id]; !ok || s.Spec.Pool.Generation > g {
			newest[id] = s.Spec.Pool.Generation
		}
	}
	out := map[Device]bool{}
	for _, s := range resourceSlices {
		if s.Spec.Pool.Generation != newest[poolID{s.Spec.Driver, s.Spec.Pool.Name}] {
			continue
		}
		for _, d := range s.Spec.Devices {
			out[Device{s.Spec.Driver, s.Spec.Pool.Name, d.Name}] = d.AllowMultipleAllocations != nil && *d.AllowMultipleAllocations
		}
	}
	return out
}

func deviceViolations(claims []*resourceapi.ResourceClaim, published map[Device]bool) []Violation {
	holders := map[Device][]string{}
	for _, c := range claims {
		if c.Status.Allocation == nil {
			continue
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			if r.AdminAccess != nil && *r.AdminAccess {
				continue
			}
			d := Device{r.Driver, r.Pool, r.Device}
			holders[d] = append(holders[d], c.Namespace+"/"+c.Name)
		}
	}
	var out []Violation
	for d, claimNames := range holders {
		slices.Sort(claimNames)
		multiple, exists := published[d]
		if !exists {
			out = append(out, Violation{
				Kind: VanishedDevice, Device: &d, Claims: slices.Compact(slices.Clone(claimNames)),
				Message: fmt.Sprintf("device %s is allocated to %s but no ResourceSlice publishes it", d, strings.Join(slices.Compact(slices.Clone(claimNames)), ", ")),
			})
		}
		if len(claimNames) > 1 && !multiple {
			out = append(out, Violation{
				Kind: DoubleAllocation, Device: &d, Claims: claimNames,
				Message: fmt.Sprintf("device %s is allocated %d times: %s", d, len(claimNames), strings.Join(claimNames, ", ")),
			})
		}
	}
	return out
}

func podViolations(pods []*v1.Pod, claims []*resourceapi.ResourceClaim) []Violation {
	type key struct{ namespace, name string }
	byName := make(map[key]*resourceapi.ResourceClaim, len(claims))
	for _, c := range claims {
		byName[key{c.Namespace, c.Name}] = c
	}
	var out []Violation
	for _, pod := range pods {
		if pod.Spec.NodeName == "" || pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed {
			continue
		}
		podName := pod.Namespace + "/" + pod.Name
		for _, ref := range PodClaimNames(pod) {
			if ref.Name == "" {
				out = append(out, Violation{
					Kind: PodClaimUnallocated, Pod: podName,
					Message: fmt.Sprintf("pod %s is bound to %s but its claim %q was never created", podName, pod.Spec.NodeName, ref.PodClaimName),
				})
				continue
			}
			claimName := pod.Namespace + "/" + ref.Name
			c := byName[key{pod.Namespace, ref.Name}]
			switch {
			case c == nil:
				out = append(out, Violation{
					Kind: PodClaimUnallocated, Pod: podName, Claims: []string{claimName},
					Message: fmt.Sprintf("pod %s is bound to %s but its claim %s does not exist", podName, pod.Spec.NodeName, claimName),
				})
			case c.Status.Allocation == nil:
				out = append(out, Violation{
					Kind: PodClaimUnallocated, Pod: podName, Claims: []string{claimName},
					Message: fmt.Sprintf("pod %s is bound to %s but its claim %s is not allocated", podName, pod.Spec.NodeName, claimName),
				})
			case !reservedFor(c, pod.UID):
				out = append(out, Violation{
					Kind: PodClaimNotReserved, Pod: podName, Claims: []string{claimName},
					Message: fmt.Sprintf("pod %s is bound to %s but its claim %s is not reserved for it", podName, pod.Spec.NodeName, claimName),
				})
			}
		}
	}
	return out
}

// ClaimRef is one claim a pod uses: PodClaimName is its name in
// pod.spec.resourceClaims ("" for the claim of DRA-backed extended
// resources), Name the ResourceClaim's name ("" while a claim from a
// template has not been created).
type ClaimRef struct {
	PodClaimName, Name string
}

// PodClaimNames lists the claims a pod uses.
func PodClaimNames(pod *v1.Pod) []ClaimRef {
	var out []ClaimRef
	for _, pc := range pod.Spec.ResourceClaims {
		ref := ClaimRef{PodClaimName: pc.Name}
		if pc.ResourceClaimName != nil {
			ref.Name = *pc.ResourceClaimName
		} else {
			for _, st := range pod.Status.ResourceClaimStatuses {
				if st.Name == pc.Name && st.ResourceClaimName != nil {
					ref.Name = *st.ResourceClaimName
				}
			}
		}
		out = append(out, ref)
	}
	if ext := pod.Status.ExtendedResourceClaimStatus; ext != nil && ext.ResourceClaimName != "" {
		out = append(out, ClaimRef{Name: ext.ResourceClaimName})
	}
	return out
}

func reservedFor(c *resourceapi.ResourceClaim, uid types.UID) bool {
	for _, r := range c.Status.ReservedFor {
		if r.UID == uid {
			return true
		}
	}
	return false
}
