package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	dto "github.com/prometheus/client_model/go"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	eventsv1 "k8s.io/api/events/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/events"
	"k8s.io/component-base/featuregate"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/legacyregistry"
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go's metrics (REST requests, work queues) in legacyregistry
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"
	"sigs.k8s.io/yaml"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/driverroot"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/pkg/version"
)

// noGPUMessage starts the one line --dry-run prints (on stderr, exit code 0)
// on a node without NVIDIA GPU; hack/gpu-check.sh looks for it.
const noGPUMessage = "no NVIDIA GPU here"

type options struct {
	nodeName            string
	podUID              string
	kubeconfig          string
	nvml                string
	driverRoot          string
	containerDriverRoot string
	nvmlLibrary         string
	containerDevRoot    string
	cdiHookPath         string
	containerHookPath   string
	toolkitConfig       string
	podResourcesSocket  string
	podName             string
	podNamespace        string
	disabledCDIHooks    []string
	uvm                 string
	createDeviceNodes   bool
	healthAddress       string
	sysfsRoot           string
	kubeletDir          string
	pluginDataDir       string
	registrarDir        string
	stateDir            string
	cdiDir              string
	ownedTaint          bool
	ownedTaintKey       string
	unhealthyEffect     string
	devicePlugin        []string
	otherDriverCheck    bool
	numaList            bool
	rescanInterval      time.Duration
	staleClaimGrace     time.Duration
	registrationTimeout time.Duration
	publishOnly         bool
	dryRun              bool
	showCDI             bool
}

func newCommand() *cobra.Command {
	cmd, _ := newCommandWithOptions()
	return cmd
}

