package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/topodra/topodra/pkg/sim"
)

func TestExampleWorkloadParses(t *testing.T) {
	w, err := sim.LoadWorkload("testdata/workload.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Templates) != 4 || len(w.Jobs) != 5 {
		t.Errorf("got %d templates and %d pods, want 4 and 5", len(w.Templates), len(w.Jobs))
	}
	if got := w.Ticks(); got != 4 {
		t.Errorf("workload spans %d ticks, want 4", got)
	}
}

// Bad flags fail before anything starts.
func TestBadFlags(t *testing.T) {
	tests := map[string]struct {
		args    []string
		wantErr string
	}{
		"unknown flag":         {args: []string{"--nodez", "3"}, wantErr: "flag provided but not defined"},
		"missing workload":     {args: []string{"--workload", "testdata/nope.yaml"}, wantErr: "no such file"},
		"stray argument":       {args: []string{"extra"}, wantErr: "unexpected arguments"},
		"missing stock config": {args: []string{"--stock-scheduler-config", "testdata/nope.yaml"}, wantErr: "no such file"},
		"rounds without seeds": {args: []string{"--rounds", "3"}, wantErr: "give --seeds"},
		"no rounds":            {args: []string{"--seeds", "1", "--rounds", "0"}, wantErr: "1 or more rounds"},
		"missing pool file":    {args: []string{"--pool", "testdata/nope.json"}, wantErr: "no such file"},
		"pool not a sweep":     {args: []string{"--pool", "testdata/workload.yaml"}, wantErr: "not a sweep report"},
		"pool and seeds":       {args: []string{"--pool", "a.json", "--seeds", "1"}, wantErr: "not both"},
		"unknown profile":      {args: []string{"--profile", "nonsense"}, wantErr: "nonsense"},
		"negative nodes":       {args: []string{"--nodes", "-1"}, wantErr: "nodes must not be negative"},
		"negative faults":      {args: []string{"--faults", "-1"}, wantErr: "faults must not be negative"},
		"unknown scheduler":    {args: []string{"--schedulers", "topodra,foo"}, wantErr: `unknown scheduler "foo"`},
		"unknown trace":        {args: []string{"--trace", "xyz"}, wantErr: `unknown trace "xyz"`},
		"misnamed profile":     {args: []string{"--scheduler-config", "testdata/misnamed-profile.yaml"}, wantErr: "no profile named topodra-scheduler"},
		"scenarios alone":      {args: []string{"--scenarios", "builtin-8"}, wantErr: "give --seeds too"},
		"report of a sweep":    {args: []string{"--seeds", "1", "--report", "x.html"}, wantErr: "--json"},
		"report into nowhere":  {args: []string{"--report", "testdata/no-such-dir/x.html"}, wantErr: "no directory testdata/no-such-dir"},
		"json into nowhere":    {args: []string{"--seeds", "1", "--json", "testdata/no-such-dir/x.json"}, wantErr: "no directory"},
		"too many seeds":       {args: []string{"--seeds", "1-4000000000"}, wantErr: `topodra-sim: --seeds "1-4000000000": 1-4000000000 is 4000000000 seeds; a sweep takes at most 10000`},
		"largest seed range":   {args: []string{"--seeds", "1-9223372036854775807"}, wantErr: "is 9223372036854775807 seeds; a sweep takes at most 10000"},
		"seeds over the cap":   {args: []string{"--seeds", "1-6000,10001-16000"}, wantErr: `--seeds "1-6000,10001-16000": 12000 seeds; a sweep takes at most 10000`},
		"unknown scenario":     {args: []string{"--seeds", "1", "--scenarios", "builtin-8,nope"}, wantErr: `--scenarios: unknown scenario "nope" (known: builtin-8, builtin-16, poisson-8, nic-match-8)`},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if code := run(tc.args, &stdout, &stderr); code != 2 {
				t.Errorf("exit code %d, want 2", code)
			}
			if !strings.Contains(stderr.String(), tc.wantErr) {
				t.Errorf("stderr %q does not say %q", stderr.String(), tc.wantErr)
			}
		})
	}
}

