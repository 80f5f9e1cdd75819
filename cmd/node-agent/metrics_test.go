package main

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/topology"
)

// TestMetricsEndpoint: the health port's /metrics serves the agent's
// metrics, as ALPHA metrics with their values, beside the process's own
// (legacyregistry, with the Go collector's default set rather than every
// runtime metric: a cluster scrapes one agent per node), and follows a
// Prepare.
func TestMetricsEndpoint(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	m, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: "node-1"})
	if err != nil {
		t.Fatal(err)
	}
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: m.NVML(), Sysfs: m.Sysfs()})
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(ctx, agent.Options{
		NodeName:       "node-1",
		KubeClient:     fake.NewClientset(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}}),
		Discovery:      disc,
		PublishOnly:    true,
		StateDir:       t.TempDir(),
		CDIDir:         t.TempDir(),
		CDIGenerator:   cdi.Static{EnvOnly: true},
		RescanInterval: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Stop)
	handler := healthHandler(a, metricsHandler(a))
	scrape := func() string {
		t.Helper()
		rec := httptest.NewRecorder()
		handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		if rec.Code != http.StatusOK {
			t.Fatalf("GET /metrics: %d %s", rec.Code, rec.Body)
		}
		return rec.Body.String()
	}
	expect := func(body string, lines ...string) {
		t.Helper()
		for _, line := range lines {
			if !strings.Contains("\n"+body, "\n"+line+"\n") {
				t.Errorf("/metrics lacks the line %q", line)
			}
		}
	}

	body := scrape()
	expect(body,
		"# TYPE topodra_agent_nvml_usable gauge",
		"# TYPE topodra_agent_prepare_errors_total counter",
		"topodra_agent_nvml_usable 1",
		`topodra_agent_gpus{state="published"} 8`,
		`topodra_agent_gpus{state="not_published"} 0`,
		"topodra_agent_prepared_claims 0",
		"topodra_agent_stale_prepared_claims 0",
		"topodra_agent_kubelet_registered 0",
		`topodra_agent_prepare_errors_total{reason="device_in_use"} 0`,
		`topodra_agent_prepare_errors_total{reason="other"} 0`,
	)
	if !strings.Contains(body, "\n# HELP topodra_agent_gpus [ALPHA] ") {
		t.Error("/metrics lacks the ALPHA help of topodra_agent_gpus")
	}
	for _, name := range []string{"go_goroutines", "go_memstats_heap_alloc_bytes", "process_resident_memory_bytes"} {
		if !strings.Contains(body, "\n"+name+" ") {
			t.Errorf("/metrics lacks the process's metric %s", name)
		}
	}
	goSeries := 0
	for _, line := range strings.Split(body, "\n") {
		if strings.HasPrefix(line, "go_") {
			goSeries++
		}
	}
	if goSeries > 60 {
		t.Errorf("/metrics has %d series of Go runtime metrics (go_*), want the Go collector's default set (under 60)", goSeries)
	}

	claim := func(name string) *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, UID: types.UID("uid-" + name)},
			Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
				Results: []resourceapi.DeviceRequestAllocationResult{{Request: "gpu", Driver: topology.DriverName, Pool: "node-1", Device: "gpu-0"}},
			}}},
		}
	}
	result, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{claim("a"), claim("b")})
	if err != nil {
		t.Fatal(err)
	}
	if errA, errB := result["uid-a"].Err, result["uid-b"].Err; (errA == nil) == (errB == nil) || !errors.Is(errors.Join(errA, errB), agent.ErrDeviceInUse) {
		t.Fatalf("prepare of two claims on gpu-0: %v, %v; want one prepared, one refused with ErrDeviceInUse", errA, errB)
	}
	expect(scrape(),
		"topodra_agent_prepared_claims 1",
		`topodra_agent_prepare_errors_total{reason="device_in_use"} 1`,
	)
}