func newCommandWithOptions() (*cobra.Command, *options) {
	o := &options{}
	featureGate := featuregate.NewFeatureGate()
	utilruntime.Must(logsapi.AddFeatureGates(featureGate))
	logConfig := logsapi.NewLoggingConfiguration()

	cmd := &cobra.Command{
		Use:   "topodra-node-agent",
		Short: "Publish this node's NVIDIA GPUs with their topology for DRA and prepare them for containers",
		Long: `topodra-node-agent discovers NVIDIA GPUs through NVML, publishes them as
ResourceSlices of driver ` + topology.DriverName + ` (one pool per node) with NVIDIA-compatible
attributes plus topology (resource.kubernetes.io/pcieRoot, numaNode, pciBusID and
nvlinkClique), turns NVML faults into device taints, and serves the kubelet DRA
plugin that prepares allocated GPUs through CDI specs.

Every flag can also be set through its environment variable (shown in brackets);
the command line wins.`,
		Version:      version.Version,
		SilenceUsage: true,
		// Everything is a flag: a stray word ("publish-only" for
		// "--publish-only") must not be ignored.
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := applyEnv(cmd.Flags(), agentFlags); err != nil {
				return err
			}
			if err := logsapi.ValidateAndApply(logConfig, featureGate); err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return run(ctx, o, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&o.nodeName, "node-name", "", "Name of this node; the slices are owned by its Node object. Required except with --dry-run (default there: the host name).")
	fs.StringVar(&o.podUID, "pod-uid", "", "UID of the agent's pod (the DaemonSet sets it from metadata.uid). With it the agent registers with the kubelet through sockets of its own (kubelet 1.33 or later), so that a rolling update can start the new agent pod beside the old one (maxSurge: 1): the new pod registers once a dry run of discovery, the devices it would publish and their CDI spec passes (a TopodraTakeOverBlocked event on the Node says why not), is ready once the kubelet has registered it, takes over the checkpoint of prepared claims when the old pod has exited, and answers the kubelet's calls from then on (calls that come meanwhile wait), so the kubelet never has the driver unregistered and never deletes the node's slices. Empty: the sockets are named by the driver alone, and an update must stop the old pod before it starts the new one (maxSurge: 0).")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "Kubeconfig file, for running outside the cluster. Empty: in-cluster configuration.")
	fs.StringVar(&o.nvml, "nvml", "real", "Where GPUs come from: 'real' (libnvidia-ml) or 'mock:<profile>' with profile one of "+strings.Join(mockgpu.Profiles(), ", ")+".")
	fs.StringVar(&o.driverRoot, "driver-root", driverroot.DefaultHostPath, "Root of the NVIDIA driver installation on the node: '/' for a driver installed on the host, '"+driverroot.GPUOperatorHostPath+"' for the GPU Operator's driver container, or '"+driverroot.Auto+"' to choose on each node the first of "+strings.Join(driverroot.AutoHostPaths, " and ")+" that holds libnvidia-ml.so.1 (see --nvml-library; an empty directory does not count), for a GPU Operator cluster whose nodes have either the operator's driver container or a driver installed on the host. With "+driverroot.Auto+", --container-driver-root is where the node's '/' is mounted; the roots are looked at until NVML is loaded from one, and again at every rescan: where "+driverroot.GPUOperatorHostPath+" holds the library after the agent loaded the host's (the driver container became ready later), the agent records a "+agent.ReasonNVMLReload+" event and exits, and its restart loads the container's. The choice is logged and recorded as a "+reasonDriverRoot+" event on the Node. CDI specs name driver files below the root.")
	fs.StringVar(&o.containerDriverRoot, "container-driver-root", "", "Where --driver-root is mounted in this container (for example /driver-root); libnvidia-ml.so.1 is loaded from there. With --driver-root="+driverroot.Auto+": where the node's '/' is mounted, with mounts made on the node later visible (HostToContainer), so that "+driverroot.GPUOperatorHostPath+" is seen below it. Empty: --driver-root itself (running on the host).")
	fs.StringVar(&o.nvmlLibrary, "nvml-library", "", "Where libnvidia-ml.so.1 is in the driver root, for a driver whose library is not in the standard library directories ("+strings.Join(driverroot.LibrarySearchPaths, ", ")+"): relative to the driver root (opt/nvidia/lib64/libnvidia-ml.so.1), or absolute as the node sees it and below --driver-root (with "+driverroot.Auto+", the roots it is not below are not looked at). Symbolic links are resolved inside the root. While it is missing the agent reports no GPU (a TopodraNoGPU event naming it) and retries. Empty: the standard directories.")
	fs.StringVar(&o.containerDevRoot, "container-dev-root", "/", "Where the node's /dev is found in this container, as <dir>/dev, for a --driver-root whose dev/ has no nvidiactl (a driver installed on the host, a driver directory without device nodes); CDI specs name the device nodes found there by the node's /dev. '/' is this container's own /dev, which holds only the device nodes that existed when the container started. The DaemonSet mounts the node's /dev at /host/dev and sets /host.")
	fs.StringVar(&o.cdiHookPath, "nvidia-cdi-hook-path", cdi.DefaultHookPath, "Path of nvidia-cdi-hook on the node (NVIDIA Container Toolkit); the CDI specs' hooks run it. GPU Operator: /usr/local/nvidia/toolkit/nvidia-cdi-hook.")
	fs.StringVar(&o.containerHookPath, "container-nvidia-cdi-hook-path", "", "Where --nvidia-cdi-hook-path is visible in this container (the DaemonSet: /driver-root/usr/bin/nvidia-cdi-hook, with the GPU Operator /host/usr/local/nvidia/toolkit/nvidia-cdi-hook). Where it is missing or not executable, the agent logs an error and records a "+agent.ReasonCDIHookMissing+" Warning event on the Node at start, and Prepare of real GPUs fails with what to do, looking again each time. A path that ends with --nvidia-cdi-hook-path has its symbolic links resolved inside the directory before that (the node's root as mounted here). Empty: not checked.")
	fs.StringVar(&o.toolkitConfig, "container-toolkit-config", "", "Where the node's NVIDIA Container Toolkit configuration (config.toml) is visible in this container (the DaemonSet: /driver-root/etc/nvidia-container-runtime/config.toml, with the GPU Operator's toolkit /host/usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml). Where it leaves "+agent.VisibleDevicesEnvKey+" true (or out), which lets any pod that sets NVIDIA_VISIBLE_DEVICES reach every GPU where nvidia-container-runtime runs it, the agent logs it and records a "+agent.ReasonVisibleDevicesEnvAccepted+" Warning event on the Node at start. A missing file is not checked. Empty: not checked.")
	fs.StringSliceVar(&o.disabledCDIHooks, "disabled-cdi-hooks", nil, "nvidia-cdi-hook subcommands to leave out of the CDI specs, for a node whose NVIDIA Container Toolkit is older than they need: "+hookVersions()+"; 'all' leaves out every hook. A container with a GPU fails to start where the node's nvidia-cdi-hook is older than 1.18.0 and lacks a hook of its spec (1.18.0 and later skip such a hook with a warning).")
	fs.BoolVar(&o.createDeviceNodes, "create-device-nodes", true, "Before Prepare of real GPUs writes a CDI spec, create the NVIDIA device nodes that a GPU's containers need and the node lacks (/dev/nvidiactl, the GPU's /dev/nvidia<minor>, /dev/nvidia-uvm and /dev/nvidia-uvm-tools), where their kernel module is loaded, as nvidia-modprobe does: in the device root mounted from the node (see --container-dev-root; never in this container's own /dev). Without them Prepare fails (see --uvm), saying what to do on the node, in the pod's events and in a "+agent.ReasonDeviceNodeMissing+" Warning event on the Node; the kubelet's next try picks them up once they are there. --dry-run never creates them.")
	fs.StringVar(&o.uvm, "uvm", string(cdi.UVMRequire), "Whether Prepare of real GPUs requires /dev/nvidia-uvm and /dev/nvidia-uvm-tools, without which CUDA cannot start in a container (cuInit error 999): 'require' fails Prepare while they are missing (where --create-device-nodes could not create them: the nvidia-uvm module is not loaded); 'optional' prepares GPUs without them, for containers that do not use CUDA.")
	fs.StringVar(&o.healthAddress, "health-address", ":8081", "Address of the HTTP health endpoints /healthz (liveness) and /readyz (readiness): running, and the kubelet registered the plugin (liveness: did not refuse it, and no step of the start other than waiting for another agent took over 5 minutes); they answer while the agent starts; a node without GPUs is ready (see the Node's TopodraNoGPU events). /metrics there serves the agent's metrics (topodra_agent_*) in the Prometheus format. Empty disables them.")
	fs.StringVar(&o.sysfsRoot, "sysfs-root", "/sys", "Host sysfs, read for PCIe roots and NUMA nodes (real NVML only).")
	fs.StringVar(&o.kubeletDir, "kubelet-dir", defaultKubeletDir, "The kubelet's root directory (--root-dir of the kubelet); some distributions move it. The agent must see it at the same path as the kubelet.")
	fs.StringVar(&o.pluginDataDir, "plugin-data-dir", "", "Directory of the DRA plugin socket. Empty: <kubelet-dir>/plugins/"+topology.DriverName+".")
	fs.StringVar(&o.registrarDir, "registrar-dir", "", "The kubelet's plugin registration directory. Empty: <kubelet-dir>/plugins_registry.")
	fs.DurationVar(&o.registrationTimeout, "registration-timeout", agent.DefaultRegistrationTimeout, "How long the kubelet may take to register the plugin after the agent starts before the agent records a "+agent.ReasonNotRegistered+" Warning on the Node (the kubelet does not look in --registrar-dir, or refuses the plugin); /readyz fails until it registers. 0 or less: no warning.")
	fs.StringVar(&o.stateDir, "state-dir", "", "Directory of the prepared-claims checkpoint. Empty: --plugin-data-dir.")
	fs.StringVar(&o.cdiDir, "cdi-dir", cdi.DefaultDir, "Directory for the per-claim CDI specs; the container runtime must read it.")
	fs.BoolVar(&o.ownedTaint, "owned-taint", agent.DefaultOwnedTaint, "Taint every published device with NoSchedule --owned-taint-key, so that only topodra-scheduler (which tolerates it) allocates them and the default scheduler leaves them alone. --owned-taint=false lets both schedulers hand out the same GPUs, and they double-book them: only for clusters where topodra-scheduler is the only scheduler that allocates this driver's devices.")
	fs.StringVar(&o.ownedTaintKey, "owned-taint-key", topology.DefaultTaintKey, "Key of the --owned-taint taint; must not be empty while --owned-taint is on.")
	fs.StringVar(&o.unhealthyEffect, "unhealthy-taint-effect", string(resourceapi.DeviceTaintEffectNoSchedule), "Effect of the "+agent.HealthTaintKey+" taint of a GPU that reported a critical XID, fell off the bus or whose row remapping failed: NoSchedule keeps new allocations off it and leaves the pods that use it alone; NoExecute also has kube-controller-manager's device taint eviction controller evict every pod whose claim holds the GPU (running, or bound and not started because the agent refuses to prepare a faulty GPU), so that its controller creates it again on healthy GPUs. Where NVML cannot tell which GPU is lost, every GPU of the node is tainted, and with NoExecute every pod using one is evicted. Admin access does not exempt a pod; only a claim that tolerates the taint with effect NoExecute keeps it.")
	fs.StringSliceVar(&o.devicePlugin, "device-plugin-resources", agent.DefaultDevicePluginResources, "Extended resources of a device plugin that hands out the same GPUs (names, or prefixes ending in *): while the Node's allocatable has any of them, every published device carries the NoSchedule taint "+agent.DevicePluginTaintKey+" and the Node a "+agent.ReasonDevicePlugin+" event, so that neither scheduler hands out a GPU that the device plugin may give to another pod. Read at start and every --rescan-interval (every minute when rescanning is off). Empty disables the check.")
	fs.BoolVar(&o.otherDriverCheck, "other-driver-check", agent.DefaultOtherDriverCheck, "Watch the ResourceSlices of other DRA drivers on this node (NVIDIA's gpu.nvidia.com): while one lists a device with the resource.kubernetes.io/pciBusID or uuid of a GPU that the agent publishes, which the default scheduler hands out through that driver, the agent's device carries the NoSchedule taint "+agent.OtherDriverTaintKey+", the Node a "+agent.ReasonOtherDriver+" Warning, and new claims on it are not prepared, until no other driver lists it. Read at start before the first publish, then watched.")
	fs.BoolVar(&o.numaList, "numa-list", false, "Publish resource.kubernetes.io/numaNode as a list (physical node first, then same-socket nodes at minimum distance). Needs the DRAListTypeAttributes feature gate in the cluster.")
	fs.DurationVar(&o.rescanInterval, "rescan-interval", agent.DefaultRescanInterval, "How often to rediscover GPUs and republish on change, to check prepared claims against the API (see --stale-claim-grace) and, while the health of some GPU is not watched, to try watching it again, and to read the Node (see --device-plugin-resources; a Node deleted and created again gets the agent's slices, owned by the new Node); 0 or less disables rescanning (prepared claims, health watching and the Node are then checked every "+agent.DefaultRescanInterval.String()+").")
	fs.DurationVar(&o.staleClaimGrace, "stale-claim-grace", agent.DefaultStaleClaimGrace, "How long a prepared claim that the API server no longer has (deleted while prepared, as for a force-deleted pod whose containers may still run), or has without an allocation (given back without the kubelet unpreparing it), keeps its GPUs before the agent drops it; it is dropped only once the kubelet (--pod-resources-socket) has reported, in two checks in a row, no container on this node using it. Until then its GPUs are not prepared for other claims, the Node gets a "+agent.ReasonPreparedClaimGone+" Warning naming it, and the kubelet unprepares it once its containers are gone. 0 or less: never dropped by the agent.")
	fs.StringVar(&o.podResourcesSocket, "pod-resources-socket", "", "The kubelet's PodResources API socket, which the agent asks which ResourceClaims the containers on this node use before it drops a prepared claim (see --stale-claim-grace); where it cannot be reached, no claim is dropped. With it the agent needs no permission to read pods. Empty: <kubelet-dir>/pod-resources/kubelet.sock.")
	fs.StringVar(&o.podName, "pod-name", "", "Name of the agent's pod (the DaemonSet sets it from metadata.name), with --pod-namespace: the agent trusts the kubelet's PodResources API (--pod-resources-socket) only once it lists this pod, so that a kubelet that has just started and not read the node's pods yet cannot have a prepared claim dropped. Empty: not checked.")
	fs.StringVar(&o.podNamespace, "pod-namespace", "", "Namespace of the agent's pod (the DaemonSet sets it from metadata.namespace); see --pod-name.")
	fs.BoolVar(&o.publishOnly, "publish-only", false, "Only publish ResourceSlices; do not register with the kubelet or serve Prepare/Unprepare (no sockets needed).")
	fs.BoolVar(&o.dryRun, "dry-run", false, "Discover GPUs, print the ResourceSlice that would be published as YAML and exit; needs no cluster. Prints '"+noGPUMessage+"' and exits 0 where there is no GPU.")
	fs.BoolVar(&o.showCDI, "show-cdi", false, "Only with --dry-run (refused without it): also prepare a claim for all published GPUs as the kubelet has the agent prepare it (in a temporary checkpoint and CDI directory), print the CDI spec written for it and what a container gets when a runtime applies it (environment, mounts of driver libraries and binaries, device nodes, hooks), then unprepare it. Nothing outside the temporary directory is written.")
	agentFlags = nil
	fs.VisitAll(func(f *pflag.Flag) { agentFlags = append(agentFlags, f.Name) })
	for _, name := range agentFlags {
		f := fs.Lookup(name)
		f.Usage += " [$" + envName(name) + "]"
	}
	logsapi.AddFlags(logConfig, fs)
	featureGate.AddFlag(fs)
	return cmd, o
}

