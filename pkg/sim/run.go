package sim

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"runtime/debug"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/topodra/topodra/config"
	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/cluster"
	"github.com/topodra/topodra/pkg/invariant"
	"github.com/topodra/topodra/pkg/measure"
	"github.com/topodra/topodra/pkg/plugins/topologydra"
	topodrav1 "github.com/topodra/topodra/pkg/plugins/topologydra/apis/config/v1"
	"github.com/topodra/topodra/pkg/topology"
)

// Namespace is where a run creates its templates, pods and claims.
const Namespace = "sim"

// retryTimeout bounds the wait for pending pods that fit by count to be
// bound after devices were freed. Both schedulers run with a 1 s backoff.
const retryTimeout = 10 * time.Second

// pollInterval is how often waits re-check the tracked state (in memory,
// fed by informers).
const pollInterval = 5 * time.Millisecond

// Run runs the workload through each scheduler in turn, each on a fresh
// cluster built from the same nodes, and returns the report. A failure to
// start or an unmet wait fails the run with an error that says what was
// waited for.
func Run(ctx context.Context, opts Options) (*Report, error) {
	if err := opts.Check(); err != nil {
		return nil, err
	}
	opts.setDefaults()
	nodes, err := PlanNodes(opts.Profile, opts.Nodes)
	if err != nil {
		return nil, err
	}
	workload := opts.Workload
	if workload == nil {
		if opts.Pin {
			workload, err = Generate(opts.Seed, opts.Pods, nodes, true)
		} else {
			workload, err = GenerateTrace(opts.Trace, opts.Seed, opts.Pods, nodes)
		}
		if err != nil {
			return nil, err
		}
		if opts.NoHostRequests {
			workload = withoutHostRequests(workload)
		}
	}
	start := time.Now()
	report := &Report{Seed: opts.Seed, Workload: "built-in", Profile: opts.Profile, Pods: len(workload.Jobs), Ticks: workload.Ticks()}
	if opts.Workload == nil {
		report.HostRequests = opts.hostRequests()
	}
	switch {
	case opts.Workload != nil:
		report.Workload = opts.WorkloadName
	case opts.Trace != "" && opts.Trace != TraceBuiltin:
		report.Workload = opts.Trace
	}
	if opts.WarmUpPods > 0 {
		if err := warmUp(ctx, opts, nodes); err != nil {
			return nil, err
		}
		report.WarmUpPods = opts.WarmUpPods
	}
	for _, sched := range opts.Schedulers {
		res, topo, err := runOne(ctx, opts, nodes, workload, sched)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", sched, err)
		}
		if report.Nodes == nil {
			report.Nodes = topo
		}
		report.Results = append(report.Results, *res)
	}
	report.WallSeconds = time.Since(start).Seconds()
	return report, nil
}

// warmUp runs a small built-in workload (opts.WarmUpPods pods on at most
// two of the run's nodes) through each scheduler, each on its own cluster,
// and discards the results, so that no measured run is the first of the
// process.
func warmUp(ctx context.Context, opts Options, nodes []NodeSpec) error {
	start := time.Now()
	nodes = nodes[:min(2, len(nodes))]
	workload, err := GenerateTrace(TraceBuiltin, opts.Seed, opts.WarmUpPods, nodes)
	if err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	if opts.NoHostRequests {
		workload = withoutHostRequests(workload)
	}
	opts.progressf("warm-up: %d pods on %d nodes through %s first, not measured ...", len(workload.Jobs), len(nodes), strings.Join(opts.Schedulers, ", "))
	o := opts
	o.Progress, o.AfterRun, o.Checkpoints, o.Faults = nil, nil, -1, 0
	for _, sched := range opts.Schedulers {
		if _, _, err := runOne(ctx, o, nodes, workload, sched); err != nil {
			return fmt.Errorf("warm-up of %s: %w", sched, err)
		}
	}
	opts.progressf("warm-up: %d pods on %d nodes through %s in %.1fs (not measured)", len(workload.Jobs), len(nodes), strings.Join(opts.Schedulers, ", "), time.Since(start).Seconds())
	return nil
}

func (o *Options) progressf(format string, args ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, format+"\n", args...)
	}
}

