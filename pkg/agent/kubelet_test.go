package agent_test

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2/ktesting"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/topology"
)

// TestKubeletPluginServesPrepare runs the agent as on a node: registration
// and DRA sockets, and NodePrepareResources/NodeUnprepareResources called
// over gRPC the way the kubelet calls them.
func TestKubeletPluginServesPrepare(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	base := socketDirs(t)
	pluginDir, registrarDir := filepath.Join(base, "p"), filepath.Join(base, "r")
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: e.machine.NVML(), Sysfs: e.machine.Sysfs()})
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(ctx, agent.Options{
		NodeName:       nodeName,
		KubeClient:     e.client,
		Discovery:      disc,
		PluginDataDir:  pluginDir,
		RegistrarDir:   registrarDir,
		StateDir:       e.stateDir,
		CDIDir:         e.cdiDir,
		RescanInterval: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Stop()
	if _, err := os.Stat(filepath.Join(registrarDir, topology.DriverName+"-reg.sock")); err != nil {
		t.Errorf("registration socket: %v", err)
	}
	if _, ok := a.PublishStatus(); !ok {
		t.Error("PublishStatus reports nothing published: the agent publishes through its own publisher beside the kubelet plugin")
	}

	c := claim("kubelet", gpus("gpus", "gpu-6")...)
	if _, err := e.client.ResourceV1().ResourceClaims(c.Namespace).Create(ctx, c, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient("unix://"+filepath.Join(pluginDir, "dra.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	client := drapb.NewDRAPluginClient(conn)
	pbClaim := &drapb.Claim{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)}

	for range 2 { // the kubelet may ask again after a restart
		resp, err := client.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{pbClaim}})
		if err != nil {
			t.Fatalf("NodePrepareResources: %v", err)
		}
		got := resp.Claims[string(c.UID)]
		if got == nil || got.Error != "" || len(got.Devices) != 1 {
			t.Fatalf("unexpected response: %v", resp)
		}
		d := got.Devices[0]
		if d.PoolName != nodeName || d.DeviceName != "gpu-6" || len(d.CdiDeviceIds) != 1 || d.CdiDeviceIds[0] != "gpu.topodra.io/gpu=uid-kubelet-gpu-6" {
			t.Errorf("unexpected device: %v", d)
		}
	}
	if spec := readSpec(t, e, c.UID); !slices.Contains(spec.Devices[0].ContainerEdits.Env, "TOPODRA_GPU_6="+e.machine.UUID(6)) {
		t.Errorf("CDI spec of gpu-6 has env %v, want TOPODRA_GPU_6=%s", spec.Devices[0].ContainerEdits.Env, e.machine.UUID(6))
	}

	resp, err := client.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{pbClaim}})
	if err != nil {
		t.Fatalf("NodeUnprepareResources: %v", err)
	}
	if got := resp.Claims[string(c.UID)]; got == nil || got.Error != "" {
		t.Errorf("unexpected unprepare response: %v", resp)
	}
}

// TestUnusableCDIDirFailsStart: a --cdi-dir that cannot hold specs fails
// the start of a kubelet plugin, rather than its first Prepare; a
// publish-only agent, which the kubelet does not ask to prepare, starts.
func TestUnusableCDIDirFailsStart(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t)
	base := socketDirs(t)
	file := filepath.Join(base, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: e.machine.NVML(), Sysfs: e.machine.Sysfs()})
	if err != nil {
		t.Fatal(err)
	}
	for name, dir := range map[string]string{"a file": file, "below a file": filepath.Join(file, "cdi")} {
		t.Run(name, func(t *testing.T) {
			opts := agent.Options{
				NodeName:       nodeName,
				KubeClient:     e.client,
				Discovery:      disc,
				PluginDataDir:  filepath.Join(base, "p"),
				RegistrarDir:   filepath.Join(base, "r"),
				StateDir:       e.stateDir,
				CDIDir:         dir,
				RescanInterval: -1,
			}
			a, err := agent.New(ctx, opts)
			if err == nil {
				a.Stop()
			}
			if !errors.Is(err, agent.ErrCDIDir) || !strings.Contains(err.Error(), dir) {
				t.Errorf("got %v, want ErrCDIDir naming %s", err, dir)
			}
			opts.PublishOnly = true
			a, err = agent.New(ctx, opts)
			if err != nil {
				t.Fatalf("publish-only: %v", err)
			}
			a.Stop()
		})
	}
}

// socketDirs returns a short temporary directory (Unix socket paths are
// limited to about 108 bytes; t.TempDir can be longer) with the
// subdirectories p and r for the plugin's and the registrar's sockets.
func socketDirs(t *testing.T) string {
	t.Helper()
	base, err := os.MkdirTemp("", "ta")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(base) })
	for _, dir := range []string{"p", "r"} {
		if err := os.MkdirAll(filepath.Join(base, dir), 0o750); err != nil {
			t.Fatal(err)
		}
	}
	return base
}
