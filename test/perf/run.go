package perf

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/component-base/metrics/legacyregistry"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/config"
	"github.com/topodra/topodra/pkg/cluster"
	"github.com/topodra/topodra/pkg/measure"
	"github.com/topodra/topodra/test/integration/framework"
)

// Scheduler names as they appear in results.
const (
	Topodra = "topodra"
	Stock   = "stock"
)

// profileOf is the scheduler profile (schedulerName) of each scheduler.
var profileOf = map[string]string{Topodra: "topodra-scheduler", Stock: "default-scheduler"}

// Options configure Run.
type Options struct {
	// Schedulers to compare, in order; default topodra then stock.
	Schedulers []string
	// Progress receives one line per step; nil discards.
	Progress io.Writer
	// Logger is used by the control plane and schedulers.
	Logger klog.Logger
	// TopodraConfig replaces config/scheduler-config.yaml for topodra
	// (to compare plugin arguments); its profile must be topodra-scheduler.
	TopodraConfig []byte
	// CPUProfileDir, if set, receives the CPU profile of each measured
	// interval as <workload>-<scheduler>.pprof.
	CPUProfileDir string
	// SteadyRounds runs each steady-state workload this many times per
	// scheduler, alternating the order (topodra, stock, stock, topodra,
	// ...), and reports the rounds together; at least 1.
	SteadyRounds int
}

// Result is one workload run by one scheduler. The JSON keys workload,
// scheduler, pods, seconds, podsPerSecond, p50Ms, p99Ms and alignedPercent
// are the stable interface (`make bench BENCH_OUT=...`); the rest is
// detail.
type Result struct {
	Workload  string `json:"workload"`
	Scheduler string `json:"scheduler"`
	// Pods is the number of measured pods that got bound.
	Pods int `json:"pods"`
	// Seconds is the measured time: from the first measured pod's creation
	// to the last bind (burst), or the steady-state duration.
	Seconds       float64 `json:"seconds"`
	PodsPerSecond float64 `json:"podsPerSecond"`
	// P50Ms and P99Ms are scheduling-attempt latencies (all results),
	// from the scheduler's attempt histogram: the scheduling cycle plus
	// the binding cycle (PreBind writes the claims' status, Bind the pod)
	// of scheduled pods, so API round trips are included.
	P50Ms float64 `json:"p50Ms"`
	P99Ms float64 `json:"p99Ms"`
	// AlgorithmP50Ms and AlgorithmP99Ms are the scheduling algorithm
	// alone (PreFilter to Score over all nodes, no API calls): where the
	// DRA plugins differ.
	AlgorithmP50Ms float64 `json:"algorithmP50Ms"`
	AlgorithmP99Ms float64 `json:"algorithmP99Ms"`
	// AlignedPercent: multi-device claims placed in one topology domain,
	// out of those for which such a placement existed; nil where the
	// workload does not measure it.
	AlignedPercent *float64 `json:"alignedPercent"`

	Mode string `json:"mode"`
	// Rounds is how many runs this result sums up (see Options.SteadyRounds).
	Rounds      int `json:"rounds"`
	Unscheduled int `json:"unscheduled"`
	Attempts    int `json:"attempts"`
	AlignedOf   int `json:"alignedEligible,omitempty"`
	// Throughput percentiles over 1 s windows (upstream's
	// SchedulingThroughput Perc50/90/99: higher percentile = faster window).
	ThroughputP50 float64 `json:"throughputP50"`
	ThroughputP90 float64 `json:"throughputP90"`
	ThroughputP99 float64 `json:"throughputP99"`
	// SchedulerCPUSeconds is the CPU time of the scheduler's goroutines
	// during the measured interval (see cpuprofile.go; -1 if unknown), and
	// SchedulerCPUMsPerPod that per bound pod: the cost of scheduling
	// independent of how busy the machine's other components are.
	SchedulerCPUSeconds  float64 `json:"schedulerCpuSeconds"`
	SchedulerCPUMsPerPod float64 `json:"schedulerCpuMsPerPod"`
	// ProcessCPUSeconds is the whole process' CPU time (apiserver, etcd,
	// claim controller, harness, scheduler) during the measured interval.
	ProcessCPUSeconds float64 `json:"processCpuSeconds"`
	// SchedulerHeapMB is the live heap (after GC) with the scheduler
	// running at the end of the run minus the live heap right after it
	// was stopped: what the scheduler held.
	SchedulerHeapMB float64 `json:"schedulerHeapMB"`
	// ProcessRSSMB is the whole process (apiserver, etcd, controller,
	// harness and the scheduler) at the end of the run.
	ProcessRSSMB float64 `json:"processRssMB"`
	// Misplaced lists a few claims that were not aligned although an
	// aligned placement existed.
	Misplaced []string `json:"misplaced,omitempty"`
}

