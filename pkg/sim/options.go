// Package sim is topodra-sim: it starts an embedded control plane (etcd,
// kube-apiserver, the ResourceClaim controller), simulated GPU nodes whose
// node agents run on mock machines and publish real ResourceSlices, and runs
// one seeded workload through topodra-scheduler and, on a fresh identical
// cluster, through the stock kube-scheduler. It tracks where every device
// went and reports placement quality side by side (text, JSON, HTML).
//
// # Time
//
// A workload runs in ticks, a virtual clock. At each tick the simulator
// deletes the pods whose lifetime has ended and waits until their claims are
// released, creates the pods that arrive at that tick and waits until each
// of them is bound or marked unschedulable. Nothing waits on a fixed sleep,
// so both schedulers see the same sequence of events and a run takes as long
// as the schedulers need.
package sim

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/topodra/topodra/pkg/agent/mockgpu"
)

// Scheduler names accepted by Options.Schedulers.
const (
	SchedulerTopodra = "topodra"
	SchedulerStock   = "stock"
)

// Device class names created in every simulated cluster.
const (
	GPUClassName = "gpu.topodra.io"
	NICClassName = "nic.topodra.io"
)

// Options configure [Run]. The zero value of a field means its default.
type Options struct {
	// Nodes is the number of simulated nodes (default 8). With a mixed
	// Profile whose counts add up, Nodes may be 0.
	Nodes int
	// Profile is a machine profile name, or a mix like
	// "dgx-h100=6,pcie-nvlink-pairs=2" (default "dgx-h100=6,pcie-nvlink-pairs=2").
	// A mix whose counts do not add up to Nodes is scaled to Nodes.
	Profile string
	// Pods is the number of pods of the generated workload (default 160).
	Pods int
	// Seed drives the generated workload and the warm-up's (default 1).
	Seed int64
	// Schedulers to compare, in order (default topodra, stock).
	Schedulers []string
	// SchedulerConfig replaces the embedded topodra profile
	// (config.SchedulerConfig) for the topodra run.
	SchedulerConfig []byte
	// StockSchedulerConfig replaces the stock scheduler's default
	// configuration (one default-scheduler profile) for the stock run;
	// its profile must be named default-scheduler.
	StockSchedulerConfig []byte
	// Trace names the generated workload (see Traces; default
	// TraceBuiltin). With Workload it must be empty or TraceBuiltin.
	Trace string
	// Workload, if set, replaces the generated workload; WorkloadName
	// says where it came from (for the report).
	Workload     *Workload
	WorkloadName string
	// NoHostRequests leaves the pods of the generated workloads without
	// CPU and memory requests. By default each requests HostCPUPerGPU CPUs
	// and HostMemoryPerGPU bytes per GPU, as GPU pods do; without them the
	// stock scheduler's NodeResourcesFit and BalancedAllocation scores
	// are equal on every node, and it takes the first feasible one.
	NoHostRequests bool
	// Pin gives every pod of the built-in workload a node (nodeSelector on
	// kubernetes.io/hostname) chosen by the seed among the nodes where it
	// fits by count. Then node choice is out of the schedulers' hands and
	// only device choice differs: runs are reproducible even between two
	// schedulers that break node-score ties at random. For tests; not
	// with Workload or another Trace.
	Pin bool
	// Checkpoints is the number of intermediate snapshots of the device
	// maps (default 3; negative: none).
	Checkpoints int
	// SettleTimeout bounds each wait for pods to be bound or marked
	// unschedulable, and for claims to be released (default 60s).
	SettleTimeout time.Duration
	// AfterRun, if set, is called at the end of each scheduler's run,
	// before its cluster is torn down, with an admin client of that
	// cluster and the run's result. Tests use it to check the result
	// against the API. An error fails the run.
	AfterRun func(ctx context.Context, client kubernetes.Interface, res *Result) error
	// Progress receives one line now and then while a run goes on; nil
	// means no progress output.
	Progress io.Writer
	// WarmUpPods is the size of a run through each scheduler, on its own
	// cluster, before the measured runs: the first control plane and
	// scheduler of a process run slower (code paths executed for the
	// first time, lazily built caches, a heap that still grows), and
	// without it the scheduler measured first pays for that in its
	// throughput, latency and CPU. Its results are discarded. Default
	// DefaultWarmUpPods; negative: no warm-up.
	WarmUpPods int
	// Faults is the number of faults injected into each measured run:
	// restarts of the scheduler and of a node's agent, a critical XID on
	// a GPU and a restart of the kube-apiserver in turn (see the Fault*
	// kinds), each a few milliseconds after the pods of a tick (chosen
	// by the seed) were created, while the scheduler places them. Both
	// schedulers get the same faults at the same ticks, nodes and GPUs.
	// The invariant checker, the stuck-pod count and the allocations of
	// tainted GPUs say whether the run survived them. 0: none.
	Faults int
}