// An output the run could not write at its end is refused before it
// starts, and the check leaves nothing behind.
func TestUnwritableOutput(t *testing.T) {
	dir := t.TempDir()
	existing := filepath.Join(dir, "old.json")
	if err := os.WriteFile(existing, []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Each case has a second bad flag, refused before anything runs but
	// after the outputs are checked, so that no case runs the simulation.
	tests := map[string]struct {
		args    []string
		wantErr string
	}{
		"report into a directory":       {args: []string{"--report", dir, "--nodes", "-1"}, wantErr: "cannot write " + dir + ": it is a directory"},
		"json into a directory":         {args: []string{"--json", dir, "--nodes", "-1"}, wantErr: "cannot write " + dir + ": it is a directory"},
		"sweep's json into a directory": {args: []string{"--seeds", "1", "--scenarios", "nope", "--json", dir}, wantErr: "cannot write " + dir + ": it is a directory"},
		// A writable file passes the check, untouched: the second bad
		// flag is refused.
		"existing file": {args: []string{"--json", existing, "--nodes", "-1"}, wantErr: "nodes must not be negative"},
		"new file":      {args: []string{"--json", filepath.Join(dir, "new.json"), "--nodes", "-1"}, wantErr: "nodes must not be negative"},
	}
	if _, err := os.Stat("/proc/self"); err == nil {
		// No file can be created in /proc, not even by root.
		tests["new file where none can be created"] = struct {
			args    []string
			wantErr string
		}{args: []string{"--report", "/proc/out.html", "--nodes", "-1"}, wantErr: "cannot write /proc/out.html: "}
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if code := run(tc.args, &stdout, &stderr); code != 2 {
				t.Errorf("exit code %d, want 2", code)
			}
			if !strings.Contains(stderr.String(), tc.wantErr) {
				t.Errorf("stderr %q does not say %q", stderr.String(), tc.wantErr)
			}
		})
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 || entries[0].Name() != "old.json" {
		t.Errorf("the checks left %v behind, want only old.json", entries)
	}
	if data, err := os.ReadFile(existing); err != nil || string(data) != "kept" {
		t.Errorf("the existing file reads %q (%v), want it untouched", data, err)
	}
}

// One bad flag is one message.
func TestNegativeNodesOneMessage(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := run([]string{"--nodes", "-1"}, &stdout, &stderr); code != 2 {
		t.Errorf("exit code %d, want 2", code)
	}
	if got := stderr.String(); got != "topodra-sim: nodes must not be negative, got -1\nRun 'topodra-sim --help' for usage.\n" {
		t.Errorf("stderr %q, want the one message", got)
	}
}

func TestHelpExitsZero(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := run([]string{"--help"}, &stdout, &stderr); code != 0 {
		t.Errorf("--help: exit code %d, want 0", code)
	}
	if !strings.Contains(stderr.String(), "-seed") {
		t.Errorf("--help printed no usage: %q", stderr.String())
	}
}

