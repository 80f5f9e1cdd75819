package main

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2/ktesting"
	"sigs.k8s.io/yaml"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/driverroot"
	"github.com/topodra/topodra/pkg/topology"
)

func TestEnvironmentTwins(t *testing.T) {
	testcases := map[string]struct {
		env  map[string]string
		args []string
		want options
	}{
		"environment only": {
			env: map[string]string{"NODE_NAME": "env-node", "NVML": "mock:dgx-h100", "OWNED_TAINT": "true", "RESCAN_INTERVAL": "5s", "CONTAINER_DEV_ROOT": "/host",
				"CONTAINER_NVIDIA_CDI_HOOK_PATH": "/driver-root/usr/bin/nvidia-cdi-hook", "DISABLED_CDI_HOOKS": "update-application-profile,apply-cuda-memory-limits", "UVM": "optional", "CREATE_DEVICE_NODES": "false", "POD_UID": "0b6e1a52-agent-pod"},
			want: options{nodeName: "env-node", podUID: "0b6e1a52-agent-pod", nvml: "mock:dgx-h100", ownedTaint: true, containerDevRoot: "/host", uvm: "optional", createDeviceNodes: false,
				containerHookPath: "/driver-root/usr/bin/nvidia-cdi-hook", disabledCDIHooks: []string{"update-application-profile", "apply-cuda-memory-limits"}},
		},
		"command line wins": {
			env:  map[string]string{"NODE_NAME": "env-node", "NVML": "mock:dgx-h100", "OWNED_TAINT": "true", "DISABLED_CDI_HOOKS": "all"},
			args: []string{"--node-name=flag-node", "--owned-taint=false", "--disabled-cdi-hooks=apply-cuda-memory-limits"},
			want: options{nodeName: "flag-node", nvml: "mock:dgx-h100", containerDevRoot: "/", disabledCDIHooks: []string{"apply-cuda-memory-limits"}, uvm: "require", createDeviceNodes: true},
		},
		"defaults: owned taint on, the container's own /dev, every hook, no hook check, device nodes created, nvidia-uvm required": {
			want: options{nvml: "real", ownedTaint: true, containerDevRoot: "/", uvm: "require", createDeviceNodes: true},
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			cmd, o := newCommandWithOptions()
			if err := cmd.ParseFlags(tc.args); err != nil {
				t.Fatal(err)
			}
			if err := applyEnv(cmd.Flags(), agentFlags); err != nil {
				t.Fatal(err)
			}
			if o.nodeName != tc.want.nodeName || o.nvml != tc.want.nvml || o.ownedTaint != tc.want.ownedTaint || o.containerDevRoot != tc.want.containerDevRoot {
				t.Errorf("got node %q nvml %q ownedTaint %v containerDevRoot %q, want %q %q %v %q", o.nodeName, o.nvml, o.ownedTaint, o.containerDevRoot, tc.want.nodeName, tc.want.nvml, tc.want.ownedTaint, tc.want.containerDevRoot)
			}
			if o.containerHookPath != tc.want.containerHookPath || !slices.Equal(o.disabledCDIHooks, tc.want.disabledCDIHooks) {
				t.Errorf("got containerHookPath %q disabledCDIHooks %q, want %q %q", o.containerHookPath, o.disabledCDIHooks, tc.want.containerHookPath, tc.want.disabledCDIHooks)
			}
			if o.podUID != tc.want.podUID {
				t.Errorf("got podUID %q, want %q", o.podUID, tc.want.podUID)
			}
			if o.uvm != tc.want.uvm || o.createDeviceNodes != tc.want.createDeviceNodes {
				t.Errorf("got uvm %q createDeviceNodes %v, want %q %v", o.uvm, o.createDeviceNodes, tc.want.uvm, tc.want.createDeviceNodes)
			}
			if v, ok := tc.env["RESCAN_INTERVAL"]; ok && o.rescanInterval.String() != v {
				t.Errorf("rescan interval %v, want %s", o.rescanInterval, v)
			}
		})
	}
}

func TestEnvironmentTwinRejectsBadValue(t *testing.T) {
	t.Setenv("OWNED_TAINT", "maybe")
	cmd, _ := newCommandWithOptions()
	if err := cmd.ParseFlags(nil); err != nil {
		t.Fatal(err)
	}
	if err := applyEnv(cmd.Flags(), agentFlags); err == nil || !strings.Contains(err.Error(), "OWNED_TAINT") {
		t.Errorf("want an error naming OWNED_TAINT, got %v", err)
	}
}

