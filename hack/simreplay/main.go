// Command simreplay replays a simulator run tick by tick from its JSON
// (go run ./cmd/simulator --json run.json): for every tick at which a pod
// waits, each node's GPUs (the size of the pod on each GPU, "." when free,
// "|" between NUMA nodes; "/4n": four NICs free, on nodes that have NICs)
// at the start of the tick, the waiting pods, the pods placed in the tick
// and the GPUs at its end. It shows what one run's
// numbers hide: which node a whole-node pod waited for and who took the
// devices meanwhile.
//
//	go run ./cmd/simulator --json run.json
//	go run ./hack/simreplay run.json
//	go run ./hack/simreplay --scheduler topodra --from 20 --to 40 run.json
//	go run ./hack/simreplay --why run.json   # why pods waited, by size
//
// The workload is generated again from the run's seed, pod count and
// trace (or read from --workload for runs of a workload file), so the
// JSON must come from the same version of the simulator.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"

	"github.com/topodra/topodra/pkg/sim"
)

func main() {
	scheduler := flag.String("scheduler", "", "only this scheduler's run (topodra or stock; default all)")
	from := flag.Int("from", 0, "first tick to print")
	to := flag.Int("to", -1, "last tick to print (default the last)")
	all := flag.Bool("all", false, "print every tick, not only those at which a pod waits")
	workloadFile := flag.String("workload", "", "the workload file of a run of --workload")
	why := flag.Bool("why", false, "instead of the ticks, count the pods that waited by size and by what the cluster lacked at the end of the tick they arrived in")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: simreplay [flags] RUN.json")
		os.Exit(2)
	}
	if err := run(flag.Arg(0), *workloadFile, options{scheduler: *scheduler, from: *from, to: *to, all: *all, why: *why}); err != nil {
		fmt.Fprintln(os.Stderr, "simreplay:", err)
		os.Exit(1)
	}
}

func run(path, workloadFile string, o options) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var rep runJSON
	if err := json.Unmarshal(data, &rep); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if len(rep.Results) == 0 {
		return fmt.Errorf("%s: no results (a sweep's JSON has no placements; replay a single run)", path)
	}
	var w *sim.Workload
	switch {
	case workloadFile != "":
		w, err = sim.LoadWorkload(workloadFile)
	case rep.Workload == "built-in":
		w, err = generate(sim.TraceBuiltin, rep)
	default:
		w, err = generate(rep.Workload, rep)
	}
	if err != nil {
		return err
	}
	return replay(os.Stdout, rep, jobsOf(w), o)
}

func generate(trace string, rep runJSON) (*sim.Workload, error) {
	specs, err := sim.PlanNodes(rep.Profile, len(rep.Nodes))
	if err != nil {
		return nil, err
	}
	w, err := sim.GenerateTrace(trace, rep.Seed, rep.Pods, specs)
	if err != nil {
		return nil, fmt.Errorf("workload %q: %w (a run of a workload file needs --workload)", rep.Workload, err)
	}
	return w, nil
}
