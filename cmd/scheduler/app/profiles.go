package app

import (
	"fmt"
	"reflect"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/validation/field"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/cmd/kube-scheduler/app/options"
	schedconfig "k8s.io/kubernetes/pkg/scheduler/apis/config"
	frameworkplugins "k8s.io/kubernetes/pkg/scheduler/framework/plugins"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/feature"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/names"

	"github.com/topodra/topodra/pkg/plugins/topologydra"
	"github.com/topodra/topodra/pkg/plugins/topologydra/apis/config"
)

// checkConfigFile checks the KubeSchedulerConfiguration in path (see
// checkProfiles) before the scheduler is set up from it. An empty path (no
// --config: kube-scheduler's default configuration, without TopologyDRA)
// passes, and so does a file that does not load: kube-scheduler then
// reports why as it loads it. The feature gates must be set already.
func checkConfigFile(logger klog.Logger, path string) error {
	if path == "" {
		return nil
	}
	cfg, err := options.LoadConfigFromFile(logger, path)
	if err != nil {
		return nil
	}
	return checkProfiles(logger, cfg.Profiles, feature.NewSchedulerFeaturesFromGates(utilfeature.DefaultFeatureGate))
}

// knownPlugins names the plugins of topodra-scheduler: kube-scheduler's
// in-tree ones and topodra's.
var knownPlugins = func() sets.Set[string] {
	known := sets.New(topologydra.Name, topologydra.SortName)
	for name := range frameworkplugins.NewInTreeRegistry() {
		known.Insert(name)
	}
	return known
}()

