package app

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/config"
	"github.com/topodra/topodra/manifests"
)

const configHeader = `apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
leaderElection:
  leaderElect: false
`

// bothDRAPlugins enables TopologyDRA beside the stock DynamicResources
// plugin, which stays enabled by default.
const bothDRAPlugins = configHeader + `profiles:
- schedulerName: topodra-scheduler
  plugins:
    multiPoint:
      enabled:
      - name: TopologyDRA
`

// topodraProfile is a profile that enables TopologyDRA in place of the
// stock DynamicResources plugin, first at PostFilter, up to its
// pluginConfig.
const topodraProfile = configHeader + `profiles:
- schedulerName: topodra-scheduler
  plugins:
    multiPoint:
      enabled:
      - name: TopologyDRA
        weight: 4
      disabled:
      - name: DynamicResources
    postFilter:
      enabled:
      - name: TopologyDRA
`

func writeConfig(t *testing.T, data string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestCheckConfigFile(t *testing.T) {
	shipped, err := manifests.FS.ReadFile("base/scheduler-config.yaml")
	if err != nil {
		t.Fatal(err)
	}
	tests := map[string]struct {
		config   string
		wantErr  []string
		wantWarn string
	}{
		"config/scheduler-config.yaml":         {config: string(config.SchedulerConfig)},
		"config/multi-profile.yaml":            {config: string(config.MultiProfileConfig)},
		"manifests/base/scheduler-config.yaml": {config: string(shipped)},
		"no TopologyDRA":                       {config: configHeader + "profiles:\n- schedulerName: default-scheduler\n"},
		"TopologyDRA beside DynamicResources": {
			config:   bothDRAPlugins,
			wantErr:  []string{`profiles[0].plugins: Forbidden: profile "topodra-scheduler" enables both TopologyDRA and DynamicResources`, "disable DynamicResources in this profile"},
			wantWarn: "runs after DefaultPreemption",
		},
		"the second profile enables both": {
			config: configHeader + `profiles:
- schedulerName: default-scheduler
- schedulerName: topodra-scheduler
  plugins:
    filter:
      enabled:
      - name: TopologyDRA
`,
			wantErr:  []string{`profiles[1].plugins`, `profile "topodra-scheduler"`},
			wantWarn: "does not run at PostFilter",
		},
		"TopologyDRA at Filter only": {
			config: configHeader + `profiles:
- schedulerName: topodra-scheduler
  plugins:
    filter:
      enabled:
      - name: TopologyDRA
    multiPoint:
      disabled:
      - name: DynamicResources
`,
			wantErr:  []string{`profile "topodra-scheduler" runs TopologyDRA, but not at PreFilter, Reserve, PreBind:`, "enable it under multiPoint"},
			wantWarn: "does not run at PostFilter",
		},
		"every PreBind plugin disabled": {
			config: topodraProfile + `    preBind:
      disabled:
      - name: "*"
`,
			wantErr: []string{"but not at PreBind:"},
		},
		"TopologyDRA disabled at Reserve": {
			config: topodraProfile + `    reserve:
      disabled:
      - name: TopologyDRA
`,
			wantErr: []string{"but not at Reserve:"},
		},
		"scores without PreScore": {
			config: topodraProfile + `    preScore:
      disabled:
      - name: TopologyDRA
`,
			wantErr: []string{"but not at PreScore:"},
		},
		"every Reserve plugin disabled, TopologyDRA enabled there": {
			config: topodraProfile + `    reserve:
      enabled:
      - name: TopologyDRA
      disabled:
      - name: "*"
`,
		},
		"TopologyDRA under multiPoint only": {
			config:   strings.TrimSuffix(topodraProfile, "    postFilter:\n      enabled:\n      - name: TopologyDRA\n"),
			wantWarn: "TopologyDRA runs after DefaultPreemption at PostFilter",
		},
		"TopologyDRA without a score weight": {
			config:   strings.Replace(topodraProfile, "        weight: 4\n", "", 1),
			wantWarn: "TopologyDRA scores with no weight given, which kube-scheduler counts as 1",
		},
		"TopologyDRA with a score weight at score": {
			config: strings.Replace(topodraProfile, "        weight: 4\n", "", 1) + `    score:
      enabled:
      - name: TopologyDRA
        weight: 2
`,
		},
		"TopologyDRA disabled at score, without a weight": {
			config: strings.Replace(topodraProfile, "        weight: 4\n", "", 1) + `    score:
      disabled:
      - name: TopologyDRA
`,
		},
		"TopologyDRA disabled at PostFilter": {
			config: strings.TrimSuffix(topodraProfile, "    postFilter:\n      enabled:\n      - name: TopologyDRA\n") + `    postFilter:
      disabled:
      - name: TopologyDRA
`,
			wantWarn: "TopologyDRA does not run at PostFilter",
		},
		"DynamicResources enabled again at one extension point": {
			config: topodraProfile + `    reserve:
      enabled:
      - name: DynamicResources
`,
			wantErr: []string{`profile "topodra-scheduler" enables both`},
		},
		"DynamicResources disabled with all default plugins": {
			config: configHeader + `profiles:
- schedulerName: topodra-scheduler
  plugins:
    multiPoint:
      enabled:
      - name: TopologyDRA
        weight: 4
      - name: DefaultBinder
      - name: PrioritySort
      disabled:
      - name: "*"
`,
		},
		"invalid args where TopologyDRA is enabled": {
			config: topodraProfile + `  pluginConfig:
  - name: TopologyDRA
    args:
      ownedTaintKey: "not a valid key!"
`,
			wantErr: []string{"profiles[0].pluginConfig[0].args.ownedTaintKey"},
		},
		"invalid args where TopologyDRA is not enabled": {
			config: configHeader + `profiles:
- schedulerName: default-scheduler
  pluginConfig:
  - name: NodeResourcesFit
    args:
      scoringStrategy:
        type: LeastAllocated
  - name: TopologyDRA
    args:
      topologyAttributes: [pcieRoot]
`,
			wantErr:  []string{`profiles[0].pluginConfig[1].args.topologyAttributes[0]: Invalid value: "pcieRoot"`},
			wantWarn: `does not enable TopologyDRA`,
		},
		"args under a misspelt plugin name": {
			config: topodraProfile + `  pluginConfig:
  - name: TopologyDra
    args:
      scoringStrategy: LeastAllocated
`,
			wantErr: []string{`profiles[0].pluginConfig[0].name: Invalid value: "TopologyDra"`, "its args would be ignored", "did you mean TopologyDRA?"},
		},
		"args under a plugin this scheduler does not have": {
			config: configHeader + `profiles:
- schedulerName: topodra-scheduler
  pluginConfig:
  - name: NoSuchPlugin
    args: {}
`,
			wantErr: []string{`profiles[0].pluginConfig[0].name: Invalid value: "NoSuchPlugin"`},
		},
		"valid args where TopologyDRA is not enabled": {
			config: configHeader + `profiles:
- schedulerName: default-scheduler
  pluginConfig:
  - name: TopologyDRA
    args:
      scoringStrategy: LeastAllocated
`,
			wantWarn: `TopologyDRA args are given in a profile that does not enable TopologyDRA; they have no effect profile="default-scheduler" field="profiles[0].pluginConfig[0].args"`,
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var buf ktesting.BufferTL
			err := checkConfigFile(ktesting.NewLogger(&buf, ktesting.NewConfig()), writeConfig(t, tc.config))
			switch {
			case len(tc.wantErr) == 0 && err != nil:
				t.Errorf("unexpected error: %v", err)
			case len(tc.wantErr) > 0 && err == nil:
				t.Errorf("no error, want one containing %q", tc.wantErr)
			case err != nil:
				for _, want := range tc.wantErr {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("error %q does not contain %q", err, want)
					}
				}
			}
			warned := strings.Contains(buf.String(), "Warning")
			switch {
			case tc.wantWarn == "" && warned:
				t.Errorf("unexpected warning: %s", buf.String())
			case tc.wantWarn != "" && !strings.Contains(buf.String(), tc.wantWarn):
				t.Errorf("log %q, want a warning containing %q", buf.String(), tc.wantWarn)
			}
		})
	}
}

