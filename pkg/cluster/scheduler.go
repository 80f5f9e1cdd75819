package cluster

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"k8s.io/klog/v2"
	"sigs.k8s.io/yaml"

	schedulerapp "github.com/topodra/topodra/cmd/scheduler/app"
)

// SchedulerOptions says which scheduler to run and with which configuration.
type SchedulerOptions struct {
	// Name labels the instance in logs and in the config file name.
	Name string
	// Stock runs plain kube-scheduler (stock DynamicResources plugin), not
	// topodra-scheduler.
	Stock bool
	// Config is a KubeSchedulerConfiguration (YAML). Its clientConnection and
	// leaderElection are filled in by StartScheduler. Empty means the
	// default: one profile named after the scheduler.
	Config []byte
	// ConfigFile is read when Config is empty.
	ConfigFile string
	// Args are extra command-line flags.
	Args []string
	// LeaderElection, when set, runs the scheduler as one replica of a
	// group that elects a leader through a Lease. Nil means leader
	// election off.
	LeaderElection *LeaderElection
	// User, when set, is the user the scheduler acts as (the admin
	// impersonates it, in group system:authenticated): to see what the
	// API server lets that identity do, such as system:kube-scheduler,
	// the default scheduler's. The control plane's authorizer must let
	// it do the rest.
	User string
	// OnFailure, when set, is called with the error of a scheduler that
	// stopped on its own (a bad configuration, the API unreachable), not
	// when it is stopped.
	OnFailure func(error)
}

// LeaderElection is the leaderElection section StartScheduler writes into a
// replica's KubeSchedulerConfiguration, and the replica's identity, which
// the Lease's holderIdentity shows while it leads.
type LeaderElection struct {
	// Namespace and Name of the Lease. Both are required.
	Namespace, Name string
	// LeaseDuration, RenewDeadline and RetryPeriod as in
	// KubeSchedulerConfiguration; zero keeps kube-scheduler's default.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// KeepLeaseOnStop: when the replica is stopped while it leads, its
	// lease is left to expire, as when the process is killed, instead of
	// being released as on a graceful shutdown.
	KeepLeaseOnStop bool
	// Identity is the replica's holder identity: SchedulerOptions.Name
	// when empty. Replicas of one lease need distinct names.
	Identity string
}

// DefaultStockConfig is a config with one stock profile, default-scheduler.
const DefaultStockConfig = `apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
profiles:
- schedulerName: default-scheduler
`

// StartScheduler runs a scheduler in process against the control plane, from
// the same options and setup code as the binary, with --secure-port=0 and
// leader election as opts.LeaderElection says (off by default). The
// returned function stops it and waits until it has stopped (a leader
// releases its lease, unless KeepLeaseOnStop); Stop calls it too.
func (c *Cluster) StartScheduler(ctx context.Context, opts SchedulerOptions) (func(), error) {
	config := opts.Config
	if len(config) == 0 && opts.ConfigFile != "" {
		data, err := os.ReadFile(opts.ConfigFile)
		if err != nil {
			return nil, fmt.Errorf("read scheduler config: %w", err)
		}
		config = data
	}
	if len(config) == 0 {
		config = []byte(DefaultStockConfig)
	}
	name := opts.Name
	if name == "" {
		name = "scheduler"
	}
	path, err := c.writeSchedulerConfig(name, config, opts.LeaderElection, opts.User)
	if err != nil {
		return nil, err
	}
	args := append([]string{"--config=" + path, "--secure-port=0"}, opts.Args...)

	runOpts := schedulerapp.RunOptions{Stock: opts.Stock}
	if le := opts.LeaderElection; le != nil {
		runOpts.KeepLeaseOnStop = le.KeepLeaseOnStop
		runOpts.Identity = cmp.Or(le.Identity, name)
	}

	ctx, cancel := context.WithCancel(ctx)
	logger := klog.FromContext(ctx).WithName(name)
	ctx = klog.NewContext(ctx, logger)
	done := make(chan error, 1)
	go func() {
		err := schedulerapp.RunWithOptions(ctx, args, runOpts)
		if err != nil && ctx.Err() == nil {
			// Failed on its own (bad config, API unreachable): say so
			// where a test log or the simulator's output shows it.
			logger.Error(err, "Scheduler failed")
			fmt.Fprintf(os.Stderr, "scheduler %s failed: %v\n", name, err)
			if opts.OnFailure != nil {
				opts.OnFailure(err)
			}
		}
		done <- err
	}()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			<-done
		})
	}
	c.AddStop(stop)
	return stop, nil
}

// writeSchedulerConfig fills in the client connection and leader election
// (off when election is nil) of a KubeSchedulerConfiguration and writes it
// to a file.
func (c *Cluster) writeSchedulerConfig(name string, config []byte, election *LeaderElection, user string) (string, error) {
	var obj map[string]any
	if err := yaml.Unmarshal(config, &obj); err != nil {
		return "", fmt.Errorf("parse scheduler config: %w", err)
	}
	conn, _ := obj["clientConnection"].(map[string]any)
	if conn == nil {
		conn = map[string]any{}
	}
	conn["kubeconfig"] = c.Kubeconfig
	if user != "" {
		kubeconfig := filepath.Join(c.Dir, name+"-kubeconfig")
		if err := writeKubeconfigAs(c.Config, kubeconfig, user); err != nil {
			return "", err
		}
		conn["kubeconfig"] = kubeconfig
	}
	conn["qps"] = 5000
	conn["burst"] = 10000
	obj["clientConnection"] = conn
	le, _ := obj["leaderElection"].(map[string]any)
	if le == nil {
		le = map[string]any{}
	}
	le["leaderElect"] = election != nil
	if election != nil {
		if election.Namespace == "" || election.Name == "" {
			return "", fmt.Errorf("leader election of scheduler %s: lease namespace and name are required", name)
		}
		le["resourceLock"] = "leases"
		le["resourceNamespace"] = election.Namespace
		le["resourceName"] = election.Name
		for key, d := range map[string]time.Duration{
			"leaseDuration": election.LeaseDuration,
			"renewDeadline": election.RenewDeadline,
			"retryPeriod":   election.RetryPeriod,
		} {
			if d != 0 {
				le[key] = d.String()
			}
		}
	}
	obj["leaderElection"] = le
	out, err := yaml.Marshal(obj)
	if err != nil {
		return "", err
	}
	path := filepath.Join(c.Dir, name+"-config.yaml")
	if err := os.WriteFile(path, out, 0o644); err != nil {
		return "", fmt.Errorf("write scheduler config: %w", err)
	}
	return path, nil
}
