package agent_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/component-base/metrics"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
)

// agentMetrics gathers the agent's metrics through a registry of their
// own, as "name{label="value"}" → value.
func agentMetrics(t *testing.T, registry metrics.KubeRegistry) map[string]float64 {
	t.Helper()
	families, err := registry.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	out := map[string]float64{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			key := f.GetName()
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			if len(labels) > 0 {
				key += "{" + strings.Join(labels, ",") + "}"
			}
			switch {
			case m.GetGauge() != nil:
				out[key] = m.GetGauge().GetValue()
			case m.GetCounter() != nil:
				out[key] = m.GetCounter().GetValue()
			}
		}
	}
	return out
}

// expectMetrics fails unless the metrics have the wanted values, polling
// for up to 30 s (health faults arrive in the background).
func expectMetrics(ctx context.Context, t *testing.T, registry metrics.KubeRegistry, want map[string]float64) {
	t.Helper()
	var got map[string]float64
	err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		got = agentMetrics(t, registry)
		for k, v := range want {
			if g, ok := got[k]; !ok || g != v {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		var diff []string
		for _, k := range slices.Sorted(maps.Keys(want)) {
			if g, ok := got[k]; !ok || g != want[k] {
				diff = append(diff, fmt.Sprintf("%s = %v (reported: %v), want %v", k, g, ok, want[k]))
			}
		}
		t.Fatalf("metrics: %s", strings.Join(diff, "; "))
	}
}

// TestMetrics: the agent's collector reports the GPUs by state, the
// prepared claims, by reason, the claims that Prepare refused, and that
// the API has the slices; a GPU fault moves a GPU to unhealthy.
func TestMetrics(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	a, _, e := startRecorded(ctx, t, 100)
	registry := metrics.NewKubeRegistry()
	registry.CustomMustRegister(a.MetricsCollector())
	waitForHealthReport(ctx, t, a, "GPUs watched", func(h map[string]kubeletplugin.DeviceHealth) bool {
		return h["gpu-4"].Health == kubeletplugin.HealthStatusHealthy && h["gpu-5"].Health == kubeletplugin.HealthStatusHealthy
	})
	expectMetrics(ctx, t, registry, map[string]float64{
		agent.MetricNVMLUsable:                                       1,
		agent.MetricGPUs + `{state="published"}`:                     8,
		agent.MetricGPUs + `{state="unhealthy"}`:                     0,
		agent.MetricGPUs + `{state="unwatched"}`:                     0,
		agent.MetricGPUs + `{state="not_published"}`:                 0,
		agent.MetricPreparedClaims:                                   0,
		agent.MetricStalePreparedClaims:                              0,
		agent.MetricPrepareErrors + `{reason="device_in_use"}`:       0,
		agent.MetricPrepareErrors + `{reason="unhealthy_device"}`:    0,
		agent.MetricPrepareErrors + `{reason="other"}`:               0,
		agent.MetricPrepareErrors + `{reason="device_node_missing"}`: 0,
		agent.MetricSlicesSynced:                                     1,
		agent.MetricPublishErrors + `{reason="other"}`:               0,
	})

	first := claim("first", gpus("gpus", "gpu-4")...)
	if err := prepareOne(ctx, t, a, first); err != nil {
		t.Fatalf("prepare: %v", err)
	}
	second := claim("second", gpus("gpus", "gpu-4")...)
	if err := prepareOne(ctx, t, a, second); !errors.Is(err, agent.ErrDeviceInUse) {
		t.Fatalf("prepare of a second claim on gpu-4: %v, want ErrDeviceInUse", err)
	}
	expectMetrics(ctx, t, registry, map[string]float64{
		agent.MetricPreparedClaims:                             1,
		agent.MetricPrepareErrors + `{reason="device_in_use"}`: 1,
		agent.MetricPrepareErrors + `{reason="other"}`:         0,
	})

	injectXIDOnceWatched(ctx, t, e, 5, 79)
	expectMetrics(ctx, t, registry, map[string]float64{
		agent.MetricGPUs + `{state="published"}`: 8,
		agent.MetricGPUs + `{state="unhealthy"}`: 1,
		agent.MetricSlicesSynced:                 1,
	})
	late := claim("late", gpus("gpus", "gpu-5")...)
	if err := prepareOne(ctx, t, a, late); !errors.Is(err, agent.ErrDeviceUnhealthy) {
		t.Fatalf("prepare of a claim on the faulty gpu-5: %v, want ErrDeviceUnhealthy", err)
	}
	unprepareOne(ctx, t, a, first)
	expectMetrics(ctx, t, registry, map[string]float64{
		agent.MetricPreparedClaims:                                0,
		agent.MetricPrepareErrors + `{reason="device_in_use"}`:    1,
		agent.MetricPrepareErrors + `{reason="unhealthy_device"}`: 1,
	})
}

// TestMetricsGPUConditions: a GPU whose fabric is not ready, that needs a
// reset, or whose compute mode is Prohibited counts in its state, one
// whose row remapping failed as unhealthy (and not as unwatched), until a
// rescan finds the condition gone.
func TestMetricsGPUConditions(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	e.machine.SetFabric(1, nvml.GPU_FABRIC_STATE_IN_PROGRESS, nvml.SUCCESS)
	e.machine.SetRowRemap(2, true, false)
	e.machine.FailRowRemap(3, nvml.ERROR_NOT_SUPPORTED)
	e.machine.SetRetiredPagesPending(3, true)
	e.machine.SetRowRemap(4, false, true)
	e.machine.SetComputeMode(6, nvml.COMPUTEMODE_PROHIBITED)
	a := e.start(ctx, t)
	registry := metrics.NewKubeRegistry()
	registry.CustomMustRegister(a.MetricsCollector())
	expectMetrics(ctx, t, registry, map[string]float64{
		agent.MetricGPUs + `{state="published"}`:          8,
		agent.MetricGPUs + `{state="unhealthy"}`:          1,
		agent.MetricGPUs + `{state="unwatched"}`:          0,
		agent.MetricGPUs + `{state="fabric_not_ready"}`:   1,
		agent.MetricGPUs + `{state="reset_required"}`:     2,
		agent.MetricGPUs + `{state="compute_prohibited"}`: 1,
	})
	e.machine.SetFabric(1, nvml.GPU_FABRIC_STATE_COMPLETED, nvml.SUCCESS)
	e.machine.SetRowRemap(2, false, false)
	e.machine.SetRetiredPagesPending(3, false)
	e.machine.SetRowRemap(4, false, false)
	e.machine.SetComputeMode(6, nvml.COMPUTEMODE_DEFAULT)
	if err := a.Rescan(ctx); err != nil {
		t.Fatal(err)
	}
	expectMetrics(ctx, t, registry, map[string]float64{
		agent.MetricGPUs + `{state="published"}`:          8,
		agent.MetricGPUs + `{state="unhealthy"}`:          0,
		agent.MetricGPUs + `{state="fabric_not_ready"}`:   0,
		agent.MetricGPUs + `{state="reset_required"}`:     0,
		agent.MetricGPUs + `{state="compute_prohibited"}`: 0,
	})
}

// TestMetricStatesDocumented: the states that the metrics section of
// docs/install.md lists for MetricGPUs are exactly those the agent
// reports, in its order, and the metric's help explains each.
func TestMetricStatesDocumented(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	a := newEnv(t).start(ctx, t)
	registry := metrics.NewKubeRegistry()
	registry.CustomMustRegister(a.MetricsCollector())
	families, err := registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var reported []string
	for _, f := range families {
		if f.GetName() != agent.MetricGPUs {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "state" {
					reported = append(reported, l.GetValue())
				}
			}
		}
		for _, state := range agent.GPUStates() {
			if !strings.Contains(f.GetHelp(), " "+state+" (") {
				t.Errorf("the help of %s does not explain the state %s (\"%s (...)\"): %q", agent.MetricGPUs, state, state, f.GetHelp())
			}
		}
	}
	if want := agent.GPUStates(); !slices.Equal(slices.Sorted(slices.Values(reported)), slices.Sorted(slices.Values(want))) {
		t.Errorf("%s reports the states %v, GPUStates says %v", agent.MetricGPUs, reported, want)
	}
	doc, err := os.ReadFile("../../docs/install.md")
	if err != nil {
		t.Fatal(err)
	}
	// The document lists "`topodra_agent_gpus{state}` (`a`, `b`: ...".
	_, text, ok := strings.Cut(string(doc), "`"+agent.MetricGPUs+"{state}` (")
	text, _, _ = strings.Cut(text, ":")
	if !ok {
		t.Fatalf("docs/install.md does not name %s{state}", agent.MetricGPUs)
	}
	var documented []string
	for _, m := range backticked.FindAllStringSubmatch(text, -1) {
		documented = append(documented, m[1])
	}
	if want := agent.GPUStates(); !slices.Equal(documented, want) {
		t.Errorf("docs/install.md lists the states of %s as %v, the agent reports %v", agent.MetricGPUs, documented, want)
	}
}

