// Command topodra-sim runs a simulated GPU cluster in process (embedded etcd,
// kube-apiserver, the ResourceClaim controller, node agents on mock machines
// publishing real ResourceSlices) and the same seeded workload through
// topodra-scheduler and, on a fresh identical cluster, the stock
// kube-scheduler; then it prints where every GPU went, side by side.
//
//	go run ./cmd/simulator [--nodes 8] [--profile dgx-h100=6,pcie-nvlink-pairs=2]
//	    [--pods 160] [--seed 1] [--schedulers topodra,stock]
//	    [--trace builtin|poisson|nic-match|urgent]
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
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
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
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/cluster"
	"github.com/topodra/topodra/pkg/sim"
	"github.com/topodra/topodra/pkg/version"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// command is what a command line asks for, checked: one run, a sweep
// (seeds set) or the pooling of sweeps already run (pool set).
type command struct {
	// opts are the options of one run, and the base of a sweep's runs.
	opts       sim.Options
	reportPath string
	jsonPath   string
	logFile    string
	verbosity  int
	// seeds, scenarios and rounds make a sweep; each scenario has its
	// pod count from --pods where that was given.
	seeds     []int64
	scenarios []sim.Scenario
	rounds    int
	// pool lists the sweep reports to join.
	pool []string
}

// errPrinted is a command line error whose message the flag package has
// printed already.
var errPrinted = errors.New("bad command line")

// exclusions are the flags that do not apply beside a flag that decides
// what runs, and why.
var exclusions = []struct {
	flag   string
	others []string
	why    string
}{
	{"seeds", []string{"profile", "nodes", "trace", "seed", "workload", "pin", "checkpoints"},
		"a sweep runs each scenario's machines and generated workload with each seed (--scenarios picks the scenarios, --pods sizes their workloads) and keeps no snapshots"},
	{"workload", []string{"trace", "pods", "seed", "host-requests", "pin"},
		"the pods are those of the file; these shape the generated workload"},
}