// runOne builds a cluster, runs the workload through one scheduler and
// tears the cluster down again (scheduler, agents, claim controller and
// informers before the apiserver).
func runOne(ctx context.Context, opts Options, nodes []NodeSpec, workload *Workload, sched string) (res *Result, topo []NodeTopology, err error) {
	// The garbage of the run before (its cluster, scheduler and agents)
	// is collected now, not while this run is measured.
	debug.FreeOSMemory()
	start := time.Now()
	logger := klog.FromContext(ctx).WithName(sched)
	ctx, cancel := context.WithCancel(klog.NewContext(ctx, logger))
	defer cancel()

	opts.progressf("[%s] starting control plane (etcd, kube-apiserver, claim controller)", sched)
	cp, err := cluster.Start(ctx, cluster.Options{})
	if err != nil {
		return nil, nil, err
	}
	defer cp.Stop()
	// Stop cancels ctx, and with it the tracker's informers, before it
	// stops the apiserver.
	cp.AddStop(cancel)
	client := cp.Client
	opts.progressf("[%s] apiserver up in %.1fs", sched, time.Since(start).Seconds())
	if _, err := cp.StartClaimController(ctx); err != nil {
		return nil, nil, err
	}
	for _, class := range []*resourceapi.DeviceClass{
		cluster.DeviceClass(GPUClassName, topology.DriverName),
		cluster.DeviceClass(NICClassName, mockgpu.NICDriverName),
	} {
		if _, err := client.ResourceV1().DeviceClasses().Create(ctx, class, metav1.CreateOptions{}); err != nil {
			return nil, nil, fmt.Errorf("create device class: %w", err)
		}
	}

	// Nodes, then their agents, started in parallel (each builds a mock
	// machine and runs discovery, which takes a while).
	var nodeObjs []*v1.Node
	for _, n := range nodes {
		node, err := cluster.CreateReadyNode(ctx, client, n.Name, map[string]string{LabelProfile: n.Profile})
		if err != nil {
			return nil, nil, err
		}
		nodeObjs = append(nodeObjs, node)
	}
	agents := make([]*agent.Simulated, len(nodes))
	agentErrs := make([]error, len(nodes))
	// With faults, each agent keeps a checkpoint, as a deployed one does,
	// so that a GPU fault outlives a restart of its agent; the cluster's
	// directory goes when the cluster stops.
	stateRoot := ""
	if opts.Faults > 0 {
		stateRoot = filepath.Join(cp.Dir, "agents")
	}
	agentOptions := func(i int, m *mockgpu.Machine) agent.SimulatedOptions {
		o := agent.SimulatedOptions{NodeName: nodes[i].Name, Profile: nodes[i].Profile, KubeClient: client, NICs: true, Machine: m}
		if stateRoot != "" {
			o.StateDir = filepath.Join(stateRoot, nodes[i].Name, "state")
			o.CDIDir = filepath.Join(stateRoot, nodes[i].Name, "cdi")
		}
		return o
	}
	var wg sync.WaitGroup
	for i := range nodes {
		wg.Go(func() {
			agents[i], agentErrs[i] = agent.StartSimulated(ctx, agentOptions(i, nil))
		})
	}
	wg.Wait()
	wantSlices := 0
	for i, a := range agents {
		if agentErrs[i] != nil {
			err = errors.Join(err, fmt.Errorf("start agent on %s: %w", nodes[i].Name, agentErrs[i]))
			continue
		}
		// The agent running at the end, which a fault may have replaced
		// (none where its restart failed).
		cp.AddStop(func() {
			if agents[i] != nil {
				agents[i].Stop()
			}
		})
		wantSlices++
		if len(a.Machine.NICDevices()) > 0 {
			wantSlices++
		}
	}
	if err != nil {
		return nil, nil, err
	}
	opts.progressf("[%s] control plane up in %.1fs; %d nodes, waiting for their agents to publish ResourceSlices", sched, time.Since(start).Seconds(), len(nodes))
	var slices_ []resourceapi.ResourceSlice
	err = wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, opts.SettleTimeout, true, func(ctx context.Context) (bool, error) {
		list, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		slices_ = list.Items
		return len(list.Items) >= wantSlices, nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("waiting for %d ResourceSlices, have %d: %w", wantSlices, len(slices_), err)
	}

	// Workload objects.
	if _, err := client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: Namespace}}, metav1.CreateOptions{}); err != nil {
		return nil, nil, fmt.Errorf("create namespace: %w", err)
	}
	for _, pc := range workload.PriorityClasses {
		pc = pc.DeepCopy()
		pc.ResourceVersion = ""
		if _, err := client.SchedulingV1().PriorityClasses().Create(ctx, pc, metav1.CreateOptions{}); err != nil {
			return nil, nil, fmt.Errorf("create PriorityClass %s: %w", pc.Name, err)
		}
	}
	for _, tmpl := range workload.Templates {
		tmpl = tmpl.DeepCopy()
		tmpl.Namespace = Namespace
		tmpl.ResourceVersion = ""
		if _, err := client.ResourceV1().ResourceClaimTemplates(Namespace).Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
			return nil, nil, fmt.Errorf("create ResourceClaimTemplate %s: %w", tmpl.Name, err)
		}
	}
	tr := newTracker(Namespace)
	tr.loadDevices(slices_, nodeObjs)
	topo = tr.topology(nodes)
	if err := tr.start(ctx, client); err != nil {
		return nil, nil, err
	}

	schedOpts := cluster.SchedulerOptions{Name: sched}
	schedulerName := "topodra-scheduler"
	switch sched {
	case SchedulerTopodra:
		schedOpts.Config = config.SchedulerConfig
		if len(opts.SchedulerConfig) > 0 {
			schedOpts.Config = opts.SchedulerConfig
		}
	case SchedulerStock:
		schedOpts.Stock = true
		schedOpts.Config = []byte(cluster.DefaultStockConfig)
		if len(opts.StockSchedulerConfig) > 0 {
			schedOpts.Config = opts.StockSchedulerConfig
		}
		schedulerName = "default-scheduler"
	}
	if schedOpts.Config, err = withShortBackoff(schedOpts.Config); err != nil {
		return nil, nil, err
	}
	if sched == SchedulerTopodra {
		percent, whole, err := headroomArgs(schedOpts.Config, schedulerName)
		if err != nil {
			return nil, nil, err
		}
		tr.setHeadroom(percent, whole)
	}
	// A scheduler that stops on its own (its configuration refused) ends
	// the wait for the probe pod with its own error.
	probeCtx, stopProbe := context.WithCancelCause(ctx)
	defer stopProbe(nil)
	schedOpts.OnFailure = func(err error) { stopProbe(fmt.Errorf("scheduler %s stopped: %w", schedulerName, err)) }
	// The scheduler's goroutines carry the pprof label scheduler=<name>,
	// so that a CPU profile of the run counts the scheduler's own CPU
	// time (Result.SchedulerCPUSeconds).
	var stopScheduler func()
	startScheduler := func(ctx context.Context) (err error) {
		pprof.Do(ctx, pprof.Labels("scheduler", sched), func(ctx context.Context) {
			stopScheduler, err = cp.StartScheduler(ctx, schedOpts)
		})
		return err
	}
	if err := startScheduler(ctx); err != nil {
		return nil, nil, err
	}
	if err := probeScheduler(probeCtx, client, schedulerName, "probe", opts.SettleTimeout); err != nil {
		if cause := context.Cause(probeCtx); cause != nil && ctx.Err() == nil {
			return nil, nil, cause
		}
		return nil, nil, err
	}
	// Attempts are counted from here: the probe pod is not the workload's.
	// (The probe pods after kube-apiserver restarts are counted, one
	// attempt each: the workload's pods are attempted meanwhile.)
	before := readAttempts(schedulerName)
	beforeTurnedDown := readTurnedDown(schedulerName)
	setup := time.Since(start)
	opts.progressf("[%s] cluster ready in %.1fs; running %d pods over %d ticks", sched, setup.Seconds(), len(workload.Jobs), workload.Ticks())

	var faults *injector
	if opts.Faults > 0 {
		arrivals := make([]int, 0, len(workload.Jobs))
		for _, j := range workload.Jobs {
			arrivals = append(arrivals, j.Arrival)
		}
		faults = &injector{
			plan:  planFaults(opts.Faults, opts.Seed, arrivals),
			nodes: len(nodes),
			restartScheduler: func(ctx context.Context) error {
				stopScheduler()
				return startScheduler(ctx)
			},
			restartAgent: func(ctx context.Context, i int) (string, error) {
				old := agents[i]
				old.Stop()
				agents[i] = nil
				a, err := agent.StartSimulated(ctx, agentOptions(i, old.Machine))
				if err != nil {
					return nodes[i].Name, err
				}
				agents[i] = a
				return nodes[i].Name, nil
			},
			failGPU: func(ctx context.Context, i int, pick func(int) int, xid uint64) (string, string, time.Duration, error) {
				node := nodes[i].Name
				healthy := tr.healthyGPUs(node)
				if len(healthy) == 0 {
					return node, "", 0, nil
				}
				uuid := healthy[pick(len(healthy))]
				m := agents[i].Machine
				gpu := -1
				for j := range m.Spec().GPUs {
					if m.UUID(j) == uuid {
						gpu = j
					}
				}
				if gpu < 0 {
					return node, "", 0, fmt.Errorf("no GPU of the machine has UUID %s", uuid)
				}
				start := time.Now()
				if err := m.InjectXID(gpu, xid); err != nil {
					return node, "", 0, err
				}
				// The agent publishes the taint at once; after a
				// kube-apiserver restart the agent's slice controller or
				// the simulator's slice informer may still be backing off.
				var key string
				var seen time.Time
				err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, reconnectTimeout, true, func(context.Context) (bool, error) {
					var tainted bool
					key, tainted, seen = tr.taintedGPU(node, uuid)
					return tainted, nil
				})
				if err != nil {
					return node, key, 0, fmt.Errorf("the simulator did not see the taint of GPU %s within %s: %w", uuid, reconnectTimeout, err)
				}
				return node, key, seen.Sub(start), nil
			},
			restartAPIServer: func(ctx context.Context, n int) (time.Duration, error) {
				cp.StopAPIServer()
				if err := cp.StartAPIServer(ctx); err != nil {
					return 0, err
				}
				start := time.Now()
				err := awaitWatching(ctx, client, tr, schedulerName, n)
				return time.Since(start), err
			},
		}
	}

	prof := measure.StartCPUProfile()
	res, err = drive(ctx, opts, workload, tr, client, topo, sched, schedulerName, faults)
	cpu, _, _, cpuErr := prof.Stop("scheduler", sched)
	if err != nil {
		return nil, nil, err
	}
	res.SchedulerCPUSeconds = cpu
	if cpuErr != nil {
		res.SchedulerCPUSeconds = -1
		res.Notes = append(res.Notes, fmt.Sprintf("scheduler CPU not measured: %v", cpuErr))
	}
	att := readAttempts(schedulerName).since(before)
	res.AttemptP50Ms = 1000 * att.quantile(0.50)
	res.AttemptP99Ms = 1000 * att.quantile(0.99)
	res.SlowAttempts = att.slow()
	res.Attempts = att.byResult()
	res.TurnedDown = readTurnedDown(schedulerName).since(beforeTurnedDown)
	tr.fillEnds(res, topo, res.Snapshots[len(res.Snapshots)-1])
	// The invariant checker, as topodra-check runs it, on the cluster as
	// the run leaves it: each violation is an inconsistency of the run.
	if violations, err := invariant.Check(ctx, client); err != nil {
		res.InvariantViolations = -1
		res.Notes = append(res.Notes, fmt.Sprintf("invariant check not done: %v", err))
	} else {
		res.InvariantViolations = len(violations)
		for _, v := range violations {
			res.Errors = append(res.Errors, "invariant: "+v.String())
		}
	}
	if opts.AfterRun != nil {
		if err := opts.AfterRun(ctx, client, res); err != nil {
			return nil, nil, fmt.Errorf("after run: %w", err)
		}
	}
	res.WallSeconds = time.Since(start).Seconds()
	return res, topo, nil
}

