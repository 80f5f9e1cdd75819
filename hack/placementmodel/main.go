// Command placementmodel screens placement policies on the simulator's
// workloads in seconds, without an API server or a scheduler: a model of
// the nodes, the ticks and the policies (model.go, policy.go), calibrated
// against `make placement` (docs/placement.md, "A model to screen ideas").
// Its numbers are the model's, not the scheduler's; use the simulator's
// sweep as the verdict.
//
//	go run ./hack/placementmodel --seeds 1-8
package main

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/topodra/topodra/pkg/sim"
)

// policies are the policies the model knows, by name.
var policies = map[string]policy{
	"stock":                 stock,
	"spread":                spread,
	"stock-least-allocated": leastAllocated,
	"stock-most-allocated":  mostAllocated,
	"topodra":               topodra(defaultTopodra),
	"topodra-no-age": topodra(func() topodraOptions {
		o := defaultTopodra
		o.age = 0
		return o
	}()),
	"topodra-oracle-remaining": topodra(func() topodraOptions {
		o := defaultTopodra
		o.remaining = true
		return o
	}()),
	"topodra-oracle-reserve": topodra(func() topodraOptions {
		o := defaultTopodra
		o.reserve = true
		return o
	}()),
	"topodra-oracle-reserve-error50":  topodra(reserveWithError(0.5)),
	"topodra-oracle-reserve-error100": topodra(reserveWithError(1)),
	"topodra-oracle-reserve-soft": topodra(func() topodraOptions {
		o := defaultTopodra
		o.reserve, o.soft = true, true
		return o
	}()),
	"topodra-reserve-deadline": topodra(func() topodraOptions {
		o := defaultTopodra
		o.reserve, o.upperBound = true, 1
		return o
	}()),
}

// Headroom: a whole-node pod starts only if some GPUs stay free for
// smaller pods; by count, by share of the cluster's GPUs, and by share
// until the whole-node pod has waited a few ticks.
func init() {
	for _, n := range []int{1, 2, 4, 8, 12, 16} {
		o := defaultTopodra
		o.headroom = n
		policies[fmt.Sprintf("topodra-headroom-%d", n)] = topodra(o)
	}
	for _, share := range []float64{0.125, 0.1875, 0.25} {
		for _, waited := range []int{0, 4, 6, 8} {
			o := defaultTopodra
			o.headroomShare, o.headroomFor = share, waited
			name := fmt.Sprintf("topodra-headroom-share-%g", 100*share)
			if waited > 0 {
				name += fmt.Sprintf("-for-%d", waited)
			}
			policies[name] = topodra(o)
		}
	}
}

// Services: the pods that run to the end are known by their restart
// policy; with and without the headroom.
func init() {
	for _, share := range []float64{0, 0.125} {
		o := defaultTopodra
		o.services, o.headroomShare = true, share
		name := "topodra-services"
		if share > 0 {
			name += fmt.Sprintf("-headroom-share-%g", 100*share)
		}
		policies[name] = topodra(o)
	}
}

// servicesHeadroom is the default's model with the services rule and the
// headroom an eighth of the cluster's GPUs, the base of the screens below.
func servicesHeadroom() topodraOptions {
	o := defaultTopodra
	o.services, o.headroomShare = true, 0.125
	return o
}

// Draining nodes closed to pods of 2 or 4 GPUs and more, where they fit
// elsewhere or always.
func init() {
	for _, from := range []int{2, 4} {
		for _, hard := range []bool{false, true} {
			o := servicesHeadroom()
			o.drainClosedFrom, o.drainClosedHard = from, hard
			name := fmt.Sprintf("topodra-services-headroom-share-12.5-drain-closed-%d", from)
			if hard {
				name += "-hard"
			}
			policies[name] = topodra(o)
		}
	}
}

// The reservation by upper bounds with the services rule and the headroom,
// for every pod or only for pods of 2 or 4 GPUs and more.
func init() {
	for _, from := range []int{0, 2, 4} {
		o := servicesHeadroom()
		o.reserve, o.upperBound, o.reserveFrom = true, 1, from
		policies[fmt.Sprintf("topodra-services-headroom-share-12.5-reserve-deadline-from-%d", from)] = topodra(o)
	}
}

// Draining nodes chosen by the size of their largest pod, then by age.
func init() {
	o := servicesHeadroom()
	o.drainSmallest = true
	policies["topodra-services-headroom-share-12.5-drain-smallest"] = topodra(o)
}

// Remaining lifetimes learned from the pods that have ended.
func init() {
	o := servicesHeadroom()
	o.learned = true
	policies["topodra-services-headroom-share-12.5-learned"] = topodra(o)
	o.learned, o.remaining = false, true
	policies["topodra-services-headroom-share-12.5-oracle-remaining"] = topodra(o)
}