// parse reads and checks a command line; nothing starts. Flags that do
// not apply to what runs, and values that would be replaced by a default,
// are refused rather than ignored. The error is flag.ErrHelp after --help,
// errPrinted where the flag package has said what is wrong.
func parse(args []string, stderr io.Writer) (*command, error) {
	fs := flag.NewFlagSet("topodra-sim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		c          command
		schedulers string
		workload   string
		schedCfg   string
		stockCfg   string
		seeds      string
		scenarios  string
		pool       string
	)
	opts := &c.opts
	fs.IntVar(&opts.Nodes, "nodes", 0, "number of simulated nodes; 0: the sum of the --profile mix, or 8 for a single profile")
	fs.StringVar(&opts.Profile, "profile", sim.DefaultProfile, "machine profile, or a mix like dgx-h100=6,pcie-nvlink-pairs=2 (profiles: dgx-h100, pcie-nvlink-pairs, workstation-2gpu); a mix is scaled to --nodes")
	fs.IntVar(&opts.Pods, "pods", 160, "number of pods of the generated workload, 1 or more (with --seeds: of every scenario's, instead of its own)")
	fs.Int64Var(&opts.Seed, "seed", 1, "seed of the generated workload, 1 or more")
	fs.StringVar(&schedulers, "schedulers", "topodra,stock", "schedulers to compare, in order: topodra, stock")
	fs.StringVar(&workload, "workload", "", "Kubernetes YAML with Pods, ResourceClaimTemplates and PriorityClasses to run instead of a generated workload (pod annotations "+sim.AnnotationArrival+" and "+sim.AnnotationLifetime+", in ticks); --trace, --pods, --seed, --host-requests and --pin do not apply")
	fs.StringVar(&opts.Trace, "trace", sim.TraceBuiltin, "generated workload: builtin, poisson (Poisson arrivals, lifetimes that grow with size) nic-match (also GPU+NIC pods with a hard matchAttribute on pcieRoot), or urgent (like poisson, a quarter of the 4- and 8-GPU jobs of a higher priority, which may preempt the others)")
	fs.StringVar(&seeds, "seeds", "", "run a sweep over these seeds (e.g. 1-8; at most "+strconv.Itoa(maxSeeds)+") and the scenarios, and print medians against the placement targets; each scenario has its own machines and workload, so --profile, --nodes, --trace, --seed, --workload, --pin and --checkpoints do not apply")
	fs.StringVar(&scenarios, "scenarios", "", "with --seeds: the scenarios to run, comma-separated (default all: builtin-8, builtin-16, poisson-8, nic-match-8)")
	fs.IntVar(&c.rounds, "rounds", 1, "with --seeds: run every scenario and seed this many times; the medians and targets are taken over all the runs")
	fs.StringVar(&pool, "pool", "", "instead of running: comma-separated JSON files written by --seeds --json (of the same build and configuration: the summary warns where their recorded builds or scheduler configurations differ); print the medians and targets over all their runs together (with --json, write that report; no other flag applies)")
	hostRequests := fs.Bool("host-requests", true, "the generated pods request "+sim.HostRequestsText+", as GPU pods do (the nodes have 256 CPUs and 2 TiB); false: no CPU or memory requests, which leaves the stock scheduler's node scores equal, so it takes the first feasible node")
	fs.BoolVar(&opts.Pin, "pin", false, "pin every pod of the built-in workload to a node (by the seed), so that only device choice differs")
	fs.IntVar(&opts.WarmUpPods, "warm-up-pods", sim.DefaultWarmUpPods, "pods of an unmeasured run through each scheduler before the measured ones (once per sweep), so that neither pays for being the first of the process; 0 or less: no warm-up")
	fs.IntVar(&opts.Faults, "faults", 0, "faults to inject into each measured run: restarts of the scheduler and of a node's agent, a critical XID on a GPU (tainted unhealthy to the end of the run) and a restart of the kube-apiserver in turn, each while the scheduler places the pods of a tick chosen by the seed (the same for both schedulers); the invariant checker, the stuck pods and the allocations of tainted GPUs say whether a run survived them")
	fs.IntVar(&opts.Checkpoints, "checkpoints", 3, "intermediate snapshots of the device maps in the report; 0 or less: none")
	fs.StringVar(&c.reportPath, "report", "", "write a self-contained HTML report to this file")
	fs.StringVar(&c.jsonPath, "json", "", "write the full results as JSON to this file")
	fs.StringVar(&stockCfg, "stock-scheduler-config", "", "KubeSchedulerConfiguration for the stock run instead of the default one (its profile must be named default-scheduler), e.g. a bin-packing NodeResourcesFit")
	fs.StringVar(&schedCfg, "scheduler-config", "", "KubeSchedulerConfiguration for the topodra run instead of the embedded config/scheduler-config.yaml (its profile must be named topodra-scheduler)")
	fs.StringVar(&c.logFile, "log-file", "", "write component logs (apiserver, schedulers, agents) to this file; by default they are discarded")
	fs.IntVar(&c.verbosity, "v", 0, "log verbosity for --log-file")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		return nil, errPrinted
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	set := map[string]bool{}
	var empty []string
	fs.Visit(func(f *flag.Flag) {
		set[f.Name] = true
		if f.Value.String() == "" {
			empty = append(empty, "--"+f.Name)
		}
	})
	// An empty value would mean the flag's default, or nothing to do.
	if len(empty) > 0 {
		return nil, fmt.Errorf("%s: empty; give a value or leave the flag out", strings.Join(empty, ", "))
	}
	if err := checkCombination(set, &c, schedulers); err != nil {
		return nil, err
	}
	for _, path := range []string{c.reportPath, c.jsonPath} {
		if path == "" {
			continue
		}
		if err := checkOutput(path); err != nil {
			return nil, err
		}
	}
	if set["pool"] {
		if c.pool = sim.ParseSchedulers(pool); len(c.pool) == 0 {
			return nil, fmt.Errorf("--pool %q: no files", pool)
		}
		return &c, nil
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
			return nil, err
		}
		opts.Workload = w
		opts.WorkloadName = workload
	}
	for _, f := range []struct {
		flag, path string
		into       *[]byte
	}{{"--scheduler-config", schedCfg, &opts.SchedulerConfig}, {"--stock-scheduler-config", stockCfg, &opts.StockSchedulerConfig}} {
		if f.path == "" {
			continue
		}
		data, err := os.ReadFile(f.path)
		if err != nil {
			return nil, err
		}
		if len(bytes.TrimSpace(data)) == 0 {
			return nil, fmt.Errorf("%s %s: the file is empty; leave the flag out for the default configuration", f.flag, f.path)
		}
		*f.into = data
	}
	if seeds == "" {
		if err := opts.Check(); err != nil {
			return nil, err
		}
		return &c, nil
	}
	return &c, c.planSweep(seeds, scenarios, set["pods"])
}