// DefaultWarmUpPods is the default size of the warm-up run.
const DefaultWarmUpPods = 24

// NodeSpec is one simulated node.
type NodeSpec struct {
	Name    string `json:"name"`
	Profile string `json:"profile"`
}

// DefaultProfile is the default machine mix.
const DefaultProfile = "dgx-h100=6,pcie-nvlink-pairs=2"

// hostRequests says what the generated pods request besides devices:
// HostRequestsText, or "none" with NoHostRequests.
func (o *Options) hostRequests() string {
	if o.NoHostRequests {
		return "none"
	}
	return HostRequestsText
}

func (o *Options) setDefaults() {
	if o.Profile == "" {
		o.Profile = DefaultProfile
	}
	if o.Pods == 0 {
		o.Pods = 160
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if len(o.Schedulers) == 0 {
		o.Schedulers = []string{SchedulerTopodra, SchedulerStock}
	}
	if o.Checkpoints == 0 {
		o.Checkpoints = 3
	}
	if o.SettleTimeout == 0 {
		o.SettleTimeout = 60 * time.Second
	}
	if o.WarmUpPods == 0 {
		o.WarmUpPods = DefaultWarmUpPods
	}
}

// Check reports what is wrong with the options before anything starts:
// counts, the trace, the schedulers, the profile mix, and the profile
// names of the scheduler configurations given (topodra-scheduler,
// default-scheduler), which the run's pods ask for.
func (o Options) Check() error {
	o.setDefaults()
	errs := []error{o.validate()}
	// A negative node count is validate's to report, once.
	if o.Nodes >= 0 {
		if _, err := PlanNodes(o.Profile, o.Nodes); err != nil {
			errs = append(errs, err)
		}
	}
	for _, c := range []struct {
		config []byte
		flag   string
		name   string
	}{{o.SchedulerConfig, "scheduler configuration", "topodra-scheduler"}, {o.StockSchedulerConfig, "stock scheduler configuration", "default-scheduler"}} {
		if len(c.config) == 0 {
			continue
		}
		names, err := profileNames(c.config)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", c.flag, err))
			continue
		}
		if !slices.Contains(names, c.name) {
			errs = append(errs, fmt.Errorf("%s: no profile named %s (the simulated pods ask for that scheduler), only %s", c.flag, c.name, strings.Join(names, ", ")))
		}
	}
	return errors.Join(errs...)
}

// profileNames lists the scheduler names of a KubeSchedulerConfiguration's
// profiles, with kube-scheduler's defaults: no profiles, or a profile
// without a name, is default-scheduler.
func profileNames(config []byte) ([]string, error) {
	var cfg struct {
		Profiles []struct {
			SchedulerName string `json:"schedulerName"`
		} `json:"profiles"`
	}
	if err := yaml.Unmarshal(config, &cfg); err != nil {
		return nil, err
	}
	if len(cfg.Profiles) == 0 {
		return []string{"default-scheduler"}, nil
	}
	var names []string
	for _, p := range cfg.Profiles {
		names = append(names, cmp.Or(p.SchedulerName, "default-scheduler"))
	}
	return names, nil
}

