package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/topodra/topodra/pkg/sim"
)

// replayRun is a run of one node of four GPUs in two NUMA nodes and a
// NIC: "pair" (2 GPUs and the NIC) runs from tick 0 for 2 ticks; "four"
// arrives at tick 1 and waits until the pair leaves at the start of tick
// 2.
const replayRun = `{"seed": 1, "workload": "built-in", "profile": "p", "pods": 2, "ticks": 3,
"nodes": [{"node": "n", "profile": "p", "devices": [
	{"name": "gpu-0", "gpu": true, "numaNode": "0"}, {"name": "gpu-1", "gpu": true, "numaNode": "0"},
	{"name": "nic-0", "gpu": false, "numaNode": "0"},
	{"name": "gpu-2", "gpu": true, "numaNode": "1"}, {"name": "gpu-3", "gpu": true, "numaNode": "1"}]}],
"results": [{"scheduler": "topodra", "placements": [
	{"pod": "pair", "node": "n", "tick": 0, "gpus": ["gpu-0", "gpu-1"], "nics": ["nic-0"]},
	{"pod": "four", "node": "n", "tick": 2, "gpus": ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]}]}]}`

// replayFixture returns replayRun and its jobs.
func replayFixture(t *testing.T) (runJSON, []job) {
	t.Helper()
	var rep runJSON
	if err := json.Unmarshal([]byte(replayRun), &rep); err != nil {
		t.Fatal(err)
	}
	return rep, []job{{name: "pair", arrival: 0, life: 2, gpus: 2}, {name: "four", arrival: 1, life: 0, gpus: 4}}
}

func TestReplay(t *testing.T) {
	// The node's free NICs follow its GPUs.
	rep, jobs := replayFixture(t)

	var out bytes.Buffer
	if err := replay(&out, rep, jobs, options{to: -1, all: true}); err != nil {
		t.Fatal(err)
	}
	want := `== topodra
nodes: 0 n (p)
tick 0
  waiting at start: 
  placed: pair -> n [gpu-0 gpu-1] (arrived 0)
  at end: 0:22|../0n
tick 1
  waiting at start: 
  placed: 
  at end: 0:22|../0n
tick 2
  waiting at start: four (4 GPUs, since 1)
  placed: four -> n [gpu-0 gpu-1 gpu-2 gpu-3] (arrived 1)
  at end: 0:44|44/1n
`
	if out.String() != want {
		t.Errorf("replay printed\n%s\nwant\n%s", out.String(), want)
	}

	out.Reset()
	if err := replay(&out, rep, jobs, options{to: -1}); err != nil {
		t.Fatal(err)
	}
	if got := bytes.Count(out.Bytes(), []byte("tick ")); got != 1 {
		t.Errorf("without --all: %d ticks printed, want 1 (the one at which a pod waits):\n%s", got, out.String())
	}

	rep.Results[0].Placements[1].Pod = "stranger"
	if err := replay(&out, rep, jobs, options{to: -1}); err == nil {
		t.Error("a placement of a pod that is not in the workload: no error")
	}
}

func TestJobsOfBuiltinWorkload(t *testing.T) {
	specs, err := sim.PlanNodes(sim.DefaultProfile, 8)
	if err != nil {
		t.Fatal(err)
	}
	w, err := sim.GenerateTrace(sim.TraceBuiltin, 1, 160, specs)
	if err != nil {
		t.Fatal(err)
	}
	jobs := jobsOf(w)
	sizes := map[int]int{}
	for _, j := range jobs {
		sizes[j.gpus]++
		// The built-in workload names pods after their size.
		if strings.Contains(j.name, "-8g-") && j.gpus != 8 || strings.Contains(j.name, "-1g-") && j.gpus != 1 {
			t.Errorf("job %s: %d GPUs", j.name, j.gpus)
		}
	}
	for _, g := range []int{1, 2, 4, 8} {
		if sizes[g] == 0 {
			t.Errorf("no job of %d GPUs in the built-in workload (sizes %v)", g, sizes)
		}
	}
}

func TestWhy(t *testing.T) {
	// The run of TestReplay: "four" arrives at tick 1, when the pair holds
	// two of the node's four GPUs.
	rep, jobs := replayFixture(t)
	var out bytes.Buffer
	if err := replay(&out, rep, jobs, options{to: -1, why: true}); err != nil {
		t.Fatal(err)
	}
	if want := "  4 GPU: fewer GPUs free than it asks 1\n"; !strings.HasSuffix(out.String(), want) || strings.Contains(out.String(), "\ntick ") {
		t.Errorf("--why printed\n%s\nwant it to end in\n%s(and no ticks)", out.String(), want)
	}

	for _, tc := range []struct {
		name  string
		job   job
		nodes []free
		roots [][]free
		want  string
	}{
		{"nothing free", job{gpus: 1}, []free{{0, 2}, {0, 0}}, nil, "cluster full"},
		{"too few free", job{gpus: 4}, []free{{1, 0}, {2, 0}}, nil, "fewer GPUs free than it asks"},
		{"scattered", job{gpus: 2}, []free{{1, 0}, {1, 0}}, nil, "free GPUs only scattered"},
		{"GPUs where no NIC is free", job{gpus: 1, nics: 1}, []free{{3, 0}, {0, 2}}, nil, "no node with its GPUs and NICs"},
		{"fits by count", job{gpus: 1, nics: 1}, []free{{3, 0}, {1, 1}}, [][]free{nil, {{1, 0}, {0, 1}}}, "fits by count on a node"},
		{"no root with both", job{gpus: 1, nics: 1, sameRoot: true}, []free{{3, 0}, {1, 1}}, [][]free{nil, {{1, 0}, {0, 1}}}, "no PCIe root with its GPUs and NICs"},
		{"a root with both", job{gpus: 1, nics: 1, sameRoot: true}, []free{{3, 0}, {2, 1}}, [][]free{nil, {{1, 0}, {1, 1}}}, "fits by count on a node"},
	} {
		roots := tc.roots
		if roots == nil {
			roots = make([][]free, len(tc.nodes))
		}
		if got := cause(tc.job, tc.nodes, roots); got != tc.want {
			t.Errorf("%s: cause %q, want %q", tc.name, got, tc.want)
		}
	}
}
