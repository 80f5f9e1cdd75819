// Package framework is the test side of pkg/cluster: it starts the
// embedded control plane for integration tests and benchmarks, tied to a
// test's lifetime, and adds object builders and queries that only tests
// use. Shipped code uses pkg/cluster directly.
package framework

import (
	"context"
	"testing"

	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/cluster"
)

// ControlPlane is a running etcd + kube-apiserver pair. Its fields
// (Config, Client, Kubeconfig, Dir) and methods (StartScheduler,
// StartClaimController, Apply, AddStop, Stop) are those of cluster.Cluster.
type ControlPlane struct {
	*cluster.Cluster
}

// Start starts a control plane (see cluster.Start) that tb's cleanup stops,
// components started through the ControlPlane first. extraFlags are
// kube-apiserver flags.
func Start(tb testing.TB, extraFlags ...string) (*ControlPlane, error) {
	tb.Helper()
	cp, err := StartProcess(klog.NewContext(context.Background(), klog.Background()), extraFlags...)
	if err != nil {
		return nil, err
	}
	tb.Cleanup(cp.Stop)
	return cp, nil
}

// StartProcess starts a control plane that lives until its Stop is called:
// for TestMain, where one control plane serves every test of a package.
func StartProcess(ctx context.Context, extraFlags ...string) (*ControlPlane, error) {
	c, err := cluster.Start(ctx, cluster.Options{APIServerFlags: extraFlags})
	if err != nil {
		return nil, err
	}
	return &ControlPlane{Cluster: c}, nil
}

// SchedulerOptions says which scheduler StartScheduler runs.
type SchedulerOptions = cluster.SchedulerOptions

// LeaderElection makes a scheduler one replica of a group that elects a
// leader through a Lease (see cluster.LeaderElection).
type LeaderElection = cluster.LeaderElection

// DefaultStockConfig is a config with one stock profile, default-scheduler.
const DefaultStockConfig = cluster.DefaultStockConfig
