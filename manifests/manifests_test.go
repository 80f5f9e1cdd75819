package manifests

import (
	"bufio"
	"bytes"
	"context"
	"io/fs"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
	dracel "k8s.io/dynamic-resource-allocation/cel"
	"sigs.k8s.io/yaml"

	"github.com/topodra/topodra/config"
	"github.com/topodra/topodra/pkg/topology"
)

// sets are what an admin applies: the base and every overlay, rendered by
// kustomize, and the examples one file each. Keys name the set.
func sets(t *testing.T) map[string][]runtime.Object {
	t.Helper()
	out := map[string][]runtime.Object{}
	for _, dir := range append([]string{"base"}, overlayDirs()...) {
		data, err := Render(dir)
		if err != nil {
			t.Fatalf("render %s: %v", dir, err)
		}
		out[dir] = decodeAll(t, dir, data)
	}
	examples, err := fs.Glob(FS, "examples/*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, path := range examples {
		data, err := FS.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		out[path] = decodeAll(t, path, data)
	}
	return out
}

func overlayDirs() []string {
	var dirs []string
	for _, o := range Overlays {
		dirs = append(dirs, "overlays/"+o)
	}
	return dirs
}

// decodeAll decodes every document strictly (unknown or duplicate fields
// fail).
func decodeAll(t *testing.T, name string, data []byte) []runtime.Object {
	t.Helper()
	decoder := serializer.NewCodecFactory(scheme.Scheme, serializer.EnableStrict).UniversalDeserializer()
	var out []runtime.Object
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		doc, err := reader.Read()
		if err != nil {
			break
		}
		if len(bytes.TrimSpace(stripComments(doc))) == 0 {
			continue
		}
		obj, _, err := decoder.Decode(doc, nil, nil)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		out = append(out, obj)
	}
	return out
}

func stripComments(doc []byte) []byte {
	var out []byte
	for _, line := range bytes.Split(doc, []byte("\n")) {
		if !bytes.HasPrefix(bytes.TrimSpace(line), []byte("#")) {
			out = append(out, line...)
			out = append(out, '\n')
		}
	}
	return out
}

// TestOwnedTaintKeyAgrees checks, for the base, every overlay and every
// example, that whatever names the owned taint names the same key as the
// scheduler's args, and that every install variant ships the ownership
// ConfigMap, the DeviceTaintRule for gpu.topodra.io, the admission policy
// and an agent that taints its devices.
func TestOwnedTaintKeyAgrees(t *testing.T) {
	want := topology.DefaultTaintKey
	for path, objs := range sets(t) {
		t.Run(path, func(t *testing.T) {
			checkOwnership(t, path, objs, want, !strings.HasPrefix(path, "examples/"))
		})
	}
	for name, data := range map[string][]byte{"config/scheduler-config.yaml": config.SchedulerConfig, "config/multi-profile.yaml": config.MultiProfileConfig} {
		if got := schedulerOwnedKey(t, data); got != want {
			t.Errorf("%s: ownedTaintKey %q, want %q", name, got, want)
		}
	}
}

