// Package app builds the topodra-scheduler command: the upstream
// kube-scheduler command with the topodra plugins compiled in. It exists as a
// package (rather than only main) so that tests, benchmarks and the simulator
// run exactly the same scheduler in process.
package app

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/component-base/configz"
	k8sversion "k8s.io/component-base/version"
	"k8s.io/klog/v2"
	schedapp "k8s.io/kubernetes/cmd/kube-scheduler/app"
	schedulerserverconfig "k8s.io/kubernetes/cmd/kube-scheduler/app/config"
	"k8s.io/kubernetes/cmd/kube-scheduler/app/options"
	"k8s.io/kubernetes/pkg/scheduler"

	"github.com/topodra/topodra/pkg/version"
)

// SchedulerName is the profile name that pods use to opt in to topodra.
const SchedulerName = "topodra-scheduler"

// RegistryOptions lists the out-of-tree plugins compiled into topodra-scheduler.
func RegistryOptions() []schedapp.Option {
	return registryOptions
}

// registryOptions is extended by plugins.go.
var registryOptions []schedapp.Option

// NewCommand returns the topodra-scheduler command. It is the upstream
// kube-scheduler command with topodra's plugins registered; --version prints
// the topodra version and the kube-scheduler version it is built on. It
// refuses to start from a configuration that checkProfiles refuses, and
// with leader election that checkElection refuses.
func NewCommand() *cobra.Command {
	cmd := schedapp.NewSchedulerCommand(RegistryOptions()...)
	cmd.Use = SchedulerName
	cmd.Short = "kube-scheduler with topology-aware Dynamic Resource Allocation"
	// The help prints Long: the upstream text with what topodra adds.
	cmd.Long = "topodra-scheduler is kube-scheduler with the TopologyDRA plugin, which allocates the devices of pods' ResourceClaims as the stock DynamicResources plugin does and chooses them with NVLink cliques, PCIe roots and NUMA nodes in mind. It runs beside the default scheduler; pods opt in with spec.schedulerName: " + SchedulerName + ". Its profiles come from --config (see config/scheduler-config.yaml).\n\n" + cmd.Long
	upstreamPreRun := cmd.PersistentPreRunE
	cmd.PersistentPreRunE = func(c *cobra.Command, args []string) error {
		// --version (true) prints topodra's line; --version=raw and a
		// version override (--version=v1.x.y) are kube-scheduler's.
		if f := c.Flags().Lookup("version"); f != nil && f.Changed && f.Value.String() == "true" {
			fmt.Fprintln(c.OutOrStdout(), VersionString())
			os.Exit(0)
		}
		return upstreamPreRun(c, args)
	}
	// The configuration is checked for what kube-scheduler's validation
	// leaves out (checkProfiles) before the upstream command sets the
	// scheduler up from it; the feature gates are set by then.
	upstreamRun := cmd.RunE
	cmd.Flags().Bool(AllowUnelectedFlag, false, "Run with leader election off (leaderElection.leaderElect: false or --leader-elect=false). Only where exactly one instance of "+SchedulerName+" ever runs: replicas without leader election hand out the same devices twice.")
	cmd.RunE = func(c *cobra.Command, args []string) error {
		if f := c.Flags().Lookup("config"); f != nil {
			if err := checkConfigFile(klog.Background(), f.Value.String()); err != nil {
				return err
			}
		}
		if err := checkElection(klog.Background(), c.Flags()); err != nil {
			return err
		}
		return upstreamRun(c, args)
	}
	return cmd
}

// VersionString is what --version prints.
func VersionString() string {
	return fmt.Sprintf("topodra-scheduler %s (kube-scheduler %s)", version.Version, k8sversion.Get().GitVersion)
}

// Run runs a scheduler in process until ctx is cancelled, parsing args
// exactly like the command does. Unlike the command it leaves process-global
// logging configuration alone and stops when ctx is done, so tests and the
// simulator can run several schedulers (topodra and stock, or a restarted
// one) in one process. With stock=true it runs plain kube-scheduler without
// topodra's plugins; otherwise it refuses a configuration that
// checkProfiles refuses, as the command does. When the configuration enables leader election, it
// schedules only while it holds the lease and returns an error if it loses
// it (see runElected).
func Run(ctx context.Context, args []string, stock bool) error {
	return RunWithOptions(ctx, args, RunOptions{Stock: stock})
}

