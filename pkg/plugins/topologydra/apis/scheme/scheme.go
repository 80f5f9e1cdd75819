// Package scheme registers the TopologyDRA plugin's argument types in the
// kube-scheduler's configuration scheme. Importing it (the plugin does) is
// what lets `pluginConfig: [{name: TopologyDRA, args: {...}}]` be decoded
// strictly, defaulted and converted by the scheduler's own config loader.
package scheme

import (
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	kubeschedulerscheme "k8s.io/kubernetes/pkg/scheduler/apis/config/scheme"
	kubeschedulerv1 "k8s.io/kubernetes/pkg/scheduler/apis/config/v1"

	"github.com/topodra/topodra/pkg/plugins/topologydra/apis/config"
	v1 "github.com/topodra/topodra/pkg/plugins/topologydra/apis/config/v1"
)

func init() {
	utilruntime.Must(config.AddToScheme(kubeschedulerscheme.Scheme))
	utilruntime.Must(v1.AddToScheme(kubeschedulerscheme.Scheme))
	// The scheduler converts typed plugin args with a scheme of its own.
	utilruntime.Must(config.AddToScheme(kubeschedulerv1.GetPluginArgConversionScheme()))
	utilruntime.Must(v1.AddToScheme(kubeschedulerv1.GetPluginArgConversionScheme()))
}