// fillEnds fills in res the nodes' free capacity as snap, the end of
// the run, leaves it, and how many of the slots for 8-GPU and for 4-GPU
// jobs pods of that size still waiting could take (Fit8Waited,
// Fit4Waited).
func (t *tracker) fillEnds(res *Result, topo []NodeTopology, snap Snapshot) {
	res.Nodes = nodeEnds(topo, snap)
	for _, e := range res.Nodes {
		res.Fit8 += e.Fit8
		res.Fit4 += e.Fit4
		res.FreeGPUs += e.FreeGPUs
	}
	res.Fit8Waited = min(res.Fit8, t.pendingWithGPUs(8))
	res.Fit4Waited = min(res.Fit4, t.pendingAsking(4))
}

// topology lists the nodes' devices in display order.
func (t *tracker) topology(nodes []NodeSpec) []NodeTopology {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []NodeTopology
	for _, n := range nodes {
		nt := NodeTopology{Node: n.Name, Profile: n.Profile}
		for _, d := range t.nodeDevices[n.Name] {
			nt.Devices = append(nt.Devices, DeviceInfo{Key: d.Key, Name: d.Name, GPU: d.GPU, NUMA: d.NUMA, Root: d.Root, Clique: d.Clique})
		}
		out = append(out, nt)
	}
	return out
}