func (o *Options) validate() error {
	var errs []error
	if o.Nodes < 0 {
		errs = append(errs, fmt.Errorf("nodes must not be negative, got %d", o.Nodes))
	}
	if o.Pods < 0 {
		errs = append(errs, fmt.Errorf("pods must not be negative, got %d", o.Pods))
	}
	if o.Faults < 0 {
		errs = append(errs, fmt.Errorf("faults must not be negative, got %d", o.Faults))
	}
	if o.Trace != "" && !slices.Contains(Traces(), o.Trace) {
		errs = append(errs, fmt.Errorf("unknown trace %q (known: %s)", o.Trace, strings.Join(Traces(), ", ")))
	}
	if o.Pin && (o.Workload != nil || o.Trace != "" && o.Trace != TraceBuiltin) {
		errs = append(errs, fmt.Errorf("pin applies to the %s workload only", TraceBuiltin))
	}
	if o.Workload != nil && o.Trace != "" && o.Trace != TraceBuiltin {
		errs = append(errs, fmt.Errorf("trace %s generates a workload: not with a workload of its own", o.Trace))
	}
	seen := map[string]bool{}
	for _, s := range o.Schedulers {
		if s != SchedulerTopodra && s != SchedulerStock {
			errs = append(errs, fmt.Errorf("unknown scheduler %q (known: %s, %s)", s, SchedulerTopodra, SchedulerStock))
		}
		if seen[s] {
			errs = append(errs, fmt.Errorf("scheduler %q listed twice", s))
		}
		seen[s] = true
	}
	return errors.Join(errs...)
}

// ParseSchedulers splits "topodra,stock".
func ParseSchedulers(s string) []string {
	var out []string
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			out = append(out, part)
		}
	}
	return out
}

// PlanNodes turns a profile (a name, or a mix "a=6,b=2") and a node count
// into node specs named sim-node-0, sim-node-1, …. A single profile is used
// for every node. A mix whose counts add up to nodes (or nodes == 0) is used
// as is; otherwise it is scaled to nodes by largest remainder, keeping at
// least one node of each profile when nodes allows.
func PlanNodes(profile string, nodes int) ([]NodeSpec, error) {
	known := mockgpu.Profiles()
	type part struct {
		name  string
		count int
	}
	var parts []part
	total := 0
	for _, item := range strings.Split(profile, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		name, countStr, hasCount := strings.Cut(item, "=")
		name = strings.TrimSpace(name)
		if !slices.Contains(known, name) {
			return nil, fmt.Errorf("unknown machine profile %q (known: %s)", name, strings.Join(known, ", "))
		}
		count := 1
		if hasCount {
			n, err := strconv.Atoi(strings.TrimSpace(countStr))
			if err != nil || n < 1 {
				return nil, fmt.Errorf("profile %q: count must be a positive integer, got %q", name, countStr)
			}
			count = n
		}
		parts = append(parts, part{name, count})
		total += count
	}
	if len(parts) == 0 {
		return nil, errors.New("no machine profile given")
	}
	if nodes == 0 {
		nodes = total
		if len(parts) == 1 && !strings.Contains(profile, "=") {
			nodes = 8
		}
	}
	if nodes < 1 {
		return nil, fmt.Errorf("need at least one node, got %d", nodes)
	}
	counts := make([]int, len(parts))
	switch {
	case len(parts) == 1:
		counts[0] = nodes
	case total == nodes:
		for i, p := range parts {
			counts[i] = p.count
		}
	default:
		// Largest remainder: floor shares, then hand out the rest by
		// remainder (ties: earlier profile first).
		assigned := 0
		rem := make([]float64, len(parts))
		for i, p := range parts {
			share := float64(p.count) * float64(nodes) / float64(total)
			counts[i] = int(share)
			rem[i] = share - float64(counts[i])
			assigned += counts[i]
		}
		for assigned < nodes {
			best := 0
			for i := range rem {
				if rem[i] > rem[best] {
					best = i
				}
			}
			counts[best]++
			rem[best] = -1
			assigned++
		}
	}
	var specs []NodeSpec
	for i, p := range parts {
		for range counts[i] {
			specs = append(specs, NodeSpec{Name: fmt.Sprintf("sim-node-%d", len(specs)), Profile: p.name})
		}
	}
	return specs, nil
}