// checkProfiles checks, in loaded (defaulted) profiles, what kube-scheduler's
// own validation leaves out since it does not know TopologyDRA:
//
//   - every pluginConfig entry names a plugin of this scheduler: the args
//     of another name (a misspelt TopologyDRA, say) are kept undecoded and
//     never read, so a typo would pass for the defaults;
//   - no profile enables both TopologyDRA and the stock DynamicResources
//     plugin: both would allocate the pods' claims and write them, and no
//     pod with a claim would ever bind;
//   - every TopologyDRA pluginConfig entry is valid under the feature gates
//     fts, whether its profile enables TopologyDRA or not, as kube-scheduler
//     validates the args of its own plugins;
//   - a profile that enables TopologyDRA runs it at PreFilter, Filter,
//     Reserve and PreBind (requiredPoints), and at PreScore wherever it
//     scores: without them a pod is bound with its claims unallocated,
//     devices in flight are never released, or Filter and Score fail for
//     want of PreFilter's and PreScore's state. A profile that runs it
//     without PostFilter, or after DefaultPreemption there, is logged as a
//     warning: its preemptors do not keep their nominations while their
//     victims' devices come back, and preemption may evict more pods.
//
// Args in a profile that does not enable TopologyDRA have no effect; that
// is logged as a warning, not refused, since kube-scheduler accepts args of
// a plugin that is disabled (a profile switched back to DynamicResources may
// keep them). A plugin counts as enabled in a profile when any extension
// point, multiPoint included, lists it as enabled: the plugins that the
// scheduler framework builds for the profile.
func checkProfiles(logger klog.Logger, profiles []schedconfig.KubeSchedulerProfile, fts feature.Features) error {
	var errs field.ErrorList
	for i := range profiles {
		prof := &profiles[i]
		path := field.NewPath("profiles").Index(i)
		enabled := enabledPlugins(prof.Plugins)
		if enabled.Has(topologydra.Name) && enabled.Has(names.DynamicResources) {
			errs = append(errs, field.Forbidden(path.Child("plugins"), fmt.Sprintf(
				"profile %q enables both %s and %s, which would both allocate the pods' claims (no pod with a claim would bind); disable %s in this profile: plugins: {multiPoint: {disabled: [{name: %s}]}}",
				prof.SchedulerName, topologydra.Name, names.DynamicResources, names.DynamicResources, names.DynamicResources)))
		}
		if enabled.Has(topologydra.Name) {
			errs = append(errs, checkPoints(logger, path, prof)...)
		}
		for j, pc := range prof.PluginConfig {
			if !knownPlugins.Has(pc.Name) {
				msg := "no plugin of this scheduler has that name, so its args would be ignored"
				for _, known := range sets.List(knownPlugins) {
					if strings.EqualFold(known, pc.Name) {
						msg += "; did you mean " + known + "?"
					}
				}
				errs = append(errs, field.Invalid(path.Child("pluginConfig").Index(j).Child("name"), pc.Name, msg))
				continue
			}
			if pc.Name != topologydra.Name {
				continue
			}
			argsPath := path.Child("pluginConfig").Index(j).Child("args")
			if pc.Args != nil {
				args, ok := pc.Args.(*config.TopologyDRAArgs)
				if !ok {
					errs = append(errs, field.Invalid(argsPath, fmt.Sprintf("%T", pc.Args), "want TopologyDRAArgs"))
					continue
				}
				errs = append(errs, config.ValidateTopologyDRAArgs(argsPath, args, fts)...)
			}
			if !enabled.Has(topologydra.Name) {
				logger.Info("Warning: "+topologydra.Name+" args are given in a profile that does not enable "+topologydra.Name+"; they have no effect",
					"profile", prof.SchedulerName, "field", argsPath.String())
			}
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("invalid %s configuration: %w", SchedulerName, errs.ToAggregate())
	}
	return nil
}

// enabledPlugins returns the names of the plugins that any extension point
// of plugins, multiPoint included, enables: after defaulting, the plugins
// that the scheduler framework builds for the profile.
func enabledPlugins(plugins *schedconfig.Plugins) sets.Set[string] {
	out := sets.New[string]()
	if plugins == nil {
		return out
	}
	v := reflect.ValueOf(plugins).Elem()
	for i := range v.NumField() {
		set, ok := v.Field(i).Interface().(schedconfig.PluginSet)
		if !ok {
			continue
		}
		for _, p := range set.Enabled {
			out.Insert(p.Name)
		}
	}
	return out
}

// requiredPoints are the extension points at which a profile that runs
// TopologyDRA at all must run it.
var requiredPoints = []string{"PreFilter", "Filter", "Reserve", "PreBind"}

// checkPoints checks at which extension points prof runs TopologyDRA (see
// checkProfiles).
func checkPoints(logger klog.Logger, path *field.Path, prof *schedconfig.KubeSchedulerProfile) field.ErrorList {
	var missing []string
	for _, point := range requiredPoints {
		if !runsAt(prof.Plugins, point, topologydra.Name) {
			missing = append(missing, point)
		}
	}
	if runsAt(prof.Plugins, "Score", topologydra.Name) && !runsAt(prof.Plugins, "PreScore", topologydra.Name) {
		missing = append(missing, "PreScore")
	}
	var errs field.ErrorList
	if len(missing) > 0 {
		errs = append(errs, field.Forbidden(path.Child("plugins"), fmt.Sprintf(
			"profile %q runs %s, but not at %s: it must run at PreFilter, Filter, Reserve and PreBind together (and at PreScore where it scores), or pods are bound with their claims unallocated and devices in flight are never released; enable it under multiPoint and do not disable it at these extension points",
			prof.SchedulerName, topologydra.Name, strings.Join(missing, ", "))))
	}
	if weight, ok := scoreWeight(prof.Plugins, topologydra.Name); ok && weight == 0 {
		logger.Info("Warning: "+topologydra.Name+" scores with no weight given, which kube-scheduler counts as 1, so other scores may outweigh topology: the shipped configuration gives it 4 (multiPoint: enabled: [{name: "+topologydra.Name+", weight: 4}]); to stop it scoring, disable it at score",
			"profile", prof.SchedulerName)
	}
	post := pointOrder(prof.Plugins, "PostFilter")
	switch self, preemption := slices.Index(post, topologydra.Name), slices.Index(post, names.DefaultPreemption); {
	case self < 0:
		logger.Info("Warning: "+topologydra.Name+" does not run at PostFilter: its preemptors do not keep their nominations while their victims' devices come back, and preemption may evict more pods than needed",
			"profile", prof.SchedulerName)
	case preemption >= 0 && preemption < self:
		logger.Info("Warning: "+topologydra.Name+" runs after "+names.DefaultPreemption+" at PostFilter: list it under postFilter.enabled (as config/scheduler-config.yaml does), or preemption may evict pods before it keeps a preemptor's nomination",
			"profile", prof.SchedulerName)
	}
	return errs
}

// scoreWeight is the weight that the plugin name scores with, as the
// framework takes it (score's entry before multiPoint's), 0 where none is
// given; ok is false where it does not run at Score.
func scoreWeight(plugins *schedconfig.Plugins, name string) (weight int32, ok bool) {
	if !runsAt(plugins, "Score", name) {
		return 0, false
	}
	for _, p := range append(slices.Clone(plugins.Score.Enabled), plugins.MultiPoint.Enabled...) {
		if p.Name == name {
			return p.Weight, true
		}
	}
	return 0, true
}

// runsAt reports whether the framework runs the plugin name at the
// extension point (a field of schedconfig.Plugins): it is enabled there,
// or under multiPoint and not disabled there by name or by "*".
func runsAt(plugins *schedconfig.Plugins, point, name string) bool {
	return slices.Contains(pointOrder(plugins, point), name)
}

// pointOrder lists the plugins that the framework runs at the extension
// point, in its order: those enabled there, then those of multiPoint that
// are not disabled there by name or by "*".
func pointOrder(plugins *schedconfig.Plugins, point string) []string {
	if plugins == nil {
		return nil
	}
	set := reflect.ValueOf(plugins).Elem().FieldByName(point).Interface().(schedconfig.PluginSet)
	var out []string
	for _, p := range set.Enabled {
		out = append(out, p.Name)
	}
	disabled := sets.New[string]()
	for _, p := range set.Disabled {
		disabled.Insert(p.Name)
	}
	if disabled.Has("*") {
		return out
	}
	for _, p := range plugins.MultiPoint.Enabled {
		if !disabled.Has(p.Name) && !slices.Contains(out, p.Name) {
			out = append(out, p.Name)
		}
	}
	return out
}
