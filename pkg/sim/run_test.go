package sim

import "testing"

// TestHeadroomArgsOfTheRunsProfile: the tracker judges the headroom with
// the args of the profile whose scheduler name the run's pods carry, not
// with the largest of any profile.
func TestHeadroomArgsOfTheRunsProfile(t *testing.T) {
	config := []byte(`apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
profiles:
- schedulerName: other
  pluginConfig:
  - name: TopologyDRA
    args:
      smallPodHeadroomPercent: 20
      wholeNodeDevices: 4
- schedulerName: topodra-scheduler
  pluginConfig:
  - name: TopologyDRA
    args:
      smallPodHeadroomPercent: 10
`)
	for _, tc := range []struct {
		name        string
		wantPercent int32
		wantWhole   int
	}{
		{"topodra-scheduler", 10, 8},
		{"other", 20, 4},
		{"absent", 0, 8},
	} {
		percent, whole, err := headroomArgs(config, tc.name)
		if err != nil {
			t.Fatal(err)
		}
		if percent != tc.wantPercent || whole != tc.wantWhole {
			t.Errorf("profile %s: headroom %d %%, whole node %d; want %d %%, %d", tc.name, percent, whole, tc.wantPercent, tc.wantWhole)
		}
	}
}
