// Command topodra-sim runs a simulated GPU cluster in process (embedded etcd,
// kube-apiserver, the ResourceClaim controller, node agents on mock machines
// publishing real ResourceSlices) and the same seeded workload through
// topodra-scheduler and, on a fresh identical cluster, the stock
// kube-scheduler; then it prints where every GPU went, side by side.
//
//	go run ./cmd/simulator [--nodes 8] [--profile dgx-h100=6,pcie-nvlink-pairs=2]
//	    [--pods 160] [--seed 1] [--schedulers topodra,stock]
//	    [--trace builtin|poisson|nic-match]
//	    [--workload FILE] [--report out.html] [--json out.json]
//
// With --seeds (e.g. 1-8) it runs a sweep instead: every scenario (the
// built-in workload on the default 8-node mix and on a 16-node mix, the
// poisson and nic-match traces on the default mix; --scenarios picks some)
// with every seed through both schedulers, prints one row per run and
// scheduler, then the medians and the placement targets; --json writes
// all of it.
//
//	go run ./cmd/simulator --seeds 1-8 [--scenarios builtin-8,poisson-8] [--rounds 3] [--json sweep.json]
//
// --rounds runs every scenario and seed several times and takes the medians
// over all runs; --pool does the same for sweeps already run, from their
// JSON files:
//
//	go run ./cmd/simulator --pool a.json,b.json [--json pooled.json]
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"slices"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/cluster"
	"github.com/topodra/topodra/pkg/sim"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("topodra-sim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		opts       sim.Options
		schedulers string
		workload   string
		reportPath string
		jsonPath   string
		logFile    string
		verbosity  int
		schedCfg   string
		stockCfg   string
		seeds      string
		scenarios  string
		rounds     int
		pool       string
	)
	fs.IntVar(&opts.Nodes, "nodes", 0, "number of simulated nodes (default: the sum of the --profile mix, or 8)")
	fs.StringVar(&opts.Profile, "profile", sim.DefaultProfile, "machine profile, or a mix like dgx-h100=6,pcie-nvlink-pairs=2 (profiles: dgx-h100, pcie-nvlink-pairs, workstation-2gpu); a mix is scaled to --nodes")
	fs.IntVar(&opts.Pods, "pods", 160, "number of pods of the built-in workload")
	fs.Int64Var(&opts.Seed, "seed", 1, "seed of the built-in workload")
	fs.StringVar(&schedulers, "schedulers", "topodra,stock", "schedulers to compare, in order: topodra, stock")
	fs.StringVar(&workload, "workload", "", "Kubernetes YAML with Pods and ResourceClaimTemplates to run instead of the built-in workload (pod annotations "+sim.AnnotationArrival+" and "+sim.AnnotationLifetime+", in ticks)")
	fs.StringVar(&opts.Trace, "trace", sim.TraceBuiltin, "generated workload: builtin, poisson (Poisson arrivals, lifetimes that grow with size) or nic-match (also GPU+NIC pods with a hard matchAttribute on pcieRoot)")
	fs.StringVar(&seeds, "seeds", "", "run a sweep over these seeds (e.g. 1-8) and the scenarios, and print medians against the placement targets")
	fs.StringVar(&scenarios, "scenarios", "", "with --seeds: the scenarios to run, comma-separated (default all: builtin-8, builtin-16, poisson-8, nic-match-8)")
	fs.IntVar(&rounds, "rounds", 1, "with --seeds: run every scenario and seed this many times; the medians and targets are taken over all the runs")
	fs.StringVar(&pool, "pool", "", "instead of running: comma-separated JSON files written by --seeds --json (of the same build and configuration); print the medians and targets over all their runs together (with --json, write that report)")
	hostRequests := fs.Bool("host-requests", true, "the generated pods request "+sim.HostRequestsText+", as GPU pods do (the nodes have 256 CPUs and 2 TiB); false: no CPU or memory requests, which leaves the stock scheduler's node scores equal, so it takes the first feasible node")
	fs.BoolVar(&opts.Pin, "pin", false, "pin every pod of the built-in workload to a node (by the seed), so that only device choice differs")
	fs.IntVar(&opts.WarmUpPods, "warm-up-pods", sim.DefaultWarmUpPods, "pods of an unmeasured run through each scheduler before the measured ones (once per sweep), so that neither pays for being the first of the process; 0 or less: no warm-up")
	fs.IntVar(&opts.Checkpoints, "checkpoints", 3, "intermediate snapshots of the device maps in the report")
	fs.StringVar(&reportPath, "report", "", "write a self-contained HTML report to this file")
	fs.StringVar(&jsonPath, "json", "", "write the full results as JSON to this file")
	fs.StringVar(&stockCfg, "stock-scheduler-config", "", "KubeSchedulerConfiguration for the stock run instead of the default one (its profile must be named default-scheduler), e.g. a bin-packing NodeResourcesFit")
	fs.StringVar(&schedCfg, "scheduler-config", "", "KubeSchedulerConfiguration for the topodra run instead of the embedded config/scheduler-config.yaml (its profile must be named topodra-scheduler)")
	fs.StringVar(&logFile, "log-file", "", "write component logs (apiserver, schedulers, agents) to this file; by default they are discarded")
	fs.IntVar(&verbosity, "v", 0, "log verbosity for --log-file")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0 // --help printed the usage, as asked
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "unexpected arguments: %v\n", fs.Args())
		return 2
	}
	if rounds < 1 || (rounds > 1 && seeds == "") {
		fmt.Fprintf(stderr, "--rounds %d: give --seeds and 1 or more rounds\n", rounds)
		return 2
	}
	if scenarios != "" && seeds == "" {
		fmt.Fprintln(stderr, "--scenarios chooses the scenarios of a sweep: give --seeds too")
		return 2
	}
	if reportPath != "" && seeds != "" {
		fmt.Fprintln(stderr, "--report is the report of one run; a sweep writes its runs with --json")
		return 2
	}
	for _, path := range []string{reportPath, jsonPath} {
		if path == "" {
			continue
		}
		if err := checkOutput(path); err != nil {
			fmt.Fprintln(stderr, err)
			return 2
		}
	}
	if pool != "" {
		if seeds != "" {
			fmt.Fprintln(stderr, "--pool joins sweeps already run: give it or --seeds, not both")
			return 2
		}
		return poolSweeps(sim.ParseSchedulers(pool), jsonPath, stdout, stderr)
	}
	opts.Schedulers = sim.ParseSchedulers(schedulers)
	opts.NoHostRequests = !*hostRequests
	if opts.Checkpoints == 0 {
		opts.Checkpoints = -1
	}
	if opts.WarmUpPods == 0 {
		opts.WarmUpPods = -1
	}
	if workload != "" {
		w, err := sim.LoadWorkload(workload)
		if err != nil {
			fmt.Fprintln(stderr, err)
			return 2
		}
		opts.Workload = w
		opts.WorkloadName = workload
	}
	for _, f := range []struct {
		path string
		into *[]byte
	}{{schedCfg, &opts.SchedulerConfig}, {stockCfg, &opts.StockSchedulerConfig}} {
		if f.path == "" {
			continue
		}
		data, err := os.ReadFile(f.path)
		if err != nil {
			fmt.Fprintln(stderr, err)
			return 2
		}
		*f.into = data
	}
	if seeds == "" {
		if err := opts.Check(); err != nil {
			fmt.Fprintln(stderr, err)
			return 2
		}
	}
	if err := cluster.SetUpLogging(logFile, verbosity); err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	defer klog.Flush()
	progress, err := quietStderr(logFile)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	if progress != nil && stderr == os.Stderr {
		stderr = progress
	}
	opts.Progress = stderr

	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	start := time.Now()
	if seeds != "" {
		podsSet := false
		fs.Visit(func(f *flag.Flag) { podsSet = podsSet || f.Name == "pods" })
		return sweep(ctx, opts, seeds, scenarios, rounds, podsSet, jsonPath, stdout, stderr)
	}
	report, err := sim.Run(ctx, opts)
	if err != nil {
		return failed(ctx, err, stderr)
	}
	fmt.Fprintf(stdout, "\ntopodra-sim: %s, %d pods over %d ticks, %d nodes (%s)\n\n", report.Description(), report.Pods, report.Ticks, len(report.Nodes), report.Profile)
	if err := report.WriteTable(stdout); err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	if s := report.Summary(); s != "" {
		fmt.Fprintf(stdout, "\n%s\n", s)
	}
	code := 0
	for _, res := range report.Results {
		for _, e := range res.Errors {
			fmt.Fprintf(stderr, "[%s] inconsistency: %s\n", res.Scheduler, e)
			code = 1
		}
	}
	if reportPath != "" {
		if err := writeFile(reportPath, report.WriteHTML); err != nil {
			fmt.Fprintln(stderr, err)
			return 1
		}
		fmt.Fprintf(stdout, "report: %s\n", reportPath)
	}
	if jsonPath != "" {
		if err := writeJSON(jsonPath, report); err != nil {
			fmt.Fprintln(stderr, err)
			return 1
		}
		fmt.Fprintf(stdout, "json: %s\n", jsonPath)
	}
	fmt.Fprintf(stdout, "total wall time %.1fs\n", time.Since(start).Seconds())
	return code
}

