package manifests

import (
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
)

// minAgentStartup is how long the agent's startup probe must let it start
// before the kubelet restarts it: NVML opens before /healthz answers (the
// agent's own liveness then fails a later step of its start that hangs).
const minAgentStartup = 300 * time.Second

// TestAgentStartupProbe: in the base and every overlay, the agent
// container has a startup probe on the liveness probe's endpoint that
// allows at least minAgentStartup, so that the liveness probe cannot kill
// an agent that is still starting.
func TestAgentStartupProbe(t *testing.T) {
	for name, objs := range sets(t) {
		ds, ok := find(objs, func(d *appsv1.DaemonSet) bool { return d.Name == "topodra-node-agent" })
		if !ok {
			continue
		}
		t.Run(name, func(t *testing.T) {
			c := &ds.Spec.Template.Spec.Containers[0]
			startup, live := c.StartupProbe, c.LivenessProbe
			if startup == nil || startup.HTTPGet == nil {
				t.Fatal("agent has no HTTP startup probe: the liveness probe can kill it while it starts")
			}
			if live == nil || live.HTTPGet == nil || startup.HTTPGet.Path != live.HTTPGet.Path || startup.HTTPGet.Port != live.HTTPGet.Port {
				t.Errorf("startup probe %+v does not probe the liveness probe's endpoint %+v", startup.HTTPGet, live)
			}
			// The kubelet's defaults for fields left out.
			period, failures := startup.PeriodSeconds, startup.FailureThreshold
			if period == 0 {
				period = 10
			}
			if failures == 0 {
				failures = 3
			}
			if allowed := time.Duration(startup.InitialDelaySeconds+period*failures) * time.Second; allowed < minAgentStartup {
				t.Errorf("startup probe allows %v, want at least %v", allowed, minAgentStartup)
			}
		})
	}
}