func (o *Options) progressf(format string, args ...any) {
	if o.Progress != nil {
		_, _ = fmt.Fprintf(o.Progress, format+"\n", args...)
	}
}

// RunWorkload starts a control plane, sets up the workload's cluster once
// and runs it through each scheduler in turn. Before each scheduler the
// measured namespace of the previous one is emptied and its claims are
// gone, so both see the same nodes, slices and pre-allocated claims.
func RunWorkload(ctx context.Context, opts Options, w Workload) (results []Result, err error) {
	if len(opts.Schedulers) == 0 {
		opts.Schedulers = []string{Topodra, Stock}
	}
	logger := opts.Logger
	ctx = klog.NewContext(ctx, logger)
	start := time.Now()
	cp, err := cluster.Start(ctx, cluster.Options{})
	if err != nil {
		return nil, err
	}
	defer cp.Stop()
	if _, err := cp.StartClaimController(ctx); err != nil {
		return nil, err
	}
	if err := setUpCluster(ctx, cp.Client, &w); err != nil {
		return nil, err
	}
	opts.progressf("%s: control plane and %d nodes, %d pre-allocated claims ready in %.1fs", w.Name, w.Nodes, w.InitClaims, time.Since(start).Seconds())
	// Whoever runs first meets an apiserver still busy with the set-up;
	// steady-state runs are short, so they alternate the order over
	// several rounds.
	rounds := 1
	if w.Mode == Steady && opts.SteadyRounds > 1 {
		rounds = opts.SteadyRounds
	}
	perScheduler := map[string][]Result{}
	for round := range rounds {
		order := slices.Clone(opts.Schedulers)
		if round%2 == 1 {
			slices.Reverse(order)
		}
		for _, sched := range order {
			res, err := runScheduler(ctx, opts, cp, &w, sched, round)
			if err != nil {
				return results, fmt.Errorf("%s with %s: %w", w.Name, sched, err)
			}
			label := sched
			if rounds > 1 {
				label = fmt.Sprintf("%s (round %d of %d)", sched, round+1, rounds)
			}
			opts.progressf("%s: %s: %d pods in %.1fs = %.1f pods/s, attempt p50 %.1fms p99 %.1fms, algorithm p50 %.2fms p99 %.2fms, scheduler CPU %.2fs (%.1f ms/pod) of %.1fs%s, heap %.0f MiB",
				w.Name, label, res.Pods, res.Seconds, res.PodsPerSecond, res.P50Ms, res.P99Ms, res.AlgorithmP50Ms, res.AlgorithmP99Ms, res.SchedulerCPUSeconds, res.SchedulerCPUMsPerPod, res.ProcessCPUSeconds, alignedText(res), res.SchedulerHeapMB)
			perScheduler[sched] = append(perScheduler[sched], *res)
		}
	}
	for _, sched := range opts.Schedulers {
		results = append(results, mergeRounds(perScheduler[sched]))
	}
	return results, nil
}

// mergeRounds reports several rounds of one scheduler as one result: pods,
// seconds and CPU add up (so pods/s and CPU per pod are over all rounds),
// latency and throughput percentiles are the rounds' mean, memory the
// largest.
func mergeRounds(rounds []Result) Result {
	m := rounds[0]
	m.Rounds = len(rounds)
	if len(rounds) == 1 {
		return m
	}
	aligned, eligible := 0.0, 0
	for i, r := range rounds {
		if r.AlignedPercent != nil {
			aligned += *r.AlignedPercent * float64(r.AlignedOf) / 100
			eligible += r.AlignedOf
		}
		if i == 0 {
			continue
		}
		// Sums here, divided into means below.
		m.P50Ms += r.P50Ms
		m.P99Ms += r.P99Ms
		m.AlgorithmP50Ms += r.AlgorithmP50Ms
		m.AlgorithmP99Ms += r.AlgorithmP99Ms
		m.ThroughputP50 += r.ThroughputP50
		m.ThroughputP90 += r.ThroughputP90
		m.ThroughputP99 += r.ThroughputP99
		m.Pods += r.Pods
		m.Seconds += r.Seconds
		m.Unscheduled += r.Unscheduled
		m.Attempts += r.Attempts
		m.SchedulerCPUSeconds += r.SchedulerCPUSeconds
		m.ProcessCPUSeconds += r.ProcessCPUSeconds
		m.SchedulerHeapMB = max(m.SchedulerHeapMB, r.SchedulerHeapMB)
		m.ProcessRSSMB = max(m.ProcessRSSMB, r.ProcessRSSMB)
		m.Misplaced = append(m.Misplaced, r.Misplaced...)
	}
	n := float64(len(rounds))
	for _, f := range []*float64{&m.P50Ms, &m.P99Ms, &m.AlgorithmP50Ms, &m.AlgorithmP99Ms, &m.ThroughputP50, &m.ThroughputP90, &m.ThroughputP99} {
		*f /= n
	}
	if m.AlignedPercent != nil && eligible > 0 {
		m.AlignedPercent = ptr.To(100 * aligned / float64(eligible))
		m.AlignedOf = eligible
	}
	if m.Seconds > 0 {
		m.PodsPerSecond = float64(m.Pods) / m.Seconds
	}
	if m.Pods > 0 && m.SchedulerCPUSeconds >= 0 {
		m.SchedulerCPUMsPerPod = 1000 * m.SchedulerCPUSeconds / float64(m.Pods)
	}
	return m
}

