package allocator

import (
	"context"
	"errors"
	"fmt"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
)

// explainFatal turns a fatal error of the upstream allocator into one that
// names what the user has to fix. Upstream reports a CEL runtime error with
// the claim and the index of the selector only; this finds the request, the
// expression (of the request or of its class) and a device it fails on. It
// runs only on the error path. Errors it cannot attribute are returned as
// they are.
func (a *Allocator) explainFatal(ctx context.Context, node *v1.Node, claims []*resourceapi.ResourceClaim, err error) error {
	if err == nil || ctx.Err() != nil || errors.Is(err, structured.ErrFailedAllocationOnNode) || !strings.Contains(err.Error(), "CEL") {
		return err
	}
	ns, gerr := a.gatherNode(node)
	if gerr != nil {
		return err
	}
	check := func(claim *resourceapi.ResourceClaim, request, className string, selectors []resourceapi.DeviceSelector) error {
		var exprs []string
		var origins []string
		if class, cerr := a.classLister.Get(className); cerr == nil {
			for _, sel := range class.Spec.Selectors {
				if sel.CEL != nil {
					exprs = append(exprs, sel.CEL.Expression)
					origins = append(origins, "device class "+className+" selector")
				}
			}
		}
		for _, sel := range selectors {
			if sel.CEL != nil {
				exprs = append(exprs, sel.CEL.Expression)
				origins = append(origins, "selector")
			}
		}
		for k, expr := range exprs {
			compiled := a.celCache.GetOrCompile(expr)
			if compiled.Error != nil {
				continue // reported at compile time elsewhere
			}
			for i := range ns.devices {
				d := &ns.devices[i]
				_, _, derr := compiled.DeviceMatches(ctx, cel.Device{
					Driver:                   d.driver,
					AllowMultipleAllocations: d.device.AllowMultipleAllocations,
					Attributes:               d.device.Attributes,
					Capacity:                 d.device.Capacity,
				})
				if derr != nil {
					return fmt.Errorf("%w: claim %s, request %s: %s `%s` fails on device %s: %w", ErrInvalidInput, klog.KObj(claim), request, origins[k], expr, d.name, derr)
				}
			}
		}
		return nil
	}
	for _, claim := range claims {
		for _, req := range claim.Spec.Devices.Requests {
			if req.Exactly != nil {
				if e := check(claim, req.Name, req.Exactly.DeviceClassName, req.Exactly.Selectors); e != nil {
					return e
				}
			}
			for _, sub := range req.FirstAvailable {
				if e := check(claim, resourceclaim.CreateSubRequestRef(req.Name, sub.Name), sub.DeviceClassName, sub.Selectors); e != nil {
					return e
				}
			}
		}
	}
	return err
}