func TestDryRun(t *testing.T) {
	testcases := map[string]struct {
		opts        options
		wantDevices int
		wantTaints  bool
		wantErr     string
	}{
		"dgx-h100":                      {opts: options{nvml: "mock:dgx-h100"}, wantDevices: 8},
		"workstation with taint":        {opts: options{nvml: "mock:workstation-2gpu", ownedTaint: true, ownedTaintKey: topology.DefaultTaintKey}, wantDevices: 2, wantTaints: true},
		"unknown profile":               {opts: options{nvml: "mock:nope"}, wantErr: "unknown machine profile"},
		"neither real nor mock":         {opts: options{nvml: "fake"}, wantErr: "--nvml must be"},
		"missing node name outside":     {opts: options{nvml: "mock:dgx-h100"}, wantErr: "--node-name"},
		"invalid owned taint key":       {opts: options{nvml: "mock:dgx-h100", ownedTaint: true, ownedTaintKey: "gpu.topodra.io/not a key"}, wantErr: "--owned-taint-key"},
		"empty owned taint key":         {opts: options{nvml: "mock:dgx-h100", ownedTaint: true}, wantErr: "--owned-taint-key (or OWNED_TAINT_KEY) is empty while --owned-taint"},
		"missing dry run for show-cdi":  {opts: options{nvml: "mock:dgx-h100", nodeName: "node-1", showCDI: true, kubeconfig: "/nonexistent"}, wantErr: "--show-cdi (or SHOW_CDI) needs --dry-run"},
		"relative device root":          {opts: options{nvml: "real", containerDevRoot: "host"}, wantErr: "--container-dev-root"},
		"driver root not there":         {opts: options{nvml: "real", driverRoot: "/nonexistent/driver"}, wantErr: `--driver-root "/nonexistent/driver"`},
		"unknown disabled hook":         {opts: options{nvml: "mock:dgx-h100", disabledCDIHooks: []string{"update-application-profiles"}}, wantErr: `--disabled-cdi-hooks (or DISABLED_CDI_HOOKS): unknown CDI hook "update-application-profiles"; valid: create-symlinks,`},
		"relative hook path":            {opts: options{nvml: "mock:dgx-h100", containerHookPath: "driver-root/usr/bin/nvidia-cdi-hook"}, wantErr: "--container-nvidia-cdi-hook-path"},
		"relative toolkit config":       {opts: options{nvml: "mock:dgx-h100", toolkitConfig: "driver-root/etc/nvidia-container-runtime/config.toml"}, wantErr: "--container-toolkit-config"},
		"pod name without namespace":    {opts: options{nvml: "mock:dgx-h100", podName: "topodra-node-agent-x7k2p"}, wantErr: "--pod-name (or POD_NAME) and --pod-namespace (or POD_NAMESPACE) go together"},
		"relative pod resources socket": {opts: options{nvml: "mock:dgx-h100", podResourcesSocket: "pod-resources/kubelet.sock"}, wantErr: "--pod-resources-socket (or POD_RESOURCES_SOCKET) must be absolute"},
		"unknown uvm policy":            {opts: options{nvml: "mock:dgx-h100", uvm: "always"}, wantErr: `--uvm (or UVM): unknown nvidia-uvm policy "always"; valid: require, optional`},
		"unknown unhealthy effect":      {opts: options{nvml: "mock:dgx-h100", unhealthyEffect: "Evict"}, wantErr: `--unhealthy-taint-effect (or UNHEALTHY_TAINT_EFFECT): unhealthy taint effect "Evict": want NoSchedule or NoExecute`},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			o := tc.opts
			o.dryRun = !strings.HasPrefix(name, "missing")
			if o.dryRun {
				o.nodeName = "node-1"
			}
			var stdout, stderr bytes.Buffer
			err := run(ctx, &o, &stdout, &stderr)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("want error containing %q, got %v", tc.wantErr, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			doc := strings.TrimPrefix(stdout.String(), "---\n")
			var slice resourceapi.ResourceSlice
			if err := yaml.UnmarshalStrict([]byte(doc), &slice); err != nil {
				t.Fatalf("output is not one ResourceSlice: %v\n%s", err, stdout.String())
			}
			if slice.Spec.Driver != topology.DriverName || slice.Spec.Pool.Name != "node-1" || *slice.Spec.NodeName != "node-1" {
				t.Errorf("unexpected slice header: %+v", slice.Spec)
			}
			if len(slice.Spec.Devices) != tc.wantDevices {
				t.Errorf("%d devices, want %d", len(slice.Spec.Devices), tc.wantDevices)
			}
			for _, d := range slice.Spec.Devices {
				if got := len(d.Taints) > 0; got != tc.wantTaints {
					t.Errorf("%s: taints %v, want taints: %v", d.Name, d.Taints, tc.wantTaints)
				}
			}
		})
	}
}

