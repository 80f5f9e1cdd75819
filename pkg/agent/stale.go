package agent

import (
	"context"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

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
		klog.FromContext(ctx).Info("Cannot read the boot id, prepared claims are kept across reboots", "path", path, "err", err)
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
//
// Where there is no checkpoint file, the claims whose CDI specs of this
// boot are in CDIDir are recorded as prepared (see recoverClaims) and the
// checkpoint is written, so that a later start does not depend on the
// specs.
func (a *Agent) checkBootID(ctx context.Context) error {
	a.prepareMutex.Lock()
	defer a.prepareMutex.Unlock()
	a.checkpointMutex.Lock()
	defer a.checkpointMutex.Unlock()
	cp, err := a.store.Load()
	if err != nil {
		return fmt.Errorf("%w: %w", ErrCheckpoint, err)
	}
	recovered, err := a.recoverClaims(ctx, cp)
	if err != nil {
		return err
	}
	boot := a.bootID(ctx)
	if (boot == "" || cp.BootID == boot) && recovered == 0 {
		a.recordClaimCounts(cp)
		return nil
	}
	if boot != "" && cp.BootID != "" && cp.BootID != boot {
		if len(cp.Claims) > 0 {
			klog.FromContext(ctx).Info("Node rebooted since claims were prepared, dropping them", "claims", len(cp.Claims), "oldBootID", cp.BootID, "bootID", boot)
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
		cp.Gone = nil
	}
	if boot != "" {
		cp.BootID = boot
	}
	if err := a.store.Save(cp); err != nil {
		return err
	}
	a.recordClaimCounts(cp)
	return nil
}

// DefaultStaleClaimGrace is the default of [Options.StaleClaimGrace].
const DefaultStaleClaimGrace = time.Hour

// Event reasons on the Node about prepared claims that the API server no
// longer has; the claim is each event's related object.
const (
	// ReasonPreparedClaimGone (Warning, once per claim and agent
	// process): a prepared claim is gone from the API server, or no
	// longer allocated, while its GPUs stay reserved for it; the note
	// names the claim, its GPUs, which of the two and since when.
	ReasonPreparedClaimGone = "TopodraPreparedClaimGone"
	// ReasonPreparedClaimDropped (Normal): the agent dropped such a claim
	// after Options.StaleClaimGrace because the kubelet reports no
	// container on the node using it; its GPUs can be prepared for other
	// claims.
	ReasonPreparedClaimDropped = "TopodraPreparedClaimDropped"
	// ReasonPodResourcesUnavailable (Warning, once until a check reaches
	// the kubelet again): a prepared claim is past its grace period but
	// the kubelet's PodResources API cannot be asked which claims the
	// node's containers use, or answers without claims (see
	// unreferenced), so it is kept; the note names the socket and the
	// error.
	ReasonPodResourcesUnavailable = "TopodraPodResourcesUnavailable"
)

// CleanupStaleClaims checks the prepared claims against the API server.
//
// A prepared claim that the API server no longer has (NotFound, or a
// claim of that name with another UID), or has without an allocation (its
// pods went and the claim was given back, but the kubelet did not
// unprepare it), keeps its GPUs: the claim
// controller deletes the claim of a force-deleted pod while the pod's
// containers may still run on the node, and the kubelet unprepares the
// claim only once they have stopped (retrying while the agent is down).
// Forgetting the claim earlier would let another claim be prepared on
// GPUs that a running container uses. The first check that finds a claim
// gone records the time in the checkpoint; the first check of each agent
// process that finds it gone logs it and records a
// ReasonPreparedClaimGone Warning on the Node naming the claim and its
// GPUs. Once the claim has been gone for Options.StaleClaimGrace
// (measured from the time in the checkpoint, so across agent restarts;
// a claim found in the API server again starts over) and the kubelet's
// PodResources API has reported, in two checks in a row, no container on
// the node using a claim of its namespace and name, the claim is
// unprepared (CDI spec and checkpoint entry removed) with a
// ReasonPreparedClaimDropped event; a negative grace never drops it.
// Errors reading a claim or reaching the kubelet keep the claim, and so
// does an answer of the kubelet that lists none of the prepared claims
// that the API server still has (see unreferenced). It returns the claims
// it dropped.
//
// It also forgets what claims held before the last reboot once such a
// claim is gone or no longer allocated: a later allocation is not the one
// prepared back then. A claim recovered from its CDI spec has no name to
// look up: the kubelet's Prepare or Unprepare of it forgets it.
func (a *Agent) CleanupStaleClaims(ctx context.Context) ([]types.UID, error) {
	if a.store == nil {
		return nil, ErrNoState
	}
	a.staleMutex.Lock()
	defer a.staleMutex.Unlock()
	logger := klog.FromContext(ctx)
	cp, err := a.store.Load()
	if err != nil {
		return nil, err
	}
	var forget []types.UID
	for uid, c := range cp.PreviousBoot {
		if isRecovered(c) {
			// Unnamed, so not to be looked up: the kubelet's Prepare
			// or Unprepare of the claim after the reboot resolves it.
			continue
		}
		claim, err := a.opts.KubeClient.ResourceV1().ResourceClaims(c.Namespace).Get(ctx, c.Name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			forget = append(forget, uid)
		case err != nil:
			logger.V(2).Info("Cannot check claim prepared before the reboot", "claim", klog.KRef(c.Namespace, c.Name), "err", err)
		case claim.UID != uid || claim.Status.Allocation == nil:
			forget = append(forget, uid)
		}
	}
	for uid := range a.goneReported {
		if _, ok := cp.Claims[uid]; !ok {
			// Unprepared by the kubelet meanwhile.
			delete(a.goneReported, uid)
		}
	}
	now := a.opts.Clock.Now().UTC()
	grace := a.opts.StaleClaimGrace
	// gone becomes the checkpoint's Gone: the claims found gone now, with
	// when they were first found gone.
	gone := map[types.UID]time.Time{}
	var goneNow, expired []types.UID
	// live are the prepared claims that the API server has, allocated.
	live := sets.New[types.NamespacedName]()
	for uid, c := range cp.Claims {
		if isRecovered(c) {
			// Unnamed: only the kubelet's Prepare or Unprepare
			// resolves it (see recoverClaims).
			continue
		}
		claim, err := a.opts.KubeClient.ResourceV1().ResourceClaims(c.Namespace).Get(ctx, c.Name, metav1.GetOptions{})
		why := "the API server no longer has it (a force-deleted pod whose containers may still run?)"
		switch {
		case apierrors.IsNotFound(err), err == nil && claim.UID != uid:
		case err != nil:
			logger.V(2).Info("Cannot check prepared claim", "claim", klog.KRef(c.Namespace, c.Name), "err", err)
			if since, ok := cp.Gone[uid]; ok {
				gone[uid] = since
			}
			continue
		case claim.Status.Allocation == nil:
			why = "it is no longer allocated (its pods went without the kubelet unpreparing it?)"
		default:
			delete(a.goneReported, uid)
			live.Insert(types.NamespacedName{Namespace: c.Namespace, Name: c.Name})
			continue
		}
		since, seen := cp.Gone[uid]
		if !seen {
			since = now
		}
		gone[uid] = since
		goneNow = append(goneNow, uid)
		if !a.goneReported[uid] {
			a.goneReported[uid] = true
			a.claimGone(ctx, uid, c, why, since)
		}
		if seen && grace >= 0 && now.Sub(since) >= grace {
			expired = append(expired, uid)
		}
	}
	if !maps.EqualFunc(gone, cp.Gone, time.Time.Equal) {
		if err := a.saveGone(gone); err != nil {
			a.unusedBefore = nil
			return nil, fmt.Errorf("save when prepared claims were found gone: %w", err)
		}
	}
	var stale []types.UID
	if grace < 0 {
		goneNow = nil
	}
	unused, err := a.unreferenced(ctx, cp, goneNow, live)
	switch {
	case err != nil && len(expired) > 0:
		if a.podResourcesFailed(err, true) {
			logger.Error(err, "Cannot learn from the kubelet which claims the node's containers use, keeping the prepared claims that the API server no longer has past their grace period", "claims", len(expired))
		} else {
			logger.V(4).Info("Still cannot learn from the kubelet which claims the node's containers use", "claims", len(expired), "err", err)
		}
		if !a.podResourcesReported {
			a.podResourcesReported = true
			a.nodeEvent(v1.EventTypeWarning, ReasonPodResourcesUnavailable, "Unprepare",
				"%d prepared claims that the API server no longer has are past --stale-claim-grace, but the agent cannot learn from the kubelet which claims the node's containers use (--pod-resources-socket %s), so it keeps them and their GPUs: %v",
				len(expired), a.opts.PodResourcesSocket, err)
		}
	case err != nil:
		if a.podResourcesFailed(err, false) {
			logger.Info("Cannot learn from the kubelet which claims the node's containers use, keeping the prepared claims that the API server no longer has", "claims", len(goneNow), "err", err)
		} else {
			logger.V(4).Info("Still cannot learn from the kubelet which claims the node's containers use", "claims", len(goneNow), "err", err)
		}
	case len(goneNow) > 0:
		a.podResourcesReported = false
		if a.podResourcesLogged != "" {
			a.podResourcesLogged = ""
			logger.Info("The kubelet tells again which claims the node's containers use")
		}
	}
	for _, uid := range expired {
		if unused.Has(uid) {
			stale = append(stale, uid)
		}
	}
	if len(stale) == 0 && len(forget) == 0 {
		return nil, nil
	}
	// A claim that a Prepare or Unprepare works on now is not stale: it
	// is left for the next check.
	var unlocks []func()
	defer func() {
		for _, unlock := range unlocks {
			unlock()
		}
	}()
	stale = slices.DeleteFunc(stale, func(uid types.UID) bool {
		unlock, ok := a.claimLocks.tryLock(uid)
		if ok {
			unlocks = append(unlocks, unlock)
		}
		return !ok
	})
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
	dropped := map[types.UID]checkpoint.PreparedClaim{}
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
		dropped[uid] = c
	}
	if err := a.saveClaims(cp); err != nil {
		return nil, fmt.Errorf("save checkpoint: %w", err)
	}
	for _, uid := range removed {
		c := dropped[uid]
		delete(a.goneReported, uid)
		logger.Info("Dropped prepared claim that the API server no longer has and no container on the node uses", "claim", klog.KRef(c.Namespace, c.Name), "uid", uid, "devices", claimDevices(c), "grace", grace)
		a.claimNodeEvent(c.Namespace, c.Name, uid, v1.EventTypeNormal, ReasonPreparedClaimDropped, "Unprepare",
			"dropped claim %s/%s (%s), which the API server no longer has and the kubelet reports no container on this node using, after %v (--stale-claim-grace): %s can be prepared for other claims",
			c.Namespace, c.Name, uid, grace, claimDevices(c))
	}
	return removed, nil
}

// saveGone writes gone as the checkpoint's Gone, leaving out claims that
// are no longer prepared. The caller holds staleMutex.
func (a *Agent) saveGone(gone map[types.UID]time.Time) error {
	return a.updateCheckpoint(func(current *checkpoint.Checkpoint) {
		current.Gone = nil
		for uid, since := range gone {
			if _, ok := current.Claims[uid]; !ok {
				continue
			}
			if current.Gone == nil {
				current.Gone = map[types.UID]time.Time{}
			}
			current.Gone[uid] = since
		}
	})
}

// claimGone reports a prepared claim that the API server no longer has, or
// has without an allocation (why says which), since the time since.
func (a *Agent) claimGone(ctx context.Context, uid types.UID, c checkpoint.PreparedClaim, why string, since time.Time) {
	devices := claimDevices(c)
	klog.FromContext(ctx).Info("Prepared claim is gone from the API server or no longer allocated, keeping its GPUs reserved until the kubelet unprepares it", "claim", klog.KRef(c.Namespace, c.Name), "uid", uid, "devices", devices, "why", why, "since", since)
	after := fmt.Sprintf("the agent drops it from %s on (%v after that, --stale-claim-grace) once the kubelet reports no container on this node using it", since.Add(a.opts.StaleClaimGrace).Format(time.RFC3339), a.opts.StaleClaimGrace)
	if a.opts.StaleClaimGrace < 0 {
		after = "the agent never drops it (--stale-claim-grace is negative)"
	}
	a.claimNodeEvent(c.Namespace, c.Name, uid, v1.EventTypeWarning, ReasonPreparedClaimGone, "Unprepare",
		"claim %s/%s (%s) is prepared with %s but %s (found so at %s): these GPUs stay reserved for it until the kubelet unprepares it after its containers stop; %s",
		c.Namespace, c.Name, uid, devices, why, since.Format(time.RFC3339), after)
}

// claimDevices names a prepared claim's GPUs as "gpu-1 (GPU-...), ...".
func claimDevices(c checkpoint.PreparedClaim) string {
	names := make([]string, 0, len(c.Devices))
	for _, d := range c.Devices {
		names = append(names, fmt.Sprintf("%s (%s)", d.Device, d.UUID))
	}
	if len(names) == 0 {
		return "no GPU"
	}
	return strings.Join(names, ", ")
}

// DefaultPodResourcesSocket is the default of [Options.PodResourcesSocket]:
// where the kubelet serves its PodResources API.
const DefaultPodResourcesSocket = "/var/lib/kubelet/pod-resources/kubelet.sock"

const (
	// podResourcesTimeout bounds one List call to the kubelet.
	podResourcesTimeout = 10 * time.Second
	// podResourcesMaxMessage is the largest List answer read, as the
	// kubelet's own client allows.
	podResourcesMaxMessage = 16 << 20
)

// podResourcesFailed records that a check could not learn from the
// kubelet which claims are in use (err), with claims past their grace
// period or not (expired), and says whether that differs from what the
// check before logged: while the kubelet does not answer, the log says so
// when the cause changes, not at every check. The caller holds
// staleMutex.
func (a *Agent) podResourcesFailed(err error, expired bool) bool {
	key := fmt.Sprintf("%t %v", expired, err)
	changed := key != a.podResourcesLogged
	a.podResourcesLogged = key
	return changed
}

// unreferenced returns the claims among gone (the prepared claims found
// gone from the API server in this check) that the kubelet reports no
// container of an active pod on this node using, in this check and in the
// one before (see claimsInUse). Two checks in a row are needed because a
// kubelet that has just started lists no pods until it has read them from
// the API server; where the agent knows its own pod (Options.Pod), an
// answer that does not list it does not count either. Nor does an answer
// that lists none of live (the prepared claims that the API server still
// has), where there are such claims: a kubelet that does not report
// claims (its feature gate KubeletPodResourcesDynamicResources off)
// answers so, and would make every gone claim look unused while its
// containers run. A check that cannot reach the kubelet, or gets such an
// answer, returns the error and no claim, and the next check starts over.
// The caller holds staleMutex.
func (a *Agent) unreferenced(ctx context.Context, cp *checkpoint.Checkpoint, gone []types.UID, live sets.Set[types.NamespacedName]) (sets.Set[types.UID], error) {
	before := a.unusedBefore
	a.unusedBefore = nil
	if len(gone) == 0 {
		return nil, nil
	}
	used, err := a.claimsInUse(ctx)
	if err != nil {
		return nil, err
	}
	if live.Len() > 0 && !used.HasAny(live.UnsortedList()...) {
		return nil, fmt.Errorf("the kubelet's PodResources API at %s lists no container using any of the %d prepared claims that the API server still has, so its answer cannot tell that a claim is unused (is the kubelet's feature gate KubeletPodResourcesDynamicResources off?)", a.opts.PodResourcesSocket, live.Len())
	}
	logger := klog.FromContext(ctx)
	unused := sets.New[types.UID]()
	twice := sets.New[types.UID]()
	for _, uid := range gone {
		c := cp.Claims[uid]
		if used.Has(types.NamespacedName{Namespace: c.Namespace, Name: c.Name}) {
			logger.V(2).Info("Keeping prepared claim that the API server no longer has: the kubelet reports a container on the node using it", "claim", klog.KRef(c.Namespace, c.Name), "uid", uid)
			continue
		}
		unused.Insert(uid)
		if before.Has(uid) {
			twice.Insert(uid)
		}
	}
	a.unusedBefore = unused
	return twice, nil
}

// claimsInUse asks the kubelet, through the List call of its PodResources
// API at Options.PodResourcesSocket, which ResourceClaims (namespace and
// name) the containers of the node's active pods use. The kubelet lists
// the claims of regular containers and restartable init containers that
// it has prepared, the claim it prepared for a pod's extended resources
// included; a claim that only an init container uses, or that no
// container names, is not listed, and nor is any claim of a container one
// of whose claims the kubelet does not have prepared. Where Options.Pod
// is set, an answer that does not list that pod is an error: the kubelet
// has not read the node's pods from the API server yet, which it does
// all at once.
func (a *Agent) claimsInUse(ctx context.Context) (sets.Set[types.NamespacedName], error) {
	socket := a.opts.PodResourcesSocket
	conn, err := grpc.NewClient("unix://"+socket,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(podResourcesMaxMessage)))
	if err != nil {
		return nil, fmt.Errorf("connect to the kubelet's PodResources API at %s: %w", socket, err)
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(ctx, podResourcesTimeout)
	defer cancel()
	resp, err := podresourcesv1.NewPodResourcesListerClient(conn).List(ctx, &podresourcesv1.ListPodResourcesRequest{})
	if err != nil {
		return nil, fmt.Errorf("list the node's pods through the kubelet's PodResources API at %s: %w", socket, err)
	}
	used := sets.New[types.NamespacedName]()
	self := a.opts.Pod.Name == ""
	for _, pod := range resp.GetPodResources() {
		if pod.GetNamespace() == a.opts.Pod.Namespace && pod.GetName() == a.opts.Pod.Name {
			self = true
		}
		for _, container := range pod.GetContainers() {
			for _, r := range container.GetDynamicResources() {
				used.Insert(types.NamespacedName{Namespace: r.GetClaimNamespace(), Name: r.GetClaimName()})
			}
		}
	}
	if !self {
		return nil, fmt.Errorf("the kubelet's PodResources API at %s does not list this agent's pod %s yet: the kubelet has not read the node's pods", socket, a.opts.Pod)
	}
	return used, nil
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
