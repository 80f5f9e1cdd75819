package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/agent/checkpoint"
)

// ClearFaultsAnnotation on the agent's Node lets an admin put GPUs back in
// service whose faults were dealt with without a reboot (a GPU reset with
// nvidia-smi, say). Its value is an RFC 3339 time, optionally followed by
// a space and a comma-separated list of device names (gpu-3) or GPU UUIDs:
// the faults of those GPUs (of every GPU without a list) recorded before
// that time are cleared at the agent's next Node check (at start, then
// every Options.NodeCheck): the health taint goes, the kubelet gets the
// GPU as Healthy again (where its health is watched), the checkpoint
// forgets the fault and the Node gets a ReasonFaultsCleared event. A fault
// recorded after the time stays, so the annotation may stay too. A value
// that cannot be read, a time more than maxClearAhead ahead of the
// agent's clock, or a list entry that names no GPU of the node clears
// nothing of its own and gets a ReasonClearFaultsRefused Warning on the
// Node.
const ClearFaultsAnnotation = "gpu.topodra.io/clear-faults"

const (
	// ReasonFaultsCleared is the Normal event on the Node that names the
	// GPU faults that ClearFaultsAnnotation cleared.
	ReasonFaultsCleared = "TopodraFaultsCleared"
	// ReasonClearFaultsRefused is the Warning event on the Node for a
	// ClearFaultsAnnotation that the agent cannot follow.
	ReasonClearFaultsRefused = "TopodraClearFaultsRefused"
)

// maxClearAhead is how far ahead of the agent's clock the time of
// ClearFaultsAnnotation may be (clocks differ a little between the admin's
// machine and the node): a time to come would clear faults that have not
// happened yet, turning health tainting off until then.
const maxClearAhead = time.Minute

// clearRequest is a parsed ClearFaultsAnnotation.
type clearRequest struct {
	before time.Time
	// gpus are device names or UUIDs; empty: every GPU.
	gpus []string
}

// parseClearFaults reads a ClearFaultsAnnotation value.
func parseClearFaults(value string, now time.Time) (clearRequest, error) {
	fields := strings.Fields(value)
	if len(fields) == 0 || len(fields) > 2 {
		return clearRequest{}, errors.New(`want "<RFC 3339 time>" or "<RFC 3339 time> <device or UUID>,..."`)
	}
	before, err := time.Parse(time.RFC3339, fields[0])
	if err != nil {
		return clearRequest{}, fmt.Errorf("the time: %w", err)
	}
	if before.After(now.Add(maxClearAhead)) {
		return clearRequest{}, fmt.Errorf("the time %s is ahead of the node's clock (%s): it would clear faults that have not happened yet", fields[0], now.UTC().Format(time.RFC3339))
	}
	req := clearRequest{before: before}
	if len(fields) == 2 {
		for gpu := range strings.SplitSeq(fields[1], ",") {
			if gpu == "" {
				return clearRequest{}, errors.New("an empty entry in the list of GPUs")
			}
			req.gpus = append(req.gpus, gpu)
		}
	}
	return req, nil
}

// clearFaults follows the node's ClearFaultsAnnotation (see there) and
// reports whether it cleared a fault. An annotation value is reported
// (refused, or naming GPUs unknown) once until it changes.
func (a *Agent) clearFaults(ctx context.Context, node *v1.Node) bool {
	value, ok := node.Annotations[ClearFaultsAnnotation]
	a.mutex.Lock()
	reported := a.clearFaultsSeen == value
	a.clearFaultsSeen = value
	a.mutex.Unlock()
	if !ok {
		return false
	}
	logger := klog.FromContext(ctx)
	req, err := parseClearFaults(value, time.Now())
	if err != nil {
		if !reported {
			logger.Error(err, "Cannot follow the node's annotation, no GPU fault cleared", "annotation", ClearFaultsAnnotation, "value", value)
			a.nodeCauseEvent(v1.EventTypeWarning, ReasonClearFaultsRefused, "ClearFaults",
				"annotation %s=%q: %v; no GPU fault cleared", ClearFaultsAnnotation, value, err)
		}
		return false
	}

	a.mutex.Lock()
	// A GPU is known by its name or UUID, discovered or (missing from
	// discovery) recorded with a fault.
	known := map[string]bool{}
	if a.inventory != nil {
		for _, g := range a.inventory.GPUs {
			known[g.Name], known[g.UUID] = true, true
		}
	}
	for uuid, f := range a.faults {
		known[uuid], known[f.Device] = true, true
	}
	var unknown []string
	for _, gpu := range req.gpus {
		if !known[gpu] {
			unknown = append(unknown, gpu)
		}
	}
	var cleared []string // "gpu-3 (xid-48 at ...)"
	var uuids []string
	for uuid, f := range a.faults {
		if !f.Time.Before(req.before) {
			continue
		}
		if len(req.gpus) > 0 && !slices.Contains(req.gpus, uuid) && !slices.Contains(req.gpus, f.Device) {
			continue
		}
		delete(a.faults, uuid)
		uuids = append(uuids, uuid)
		cleared = append(cleared, fmt.Sprintf("%s %s (%s at %s)", f.Device, uuid, f.Reason, f.Time.UTC().Format(time.RFC3339)))
	}
	if len(cleared) > 0 {
		a.healthChangedLocked()
	}
	a.mutex.Unlock()

	if len(unknown) > 0 && !reported {
		logger.Info("The node's annotation names GPUs this node does not have", "annotation", ClearFaultsAnnotation, "gpus", unknown)
		a.nodeCauseEvent(v1.EventTypeWarning, ReasonClearFaultsRefused, "ClearFaults",
			"annotation %s=%q names no GPU of this node: %s (device names such as gpu-3, or GPU UUIDs)", ClearFaultsAnnotation, value, strings.Join(unknown, ", "))
	}
	if len(cleared) == 0 {
		return false
	}
	slices.Sort(cleared)
	logger.Info("Cleared GPU faults as the node's annotation asks", "annotation", ClearFaultsAnnotation, "value", value, "faults", cleared)
	if a.store != nil {
		if err := a.updateCheckpoint(func(cp *checkpoint.Checkpoint) {
			for _, uuid := range uuids {
				delete(cp.Faults, uuid)
			}
		}); err != nil {
			// The annotation clears them again after a restart.
			logger.Error(err, "Cannot remove the cleared GPU faults from the checkpoint; a restarted agent clears them again while the annotation stays")
		}
	}
	a.nodeEvent(v1.EventTypeNormal, ReasonFaultsCleared, "ClearFaults",
		"GPU faults cleared as annotation %s=%q asks, the GPUs are no longer tainted %s: %s", ClearFaultsAnnotation, value, HealthTaintKey, strings.Join(cleared, "; "))
	return true
}
