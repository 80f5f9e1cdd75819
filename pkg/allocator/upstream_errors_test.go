package allocator

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
)

// These tests cover inputs on which upstream's allocator reports an error
// only where its search gets to a request or a device: topodra must then
// allocate where upstream does and fail where upstream fails, whichever
// strategy serves the pod.

// withCounting runs f with counting allowed and with counting skipped.
func withCounting(t *testing.T, opts Options, f func(t *testing.T, opts Options)) {
	for _, counting := range []bool{true, false} {
		t.Run(fmt.Sprintf("counting %v", counting), func(t *testing.T) {
			if !counting {
				opts.SkipCounting = func(string) bool { return true }
			}
			f(t, opts)
		})
	}
}

// TestUncompilableSelectorFailsOnlyWhereUpstreamEvaluatesIt: upstream
// compiles a selector when its search first evaluates it, so one that does
// not compile in a later firstAvailable subrequest (or in the class that
// only a later subrequest uses) fails nothing while an earlier subrequest
// fits. Where upstream does get to it, the error names the claim, request
// and expression.
func TestUncompilableSelectorFailsOnlyWhereUpstreamEvaluatesIt(t *testing.T) {
	const broken = `device.attributes["x"].nosuchfunc()`
	cls := classes(
		class("gpu", `device.driver == "`+gpuDriver+`"`),
		class("nic", `device.driver == "`+nicDriver+`"`),
		class("broken", `device.driver == "`+gpuDriver+`"`, broken),
	)
	sub := func(name, className string, count int64, selectors ...string) resourceapi.DeviceSubRequest {
		s := resourceapi.DeviceSubRequest{Name: name, DeviceClassName: className, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count}
		for _, e := range selectors {
			s.Selectors = append(s.Selectors, resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: e}})
		}
		return s
	}
	prioritized := func(subs ...resourceapi.DeviceSubRequest) *resourceapi.ResourceClaim {
		c := claim("c").obj()
		c.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "r", FirstAvailable: subs}}
		return c
	}
	testcases := map[string]struct {
		claim   *resourceapi.ResourceClaim
		wantErr []string // what the error names; nil: no error
	}{
		"later subrequest's selector":              {claim: prioritized(sub("s0", "gpu", 1), sub("s1", "gpu", 1, broken))},
		"later subrequest's class":                 {claim: prioritized(sub("s0", "gpu", 2), sub("s1", "broken", 1))},
		"two devices, later subrequest's selector": {claim: prioritized(sub("s0", "gpu", 2), sub("s1", "gpu", 1, broken))},
		"first subrequest does not fit": {claim: prioritized(sub("s0", "gpu", 9), sub("s1", "gpu", 1, broken)),
			wantErr: []string{"default/c", "r/s1", "selector #0", broken}},
		"only request": {claim: claim("c").request("r", "gpu", 1, broken).obj(),
			wantErr: []string{"default/c", "request r:", "selector #0", broken}},
		"only request's class": {claim: claim("c").request("r", "broken", 1).obj(),
			wantErr: []string{"default/c", "request r:", "device class broken: selector #1", broken}},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			opts := Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "node-a", "gpu-1"), ClassLister: cls,
				Slices: gpuNIC("node-a"), CELCache: newCELCache(), Policy: DefaultPolicy()}
			withCounting(t, opts, func(t *testing.T, opts Options) {
				ctx := quietContext(t)
				claims := []*resourceapi.ResourceClaim{tc.claim}
				err := allocateLikeUpstream(ctx, t, opts, claims, tc.wantErr != nil)
				if err == nil {
					return
				}
				var inputErr *InputError
				if !errors.As(err, &inputErr) {
					t.Errorf("error %q is not an *InputError", err)
				}
				for _, want := range tc.wantErr {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("error %q does not name %q", err, want)
					}
				}
				// The Allocator still serves other pods.
				a, nerr := New(ctx, opts)
				if nerr != nil {
					t.Fatal(nerr)
				}
				if _, err := a.Allocate(ctx, node("node-a"), claims); err == nil {
					t.Fatal("no error the second time")
				}
				res, err := a.Allocate(ctx, node("node-a"), []*resourceapi.ResourceClaim{claim("other").request("r", "gpu", 1).obj()})
				if err != nil || res.Allocations == nil {
					t.Errorf("another pod after the error: %v, %+v", err, res)
				}
			})
		})
	}
}
