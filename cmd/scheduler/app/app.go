// Package app builds the topodra-scheduler command: the upstream
// kube-scheduler command with the topodra plugins compiled in. It exists as a
// package (rather than only main) so that tests, benchmarks and the simulator
// run exactly the same scheduler in process.
package app

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"k8s.io/component-base/configz"
	k8sversion "k8s.io/component-base/version"
	"k8s.io/klog/v2"
	schedapp "k8s.io/kubernetes/cmd/kube-scheduler/app"
	"k8s.io/kubernetes/cmd/kube-scheduler/app/options"

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
// the topodra version and the kube-scheduler version it is built on.
func NewCommand() *cobra.Command {
	cmd := schedapp.NewSchedulerCommand(RegistryOptions()...)
	cmd.Use = SchedulerName
	cmd.Short = "kube-scheduler with topology-aware Dynamic Resource Allocation"
	upstreamPreRun := cmd.PersistentPreRunE
	cmd.PersistentPreRunE = func(c *cobra.Command, args []string) error {
		if f := c.Flags().Lookup("version"); f != nil && f.Changed && f.Value.String() != "false" {
			fmt.Fprintln(c.OutOrStdout(), VersionString())
			os.Exit(0)
		}
		return upstreamPreRun(c, args)
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
// topodra's plugins.
func Run(ctx context.Context, args []string, stock bool) error {
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
	}
	cc, sched, err := schedapp.Setup(ctx, opts, reg...)
	if err != nil {
		return fmt.Errorf("set up scheduler: %w", err)
	}
	// configz refuses a second registration of the same name, and Run
	// registers "componentconfig" as it starts. In-process schedulers start
	// one at a time: each removes what the one before registered and waits
	// until its own registration is there (or Run has ended).
	startMu.Lock()
	configz.Delete(configzName)
	klog.FromContext(ctx).V(2).Info("starting in-process scheduler", "stock", stock)
	done := make(chan error, 1)
	go func() { done <- schedapp.Run(ctx, cc, sched) }()
	err = waitRegistered(ctx, done)
	startMu.Unlock()
	if err != nil {
		return err
	}
	return <-done
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
	for {
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, configz.DefaultConfigzPath, nil))
		var registered map[string]json.RawMessage
		if rec.Code == http.StatusOK && json.Unmarshal(rec.Body.Bytes(), &registered) == nil {
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