func checkOwnership(t *testing.T, path string, objs []runtime.Object, want string, install bool) {
	var sawConfigMap, sawAgent, sawRule, sawPolicy bool
	{
		for _, obj := range objs {
			switch o := obj.(type) {
			case *v1.ConfigMap:
				if o.Name == "topodra-ownership" {
					sawConfigMap = true
					if got := o.Data["ownedTaintKey"]; got != want {
						t.Errorf("%s: ConfigMap topodra-ownership ownedTaintKey %q, want %q", path, got, want)
					}
				}
				if cfg, ok := o.Data["scheduler-config.yaml"]; ok {
					if got := schedulerOwnedKey(t, []byte(cfg)); got != want {
						t.Errorf("%s: scheduler config ownedTaintKey %q, want %q", path, got, want)
					}
				}
			case *resourceapi.DeviceTaintRule:
				sawRule = sawRule || (o.Spec.DeviceSelector != nil && o.Spec.DeviceSelector.Driver != nil && *o.Spec.DeviceSelector.Driver == topology.DriverName)
				if o.Spec.Taint.Key != want || o.Spec.Taint.Effect != resourceapi.DeviceTaintEffectNoSchedule {
					t.Errorf("%s: DeviceTaintRule %s taints %s:%s, want %s:NoSchedule", path, o.Name, o.Spec.Taint.Key, o.Spec.Taint.Effect, want)
				}
				if o.Spec.DeviceSelector == nil || o.Spec.DeviceSelector.Driver == nil {
					t.Errorf("%s: DeviceTaintRule %s selects no driver", path, o.Name)
				}
			case *appsv1.DaemonSet:
				if o.Name != "topodra-node-agent" {
					continue
				}
				sawAgent = true
				env := map[string]v1.EnvVar{}
				for _, e := range o.Spec.Template.Spec.Containers[0].Env {
					env[e.Name] = e
				}
				if e, ok := env["OWNED_TAINT"]; ok && e.Value != "true" {
					t.Errorf("%s: the agent ships with OWNED_TAINT=%q; it must taint its devices", path, e.Value)
				}
				ref := env["OWNED_TAINT_KEY"].ValueFrom
				if ref == nil || ref.ConfigMapKeyRef == nil || ref.ConfigMapKeyRef.Name != "topodra-ownership" || ref.ConfigMapKeyRef.Key != "ownedTaintKey" {
					t.Errorf("%s: OWNED_TAINT_KEY must come from ConfigMap topodra-ownership, key ownedTaintKey", path)
				}
			case *admissionv1.ValidatingAdmissionPolicy:
				if o.Name != "topodra-owned-taint" {
					continue
				}
				sawPolicy = true
				if o.Spec.ParamKind != nil {
					t.Errorf("%s: policy %s takes a parameter: without it the API server would refuse every claim it matches", path, o.Name)
				}
				if got := policyOwnedKey(o); got != want {
					t.Errorf("%s: policy %s refuses tolerations of %q, want %q", path, o.Name, got, want)
				}
				for _, v := range o.Spec.Validations {
					if strings.Contains(v.Expression, want) {
						t.Errorf("%s: policy %s hard-codes %s in a validation instead of reading variables.ownedKey", path, o.Name, want)
					}
				}
			case *admissionv1.ValidatingAdmissionPolicyBinding:
				if o.Spec.PolicyName == "topodra-owned-taint" && o.Spec.ParamRef != nil {
					t.Errorf("%s: binding %s names a parameter: without it the API server would refuse every claim the policy matches", path, o.Name)
				}
			}
		}
	}
	if !install {
		return
	}
	for what, saw := range map[string]bool{"ConfigMap topodra-ownership": sawConfigMap, "agent DaemonSet": sawAgent, "DeviceTaintRule for driver " + topology.DriverName: sawRule, "admission policy topodra-owned-taint": sawPolicy} {
		if !saw {
			t.Errorf("%s: no %s", path, what)
		}
	}
}

// policyOwnedKey returns the key that the claim policy's ownedKey variable
// holds: its expression is the key as a CEL string literal in single
// quotes (kustomize's replacement writes between them); "" where the
// variable is missing or not such a literal.
func policyOwnedKey(p *admissionv1.ValidatingAdmissionPolicy) string {
	for _, v := range p.Spec.Variables {
		if v.Name != "ownedKey" {
			continue
		}
		e := strings.TrimSpace(v.Expression)
		if len(e) >= 2 && e[0] == '\'' && e[len(e)-1] == '\'' && !strings.ContainsAny(e[1:len(e)-1], "'\\") {
			return e[1 : len(e)-1]
		}
	}
	return ""
}

