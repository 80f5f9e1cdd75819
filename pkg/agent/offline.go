package agent

import (
	"context"
	"errors"

	"github.com/topodra/topodra/pkg/agent/discovery"
)

// NewOffline returns an agent that only prepares and unprepares claims,
// for the GPUs of inv, with its checkpoint in opts.StateDir and CDI specs
// in opts.CDIDir (NodeName, StateDir and CDIDir are required). It registers
// with no kubelet, publishes nothing, watches nothing and talks to no API
// server: KubeClient, Discovery and the publishing options are ignored.
// PrepareResourceClaims and UnprepareResourceClaims behave as on a running
// agent, so that a node can be checked without a cluster (the node agent's
// --dry-run --show-cdi prepares a claim with it). Stop releases it.
func NewOffline(ctx context.Context, opts Options, inv *discovery.Inventory) (*Agent, error) {
	if opts.NodeName == "" {
		return nil, errors.New("node name must be set")
	}
	if opts.StateDir == "" || opts.CDIDir == "" {
		return nil, errors.New("state and CDI directories must be set")
	}
	if inv == nil {
		return nil, errors.New("inventory must be set")
	}
	opts.setNames()
	a := &Agent{
		opts:          opts,
		inventory:     inv,
		faults:        map[string]discovery.HealthEvent{},
		healthChanged: make(chan struct{}),
		started:       make(chan struct{}),
		startDone:     make(chan struct{}),
	}
	close(a.started)
	close(a.startDone)
	a.ctx, a.cancel = context.WithCancelCause(ctx)
	if err := a.openState(ctx); err != nil {
		a.cancel(err)
		return nil, err
	}
	return a, nil
}
