package topologydra

import (
	"context"
	"time"

	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/util/validation/field"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	featuregatetesting "k8s.io/component-base/featuregate/testing"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/cmd/kube-scheduler/app/options"
	"k8s.io/kubernetes/pkg/features"
	schedconfig "k8s.io/kubernetes/pkg/scheduler/apis/config"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/feature"

	"github.com/topodra/topodra/pkg/plugins/topologydra/apis/config"
)

func loadProfileArgs(t *testing.T, path, profile string) (*config.TopologyDRAArgs, *schedconfig.KubeSchedulerProfile) {
	t.Helper()
	cfg, err := options.LoadConfigFromFile(klog.Background(), path)
	if err != nil {
		t.Fatalf("load %s: %v", path, err)
	}
	for i := range cfg.Profiles {
		p := &cfg.Profiles[i]
		if p.SchedulerName != profile {
			continue
		}
		for _, pc := range p.PluginConfig {
			if pc.Name == Name {
				args, ok := pc.Args.(*config.TopologyDRAArgs)
				if !ok {
					t.Fatalf("%s: args of %s decoded as %T, want *config.TopologyDRAArgs", path, Name, pc.Args)
				}
				return args, p
			}
		}
		return nil, p
	}
	t.Fatalf("%s: no profile %s", path, profile)
	return nil, nil
}

func TestConfigFilesDecode(t *testing.T) {
	tests := map[string]struct {
		file string
		want config.TopologyDRAArgs
	}{
		"scheduler-config.yaml": {
			file: "scheduler-config.yaml",
			want: config.TopologyDRAArgs{
				TopologyAttributes:         []string{"gpu.topodra.io/nvlinkClique", "resource.kubernetes.io/pcieRoot", "resource.kubernetes.io/numaNode"},
				ScoringStrategy:            config.MostAllocated,
				WholeNodeTrade:             0,
				WholeNodeTradeWhileWaiting: 2,
				DrainTrade:                 1,
				RoomWeight:                 70,
				PackingWeight:              30,
				AgeWeight:                  30,
				SmallPodHeadroomPercent:    12,
				WholeNodeDevices:           8,
				NICRootTrade:               1,
				NICReservePercent:          5,
				Alignment:                  config.AlignmentPrefer,
				OwnedTaintKey:              "gpu.topodra.io/topodra-only",
				BindingTimeoutSeconds:      600,
				FilterTimeout:              config.DefaultFilterTimeout,
			},
		},
		"multi-profile.yaml (defaults filled in)": {
			file: "multi-profile.yaml",
			want: *DefaultArgs(),
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			args, profile := loadProfileArgs(t, filepath.Join("..", "..", "..", "config", tc.file), "topodra-scheduler")
			if args == nil {
				t.Fatalf("no TopologyDRA args in profile")
			}
			got := *args
			got.TypeMeta = tc.want.TypeMeta
			if strings.Join(got.TopologyAttributes, ",") != strings.Join(tc.want.TopologyAttributes, ",") {
				t.Errorf("topologyAttributes = %v, want %v", got.TopologyAttributes, tc.want.TopologyAttributes)
			}
			got.TopologyAttributes, tc.want.TopologyAttributes = nil, nil
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("args = %+v, want %+v", got, tc.want)
			}
			if errs := config.ValidateTopologyDRAArgs(field.NewPath("args"), args, defaultFeatures()); len(errs) > 0 {
				t.Errorf("config file args invalid: %v", errs)
			}
			enabled := false
			for _, p := range profile.Plugins.MultiPoint.Enabled {
				enabled = enabled || p.Name == Name
			}
			for _, p := range profile.Plugins.MultiPoint.Disabled {
				if p.Name == Name {
					enabled = false
				}
			}
			if !enabled {
				t.Errorf("%s not enabled in profile", Name)
			}
		})
	}
}

func TestStrictDecoding(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "bad.yaml")
	data := `apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
profiles:
- schedulerName: topodra-scheduler
  pluginConfig:
  - name: TopologyDRA
    args:
      scoringStrategy: MostAllocated
      alignmentWieght: 3
`
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := options.LoadConfigFromFile(klog.Background(), path)
	if err == nil || !strings.Contains(err.Error(), "alignmentWieght") {
		t.Errorf("unknown field: got error %v, want one naming alignmentWieght", err)
	}
}

