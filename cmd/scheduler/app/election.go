package app

import (
	"fmt"
	"slices"

	"github.com/spf13/pflag"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/cmd/kube-scheduler/app/options"
	schedconfig "k8s.io/kubernetes/pkg/scheduler/apis/config"
)

// AllowUnelectedFlag lets the command run without leader election.
const AllowUnelectedFlag = "allow-unelected"

// defaultLease is kube-scheduler's lease (namespace and name), which its
// default configuration competes for.
const defaultLeaseNamespace, defaultLeaseName = "kube-system", "kube-scheduler"

// checkElection checks how the command would run beside other schedulers:
// the configuration file named by --config, with the --leader-elect* flags
// that override its leaderElection, as kube-scheduler applies them. It
// refuses
//
//   - no --config: kube-scheduler's default configuration has no
//     TopologyDRA, so the binary would run as a second default-scheduler,
//     on kube-scheduler's lease;
//   - leader election off, unless --allow-unelected says that exactly one
//     instance runs: every replica (the shipped Deployment runs two) would
//     schedule at once, each with its own devices in flight, and they would
//     hand out the same devices;
//   - kube-scheduler's lease without a default-scheduler profile: topodra
//     would compete with the default scheduler for one lease, standing by
//     while it leads and, once it leads, leaving every pod of the default
//     scheduler pending.
//
// A file that does not load passes: kube-scheduler reports why as it
// loads it.
func checkElection(logger klog.Logger, fs *pflag.FlagSet) error {
	path := ""
	if f := fs.Lookup("config"); f != nil {
		path = f.Value.String()
	}
	if path == "" {
		return fmt.Errorf("%s needs --config with a profile that enables TopologyDRA (see config/scheduler-config.yaml): without it, it would run as a second default-scheduler on kube-scheduler's lease", SchedulerName)
	}
	cfg, err := options.LoadConfigFromFile(logger, path)
	if err != nil {
		return nil
	}
	le := cfg.LeaderElection
	if changed(fs, "leader-elect") {
		le.LeaderElect = fs.Lookup("leader-elect").Value.String() == "true"
	}
	if changed(fs, "leader-elect-resource-name") {
		le.ResourceName = fs.Lookup("leader-elect-resource-name").Value.String()
	}
	if changed(fs, "leader-elect-resource-namespace") {
		le.ResourceNamespace = fs.Lookup("leader-elect-resource-namespace").Value.String()
	}
	allow, _ := fs.GetBool(AllowUnelectedFlag)
	if !le.LeaderElect && !allow {
		return fmt.Errorf("leader election is off (leaderElection.leaderElect in %s, or --leader-elect=false): every running replica of %s would allocate devices on its own and hand out the same devices twice (the shipped Deployment runs 2); set leaderElect: true with resourceName: %s, or pass --%s where exactly one instance ever runs",
			path, SchedulerName, SchedulerName, AllowUnelectedFlag)
	}
	if le.LeaderElect && le.ResourceNamespace == defaultLeaseNamespace && le.ResourceName == defaultLeaseName && !hasProfile(cfg.Profiles, "default-scheduler") {
		return fmt.Errorf("leader election uses %s/%s, the default scheduler's lease, but no profile is default-scheduler: beside kube-scheduler, %s would stand by while it leads and leave its pods pending once it leads; set leaderElection.resourceName: %s (use %s only with a default-scheduler profile that replaces kube-scheduler)",
			defaultLeaseNamespace, defaultLeaseName, SchedulerName, SchedulerName, defaultLeaseName)
	}
	return nil
}

func changed(fs *pflag.FlagSet, name string) bool {
	f := fs.Lookup(name)
	return f != nil && f.Changed
}

func hasProfile(profiles []schedconfig.KubeSchedulerProfile, name string) bool {
	return slices.ContainsFunc(profiles, func(p schedconfig.KubeSchedulerProfile) bool { return p.SchedulerName == name })
}