// checkCombination refuses flags that would be ignored or replaced by what
// runs: flags beside --pool other than --json, flags that a sweep or a
// workload file replaces (exclusions), sweep flags without --seeds, a
// scheduler's configuration without that scheduler, -v without
// --log-file, and --pods or --seed 0, or a --schedulers list of no
// names, which would mean their defaults.
func checkCombination(set map[string]bool, c *command, schedulersFlag string) error {
	if set["pool"] {
		if set["seeds"] {
			return errors.New("--pool joins sweeps already run: give it or --seeds, not both")
		}
		var others []string
		for name := range set {
			if name != "pool" && name != "json" {
				others = append(others, "--"+name)
			}
		}
		if len(others) > 0 {
			slices.Sort(others)
			return fmt.Errorf("%s: not with --pool, which joins sweeps already run (only --json applies)", strings.Join(others, ", "))
		}
		return nil
	}
	schedulers := sim.ParseSchedulers(schedulersFlag)
	if set["schedulers"] && len(schedulers) == 0 {
		return fmt.Errorf("--schedulers %q: no schedulers; give %s, %s or both, comma-separated", schedulersFlag, sim.SchedulerTopodra, sim.SchedulerStock)
	}
	if set["rounds"] && (c.rounds < 1 || !set["seeds"]) {
		return fmt.Errorf("--rounds %d: give --seeds and 1 or more rounds", c.rounds)
	}
	if set["scenarios"] && !set["seeds"] {
		return errors.New("--scenarios chooses the scenarios of a sweep: give --seeds too")
	}
	if set["report"] && set["seeds"] {
		return errors.New("--report is the report of one run; a sweep writes its runs with --json")
	}
	for _, ex := range exclusions {
		if !set[ex.flag] {
			continue
		}
		var others []string
		for _, o := range ex.others {
			if set[o] {
				others = append(others, "--"+o)
			}
		}
		if len(others) > 0 {
			return fmt.Errorf("%s: not with --%s: %s", strings.Join(others, ", "), ex.flag, ex.why)
		}
	}
	if set["scheduler-config"] && !slices.Contains(schedulers, sim.SchedulerTopodra) {
		return errors.New("--scheduler-config configures the topodra run, and --schedulers has none")
	}
	if set["stock-scheduler-config"] && !slices.Contains(schedulers, sim.SchedulerStock) {
		return errors.New("--stock-scheduler-config configures the stock run, and --schedulers has none")
	}
	if set["v"] && !set["log-file"] {
		return errors.New("-v is the verbosity of the logs in --log-file: give --log-file too")
	}
	if set["pods"] && c.opts.Pods == 0 {
		return errors.New("--pods 0: give 1 or more pods")
	}
	if set["seed"] && c.opts.Seed < 1 {
		return fmt.Errorf("--seed %d: seeds start at 1", c.opts.Seed)
	}
	return nil
}

// maxSeeds is the most seeds a sweep takes: each one is a run of every
// scenario through each scheduler.
const maxSeeds = 10000

// planSweep sets the sweep's seeds and scenarios, with withPods the pod
// count of every scenario's workload, and checks each scenario's options.
func (c *command) planSweep(seeds, scenarios string, withPods bool) error {
	if err := checkSeeds(seeds); err != nil {
		return err
	}
	var err error
	if c.seeds, err = sim.ParseSeeds(seeds); err != nil {
		return err
	}
	all := sim.DefaultScenarios()
	c.scenarios = all
	if scenarios != "" {
		names := sim.ParseSchedulers(scenarios)
		if len(names) == 0 {
			return fmt.Errorf("--scenarios %q: no scenarios; give one or more of %s, comma-separated", scenarios, scenarioNames(all))
		}
		c.scenarios = nil
		for _, name := range names {
			i := slices.IndexFunc(all, func(sc sim.Scenario) bool { return sc.Name == name })
			if i < 0 {
				return fmt.Errorf("--scenarios: unknown scenario %q (known: %s)", name, scenarioNames(all))
			}
			c.scenarios = append(c.scenarios, all[i])
		}
	}
	if withPods {
		for i := range c.scenarios {
			c.scenarios[i].Pods = c.opts.Pods
		}
	}
	base := c.opts
	for _, sc := range c.scenarios {
		base.Profile, base.Nodes, base.Pods, base.Trace = sc.Profile, sc.Nodes, sc.Pods, sc.Trace
		if err := base.Check(); err != nil {
			return fmt.Errorf("scenario %s: %w", sc.Name, err)
		}
	}
	return nil
}

// scenarioNames lists the names of scenarios, comma-separated.
func scenarioNames(scenarios []sim.Scenario) string {
	names := make([]string, len(scenarios))
	for i, sc := range scenarios {
		names[i] = sc.Name
	}
	return strings.Join(names, ", ")
}