func TestValidateArgs(t *testing.T) {
	tests := map[string]struct {
		mutate  func(*config.TopologyDRAArgs)
		wantErr string
	}{
		"defaults are valid":        {mutate: func(*config.TopologyDRAArgs) {}},
		"unqualified attr":          {mutate: func(a *config.TopologyDRAArgs) { a.TopologyAttributes = []string{"pcieRoot"} }, wantErr: "fully qualified"},
		"duplicate attr":            {mutate: func(a *config.TopologyDRAArgs) { a.TopologyAttributes = []string{"a.io/x", "a.io/x"} }, wantErr: "Duplicate"},
		"attr with a space":         {mutate: func(a *config.TopologyDRAArgs) { a.TopologyAttributes = []string{"a.io/pcie root"} }, wantErr: `topologyAttributes[0]: Invalid value: "a.io/pcie root"`},
		"attr with a dash":          {mutate: func(a *config.TopologyDRAArgs) { a.TopologyAttributes = []string{"a.io/pcie-root"} }, wantErr: "C identifier"},
		"attr with two slashes":     {mutate: func(a *config.TopologyDRAArgs) { a.TopologyAttributes = []string{"a.io/x", "a.io/b/c"} }, wantErr: `topologyAttributes[1]: Invalid value: "a.io/b/c"`},
		"attr with a bad domain":    {mutate: func(a *config.TopologyDRAArgs) { a.TopologyAttributes = []string{"a_b.io/x"} }, wantErr: "the domain"},
		"attr with an empty domain": {mutate: func(a *config.TopologyDRAArgs) { a.TopologyAttributes = []string{"/x"} }, wantErr: "domain must not be empty"},
		"attr with an empty name":   {mutate: func(a *config.TopologyDRAArgs) { a.TopologyAttributes = []string{"a.io/"} }, wantErr: "name must not be empty"},
		"attr with a long name":     {mutate: func(a *config.TopologyDRAArgs) { a.TopologyAttributes = []string{"a.io/" + strings.Repeat("x", 33)} }, wantErr: "at most 32"},
		"attr with a long domain":   {mutate: func(a *config.TopologyDRAArgs) { a.TopologyAttributes = []string{strings.Repeat("a", 64) + "/x"} }, wantErr: "at most 63"},
		"attr at the length limits": {mutate: func(a *config.TopologyDRAArgs) {
			a.TopologyAttributes = []string{strings.Repeat("a", 63) + "/" + strings.Repeat("x", 32)}
		}},
		"attr with upper case": {mutate: func(a *config.TopologyDRAArgs) { a.TopologyAttributes = []string{"GPU.example.com/NVLink_Clique"} }},
		"no attrs":             {mutate: func(a *config.TopologyDRAArgs) { a.TopologyAttributes = []string{} }},
		"bad strategy":         {mutate: func(a *config.TopologyDRAArgs) { a.ScoringStrategy = "Random" }, wantErr: "scoringStrategy"},
		"bad alignment":        {mutate: func(a *config.TopologyDRAArgs) { a.Alignment = "always" }, wantErr: "alignment"},
		"require without attributes": {mutate: func(a *config.TopologyDRAArgs) {
			a.Alignment, a.TopologyAttributes = config.AlignmentRequire, []string{}
		}, wantErr: "needs topologyAttributes"},
		"zero weights":                     {mutate: func(a *config.TopologyDRAArgs) { a.RoomWeight, a.PackingWeight = 0, 0 }, wantErr: "both be zero"},
		"spreading without packing weight": {mutate: func(a *config.TopologyDRAArgs) { a.ScoringStrategy, a.PackingWeight = config.LeastAllocated, 0 }},
		"spreading with packing weight": {mutate: func(a *config.TopologyDRAArgs) {
			a.ScoringStrategy, a.RoomWeight, a.PackingWeight = config.LeastAllocated, 0, 1
		}},
		"packing without packing weight": {mutate: func(a *config.TopologyDRAArgs) { a.PackingWeight = 0 }},
		"negative weight":                {mutate: func(a *config.TopologyDRAArgs) { a.PackingWeight = -1 }, wantErr: "negative"},
		"negative trade":                 {mutate: func(a *config.TopologyDRAArgs) { a.WholeNodeTrade = -1 }, wantErr: "wholeNodeTrade"},
		"negative drain trade":           {mutate: func(a *config.TopologyDRAArgs) { a.DrainTrade = -1 }, wantErr: "drainTrade"},
		"no trade is valid":              {mutate: func(a *config.TopologyDRAArgs) { a.WholeNodeTrade = 0 }},
		"zero binding timout":            {mutate: func(a *config.TopologyDRAArgs) { a.BindingTimeoutSeconds = 0 }, wantErr: "positive"},
		"binding timeout of a day":       {mutate: func(a *config.TopologyDRAArgs) { a.BindingTimeoutSeconds = 86400 }},
		"binding timeout above a day":    {mutate: func(a *config.TopologyDRAArgs) { a.BindingTimeoutSeconds = 86401 }, wantErr: "bindingTimeoutSeconds"},
		// time.Duration(secs) * time.Second would overflow to a negative
		// timeout.
		"overflowing binding timeout":      {mutate: func(a *config.TopologyDRAArgs) { a.BindingTimeoutSeconds = 1 << 40 }, wantErr: "at most 86400"},
		"NIC reserve above 50":             {mutate: func(a *config.TopologyDRAArgs) { a.NICReservePercent = 51 }, wantErr: "nicReservePercent"},
		"negative NIC reserve":             {mutate: func(a *config.TopologyDRAArgs) { a.NICReservePercent = -1 }, wantErr: "nicReservePercent"},
		"no NIC reserve is valid":          {mutate: func(a *config.TopologyDRAArgs) { a.NICReservePercent = 0 }},
		"whole node of 4 devices":          {mutate: func(a *config.TopologyDRAArgs) { a.WholeNodeDevices = 4 }},
		"whole node of 1 device":           {mutate: func(a *config.TopologyDRAArgs) { a.WholeNodeDevices = 1 }, wantErr: "wholeNodeDevices"},
		"whole node above 1024":            {mutate: func(a *config.TopologyDRAArgs) { a.WholeNodeDevices = 1025 }, wantErr: "wholeNodeDevices"},
		"no filter timeout":                {mutate: func(a *config.TopologyDRAArgs) { a.FilterTimeout = 0 }},
		"invalid owned taint key":          {mutate: func(a *config.TopologyDRAArgs) { a.OwnedTaintKey = "not a valid key!" }, wantErr: "ownedTaintKey"},
		"owned taint key with two slashes": {mutate: func(a *config.TopologyDRAArgs) { a.OwnedTaintKey = "a.io/b/c" }, wantErr: "ownedTaintKey"},
		"owned taint key with bad prefix":  {mutate: func(a *config.TopologyDRAArgs) { a.OwnedTaintKey = "Not_A_Domain/key" }, wantErr: "ownedTaintKey"},
		"unprefixed owned taint key":       {mutate: func(a *config.TopologyDRAArgs) { a.OwnedTaintKey = "topodra-only" }},
		"no owned taint key":               {mutate: func(a *config.TopologyDRAArgs) { a.OwnedTaintKey = "" }},
		"negative filter timeout":          {mutate: func(a *config.TopologyDRAArgs) { a.FilterTimeout = -time.Second }, wantErr: "filterTimeout"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) { checkValidation(t, tc.mutate, defaultFeatures(), tc.wantErr) })
	}
}

