package integration

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/kubernetes/test/utils/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/config"
	"github.com/topodra/topodra/pkg/cluster"
	"github.com/topodra/topodra/pkg/invariant"
	"github.com/topodra/topodra/test/integration/framework"
)

// TestLeaderFailover runs two topodra-scheduler replicas that elect a
// leader through a Lease, as a Deployment with two replicas would, and
// stops the leader while it is scheduling. The other replica must take the
// lease and schedule every pod, including those created after the leader
// stopped (only it can bind them), without a double allocation or a pod
// bound with an unreserved claim.
func TestLeaderFailover(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "failover")
	// 10 nodes x 8 GPUs hold the 60 GPUs of the pods below however they
	// are placed: a node always has two GPUs free while 20 are free in all.
	e.dgxNodes("dgx", 10, "256")
	templates := []string{e.template(1, nil), e.template(2, nil)}

	election := &cluster.LeaderElection{
		Namespace:     e.ns,
		Name:          "topodra-scheduler",
		LeaseDuration: 4 * time.Second,
		RenewDeadline: 2 * time.Second,
		RetryPeriod:   time.Second,
	}
	startReplica := func(name string) func() {
		stop, err := cp.StartScheduler(tCtx, framework.SchedulerOptions{Name: name, Config: config.SchedulerConfig, LeaderElection: election})
		tCtx.ExpectNoError(err, "start replica "+name)
		tCtx.Cleanup(stop)
		return stop
	}
	// Replica a starts alone, so the first holder of the lease is a.
	stopA := startReplica("replica-a")
	holderA := e.waitLeaseHolder(election.Name, 30*time.Second, "a first holder", func(id string) bool { return id != "" })
	startReplica("replica-b")
	t.Logf("replica a holds the lease as %s; replica b stands by", holderA)

	const perBatch = 20
	createBatch := func(batch int) {
		for i := range perBatch {
			e.pod(fmt.Sprintf("b%d-%d", batch, i), topodraName, "dgx", templates[i%2])
		}
	}
	createBatch(0)
	bound := e.waitBoundCount(5, "a few pods of the first batch")
	// stopA returns once a's scheduler has stopped and its lease is released.
	stopA()
	stopped := time.Now()
	t.Logf("stopped the leader with %d of %d pods bound", bound, perBatch)
	holderB := e.waitLeaseHolder(election.Name, election.LeaseDuration+30*time.Second, "a holder other than a", func(id string) bool {
		return id != "" && id != holderA
	})
	t.Logf("replica b (%s) took the lease %s after a stopped", holderB, time.Since(stopped).Round(time.Millisecond))

	// Only b runs now: these pods can be bound by it alone.
	createBatch(1)
	e.waitBoundCount(2*perBatch, "every pod")
	pods, err := cp.Client.CoreV1().Pods(e.ns).List(tCtx, metav1.ListOptions{})
	tCtx.ExpectNoError(err)
	for i := range pods.Items {
		e.devicesOf(&pods.Items[i])
	}
	if got := e.leaseHolder(election.Name); got != holderB {
		t.Errorf("lease holder after the run is %q, want b (%s)", got, holderB)
	}
	e.expectNoViolations()
}

// leaseHolder returns the holderIdentity of a Lease in the test's
// namespace, "" if it has none or does not exist yet.
func (e *env) leaseHolder(name string) string {
	lease, err := cp.Client.CoordinationV1().Leases(e.ns).Get(e.tCtx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return ""
	}
	e.tCtx.ExpectNoError(err, "get lease "+name)
	return ptr.Deref(lease.Spec.HolderIdentity, "")
}

// waitLeaseHolder polls the Lease until cond accepts its holder and returns
// that holder.
func (e *env) waitLeaseHolder(name string, timeout time.Duration, what string, cond func(string) bool) string {
	e.tCtx.Helper()
	var holder string
	err := wait.PollUntilContextTimeout(e.tCtx, framework.PollInterval, timeout, true, func(context.Context) (bool, error) {
		holder = e.leaseHolder(name)
		return cond(holder), nil
	})
	e.tCtx.ExpectNoError(err, fmt.Sprintf("lease %s: waiting for %s; last holder %q", name, what, holder))
	return holder
}

// waitBoundCount waits until at least n pods of the namespace are bound and
// returns how many are.
func (e *env) waitBoundCount(n int, what string) int {
	e.tCtx.Helper()
	var bound, total int
	err := wait.PollUntilContextTimeout(e.tCtx, 20*time.Millisecond, waitTimeout, true, func(ctx context.Context) (bool, error) {
		pods, err := cp.Client.CoreV1().Pods(e.ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		bound, total = boundPods(pods.Items), len(pods.Items)
		return bound >= n, nil
	})
	e.tCtx.ExpectNoError(err, fmt.Sprintf("waiting for %s (%d) to be bound; %d of %d are", what, n, bound, total))
	return bound
}

func boundPods(pods []v1.Pod) int {
	n := 0
	for _, p := range pods {
		if p.Spec.NodeName != "" {
			n++
		}
	}
	return n
}

// expectNoViolations runs the invariant checker on the cluster and fails
// the test for each violation that involves the test's namespace (other
// tests sharing the cluster may leave theirs on purpose).
func (e *env) expectNoViolations() {
	e.tCtx.Helper()
	violations, err := invariant.Check(e.tCtx, cp.Client)
	e.tCtx.ExpectNoError(err, "invariant check")
	for _, v := range violations {
		if e.involves(v) {
			e.tCtx.Errorf("violation: %s", v)
		}
	}
}

func (e *env) involves(v invariant.Violation) bool {
	if strings.HasPrefix(v.Pod, e.ns+"/") {
		return true
	}
	for _, c := range v.Claims {
		if strings.HasPrefix(c, e.ns+"/") {
			return true
		}
	}
	return false
}