func alignedText(r *Result) string {
	s := ""
	if r.AlignedPercent != nil {
		s += fmt.Sprintf(", aligned %.1f%% of %d", *r.AlignedPercent, r.AlignedOf)
	}
	if r.Unscheduled > 0 {
		s += fmt.Sprintf(", %d unscheduled", r.Unscheduled)
	}
	return s
}

func runScheduler(ctx context.Context, opts Options, cp *cluster.Cluster, w *Workload, sched string, round int) (*Result, error) {
	profile, ok := profileOf[sched]
	if !ok {
		return nil, fmt.Errorf("unknown scheduler %q", sched)
	}
	client := cp.Client
	ns := "test-" + sched
	if round > 0 {
		ns = fmt.Sprintf("%s-%d", ns, round+1)
	}
	if _, err := client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("create namespace: %w", err)
	}
	if err := createTemplates(ctx, client, ns, w); err != nil {
		return nil, err
	}

	// Steady state: each bound pod is deleted and replaced.
	bound := make(chan *v1.Pod, 1000)
	var onBind func(*v1.Pod)
	if w.Mode == Steady {
		onBind = func(p *v1.Pod) {
			select {
			case bound <- p:
			default: // the driver loop is behind; it only needs the count
			}
		}
	}
	tr := newTracker(ns, w.Shape, w.Nodes, onBind)
	if err := tr.start(ctx, client); err != nil {
		return nil, err
	}
	defer tr.shutdown()

	// Start the scheduler with a pprof label, so a CPU profile of the run
	// can be split by scheduler (go tool pprof -tagfocus scheduler=topodra).
	var stop func()
	var err error
	pprof.Do(ctx, pprof.Labels("scheduler", sched), func(ctx context.Context) {
		so := cluster.SchedulerOptions{Name: sched, Stock: sched == Stock}
		if sched == Topodra {
			so.Config = config.SchedulerConfig
			if len(opts.TopodraConfig) > 0 {
				so.Config = opts.TopodraConfig
			}
		}
		stop, err = cp.StartScheduler(ctx, so)
	})
	if err != nil {
		return nil, err
	}
	stopped := false
	defer func() {
		if !stopped {
			stop()
		}
	}()
	if err := warmUp(ctx, client, profile, sched); err != nil {
		return nil, err
	}
	background := ns + "-background"
	if len(w.Background) > 0 {
		start := time.Now()
		if err := runBackground(ctx, client, background, profile, w); err != nil {
			return nil, err
		}
		opts.progressf("%s: %s: %d background pods bound in %.1fs", w.Name, sched, len(shuffled(w.Background)), time.Since(start).Seconds())
	}

	before, err := measure.Gather(legacyregistry.DefaultGatherer, attemptMetric, map[string]string{"profile": profile})
	if err != nil {
		return nil, err
	}
	algoBefore, err := measure.Gather(legacyregistry.DefaultGatherer, algorithmMetric, nil)
	if err != nil {
		return nil, err
	}
	res := &Result{Workload: w.Name, Scheduler: sched, Mode: string(w.Mode)}
	prof := measure.StartCPUProfile()
	var t0, end time.Time
	switch w.Mode {
	case Burst:
		t0, end, err = runBurst(ctx, client, ns, profile, w, tr)
		res.Unscheduled = w.podCount() - tr.boundCount()
	case Steady:
		t0, end, err = runSteady(ctx, client, ns, profile, w, bound)
	}
	cpu, processCPU, raw, cpuErr := prof.Stop("scheduler", sched)
	if err != nil {
		return nil, err
	}
	if cpuErr != nil {
		return nil, cpuErr
	}
	res.SchedulerCPUSeconds, res.ProcessCPUSeconds = cpu, processCPU
	if opts.CPUProfileDir != "" && raw != nil {
		name := strings.NewReplacer("/", "_", " ", "_").Replace(w.Name) + "-" + sched
		if round > 0 {
			name += fmt.Sprintf("-round%d", round+1)
		}
		name += ".pprof"
		if err := os.WriteFile(filepath.Join(opts.CPUProfileDir, name), raw, 0o644); err != nil {
			return nil, fmt.Errorf("write profile: %w", err)
		}
	}
	binds := tr.bindTimes()
	for _, b := range binds {
		if !b.After(end) {
			res.Pods++
		}
	}
	// The scheduler observes an attempt once its binding cycle has
	// returned, which may be after the binding is seen: wait a little for
	// the attempts of the pods seen bound.
	after, err := measure.Gather(legacyregistry.DefaultGatherer, attemptMetric, map[string]string{"profile": profile})
	for deadline := time.Now().Add(2 * time.Second); err == nil && int(after.Sub(before).Count()) < res.Pods && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
		after, err = measure.Gather(legacyregistry.DefaultGatherer, attemptMetric, map[string]string{"profile": profile})
	}
	if err != nil {
		return nil, err
	}
	algoAfter, err := measure.Gather(legacyregistry.DefaultGatherer, algorithmMetric, nil)
	if err != nil {
		return nil, err
	}
	res.Seconds = end.Sub(t0).Seconds()
	if res.Pods > 0 && cpu >= 0 {
		res.SchedulerCPUMsPerPod = 1000 * cpu / float64(res.Pods)
	}
	if res.Seconds > 0 {
		res.PodsPerSecond = float64(res.Pods) / res.Seconds
	}
	rates := windowRates(binds, t0, end, time.Second)
	res.ThroughputP50, res.ThroughputP90, res.ThroughputP99 = measure.Quantile(rates, 0.50), measure.Quantile(rates, 0.90), measure.Quantile(rates, 0.99)
	h := after.Sub(before)
	res.Attempts = int(h.Count())
	res.P50Ms, res.P99Ms = h.Quantile(0.50)*1000, h.Quantile(0.99)*1000
	algo := algoAfter.Sub(algoBefore)
	res.AlgorithmP50Ms, res.AlgorithmP99Ms = algo.Quantile(0.50)*1000, algo.Quantile(0.99)*1000
	if w.Aligned {
		aligned, eligible, examples := tr.alignment()
		if eligible > 0 {
			res.AlignedPercent = ptr.To(100 * float64(aligned) / float64(eligible))
		}
		res.AlignedOf = eligible
		res.Misplaced = examples
	}

	// Memory: live heap with the scheduler, minus without it, at the same
	// cluster state.
	withScheduler := liveHeapMB()
	res.ProcessRSSMB, _ = processRSSMB()
	stop()
	stopped = true
	res.SchedulerHeapMB = withScheduler - liveHeapMB()

	// Leave the cluster as it was for the next scheduler.
	if err := drain(ctx, client, ns); err != nil {
		return nil, err
	}
	if len(w.Background) > 0 {
		if err := drain(ctx, client, background); err != nil {
			return nil, err
		}
	}
	sanitize(res)
	return res, nil
}