// drive runs the ticks of a workload against a ready cluster.
func drive(ctx context.Context, opts Options, workload *Workload, tr *tracker, client kubernetes.Interface, topo []NodeTopology, sched, schedulerName string, faults *injector) (*Result, error) {
	res := &Result{Scheduler: sched, SchedulerName: schedulerName, Pods: len(workload.Jobs)}
	ticks := workload.Ticks()
	checkpoints := map[int]bool{}
	for i := 1; i <= opts.Checkpoints; i++ {
		checkpoints[ticks*i/(opts.Checkpoints+1)] = true
	}
	lifetime := func(job int) int { return workload.Jobs[job].Lifetime }
	byTick := map[int][]int{}
	for i, j := range workload.Jobs {
		byTick[j.Arrival] = append(byTick[j.Arrival], i)
	}
	templates := map[string]*resourceapi.ResourceClaimTemplate{}
	for _, tmpl := range workload.Templates {
		templates[tmpl.Name] = tmpl
	}
	// stuck are pods that fit by count but were not bound within
	// retryTimeout; they are reported and not waited for again.
	stuck := map[string]bool{}
	var busy time.Duration
	boundOnArrival := 0
	blockShare, blockTicks := 0.0, 0
	progressEvery := max(1, ticks/10)
	lastProgress := time.Now()

	waitFor := func(what string, cond func() (bool, string)) error {
		var last string
		err := wait.PollUntilContextTimeout(ctx, pollInterval, opts.SettleTimeout, true, func(context.Context) (bool, error) {
			ok, why := cond()
			last = why
			return ok, nil
		})
		if err != nil {
			return fmt.Errorf("waiting for %s: %w; %s", what, err, last)
		}
		return nil
	}

	// deletePod deletes a pod at once; one already gone is no error.
	deletePod := func(ctx context.Context, name string) error {
		err := client.CoreV1().Pods(Namespace).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)})
		if err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete pod %s: %w", name, err)
		}
		return nil
	}
	// evictedGone waits until the pods evicted so far are gone and their
	// claims released.
	evictedGone := func(when string) error {
		return waitFor(when+": evicted pods to release their devices", func() (bool, string) { return tr.released(tr.evictedPods()) })
	}

	// Pods that the scheduler evicts (preemption) go at once, as their
	// kubelet would make them go, whatever the simulator waits for.
	kubeletCtx, stopKubelet := context.WithCancel(ctx)
	kubeletDone := make(chan struct{})
	go func() {
		defer close(kubeletDone)
		wait.UntilWithContext(kubeletCtx, func(ctx context.Context) {
			for _, name := range tr.evicted() {
				if deletePod(ctx, name) != nil {
					tr.undoEvicted(name)
				}
			}
		}, pollInterval)
	}()
	defer func() {
		stopKubelet()
		<-kubeletDone
	}()

	for tick := range ticks {
		tr.setTick(tick)
		// Departures: delete pods whose lifetime is over and wait until
		// their claims are released, so that arrivals see the freed devices.
		if gone := tr.expired(tick, lifetime); len(gone) > 0 {
			for _, name := range gone {
				if err := deletePod(ctx, name); err != nil {
					return nil, err
				}
			}
			if err := waitFor(fmt.Sprintf("tick %d: %d finished pods to release their devices", tick, len(gone)), func() (bool, string) { return tr.released(gone) }); err != nil {
				return nil, err
			}
		}
		// Pods evicted since the last tick are gone with their devices
		// before pending pods are judged.
		if err := evictedGone(fmt.Sprintf("tick %d", tick)); err != nil {
			return nil, err
		}
		// Pending pods that now fit by count: give the scheduler the chance
		// a real cluster would give it (ticks stand for minutes) before new
		// pods compete for the freed devices.
		if pending := tr.retryable(stuck); len(pending) > 0 {
			var last []string
			err := wait.PollUntilContextTimeout(ctx, pollInterval, retryTimeout, true, func(context.Context) (bool, error) {
				last = tr.retryable(stuck)
				return len(last) == 0 && tr.boundWithClaims(pending), nil
			})
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if err != nil {
				for _, name := range last {
					stuck[name] = true
					note := fmt.Sprintf("tick %d: pod %s fits by free device count but was not scheduled within %s", tick, name, retryTimeout)
					if word := tr.lastWord(name); word != "" {
						note += "; " + word
					}
					res.Notes = append(res.Notes, note)
					opts.progressf("[%s] %s", sched, note)
				}
			}
		}
		// Arrivals.
		if jobs := byTick[tick]; len(jobs) > 0 {
			t0 := time.Now()
			var names []string
			for _, j := range jobs {
				pod := workload.Jobs[j].Pod.DeepCopy()
				pod.Namespace = Namespace
				pod.ResourceVersion = ""
				pod.Spec.SchedulerName = schedulerName
				tr.created(pod, j, demandOf(pod, templates), gpusAsked(pod, templates))
				if _, err := client.CoreV1().Pods(Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
					return nil, fmt.Errorf("create pod %s: %w", pod.Name, err)
				}
				names = append(names, pod.Name)
			}
			if f, err := faults.strike(ctx, tick); err != nil {
				return nil, err
			} else if f != nil {
				// Throughput counts the scheduler's time, not the
				// injector's: a restart, a wait for watches.
				t0 = t0.Add(f.Took)
				res.Faults = append(res.Faults, *f)
				what, then := "restarted the scheduler", ""
				switch f.Kind {
				case FaultAgentRestart:
					what = "restarted the agent of " + f.Node
				case FaultAPIServerRestart:
					what = "restarted the kube-apiserver"
					then = fmt.Sprintf("; the simulator's informer and the scheduler watched again %.1fs after it was back", f.Reconnect.Seconds())
				case FaultGPUXID:
					what = "found no healthy GPU on " + f.Node + " for an XID"
					if f.Device != "" {
						what = fmt.Sprintf("made %s report XID %d", f.Device, f.XID)
						then = fmt.Sprintf("; the simulator saw its taint %s later", f.Tainted.Round(time.Millisecond))
					}
				}
				opts.progressf("[%s] tick %d: %s %s after the tick's pods were created%s", sched, tick, what, f.After, then)
			}
			if err := waitFor(fmt.Sprintf("tick %d: %d new pods to be bound or marked unschedulable", tick, len(names)), func() (bool, string) { return tr.settled(names) }); err != nil {
				return nil, err
			}
			busy += time.Since(t0)
			boundOnArrival += tr.boundAt(names, tick)
			tr.judgeWaits(names)
		}
		snap := tr.snapshot(fmt.Sprintf("tick %d", tick))
		if checkpoints[tick] {
			res.Snapshots = append(res.Snapshots, snap)
		}
		// Over the whole run (the end state depends on which jobs happen
		// to be running): how much of the free capacity sits in whole free
		// NUMA nodes.
		free, inBlocks := 0, 0
		_, _, waiting := tr.counts()
		point := TickPoint{Tick: tick, Waiting: waiting}
		for _, e := range nodeEnds(topo, snap) {
			free += e.FreeGPUs
			inBlocks += 4 * e.Fit4
			point.FreeNUMA += e.Fit4
			if e.GPUs > 0 && e.FreeGPUs == e.GPUs {
				point.FreeNodes++
			}
		}
		point.FreeGPUs = free
		if waiting > 0 {
			res.IdleWhileWaiting += free
		}
		res.Timeline = append(res.Timeline, point)
		if free > 0 {
			blockShare += float64(inBlocks) / float64(free)
			blockTicks++
		}
		if tick%progressEvery == progressEvery-1 || time.Since(lastProgress) > 5*time.Second {
			placed, running, pending := tr.counts()
			opts.progressf("[%s] tick %3d/%d  placed %3d  running %3d  pending %3d", sched, tick+1, ticks, placed, running, pending)
			lastProgress = time.Now()
		}
	}
	res.Stuck = len(stuck)
	// The end state is taken once the pods evicted are gone and their
	// devices given back.
	stopKubelet()
	<-kubeletDone
	for _, name := range tr.evicted() {
		if err := deletePod(ctx, name); err != nil {
			return nil, err
		}
	}
	if err := evictedGone("the end"); err != nil {
		return nil, err
	}
	res.Snapshots = append(res.Snapshots, tr.snapshot("end"))
	if blockTicks > 0 {
		res.FreeInWholeNUMA = blockShare / float64(blockTicks)
	}
	tr.fill(res)
	if busy > 0 {
		res.Throughput = float64(boundOnArrival) / busy.Seconds()
	}
	return res, nil
}