// TestDryRunRealNVML runs the dry run with --show-cdi on the real NVML
// library, loaded from the driver root that DRIVER_ROOT names (the
// agent's own environment twin of --driver-root; default "/"). Where there
// is no GPU (CI) it must say so and succeed. Where there is one, every
// published GPU must carry what NVML and sysfs tell about it, and a
// container of a claim for all of them must get their device nodes and the
// driver's NVML library from the driver root.
func TestDryRunRealNVML(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	cmd, o := newCommandWithOptions()
	if err := cmd.ParseFlags([]string{"--nvml=real", "--dry-run", "--show-cdi", "--node-name=node-1"}); err != nil {
		t.Fatal(err)
	}
	if err := applyEnv(cmd.Flags(), agentFlags); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	if err := run(ctx, o, &stdout, &stderr); err != nil {
		t.Fatalf("dry run with real NVML (driver root %s): %v", o.driverRoot, err)
	}
	if stdout.Len() == 0 {
		if !strings.HasPrefix(stderr.String(), noGPUMessage) {
			t.Errorf("want %q on stderr, got %q", noGPUMessage, stderr.String())
		}
		t.Logf("no GPU, as the dry run says: %s", stderr.String())
		return
	}
	t.Logf("driver root %s:\n%s", o.driverRoot, stdout.String())

	docs := strings.Split(stdout.String(), "---\n")
	if len(docs) != 4 {
		t.Fatalf("want the skipped GPUs' comments, one slice, the CDI spec and the container view; got %d documents", len(docs))
	}
	var slice resourceapi.ResourceSlice
	if err := yaml.Unmarshal([]byte(docs[1]), &slice); err != nil {
		t.Fatalf("first document is not a ResourceSlice: %v", err)
	}
	if len(slice.Spec.Devices) == 0 {
		t.Fatal("a GPU answered NVML but the slice has no device")
	}
	var view containerView
	if err := yaml.Unmarshal([]byte(docs[3]), &view); err != nil {
		t.Fatalf("container view: %v", err)
	}
	deviceNodes := map[string]bool{}
	for _, d := range view.Devices {
		deviceNodes[d.Path] = true
	}
	env := strings.Join(view.Env, "\n")
	for _, d := range slice.Spec.Devices {
		for _, name := range []resourceapi.QualifiedName{discovery.AttrUUID, discovery.AttrProductName, discovery.AttrArchitecture, discovery.AttrCUDAComputeCapability, discovery.AttrDriverVersion, discovery.AttrCUDADriverVersion, topology.AttrPCIBusID, topology.AttrPCIeRoot} {
			if _, ok := d.Attributes[name]; !ok {
				t.Errorf("%s: no attribute %s", d.Name, name)
			}
		}
		mem, ok := d.Capacity[discovery.CapacityMemory]
		if !ok || mem.Value.Sign() <= 0 {
			t.Errorf("%s: memory capacity %v", d.Name, mem.Value)
		}
		if _, ok := d.Capacity[discovery.CapacityMultiprocessors]; !ok {
			// NVML answers "Not Supported" for a whole GPU on some drivers
			// (an H200 on 580.159).
			t.Logf("%s: NVML gave no multiprocessor count", d.Name)
		}
		if uuid := d.Attributes[discovery.AttrUUID].StringValue; uuid == nil || !strings.HasPrefix(*uuid, "GPU-") || !strings.Contains(env, *uuid) {
			t.Errorf("%s: UUID %v is not a GPU UUID in the container's environment", d.Name, uuid)
		}
		minor := d.Attributes[discovery.AttrMinor].IntValue
		if minor == nil {
			t.Errorf("%s: no minor number", d.Name)
		} else if node := fmt.Sprintf("/dev/nvidia%d", *minor); !deviceNodes[node] {
			t.Errorf("%s: the container lacks %s; it has %v", d.Name, node, view.Devices)
		}
	}
	if !deviceNodes[driverroot.ControlDevice] {
		t.Errorf("the container lacks /dev/nvidiactl: %v", view.Devices)
	}
	if !slices.ContainsFunc(view.Mounts, func(m oci.Mount) bool { return strings.Contains(path.Base(m.Source), "libnvidia-ml.so") }) {
		t.Errorf("the container does not get the driver's libnvidia-ml: %v", view.Mounts)
	}
}