// hookVersions lists the CDI hooks with the NVIDIA Container Toolkit
// release that each needs.
func hookVersions() string {
	var out []string
	for _, h := range cdi.Hooks {
		out = append(out, fmt.Sprintf("%s (%s)", h.Name, h.Since))
	}
	return strings.Join(out, ", ")
}

// agentFlags are the flags with environment twins (not the logging flags).
var agentFlags []string

func envName(flag string) string {
	return strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// applyEnv sets each named flag that was not given on the command line from
// its environment variable, if that is set.
func applyEnv(fs *pflag.FlagSet, names []string) error {
	for _, name := range names {
		f := fs.Lookup(name)
		if f == nil || f.Changed {
			continue
		}
		value, ok := os.LookupEnv(envName(name))
		if !ok {
			continue
		}
		if err := fs.Set(name, value); err != nil {
			return fmt.Errorf("environment variable %s: %w", envName(name), err)
		}
	}
	return nil
}

// defaultKubeletDir is the kubelet's usual root directory, the one the
// kubeletplugin helper's defaults live in.
var defaultKubeletDir = filepath.Dir(kubeletplugin.KubeletPluginsDir)

// pluginDir is --plugin-data-dir, defaulted from --kubelet-dir.
func (o *options) pluginDir() string {
	if o.pluginDataDir != "" {
		return o.pluginDataDir
	}
	return filepath.Join(o.kubeletDir, "plugins", topology.DriverName)
}

// podResources is --pod-resources-socket, defaulted from --kubelet-dir.
func (o *options) podResources() string {
	if o.podResourcesSocket != "" {
		return o.podResourcesSocket
	}
	return filepath.Join(o.kubeletDir, "pod-resources", "kubelet.sock")
}

// registryDir is --registrar-dir, defaulted from --kubelet-dir.
func (o *options) registryDir() string {
	if o.registrarDir != "" {
		return o.registrarDir
	}
	return filepath.Join(o.kubeletDir, "plugins_registry")
}

// source is where devices and their CDI edits come from.
type source struct {
	discovery discovery.Interface
	cdi       cdi.Generator
	// roots selects the driver root of real NVML; nil for mock GPUs.
	roots *driverroot.Selector
	close func() error
}

// newSource builds discovery and CDI generation for --nvml. Real NVML is
// loaded from the driver root, on first discovery and again on every retry
// until it works, so that a driver installed after the agent started is
// found without a restart.
func newSource(o *options, nodeName string) (*source, error) {
	form := discovery.NUMAScalar
	if o.numaList {
		form = discovery.NUMAList
	}
	disabledHooks, err := cdi.ParseDisabledHooks(o.disabledCDIHooks)
	if err != nil {
		return nil, fmt.Errorf("--disabled-cdi-hooks (or DISABLED_CDI_HOOKS): %w", err)
	}
	uvm := cdi.UVMRequire
	if o.uvm != "" {
		if uvm, err = cdi.ParseUVMPolicy(o.uvm); err != nil {
			return nil, fmt.Errorf("--uvm (or UVM): %w", err)
		}
	}
	if o.containerHookPath != "" && !filepath.IsAbs(o.containerHookPath) {
		return nil, fmt.Errorf("--container-nvidia-cdi-hook-path (or CONTAINER_NVIDIA_CDI_HOOK_PATH) must be absolute, got %q", o.containerHookPath)
	}
	if o.toolkitConfig != "" && !filepath.IsAbs(o.toolkitConfig) {
		return nil, fmt.Errorf("--container-toolkit-config (or CONTAINER_TOOLKIT_CONFIG) must be absolute, got %q", o.toolkitConfig)
	}
	if (o.podName == "") != (o.podNamespace == "") {
		return nil, fmt.Errorf("--pod-name (or POD_NAME) and --pod-namespace (or POD_NAMESPACE) go together, got %q and %q", o.podName, o.podNamespace)
	}
	if o.podResourcesSocket != "" && !filepath.IsAbs(o.podResourcesSocket) {
		return nil, fmt.Errorf("--pod-resources-socket (or POD_RESOURCES_SOCKET) must be absolute, got %q", o.podResourcesSocket)
	}
	switch {
	case o.nvml == "real":
		roots, err := o.driverRoots()
		if err != nil {
			return nil, err
		}
		var sysfs fs.ReadLinkFS
		if o.sysfsRoot != "/sys" {
			sysfs = os.DirFS(o.sysfsRoot).(fs.ReadLinkFS)
		}
		disc := discovery.NewLazy(openNVML(roots, o.nvmlLibrary), discovery.NVMLOptions{Sysfs: sysfs, NUMAForm: form})
		gen, err := cdi.NewNVCDI(cdi.NVCDIOptions{
			LoadedRoot:        roots.Loaded,
			NVML:              disc.Lib,
			HookPath:          o.cdiHookPath,
			ContainerHookPath: o.containerHookPath,
			DisabledHooks:     disabledHooks,
			UVM:               uvm,
			// A dry run changes nothing on the node: it reports the
			// device nodes that the agent would create as missing.
			CreateDeviceNodes: o.createDeviceNodes && !o.dryRun,
		})
		if err != nil {
			return nil, err
		}
		return &source{discovery: rootCheckingDiscovery{Lazy: disc, roots: roots}, cdi: gen, roots: roots, close: disc.Close}, nil
	case strings.HasPrefix(o.nvml, "mock:"):
		m, err := mockgpu.New(strings.TrimPrefix(o.nvml, "mock:"), mockgpu.Options{NodeName: nodeName})
		if err != nil {
			return nil, fmt.Errorf("--nvml: %w", err)
		}
		disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: m.NVML(), Sysfs: m.Sysfs(), NUMAForm: form})
		if err != nil {
			return nil, err
		}
		// Mock GPUs have no device nodes: containers get only the
		// environment (NVIDIA_VISIBLE_DEVICES, TOPODRA_GPU_<n>).
		return &source{discovery: disc, cdi: cdi.Static{EnvOnly: true}, close: disc.Close}, nil
	default:
		return nil, fmt.Errorf("--nvml must be 'real' or 'mock:<profile>', got %q", o.nvml)
	}
}