// failed reports a run that did not finish: interrupted (exit 130, as a
// shell reports SIGINT), or failed (exit 1).
func failed(ctx context.Context, err error, stderr io.Writer) int {
	if ctx.Err() != nil {
		fmt.Fprintln(stderr, "topodra-sim: interrupted")
		return 130
	}
	fmt.Fprintf(stderr, "topodra-sim: %v\n", err)
	return 1
}

// sweep runs the multi-seed sweep; opts.Pods replaces each scenario's pod
// count when podsSet.
func sweep(ctx context.Context, opts sim.Options, seeds, scenarios string, rounds int, podsSet bool, jsonPath string, stdout, stderr io.Writer) int {
	start := time.Now()
	seedList, err := sim.ParseSeeds(seeds)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	all := sim.DefaultScenarios()
	chosen := all
	if scenarios != "" {
		chosen = nil
		for _, name := range sim.ParseSchedulers(scenarios) {
			i := slices.IndexFunc(all, func(sc sim.Scenario) bool { return sc.Name == name })
			if i < 0 {
				fmt.Fprintf(stderr, "unknown scenario %q\n", name)
				return 2
			}
			chosen = append(chosen, all[i])
		}
	}
	if podsSet {
		for i := range chosen {
			chosen[i].Pods = opts.Pods
		}
	}
	if opts.Workload != nil || opts.Pin {
		fmt.Fprintln(stderr, "--seeds generates its workloads: --workload and --pin do not apply")
		return 2
	}
	base := opts
	for _, sc := range chosen {
		base.Profile, base.Nodes, base.Trace = sc.Profile, sc.Nodes, sc.Trace
		if err := base.Check(); err != nil {
			fmt.Fprintf(stderr, "scenario %s: %v\n", sc.Name, err)
			return 2
		}
	}
	rep, err := sim.Sweep(ctx, sim.SweepOptions{Seeds: seedList, Scenarios: chosen, Rounds: rounds, Base: opts, Rows: stdout})
	if err != nil {
		if rep != nil && jsonPath != "" {
			// The runs before the failure are kept, marked incomplete.
			if werr := writeJSON(jsonPath, rep); werr != nil {
				fmt.Fprintln(stderr, werr)
			} else {
				fmt.Fprintf(stderr, "json of the %d rows before the failure (incomplete): %s\n", len(rep.Rows), jsonPath)
			}
		}
		return failed(ctx, err, stderr)
	}
	fmt.Fprintln(stdout)
	return writeSweep(rep, jsonPath, start, stdout, stderr)
}