// --pool prints the targets over the runs of all the reports it is given,
// and writes the pooled report with --json; reports that do not agree on
// the pods' requests are refused.
func TestPoolSweeps(t *testing.T) {
	dir := t.TempDir()
	sc := sim.Scenario{Name: "builtin-8", Profile: sim.DefaultProfile, Nodes: 8, Pods: 100, Trace: sim.TraceBuiltin}
	write := func(name, requests string, topodraWait, stockWait float64) string {
		rep := sim.SweepReport{Scenarios: []sim.Scenario{sc}, Seeds: []int64{1}, HostRequests: requests, Rows: []sim.SweepRow{
			{Scenario: sc.Name, Seed: 1, Scheduler: sim.SchedulerTopodra, MeanWait: map[int]float64{8: topodraWait}, Aligned: 0.97, Throughput: 50},
			{Scenario: sc.Name, Seed: 1, Scheduler: sim.SchedulerStock, MeanWait: map[int]float64{8: stockWait}, Aligned: 0.7, Throughput: 50},
		}}
		data, err := json.Marshal(rep)
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
		return path
	}
	a, b := write("a.json", "r", 2, 6), write("b.json", "r", 4, 10)
	out := filepath.Join(dir, "pooled.json")
	var stdout, stderr bytes.Buffer
	if code := run([]string{"--pool", a + "," + b, "--json", out}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit code %d: %s", code, stderr.String())
	}
	for _, want := range []string{"pooled 2 sweep reports: 4 runs", "seeds 1, 2 rounds", "over 2 runs per scheduler"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("output does not say %q:\n%s", want, stdout.String())
		}
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var pooled sim.SweepReport
	if err := json.Unmarshal(data, &pooled); err != nil {
		t.Fatal(err)
	}
	if pooled.Rounds != 2 || len(pooled.Rows) != 4 || len(pooled.Targets) == 0 {
		t.Errorf("pooled report: %d rounds, %d rows, %d targets; want 2, 4 and the targets", pooled.Rounds, len(pooled.Rows), len(pooled.Targets))
	}

	// The JSON of one run, and of nothing, are not sweeps.
	one, err := json.Marshal(sim.Report{Seed: 1, Workload: "built-in", Results: []sim.Result{{Scheduler: sim.SchedulerTopodra}}})
	if err != nil {
		t.Fatal(err)
	}
	single, empty := filepath.Join(dir, "single.json"), filepath.Join(dir, "empty.json")
	if err := os.WriteFile(single, one, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(empty, []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	for file, want := range map[string]string{
		single: single + ": not a sweep report: it is the report of one run (--json without --seeds); --pool takes the JSON files of sweeps (--seeds ... --json FILE)",
		empty:  empty + ": not a sweep report: it has no runs",
	} {
		stdout.Reset()
		stderr.Reset()
		if code := run([]string{"--pool", a + "," + file}, &stdout, &stderr); code != 2 || !strings.Contains(stderr.String(), want) {
			t.Errorf("--pool %s: exit code %d, stderr %q; want 2 and %q", filepath.Base(file), code, stderr.String(), want)
		}
	}

	c := write("c.json", "none", 1, 1)
	stdout.Reset()
	stderr.Reset()
	if code := run([]string{"--pool", a + "," + c}, &stdout, &stderr); code != 2 || !strings.Contains(stderr.String(), "requests") {
		t.Errorf("reports with different requests: exit code %d, stderr %q; want 2 and the reason", code, stderr.String())
	}
}

// Flags that would be ignored, or replaced by a default or by what runs,
// are refused before anything starts.
func TestFlagsThatDoNotApply(t *testing.T) {
	empty := filepath.Join(t.TempDir(), "empty.yaml")
	if err := os.WriteFile(empty, []byte("\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	const w = "testdata/workload.yaml"
	tests := map[string]struct {
		args    []string
		wantErr string
	}{
		"no pods":                        {args: []string{"--pods", "0"}, wantErr: "--pods 0: give 1 or more pods"},
		"no pods in a sweep":             {args: []string{"--seeds", "1", "--pods", "0"}, wantErr: "--pods 0: give 1 or more pods"},
		"seed 0":                         {args: []string{"--seed", "0"}, wantErr: "--seed 0: seeds start at 1"},
		"pool of nothing":                {args: []string{"--pool", ""}, wantErr: "--pool: empty; give a value or leave the flag out"},
		"pool of commas":                 {args: []string{"--pool", ","}, wantErr: `--pool ",": no files`},
		"seeds of nothing":               {args: []string{"--seeds", ""}, wantErr: "--seeds: empty"},
		"seeds of commas":                {args: []string{"--seeds", ","}, wantErr: `--seeds ",": no seeds; give seeds 1 or more, or ranges of them, comma-separated (e.g. 1-8)`},
		"schedulers of commas":           {args: []string{"--schedulers", ","}, wantErr: `--schedulers ",": no schedulers; give topodra, stock or both, comma-separated`},
		"schedulers of blanks":           {args: []string{"--schedulers", " , "}, wantErr: `--schedulers " , ": no schedulers`},
		"scenarios of commas":            {args: []string{"--seeds", "1", "--scenarios", ","}, wantErr: `--scenarios ",": no scenarios; give one or more of builtin-8, builtin-16, poisson-8, nic-match-8, comma-separated`},
		"empty values":                   {args: []string{"--profile", "", "--trace", ""}, wantErr: "--profile, --trace: empty"},
		"pool with run flags":            {args: []string{"--pool", "a.json", "--pods", "5", "--nodes", "2", "--json", "x.json"}, wantErr: "--nodes, --pods: not with --pool"},
		"empty scheduler config":         {args: []string{"--scheduler-config", empty}, wantErr: "--scheduler-config " + empty + ": the file is empty"},
		"empty stock scheduler config":   {args: []string{"--stock-scheduler-config", empty}, wantErr: "--stock-scheduler-config " + empty + ": the file is empty"},
		"topodra's config, no topodra":   {args: []string{"--schedulers", "stock", "--scheduler-config", empty}, wantErr: "--scheduler-config configures the topodra run"},
		"stock's config, no stock":       {args: []string{"--schedulers", "topodra", "--stock-scheduler-config", empty}, wantErr: "--stock-scheduler-config configures the stock run"},
		"workload and trace":             {args: []string{"--workload", w, "--trace", "poisson"}, wantErr: "--trace: not with --workload"},
		"workload and the default trace": {args: []string{"--workload", w, "--trace", "builtin"}, wantErr: "--trace: not with --workload"},
		"workload and pods":              {args: []string{"--workload", w, "--pods", "10"}, wantErr: "--pods: not with --workload"},
		"workload and host requests":     {args: []string{"--workload", w, "--host-requests=false"}, wantErr: "--host-requests: not with --workload"},
		"workload and seed":              {args: []string{"--workload", w, "--seed", "3"}, wantErr: "--seed: not with --workload"},
		"workload and pin":               {args: []string{"--workload", w, "--pin"}, wantErr: "--pin: not with --workload"},
		"sweep and machines":             {args: []string{"--seeds", "1", "--profile", "dgx-h100", "--nodes", "4"}, wantErr: "--profile, --nodes: not with --seeds"},
		"sweep and trace":                {args: []string{"--seeds", "1", "--trace", "poisson"}, wantErr: "--trace: not with --seeds"},
		"sweep and seed":                 {args: []string{"--seeds", "1-2", "--seed", "3"}, wantErr: "--seed: not with --seeds"},
		"sweep and checkpoints":          {args: []string{"--seeds", "1", "--checkpoints", "2"}, wantErr: "--checkpoints: not with --seeds"},
		"sweep and workload":             {args: []string{"--seeds", "1", "--workload", w}, wantErr: "--workload: not with --seeds"},
		"sweep and pin":                  {args: []string{"--seeds", "1", "--pin"}, wantErr: "--pin: not with --seeds"},
		"one round without seeds":        {args: []string{"--rounds", "1"}, wantErr: "give --seeds"},
		"verbosity without a log file":   {args: []string{"-v", "4"}, wantErr: "-v is the verbosity of the logs in --log-file"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var stderr bytes.Buffer
			c, err := parse(tc.args, &stderr)
			if err == nil {
				t.Fatalf("parsed into %+v, want an error saying %q", c, tc.wantErr)
			}
			if !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("error %q does not say %q", err, tc.wantErr)
			}
		})
	}
}

// simulatorCommand finds the arguments of "go run ./cmd/simulator ..." in
// documentation, up to the end of the line, a closing backquote or a
// comment.
var simulatorCommand = regexp.MustCompile("go run \\./cmd/simulator((?: +[^ `#\\n]+)*)")

// The commands of the README, the documents in docs/ and the Makefile's demo
// and placement targets parse.
func TestDocumentedCommands(t *testing.T) {
	out := t.TempDir()
	makefile, err := os.ReadFile("../../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	expand := strings.NewReplacer("$(PLACEMENT_SEEDS)", "1-8", "$(PLACEMENT_ROUNDS)", "3",
		"$(or $(PLACEMENT_OUT),_out/placement.json)", filepath.Join(out, "placement.json"), "$(PLACEMENT_ARGS)", "", "$(DEMO_ARGS)", "")
	commands := map[string][]string{}
	for _, line := range strings.Split(string(makefile), "\n") {
		if _, args, ok := strings.Cut(line, "$(GO) run ./cmd/simulator"); ok {
			if args = expand.Replace(args); strings.Contains(args, "$(") {
				t.Fatalf("Makefile: cannot expand %q", args)
			}
			commands["Makefile:"+strings.TrimSpace(line)] = strings.Fields(args)
		}
	}
	docs, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, doc := range append([]string{"../../README.md"}, docs...) {
		data, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range simulatorCommand.FindAllStringSubmatch(string(data), -1) {
			commands[filepath.Base(doc)+": "+m[0]] = strings.Fields(m[1])
		}
	}
	if len(commands) < 10 {
		t.Fatalf("found %d documented commands, want the README's and the Makefile's", len(commands))
	}
	// The documents' paths are relative to the repository's root.
	t.Chdir("../..")
	for name, args := range commands {
		t.Logf("%s: %q", name, args)
		var stderr bytes.Buffer
		if _, err := parse(args, &stderr); err != nil {
			t.Errorf("%s: %v %s", name, err, stderr.String())
		}
	}
}