// sanitize turns NaN (no samples) into 0 so the JSON stays valid.
func sanitize(r *Result) {
	for _, f := range []*float64{&r.P50Ms, &r.P99Ms, &r.AlgorithmP50Ms, &r.AlgorithmP99Ms, &r.ThroughputP50, &r.ThroughputP90, &r.ThroughputP99} {
		*f = measure.ZeroIfNaN(*f)
	}
}

// warmUp schedules one pod without claims and deletes it: the scheduler
// has synced its informers and runs.
func warmUp(ctx context.Context, client kubernetes.Interface, profile, sched string) error {
	ns := "warmup-" + sched
	if _, err := client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create namespace: %w", err)
	}
	pod := framework.PodWithClaims(ns, "warmup", profile)
	if _, err := client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create warm-up pod: %w", err)
	}
	if _, err := framework.WaitForPodScheduled(ctx, client, ns, pod.Name, 2*time.Minute); err != nil {
		return fmt.Errorf("scheduler did not start: %w", err)
	}
	return deletePod(ctx, client, ns, pod.Name)
}

func deletePod(ctx context.Context, client kubernetes.Interface, ns, name string) error {
	err := client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{
		GracePeriodSeconds: ptr.To[int64](0),
		PropagationPolicy:  ptr.To(metav1.DeletePropagationBackground),
	})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete pod %s/%s: %w", ns, name, err)
	}
	return nil
}