func run(ctx context.Context, o *options, stdout, stderr io.Writer) error {
	logger := klog.FromContext(ctx)
	nodeName := o.nodeName
	if nodeName == "" && o.dryRun {
		nodeName, _ = os.Hostname()
	}
	if nodeName == "" {
		return errors.New("--node-name (or NODE_NAME) is required")
	}
	if o.showCDI && !o.dryRun {
		// Without --dry-run this would start a second agent beside the
		// node's own, taking over its kubelet sockets.
		return errors.New("--show-cdi (or SHOW_CDI) needs --dry-run (or DRY_RUN=true)")
	}
	if o.ownedTaint && o.ownedTaintKey == "" {
		return errors.New("--owned-taint-key (or OWNED_TAINT_KEY) is empty while --owned-taint (OWNED_TAINT) is on: set the key topodra-scheduler tolerates (its ownedTaintKey), or turn --owned-taint off")
	}
	if o.ownedTaintKey != "" {
		if err := agent.ValidateTaintKey(o.ownedTaintKey); err != nil {
			return fmt.Errorf("--owned-taint-key (or OWNED_TAINT_KEY): %w", err)
		}
	}
	if o.unhealthyEffect != "" {
		if err := agent.ValidateUnhealthyTaintEffect(resourceapi.DeviceTaintEffect(o.unhealthyEffect)); err != nil {
			return fmt.Errorf("--unhealthy-taint-effect (or UNHEALTHY_TAINT_EFFECT): %w", err)
		}
	}

	src, err := newSource(o, nodeName)
	if err == nil {
		defer func() { _ = src.close() }()
		if src.roots != nil {
			src.roots.Notify(reportRootChoice(logger, nil, nodeName))
		}
	}
	if o.dryRun {
		if err == nil {
			err = dryRun(ctx, src, o, nodeName, stdout)
		}
		if errors.Is(err, discovery.ErrNoGPU) {
			_, _ = fmt.Fprintf(stderr, "%s: %v\n", noGPUMessage, err)
			return nil
		}
		return err
	}
	if err != nil {
		return err
	}

	config, err := kubeConfig(o.kubeconfig)
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(config)
	if err != nil {
		return fmt.Errorf("create kube client: %w", err)
	}
	sink := newEventSink(client)
	broadcaster := events.NewBroadcaster(sink)
	broadcaster.StartRecordingToSink(ctx.Done())
	defer broadcaster.Shutdown()
	recorder := broadcaster.NewRecorder(scheme.Scheme, "topodra-node-agent")
	if src.roots != nil && len(src.roots.Candidates()) > 1 {
		src.roots.Notify(reportRootChoice(logger, recorder, nodeName))
	}
	a, err := agent.Start(ctx, agent.Options{
		NodeName:              nodeName,
		RollingUpdateUID:      types.UID(o.podUID),
		KubeClient:            client,
		Discovery:             src.discovery,
		CDIGenerator:          src.cdi,
		Recorder:              recorder,
		PublishOnly:           o.publishOnly,
		PluginDataDir:         o.pluginDir(),
		RegistrarDir:          o.registryDir(),
		StateDir:              o.stateDir,
		CDIDir:                o.cdiDir,
		OwnedTaint:            o.ownedTaint,
		OwnedTaintKey:         o.ownedTaintKey,
		UnhealthyTaintEffect:  resourceapi.DeviceTaintEffect(o.unhealthyEffect),
		DevicePluginResources: o.devicePlugin,
		OtherDriverCheck:      o.otherDriverCheck,
		NodeCheck:             checkInterval(o.rescanInterval),
		RescanInterval:        rescan(o.rescanInterval),
		StaleClaimCheck:       checkInterval(o.rescanInterval),
		StaleClaimGrace:       zeroIsNever(o.staleClaimGrace),
		RegistrationTimeout:   zeroIsNever(o.registrationTimeout),
		ToolkitConfig:         o.toolkitConfig,
		PodResourcesSocket:    o.podResources(),
		Pod:                   types.NamespacedName{Namespace: o.podNamespace, Name: o.podName},
	})
	if err != nil {
		return exitError(ctx, sink, err)
	}
	// The endpoints answer while the agent starts: with --pod-uid it is
	// ready before it has the lock on the state directory, which the
	// agent it replaces releases only once the rollout sees this one
	// ready.
	if o.healthAddress != "" {
		stopHealth, err := serveHealth(ctx, o.healthAddress, a, metricsHandler(a))
		if err != nil {
			a.Stop()
			return err
		}
		defer stopHealth()
	}
	select {
	case <-a.Started():
		logger.Info("Node agent running", "node", nodeName, "nvml", o.nvml, "driverRoot", o.driverRoot, "driverRootInUse", src.rootInUse(), "nvmlLibrary", o.nvmlLibrary, "containerDevRoot", o.containerDevRoot, "cdiHook", o.cdiHookPath, "disabledCDIHooks", o.disabledCDIHooks, "publishOnly", o.publishOnly, "ownedTaint", o.ownedTaint, "podUID", o.podUID)
	case <-a.Done():
	}
	err = waitAgent(ctx, sink, a)
	if ctx.Err() != nil {
		logger.Info("Shutting down", "reason", context.Cause(ctx))
		return nil
	}
	return err
}

