package main

import (
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/topodra/topodra/pkg/measure"
	"github.com/topodra/topodra/pkg/sim"
	"github.com/topodra/topodra/pkg/topology"
)

// runJSON is the part of a simulator run's JSON that the replay reads.
type runJSON struct {
	Seed     int64  `json:"seed"`
	Workload string `json:"workload"`
	Profile  string `json:"profile"`
	Pods     int    `json:"pods"`
	Ticks    int    `json:"ticks"`
	Nodes    []struct {
		Node    string `json:"node"`
		Profile string `json:"profile"`
		Devices []struct {
			Name string `json:"name"`
			GPU  bool   `json:"gpu"`
			NUMA string `json:"numaNode"`
			Root string `json:"pcieRoot"`
		} `json:"devices"`
	} `json:"nodes"`
	Results []struct {
		Scheduler  string `json:"scheduler"`
		Placements []struct {
			Pod  string   `json:"pod"`
			Node string   `json:"node"`
			Tick int      `json:"tick"`
			GPUs []string `json:"gpus"`
			NICs []string `json:"nics"`
		} `json:"placements"`
	} `json:"results"`
}

// job is what the replay needs of a pod: when it arrives, how long it
// runs once bound (0: to the end), how many GPUs and NICs it asks for,
// and whether one of its claims needs its devices on one PCIe root.
type job struct {
	name          string
	arrival, life int
	gpus, nics    int
	sameRoot      bool
}

// jobsOf reads the jobs of a workload; GPUs and NICs are the counts its
// claim templates ask of the GPU and NIC classes.
func jobsOf(w *sim.Workload) []job {
	type count struct {
		gpus, nics int
		sameRoot   bool
	}
	perTemplate := map[string]count{}
	for _, t := range w.Templates {
		c := perTemplate[t.Name]
		for _, m := range t.Spec.Spec.Devices.Constraints {
			if m.MatchAttribute != nil && string(*m.MatchAttribute) == string(topology.AttrPCIeRoot) {
				c.sameRoot = true
			}
		}
		for _, r := range t.Spec.Spec.Devices.Requests {
			switch {
			case r.Exactly == nil:
			case r.Exactly.DeviceClassName == sim.GPUClassName:
				c.gpus += int(r.Exactly.Count)
			case r.Exactly.DeviceClassName == sim.NICClassName:
				c.nics += int(r.Exactly.Count)
			}
		}
		perTemplate[t.Name] = c
	}
	var out []job
	for _, j := range w.Jobs {
		jb := job{name: j.Pod.Name, arrival: j.Arrival, life: j.Lifetime}
		for _, c := range j.Pod.Spec.ResourceClaims {
			if c.ResourceClaimTemplateName != nil {
				jb.gpus += perTemplate[*c.ResourceClaimTemplateName].gpus
				jb.nics += perTemplate[*c.ResourceClaimTemplateName].nics
				jb.sameRoot = jb.sameRoot || perTemplate[*c.ResourceClaimTemplateName].sameRoot
			}
		}
		out = append(out, jb)
	}
	return out
}

type options struct {
	scheduler string
	from, to  int
	all       bool
	// why prints, instead of the ticks, why the pods that waited did:
	// see causes.
	why bool
}

// free is a count of free GPUs and NICs.
type free struct{ gpus, nics int }

// cause classifies a waiting pod by the free GPUs and NICs per node and,
// for a pod that needs its devices on one PCIe root, per root of each
// node (roots[node]), as the simulator does (sim.ClassifyWait); the replay
// does not know the scheduler's headroom.
func cause(j job, nodes []free, roots [][]free) string {
	var n, r []measure.Count
	for i, f := range nodes {
		n = append(n, measure.Count{GPUs: f.gpus, NICs: f.nics})
		for _, rf := range roots[i] {
			r = append(r, measure.Count{GPUs: rf.gpus, NICs: rf.nics})
		}
	}
	return sim.ClassifyWait(sim.WaitWant{GPUs: j.gpus, NICs: j.nics, SameRoot: j.sameRoot}, n, r, nil)
}

