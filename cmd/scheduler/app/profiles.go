package app

import (
	"fmt"
	"reflect"
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
//     validates the args of its own plugins.
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
