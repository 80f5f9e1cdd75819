package agent

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/checkpoint"
)

// ReasonPreparedClaimsRecovered (Warning, at start): the checkpoint of
// prepared claims does not exist while CDIDir holds claim specs of this
// driver; the agent recorded those claims from their specs and keeps
// their GPUs for them (see recoverClaims). The note names each claim by
// UID with its GPUs.
const ReasonPreparedClaimsRecovered = "TopodraPreparedClaimsRecovered"

// recoverClaims records in cp, where the checkpoint file does not exist,
// each claim whose CDI spec is in CDIDir and was written during this boot
// as prepared, with the GPUs that its spec names (device name, GPU UUID,
// minor number), and reports that in the log and as a
// ReasonPreparedClaimsRecovered Warning on the Node. A spec there belongs
// to a claim prepared during this boot whose containers may run: a
// checkpoint that is missing (a changed --state-dir or --kubelet-dir, a
// wiped plugin directory) must not let another claim be prepared with
// those GPUs. It returns how many claims it recorded; a claim spec of
// this boot that cannot be read fails it with ErrCheckpoint (wrapping
// cdi.ErrUnreadableSpec), as the agent cannot tell which GPUs that claim
// holds, and leaves cp as it was. Files in CDIDir that are not named as
// this driver's claim specs are not read.
//
// Specs of an earlier boot are removed instead, unread, whatever they
// hold (a power loss can leave one empty), as checkBootID removes those
// of claims prepared during another boot: where CDIDir is a tmpfs
// (/var/run is one), every spec in it was written during this boot;
// otherwise a spec last written before the node booted (btime in
// /proc/stat, by the clock that file times are in) is of an earlier boot.
// Where the boot time is unknown, every spec counts as of this boot.
//
// A spec does not say whether a GPU was prepared with admin access: a
// recovered claim holds its GPUs as one without, so no other claim gets
// them until it is adopted or unprepared.
//
// A recovered claim has neither namespace nor name (see isRecovered):
// the kubelet's Unprepare of its UID removes it, and its next Prepare
// completes the record where the allocation names the same GPUs (see
// adoptRecovered). CleanupStaleClaims cannot look it up and leaves it.
// The caller holds prepareMutex and checkpointMutex, and saves cp.
func (a *Agent) recoverClaims(ctx context.Context, cp *checkpoint.Checkpoint) (int, error) {
	exists, err := a.store.Exists()
	if err != nil {
		return 0, fmt.Errorf("%w: %w", ErrCheckpoint, err)
	}
	if exists {
		return 0, nil
	}
	files, err := a.cdi.ListClaimSpecs()
	if err != nil {
		return 0, fmt.Errorf("%w: the checkpoint %s does not exist and the CDI specs of prepared claims cannot be read: %w", ErrCheckpoint, a.store.Path(), err)
	}
	if len(files) == 0 {
		return 0, nil
	}
	logger := klog.FromContext(ctx)
	boot := time.Time{}
	if !livesOneBoot(a.opts.CDIDir) {
		boot = bootTime()
	}
	// Specs of an earlier boot go by their time alone: a damaged one
	// must not stop the start.
	var ofThisBoot []cdi.SpecFile
	for _, f := range files {
		if !ofEarlierBoot(f, boot) {
			ofThisBoot = append(ofThisBoot, f)
			continue
		}
		logger.Info("No checkpoint of prepared claims, removing the CDI spec of a claim prepared before the node booted", "uid", f.UID, "path", f.Path, "written", f.ModTime, "bootTime", boot)
		if err := a.cdi.DeleteClaimSpec(f.UID); err != nil {
			return 0, err
		}
	}
	specs := make([]cdi.ClaimSpec, 0, len(ofThisBoot))
	for _, f := range ofThisBoot {
		spec, err := cdi.ReadClaimSpec(f)
		if err != nil {
			return 0, fmt.Errorf("%w: the checkpoint %s does not exist and the CDI specs of prepared claims cannot be read: %w", ErrCheckpoint, a.store.Path(), err)
		}
		specs = append(specs, spec)
	}
	var claims []string
	recovered := 0
	for _, spec := range specs {
		prepared := checkpoint.PreparedClaim{}
		for _, d := range spec.Devices {
			prepared.Devices = append(prepared.Devices, checkpoint.PreparedDevice{
				Pool:         a.opts.PoolName,
				Device:       d.Name,
				UUID:         d.UUID,
				Minor:        d.Minor,
				CDIDeviceIDs: []string{cdi.DeviceID(spec.UID, d.Name)},
			})
		}
		cp.Claims[spec.UID] = prepared
		recovered++
		claims = append(claims, fmt.Sprintf("UID %s with %s", spec.UID, claimDevices(prepared)))
	}
	if recovered == 0 {
		return 0, nil
	}
	logger.Info("No checkpoint of prepared claims, recorded the claims whose CDI specs exist as prepared; their GPUs stay reserved for them until the kubelet unprepares them",
		"checkpoint", a.store.Path(), "cdiDir", a.opts.CDIDir, "claims", claims)
	a.nodeEvent(v1.EventTypeWarning, ReasonPreparedClaimsRecovered, "Start",
		"%s found no checkpoint of prepared claims (%s) but the CDI specs of %d claims prepared during this boot (%s): was --state-dir or --kubelet-dir changed, or the plugin directory wiped? Their GPUs stay reserved for them until the kubelet unprepares them after their pods stop: %s; where no pod on this node uses such a claim (kubectl get resourceclaims -A -o custom-columns=NS:.metadata.namespace,NAME:.metadata.name,UID:.metadata.uid), its GPUs stay reserved until the node reboots",
		a.opts.DriverName, a.store.Path(), recovered, a.opts.CDIDir, strings.Join(claims, "; "))
	return recovered, nil
}