// replay prints the run of each scheduler tick by tick. Departures follow
// the simulator: a pod bound at tick b with lifetime l leaves at the start
// of tick b+l.
func replay(out io.Writer, rep runJSON, jobs []job, o options) error {
	byName := map[string]job{}
	for _, j := range jobs {
		byName[j.name] = j
	}
	nodeIndex := map[string]int{}
	for i, n := range rep.Nodes {
		nodeIndex[n.Node] = i
	}
	to := o.to
	if to < 0 {
		to = rep.Ticks - 1
	}
	for _, res := range rep.Results {
		if o.scheduler != "" && res.Scheduler != o.scheduler {
			continue
		}
		// waited[size][cause]: pods that waited, by what they ask for.
		waited := sim.WaitedBy{}
		fmt.Fprintf(out, "== %s\nnodes:", res.Scheduler)
		for i, n := range rep.Nodes {
			fmt.Fprintf(out, " %d %s (%s)", i, n.Node, n.Profile)
		}
		fmt.Fprintln(out)
		// gpus[node][device name] = size of the pod holding it, 0 free.
		gpus := make([]map[string]int, len(rep.Nodes))
		for i := range gpus {
			gpus[i] = map[string]int{}
		}
		type bound struct {
			node, tick int
			devices    []string
		}
		placed := map[string]bound{}
		for _, p := range res.Placements {
			n, ok := nodeIndex[p.Node]
			if !ok {
				return fmt.Errorf("%s: pod %s placed on unknown node %s", res.Scheduler, p.Pod, p.Node)
			}
			if _, ok := byName[p.Pod]; !ok {
				return fmt.Errorf("%s: pod %s is not in the workload (the JSON is from another workload or version)", res.Scheduler, p.Pod)
			}
			placed[p.Pod] = bound{node: n, tick: p.Tick, devices: append(slices.Clone(p.GPUs), p.NICs...)}
		}
		// freeOn counts node i's free GPUs and free NICs, and its NICs.
		freeOn := func(i int) (freeGPUs, freeNICs, nics int) {
			for _, d := range rep.Nodes[i].Devices {
				if !d.GPU {
					nics++
				}
				switch {
				case gpus[i][d.Name] != 0:
				case d.GPU:
					freeGPUs++
				default:
					freeNICs++
				}
			}
			return freeGPUs, freeNICs, nics
		}
		show := func() string {
			var parts []string
			for i, n := range rep.Nodes {
				var b strings.Builder
				fmt.Fprintf(&b, "%d:", i)
				numa := ""
				for k, d := range n.Devices {
					if !d.GPU {
						continue
					}
					if k > 0 && d.NUMA != numa {
						b.WriteString("|")
					}
					numa = d.NUMA
					switch g := gpus[i][d.Name]; {
					case g == 0:
						b.WriteString(".")
					case g > 9:
						b.WriteString("#")
					default:
						fmt.Fprint(&b, g)
					}
				}
				if _, free, nics := freeOn(i); nics > 0 {
					fmt.Fprintf(&b, "/%dn", free)
				}
				parts = append(parts, b.String())
			}
			return strings.Join(parts, " ")
		}
		for tick := 0; tick < rep.Ticks; tick++ {
			for name, b := range placed {
				if j := byName[name]; j.life > 0 && b.tick+j.life == tick {
					for _, d := range b.devices {
						gpus[b.node][d] = 0
					}
				}
			}
			var waiting []string
			for _, j := range jobs {
				if b, ok := placed[j.name]; j.arrival < tick && (!ok || b.tick >= tick) {
					waiting = append(waiting, fmt.Sprintf("%s (%d GPUs, since %d)", j.name, j.gpus, j.arrival))
				}
			}
			var now []string
			for _, p := range res.Placements {
				if p.Tick != tick {
					continue
				}
				b, j := placed[p.Pod], byName[p.Pod]
				for _, d := range b.devices {
					gpus[b.node][d] = j.gpus
				}
				now = append(now, fmt.Sprintf("%s -> %s %v (arrived %d)", p.Pod, p.Node, p.GPUs, j.arrival))
			}
			if o.why {
				nodes, roots := make([]free, len(rep.Nodes)), make([][]free, len(rep.Nodes))
				for i, n := range rep.Nodes {
					nodes[i].gpus, nodes[i].nics, _ = freeOn(i)
					byRoot := map[string]free{}
					for _, d := range n.Devices {
						f := byRoot[d.Root]
						switch {
						case d.Root == "" || gpus[i][d.Name] != 0:
							continue
						case d.GPU:
							f.gpus++
						default:
							f.nics++
						}
						byRoot[d.Root] = f
					}
					for _, f := range byRoot {
						roots[i] = append(roots[i], f)
					}
				}
				for _, j := range jobs {
					if b, ok := placed[j.name]; j.arrival != tick || ok && b.tick == tick {
						continue
					}
					size := sim.WaitSize(j.gpus, j.nics)
					waited.Add(size, cause(j, nodes, roots), 1)
				}
				continue
			}
			if tick < o.from || tick > to || (len(waiting) == 0 && !o.all) {
				continue
			}
			slices.Sort(waiting)
			fmt.Fprintf(out, "tick %d\n  waiting at start: %s\n  placed: %s\n  at end: %s\n", tick, strings.Join(waiting, ", "), strings.Join(now, ", "), show())
		}
		if o.why {
			printWhy(out, waited)
		}
	}
	return nil
}

// printWhy prints the pods that waited by what they ask for and cause.
func printWhy(out io.Writer, waited sim.WaitedBy) {
	fmt.Fprintln(out, "pods that waited, by the cluster at the end of the tick they arrived in:")
	if len(waited) == 0 {
		fmt.Fprintln(out, "  none")
		return
	}
	for _, size := range waited.Sizes() {
		fmt.Fprintf(out, "  %s: %s\n", size, waited.Line(size, nil))
	}
}