// RunOptions are the settings of an in-process scheduler that have no
// command-line flag.
type RunOptions struct {
	// Stock runs plain kube-scheduler without topodra's plugins.
	Stock bool
	// KeepLeaseOnStop makes a leader that is stopped through its context
	// leave its lease to expire instead of releasing it, as a killed
	// process does: a successor takes over only once the lease duration has
	// passed. Without leader election it has no effect.
	KeepLeaseOnStop bool
	// Identity is the replica's holder identity in the lease. Empty keeps
	// kube-scheduler's own (hostname_uuid). Without leader election it has
	// no effect.
	Identity string
}

// RunWithOptions is Run with the settings in runOpts.
func RunWithOptions(ctx context.Context, args []string, runOpts RunOptions) error {
	stock := runOpts.Stock
	opts := options.NewOptions()
	fs := pflag.NewFlagSet(SchedulerName, pflag.ContinueOnError)
	for _, set := range opts.Flags.FlagSets {
		fs.AddFlagSet(set)
	}
	if err := fs.Parse(args); err != nil {
		return fmt.Errorf("parse scheduler flags: %w", err)
	}
	if err := opts.ComponentGlobalsRegistry.Set(); err != nil {
		return fmt.Errorf("apply feature gates: %w", err)
	}
	var reg []schedapp.Option
	if !stock {
		reg = RegistryOptions()
		if err := checkConfigFile(klog.FromContext(ctx), opts.ConfigFile); err != nil {
			return err
		}
	}
	cc, sched, err := schedapp.Setup(ctx, opts, reg...)
	if err != nil {
		return fmt.Errorf("set up scheduler: %w", err)
	}
	if cc.LeaderElection != nil {
		if runOpts.Identity != "" {
			lock, ok := cc.LeaderElection.Lock.(*resourcelock.LeaseLock)
			if !ok {
				return fmt.Errorf("leader election identity %q: lock %T is not a Lease", runOpts.Identity, cc.LeaderElection.Lock)
			}
			lock.LockConfig.Identity = runOpts.Identity
		}
		return runElected(ctx, cc, sched, stock, !runOpts.KeepLeaseOnStop)
	}
	return runScheduler(ctx, cc, sched, stock)
}

// runScheduler runs the scheduler inline (upstream's path without leader
// election) until ctx is done.
func runScheduler(ctx context.Context, cc *schedulerserverconfig.CompletedConfig, sched *scheduler.Scheduler, stock bool) error {
	// configz refuses a second registration of the same name, and Run
	// registers "componentconfig" as it starts. In-process schedulers start
	// one at a time: each removes what the one before registered and waits
	// until its own registration is there (or Run has ended).
	startMu.Lock()
	configz.Delete(configzName)
	klog.FromContext(ctx).V(2).Info("Starting in-process scheduler", "stock", stock)
	done := make(chan error, 1)
	go func() { done <- schedapp.Run(ctx, cc, sched) }()
	err := waitRegistered(ctx, done)
	startMu.Unlock()
	if err != nil {
		return err
	}
	return <-done
}

// errLostLease is what runElected returns when the scheduler stopped because
// another replica took the lease (upstream's command exits with status 1).
var errLostLease = errors.New("lost lease")