// poolSweeps reads sweep reports from files and prints (and, with
// jsonPath, writes) the report of all their runs together.
func poolSweeps(files []string, jsonPath string, stdout, stderr io.Writer) int {
	start := time.Now()
	var reports []*sim.SweepReport
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			fmt.Fprintln(stderr, err)
			return 2
		}
		var rep sim.SweepReport
		if err := json.Unmarshal(data, &rep); err != nil {
			fmt.Fprintf(stderr, "%s: not a sweep report: %v\n", f, err)
			return 2
		}
		if len(rep.Rows) == 0 {
			fmt.Fprintf(stderr, "%s: not a sweep report: %s; --pool takes the JSON files of sweeps (--seeds ... --json FILE)\n", f, whatInstead(data))
			return 2
		}
		reports = append(reports, &rep)
	}
	rep, err := sim.PoolSweeps(reports)
	if err != nil {
		fmt.Fprintf(stderr, "--pool: %v\n", err)
		return 2
	}
	fmt.Fprintf(stdout, "pooled %d sweep reports: %d runs\n\n", len(reports), len(rep.Rows))
	return writeSweep(rep, jsonPath, start, stdout, stderr)
}

// whatInstead says what a JSON file without a sweep's runs is.
func whatInstead(data []byte) string {
	var run struct {
		Results []json.RawMessage `json:"results"`
	}
	if json.Unmarshal(data, &run) == nil && run.Results != nil {
		return "it is the report of one run (--json without --seeds)"
	}
	return "it has no runs"
}