// waitAgent waits until the agent a stops (it failed to start, a fatal
// error, or ctx ended), stops it and returns why (see exitError).
func waitAgent(ctx context.Context, sink *eventSink, a *agent.Agent) error {
	<-a.Done()
	cause := a.Err()
	a.Stop()
	return exitError(ctx, sink, cause)
}

// exitError is the error the command exits with where the agent could
// not start or stopped: one that a flag causes names the flag. Where the
// checkpoint is unreadable or the state cannot be written it first waits
// (up to eventFlushTimeout) until the agent's ReasonCheckpointUnreadable
// or ReasonStateUnwritable event has been sent to the API server: the
// process exits next, and events are sent in the background.
func exitError(ctx context.Context, sink *eventSink, err error) error {
	switch {
	case errors.Is(err, agent.ErrCheckpoint):
		flushEvent(ctx, sink, agent.ReasonCheckpointUnreadable)
	case errors.Is(err, agent.ErrStateUnwritable):
		flushEvent(ctx, sink, agent.ReasonStateUnwritable)
	case errors.Is(err, agent.ErrCDIDir):
		return fmt.Errorf("--cdi-dir (or CDI_DIR): %w", err)
	case errors.Is(err, agent.ErrSocketPath):
		return fmt.Errorf("--kubelet-dir (or --plugin-data-dir, --registrar-dir): %w", err)
	}
	return err
}

