package cluster

import (
	"context"
	"fmt"
	"sync"

	"k8s.io/client-go/informers"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/controller/resourceclaim"
)

// StartClaimController runs the upstream ResourceClaim controller, which
// creates claims from ResourceClaimTemplates for pods and removes pods from
// reservedFor when they are done. It runs until ctx ends or the returned
// function is called; that function waits until it has stopped, may be
// called more than once, and is also called by Stop.
func (c *Cluster) StartClaimController(ctx context.Context) (func(), error) {
	ctx, cancel := context.WithCancel(ctx)
	logger := klog.FromContext(ctx).WithName("resourceclaim-controller")
	factory := informers.NewSharedInformerFactory(c.Client, 0)
	ctrl, err := resourceclaim.NewController(logger, c.Client,
		factory.Core().V1().Pods(),
		nil, // PodGroups: only used with the GenericWorkload feature, which is off.
		factory.Resource().V1().ResourceClaims(),
		factory.Resource().V1().ResourceClaimTemplates())
	if err != nil {
		cancel()
		return nil, fmt.Errorf("create resourceclaim controller: %w", err)
	}
	return c.runController(ctx, cancel, factory, func() { ctrl.Run(klog.NewContext(ctx, logger), 5) }), nil
}

// runController starts factory and run, which runs a controller until ctx
// (which cancel ends) is done, and returns the function that stops it:
// it ends ctx, waits until run has returned and shuts the factory down;
// it may be called more than once, and Stop calls it.
func (c *Cluster) runController(ctx context.Context, cancel context.CancelFunc, factory informers.SharedInformerFactory, run func()) func() {
	factory.Start(ctx.Done())
	var wg sync.WaitGroup
	wg.Go(run)
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			wg.Wait()
			factory.Shutdown()
		})
	}
	c.AddStop(stop)
	return stop
}