// The headroom as the scheduler applies it: 12 % rounded up, a quarter of
// it for pods of 4 to 7 GPUs, counted on nodes left with two or more free;
// topodra-shipped-whole-W-half-H keeps the share W of it against pods of 8
// GPUs and H against pods of 4 to 7 instead (W 1, H 0.25 as shipped).
// The earlier names topodra-shipped-whole-W (H 0.25) and
// topodra-shipped-half-H (W 1) name points of the same grid.
func init() {
	o := defaultTopodra
	o.services, o.headroomShare, o.headroomAsShipped = true, 0.12, true
	policies["topodra-shipped"] = topodra(o)
	for _, f := range []float64{0.5, 0.625, 0.75, 0.875, 1} {
		for _, share := range []float64{0.25, 0.375, 0.5} {
			w := o
			w.wholeNodeHeadroom, w.halfNodeShare = f, share
			pick := topodra(w)
			policies[fmt.Sprintf("topodra-shipped-whole-%g-half-%g", f, share)] = pick
			switch {
			case share == 0.25 && (f == 0.5 || f == 0.75):
				policies[fmt.Sprintf("topodra-shipped-whole-%g", f)] = pick
			case f == 1 && share != 0.25:
				policies[fmt.Sprintf("topodra-shipped-half-%g", share)] = pick
			}
		}
	}
	// The draining nodes chosen among all nodes, none marked where every
	// node the pod can go to would be (for pods of any size), or both.
	d := o
	d.drainAmongAll = true
	policies["topodra-shipped-drain-among-all"] = topodra(d)
	d.drainMoot = true
	policies["topodra-shipped-drain-among-all-moot"] = topodra(d)
	d.drainAmongAll = false
	policies["topodra-shipped-drain-moot"] = topodra(d)
	// The drain rule above with the whole-node headroom at the share S
	// while at least N other pods of 8 GPUs wait
	// (topodra-shipped-relax-N-S).
	for _, from := range []int{1, 2, 3} {
		for _, share := range []float64{0, 0.5} {
			r := d
			r.relaxFrom, r.relaxShare = from, share
			policies[fmt.Sprintf("topodra-shipped-relax-%d-%g", from, share)] = topodra(r)
		}
	}
	// The drain rule above with pods of up to U GPUs drawn to nodes whose
	// pods are of their size class, at weight W beside room 70, packing
	// and age 30 (topodra-shipped-like-U-W).
	for _, upTo := range []int{2, 4, 8} {
		for _, w := range []float64{15, 30, 70} {
			l := d
			l.likeUpTo, l.like = upTo, w
			policies[fmt.Sprintf("topodra-shipped-like-%d-%g", upTo, w)] = topodra(l)
		}
	}
	v := o
	v.wholeNodeSpareFrom = 1
	policies["topodra-shipped-whole-singles"] = topodra(v)
	v.wholeNodeSpareFrom = 4
	policies["topodra-shipped-whole-spare-4"] = topodra(v)
	for _, share := range []float64{0.375, 0.5} {
		w := o
		w.wholeNodeSpareFrom, w.halfNodeShare = 1, share
		policies[fmt.Sprintf("topodra-shipped-whole-singles-half-%g", share)] = topodra(w)
	}
}

// reserveWithError is the reservation oracle with lifetimes off by up to
// the given fraction.
func reserveWithError(e float64) topodraOptions {
	o := defaultTopodra
	o.reserve, o.lifetimeError = true, e
	return o
}

var orders = map[string]queueOrder{"fifo": fifo, "small-first": smallFirst, "large-first": largeFirst, "whole-then-small": wholeThenSmall}

// agedAfter are the waits, in ticks, of the small-first-aged-N orders.
var agedAfter = []int{2, 4, 6, 8, 12}

func init() {
	for _, n := range agedAfter {
		orders[fmt.Sprintf("small-first-aged-%d", n)] = smallFirstAged(n)
	}
}

func main() {
	seeds := flag.String("seeds", "1-8", "seeds, e.g. 1-8 or 1,3,9-12")
	names := flag.String("policies", "stock,spread,topodra,topodra-no-age,topodra-oracle-remaining,topodra-oracle-reserve", "policies to run: "+strings.Join(sortedKeys(policies), ", "))
	queue := flag.String("queue", "fifo,small-first,large-first", fmt.Sprintf("orders in which waiting pods are retried: fifo, small-first, large-first, whole-then-small, small-first-aged-N (N ticks, one of %v)", agedAfter))
	flag.BoolVar(&sortArrivals, "sort-arrivals", false, "try a tick's new pods in queue order, not arrival order")
	flag.BoolVar(&oneByOne, "one-by-one", false, "retry waiting pods after each departure, not after all departures of a tick")
	scenarios := flag.String("scenarios", "", "scenarios to run, comma-separated: the sweep's (default all of them) and demo (the demo's default run: built-in workload, 160 pods, 8 nodes)")
	reps := flag.Int("reps", 3, "runs per seed and scenario (the stock and spread policies draw random numbers)")
	causes := flag.Bool("causes", false, "also split the pod-ticks that 8-GPU pods wait by what the cluster had free at the end of each tick")
	flag.Parse()
	if err := run1(*seeds, *scenarios, *names, *queue, *reps, *causes); err != nil {
		fmt.Fprintln(os.Stderr, "placementmodel:", err)
		os.Exit(1)
	}
}