// TestOwnedKeyCopiedFromConfigMap changes the key in ConfigMap
// topodra-ownership alone and checks that the rendered claim policy and
// the GPUs' DeviceTaintRule follow it, in the base and in every overlay.
func TestOwnedKeyCopiedFromConfigMap(t *testing.T) {
	const other = "example.com/other-owner"
	edit := func(p string, data []byte) []byte {
		if p != "base/ownership.yaml" {
			return data
		}
		line := "ownedTaintKey: " + topology.DefaultTaintKey
		if !bytes.Contains(data, []byte(line)) {
			t.Fatalf("%s has no line %q", p, line)
		}
		return bytes.Replace(data, []byte(line), []byte("ownedTaintKey: "+other), 1)
	}
	for _, dir := range append([]string{"base"}, overlayDirs()...) {
		data, err := renderEdited(dir, edit)
		if err != nil {
			t.Fatal(err)
		}
		var sawPolicy, sawRule bool
		for _, obj := range decodeAll(t, dir, data) {
			switch o := obj.(type) {
			case *admissionv1.ValidatingAdmissionPolicy:
				if o.Name == "topodra-owned-taint" {
					sawPolicy = true
					if got := policyOwnedKey(o); got != other {
						t.Errorf("%s: policy refuses tolerations of %q, want %q from the ConfigMap", dir, got, other)
					}
				}
			case *resourceapi.DeviceTaintRule:
				if o.Name == "topodra-owns-gpu.topodra.io" {
					sawRule = true
					if o.Spec.Taint.Key != other {
						t.Errorf("%s: DeviceTaintRule taints %q, want %q from the ConfigMap", dir, o.Spec.Taint.Key, other)
					}
				}
			}
		}
		if !sawPolicy || !sawRule {
			t.Errorf("%s: rendered policy %v, rule %v; want both", dir, sawPolicy, sawRule)
		}
	}
}

// schedulerOwnedKey returns the ownedTaintKey of the TopologyDRA args of
// every profile of a KubeSchedulerConfiguration (the default where unset);
// it fails the test if profiles disagree.
func schedulerOwnedKey(t *testing.T, data []byte) string {
	t.Helper()
	var cfg struct {
		Profiles []struct {
			PluginConfig []struct {
				Name string `json:"name"`
				Args struct {
					OwnedTaintKey *string `json:"ownedTaintKey"`
				} `json:"args"`
			} `json:"pluginConfig"`
		} `json:"profiles"`
	}
	if err := yaml.Unmarshal(data, &cfg); err != nil {
		t.Fatalf("parse scheduler config: %v", err)
	}
	key := ""
	for _, p := range cfg.Profiles {
		for _, pc := range p.PluginConfig {
			if pc.Name != "TopologyDRA" {
				continue
			}
			k := topology.DefaultTaintKey
			if pc.Args.OwnedTaintKey != nil {
				k = *pc.Args.OwnedTaintKey
			}
			if key != "" && k != key {
				t.Errorf("profiles disagree on ownedTaintKey: %q and %q", key, k)
			}
			key = k
		}
	}
	if key == "" {
		return topology.DefaultTaintKey
	}
	return key
}

// TestSchedulerSurvivesADrain: in every install, the scheduler's
// replicas prefer distinct nodes and a PodDisruptionBudget that selects
// them lets a drain evict only one at a time.
func TestSchedulerSurvivesADrain(t *testing.T) {
	for name, objs := range sets(t) {
		if strings.HasPrefix(name, "examples/") {
			continue
		}
		var deploy *appsv1.Deployment
		var pdb *policyv1.PodDisruptionBudget
		for _, obj := range objs {
			switch o := obj.(type) {
			case *appsv1.Deployment:
				if o.Name == "topodra-scheduler" {
					deploy = o
				}
			case *policyv1.PodDisruptionBudget:
				pdb = o
			}
		}
		if deploy == nil {
			t.Errorf("%s: no topodra-scheduler Deployment", name)
			continue
		}
		labels := deploy.Spec.Template.Labels
		if pdb == nil || pdb.Namespace != deploy.Namespace || pdb.Spec.Selector == nil || pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.IntValue() != 1 {
			t.Errorf("%s: want a PodDisruptionBudget with maxUnavailable 1 beside the scheduler, got %+v", name, pdb)
			continue
		}
		for k, v := range pdb.Spec.Selector.MatchLabels {
			if labels[k] != v {
				t.Errorf("%s: the PodDisruptionBudget selects %s=%s, which the scheduler's pods do not carry", name, k, v)
			}
		}
		anti := deploy.Spec.Template.Spec.Affinity
		if anti == nil || anti.PodAntiAffinity == nil || len(anti.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution) == 0 ||
			anti.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution[0].PodAffinityTerm.TopologyKey != v1.LabelHostname {
			t.Errorf("%s: the scheduler's replicas do not prefer distinct nodes", name)
		}
	}
}

