package agent

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/agent/checkpoint"
)

// bootID reads the node's boot id; "" when it cannot be read.
func (a *Agent) bootID(ctx context.Context) string {
	path := a.opts.BootIDPath
	if path == "" {
		path = DefaultBootIDPath
	}
	data, err := os.ReadFile(path)
	if err != nil {
		klog.FromContext(ctx).Info("cannot read the boot id, prepared claims are kept across reboots", "path", path, "err", err)
		return ""
	}
	return strings.TrimSpace(string(data))
}

// checkBootID loads the checkpoint and, if it was written during another
// boot, drops every prepared claim with its CDI spec: after a reboot no
// container holds those devices any more, and minor numbers may differ.
// The kubelet prepares the claims of pods that still run again; what each
// dropped claim held (device name and GPU UUID) moves to PreviousBoot so
// that Prepare can refuse a device name that now names another GPU. GPU
// faults are cleared: a reboot resets the GPUs.
func (a *Agent) checkBootID(ctx context.Context) error {
	a.prepareMutex.Lock()
	defer a.prepareMutex.Unlock()
	cp, err := a.store.Load()
	if err != nil {
		return err
	}
	boot := a.bootID(ctx)
	if boot == "" || cp.BootID == boot {
		return nil
	}
	if cp.BootID != "" {
		if len(cp.Claims) > 0 {
			klog.FromContext(ctx).Info("node rebooted since claims were prepared, dropping them", "claims", len(cp.Claims), "oldBootID", cp.BootID, "bootID", boot)
		}
		for uid, c := range cp.Claims {
			if err := a.cdi.DeleteClaimSpec(uid); err != nil {
				return err
			}
			if cp.PreviousBoot == nil {
				cp.PreviousBoot = map[types.UID]checkpoint.PreparedClaim{}
			}
			cp.PreviousBoot[uid] = c
		}
		cp.Claims = map[types.UID]checkpoint.PreparedClaim{}
		cp.Faults = nil
	}
	cp.BootID = boot
	return a.store.Save(cp)
}

// CleanupStaleClaims unprepares every recorded claim that no longer exists
// in the API server (or exists with another UID): its pods are gone, and
// the kubelet, which would normally call Unprepare, may never do so (for
// example when the agent was down at the time). It returns the claims it
// removed. API errors other than NotFound keep the claim. It also forgets
// what claims held before the last reboot once such a claim is gone or no
// longer allocated: a later allocation is not the one prepared back then.
func (a *Agent) CleanupStaleClaims(ctx context.Context) ([]types.UID, error) {
	if a.store == nil {
		return nil, ErrNoState
	}
	cp, err := a.store.Load()
	if err != nil {
		return nil, err
	}
	var stale, forget []types.UID
	for uid, c := range cp.PreviousBoot {
		claim, err := a.opts.KubeClient.ResourceV1().ResourceClaims(c.Namespace).Get(ctx, c.Name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			forget = append(forget, uid)
		case err != nil:
			klog.FromContext(ctx).V(2).Info("cannot check claim prepared before the reboot", "claim", klog.KRef(c.Namespace, c.Name), "err", err)
		case claim.UID != uid || claim.Status.Allocation == nil:
			forget = append(forget, uid)
		}
	}
	for uid, c := range cp.Claims {
		claim, err := a.opts.KubeClient.ResourceV1().ResourceClaims(c.Namespace).Get(ctx, c.Name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			stale = append(stale, uid)
		case err != nil:
			klog.FromContext(ctx).V(2).Info("cannot check prepared claim", "claim", klog.KRef(c.Namespace, c.Name), "err", err)
		case claim.UID != uid:
			stale = append(stale, uid)
		}
	}
	if len(stale) == 0 && len(forget) == 0 {
		return nil, nil
	}
	a.prepareMutex.Lock()
	defer a.prepareMutex.Unlock()
	cp, err = a.store.Load()
	if err != nil {
		return nil, err
	}
	for _, uid := range forget {
		delete(cp.PreviousBoot, uid)
	}
	var removed []types.UID
	for _, uid := range stale {
		c, ok := cp.Claims[uid]
		if !ok {
			continue
		}
		if err := a.cdi.DeleteClaimSpec(uid); err != nil {
			return removed, err
		}
		delete(cp.Claims, uid)
		removed = append(removed, uid)
		klog.FromContext(ctx).Info("unprepared stale claim", "claim", klog.KRef(c.Namespace, c.Name), "uid", uid)
	}
	if err := a.store.Save(cp); err != nil {
		return nil, fmt.Errorf("save checkpoint: %w", err)
	}
	return removed, nil
}

func (a *Agent) staleClaimLoop(ctx context.Context) {
	interval := a.opts.StaleClaimCheck
	for {
		if _, err := a.CleanupStaleClaims(ctx); err != nil && ctx.Err() == nil {
			utilruntime.HandleErrorWithContext(ctx, err, "stale claim cleanup failed")
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(interval):
		}
	}
}