// TestRealSourceChecksHook: on real NVML the CDI generator looks for
// --nvidia-cdi-hook-path at --container-nvidia-cdi-hook-path, and not
// where --disabled-cdi-hooks leaves out every hook or the container path
// is empty; mock GPUs run no hooks and check nothing.
func TestRealSourceChecksHook(t *testing.T) {
	nodeRoot := t.TempDir()
	testcases := map[string]struct {
		opts    options
		wantErr bool
	}{
		"missing":             {opts: options{nvml: "real", containerHookPath: filepath.Join(nodeRoot, "usr/bin/nvidia-cdi-hook")}, wantErr: true},
		"not checked":         {opts: options{nvml: "real"}},
		"all hooks disabled":  {opts: options{nvml: "real", containerHookPath: filepath.Join(nodeRoot, "usr/bin/nvidia-cdi-hook"), disabledCDIHooks: []string{"all"}}},
		"some hooks disabled": {opts: options{nvml: "real", containerHookPath: filepath.Join(nodeRoot, "usr/bin/nvidia-cdi-hook"), disabledCDIHooks: []string{"apply-cuda-memory-limits"}}, wantErr: true},
		"mock":                {opts: options{nvml: "mock:dgx-h100", containerHookPath: filepath.Join(nodeRoot, "usr/bin/nvidia-cdi-hook")}},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			o := tc.opts
			o.driverRoot, o.containerDriverRoot, o.cdiHookPath = "/", nodeRoot, cdi.DefaultHookPath
			src, err := newSource(&o, "node-1")
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = src.close() }()
			checker, ok := src.cdi.(cdi.HookChecker)
			if !ok {
				if tc.wantErr || o.nvml == "real" {
					t.Fatalf("generator %T does not check its hook", src.cdi)
				}
				return
			}
			err = checker.CheckHook()
			if got := errors.Is(err, cdi.ErrHookMissing); got != tc.wantErr {
				t.Errorf("CheckHook: %v, want an error: %v", err, tc.wantErr)
			}
			if tc.wantErr && !strings.Contains(err.Error(), cdi.DefaultHookPath) {
				t.Errorf("error %q does not name the path on the node", err)
			}
		})
	}
}

// TestRealSourceDeviceNodes: real GPUs get the --uvm policy and
// --create-device-nodes, except that a dry run, which changes nothing on
// the node, creates none.
func TestRealSourceDeviceNodes(t *testing.T) {
	for name, tc := range map[string]struct {
		uvm        string
		create     bool
		dryRun     bool
		want       cdi.UVMPolicy
		wantCreate bool
	}{
		"defaults":            {create: true, want: cdi.UVMRequire, wantCreate: true},
		"create in a dry run": {create: true, dryRun: true, want: cdi.UVMRequire},
		"optional":            {uvm: "optional", create: true, want: cdi.UVMOptional, wantCreate: true},
		"require, no create":  {uvm: "require", want: cdi.UVMRequire},
	} {
		t.Run(name, func(t *testing.T) {
			o := options{nvml: "real", driverRoot: "/", containerDriverRoot: t.TempDir(), uvm: tc.uvm, createDeviceNodes: tc.create, dryRun: tc.dryRun}
			src, err := newSource(&o, "node-1")
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = src.close() }()
			gen, ok := src.cdi.(*cdi.NVCDI)
			if !ok {
				t.Fatalf("generator %T, want *cdi.NVCDI", src.cdi)
			}
			if got, create := gen.UVM(), gen.CreatesDeviceNodes(); got != tc.want || create != tc.wantCreate {
				t.Errorf("nvidia-uvm policy %q, creates device nodes %v; want %q, %v", got, create, tc.want, tc.wantCreate)
			}
		})
	}
}

type fakeProber struct{ live, ready error }

func (p fakeProber) Live() error  { return p.live }
func (p fakeProber) Ready() error { return p.ready }