// TestDeviceClassSelectorsNeverFail evaluates the selectors of every
// shipped DeviceClass against a GPU with all the attributes the agent can
// publish, one with none of those it may leave out, and another driver's
// device: none may fail with a runtime error (the upstream allocator turns
// that into a failed attempt for every pod of the class), and the H100
// class takes only the H100.
func TestDeviceClassSelectorsNeverFail(t *testing.T) {
	str := func(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: &s} }
	devices := map[string]dracel.Device{
		"H100": {Driver: topology.DriverName, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			"productName": str("NVIDIA H100 80GB HBM3"), "uuid": str("GPU-1"),
		}},
		"GPU without a product name": {Driver: topology.DriverName, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"uuid": str("GPU-2")}},
		"A100":                       {Driver: topology.DriverName, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"productName": str("NVIDIA A100-SXM4-80GB")}},
		"another driver's device":    {Driver: "nic.example.com"},
	}
	compiler := dracel.GetCompiler(dracel.Features{EnableConsumableCapacity: true, EnableListTypeAttributes: true})
	classes := 0
	for _, obj := range sets(t)["base"] {
		class, ok := obj.(*resourceapi.DeviceClass)
		if !ok {
			continue
		}
		classes++
		for _, sel := range class.Spec.Selectors {
			if sel.CEL == nil {
				continue
			}
			compiled := compiler.CompileCELExpression(sel.CEL.Expression, dracel.Options{})
			if compiled.Error != nil {
				t.Fatalf("class %s: %v", class.Name, compiled.Error)
			}
			for name, device := range devices {
				matches, _, err := compiled.DeviceMatches(context.Background(), device)
				if err != nil {
					t.Errorf("class %s on %s: %v", class.Name, name, err)
				}
				if want := name == "H100"; class.Name == "h100.gpu.topodra.io" && matches != want {
					t.Errorf("class %s on %s: matches %v, want %v", class.Name, name, matches, want)
				}
			}
		}
	}
	if classes == 0 {
		t.Fatal("no DeviceClass in the base manifests")
	}
}

// TestSchedulerConfigRollsOut checks that every install variant mounts the
// scheduler's configuration from a ConfigMap whose name kustomize derives
// from its content: a changed configuration then changes the Deployment's
// pod template, and `kubectl apply -k` rolls the scheduler out.
func TestSchedulerConfigRollsOut(t *testing.T) {
	for _, dir := range append([]string{"base"}, overlayDirs()...) {
		data, err := Render(dir)
		if err != nil {
			t.Fatalf("render %s: %v", dir, err)
		}
		var configMaps []string
		var mounted string
		for _, obj := range decodeAll(t, dir, data) {
			switch o := obj.(type) {
			case *v1.ConfigMap:
				if _, ok := o.Data["scheduler-config.yaml"]; ok {
					configMaps = append(configMaps, o.Name)
				}
			case *appsv1.Deployment:
				if o.Name != "topodra-scheduler" {
					continue
				}
				for _, vol := range o.Spec.Template.Spec.Volumes {
					if vol.ConfigMap != nil {
						mounted = vol.ConfigMap.Name
					}
				}
			}
		}
		if len(configMaps) != 1 {
			t.Errorf("%s: ConfigMaps with a scheduler configuration %v, want one", dir, configMaps)
			continue
		}
		name := configMaps[0]
		if suffix, ok := strings.CutPrefix(name, "topodra-scheduler-config-"); !ok || suffix == "" {
			t.Errorf("%s: scheduler configuration in ConfigMap %q, want a name generated from its content (topodra-scheduler-config-<hash>)", dir, name)
		}
		if mounted != name {
			t.Errorf("%s: the scheduler mounts ConfigMap %q, want %q", dir, mounted, name)
		}
	}
}