// boundAt counts the named pods bound at tick.
func (t *tracker) boundAt(names []string, tick int) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, name := range names {
		if ps := t.pods[name]; ps.Bound && ps.BoundTick == tick {
			n++
		}
	}
	return n
}

// fill adds counts, alignment, latency and consistency checks to res.
func (t *tracker) fill(res *Result) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var latencies []float64
	res.PendingPods = map[string]string{}
	for _, ps := range t.pods {
		switch {
		case ps.Bound:
			res.Placed++
			switch {
			case ps.Evicted:
				// Counted in Evicted below.
			case ps.Gone:
				res.Finished++
			default:
				res.RunningAtEnd++
			}
			if ps.BoundTick == ps.CreatedTick {
				latencies = append(latencies, float64(ps.BoundAt.Sub(ps.Created).Microseconds())/1000)
			}
		default:
			res.Pending++
			res.PendingPods[ps.Name] = ps.Message
		}
		// Waiting: ticks from arrival to binding (to the end of the run
		// for pods never bound), by GPUs per pod.
		wait := t.tick + 1 - ps.CreatedTick
		if ps.Bound {
			wait = ps.BoundTick - ps.CreatedTick
		}
		gpus := ps.GPUs
		if res.WaitByGPUs == nil {
			res.WaitByGPUs = map[int]*Wait{}
		}
		w := res.WaitByGPUs[gpus]
		if w == nil {
			w = &Wait{}
			res.WaitByGPUs[gpus] = w
		}
		w.Pods++
		w.Ticks += wait
		if wait > 0 && ps.WaitCause != "" {
			if res.WaitedBy == nil {
				res.WaitedBy = WaitedBy{}
			}
			res.WaitedBy.Add(ps.WaitSize, ps.WaitCause, 1)
		}
		res.PendingPodTicks += wait
		res.PendingGPUTicks += wait * gpus
		if ps.Priority > 0 {
			if res.PrioritizedWait == nil {
				res.PrioritizedWait = &Wait{}
			}
			res.PrioritizedWait.Pods++
			res.PrioritizedWait.Ticks += wait
		}
		if ps.Evicted {
			if res.Evicted == nil {
				res.Evicted = map[string]int{}
			}
			res.Evicted[cmp.Or(ps.EvictedBy, "unknown")]++
		}
	}
	res.LatencySamples = len(latencies)
	res.LatencyP50Ms = measure.ZeroIfNaN(measure.Quantile(latencies, 0.50))
	res.LatencyP99Ms = measure.ZeroIfNaN(measure.Quantile(latencies, 0.99))
	res.Placements = slices.Clone(t.placements)
	res.Alignment.Trivial = &TrivialCounts{}
	for _, p := range t.placements {
		res.Alignment.add(p)
		if ps := t.pods[p.Pod]; ps != nil && ps.Bound && ps.Node != p.Node {
			t.errs = append(t.errs, fmt.Sprintf("claim %s of pod %s allocated on %s, pod bound to %s", p.Claim, p.Pod, p.Node, ps.Node))
		}
	}
	res.AlignedFraction = res.Alignment.Fraction()
	res.Errors = append(slices.Clone(t.errs), t.conflictErrors()...)
	if t.reordered > 0 {
		res.Notes = append(res.Notes, fmt.Sprintf("%d devices were seen allocated again before the claim that held them was seen giving them back (the claim informer listed anew after it lost its watch): no conflict", t.reordered))
	}
	res.TaintedAllocations = slices.Clone(t.taintedAllocations)
	for _, a := range t.taintedAllocations {
		res.Notes = append(res.Notes, "allocated a tainted GPU (its agent would not prepare it): "+a.String())
	}
}

