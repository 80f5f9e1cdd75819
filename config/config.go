// Package config embeds the KubeSchedulerConfiguration files of this
// directory so that tests, benchmarks and the simulator use exactly the
// files that are deployed.
package config

import _ "embed"

// SchedulerConfig is scheduler-config.yaml: one profile, topodra-scheduler.
//
//go:embed scheduler-config.yaml
var SchedulerConfig []byte

// MultiProfileConfig is multi-profile.yaml: default-scheduler and
// topodra-scheduler in one binary.
//
//go:embed multi-profile.yaml
var MultiProfileConfig []byte