func TestHealthEndpoints(t *testing.T) {
	testcases := map[string]struct {
		prober     fakeProber
		path       string
		wantStatus int
		wantBody   string
	}{
		"live":                 {path: "/healthz", wantStatus: http.StatusOK, wantBody: "ok"},
		"not live":             {prober: fakeProber{live: errors.New("kubelet refused plugin registration: bad")}, path: "/healthz", wantStatus: http.StatusServiceUnavailable, wantBody: "refused"},
		"ready":                {path: "/readyz", wantStatus: http.StatusOK, wantBody: "ok"},
		"not ready":            {prober: fakeProber{ready: errors.New("kubelet refused plugin registration: bad")}, path: "/readyz", wantStatus: http.StatusServiceUnavailable, wantBody: "refused"},
		"live while not ready": {prober: fakeProber{ready: errors.New("not yet")}, path: "/healthz", wantStatus: http.StatusOK},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			healthHandler(tc.prober, nil).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, tc.path, nil))
			if rec.Code != tc.wantStatus || !strings.Contains(rec.Body.String(), tc.wantBody) {
				t.Errorf("status %d body %q, want %d containing %q", rec.Code, rec.Body.String(), tc.wantStatus, tc.wantBody)
			}
		})
	}
}

func TestStaleClaimCheckFollowsRescans(t *testing.T) {
	for in, want := range map[time.Duration]time.Duration{
		5 * time.Minute: 5 * time.Minute,
		0:               agent.DefaultRescanInterval,
		-time.Second:    agent.DefaultRescanInterval,
	} {
		if got := checkInterval(in); got != want {
			t.Errorf("--rescan-interval=%v: stale claims checked every %v, want %v", in, got, want)
		}
	}
}

func TestStaleClaimGraceFlag(t *testing.T) {
	cmd, o := newCommandWithOptions()
	if err := cmd.Flags().Parse(nil); err != nil {
		t.Fatal(err)
	}
	if got := zeroIsNever(o.staleClaimGrace); got != agent.DefaultStaleClaimGrace {
		t.Errorf("default --stale-claim-grace: %v, want %v", got, agent.DefaultStaleClaimGrace)
	}
	if got := zeroIsNever(o.registrationTimeout); got != agent.DefaultRegistrationTimeout {
		t.Errorf("default --registration-timeout: %v, want %v", got, agent.DefaultRegistrationTimeout)
	}
	for in, want := range map[time.Duration]time.Duration{
		2 * time.Hour: 2 * time.Hour,
		0:             -1,
		-time.Second:  -1,
	} {
		if got := zeroIsNever(in); got != want {
			t.Errorf("--stale-claim-grace=%v: %v, want %v", in, got, want)
		}
	}
}

// TestUnusableCDIDirNamesFlag: a --cdi-dir that cannot hold CDI specs fails
// the start with an error that names the flag.
func TestUnusableCDIDirNamesFlag(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
users: [{name: u, user: {}}]
current-context: c
`), 0o600); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	o := options{
		nodeName:   "node-1",
		kubeconfig: kubeconfig,
		nvml:       "mock:dgx-h100",
		kubeletDir: filepath.Join(dir, "kubelet"),
		stateDir:   filepath.Join(dir, "state"),
		cdiDir:     file,
	}
	var stdout, stderr bytes.Buffer
	err := run(ctx, &o, &stdout, &stderr)
	if err == nil || !strings.Contains(err.Error(), "--cdi-dir") || !strings.Contains(err.Error(), file) {
		t.Errorf("got %v, want an error naming --cdi-dir and %s", err, file)
	}
}

// TestPositionalArgumentsRefused: "publish-only" instead of
// "--publish-only" is an error, not ignored.
func TestPositionalArgumentsRefused(t *testing.T) {
	cmd := newCommand()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs([]string{"--nvml=mock:dgx-h100", "--dry-run", "--node-name=node-1", "publish-only"})
	err := cmd.Execute()
	if err == nil || !strings.Contains(err.Error(), `"publish-only"`) {
		t.Errorf("got %v, want an error naming the stray argument", err)
	}
}

// TestPodResourcesSocketFlag: the kubelet's PodResources socket is below
// --kubelet-dir unless --pod-resources-socket names it; the default is the
// agent's own default for the kubelet's default directory.
func TestPodResourcesSocketFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{want: agent.DefaultPodResourcesSocket},
		{args: []string{"--kubelet-dir=/var/lib/k0s/kubelet"}, want: "/var/lib/k0s/kubelet/pod-resources/kubelet.sock"},
		{args: []string{"--kubelet-dir=/var/lib/k0s/kubelet", "--pod-resources-socket=/run/pr.sock"}, want: "/run/pr.sock"},
	} {
		cmd, o := newCommandWithOptions()
		if err := cmd.Flags().Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		if got := o.podResources(); got != tc.want {
			t.Errorf("%v: PodResources socket %q, want %q", tc.args, got, tc.want)
		}
	}
}