// checkValidation validates the default args changed by mutate under fts:
// no error where wantErr is empty, else one that contains it.
func checkValidation(t *testing.T, mutate func(*config.TopologyDRAArgs), fts feature.Features, wantErr string) {
	t.Helper()
	args := DefaultArgs()
	mutate(args)
	errs := config.ValidateTopologyDRAArgs(field.NewPath("args"), args, fts)
	if wantErr == "" {
		if len(errs) > 0 {
			t.Errorf("unexpected errors: %v", errs)
		}
		return
	}
	if len(errs) == 0 || !strings.Contains(errs.ToAggregate().Error(), wantErr) {
		t.Errorf("errors %v, want one containing %q", errs, wantErr)
	}
}

// defaultFeatures are the scheduler features of the current feature gates.
func defaultFeatures() feature.Features {
	return feature.NewSchedulerFeaturesFromGates(utilfeature.DefaultFeatureGate)
}

// TestValidateArgsFeatureGates: as for the stock plugin's args, a timeout
// given while its feature is off is refused; unset (0) is valid then.
func TestValidateArgsFeatureGates(t *testing.T) {
	on := defaultFeatures()
	if !on.EnableDRASchedulerFilterTimeout || !on.EnableDRADeviceBindingConditions || !on.EnableDRAResourceClaimDeviceStatus {
		t.Fatal("the timeouts' feature gates are on by default in Kubernetes 1.37")
	}
	noFilterTimeout, noBinding := on, on
	noFilterTimeout.EnableDRASchedulerFilterTimeout = false
	noBinding.EnableDRADeviceBindingConditions = false
	noDeviceStatus := on
	noDeviceStatus.EnableDRAResourceClaimDeviceStatus = false
	tests := map[string]struct {
		fts     feature.Features
		mutate  func(*config.TopologyDRAArgs)
		wantErr string
	}{
		"filter timeout without its gate":          {fts: noFilterTimeout, mutate: func(a *config.TopologyDRAArgs) {}, wantErr: "filterTimeout: Forbidden: DRASchedulerFilterTimeout feature gate is disabled"},
		"no filter timeout without its gate":       {fts: noFilterTimeout, mutate: func(a *config.TopologyDRAArgs) { a.FilterTimeout = 0 }},
		"binding timeout without its gate":         {fts: noBinding, mutate: func(a *config.TopologyDRAArgs) {}, wantErr: "bindingTimeoutSeconds: Forbidden: DRADeviceBindingConditions or DRAResourceClaimDeviceStatus"},
		"binding timeout without device status":    {fts: noDeviceStatus, mutate: func(a *config.TopologyDRAArgs) {}, wantErr: "bindingTimeoutSeconds: Forbidden"},
		"no binding timeout without its gate":      {fts: noBinding, mutate: func(a *config.TopologyDRAArgs) { a.BindingTimeoutSeconds = 0 }},
		"huge binding timeout without its gate":    {fts: noBinding, mutate: func(a *config.TopologyDRAArgs) { a.BindingTimeoutSeconds = 1 << 40 }, wantErr: "bindingTimeoutSeconds: Forbidden"},
		"no binding timeout with its gates":        {fts: on, mutate: func(a *config.TopologyDRAArgs) { a.BindingTimeoutSeconds = 0 }, wantErr: "positive"},
		"negative filter timeout without its gate": {fts: noFilterTimeout, mutate: func(a *config.TopologyDRAArgs) { a.FilterTimeout = -time.Second }, wantErr: "filterTimeout: Forbidden"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) { checkValidation(t, tc.mutate, tc.fts, tc.wantErr) })
	}
}

