package perf

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/config"
	"github.com/topodra/topodra/pkg/cluster"
	"github.com/topodra/topodra/pkg/invariant"
)

// TestChurnNoDoubleAllocation loads topodra with upstream's
// claim-template/5000pods_500nodes (2,500 pre-allocated claims and 2,500
// one-device pods on 500 nodes of ten devices: the cluster ends up full),
// then runs ten rounds of churn: a fifth of the pods is deleted (their
// claims go with them) and as many pods of mixed sizes (1, 2 and 4
// devices) are created. After the burst and after every round, once
// binding has settled, the invariant checker must find nothing, and every
// pending pod must be one that fits nowhere (no node has as many free
// devices as it asks for). It asserts no timing.
func TestChurnNoDoubleAllocation(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a control plane with 500 nodes and schedules about 7,500 pods")
	}
	ctx := klog.NewContext(t.Context(), klog.Background())
	var w Workload
	for _, wl := range Workloads(500, time.Second) {
		if strings.HasPrefix(wl.Name, "claim-template/5000pods") {
			w = wl
		}
	}
	if w.Name == "" {
		t.Fatal("no claim-template/5000pods_500nodes workload")
	}
	w.Templates = append(w.Templates,
		Template{Name: "two", Requests: []Request{{Name: "req-0", Class: basicClass, Count: 2}}},
		Template{Name: "four", Requests: []Request{{Name: "req-0", Class: basicClass, Count: 4}}},
	)
	perNode := len(basicDevices())

	cp, err := cluster.Start(ctx, cluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer cp.Stop()
	if _, err := cp.StartClaimController(ctx); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := setUpCluster(ctx, cp.Client, &w); err != nil {
		t.Fatal(err)
	}
	const ns = "churn"
	if _, err := cp.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := createTemplates(ctx, cp.Client, ns, &w); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d nodes, %d pre-allocated claims in %v", w.Nodes, w.InitClaims, time.Since(start).Round(time.Second))
	stop, err := cp.StartScheduler(ctx, cluster.SchedulerOptions{Name: Topodra, Config: config.SchedulerConfig})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	if err := warmUp(ctx, cp.Client, "topodra-scheduler", Topodra); err != nil {
		t.Fatal(err)
	}

	create := func(templates []string) {
		t.Helper()
		err := parallel(ctx, len(templates), 16, func(ctx context.Context, i int) error {
			_, err := cp.Client.CoreV1().Pods(ns).Create(ctx, w.newPod(ns, "topodra-scheduler", templates[i]), metav1.CreateOptions{})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	judge := func(round string) []v1.Pod {
		t.Helper()
		start := time.Now()
		// Quiet for longer than the scheduler's largest backoff (10 s by
		// default): a pod that devices were freed for may wait that long
		// in backoff before its next attempt.
		pods, pending := settle(ctx, t, cp.Client, ns, 12*time.Second)
		violations, err := invariant.Check(ctx, cp.Client)
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range violations {
			t.Errorf("%s: %s", round, v)
		}
		free, err := freeDevices(ctx, cp.Client, perNode)
		if err != nil {
			t.Fatal(err)
		}
		most := 0
		for _, n := range free {
			most = max(most, n)
		}
		var fits []string
		for _, p := range pending {
			if need := devicesAsked(&w, p); need <= most {
				fits = append(fits, fmt.Sprintf("%s (%d devices)", p.Name, need))
			}
		}
		if len(fits) > 0 {
			t.Errorf("%s: %d pods stay pending although a node has %d free devices, e.g. %v", round, len(fits), most, fits[:min(5, len(fits))])
		}
		t.Logf("%s: %d pods, %d pending, %d violations, largest free block %d, settled in %v", round, len(pods), len(pending), len(violations), most, time.Since(start).Round(time.Second))
		return pods
	}

	create(w.podTemplates())
	pods := judge("burst")
	rng := newRand(11)
	sizes := []string{w.Templates[0].Name, w.Templates[0].Name, "two", "four"}
	for round := range 10 {
		victims := len(pods) / 5
		rng.Shuffle(len(pods), func(i, j int) { pods[i], pods[j] = pods[j], pods[i] })
		err := parallel(ctx, victims, 16, func(ctx context.Context, i int) error {
			return deletePod(ctx, cp.Client, ns, pods[i].Name)
		})
		if err != nil {
			t.Fatal(err)
		}
		next := make([]string, victims)
		for i := range next {
			next[i] = sizes[rng.IntN(len(sizes))]
		}
		create(next)
		pods = judge(fmt.Sprintf("round %d", round+1))
	}
}

// settle waits until every pod in ns is bound or has been found
// unschedulable, and the number of bound pods has not changed for quiet;
// it returns all pods and the pending ones.
func settle(ctx context.Context, t *testing.T, client kubernetes.Interface, ns string, quiet time.Duration) (all, pending []v1.Pod) {
	t.Helper()
	last, since := -1, time.Now()
	for {
		list, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		all, pending = all[:0], pending[:0]
		untried := 0
		for _, p := range list.Items {
			if p.DeletionTimestamp != nil {
				continue
			}
			all = append(all, p)
			if p.Spec.NodeName == "" {
				pending = append(pending, p)
				if !triedAndFailed(&p) {
					untried++
				}
			}
		}
		bound := len(all) - len(pending)
		if bound != last {
			last, since = bound, time.Now()
		}
		if len(pending) == 0 || (untried == 0 && time.Since(since) > quiet) {
			return all, pending
		}
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(time.Second):
		}
	}
}

// triedAndFailed reports whether the scheduler has marked the pod
// unschedulable.
func triedAndFailed(p *v1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse {
			return true
		}
	}
	return false
}

// freeDevices counts the devices without an allocation on each node.
func freeDevices(ctx context.Context, client kubernetes.Interface, perNode int) (map[string]int, error) {
	state, err := invariant.List(ctx, client)
	if err != nil {
		return nil, err
	}
	free := map[string]int{}
	for _, s := range state.Slices {
		if s.Spec.NodeName != nil {
			free[*s.Spec.NodeName] = perNode
		}
	}
	for _, c := range state.Claims {
		if c.Status.Allocation == nil {
			continue
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			free[r.Pool]--
		}
	}
	return free, nil
}

// devicesAsked is the device count of the pod's template.
func devicesAsked(w *Workload, p v1.Pod) int {
	for _, rc := range p.Spec.ResourceClaims {
		for _, tmpl := range w.Templates {
			if rc.ResourceClaimTemplateName != nil && *rc.ResourceClaimTemplateName == tmpl.Name {
				n := 0
				for _, r := range tmpl.Requests {
					n += int(r.Count)
				}
				return n
			}
		}
	}
	return 0
}
