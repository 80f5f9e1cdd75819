package app

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/klog/v2"
	schedapp "k8s.io/kubernetes/cmd/kube-scheduler/app"
	"k8s.io/kubernetes/cmd/kube-scheduler/app/options"
	"sigs.k8s.io/yaml"

	"github.com/topodra/topodra/config"
	"github.com/topodra/topodra/manifests"
	"github.com/topodra/topodra/pkg/plugins/topologydra"
)

// TestShippedSchedulerConfigs builds the scheduler from every shipped
// configuration (no API server is contacted) and checks that TopologyDRA's
// PostFilter, which deallocates claims no node can use, runs before
// DefaultPreemption, as the stock DynamicResources plugin does, that
// every profile sorts the queue with DeviceCountSort, and that every
// configuration gives TopologyDRA's score the same weight.
func TestShippedSchedulerConfigs(t *testing.T) {
	shipped, err := manifests.FS.ReadFile("base/scheduler-config.yaml")
	if err != nil {
		t.Fatal(err)
	}
	configs := map[string][]byte{
		"config/scheduler-config.yaml":         config.SchedulerConfig,
		"config/multi-profile.yaml":            config.MultiProfileConfig,
		"manifests/base/scheduler-config.yaml": shipped,
	}
	weights := map[string]int32{}
	for name, cfg := range configs {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			kubeconfig := filepath.Join(dir, "kubeconfig")
			kc := clientcmdapi.NewConfig()
			kc.Clusters["c"] = &clientcmdapi.Cluster{Server: "https://127.0.0.1:1", InsecureSkipTLSVerify: true}
			kc.AuthInfos["u"] = &clientcmdapi.AuthInfo{Token: "x"}
			kc.Contexts["c"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "u"}
			kc.CurrentContext = "c"
			if err := clientcmd.WriteToFile(*kc, kubeconfig); err != nil {
				t.Fatal(err)
			}
			var obj map[string]any
			if err := yaml.Unmarshal(cfg, &obj); err != nil {
				t.Fatal(err)
			}
			obj["clientConnection"] = map[string]any{"kubeconfig": kubeconfig}
			obj["leaderElection"] = map[string]any{"leaderElect": false}
			data, err := yaml.Marshal(obj)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(dir, "config.yaml")
			if err := os.WriteFile(path, data, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := checkConfigFile(klog.Background(), path); err != nil {
				t.Fatalf("topodra's own checks refuse the shipped configuration: %v", err)
			}
			opts := options.NewOptions()
			for _, fs := range opts.Flags.FlagSets {
				for flag, value := range map[string]string{"config": path, "secure-port": "0"} {
					if f := fs.Lookup(flag); f != nil {
						if err := f.Value.Set(value); err != nil {
							t.Fatal(err)
						}
					}
				}
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			_, sched, err := schedapp.Setup(ctx, opts, RegistryOptions()...)
			if err != nil {
				t.Fatalf("set up scheduler: %v", err)
			}
			fw, ok := sched.Profiles["topodra-scheduler"]
			if !ok {
				t.Fatal("no topodra-scheduler profile")
			}
			var order []string
			for _, p := range fw.ListPlugins().PostFilter.Enabled {
				order = append(order, p.Name)
			}
			for _, p := range fw.ListPlugins().Score.Enabled {
				if p.Name == topologydra.Name {
					weights[name] = p.Weight
				}
			}
			dra, preempt := slices.Index(order, topologydra.Name), slices.Index(order, "DefaultPreemption")
			if dra < 0 || preempt < 0 || dra > preempt {
				t.Errorf("PostFilter plugins %v: want %s before DefaultPreemption", order, topologydra.Name)
			}
			for profile, fw := range sched.Profiles {
				sorts := fw.ListPlugins().QueueSort.Enabled
				if len(sorts) != 1 || sorts[0].Name != topologydra.SortName {
					t.Errorf("profile %s: QueueSort plugins %v, want %s only", profile, sorts, topologydra.SortName)
				}
			}
		})
	}
	// The deployed ConfigMap and the config files score alike.
	for name, w := range weights {
		if w != weights["config/scheduler-config.yaml"] {
			t.Errorf("%s: TopologyDRA score weight %d, config/scheduler-config.yaml has %d", name, w, weights["config/scheduler-config.yaml"])
		}
	}
}