// TestStartRefusesConfig: the command and the in-process scheduler (the
// simulator's and the tests' entry point) refuse a profile that enables
// both DRA plugins, and invalid TopologyDRA args in a profile that does
// not enable TopologyDRA, before they set the scheduler up. The kubeconfig
// is missing, so that setting up would fail with another error.
func TestStartRefusesConfig(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing-kubeconfig")
	tests := map[string]struct {
		config, want string
	}{
		"TopologyDRA beside DynamicResources": {
			config: bothDRAPlugins,
			want:   `profile "topodra-scheduler" enables both TopologyDRA and DynamicResources`,
		},
		"invalid args where TopologyDRA is not enabled": {
			config: configHeader + `profiles:
- schedulerName: default-scheduler
  pluginConfig:
  - name: TopologyDRA
    args:
      bindingTimeoutSeconds: 10000000000000
`,
			want: "profiles[0].pluginConfig[0].args.bindingTimeoutSeconds",
		},
	}
	for name, tc := range tests {
		path := writeConfig(t, tc.config+"clientConnection:\n  kubeconfig: "+missing+"\n")
		t.Run(name+", in process", func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			err := Run(ctx, []string{"--config=" + path, "--secure-port=0"}, false)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Run: %v, want an error containing %q", err, tc.want)
			}
		})
		t.Run(name+", command", func(t *testing.T) {
			cmd := NewCommand()
			cmd.SetArgs([]string{"--config=" + path, "--secure-port=0"})
			cmd.SetOut(io.Discard)
			cmd.SetErr(io.Discard)
			err := cmd.Execute()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("command: %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
