package agent_test

import (
	"fmt"
	"sync"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2/ktesting"
)

// TestConcurrentPreparesOfOtherClaims: Prepares and Unprepares of
// different claims, on different GPUs, run at once (the kubelet calls for
// each pod on its own) and each succeeds. Under the race detector it
// also shows that a Prepare does not write what another one reads.
func TestConcurrentPreparesOfOtherClaims(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	a := e.start(ctx, t)
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for g := range 2 {
		wg.Go(func() {
			c := claim(fmt.Sprintf("c%d", g), gpus("gpus", fmt.Sprintf("gpu-%d", g))...)
			for i := range 50 {
				res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{c})
				if err == nil {
					err = res[c.UID].Err
				}
				if err != nil {
					errs <- fmt.Errorf("prepare %d of claim %s: %w", i, c.Name, err)
					return
				}
				unres, err := a.UnprepareResourceClaims(ctx, []kubeletplugin.NamespacedObject{ref(c)})
				if err == nil {
					err = unres[c.UID]
				}
				if err != nil {
					errs <- fmt.Errorf("unprepare %d of claim %s: %w", i, c.Name, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
