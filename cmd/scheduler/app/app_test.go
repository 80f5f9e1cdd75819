package app

import (
	"strings"
	"testing"

	"github.com/topodra/topodra/pkg/version"
)

func TestVersionString(t *testing.T) {
	got := VersionString()
	if !strings.HasPrefix(got, "topodra-scheduler "+version.Version+" ") {
		t.Errorf("VersionString() = %q, want it to start with the topodra version %q", got, version.Version)
	}
	if !strings.Contains(got, "kube-scheduler v") {
		t.Errorf("VersionString() = %q, want the kube-scheduler version too", got)
	}
}

func TestCommandHasSchedulerFlags(t *testing.T) {
	cmd := NewCommand()
	if cmd.Use != SchedulerName {
		t.Errorf("Use = %q, want %q", cmd.Use, SchedulerName)
	}
	for _, name := range []string{"config", "secure-port", "version", "kubeconfig"} {
		if cmd.Flags().Lookup(name) == nil {
			t.Errorf("flag --%s missing", name)
		}
	}
	// --help prints Long.
	if !strings.HasPrefix(cmd.Long, "topodra-scheduler is kube-scheduler with the TopologyDRA plugin") || !strings.Contains(cmd.Long, "schedulerName: "+SchedulerName) {
		t.Errorf("Long = %q, want it to say what topodra-scheduler is and how pods use it", cmd.Long)
	}
}