// TestMetricsPerAgent: two agents in one process (a simulator) each
// report their own values through their own collectors.
func TestMetricsPerAgent(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	a := newEnv(t).start(ctx, t)
	b := newEnv(t).start(ctx, t)
	ra, rb := metrics.NewKubeRegistry(), metrics.NewKubeRegistry()
	ra.CustomMustRegister(a.MetricsCollector())
	rb.CustomMustRegister(b.MetricsCollector())
	if err := prepareOne(ctx, t, a, claim("only-on-a", gpus("gpus", "gpu-0")...)); err != nil {
		t.Fatal(err)
	}
	expectMetrics(ctx, t, ra, map[string]float64{agent.MetricPreparedClaims: 1})
	expectMetrics(ctx, t, rb, map[string]float64{agent.MetricPreparedClaims: 0})
}

// backticked matches the words that Markdown sets as code.
var backticked = regexp.MustCompile("`([^`]+)`")

// TestMetricReasonsDocumented: the reasons that the help text of a
// metric with a "reason" label and the metrics section of
// docs/install.md list are exactly those that the agent reports, in its
// order, and so are the rows of the runbook's table of Prepare errors
// (docs/operations.md).
func TestMetricReasonsDocumented(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	a := newEnv(t).start(ctx, t)
	registry := metrics.NewKubeRegistry()
	registry.CustomMustRegister(a.MetricsCollector())
	families, err := registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	help := map[string]string{}
	for _, f := range families {
		help[f.GetName()] = f.GetHelp()
	}
	doc, err := os.ReadFile("../../docs/install.md")
	if err != nil {
		t.Fatal(err)
	}
	// The document names the metric, then lists "reasons `a`, `b`;".
	documented := func(metric string) []string {
		text := string(doc)
		i := strings.Index(text, "`"+metric+"{reason}`")
		if i < 0 {
			t.Fatalf("docs/install.md does not name %s{reason}", metric)
		}
		text = text[i:]
		j := strings.Index(text, "reasons ")
		k := strings.Index(text[max(j, 0):], ";")
		if j < 0 || k < 0 {
			t.Fatalf("docs/install.md lists no reasons after %s{reason} (\"reasons `a`, `b`;\")", metric)
		}
		var out []string
		for _, m := range backticked.FindAllStringSubmatch(text[j:j+k], -1) {
			out = append(out, m[1])
		}
		return out
	}
	// The help text lists "by reason: a, b. ..." (after the ALPHA prefix).
	inHelp := func(metric string) []string {
		h := help[metric]
		_, list, ok := strings.Cut(h, "by reason: ")
		list, _, _ = strings.Cut(list, ". ")
		if !ok || list == "" {
			t.Fatalf("help of %s lists no reasons (\"by reason: a, b. \"): %q", metric, h)
		}
		return strings.Split(list, ", ")
	}
	for metric, reasons := range map[string][]string{
		agent.MetricPrepareErrors: agent.PrepareErrorReasons(),
		agent.MetricPublishErrors: agent.PublishErrorReasons(),
	} {
		if got := documented(metric); !slices.Equal(got, reasons) {
			t.Errorf("docs/install.md lists the reasons of %s as %v, the agent reports %v", metric, got, reasons)
		}
		if got := inHelp(metric); !slices.Equal(got, reasons) {
			t.Errorf("the help of %s lists the reasons %v, the agent reports %v", metric, got, reasons)
		}
	}

	runbook, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(runbook), "\n### TopodraPrepareErrors\n")
	if !ok {
		t.Fatal("docs/operations.md has no section TopodraPrepareErrors")
	}
	section, _, _ = strings.Cut(section, "\n### ")
	var rows []string
	for _, line := range strings.Split(section, "\n") {
		if m := tableRowReason.FindStringSubmatch(line); m != nil {
			rows = append(rows, m[1])
		}
	}
	if want := agent.PrepareErrorReasons(); !slices.Equal(rows, want) {
		t.Errorf("docs/operations.md's TopodraPrepareErrors table has rows for %v, the agent reports %v", rows, want)
	}
}

// tableRowReason matches a Markdown table row that starts with a reason.
var tableRowReason = regexp.MustCompile("^\\| `([a-z_]+)` \\|")