// flushEvent waits (up to eventFlushTimeout) until an event with reason
// has been sent to the API server: the process exits next, and events are
// sent in the background.
func flushEvent(ctx context.Context, sink *eventSink, reason string) {
	if !sink.waitFor(ctx, reason, eventFlushTimeout) {
		klog.FromContext(ctx).Info("the event may not have reached the API server", "reason", reason)
	}
}

// eventFlushTimeout bounds how long flushEvent waits.
const eventFlushTimeout = 10 * time.Second

// eventSink writes events to the API server (events.k8s.io/v1) and tells
// waitFor when an event with a given reason has been written, or failed
// to be.
type eventSink struct {
	events.EventSink
	mutex sync.Mutex
	sent  map[string]chan struct{}
}

func newEventSink(client kubernetes.Interface) *eventSink {
	return &eventSink{EventSink: &events.EventSinkImpl{Interface: client.EventsV1()}, sent: map[string]chan struct{}{}}
}

// Create implements events.EventSink.
func (s *eventSink) Create(ctx context.Context, event *eventsv1.Event) (*eventsv1.Event, error) {
	out, err := s.EventSink.Create(ctx, event)
	ch := s.channel(event.Reason)
	s.mutex.Lock()
	select {
	case <-ch:
	default:
		close(ch)
	}
	s.mutex.Unlock()
	return out, err
}

