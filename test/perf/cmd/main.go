// Command perf runs topodra's benchmark: every workload through
// topodra-scheduler and the stock kube-scheduler on an in-process control
// plane, and prints a markdown table with the ratio topodra/stock.
//
//	go run ./test/perf/cmd [--short] [--out FILE.json] [--run REGEXP]
//	    [--schedulers topodra,stock] [--cpuprofile-dir DIR] [--log-file FILE]
//
// `make bench` and `make bench-short` call it.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"regexp"
	"strings"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/cluster"
	"github.com/topodra/topodra/test/perf"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("perf", flag.ContinueOnError)
	fs.SetOutput(stderr)
	short := fs.Bool("short", false, "scaled-down set: 50 nodes, 5 s steady state")
	nodes := fs.Int("nodes", 0, "nodes per workload (default 500, or 50 with --short)")
	steady := fs.Duration("steady-duration", 0, "steady-state duration (default 10s, or 5s with --short)")
	steadyRounds := fs.Int("steady-rounds", 0, "runs per scheduler of each steady-state workload, alternating which scheduler goes first; reported together (default 2, or 1 with --short)")
	out := fs.String("out", "", "write the results as a JSON array to this file")
	runRE := fs.String("run", "", "only workloads whose name matches this regular expression")
	schedulers := fs.String("schedulers", "topodra,stock", "schedulers to run, in order")
	cpuProfileDir := fs.String("cpuprofile-dir", "", "write the CPU profile of each measured run here as <workload>-<scheduler>.pprof (the scheduler's goroutines carry the pprof label scheduler=topodra|stock)")
	topodraConfig := fs.String("topodra-config", "", "KubeSchedulerConfiguration for topodra instead of config/scheduler-config.yaml (profile topodra-scheduler)")
	logFile := fs.String("log-file", "", "write component logs here; by default they are discarded")
	verbosity := fs.Int("v", 0, "log verbosity for --log-file")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *nodes == 0 {
		*nodes = 500
		if *short {
			*nodes = 50
		}
	}
	if *steady == 0 {
		*steady = 10 * time.Second
		if *short {
			*steady = 5 * time.Second
		}
	}
	if *steadyRounds <= 0 {
		*steadyRounds = 2
		if *short {
			*steadyRounds = 1
		}
	}
	var re *regexp.Regexp
	if *runRE != "" {
		var err error
		if re, err = regexp.Compile(*runRE); err != nil {
			fmt.Fprintf(stderr, "--run: %v\n", err)
			return 2
		}
	}
	if err := cluster.SetUpLogging(*logFile, *verbosity); err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	defer klog.Flush()
	if *cpuProfileDir != "" {
		if err := os.MkdirAll(*cpuProfileDir, 0o755); err != nil {
			fmt.Fprintln(stderr, err)
			return 2
		}
	}

	var topodraCfg []byte
	if *topodraConfig != "" {
		var err error
		if topodraCfg, err = os.ReadFile(*topodraConfig); err != nil {
			fmt.Fprintln(stderr, err)
			return 2
		}
	}

	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	opts := perf.Options{
		Schedulers: strings.Split(*schedulers, ","),
		Progress:   stderr,
		Logger:     klog.Background(),

		CPUProfileDir: *cpuProfileDir,
		SteadyRounds:  *steadyRounds,
		TopodraConfig: topodraCfg,
	}
	start := time.Now()
	var results []perf.Result
	code := 0
	for _, w := range perf.Workloads(*nodes, *steady) {
		if re != nil && !re.MatchString(w.Name) {
			continue
		}
		res, err := perf.RunWorkload(ctx, opts, w)
		results = append(results, res...)
		if err != nil {
			fmt.Fprintf(stderr, "perf: %v\n", err)
			code = 1
			if ctx.Err() != nil {
				break
			}
		}
	}
	fmt.Fprintln(stdout)
	if err := perf.WriteTable(stdout, results); err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	_, peak := procPeakRSS()
	fmt.Fprintf(stdout, "\n%d nodes per workload; total wall time %.0fs; process peak RSS %.0f MiB\n", *nodes, time.Since(start).Seconds(), peak)
	if *out != "" {
		f, err := os.Create(*out)
		if err != nil {
			fmt.Fprintln(stderr, err)
			return 1
		}
		if err := perf.WriteJSON(f, results); err != nil {
			_ = f.Close()
			fmt.Fprintln(stderr, err)
			return 1
		}
		if err := f.Close(); err != nil {
			fmt.Fprintln(stderr, err)
			return 1
		}
		fmt.Fprintf(stdout, "json: %s\n", *out)
	}
	return code
}

func procPeakRSS() (float64, float64) { return perf.ProcessRSSMB() }