func sortedKeys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func run1(seedList, scenarioList, names, queues string, reps int, causes bool) error {
	seeds, err := sim.ParseSeeds(seedList)
	if err != nil {
		return err
	}
	scenarios, err := pickScenarios(scenarioList)
	if err != nil {
		return err
	}
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(w, "policy\tqueue\truns\twait 1\twait 2\twait 4\twait 8\tnever placed\tfit 8\tGPU-ticks\t8-GPU share\tidle\taligned\t")
	if causes {
		fmt.Fprintf(w, "8-GPU pod-ticks waiting: %s\t", strings.Join(causes8[:], "\t"))
	}
	fmt.Fprintf(w, "mean 2 / 4 / 8\t")
	fmt.Fprintln(w)
	for _, q := range strings.Split(queues, ",") {
		order, ok := orders[q]
		if !ok {
			return fmt.Errorf("unknown queue order %q", q)
		}
		for _, name := range strings.Split(names, ",") {
			pick, ok := policies[name]
			if !ok {
				return fmt.Errorf("unknown policy %q (known: %s)", name, strings.Join(sortedKeys(policies), ", "))
			}
			s, err := sweep(scenarios, seeds, pick, order, reps)
			if err != nil {
				return err
			}
			fmt.Fprintf(w, "%s\t%s\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t%d\t%d\t%d\t%.0f%%\t%d\t%.1f%%\t", name, q, s.runs,
				median(s.waits[1]), median(s.waits[2]), median(s.waits[4]), median(s.waits[8]),
				s.neverPlaced, s.fit8, s.gpuTicks, 100*float64(s.gpuTicks8)/float64(max(1, s.gpuTicks)), s.idle, 100*median(s.aligned))
			if causes {
				for _, n := range s.wait8 {
					fmt.Fprintf(w, "%d\t", n)
				}
			}
			fmt.Fprintf(w, "%.3f / %.3f / %.2f\t", mean(s.waits[2]), mean(s.waits[4]), mean(s.waits[8]))
			fmt.Fprintln(w)
		}
	}
	return w.Flush()
}

// summary holds per-run values (medians are taken over runs) and sums.
type summary struct {
	runs                                         int
	waits                                        map[int][]float64
	aligned                                      []float64
	neverPlaced, fit8, gpuTicks, gpuTicks8, idle int
	wait8                                        [len(causes8)]int
}

// pickScenarios resolves a comma-separated list of scenario names; empty
// means the sweep's scenarios.
func pickScenarios(list string) ([]sim.Scenario, error) {
	known := append(sim.DefaultScenarios(), sim.Scenario{Name: "demo", Profile: sim.DefaultProfile, Nodes: 8, Pods: 160, Trace: sim.TraceBuiltin})
	if list == "" {
		return known[:len(known)-1], nil
	}
	var out []sim.Scenario
	for _, name := range strings.Split(list, ",") {
		i := slices.IndexFunc(known, func(s sim.Scenario) bool { return s.Name == name })
		if i < 0 {
			return nil, fmt.Errorf("unknown scenario %q", name)
		}
		out = append(out, known[i])
	}
	return out, nil
}

func sweep(scenarios []sim.Scenario, seeds []int64, pick policy, order queueOrder, reps int) (summary, error) {
	s := summary{waits: map[int][]float64{}}
	for _, sc := range scenarios {
		specs, err := sim.PlanNodes(sc.Profile, sc.Nodes)
		if err != nil {
			return s, err
		}
		for _, seed := range seeds {
			w, err := sim.GenerateTrace(sc.Trace, seed, sc.Pods, specs)
			if err != nil {
				return s, err
			}
			for rep := range reps {
				r := run(w, specs, pick, order, rand.New(rand.NewPCG(uint64(seed), uint64(rep))))
				s.runs++
				for k, v := range r.waits {
					if v[0] > 0 {
						s.waits[k] = append(s.waits[k], float64(v[1])/float64(v[0]))
					}
				}
				if r.aligned[1] > 0 {
					s.aligned = append(s.aligned, float64(r.aligned[0])/float64(r.aligned[1]))
				}
				s.neverPlaced += r.neverPlaced
				s.fit8 += r.fit8
				s.gpuTicks += r.gpuTicks
				s.gpuTicks8 += r.gpuTicks8
				s.idle += r.idle
				for i, n := range r.wait8 {
					s.wait8[i] += n
				}
			}
		}
	}
	return s, nil
}

// mean is the mean over runs: the medians of the small pods' waits move
// in steps (most runs have none), the means show the trade between sizes.
func mean(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	sum := 0.0
	for _, x := range v {
		sum += x
	}
	return sum / float64(len(v))
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	v = slices.Clone(v)
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}