// probeScheduler waits until the scheduler binds a pod without claims. It
// proves that the scheduler started (it runs in process; a bad
// configuration makes it exit at once) and that its caches are warm before
// the workload starts.
func probeScheduler(ctx context.Context, client kubernetes.Interface, schedulerName, name string, timeout time.Duration) error {
	const ns = "sim-probe"
	if _, err := client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create namespace: %w", err)
	}
	pod := cluster.PodWithClaims(ns, name, schedulerName)
	if _, err := client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create probe pod: %w", err)
	}
	if _, err := cluster.WaitForPodScheduled(ctx, client, ns, pod.Name, timeout); err != nil {
		return fmt.Errorf("scheduler %s did not bind a probe pod (did it start? rerun with --log-file to see its log): %w", schedulerName, err)
	}
	if err := client.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}); err != nil {
		return fmt.Errorf("delete probe pod: %w", err)
	}
	return nil
}

// reconnectTimeout bounds the wait for the simulator's informers and the
// scheduler to watch again after the kube-apiserver restarted.
const reconnectTimeout = 3 * time.Minute

// awaitWatching waits, after the kube-apiserver came back, until the
// simulator's pod informer sees a new pod and the scheduler binds one:
// client-go's informers retry with a backoff that grows with each failure
// in a row (to a minute and more after a few restarts), and a tick that
// went on meanwhile would take the stale view of the simulator, or of the
// scheduler, for the scheduler's doing. n numbers the wait's pods.
func awaitWatching(ctx context.Context, client kubernetes.Interface, tr *tracker, schedulerName string, n int) error {
	name := fmt.Sprintf("%s%d", sentinelPrefix, n)
	sentinel := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: tr.namespace, Name: name},
		// No scheduler has this name: the pod is only to be seen.
		Spec: v1.PodSpec{SchedulerName: "sim-none", Containers: []v1.Container{{Name: "c", Image: "none"}}},
	}
	err := wait.PollUntilContextTimeout(ctx, pollInterval, reconnectTimeout, true, func(ctx context.Context) (bool, error) {
		if _, err := client.CoreV1().Pods(tr.namespace).Create(ctx, sentinel, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return false, nil
		}
		return tr.sees(name), nil
	})
	if err != nil {
		return fmt.Errorf("the simulator's pod informer did not see pod %s within %s: %w", name, reconnectTimeout, err)
	}
	if err := client.CoreV1().Pods(tr.namespace).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}); err != nil {
		return fmt.Errorf("delete pod %s: %w", name, err)
	}
	return probeScheduler(ctx, client, schedulerName, fmt.Sprintf("probe-%d", n), reconnectTimeout)
}

