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
)

// faultKinds are the kinds of fault, in the order a run's faults take.
var faultKinds = []string{FaultSchedulerRestart, FaultAgentRestart, FaultAPIServerRestart}

// Fault is one fault injected into a run.
type Fault struct {
	Tick int    `json:"tick"`
	Kind string `json:"kind"`
	// Node is the node whose agent restarted; empty for the scheduler.
	Node string `json:"node,omitempty"`
	// After is how long after the tick's new pods were created the fault
	// struck: the scheduler was placing them.
	After time.Duration `json:"afterNs"`
	// Reconnect is, for a kube-apiserver restart, how long after it was
	// back the simulator's informer and the scheduler took to watch again
	// (client-go's backoff).
	Reconnect time.Duration `json:"reconnectNs,omitempty"`
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
	nodes            int
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
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(after):
	}
	f := &Fault{Tick: tick, Kind: kind, After: after}
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
	}
	return f, nil
}

// faultsText sums up a run's faults for the table: "2 scheduler, 1 agent,
// 1 API server restarts".
func faultsText(res Result) string {
	n := map[string]int{}
	for _, f := range res.Faults {
		n[f.Kind]++
	}
	return fmt.Sprintf("%d scheduler, %d agent, %d API server restarts", n[FaultSchedulerRestart], n[FaultAgentRestart], n[FaultAPIServerRestart])
}
