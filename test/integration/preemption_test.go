package integration

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/kubernetes/test/utils/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/test/integration/framework"
)

// TestPreemptionFreesDevices: a DGX node whose 8 GPUs two low-priority
// pods hold, 4 each. A high-priority pod that needs 4 GPUs preempts
// exactly one of them (the stock plugin never preempts for devices: its
// trials free none), and gets the victim's GPUs once the victim is gone,
// not a third low-priority pod that waits for GPUs.
// After the victim is deleted, its claim keeps its allocation until the
// claim controller gives it back; the preemptor's attempts meanwhile must
// not take the other pod for a victim too.
func TestPreemptionFreesDevices(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "preempt")
	node := e.dgxNodes("g", 1, "256")[0]
	four := e.template(4, nil)
	startTopodra(tCtx)

	low := map[string][]string{}
	for _, name := range []string{"low-a", "low-b"} {
		e.pod(name, topodraName, "g", four)
		low[name] = e.devicesOf(e.waitScheduled(name))
	}
	tCtx.Logf("low-priority pods hold %v", low)
	// A third waits for GPUs at the victims' priority: the room made by
	// preemption is not its.
	e.pod("low-c", topodraName, "g", four)

	high := e.highPriority()
	e.podEdited("important", topodraName, "g", func(p *v1.Pod) { p.Spec.PriorityClassName = high }, four)

	// One victim; without a kubelet its deletion does not finish by
	// itself, so the test finishes it, as a kubelet would.
	var victim string
	deadline := time.Now().Add(waitTimeout)
	for victim == "" {
		if time.Now().After(deadline) {
			p, _ := cp.Client.CoreV1().Pods(e.ns).Get(tCtx, "important", metav1.GetOptions{})
			tCtx.Fatalf("no low-priority pod was preempted; important pod: %+v", framework.PodScheduledCondition(p))
		}
		for name := range low {
			p, err := cp.Client.CoreV1().Pods(e.ns).Get(tCtx, name, metav1.GetOptions{})
			tCtx.ExpectNoError(err)
			if p.DeletionTimestamp != nil {
				victim = name
			}
		}
		time.Sleep(framework.PollInterval)
	}
	tCtx.ExpectNoError(cp.Client.CoreV1().Pods(e.ns).Delete(tCtx, victim, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	scheduled := e.waitScheduled("important")
	got := e.devicesOf(scheduled)
	tCtx.Logf("victim %s; important pod on %s with %v", victim, scheduled.Spec.NodeName, got)
	if scheduled.Spec.NodeName != node || !slices.Equal(got, low[victim]) {
		tCtx.Errorf("important pod got %v on %s, want the victim's %v on %s", got, scheduled.Spec.NodeName, low[victim], node)
	}

	// The other pod runs on: no second victim, now or a little later;
	// the waiting pod still waits.
	time.Sleep(2 * time.Second)
	waiting, err := cp.Client.CoreV1().Pods(e.ns).Get(tCtx, "low-c", metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	if waiting.Spec.NodeName != "" {
		tCtx.Errorf("waiting low-priority pod bound to %s, want still pending", waiting.Spec.NodeName)
	}
	for name := range low {
		if name == victim {
			continue
		}
		p, err := cp.Client.CoreV1().Pods(e.ns).Get(tCtx, name, metav1.GetOptions{})
		tCtx.ExpectNoError(err)
		if p.DeletionTimestamp != nil || hasDisruptionTarget(p) {
			tCtx.Errorf("pod %s was preempted too (conditions %+v)", name, p.Status.Conditions)
		}
	}
}

// TestNoPreemptionWithoutRoom: the high-priority pod needs more GPUs than
// the node has; preemption evicts nobody for it.
func TestNoPreemptionWithoutRoom(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "nopreempt")
	e.dgxNodes("g", 1, "256")
	four := e.template(4, nil)
	startTopodra(tCtx)
	e.pod("low", topodraName, "g", four)
	e.waitScheduled("low")

	high := e.highPriority()
	e.podEdited("nine", topodraName, "g", func(p *v1.Pod) { p.Spec.PriorityClassName = high }, e.template(9, nil))
	_, err := framework.WaitForPod(tCtx, cp.Client, e.ns, "nine", waitTimeout, "unschedulable", func(p *v1.Pod) (bool, error) {
		c := framework.PodScheduledCondition(p)
		return c != nil && c.Reason == v1.PodReasonUnschedulable, nil
	})
	tCtx.ExpectNoError(err)
	time.Sleep(2 * time.Second)
	p, err := cp.Client.CoreV1().Pods(e.ns).Get(tCtx, "low", metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	if p.DeletionTimestamp != nil || hasDisruptionTarget(p) {
		tCtx.Errorf("pod low was preempted for a pod that cannot fit")
	}
}

// TestPreemptionOnFullCluster: 8 DGX nodes, every GPU held by 2-GPU pods
// of priority 0, with smallPodHeadroomPercent at its default. Pods of
// higher priority that need 4 and then 8 GPUs preempt: the headroom,
// which nothing free could satisfy, does not hold back a pod that may
// preempt. Each evicts the fewest pods that free an aligned placement:
// the 4-GPU pod two pods of one NUMA node, and gets that NUMA node; the
// 8-GPU pod the four pods of one node.
func TestPreemptionOnFullCluster(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "preemptfull")
	e.dgxNodes("g", 8, "256")
	two := e.template(2, nil)
	startTopodra(tCtx)

	var low []string
	for i := range 32 {
		name := fmt.Sprintf("low-%d", i)
		// Evicted pods go at once: no kubelet runs here.
		e.podEdited(name, topodraName, "g", func(p *v1.Pod) { p.Spec.TerminationGracePeriodSeconds = ptr.To[int64](0) }, two)
		low = append(low, name)
	}
	// Where each low-priority pod runs, and on which GPUs.
	placed := map[string]string{}
	for _, name := range low {
		pod := e.waitScheduled(name)
		placed[name] = fmt.Sprintf("%s %v", pod.Spec.NodeName, e.devicesOf(pod))
	}

	high := e.highPriority()
	for _, tc := range []struct {
		name    string
		gpus    int64
		victims int
	}{
		{"important-4", 4, 2},
		{"important-8", 8, 4},
	} {
		e.podEdited(tc.name, topodraName, "g", func(p *v1.Pod) { p.Spec.PriorityClassName = high }, e.template(tc.gpus, nil))
		scheduled := e.waitScheduled(tc.name)
		got := e.devicesOf(scheduled)
		pods, err := cp.Client.CoreV1().Pods(e.ns).List(tCtx, metav1.ListOptions{})
		tCtx.ExpectNoError(err)
		evicted := maps.Clone(placed)
		for _, p := range pods.Items {
			delete(evicted, p.Name)
		}
		for name := range evicted {
			delete(placed, name)
		}
		tCtx.Logf("%s on %s with %v; evicted: %v", tc.name, scheduled.Spec.NodeName, got, evicted)
		if len(got) != int(tc.gpus) || !sharedDomain(got, 4) && tc.gpus == 4 {
			tCtx.Errorf("%s got %v, want %d GPUs of one NUMA node", tc.name, got, tc.gpus)
		}
		if len(evicted) != tc.victims {
			tCtx.Errorf("%s: %d pods evicted, want %d", tc.name, len(evicted), tc.victims)
		}
	}
}

// TestHeldBackPodGoesOnceALowerPodHoldsDevices: on eight DGX nodes (the
// headroom keeps 8 of the 64 GPUs free), node 0 empty and 4 GPUs free on
// node 1, every other GPU held by claims without pods. A high-priority
// 8-GPU pod waits: on node 0 it would leave 4 free. Then a pod of lower
// priority takes 2 GPUs of node 1, placed by topodra or by the default
// scheduler. The headroom does not hold back a pod that may preempt a
// lower pod holding devices, so that pod's binding retries the 8-GPU pod
// at once, and it starts on node 0 (long before the scheduler would retry
// it on its own, after 5 minutes).
func TestHeldBackPodGoesOnceALowerPodHoldsDevices(t *testing.T) {
	for name, scheduler := range map[string]string{"topodra": topodraName, "default scheduler": stockName} {
		t.Run(name, func(t *testing.T) {
			tCtx := ktesting.Init(t)
			e := newEnv(tCtx, "heldlower")
			nodes := e.dgxNodes("h", 8, "256")
			e.preallocate("half", nodes[1], gpuRange(0, 4)...)
			for _, n := range nodes[2:] {
				e.preallocate("all-"+n, n, gpuRange(0, 8)...)
			}
			startTopodra(tCtx)
			if scheduler == stockName {
				startStock(tCtx)
			}

			high := e.highPriority()
			e.podEdited("whole", topodraName, "h", func(p *v1.Pod) { p.Spec.PriorityClassName = high }, e.template(8, nil))
			pod, err := framework.WaitForPodUnschedulable(tCtx, cp.Client, e.ns, "whole", waitTimeout)
			tCtx.ExpectNoError(err)
			if msg := framework.PodScheduledCondition(pod).Message; !strings.Contains(msg, "held back") {
				t.Fatalf("the 8-GPU pod waits with %q, want it held back by the headroom", msg)
			}
			// Past the scheduler's initial backoff (1 s).
			time.Sleep(1500 * time.Millisecond)

			e.podEdited("small", scheduler, "h", func(p *v1.Pod) { p.Spec.NodeSelector["kubernetes.io/hostname"] = nodes[1] }, e.template(2, nil))
			if got := e.waitScheduled("small").Spec.NodeName; got != nodes[1] {
				t.Errorf("the 2-GPU pod went to %s, want %s", got, nodes[1])
			}
			scheduled, err := framework.WaitForPod(tCtx, cp.Client, e.ns, "whole", 20*time.Second, "scheduled", func(p *v1.Pod) (bool, error) {
				return p.Spec.NodeName != "", nil
			})
			if err != nil {
				tCtx.Fatalf("the 8-GPU pod was not retried once a lower pod held devices: %v", err)
			}
			if scheduled.Spec.NodeName != nodes[0] {
				t.Errorf("the 8-GPU pod went to %s, want the empty %s", scheduled.Spec.NodeName, nodes[0])
			}
			if p, err := cp.Client.CoreV1().Pods(e.ns).Get(tCtx, "small", metav1.GetOptions{}); err != nil || p.DeletionTimestamp != nil {
				t.Errorf("the 2-GPU pod was preempted (%v), though node 0 was free", err)
			}
		})
	}
}

// TestPodKeptOffForNomineeGoesWhenNomineeDeleted: a DGX node whose GPUs
// three low-priority pods hold, 2 each, 2 free. A high-priority 8-GPU pod
// preempts them and is nominated to the node (the victims' deletion does
// not finish: no kubelet). A 2-GPU pod of low priority then finds the 2
// free GPUs kept for the nominee. Once the nominee is deleted, the
// scheduler requeues it at once and it takes them.
func TestPodKeptOffForNomineeGoesWhenNomineeDeleted(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "nominee")
	node := e.dgxNodes("g", 1, "256")[0]
	two := e.template(2, nil)
	startTopodra(tCtx)
	for _, name := range []string{"low-a", "low-b", "low-c"} {
		e.pod(name, topodraName, "g", two)
		e.waitScheduled(name)
	}
	high := e.highPriority()
	e.podEdited("nominee", topodraName, "g", func(p *v1.Pod) { p.Spec.PriorityClassName = high }, e.template(8, nil))
	_, err := framework.WaitForPod(tCtx, cp.Client, e.ns, "nominee", waitTimeout, "nominated", func(p *v1.Pod) (bool, error) {
		return p.Status.NominatedNodeName == node, nil
	})
	tCtx.ExpectNoError(err)

	e.pod("waiting", topodraName, "g", two)
	pod, err := framework.WaitForPodUnschedulable(tCtx, cp.Client, e.ns, "waiting", waitTimeout)
	tCtx.ExpectNoError(err)
	if msg := framework.PodScheduledCondition(pod).Message; !strings.Contains(msg, "in use") {
		t.Fatalf("the 2-GPU pod waits with %q, want the devices in use (kept for the nominated pod)", msg)
	}
	// Past the scheduler's initial backoff (1 s).
	time.Sleep(1500 * time.Millisecond)
	tCtx.ExpectNoError(cp.Client.CoreV1().Pods(e.ns).Delete(tCtx, "nominee", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	scheduled, err := framework.WaitForPod(tCtx, cp.Client, e.ns, "waiting", 20*time.Second, "scheduled", func(p *v1.Pod) (bool, error) {
		return p.Spec.NodeName != "", nil
	})
	if err != nil {
		tCtx.Fatalf("the 2-GPU pod was not retried once the nominated pod was deleted: %v", err)
	}
	tCtx.Logf("the 2-GPU pod got %v on %s", e.devicesOf(scheduled), scheduled.Spec.NodeName)
}

// TestPreemptorLeavesRuledOutNode: a high-priority pod preempts the
// low-priority pod on one of two full DGX nodes and waits there for the
// victim's GPUs; the victim terminates and never finishes (no kubelet, as
// on an unreachable node). The node is then cordoned: it is ruled out for
// reasons preemption cannot resolve, so the pod no longer waits there and
// preempts the low-priority pod on the other node, as DefaultPreemption
// does where a nominated node is ruled out.
func TestPreemptorLeavesRuledOutNode(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "cordon")
	nodes := e.dgxNodes("g", 2, "256")
	eight := e.template(8, nil)
	startTopodra(tCtx)
	for i, n := range nodes {
		e.podEdited(fmt.Sprintf("low-%d", i), topodraName, "g", func(p *v1.Pod) { p.Spec.NodeSelector["kubernetes.io/hostname"] = n }, eight)
	}
	for i := range nodes {
		e.waitScheduled(fmt.Sprintf("low-%d", i))
	}
	high := e.highPriority()
	e.podEdited("important", topodraName, "g", func(p *v1.Pod) { p.Spec.PriorityClassName = high }, eight)
	p, err := framework.WaitForPod(tCtx, cp.Client, e.ns, "important", waitTimeout, "nominated", func(p *v1.Pod) (bool, error) {
		return p.Status.NominatedNodeName != "", nil
	})
	tCtx.ExpectNoError(err)
	nominated := p.Status.NominatedNodeName
	victim, other := "low-0", "low-1"
	if nominated == nodes[1] {
		victim, other = other, victim
	}
	_, err = framework.WaitForPod(tCtx, cp.Client, e.ns, victim, waitTimeout, "terminating", func(p *v1.Pod) (bool, error) {
		return p.DeletionTimestamp != nil, nil
	})
	tCtx.ExpectNoError(err)
	if o, err := cp.Client.CoreV1().Pods(e.ns).Get(tCtx, other, metav1.GetOptions{}); err != nil || o.DeletionTimestamp != nil || hasDisruptionTarget(o) {
		tCtx.Fatalf("before the cordon: %s preempted too (%v)", other, err)
	}
	node, err := cp.Client.CoreV1().Nodes().Get(tCtx, nominated, metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	node.Spec.Unschedulable = true
	_, err = cp.Client.CoreV1().Nodes().Update(tCtx, node, metav1.UpdateOptions{})
	tCtx.ExpectNoError(err)
	// A node added, which requeues the pod (the same informer delivers
	// the cordon first).
	_, err = framework.CreateReadyNodeWithCPU(tCtx, cp.Client, e.ns+"-extra", map[string]string{"test": e.ns, "group": "none"}, "4")
	tCtx.ExpectNoError(err)
	if _, err := framework.WaitForPod(tCtx, cp.Client, e.ns, other, waitTimeout, "preempted", func(p *v1.Pod) (bool, error) {
		return p.DeletionTimestamp != nil || hasDisruptionTarget(p), nil
	}); err != nil {
		p, _ := cp.Client.CoreV1().Pods(e.ns).Get(tCtx, "important", metav1.GetOptions{})
		tCtx.Fatalf("%s was cordoned and the important pod did not preempt %s on the other node: nominated %q, %+v", nominated, other, p.Status.NominatedNodeName, framework.PodScheduledCondition(p))
	}
}