// headroomArgs are the smallPodHeadroomPercent and wholeNodeDevices of
// the TopologyDRA args of the profile named schedulerName in a
// KubeSchedulerConfiguration, defaults applied where it sets none (0 and
// the default where no profile has that name): the pods of the run carry
// that scheduler name.
func headroomArgs(config []byte, schedulerName string) (percent int32, whole int, err error) {
	var cfg struct {
		Profiles []struct {
			SchedulerName string `json:"schedulerName"`
			PluginConfig  []struct {
				Name string          `json:"name"`
				Args json.RawMessage `json:"args"`
			} `json:"pluginConfig"`
		} `json:"profiles"`
	}
	if err := yaml.Unmarshal(config, &cfg); err != nil {
		return 0, 0, fmt.Errorf("scheduler configuration: %w", err)
	}
	whole = topodrav1.DefaultWholeNodeDevices
	for _, p := range cfg.Profiles {
		if p.SchedulerName != schedulerName {
			continue
		}
		args := &topodrav1.TopologyDRAArgs{}
		for _, pc := range p.PluginConfig {
			if pc.Name == topologydra.Name && len(pc.Args) > 0 {
				if err := json.Unmarshal(pc.Args, args); err != nil {
					return 0, 0, fmt.Errorf("scheduler configuration: TopologyDRA args: %w", err)
				}
			}
		}
		topodrav1.SetDefaults(args)
		return *args.SmallPodHeadroomPercent, int(*args.WholeNodeDevices), nil
	}
	return 0, whole, nil
}

// withShortBackoff sets the pod backoff of a KubeSchedulerConfiguration to
// 1 s (initial and maximum). Ticks are compressed time: with the default
// maximum of 10 s a pod that failed a few times would sit out many ticks
// after devices were freed, which a real cluster, whose ticks are minutes
// long, would not see. Both schedulers get the same setting.
func withShortBackoff(config []byte) ([]byte, error) {
	var obj map[string]any
	if err := yaml.Unmarshal(config, &obj); err != nil {
		return nil, fmt.Errorf("parse scheduler config: %w", err)
	}
	obj["podInitialBackoffSeconds"] = 1
	obj["podMaxBackoffSeconds"] = 1
	out, err := yaml.Marshal(obj)
	if err != nil {
		return nil, fmt.Errorf("write scheduler config: %w", err)
	}
	return out, nil
}