// runBurst creates all measured pods at once and waits until all are
// bound or none got bound for w.Stall.
func runBurst(ctx context.Context, client kubernetes.Interface, ns, profile string, w *Workload, tr *tracker) (start, end time.Time, err error) {
	templates := w.podTemplates()
	start = time.Now()
	err = parallel(ctx, len(templates), 16, func(ctx context.Context, i int) error {
		_, err := client.CoreV1().Pods(ns).Create(ctx, w.newPod(ns, profile, templates[i]), metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("create pod: %w", err)
		}
		return nil
	})
	if err != nil {
		return start, start, err
	}
	lastCount, lastChange := -1, time.Now()
	for {
		n := tr.boundCount()
		if n != lastCount {
			lastCount, lastChange = n, time.Now()
		}
		if n >= len(templates) || time.Since(lastChange) > w.Stall {
			break
		}
		select {
		case <-ctx.Done():
			return start, start, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	end = start
	if binds := tr.bindTimes(); len(binds) > 0 {
		end = binds[len(binds)-1]
	}
	return start, end, nil
}

// runBackground creates the workload's background pods in namespace and
// waits until all are bound: the state the measured pods start from.
func runBackground(ctx context.Context, client kubernetes.Interface, namespace, profile string, w *Workload) error {
	if _, err := client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create namespace: %w", err)
	}
	if err := createTemplates(ctx, client, namespace, w); err != nil {
		return err
	}
	templates := shuffled(w.Background)
	err := parallel(ctx, len(templates), 16, func(ctx context.Context, i int) error {
		if _, err := client.CoreV1().Pods(namespace).Create(ctx, backgroundPod(namespace, profile, templates[i]), metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create background pod: %w", err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	bound := 0
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 5*time.Minute, true, func(ctx context.Context) (bool, error) {
		pods, err := client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		bound = 0
		for _, p := range pods.Items {
			if p.Spec.NodeName != "" {
				bound++
			}
		}
		return bound == len(templates), nil
	})
	if err != nil {
		return fmt.Errorf("background: %d of %d pods bound: %w", bound, len(templates), err)
	}
	return nil
}

// runSteady keeps w.Pods pods pending for w.Duration: each bound pod is
// deleted (its generated claim goes with it) and replaced by a new one,
// like upstream's createPodsOp with steadyState.
func runSteady(ctx context.Context, client kubernetes.Interface, ns, profile string, w *Workload, bound <-chan *v1.Pod) (start, end time.Time, err error) {
	create := func(ctx context.Context) error {
		_, err := client.CoreV1().Pods(ns).Create(ctx, w.newPod(ns, profile, w.Templates[0].Name), metav1.CreateOptions{})
		return err
	}
	start = time.Now()
	if err := parallel(ctx, w.Pods, 16, func(ctx context.Context, _ int) error { return create(ctx) }); err != nil {
		return start, start, fmt.Errorf("create pods: %w", err)
	}
	runCtx, cancel := context.WithTimeout(ctx, w.Duration)
	defer cancel()
	for {
		select {
		case <-runCtx.Done():
			if ctx.Err() != nil {
				return start, start, ctx.Err()
			}
			return start, start.Add(w.Duration), nil
		case pod := <-bound:
			// The calls use ctx, not runCtx: the client's rate limiter
			// fails calls that would end after runCtx's deadline.
			if err := deletePod(ctx, client, ns, pod.Name); err != nil {
				return start, start, err
			}
			if err := create(ctx); err != nil {
				return start, start, fmt.Errorf("create pod: %w", err)
			}
		}
	}
}

// drain deletes the measured pods, waits until the claim controller has
// deallocated their claims (it does so when a pod is gone; deleting the
// generated claims is the garbage collector's job, which does not run
// here) and deletes the claims, so the next scheduler starts from the
// pre-allocated state.
func drain(ctx context.Context, client kubernetes.Interface, ns string) error {
	err := client.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("delete pods: %w", err)
	}
	var left, allocated int
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		pods, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		claims, err := client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		left, allocated = len(pods.Items), 0
		for _, c := range claims.Items {
			if c.Status.Allocation != nil || len(c.Finalizers) > 0 {
				allocated++
			}
		}
		return left == 0 && allocated == 0, nil
	})
	if err != nil {
		return fmt.Errorf("drain namespace %s: %d pods and %d allocated claims left: %w", ns, left, allocated, err)
	}
	if err := client.ResourceV1().ResourceClaims(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		return fmt.Errorf("delete claims: %w", err)
	}
	return nil
}
