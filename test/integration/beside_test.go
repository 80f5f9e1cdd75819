package integration

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/kubernetes/test/utils/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/config"
	"github.com/topodra/topodra/manifests"
	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/invariant"
	"github.com/topodra/topodra/pkg/plugins/topologydra"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// TestBesideDefaultScheduler runs topodra-scheduler and the stock
// default-scheduler as two separate scheduler instances (each with its own
// informers and in-flight tracker) against one API server, with GPU and NIC
// pods of mixed sizes split between them and churn, and judges the cluster
// with the invariant checker after every wave.
//
// Owned (what the shipped manifests install): zero violations, topodra
// places its pods, the default scheduler hands out none of topodra's
// devices. Not owned (agent taint off, no DeviceTaintRules): the checker
// must find double allocations, which shows that it works and what the
// ownership prevents.
func TestBesideDefaultScheduler(t *testing.T) {
	ownedTaint := shippedAgentOwnedTaint(t)
	if !ownedTaint {
		t.Fatal("the shipped node agent does not taint its devices")
	}

	t.Run("owned", func(t *testing.T) {
		r := runBesideDefault(t, true)
		t.Logf("owned: %d topodra pods and %d default-scheduler pods were bound over the run; %d violations", r.boundTopodra, r.boundStock, len(r.violations))
		for _, v := range r.violations {
			t.Errorf("violation: %s", v)
		}
		if r.boundTopodra < 40 {
			t.Errorf("topodra bound only %d pods over the run, want at least 40", r.boundTopodra)
		}
		if r.boundStock != 0 {
			t.Errorf("the default scheduler bound %d pods to topodra's devices", r.boundStock)
		}
		if r.checkExit != invariant.ExitClean {
			t.Errorf("topodra-check exited %d, want %d", r.checkExit, invariant.ExitClean)
		}
		// Every default-scheduler pod, pending for the owned taint, is
		// told which scheduler its claims need.
		if r.pendingStock == 0 || r.noticedStock != r.pendingStock {
			t.Errorf("%d of %d pending default-scheduler pods got a %s event, want all (and some pending)", r.noticedStock, r.pendingStock, topologydra.OwnedNoticeReason)
		}
	})
	t.Run("not owned", func(t *testing.T) {
		r := runBesideDefault(t, false)
		doubles := 0
		for _, v := range r.violations {
			if v.Kind == invariant.DoubleAllocation {
				doubles++
			}
		}
		t.Logf("not owned: %d topodra pods and %d default-scheduler pods were bound over the run; the checker found %d violations, %d of them double allocations", r.boundTopodra, r.boundStock, len(r.violations), doubles)
		if doubles == 0 {
			t.Error("without ownership the checker found no double allocation: either the schedulers no longer race or the checker misses them")
		}
		if r.checkExit != invariant.ExitViolations {
			t.Errorf("topodra-check exited %d at the end, want %d", r.checkExit, invariant.ExitViolations)
		}
		if r.noticedStock != 0 {
			t.Errorf("%d default-scheduler pods got a %s event although their devices carry no owned taint", r.noticedStock, topologydra.OwnedNoticeReason)
		}
	})
}

// shippedAgentOwnedTaint returns whether the shipped DaemonSet runs the
// agent with the owned taint: OWNED_TAINT if set, else the flag default.
func shippedAgentOwnedTaint(t *testing.T) bool {
	data, err := manifests.FS.ReadFile("base/node-agent.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, doc := range strings.Split(string(data), "\n---\n") {
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
		if err != nil {
			continue
		}
		ds, ok := obj.(*appsv1.DaemonSet)
		if !ok {
			continue
		}
		for _, e := range ds.Spec.Template.Spec.Containers[0].Env {
			if e.Name == "OWNED_TAINT" {
				return e.Value == "true"
			}
		}
		return agent.DefaultOwnedTaint
	}
	t.Fatal("no DaemonSet in node-agent.yaml")
	return false
}

