package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/agent/discovery"
)

// ClearFaultsAnnotation on the agent's Node lets an admin put GPUs back in
// service whose faults were dealt with without a reboot (a GPU reset with
// nvidia-smi, say). Its value is an RFC 3339 time, optionally followed by
// a space and a comma-separated list of GPUs, each a device name as the
// node publishes it now (gpu-3) or a GPU UUID: the faults of those GPUs
// (of every GPU without a list) last reported before that time are
// cleared at the agent's next Node check (at start, then every
// Options.NodeCheck): the health taint goes, the kubelet gets the GPU as
// Healthy again (where its health is watched), the checkpoint forgets the
// fault and the Node gets a ReasonFaultsCleared event. A fault reported
// (again) after the time stays, so the annotation may stay too. A value
// that cannot be read, a time ahead of when the value was set (as the
// Node's managed fields record it; else ahead of the agent's clock: it
// would clear faults still to come), a list entry that names no GPU of
// the node, and a value that clears no fault get a
// ReasonClearFaultsRefused Warning on the Node, once per value while the
// agent runs.
const ClearFaultsAnnotation = "gpu.topodra.io/clear-faults"

const (
	// ReasonFaultsCleared is the Normal event on the Node that names the
	// GPU faults that ClearFaultsAnnotation cleared.
	ReasonFaultsCleared = "TopodraFaultsCleared"
	// ReasonClearFaultsRefused is the Warning event on the Node for a
	// ClearFaultsAnnotation that the agent cannot follow, or that clears
	// nothing.
	ReasonClearFaultsRefused = "TopodraClearFaultsRefused"
)

// clearRequest is a parsed ClearFaultsAnnotation.
type clearRequest struct {
	before time.Time
	// gpus are device names or UUIDs; empty: every GPU.
	gpus []string
}

// annotationSetAt returns when the annotation key of obj was last set, as
// its managed fields record it (whole seconds): the time of the field
// manager whose fields own the key. False where no entry owns it (managed
// fields stripped, or the entry has no time).
func annotationSetAt(obj metav1.Object, key string) (time.Time, bool) {
	owns := []byte(`"f:` + key + `"`)
	var at time.Time
	for _, entry := range obj.GetManagedFields() {
		if entry.FieldsV1 == nil || entry.Time == nil || !bytes.Contains(entry.FieldsV1.Raw, owns) {
			continue
		}
		if entry.Time.After(at) {
			at = entry.Time.Time
		}
	}
	return at, !at.IsZero()
}

