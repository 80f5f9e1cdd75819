package agent_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	cgotesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/checkpoint"
)

// foreignSpecs are files in the CDI directory that are not claim specs
// of this driver, some of them malformed: an agent must start beside them.
var foreignSpecs = map[string]string{
	"nvidia.com-gpu.json":      "{not json",
	"vendor.example-nic.yaml":  "kind: [",
	"gpu.topodra.io-gpu.json":  "{not json",
	"gpu.topodra.io-gpu_x.txt": "{not json",
}

// loseCheckpoint prepares claim "held" with gpu-1 and gpu-2, stops the
// agent and deletes its checkpoint, keeping the claim's CDI spec, as a
// changed --state-dir does; it adds foreignSpecs to the CDI directory.
// It returns what Prepare answered for the claim.
func loseCheckpoint(ctx context.Context, t *testing.T, e *env, held *resourceapi.ResourceClaim) kubeletplugin.PrepareResult {
	t.Helper()
	a, err := agent.New(ctx, e.options(t))
	if err != nil {
		t.Fatalf("start agent: %v", err)
	}
	res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{held})
	a.Stop()
	if err != nil || res[held.UID].Err != nil {
		t.Fatalf("prepare: %v %v", err, res[held.UID].Err)
	}
	if err := os.Remove(filepath.Join(e.stateDir, checkpoint.FileName)); err != nil {
		t.Fatal(err)
	}
	for name, content := range foreignSpecs {
		if err := os.WriteFile(filepath.Join(e.cdiDir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return res[held.UID]
}

// TestRecoverPreparedClaims: an agent that finds no checkpoint but the
// CDI spec of a prepared claim (malformed files of others beside it)
// starts, records the claim as prepared with the GPUs of its spec, says so
// on the Node naming the claim's UID, and refuses those GPUs to other
// claims. The claim stays so until the kubelet unprepares it, or prepares
// it again with the same GPUs (it is then an ordinary prepared claim); a
// Prepare of it with other GPUs is refused. The record survives a restart
// without the spec.
func TestRecoverPreparedClaims(t *testing.T) {
	testcases := map[string]func(ctx context.Context, t *testing.T, e *env, a *agent.Agent, held *resourceapi.ResourceClaim, before kubeletplugin.PrepareResult){
		"unprepared by the kubelet": func(ctx context.Context, t *testing.T, e *env, a *agent.Agent, held *resourceapi.ResourceClaim, _ kubeletplugin.PrepareResult) {
			w, err := cdi.New(e.cdiDir)
			if err != nil {
				t.Fatal(err)
			}
			unprepareOne(ctx, t, a, held)
			if _, err := os.Stat(w.SpecPath(held.UID)); !os.IsNotExist(err) {
				t.Errorf("CDI spec of the unprepared claim: %v, want it removed", err)
			}
			other := claim("other", gpus("gpus", "gpu-1")...)
			if err := prepareOne(ctx, t, a, other); err != nil {
				t.Errorf("after unprepare, gpu-1 is not free: %v", err)
			}
		},
		"prepared again by the kubelet": func(ctx context.Context, t *testing.T, e *env, a *agent.Agent, held *resourceapi.ResourceClaim, before kubeletplugin.PrepareResult) {
			res, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{held})
			if err != nil || res[held.UID].Err != nil {
				t.Fatalf("prepare again: %v %v", err, res[held.UID].Err)
			}
			if got, want := devicesByName(res[held.UID]), devicesByName(before); !equalDevices(got, want) {
				t.Errorf("prepare again answers %v, want %v as before", got, want)
			}
			// Adopted: named in the checkpoint, so the refusal names the
			// claim, after a restart too.
			a.Stop()
			a = e.start(ctx, t)
			err = prepareOne(ctx, t, a, claim("other", gpus("gpus", "gpu-2")...))
			if !errors.Is(err, agent.ErrDeviceInUse) || !strings.Contains(err.Error(), "prepared for claim held ("+string(held.UID)+")") {
				t.Errorf("other claim on gpu-2 after adoption: %v, want ErrDeviceInUse naming claim held", err)
			}
		},
		"allocated other GPUs": func(ctx context.Context, t *testing.T, _ *env, a *agent.Agent, held *resourceapi.ResourceClaim, _ kubeletplugin.PrepareResult) {
			moved := claim(held.Name, gpus("gpus", "gpu-1", "gpu-3")...)
			err := prepareOne(ctx, t, a, moved)
			if !errors.Is(err, agent.ErrReallocated) || !strings.Contains(err.Error(), "gpu-2") || !strings.Contains(err.Error(), "gpu-3") {
				t.Errorf("prepare with other GPUs: %v, want ErrReallocated naming gpu-2 and gpu-3", err)
			}
			if err := prepareOne(ctx, t, a, claim("other", gpus("gpus", "gpu-2")...)); !errors.Is(err, agent.ErrDeviceInUse) {
				t.Errorf("after the refused Prepare, other claim on gpu-2: %v, want ErrDeviceInUse", err)
			}
		},
		"restarted without the spec": func(ctx context.Context, t *testing.T, e *env, a *agent.Agent, held *resourceapi.ResourceClaim, _ kubeletplugin.PrepareResult) {
			a.Stop()
			w, err := cdi.New(e.cdiDir)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(w.SpecPath(held.UID)); err != nil {
				t.Fatal(err)
			}
			a = e.start(ctx, t)
			if err := prepareOne(ctx, t, a, claim("other", gpus("gpus", "gpu-1")...)); !errors.Is(err, agent.ErrDeviceInUse) {
				t.Errorf("after a restart without the spec, other claim on gpu-1: %v, want ErrDeviceInUse", err)
			}
		},
	}
	for name, then := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			e := newEnv(t)
			held := claim("held", gpus("gpus", "gpu-1", "gpu-2")...)
			before := loseCheckpoint(ctx, t, e, held)

			recorder := events.NewFakeRecorder(100)
			e.recorder = recorder
			a := e.start(ctx, t)
			ev := expectEventWithPrefix(t, recorder, "Warning "+agent.ReasonPreparedClaimsRecovered)
			for _, want := range []string{string(held.UID), "gpu-1", "gpu-2", e.stateDir} {
				if !strings.Contains(ev, want) {
					t.Errorf("event %q does not name %s", ev, want)
				}
			}
			if _, err := os.Stat(filepath.Join(e.stateDir, checkpoint.FileName)); err != nil {
				t.Errorf("checkpoint not written at start: %v", err)
			}
			for _, device := range []string{"gpu-1", "gpu-2"} {
				other := claim("other", gpus("gpus", device)...)
				err := prepareOne(ctx, t, a, other)
				if !errors.Is(err, agent.ErrDeviceInUse) || !strings.Contains(err.Error(), string(held.UID)) {
					t.Errorf("other claim on recovered %s: %v, want ErrDeviceInUse naming UID %s", device, err, held.UID)
				}
			}
			if err := prepareOne(ctx, t, a, claim("free", gpus("gpus", "gpu-0")...)); err != nil {
				t.Errorf("claim on a GPU that no spec names: %v", err)
			}
			then(ctx, t, e, a, held, before)
		})
	}
}