// checkSeeds refuses, before sim.ParseSeeds expands it, a --seeds value
// of no seeds or of more than maxSeeds: it counts the seeds of the ranges
// (and single seeds) that parse, and leaves what does not parse to
// sim.ParseSeeds to refuse.
func checkSeeds(seeds string) error {
	if len(sim.ParseSchedulers(seeds)) == 0 {
		return fmt.Errorf("--seeds %q: no seeds; give seeds 1 or more, or ranges of them, comma-separated (e.g. 1-8)", seeds)
	}
	var total int64
	for _, part := range strings.Split(seeds, ",") {
		lo, hi, isRange := strings.Cut(strings.TrimSpace(part), "-")
		a, err := strconv.ParseInt(strings.TrimSpace(lo), 10, 64)
		if err != nil || a < 1 {
			continue
		}
		b := a
		if isRange {
			if b, err = strconv.ParseInt(strings.TrimSpace(hi), 10, 64); err != nil || b < a {
				continue
			}
		}
		// b-a+1 cannot overflow, a being 1 or more.
		n := b - a + 1
		if n > maxSeeds {
			return fmt.Errorf("--seeds %q: %s is %d seeds; a sweep takes at most %d", seeds, strings.TrimSpace(part), n, maxSeeds)
		}
		total += n
	}
	if total > maxSeeds {
		return fmt.Errorf("--seeds %q: %d seeds; a sweep takes at most %d", seeds, total, maxSeeds)
	}
	return nil
}

func run(args []string, stdout, stderr io.Writer) int {
	c, err := parse(args, stderr)
	switch {
	case errors.Is(err, flag.ErrHelp):
		return 0 // --help printed the usage, as asked
	case errors.Is(err, errPrinted):
		return 2
	case err != nil:
		fmt.Fprintf(stderr, "topodra-sim: %v\nRun 'topodra-sim --help' for usage.\n", err)
		return 2
	}
	if c.pool != nil {
		return poolSweeps(c.pool, c.jsonPath, stdout, stderr)
	}
	if err := cluster.SetUpLogging(c.logFile, c.verbosity); err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	defer klog.Flush() //nolint:logcheck // the log file is the process's; flushed once at exit
	progress, err := quietStderr(c.logFile)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	if progress != nil && stderr == os.Stderr {
		stderr = progress
	}
	c.opts.Progress = stderr

	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	start := time.Now()
	if c.seeds != nil {
		return sweep(ctx, c, stdout, stderr)
	}
	report, err := sim.Run(ctx, c.opts)
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
	if c.reportPath != "" {
		if err := writeFile(c.reportPath, report.WriteHTML); err != nil {
			fmt.Fprintln(stderr, err)
			return 1
		}
		fmt.Fprintf(stdout, "report: %s\n", c.reportPath)
	}
	if c.jsonPath != "" {
		if err := writeJSON(c.jsonPath, report); err != nil {
			fmt.Fprintln(stderr, err)
			return 1
		}
		fmt.Fprintf(stdout, "json: %s\n", c.jsonPath)
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

// sweep runs the multi-seed sweep of c.
func sweep(ctx context.Context, c *command, stdout, stderr io.Writer) int {
	start := time.Now()
	rep, err := sim.Sweep(ctx, sim.SweepOptions{Seeds: c.seeds, Scenarios: c.scenarios, Rounds: c.rounds, Base: c.opts, Rows: stdout, Build: buildID()})
	if err != nil {
		if rep != nil && c.jsonPath != "" {
			// The runs before the failure are kept, marked incomplete.
			if werr := writeJSON(c.jsonPath, rep); werr != nil {
				fmt.Fprintln(stderr, werr)
			} else {
				fmt.Fprintf(stderr, "json of the %d rows before the failure (incomplete): %s\n", len(rep.Rows), c.jsonPath)
			}
		}
		return failed(ctx, err, stderr)
	}
	fmt.Fprintln(stdout)
	return writeSweep(rep, c.jsonPath, start, stdout, stderr)
}

// buildID names this program's build for the sweep's report: the version,
// the commit where the build recorded it (-buildvcs), and the SHA-256 of
// the executable (the same source built in the same place with the same
// toolchain gives the same executable), so that --pool can tell reports of
// different builds apart. Parts that cannot be read are left out.
func buildID() string {
	id := version.Version
	if info, ok := debug.ReadBuildInfo(); ok {
		var revision, modified string
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				revision = s.Value
			case "vcs.modified":
				modified = s.Value
			}
		}
		if revision != "" {
			id += "+" + revision[:min(12, len(revision))]
			if modified == "true" {
				id += "-dirty"
			}
		}
	}
	exe, err := os.Executable()
	if err != nil {
		return id
	}
	f, err := os.Open(exe)
	if err != nil {
		return id
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return id
	}
	return id + " sha256:" + hex.EncodeToString(h.Sum(nil)[:6])
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
