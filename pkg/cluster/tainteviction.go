package cluster

import (
	"context"

	"k8s.io/client-go/informers"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/controller/devicetainteviction"
)

// StartDeviceTaintEvictionController runs kube-controller-manager's device
// taint eviction controller, which evicts the pods whose allocated devices
// carry a NoExecute taint that their claims do not tolerate. It runs until
// ctx ends or the returned function is called; that function waits until
// it has stopped, may be called more than once, and is also called by
// Stop.
func (c *Cluster) StartDeviceTaintEvictionController(ctx context.Context) func() {
	ctx, cancel := context.WithCancel(ctx)
	logger := klog.FromContext(ctx).WithName("device-taint-eviction-controller")
	factory := informers.NewSharedInformerFactory(c.Client, 0)
	ctrl := devicetainteviction.New(c.Client,
		factory.Core().V1().Pods(),
		factory.Resource().V1().ResourceClaims(),
		factory.Resource().V1().ResourceSlices(),
		factory.Resource().V1().DeviceTaintRules(),
		factory.Resource().V1().DeviceClasses(),
		"device-taint-eviction-controller")
	return c.runController(ctx, cancel, factory, func() {
		if err := ctrl.Run(klog.NewContext(ctx, logger), 2); err != nil && ctx.Err() == nil {
			logger.Error(err, "Device taint eviction controller stopped")
		}
	})
}