// TestDefaultsFollowFeatureGates: the timeouts of features that are off
// are not defaulted (the defaults stay valid), and a config file that sets
// them is refused then, as the stock plugin's filterTimeout and
// bindingTimeout are.
func TestDefaultsFollowFeatureGates(t *testing.T) {
	featuregatetesting.SetFeatureGatesDuringTest(t, utilfeature.DefaultFeatureGate, featuregatetesting.FeatureOverrides{
		features.DRASchedulerFilterTimeout:  false,
		features.DRADeviceBindingConditions: false,
	})
	args := DefaultArgs()
	if args.FilterTimeout != 0 || args.BindingTimeoutSeconds != 0 {
		t.Errorf("defaults with the gates off: filterTimeout %s, bindingTimeoutSeconds %d, want both unset", args.FilterTimeout, args.BindingTimeoutSeconds)
	}
	if errs := config.ValidateTopologyDRAArgs(field.NewPath("args"), args, defaultFeatures()); len(errs) > 0 {
		t.Errorf("defaults with the gates off are invalid: %v", errs)
	}
	loaded, _ := loadProfileArgs(t, filepath.Join("..", "..", "..", "config", "scheduler-config.yaml"), "topodra-scheduler")
	errs := config.ValidateTopologyDRAArgs(field.NewPath("args"), loaded, defaultFeatures()).ToAggregate()
	if errs == nil || !strings.Contains(errs.Error(), "filterTimeout: Forbidden") || !strings.Contains(errs.Error(), "bindingTimeoutSeconds: Forbidden") {
		t.Errorf("config/scheduler-config.yaml with the gates off: %v, want filterTimeout and bindingTimeoutSeconds forbidden", errs)
	}
}

// stubHandle is the least of a framework handle that New needs.
type stubHandle struct {
	fwk.Handle
	factory informers.SharedInformerFactory
}