type besideResult struct {
	// violations found over all checks, each device or pod once.
	violations               []invariant.Violation
	boundTopodra, boundStock int
	checkExit                int
	// pendingStock counts the default-scheduler pods pending at the end,
	// noticedStock those of them with topodra's notice that their claims
	// need it.
	pendingStock, noticedStock int
}

func runBesideDefault(t *testing.T, owned bool) besideResult {
	tCtx := ktesting.Init(t)
	var c *framework.ControlPlane
	if owned {
		c = startOwnedCluster(t, tCtx)
		// docs/install.md's path for other drivers' devices: the example
		// DeviceTaintRule with the NIC driver's name.
		rule, err := manifests.FS.ReadFile("examples/owned-nic-taint-rule.yaml")
		tCtx.ExpectNoError(err)
		tCtx.ExpectNoError(c.Apply(tCtx, rule, func(obj *unstructured.Unstructured) bool {
			tCtx.ExpectNoError(unstructured.SetNestedField(obj.Object, mockgpu.NICDriverName, "spec", "deviceSelector", "driver"))
			return true
		}))
	} else {
		var err error
		c, err = framework.Start(t)
		tCtx.ExpectNoError(err)
		data, err := manifests.FS.ReadFile("base/deviceclasses.yaml")
		tCtx.ExpectNoError(err)
		tCtx.ExpectNoError(c.Apply(tCtx, data, nil))
	}
	_, err := c.Client.ResourceV1().DeviceClasses().Create(tCtx, framework.DeviceClass(mockgpu.NICDriverName, mockgpu.NICDriverName), metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	_, err = c.StartClaimController(tCtx)
	tCtx.ExpectNoError(err)

	const nodes = 4
	for i := range nodes {
		name := fmt.Sprintf("dgx-%d", i)
		_, err := framework.CreateReadyNode(tCtx, c.Client, name, nil)
		tCtx.ExpectNoError(err)
		s, err := agent.StartSimulated(tCtx, agent.SimulatedOptions{
			NodeName: name, Profile: mockgpu.ProfileDGXH100, KubeClient: c.Client,
			OwnedTaint: owned, NICs: true,
		})
		tCtx.ExpectNoError(err)
		t.Cleanup(s.Stop)
	}
	err = wait.PollUntilContextTimeout(tCtx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		list, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		return err == nil && len(list.Items) == 2*nodes, nil
	})
	tCtx.ExpectNoError(err, "slices of the simulated nodes")

	ns, err := framework.CreateNamespace(tCtx, c.Client, "beside")
	tCtx.ExpectNoError(err)
	for _, count := range []int64{1, 2, 4} {
		_, err := c.Client.ResourceV1().ResourceClaimTemplates(ns).Create(tCtx, framework.ClaimTemplate(ns, fmt.Sprintf("gpus-%d", count), topology.DriverName, count), metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
	}
	gpuNIC := framework.ClaimTemplate(ns, "gpu-nic", topology.DriverName, 1, 1)
	gpuNIC.Spec.Spec.Devices.Requests[1].Exactly.DeviceClassName = mockgpu.NICDriverName
	_, err = c.Client.ResourceV1().ResourceClaimTemplates(ns).Create(tCtx, gpuNIC, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)

	// Two scheduler instances, as two Deployments would run them.
	stopTopodra, err := c.StartScheduler(tCtx, framework.SchedulerOptions{Name: "topodra", Config: config.SchedulerConfig})
	tCtx.ExpectNoError(err)
	t.Cleanup(stopTopodra)
	stopStock, err := c.StartScheduler(tCtx, framework.SchedulerOptions{Name: "stock", Stock: true})
	tCtx.ExpectNoError(err)
	t.Cleanup(stopStock)

	const waves, perWave = 10, 24
	templates := []string{"gpus-1", "gpus-2", "gpus-1", "gpus-4", "gpu-nic", "gpus-1", "gpus-2", "gpus-1"}
	rng := rand.New(rand.NewPCG(1, 2))
	seen := map[string]invariant.Violation{}
	everBound := map[string]string{} // pod name -> scheduler
	check := func() {
		violations, err := invariant.Check(tCtx, c.Client)
		tCtx.ExpectNoError(err, "invariant check")
		for _, v := range violations {
			seen[v.String()] = v
		}
	}
	for wave := range waves {
		var names []string
		for i := range perWave {
			scheduler := topodraName
			if i%2 == 1 {
				scheduler = stockName
			}
			name := fmt.Sprintf("w%d-%s-%d", wave, scheduler[:7], i)
			pod := framework.PodWithClaims(ns, name, scheduler, templates[(wave+i/2)%len(templates)])
			_, err := c.Client.CoreV1().Pods(ns).Create(tCtx, pod, metav1.CreateOptions{})
			tCtx.ExpectNoError(err, "create pod "+name)
			names = append(names, name)
		}
		// Wait until both schedulers have decided on every pod of the wave.
		var pods []v1.Pod
		err := wait.PollUntilContextTimeout(tCtx, 200*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
			list, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, err
			}
			pods = list.Items
			decided := 0
			for _, p := range pods {
				if strings.HasPrefix(p.Name, fmt.Sprintf("w%d-", wave)) && (p.Spec.NodeName != "" || framework.PodScheduledCondition(&p) != nil) {
					decided++
				}
			}
			return decided == len(names), nil
		})
		tCtx.ExpectNoError(err, fmt.Sprintf("wave %d: not every pod was tried", wave))
		var bound []string
		for _, p := range pods {
			if p.Spec.NodeName != "" {
				everBound[p.Name] = p.Spec.SchedulerName
				bound = append(bound, p.Name)
			}
		}
		check()
		// Churn: half of the running pods finish.
		rng.Shuffle(len(bound), func(i, j int) { bound[i], bound[j] = bound[j], bound[i] })
		for _, name := range bound[:len(bound)/2] {
			tCtx.ExpectNoError(c.Client.CoreV1().Pods(ns).Delete(tCtx, name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
		}
	}
	check()

	var r besideResult
	for _, scheduler := range everBound {
		if scheduler == topodraName {
			r.boundTopodra++
		} else {
			r.boundStock++
		}
	}
	for _, v := range seen {
		r.violations = append(r.violations, v)
	}
	r.pendingStock, r.noticedStock = stockNotices(tCtx, c, ns, owned)
	var stdout, stderr bytes.Buffer
	r.checkExit = invariant.Run(tCtx, []string{"--kubeconfig", c.Kubeconfig}, &stdout, &stderr)
	t.Logf("topodra-check: exit %d\n%s%s", r.checkExit, stdout.String(), stderr.String())
	return r
}

// stockNotices counts the default-scheduler pods of ns that are pending
// and those of them with topodra's notice (topologydra.OwnedNoticeReason)
// that their claims need it: with owned devices, once every pending pod
// has one or 30 s have passed; without, after 5 s. A count that fails
// leaves the counts of the one before.
func stockNotices(tCtx ktesting.TContext, c *framework.ControlPlane, ns string, owned bool) (pending, noticed int) {
	count := func(ctx context.Context) (bool, error) {
		pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil // counted again at the next poll
		}
		evs, err := c.Client.EventsV1().Events(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		told := map[types.UID]bool{}
		for _, ev := range evs.Items {
			if ev.Reason == topologydra.OwnedNoticeReason && ev.Type == v1.EventTypeWarning {
				told[ev.Regarding.UID] = true
			}
		}
		pending, noticed = 0, 0
		for _, p := range pods.Items {
			if p.Spec.SchedulerName == stockName && p.Spec.NodeName == "" {
				pending++
				if told[p.UID] {
					noticed++
				}
			}
		}
		return owned && pending > 0 && noticed == pending, nil
	}
	timeout := 5 * time.Second
	if owned {
		timeout = 30 * time.Second
	}
	_ = wait.PollUntilContextTimeout(tCtx, 200*time.Millisecond, timeout, true, count)
	return pending, noticed
}
