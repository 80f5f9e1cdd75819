package topologydra

import (
	"fmt"
	"reflect"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	schedconfig "k8s.io/kubernetes/pkg/scheduler/apis/config"
	schedscheme "k8s.io/kubernetes/pkg/scheduler/apis/config/scheme"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/feature"
	"sigs.k8s.io/yaml"

	"github.com/topodra/topodra/config"
	pluginconfig "github.com/topodra/topodra/pkg/plugins/topologydra/apis/config"
	v1 "github.com/topodra/topodra/pkg/plugins/topologydra/apis/config/v1"
)

// FuzzArgsDecode feeds TopologyDRA args through the scheduler's strict
// configuration decoder (the one kube-scheduler uses for --config), then
// through validation. Nothing may panic; decoded args that validate must
// survive another encode/decode unchanged.
func FuzzArgsDecode(f *testing.F) {
	for _, seed := range []string{
		"scoringStrategy: MostAllocated\nalignment: prefer\n",
		"topologyAttributes: [gpu.topodra.io/nvlinkClique, resource.kubernetes.io/pcieRoot]\n",
		"roomWeight: 70\npackingWeight: 30\nownedTaintKey: gpu.topodra.io/topodra-only\n",
		"alignment: require\nbindingTimeoutSeconds: 0\n",
		"alignment: sideways\n",
		"unknownField: 1\n",
		"topologyAttributes: []\nownedTaintKey: \"\"\n",
		"roomWeight: -1\n",
		"{}",
		"[",
	} {
		f.Add(seed)
	}
	f.Add(string(config.SchedulerConfig))
	f.Fuzz(func(t *testing.T, args string) {
		doc := args
		if !strings.Contains(args, "KubeSchedulerConfiguration") {
			doc = wrapArgs(args)
		}
		decoded := decodeArgs(t, doc)
		if decoded == nil {
			return
		}
		if errs := pluginconfig.ValidateTopologyDRAArgs(field.NewPath("args"), decoded, feature.NewSchedulerFeaturesFromGates(utilfeature.DefaultFeatureGate)); len(errs) > 0 {
			return
		}
		versioned := &v1.TopologyDRAArgs{}
		v1.ConvertBack(decoded, versioned)
		versioned.TypeMeta = metav1.TypeMeta{}
		encoded, err := yaml.Marshal(versioned)
		if err != nil {
			t.Fatalf("encode valid args %+v: %v", decoded, err)
		}
		again := decodeArgs(t, wrapArgs(string(encoded)))
		if again == nil || !reflect.DeepEqual(decoded, again) {
			t.Errorf("args changed on a round trip:\n%#v\n%#v", decoded, again)
		}
	})
}

func wrapArgs(args string) string {
	var b strings.Builder
	b.WriteString("apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\nprofiles:\n- schedulerName: topodra-scheduler\n  pluginConfig:\n  - name: TopologyDRA\n    args:\n")
	for _, line := range strings.Split(args, "\n") {
		fmt.Fprintf(&b, "      %s\n", line)
	}
	return b.String()
}

// decodeArgs decodes a KubeSchedulerConfiguration and returns the args of
// the first TopologyDRA plugin config, or nil if it does not decode.
func decodeArgs(t *testing.T, doc string) *pluginconfig.TopologyDRAArgs {
	obj, _, err := schedscheme.Codecs.UniversalDecoder().Decode([]byte(doc), nil, nil)
	if err != nil {
		return nil
	}
	cfg, ok := obj.(*schedconfig.KubeSchedulerConfiguration)
	if !ok {
		return nil
	}
	for _, p := range cfg.Profiles {
		for _, pc := range p.PluginConfig {
			if pc.Name != Name {
				continue
			}
			args, ok := pc.Args.(*pluginconfig.TopologyDRAArgs)
			if !ok {
				t.Fatalf("args of %s decoded as %T", Name, pc.Args)
			}
			return args
		}
	}
	return nil
}
