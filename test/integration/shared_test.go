package integration

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apiresource "k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/kubernetes/test/utils/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/invariant"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// sharedNode creates a node in group whose pool has two slices: one with a
// counter set for one physical GPU (4 memory slices of 10Gi), one with the
// devices that draw on it (the whole GPU, four 1g and two 2g partitions)
// and a link that allows multiple allocations with a bandwidth of 10.
func (e *env) sharedNode(group string) string {
	name := fmt.Sprintf("%s-%s", e.ns, group)
	_, err := framework.CreateReadyNodeWithCPU(e.tCtx, cp.Client, name, map[string]string{"test": e.ns, "group": group}, "256")
	e.tCtx.ExpectNoError(err)
	pool := resourceapi.ResourcePool{Name: name, Generation: 1, ResourceSliceCount: 2}
	counters := &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name + "-counters"},
		Spec: resourceapi.ResourceSliceSpec{
			Driver: topology.DriverName, NodeName: ptr.To(name), Pool: pool,
			SharedCounters: []resourceapi.CounterSet{{Name: "gpu-0", Counters: map[string]resourceapi.Counter{
				"memory": {Value: apiresource.MustParse("40Gi")},
			}}},
		},
	}
	device := func(name, profile string, memorySlices int64) resourceapi.Device {
		return resourceapi.Device{
			Name:       name,
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"profile": framework.StringAttr(profile)},
			ConsumesCounters: []resourceapi.DeviceCounterConsumption{{CounterSet: "gpu-0", Counters: map[string]resourceapi.Counter{
				"memory": {Value: apiresource.MustParse(fmt.Sprintf("%dGi", 10*memorySlices))},
			}}},
		}
	}
	devices := &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name + "-devices"},
		Spec: resourceapi.ResourceSliceSpec{
			Driver: topology.DriverName, NodeName: ptr.To(name), Pool: pool,
			Devices: []resourceapi.Device{
				device("gpu-0", "whole", 4),
				device("gpu-0-1g-0", "1g", 1), device("gpu-0-1g-1", "1g", 1), device("gpu-0-1g-2", "1g", 1), device("gpu-0-1g-3", "1g", 1),
				device("gpu-0-2g-0", "2g", 2), device("gpu-0-2g-1", "2g", 2),
				{
					Name:                     "link",
					Attributes:               map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"profile": framework.StringAttr("link")},
					AllowMultipleAllocations: ptr.To(true),
					Capacity:                 map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"bandwidth": {Value: apiresource.MustParse("10")}},
				},
			},
		},
	}
	for _, s := range []*resourceapi.ResourceSlice{counters, devices} {
		_, err := cp.Client.ResourceV1().ResourceSlices().Create(e.tCtx, s, metav1.CreateOptions{})
		e.tCtx.ExpectNoError(err, "create slice "+s.Name)
	}
	return name
}

// profileTemplate creates a template with one request for a device of the
// profile, with a bandwidth request where bandwidth is not empty.
func (e *env) profileTemplate(profile, bandwidth string) string {
	name := "profile-" + profile
	tmpl := framework.ClaimTemplate(e.ns, name, e.class, 1)
	tmpl.Spec.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
		Expression: fmt.Sprintf("device.attributes[%q].profile == %q", topology.DriverName, profile),
	}}}
	if bandwidth != "" {
		tmpl.Spec.Spec.Devices.Requests[0].Exactly.Capacity = &resourceapi.CapacityRequirements{
			Requests: map[resourceapi.QualifiedName]apiresource.Quantity{"bandwidth": apiresource.MustParse(bandwidth)},
		}
	}
	return e.createTemplate(tmpl)
}