// runElected competes for the lease described by cc.LeaderElection and runs
// the scheduler (runScheduler) only while it holds it. It returns nil when
// ctx is done and errLostLease when the lease was lost.
//
// Upstream's Run elects too, but it ends the process (os.Exit) when it stops
// leading, even when asked to stop, which an in-process replica must not do.
// Here, when ctx is done, the scheduler stops first and the lease is
// released (if release is set) after it has stopped, so that a successor
// does not start beside it. A standby replica starts its informers only
// once it leads.
func runElected(ctx context.Context, cc *schedulerserverconfig.CompletedConfig, sched *scheduler.Scheduler, stock, release bool) error {
	logger := klog.FromContext(ctx)
	le := *cc.LeaderElection
	// Upstream's Run must not elect again (cc.LeaderElection) nor add the
	// elector's watchdog to its health checks (LeaderElect).
	cc.LeaderElection = nil
	cc.ComponentConfig.LeaderElection.LeaderElect = false
	le.ReleaseOnCancel = release

	// electCtx keeps ctx's values (logger) but ends only through
	// stopElect, which releases the lease if it is held and release is
	// set.
	electCtx, stopElect := context.WithCancel(context.WithoutCancel(ctx))
	defer stopElect()
	var (
		mu       sync.Mutex
		leading  bool // guarded by mu
		stopping bool // guarded by mu
	)
	schedDone := make(chan error, 1)
	// While standing by, stop competing as soon as ctx is done. While
	// leading, OnStartedLeading stops the scheduler first, then the
	// election.
	stopWatch := context.AfterFunc(ctx, func() {
		mu.Lock()
		defer mu.Unlock()
		stopping = true
		if !leading {
			stopElect()
		}
	})
	defer stopWatch()
	le.Callbacks = leaderelection.LeaderCallbacks{
		OnStartedLeading: func(leaseCtx context.Context) {
			mu.Lock()
			if stopping {
				mu.Unlock()
				return
			}
			leading = true
			mu.Unlock()
			logger.Info("Leading, starting to schedule", "identity", le.Lock.Identity())
			runCtx, cancel := context.WithCancel(leaseCtx)
			stopRun := context.AfterFunc(ctx, cancel)
			err := runScheduler(runCtx, cc, sched, stock)
			stopRun()
			cancel()
			schedDone <- err
			stopElect()
		},
		OnStoppedLeading: func() {},
	}
	elector, err := leaderelection.NewLeaderElector(le)
	if err != nil {
		return fmt.Errorf("create leader elector: %w", err)
	}
	logger.V(2).Info("Competing for the scheduler lease", "identity", le.Lock.Identity(), "lease", le.Lock.Describe())
	elector.Run(electCtx)
	mu.Lock()
	led := leading
	mu.Unlock()
	if led {
		// The scheduler stops when the lease ends (leaseCtx); wait for it.
		<-schedDone
	}
	if ctx.Err() != nil {
		return nil
	}
	return errLostLease
}

const configzName = "componentconfig"

// startMu serialises the start of in-process schedulers (see Run).
var startMu sync.Mutex

// waitRegistered polls the configz handler until configzName is registered.
// If Run ends first, its result is returned (and put back for the caller).
func waitRegistered(ctx context.Context, done chan error) error {
	mux := http.NewServeMux()
	configz.InstallHandler(mux)
	ticker := time.NewTicker(5 * time.Millisecond)
	defer ticker.Stop()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, configz.DefaultConfigzPath, nil)
	if err != nil {
		return err
	}
	for {
		rec := &response{}
		mux.ServeHTTP(rec, req)
		var registered map[string]json.RawMessage
		if rec.status() == http.StatusOK && json.Unmarshal(rec.body.Bytes(), &registered) == nil {
			if _, ok := registered[configzName]; ok {
				return nil
			}
		}
		select {
		case err := <-done:
			done <- err
			return nil
		case <-ctx.Done():
			return nil
		case <-ticker.C:
		}
	}
}

// response is an http.ResponseWriter that keeps what a handler writes.
type response struct {
	header http.Header
	code   int
	body   bytes.Buffer
}

func (r *response) Header() http.Header {
	if r.header == nil {
		r.header = http.Header{}
	}
	return r.header
}

func (r *response) WriteHeader(code int) {
	if r.code == 0 {
		r.code = code
	}
}

func (r *response) Write(b []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	return r.body.Write(b)
}

// status is the status code written, 200 where none was.
func (r *response) status() int {
	if r.code == 0 {
		return http.StatusOK
	}
	return r.code
}