func (s *eventSink) channel(reason string) chan struct{} {
	s.mutex.Lock()
	defer s.mutex.Unlock()
	ch, ok := s.sent[reason]
	if !ok {
		ch = make(chan struct{})
		s.sent[reason] = ch
	}
	return ch
}

// waitFor says whether an event with the reason was sent within timeout.
func (s *eventSink) waitFor(ctx context.Context, reason string, timeout time.Duration) bool {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-s.channel(reason):
		return true
	case <-ctx.Done():
		return false
	case <-timer.C:
		return false
	}
}

func rescan(d time.Duration) time.Duration {
	if d <= 0 {
		return -1
	}
	return d
}

// checkInterval is how often prepared claims are checked against the
// API server and the Node for a device plugin: every rescan, or every
// DefaultRescanInterval where rescans are off (claims deleted while the
// agent was down still go).
func checkInterval(rescanInterval time.Duration) time.Duration {
	if rescanInterval <= 0 {
		return agent.DefaultRescanInterval
	}
	return rescanInterval
}

// zeroIsNever is a duration flag whose 0 or less means never
// (--stale-claim-grace, --registration-timeout) as the agent's Options
// have it: negative, where their 0 is a default.
func zeroIsNever(d time.Duration) time.Duration {
	if d <= 0 {
		return -1
	}
	return d
}