// TestSharedDevicesNeverOverbooked: pods that ask for partitions of one
// GPU (devices that draw on one shared counter set) and for shares of a
// link's bandwidth (consumable capacity) arrive together, more than fit.
// topodra, like the stock scheduler on a twin node, binds pods until no
// waiting one fits in what the counters and the capacity have left
// (which ones depends on the order the queue tries them: the whole GPU,
// or partitions that use up the same counters), and the invariant
// checker finds nothing consumed beyond what the pool publishes. Then allocations
// written past the schedulers (a free partition or the free whole GPU,
// one more share of the link) must be found by the checker through the
// API; once they are deleted, no pod may bind into what they seemed to
// free.
func TestSharedDevicesNeverOverbooked(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newFaultEnv(tCtx, "shared")
	whole, oneG, twoG := e.profileTemplate("whole", ""), e.profileTemplate("1g", ""), e.profileTemplate("2g", "")
	link := e.profileTemplate("link", "3")
	startTopodra(tCtx)
	startStock(tCtx)

	// The memory slices (of 4) each pod's device takes, and the bandwidth
	// (of 10) each link pod takes.
	type ask struct {
		template     string
		slices, band int
	}
	asks := []ask{{whole, 4, 0}, {oneG, 1, 0}, {oneG, 1, 0}, {twoG, 2, 0}, {oneG, 1, 0}, {whole, 4, 0}, {twoG, 2, 0}, {oneG, 1, 0}, {oneG, 1, 0}}
	for range 5 {
		asks = append(asks, ask{link, 0, 3})
	}
	groups := []struct{ name, scheduler string }{{"topodra", topodraName}, {"stock", stockName}}
	for _, g := range groups {
		e.sharedNode(g.name)
		for i, a := range asks {
			e.pod(fmt.Sprintf("%s-%d", g.name, i), g.scheduler, g.name, a.template)
		}
	}

	// settle waits until every pod of the group is bound or unschedulable
	// and stays so for two seconds (a pod marked unschedulable by one
	// attempt may be in the next), checks that no waiting pod fits in
	// what is left, and returns the bound pods.
	settle := func(group string) []int {
		var bound, waiting []int
		var slicesUsed, bandUsed, stable int
		var last string
		err := wait.PollUntilContextTimeout(tCtx, 250*time.Millisecond, waitTimeout, true, func(ctx context.Context) (bool, error) {
			bound, waiting, slicesUsed, bandUsed = nil, nil, 0, 0
			for i, a := range asks {
				p, err := cp.Client.CoreV1().Pods(e.ns).Get(ctx, fmt.Sprintf("%s-%d", group, i), metav1.GetOptions{})
				if err != nil {
					return false, err
				}
				switch c := framework.PodScheduledCondition(p); {
				case p.Spec.NodeName != "":
					bound = append(bound, i)
					slicesUsed += a.slices
					bandUsed += a.band
				case c != nil && c.Status == v1.ConditionFalse && c.Reason == v1.PodReasonUnschedulable:
					waiting = append(waiting, i)
				default:
					stable = 0
					return false, nil
				}
			}
			if now := fmt.Sprint(bound); now != last {
				last, stable = now, 0
				return false, nil
			}
			stable++
			return stable >= 8, nil
		})
		tCtx.ExpectNoError(err, group+": pods bound or unschedulable")
		tCtx.Logf("%s: pods %v bound, memory slices used %d of 4, bandwidth %d of 10", group, bound, slicesUsed, bandUsed)
		if slicesUsed > 4 || bandUsed > 10 {
			t.Errorf("%s: bound pods use %d memory slices (4 exist) and bandwidth %d (10 exist)", group, slicesUsed, bandUsed)
		}
		for _, i := range waiting {
			if a := asks[i]; (a.slices > 0 && slicesUsed+a.slices <= 4) || (a.band > 0 && bandUsed+a.band <= 10) {
				t.Errorf("%s: pod %d (%s) waits, but %d memory slices and bandwidth %d are free", group, i, a.template, 4-slicesUsed, 10-bandUsed)
			}
		}
		return bound
	}
	bound := map[string][]int{}
	for _, g := range groups {
		bound[g.name] = settle(g.name)
	}
	if len(bound["topodra"]) == 0 || len(bound["stock"]) == 0 {
		t.Errorf("pods bound: topodra %v, stock %v; want some in both", bound["topodra"], bound["stock"])
	}
	e.expectClean()

	// Allocations written past the schedulers: on each node a GPU device
	// that no claim holds (the counter set is used up, so it cannot fit)
	// and one more share of the link.
	held := map[string]bool{}
	claims, err := cp.Client.ResourceV1().ResourceClaims(e.ns).List(tCtx, metav1.ListOptions{})
	tCtx.ExpectNoError(err)
	for _, c := range claims.Items {
		if c.Status.Allocation != nil {
			for _, r := range c.Status.Allocation.Devices.Results {
				held[r.Pool+"/"+r.Device] = true
			}
		}
	}
	var extras []string
	overbook := func(name, node, template, device string, share bool) {
		tmpl, err := cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Get(tCtx, template, metav1.GetOptions{})
		tCtx.ExpectNoError(err)
		c, err := cp.Client.ResourceV1().ResourceClaims(e.ns).Create(tCtx, &resourceapi.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: tmpl.Spec.Spec,
		}, metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
		extras = append(extras, name)
		result := resourceapi.DeviceRequestAllocationResult{Request: "req-0", Driver: topology.DriverName, Pool: node, Device: device}
		if share {
			result.ShareID = ptr.To(types.UID(c.UID))
			result.ConsumedCapacity = map[resourceapi.QualifiedName]apiresource.Quantity{"bandwidth": apiresource.MustParse("3")}
		}
		c.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{result}}}
		_, err = cp.Client.ResourceV1().ResourceClaims(e.ns).UpdateStatus(tCtx, c, metav1.UpdateOptions{})
		tCtx.ExpectNoError(err, "write allocation of "+name)
	}
	for _, g := range groups {
		node := e.ns + "-" + g.name
		free := ""
		for _, d := range []struct{ device, template string }{
			{"gpu-0", whole}, {"gpu-0-1g-0", oneG}, {"gpu-0-1g-1", oneG}, {"gpu-0-1g-2", oneG}, {"gpu-0-1g-3", oneG}, {"gpu-0-2g-0", twoG}, {"gpu-0-2g-1", twoG},
		} {
			if !held[node+"/"+d.device] && free == "" {
				free = d.device
				overbook("extra-gpu-"+g.name, node, d.template, d.device, false)
			}
		}
		overbook("extra-link-"+g.name, node, link, "link", true)
	}
	violations, err := invariant.Check(tCtx, cp.Client)
	tCtx.ExpectNoError(err)
	found := map[string][]string{}
	for _, v := range violations {
		for _, c := range v.Claims {
			if name := strings.TrimPrefix(c, e.ns+"/"); slices.Contains(extras, name) {
				tCtx.Logf("found: %s", v)
				found[name] = append(found[name], string(v.Kind))
			}
		}
	}
	for _, g := range groups {
		for name, want := range map[string]invariant.Kind{"extra-gpu-" + g.name: invariant.CounterExceeded, "extra-link-" + g.name: invariant.CapacityExceeded} {
			if !slices.Equal(found[name], []string{string(want)}) {
				t.Errorf("violations naming claim %s: %v, want [%s]", name, found[name], want)
			}
		}
	}

	// Deleting them gives nothing back that the pods' claims hold.
	for _, name := range extras {
		tCtx.ExpectNoError(cp.Client.ResourceV1().ResourceClaims(e.ns).Delete(tCtx, name, metav1.DeleteOptions{}))
	}
	for _, g := range groups {
		if after := settle(g.name); !slices.Equal(after, bound[g.name]) {
			t.Errorf("%s: pods bound %v after the extra claims were deleted, before %v", g.name, after, bound[g.name])
		}
	}
	e.expectClean()
}