// A recovered claim whose request with admin access and ordinary request
// were both allocated one GPU, adopted when the kubelet prepares it again,
// still holds that GPU exclusively.
func TestRecoverAdoptsAdminAndOrdinaryRequest(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	held := claim("held", alloc{request: "monitor", device: "gpu-1", admin: true}, alloc{request: "work", device: "gpu-1"})
	loseCheckpoint(ctx, t, e, held)
	a := e.start(ctx, t)
	if err := prepareOne(ctx, t, a, held); err != nil {
		t.Fatalf("prepare the recovered claim again: %v", err)
	}
	err := prepareOne(ctx, t, a, claim("other", gpus("gpus", "gpu-1")...))
	if !errors.Is(err, agent.ErrDeviceInUse) || !strings.Contains(err.Error(), "prepared for claim held") {
		t.Errorf("other claim on gpu-1 after adoption: %v, want ErrDeviceInUse naming claim held", err)
	}
}

// A claim recovered from its CDI spec that a reboot moved to the claims of
// the boot before is not looked up by its empty name (the API server
// refuses that, and the check would log it again and again): it stays
// until the kubelet prepares or unprepares it.
func TestRecoveredClaimOfPreviousBootNotLookedUp(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	var unnamed atomic.Int32
	e.client.PrependReactor("get", "resourceclaims", func(action cgotesting.Action) (bool, runtime.Object, error) {
		if action.(cgotesting.GetAction).GetName() == "" {
			unnamed.Add(1)
			return true, nil, errors.New("resource name may not be empty")
		}
		return false, nil, nil
	})
	held := claim("held", gpus("gpus", "gpu-1")...)
	loseCheckpoint(ctx, t, e, held)
	a := e.start(ctx, t) // recovers the claim from its spec
	a.Stop()
	if err := os.WriteFile(e.bootIDFile, []byte("boot-2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	a = e.start(ctx, t)
	if _, err := a.CleanupStaleClaims(ctx); err != nil {
		t.Fatal(err)
	}
	if n := unnamed.Load(); n != 0 {
		t.Errorf("%d reads of a claim without a name", n)
	}
	cp, err := checkpoint.Read(e.stateDir)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := cp.PreviousBoot[held.UID]; !ok {
		t.Fatalf("recovered claim %s not among the previous boot's claims: %+v", held.UID, cp.PreviousBoot)
	}
	unprepareOne(ctx, t, a, held)
	if cp, err = checkpoint.Read(e.stateDir); err != nil {
		t.Fatal(err)
	}
	if _, ok := cp.PreviousBoot[held.UID]; ok {
		t.Errorf("recovered claim %s kept after the kubelet unprepared it", held.UID)
	}
}

// devicesByName maps a Prepare result's device names to their CDI ids.
func devicesByName(r kubeletplugin.PrepareResult) map[string]string {
	out := map[string]string{}
	for _, d := range r.Devices {
		out[d.PoolName+"/"+d.DeviceName+" "+strings.Join(d.Requests, ",")] = strings.Join(d.CDIDeviceIDs, ",")
	}
	return out
}

func equalDevices(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// TestRecoverUnreadableClaimSpec: an agent without a checkpoint whose CDI
// directory holds a claim spec of this driver that it cannot read does
// not start, as it cannot tell which GPUs that claim holds; it names the
// file on the Node. Files of others do not stop it.
func TestRecoverUnreadableClaimSpec(t *testing.T) {
	const uid = types.UID("uid-damaged")
	testcases := map[string]struct {
		file, content string
		wantErr       bool
	}{
		"not JSON":        {content: "{not json", wantErr: true},
		"empty":           {content: "", wantErr: true},
		"null":            {content: "null", wantErr: true},
		"other kind":      {content: `{"cdiVersion":"0.6.0","kind":"nvidia.com/gpu","devices":[{"name":"uid-damaged-gpu-1","containerEdits":{"env":["TOPODRA_GPU_1=GPU-1"]}}]}`, wantErr: true},
		"no device":       {content: `{"cdiVersion":"0.6.0","kind":"gpu.topodra.io/gpu","devices":[]}`, wantErr: true},
		"no UUID":         {content: `{"cdiVersion":"0.6.0","kind":"gpu.topodra.io/gpu","devices":[{"name":"uid-damaged-gpu-1","containerEdits":{"env":["OTHER=1"]}}]}`, wantErr: true},
		"foreign":         {file: "nvidia.com-gpu.json", content: "{not json"},
		"foreign, empty":  {file: "example.com-dev_x.json", content: ""},
		"other extension": {file: "gpu.topodra.io-gpu_" + string(uid) + ".json.bak", content: "{not json"},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			e := newEnv(t)
			w, err := cdi.New(e.cdiDir)
			if err != nil {
				t.Fatal(err)
			}
			path := w.SpecPath(uid)
			if tc.file != "" {
				path = filepath.Join(e.cdiDir, tc.file)
			}
			if err := os.WriteFile(path, []byte(tc.content), 0o644); err != nil {
				t.Fatal(err)
			}
			recorder := events.NewFakeRecorder(100)
			e.recorder = recorder
			a, err := agent.New(ctx, e.options(t))
			if !tc.wantErr {
				if err != nil {
					t.Fatalf("agent does not start beside %s: %v", tc.file, err)
				}
				defer a.Stop()
				if err := prepareOne(ctx, t, a, claim("c", gpus("gpus", "gpu-1")...)); err != nil {
					t.Errorf("prepare beside %s: %v", tc.file, err)
				}
				return
			}
			if err == nil {
				a.Stop()
				t.Fatal("agent started with an unreadable claim spec and no checkpoint")
			}
			if !errors.Is(err, agent.ErrCheckpoint) || !errors.Is(err, cdi.ErrUnreadableSpec) {
				t.Errorf("error %v, want ErrCheckpoint and cdi.ErrUnreadableSpec", err)
			}
			ev := expectEventWithPrefix(t, recorder, "Warning "+agent.ReasonCheckpointUnreadable)
			if !strings.Contains(ev, path) {
				t.Errorf("event %q does not name %s", ev, path)
			}
		})
	}
}

// TestRecoverRemovesSpecsOfEarlierBoot: an agent without a checkpoint on
// a --cdi-dir that outlives a reboot removes the claim specs last written
// before the node booted, unread: an empty one (what a power loss can
// leave) does not stop its start, and a good one of an earlier boot does
// not hold its GPUs. A claim spec of this boot is recovered, or, where it
// is damaged, stops the start as before.
func TestRecoverRemovesSpecsOfEarlierBoot(t *testing.T) {
	const damaged = types.UID("uid-damaged")
	testcases := map[string]struct {
		goodOld, damagedOld bool
	}{
		"both of an earlier boot":                      {goodOld: true, damagedOld: true},
		"damaged of an earlier boot, good of this one": {damagedOld: true},
		"good of an earlier boot, damaged of this one": {goodOld: true},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			e := newEnv(t)
			boot, ok := agent.SpecTimesTellBoot(e.cdiDir)
			if !ok {
				t.Skipf("the CDI directory %s lives one boot, or the boot time is unknown: every spec there is of this boot", e.cdiDir)
			}
			yearAgo := time.Now().AddDate(-1, 0, 0)
			if !yearAgo.Before(boot) {
				t.Skipf("the node booted %v, over a year ago", boot)
			}
			held := claim("held", gpus("gpus", "gpu-1", "gpu-2")...)
			loseCheckpoint(ctx, t, e, held)
			w, err := cdi.New(e.cdiDir)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(w.SpecPath(damaged), nil, 0o600); err != nil {
				t.Fatal(err)
			}
			for uid, old := range map[types.UID]bool{held.UID: tc.goodOld, damaged: tc.damagedOld} {
				if !old {
					continue
				}
				if err := os.Chtimes(w.SpecPath(uid), yearAgo, yearAgo); err != nil {
					t.Fatal(err)
				}
			}

			a, err := agent.New(ctx, e.options(t))
			if !tc.damagedOld {
				if err == nil {
					a.Stop()
					t.Fatal("agent started with an empty claim spec of this boot and no checkpoint")
				}
				if !errors.Is(err, agent.ErrCheckpoint) || !errors.Is(err, cdi.ErrUnreadableSpec) || !strings.Contains(err.Error(), w.SpecPath(damaged)) {
					t.Errorf("error %v, want ErrCheckpoint and cdi.ErrUnreadableSpec naming %s", err, w.SpecPath(damaged))
				}
			} else {
				if err != nil {
					t.Fatalf("agent does not start: %v", err)
				}
				t.Cleanup(a.Stop)
			}
			for uid, old := range map[types.UID]bool{held.UID: tc.goodOld, damaged: tc.damagedOld} {
				_, err := os.Stat(w.SpecPath(uid))
				if old && !errors.Is(err, os.ErrNotExist) {
					t.Errorf("spec of %s of an earlier boot: %v, want it removed", uid, err)
				}
				if !old && err != nil {
					t.Errorf("spec of %s of this boot: %v, want it kept", uid, err)
				}
			}
			if a == nil || err != nil {
				return
			}
			err = prepareOne(ctx, t, a, claim("other", gpus("gpus", "gpu-1")...))
			switch {
			case tc.goodOld && err != nil:
				t.Errorf("other claim on gpu-1, held by a claim of an earlier boot: %v", err)
			case !tc.goodOld && !errors.Is(err, agent.ErrDeviceInUse):
				t.Errorf("other claim on gpu-1, held by a recovered claim of this boot: %v, want ErrDeviceInUse", err)
			}
		})
	}
}