// parseClearFaults reads a ClearFaultsAnnotation value; its time must not
// be after now, the time the value was set where that is known.
func parseClearFaults(value string, now time.Time) (clearRequest, error) {
	fields := strings.Fields(value)
	if len(fields) == 0 || len(fields) > 2 {
		return clearRequest{}, errors.New(`want "<RFC 3339 time>" or "<RFC 3339 time> <device or UUID>,..."`)
	}
	before, err := time.Parse(time.RFC3339, fields[0])
	if err != nil {
		return clearRequest{}, fmt.Errorf("the time: %w", err)
	}
	if before.After(now) {
		return clearRequest{}, fmt.Errorf("the time %s is ahead of when the annotation was set (%s, by the API server's or the node's clock): it would clear faults still to come; give the time of the reset", fields[0], now.UTC().Format(time.RFC3339))
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

// clearFaultsState is what the agent remembers of ClearFaultsAnnotation
// between Node checks.
type clearFaultsState struct {
	// seen: the annotation was there at the last check, with value.
	seen  bool
	value string
	// refused: value was refused (an error, not a GPU list), and stays so
	// until it changes, even once its time has passed.
	refused bool
}

// clearFaults follows the node's ClearFaultsAnnotation (see there); where
// it clears a fault it saves the checkpoint's faults and publishes.
func (a *Agent) clearFaults(ctx context.Context, node *v1.Node) {
	value, ok := node.Annotations[ClearFaultsAnnotation]
	a.mutex.Lock()
	prev := a.clearAnnotation
	reported := prev.seen && prev.value == value
	a.clearAnnotation = clearFaultsState{seen: ok, value: value, refused: reported && prev.refused}
	a.mutex.Unlock()
	if !ok || reported && prev.refused {
		return
	}
	logger := klog.FromContext(ctx)
	refuse := func(format string, args ...any) {
		if reported {
			return
		}
		note := fmt.Sprintf(format, args...)
		logger.Info("Not clearing GPU faults as the node's annotation asks", "annotation", ClearFaultsAnnotation, "value", value, "why", note)
		a.nodeCauseEvent(v1.EventTypeWarning, ReasonClearFaultsRefused, "ClearFaults", "annotation %s=%q: %s", ClearFaultsAnnotation, value, note)
	}
	// A time ahead of when the value was set stays refused after an
	// agent restart too, once it has passed.
	setAt, setKnown := annotationSetAt(node, ClearFaultsAnnotation)
	limit := time.Now()
	if setKnown && setAt.Before(limit) {
		limit = setAt
	}
	req, err := parseClearFaults(value, limit)
	if err != nil {
		a.mutex.Lock()
		a.clearAnnotation.refused = true
		a.mutex.Unlock()
		refuse("%v; no GPU fault cleared", err)
		return
	}

	a.mutex.Lock()
	targets, unknown := a.resolveGPUsLocked(req.gpus)
	var cleared, kept []string
	for uuid, f := range a.faults {
		if targets != nil && !targets[uuid] {
			continue
		}
		what := a.describeFaultLocked(uuid, f)
		if !a.lastReportLocked(uuid).Before(req.before) {
			kept = append(kept, what)
			continue
		}
		delete(a.faults, uuid)
		delete(a.faultLast, uuid)
		delete(a.warned, warning{reason: ReasonDeviceUnhealthy, subject: uuid})
		a.clearGen++
		a.faultsCleared[uuid] = a.clearGen
		cleared = append(cleared, what)
	}
	if len(cleared) > 0 {
		a.healthChangedLocked()
	}
	a.mutex.Unlock()
	slices.Sort(cleared)
	slices.Sort(kept)

	if len(unknown) > 0 {
		refuse("names no GPU of this node: %s (device names as published now, such as gpu-3, or GPU UUIDs)", strings.Join(unknown, ", "))
	}
	if len(cleared) == 0 {
		// An annotation left in place after its clear, read by an agent
		// started since, clears nothing: an agent before said what it did.
		if len(unknown) == 0 && !(setKnown && setAt.Before(a.created)) {
			why := "no GPU it names has a fault"
			if len(kept) > 0 {
				why = "every fault it names was reported at or after " + req.before.UTC().Format(time.RFC3339) + ": " + strings.Join(kept, "; ")
			}
			refuse("no GPU fault cleared: %s", why)
		}
		return
	}
	logger.Info("Clearing GPU faults as the node's annotation asks", "annotation", ClearFaultsAnnotation, "value", value, "faults", cleared)
	a.saveFaults(ctx)
	published := "they are no longer tainted " + HealthTaintKey
	if err := a.publish(ctx); err != nil {
		a.HandleError(ctx, err, "publish after clearing GPU faults")
		published = fmt.Sprintf("their %s taints go once the agent can publish (%v)", HealthTaintKey, err)
	}
	a.nodeEvent(v1.EventTypeNormal, ReasonFaultsCleared, "ClearFaults",
		"GPU faults cleared as annotation %s=%q asks, %s: %s", ClearFaultsAnnotation, value, published, strings.Join(cleared, "; "))
}

// resolveGPUsLocked turns the GPUs of a ClearFaultsAnnotation into UUIDs
// (nil for no list: every GPU) and lists the entries that name none. A
// device name is the name a discovered GPU has now; a GPU missing from
// discovery with a fault is also known by the name it had when the fault
// was seen, unless a discovered GPU has that name now. UUIDs match without
// regard to case.
func (a *Agent) resolveGPUsLocked(gpus []string) (map[string]bool, []string) {
	if len(gpus) == 0 {
		return nil, nil
	}
	byName := map[string]string{}
	var uuids []string
	if a.inventory != nil {
		for _, g := range a.inventory.GPUs {
			byName[g.Name] = g.UUID
			uuids = append(uuids, g.UUID)
		}
	}
	for uuid, f := range a.faults {
		if !slices.Contains(uuids, uuid) {
			uuids = append(uuids, uuid)
			if _, taken := byName[f.Device]; !taken {
				byName[f.Device] = uuid
			}
		}
	}
	targets := map[string]bool{}
	var unknown []string
	for _, gpu := range gpus {
		if uuid, ok := byName[gpu]; ok {
			targets[uuid] = true
			continue
		}
		if i := slices.IndexFunc(uuids, func(u string) bool { return strings.EqualFold(u, gpu) }); i >= 0 {
			targets[uuids[i]] = true
			continue
		}
		unknown = append(unknown, gpu)
	}
	return targets, unknown
}

// describeFaultLocked names a fault for the Node's events: "gpu-3
// GPU-… (xid-48 at …)", with the name the GPU had when the fault was seen
// where it has another now, and the latest report where there was one.
func (a *Agent) describeFaultLocked(uuid string, f discovery.HealthEvent) string {
	name := f.Device
	if a.inventory != nil {
		for _, g := range a.inventory.GPUs {
			if g.UUID == uuid && g.Name != f.Device {
				name = g.Name + " (" + f.Device + " at the fault)"
			}
		}
	}
	when := f.Time.UTC().Format(time.RFC3339Nano)
	if last := a.lastReportLocked(uuid); last.After(f.Time) {
		when += ", last " + last.UTC().Format(time.RFC3339Nano)
	}
	return fmt.Sprintf("%s %s (%s at %s)", name, uuid, f.Reason, when)
}
