package integration

import (
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/kubernetes/test/utils/ktesting"

	"github.com/topodra/topodra/config"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

func TestSchedulerProfileBindsPods(t *testing.T) {
	tCtx := ktesting.Init(t)
	client := cp.Client
	ns, err := framework.CreateNamespace(tCtx, client, "profile")
	tCtx.ExpectNoError(err)
	nodeName := ns + "-node"
	_, err = framework.CreateReadyNode(tCtx, client, nodeName, map[string]string{"test": ns})
	tCtx.ExpectNoError(err)

	class := framework.DeviceClass(ns+"-gpu", topology.DriverName)
	_, err = client.ResourceV1().DeviceClasses().Create(tCtx, class, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	var devices []framework.Device
	for i := range 4 {
		devices = append(devices, framework.Device{Name: fmt.Sprintf("gpu-%d", i)})
	}
	_, err = client.ResourceV1().ResourceSlices().Create(tCtx, framework.SliceForNode(nodeName, topology.DriverName, devices), metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	_, err = client.ResourceV1().ResourceClaimTemplates(ns).Create(tCtx, framework.ClaimTemplate(ns, "one-gpu", class.Name, 1), metav1.CreateOptions{})
	tCtx.ExpectNoError(err)

	stop, err := cp.StartScheduler(tCtx, framework.SchedulerOptions{
		Name:       "topodra",
		ConfigFile: filepath.Join("..", "..", "config", "scheduler-config.yaml"),
	})
	tCtx.ExpectNoError(err)
	defer stop()

	plain := framework.PodWithClaims(ns, "plain", "topodra-scheduler")
	plain.Spec.NodeSelector = map[string]string{"test": ns}
	other := framework.PodWithClaims(ns, "other", "someone-else")
	withClaim := framework.PodWithClaims(ns, "with-claim", "topodra-scheduler", "one-gpu")
	withClaim.Spec.NodeSelector = map[string]string{"test": ns}
	for _, pod := range []*v1.Pod{plain, other, withClaim} {
		_, err := client.CoreV1().Pods(ns).Create(tCtx, pod, metav1.CreateOptions{})
		tCtx.ExpectNoError(err, "create pod "+pod.Name)
	}

	got, err := framework.WaitForPodScheduled(tCtx, client, ns, "plain", 60*time.Second)
	tCtx.ExpectNoError(err)
	if got.Spec.NodeName != nodeName {
		t.Errorf("plain pod bound to %q, want %q", got.Spec.NodeName, nodeName)
	}
	got, err = framework.WaitForPodScheduled(tCtx, client, ns, "with-claim", 60*time.Second)
	tCtx.ExpectNoError(err)
	claims, err := framework.PodClaims(tCtx, client, got)
	tCtx.ExpectNoError(err)
	if len(claims) != 1 {
		t.Fatalf("pod has %d claims, want 1", len(claims))
	}
	claim := claims[0]
	if devs := framework.AllocatedDevices(claim); len(devs) != 1 {
		t.Errorf("claim %s allocated devices %v, want exactly 1", claim.Name, devs)
	}
	if len(claim.Status.ReservedFor) != 1 || claim.Status.ReservedFor[0].Name != "with-claim" {
		t.Errorf("claim %s reservedFor = %v, want the pod", claim.Name, claim.Status.ReservedFor)
	}

	// A pod for another scheduler must stay pending. By now our scheduler has
	// bound two pods created after it, so it has seen this one and left it.
	pending, err := client.CoreV1().Pods(ns).Get(tCtx, "other", metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	if pending.Spec.NodeName != "" {
		t.Errorf("pod for schedulerName someone-else was bound to %s", pending.Spec.NodeName)
	}
	if c := framework.PodScheduledCondition(pending); c != nil {
		t.Errorf("pod for schedulerName someone-else has a PodScheduled condition from us: %+v", c)
	}
}

// TestSchedulersStartTogether starts topodra and stock at the same moment,
// several times: in-process schedulers share the configz registry, and a
// start that raced another one used to fail ("register config
// componentconfig twice", seen once in a full run of this package). The
// window is narrow, so this is a stress test: it fails only when a start
// races and app.Run does not serialise starts. Each round, both schedulers
// must schedule a pod.
func TestSchedulersStartTogether(t *testing.T) {
	tCtx := ktesting.Init(t)
	ns, err := framework.CreateNamespace(tCtx, cp.Client, "together")
	tCtx.ExpectNoError(err)
	_, err = framework.CreateReadyNode(tCtx, cp.Client, ns+"-node", map[string]string{"test": ns})
	tCtx.ExpectNoError(err)
	for round := range 5 {
		var stops [2]func()
		var errs [2]error
		var wg sync.WaitGroup
		for i, opts := range []framework.SchedulerOptions{{Name: "topodra", Config: config.SchedulerConfig}, {Name: "stock", Stock: true}} {
			wg.Go(func() { stops[i], errs[i] = cp.StartScheduler(tCtx, opts) })
		}
		wg.Wait()
		tCtx.ExpectNoError(errs[0])
		tCtx.ExpectNoError(errs[1])
		for _, sched := range []string{topodraName, stockName} {
			name := fmt.Sprintf("%s-%d", sched, round)
			pod := framework.PodWithClaims(ns, name, sched)
			pod.Spec.NodeSelector = map[string]string{"test": ns}
			_, err := cp.Client.CoreV1().Pods(ns).Create(tCtx, pod, metav1.CreateOptions{})
			tCtx.ExpectNoError(err)
			_, err = framework.WaitForPodScheduled(tCtx, cp.Client, ns, name, waitTimeout)
			tCtx.ExpectNoError(err, "round %d", round)
		}
		stops[0]()
		stops[1]()
	}
}