type stubDRAManager struct{ fwk.SharedDRAManager }

func (h stubHandle) SharedDRAManager() fwk.SharedDRAManager                 { return stubDRAManager{} }
func (h stubHandle) ClientSet() kubernetes.Interface                        { return nil }
func (h stubHandle) SharedInformerFactory() informers.SharedInformerFactory { return h.factory }
func (h stubHandle) ProfileName() string                                    { return "stub" }

// newWithLog builds the plugin from args and returns what New logged.
func newWithLog(t *testing.T, args *config.TopologyDRAArgs) string {
	t.Helper()
	var buf ktesting.BufferTL
	ctx, cancel := context.WithCancel(klog.NewContext(context.Background(), ktesting.NewLogger(&buf, ktesting.NewConfig())))
	defer cancel()
	h := stubHandle{factory: informers.NewSharedInformerFactory(fake.NewClientset(), 0)}
	if _, err := New(ctx, args, h); err != nil {
		t.Fatalf("New: %v", err)
	}
	return buf.String()
}

func TestNewWarnsAboutArgsWithoutEffect(t *testing.T) {
	tests := map[string]struct {
		mutate   func(*config.TopologyDRAArgs)
		wantWarn string
	}{
		"defaults":                      {mutate: func(*config.TopologyDRAArgs) {}},
		"nicRootTrade without pcieRoot": {mutate: func(a *config.TopologyDRAArgs) { a.TopologyAttributes = []string{"gpu.topodra.io/nvlinkClique"} }, wantWarn: "nicRootTrade has no effect"},
		"no nicRootTrade, no pcieRoot": {mutate: func(a *config.TopologyDRAArgs) {
			a.TopologyAttributes, a.NICRootTrade, a.NICReservePercent = nil, 0, 0
		}},
		"nicReservePercent without pcieRoot": {mutate: func(a *config.TopologyDRAArgs) {
			a.TopologyAttributes, a.NICRootTrade = []string{"gpu.topodra.io/nvlinkClique"}, 0
		}, wantWarn: "nicReservePercent has no effect"},
		"nicRootTrade without any attrs": {mutate: func(a *config.TopologyDRAArgs) { a.TopologyAttributes = nil }, wantWarn: "resource.kubernetes.io/pcieRoot"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			args := DefaultArgs()
			tc.mutate(args)
			got := newWithLog(t, args)
			if tc.wantWarn == "" {
				if strings.Contains(got, "Warning") {
					t.Errorf("New logged %q, want no warning", got)
				}
				return
			}
			if !strings.Contains(got, tc.wantWarn) {
				t.Errorf("New logged %q, want a warning containing %q", got, tc.wantWarn)
			}
		})
	}
}

// TestNewWarnsWithoutDeviceTaints: with the DRADeviceTaints gate off, the
// allocator ignores device taints, the health taint included: New says so.
func TestNewWarnsWithoutDeviceTaints(t *testing.T) {
	featuregatetesting.SetFeatureGateDuringTest(t, utilfeature.DefaultFeatureGate, features.DRADeviceTaints, false)
	if got := newWithLog(t, DefaultArgs()); !strings.Contains(got, "Warning: the DRADeviceTaints feature gate is off") {
		t.Errorf("New logged %q, want a warning that device taints are ignored", got)
	}
}

// TestWholeNodeDevicesReachesThePolicy: wholeNodeDevices becomes the
// allocator policy's whole node and the pending-pod index's, 8 by
// default.
func TestWholeNodeDevicesReachesThePolicy(t *testing.T) {
	args := DefaultArgs()
	if p := policyFromArgs(*args); p.WholeNode != 8 {
		t.Errorf("default: policy whole node %d, want 8", p.WholeNode)
	}
	args.WholeNodeDevices = 4
	if p := policyFromArgs(*args); p.WholeNode != 4 {
		t.Errorf("wholeNodeDevices 4: policy whole node %d, want 4", p.WholeNode)
	}
	h := newHarness(t, nil)
	if h.pl.wholeNode() != 8 || h.pl.pending.wholeNode != 8 || h.pl.halfNode() != 4 {
		t.Errorf("plugin defaults: whole node %d, pending index %d, half %d; want 8, 8, 4", h.pl.wholeNode(), h.pl.pending.wholeNode, h.pl.halfNode())
	}
}