// ofEarlierBoot says whether a claim spec file was last written before
// the node booted at boot; a zero boot time (unknown, or a CDI directory
// that lives one boot) says no.
func ofEarlierBoot(f cdi.SpecFile, boot time.Time) bool {
	return !boot.IsZero() && f.ModTime.Before(boot)
}

// Magic numbers (statfs f_type) of the file systems whose content lives
// one boot (linux/magic.h).
const (
	tmpfsMagic = 0x01021994
	ramfsMagic = 0x858458f6
)

// livesOneBoot says whether dir is on a tmpfs or ramfs; false where that
// cannot be told.
func livesOneBoot(dir string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false
	}
	t := uint64(st.Type)
	return t == tmpfsMagic || t == ramfsMagic
}

// procStatPath is where Linux publishes the boot time (btime).
const procStatPath = "/proc/stat"

// bootTime is when the node booted, by the wall clock as it is now (the
// kernel moves btime with clock steps); zero where it cannot be read.
func bootTime() time.Time {
	data, err := os.ReadFile(procStatPath)
	if err != nil {
		return time.Time{}
	}
	for line := range strings.Lines(string(data)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "btime "); ok {
			sec, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			if err != nil || sec <= 0 {
				return time.Time{}
			}
			return time.Unix(sec, 0)
		}
	}
	return time.Time{}
}

// isRecovered says whether a prepared claim was recorded from its CDI
// spec by recoverClaims (and not prepared by this agent since).
func isRecovered(c checkpoint.PreparedClaim) bool {
	return c.Namespace == "" && c.Name == ""
}

// adoptRecovered completes the record of a recovered claim from the
// claim that the kubelet prepares again: where its allocation names the
// same devices of this driver as the spec did, the record gets the
// claim's namespace, name, requests, admin access and allocation time,
// and keeps the GPUs (UUID, minor number) and CDI device ids of the spec.
// Otherwise the claim was allocated again since: ErrReallocated.
func (a *Agent) adoptRecovered(claim *resourceapi.ResourceClaim, recovered checkpoint.PreparedClaim) (checkpoint.PreparedClaim, error) {
	var before, now []string
	for _, d := range recovered.Devices {
		before = append(before, d.Device)
	}
	byDevice := map[string]int{}
	for i, d := range recovered.Devices {
		byDevice[d.Device] = i
	}
	adopted := checkpoint.PreparedClaim{Namespace: claim.Namespace, Name: claim.Name}
	if claim.Status.Allocation != nil {
		if ts := claim.Status.Allocation.AllocationTimestamp; ts != nil {
			adopted.AllocatedAt = ptr.To(ts.UTC().Truncate(time.Second))
		}
		seen := map[string]int{}
		for _, r := range claim.Status.Allocation.Devices.Results {
			if r.Driver != a.opts.DriverName {
				continue
			}
			if i, ok := seen[r.Device]; ok {
				// Exclusive where any of the claim's results is (see planClaim).
				adopted.Devices[i].Requests = append(adopted.Devices[i].Requests, r.Request)
				adopted.Devices[i].AdminAccess = adopted.Devices[i].AdminAccess && grantsAdminAccess(claim, r)
				continue
			}
			now = append(now, r.Device)
			i, ok := byDevice[r.Device]
			if !ok || r.Pool != a.opts.PoolName {
				continue
			}
			d := recovered.Devices[i]
			d.Requests = []string{r.Request}
			d.AdminAccess = grantsAdminAccess(claim, r)
			seen[r.Device] = len(adopted.Devices)
			adopted.Devices = append(adopted.Devices, d)
		}
	}
	slices.Sort(before)
	slices.Sort(now)
	if claim.Status.Allocation == nil || !slices.Equal(before, now) || len(adopted.Devices) != len(recovered.Devices) {
		return checkpoint.PreparedClaim{}, fmt.Errorf("claim %s: %w: its CDI spec, from before the agent on node %s lost its checkpoint, names %s and it is now allocated %s; the agent keeps the earlier devices until the kubelet unprepares the claim, then prepares the new allocation",
			klog.KObj(claim), ErrReallocated, a.opts.NodeName, strings.Join(before, ", "), orNone(now))
	}
	return adopted, nil
}

// orNone lists devices, or says there are none.
func orNone(devices []string) string {
	if len(devices) == 0 {
		return "no device of this driver"
	}
	return strings.Join(devices, ", ")
}

// recoveredOwner describes, for an error that reaches the pod's events,
// a recovered claim that holds a device.
func recoveredOwner(uid types.UID) string {
	return fmt.Sprintf("the claim with UID %s, which the agent recorded from its CDI spec when it found no checkpoint (%s event on the Node)", uid, ReasonPreparedClaimsRecovered)
}