// prober is what the health endpoints ask.
type prober interface {
	Live() error
	Ready() error
}

// healthHandler serves /healthz from Live and /readyz from Ready: 200 "ok",
// or 503 with the reason; and /metrics from metrics, where that is not nil.
func healthHandler(p prober, metrics http.Handler) http.Handler {
	mux := http.NewServeMux()
	probe := func(check func() error) http.HandlerFunc {
		return func(w http.ResponseWriter, _ *http.Request) {
			if err := check(); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			_, _ = io.WriteString(w, "ok\n")
		}
	}
	mux.Handle("/healthz", probe(p.Live))
	mux.Handle("/readyz", probe(p.Ready))
	if metrics != nil {
		mux.Handle("/metrics", metrics)
	}
	return mux
}

// metricsHandler serves the metrics of the process and those of the agent
// a (agent.Agent.MetricsCollector), which a registry of its own holds, so
// that nothing registers an agent's metrics globally. The process's are
// legacyregistry's (client-go's REST and work queue metrics, the process
// collector) without its Go collector, which exports every runtime/metrics
// series (over 200 per agent, on every node of a cluster), and the Go
// collector's default set instead (goroutines, threads, GC, memory
// statistics).
func metricsHandler(a *agent.Agent) http.Handler {
	registry := metrics.NewKubeRegistry()
	registry.CustomMustRegister(a.MetricsCollector())
	goRuntime := prometheus.NewRegistry()
	goRuntime.MustRegister(collectors.NewGoCollector())
	return metrics.HandlerFor(prometheus.Gatherers{withoutGoMetrics(legacyregistry.DefaultGatherer), goRuntime, registry}, metrics.HandlerOpts{})
}

// withoutGoMetrics gathers what g does, less the Go collector's metrics
// (go_*).
func withoutGoMetrics(g prometheus.Gatherer) prometheus.Gatherer {
	return prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) {
		families, err := g.Gather()
		return slices.DeleteFunc(families, func(f *dto.MetricFamily) bool {
			return strings.HasPrefix(f.GetName(), "go_")
		}), err
	})
}

// serveHealth listens on address until the returned function is called.
func serveHealth(ctx context.Context, address string, p prober, metrics http.Handler) (func(), error) {
	listener, err := net.Listen("tcp", address)
	if err != nil {
		return nil, fmt.Errorf("--health-address: %w", err)
	}
	server := &http.Server{Handler: healthHandler(p, metrics), ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := server.Serve(listener); err != nil && !errors.Is(err, http.ErrServerClosed) {
			klog.FromContext(ctx).Error(err, "health endpoint failed")
		}
	}()
	return func() { _ = server.Close() }, nil
}

func kubeConfig(path string) (*rest.Config, error) {
	if path == "" {
		config, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("in-cluster configuration (use --kubeconfig outside a cluster): %w", err)
		}
		return config, nil
	}
	config, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, fmt.Errorf("load kubeconfig %s: %w", path, err)
	}
	return config, nil
}

// dryRun prints the slice the agent would publish, with GPUs that it would
// not publish as comments; with --show-cdi it then prepares a claim for
// all GPUs (see showPrepared).
func dryRun(ctx context.Context, src *source, o *options, nodeName string, out io.Writer) error {
	inv, err := src.discovery.Discover(ctx)
	if err != nil {
		return err
	}
	resources := agent.BuildResources(inv, nodeName, nil, agent.TaintOptions{Owned: o.ownedTaint, OwnedKey: o.ownedTaintKey})
	for _, s := range inv.Skipped {
		if _, err := fmt.Fprintf(out, "# not published: GPU %d %s (%s): %s\n", s.Index, s.UUID, s.PCIBusID, s.Reason); err != nil {
			return err
		}
	}
	for _, slice := range agent.SliceObjects(topology.DriverName, nodeName, resources) {
		data, err := yaml.Marshal(slice)
		if err != nil {
			return err
		}
		if _, err := fmt.Fprintf(out, "---\n%s", data); err != nil {
			return err
		}
	}
	if !o.showCDI {
		return nil
	}
	return showPrepared(ctx, src, nodeName, inv, out)
}

// errOrFile is err, or where it is nil (the path is there but is not a
// directory) says so.
func errOrFile(err error) error {
	if err == nil {
		return errors.New("it is a file")
	}
	return err
}
