package sim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"
)

// Fault kinds that Options.Faults injects.
const (
	// FaultSchedulerRestart stops the scheduler, as a crash or a lost
	// lease would (whatever it had in flight is dropped), and starts a
	// new one.
	FaultSchedulerRestart = "scheduler-restart"
	// FaultAgentRestart stops a node's agent and starts a new one on the
	// same machine, which takes its ResourceSlices over.
	FaultAgentRestart = "agent-restart"
	// FaultAPIServerRestart stops the kube-apiserver and starts it again
	// on the same etcd: every component loses its connections and
	// watches meanwhile.
	FaultAPIServerRestart = "apiserver-restart"
	// FaultGPUXID makes a healthy GPU of a node report a critical XID
	// through NVML: its agent taints it, the scheduler must not allocate
	// it from then on, and it stays unhealthy for the rest of the run
	// (the pod that uses it runs on, as under a NoSchedule taint).
	FaultGPUXID = "gpu-xid"
)

// faultKinds are the kinds of fault, in the order a run's faults take.
var faultKinds = []string{FaultSchedulerRestart, FaultAgentRestart, FaultGPUXID, FaultAPIServerRestart}

// faultXIDs are the critical XIDs that FaultGPUXID picks from.
var faultXIDs = []uint64{48, 74, 79, 94, 95, 119}

// Fault is one fault injected into a run.
type Fault struct {
	Tick int    `json:"tick"`
	Kind string `json:"kind"`
	// Node is the node whose agent restarted or whose GPU failed; empty
	// for the scheduler and the kube-apiserver.
	Node string `json:"node,omitempty"`
	// Device and XID are, for a GPU fault, the device that failed and
	// the XID it reported; Tainted is how long after the XID the
	// simulator saw the device's taint in its ResourceSlice. Device is
	// empty where the node had no healthy GPU left.
	Device  string        `json:"device,omitempty"`
	XID     uint64        `json:"xid,omitempty"`
	Tainted time.Duration `json:"taintedNs,omitempty"`
	// After is how long after the tick's new pods were created the fault
	// struck: the scheduler was placing them.
	After time.Duration `json:"afterNs"`
	// Reconnect is, for a kube-apiserver restart, how long after it was
	// back the simulator's informer and the scheduler took to watch again
	// (client-go's backoff).
	Reconnect time.Duration `json:"reconnectNs,omitempty"`
	// Took is how long injecting the fault took, from its strike to the
	// components' recovery that the simulator waits for (a restart, the
	// taint seen, the watches back): the run's throughput leaves it out.
	Took time.Duration `json:"tookNs"`
}

// faultPlan says which fault strikes at which tick.
type faultPlan struct {
	at  map[int]string
	rng *rand.Rand
}

// planFaults picks n of the ticks at which pods arrive, by the seed, and
// gives them the kinds of faultKinds in turn.
// Both schedulers of a run get the same plan; n beyond the arrival ticks
// is cut to them.
func planFaults(n int, seed int64, arrivals []int) *faultPlan {
	p := &faultPlan{at: map[int]string{}, rng: rand.New(rand.NewPCG(uint64(seed), 0xfa17))}
	if n <= 0 {
		return p
	}
	ticks := slices.Clone(arrivals)
	slices.Sort(ticks)
	ticks = slices.Compact(ticks)
	p.rng.Shuffle(len(ticks), func(i, j int) { ticks[i], ticks[j] = ticks[j], ticks[i] })
	ticks = ticks[:min(n, len(ticks))]
	slices.Sort(ticks)
	for i, tick := range ticks {
		p.at[tick] = faultKinds[i%len(faultKinds)]
	}
	return p
}

// injector carries out a run's faults.
type injector struct {
	plan *faultPlan
	// restartScheduler stops the run's scheduler and starts another.
	restartScheduler func(ctx context.Context) error
	// restartAgent stops the agent of node i and starts another.
	restartAgent func(ctx context.Context, i int) (node string, err error)
	// restartAPIServer stops the kube-apiserver, starts it again and
	// waits until the components watch again, which it times; n numbers
	// the fault.
	restartAPIServer func(ctx context.Context, n int) (time.Duration, error)
	// failGPU makes the GPU of node i that pick chooses among its
	// healthy ones (pick(n) is in [0, n)) report xid, and waits until
	// its taint is published; device is empty where the node has no
	// healthy GPU.
	failGPU func(ctx context.Context, i int, pick func(n int) int, xid uint64) (node, device string, tainted time.Duration, err error)
	nodes   int
}

// strike injects the fault planned for tick, if any, a few milliseconds
// (chosen by the seed) after the tick's pods were created, so that it
// hits the scheduler at work on them.
func (in *injector) strike(ctx context.Context, tick int) (*Fault, error) {
	if in == nil {
		return nil, nil
	}
	kind, ok := in.plan.at[tick]
	if !ok {
		return nil, nil
	}
	after := time.Duration(in.plan.rng.IntN(30)) * time.Millisecond
	node := in.plan.rng.IntN(max(in.nodes, 1))
	// Drawn for every fault, so that the draws of later faults do not
	// depend on which GPUs are left healthy.
	gpuDraw := in.plan.rng.Uint64()
	xid := faultXIDs[in.plan.rng.IntN(len(faultXIDs))]
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(after):
	}
	f := &Fault{Tick: tick, Kind: kind, After: after}
	start := time.Now()
	defer func() { f.Took = time.Since(start) }()
	switch kind {
	case FaultSchedulerRestart:
		if err := in.restartScheduler(ctx); err != nil {
			return nil, fmt.Errorf("tick %d: restart the scheduler: %w", tick, err)
		}
	case FaultAgentRestart:
		name, err := in.restartAgent(ctx, node)
		if err != nil {
			return nil, fmt.Errorf("tick %d: restart the agent of %s: %w", tick, name, err)
		}
		f.Node = name
	case FaultAPIServerRestart:
		back, err := in.restartAPIServer(ctx, tick)
		if err != nil {
			return nil, fmt.Errorf("tick %d: restart the kube-apiserver: %w", tick, err)
		}
		f.Reconnect = back
	case FaultGPUXID:
		pick := func(n int) int { return int(gpuDraw % uint64(n)) }
		name, device, tainted, err := in.failGPU(ctx, node, pick, xid)
		if err != nil {
			return nil, fmt.Errorf("tick %d: XID %d on a GPU of %s: %w", tick, xid, name, err)
		}
		f.Node, f.Device, f.Tainted = name, device, tainted
		if device != "" {
			f.XID = xid
		}
	}
	return f, nil
}

// faultsText sums up a run's faults for the table: "2 scheduler, 1 agent,
// 1 API server restarts; 1 GPU XID".
func faultsText(res Result) string {
	n := map[string]int{}
	xids := 0
	for _, f := range res.Faults {
		n[f.Kind]++
		if f.Kind == FaultGPUXID && f.Device != "" {
			xids++
		}
	}
	text := fmt.Sprintf("%d scheduler, %d agent, %d API server restarts", n[FaultSchedulerRestart], n[FaultAgentRestart], n[FaultAPIServerRestart])
	if n[FaultGPUXID] > 0 {
		text += fmt.Sprintf("; %d GPU XID", xids)
		if xids != 1 {
			text += "s"
		}
	}
	return text
}