// writeSweep prints a sweep report's summary and targets, and writes it
// as JSON to jsonPath if set.
func writeSweep(rep *sim.SweepReport, jsonPath string, start time.Time, stdout, stderr io.Writer) int {
	if err := rep.WriteSummary(stdout); err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	if jsonPath != "" {
		if err := writeJSON(jsonPath, rep); err != nil {
			fmt.Fprintln(stderr, err)
			return 1
		}
		fmt.Fprintf(stdout, "json: %s\n", jsonPath)
	}
	code := 0
	for _, s := range rep.Summaries {
		if s.Errors > 0 {
			fmt.Fprintf(stderr, "[%s] %d inconsistencies; rerun one seed with --json to see them\n", s.Scheduler, s.Errors)
			code = 1
		}
	}
	fmt.Fprintf(stdout, "total wall time %.1fs\n", time.Since(start).Seconds())
	return code
}

// checkOutput refuses, before anything runs, an output path that could
// not be written at the end: one in a directory that does not exist, a
// directory, a file that cannot be opened for writing, or a new file in a
// directory where none can be created. It leaves nothing behind: an
// existing file is opened without being truncated, and a new one is
// tried with a temporary file beside it, removed at once.
func checkOutput(path string) error {
	dir := filepath.Dir(path)
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		return fmt.Errorf("cannot write %s: no directory %s", path, dir)
	}
	st, err := os.Stat(path)
	switch {
	case err == nil && st.IsDir():
		return fmt.Errorf("cannot write %s: it is a directory", path)
	case err == nil:
		f, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err != nil {
			return fmt.Errorf("cannot write %s: %w", path, err)
		}
		return f.Close()
	case errors.Is(err, os.ErrNotExist):
		f, err := os.CreateTemp(dir, ".topodra-sim-*")
		if err != nil {
			return fmt.Errorf("cannot write %s: %w", path, err)
		}
		_ = f.Close()
		return os.Remove(f.Name())
	default:
		return fmt.Errorf("cannot write %s: %w", path, err)
	}
}

// writeJSON writes v as indented JSON to path.
func writeJSON(path string, v any) error {
	return writeFile(path, func(w io.Writer) error {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	})
}

func writeFile(path string, write func(io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		_ = f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Close()
}

// quietStderr points file descriptor 2 at the log file (or /dev/null) and
// returns a file for the original stderr. Embedded etcd and its clients log
// through their own loggers straight to stderr, which would tear up the
// progress output. It returns nil where descriptors cannot be moved.
func quietStderr(logFile string) (*os.File, error) {
	target := os.DevNull
	if logFile != "" {
		target = logFile
	}
	sink, err := os.OpenFile(target, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	defer sink.Close()
	orig, err := unix.Dup(int(os.Stderr.Fd()))
	if err != nil {
		return nil, nil
	}
	if err := unix.Dup2(int(sink.Fd()), int(os.Stderr.Fd())); err != nil {
		_ = unix.Close(orig)
		return nil, nil
	}
	f := os.NewFile(uintptr(orig), "stderr")
	// Crashes still reach the terminal.
	_ = debug.SetCrashOutput(f, debug.CrashOptions{})
	return f, nil
}
