package manifests

import (
	"path"
	"slices"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	schedulingv1 "k8s.io/api/scheduling/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"

	"github.com/topodra/topodra/pkg/agent/driverroot"
)

func find[T runtime.Object](objs []runtime.Object, match func(T) bool) (T, bool) {
	for _, obj := range objs {
		if o, ok := obj.(T); ok && match(o) {
			return o, true
		}
	}
	var zero T
	return zero, false
}

func agentOf(t *testing.T, objs []runtime.Object) (*appsv1.DaemonSet, *v1.Container, map[string]string) {
	t.Helper()
	ds, ok := find(objs, func(d *appsv1.DaemonSet) bool { return d.Name == "topodra-node-agent" })
	if !ok {
		t.Fatal("no agent DaemonSet")
	}
	c := &ds.Spec.Template.Spec.Containers[0]
	env := map[string]string{}
	for _, e := range c.Env {
		env[e.Name] = e.Value
	}
	return ds, c, env
}

func volume(ds *appsv1.DaemonSet, name string) *v1.Volume {
	for i, v := range ds.Spec.Template.Spec.Volumes {
		if v.Name == name {
			return &ds.Spec.Template.Spec.Volumes[i]
		}
	}
	return nil
}

func mount(c *v1.Container, name string) *v1.VolumeMount {
	for i, m := range c.VolumeMounts {
		if m.Name == name {
			return &c.VolumeMounts[i]
		}
	}
	return nil
}

// checkHookMount: the agent sees the node's NVIDIA_CDI_HOOK_PATH at
// CONTAINER_NVIDIA_CDI_HOOK_PATH, through a read-only hostPath mount (the
// one with the longest mount path that holds it) of the volume named
// want, and the container path ends with the node's path, so that the
// agent resolves the hook's symbolic links inside the node's root.
func checkHookMount(t *testing.T, ds *appsv1.DaemonSet, c *v1.Container, env map[string]string, want string) {
	t.Helper()
	hook, containerHook := env["NVIDIA_CDI_HOOK_PATH"], env["CONTAINER_NVIDIA_CDI_HOOK_PATH"]
	if !strings.HasSuffix(containerHook, hook) {
		t.Errorf("CONTAINER_NVIDIA_CDI_HOOK_PATH=%q does not end with NVIDIA_CDI_HOOK_PATH=%q", containerHook, hook)
	}
	through := mountOf(c, containerHook)
	if through == nil {
		t.Fatalf("CONTAINER_NVIDIA_CDI_HOOK_PATH=%q is on no mount", containerHook)
	}
	v := volume(ds, through.Name)
	if through.Name != want || v == nil || v.HostPath == nil || !through.ReadOnly {
		t.Fatalf("CONTAINER_NVIDIA_CDI_HOOK_PATH=%q is on mount %s (read-only %v), want a read-only hostPath mount of %s", containerHook, through.Name, through.ReadOnly, want)
	}
	if onNode := path.Join(v.HostPath.Path, strings.TrimPrefix(containerHook, through.MountPath)); onNode != hook {
		t.Errorf("CONTAINER_NVIDIA_CDI_HOOK_PATH=%q is the node's %s through mount %s, want NVIDIA_CDI_HOOK_PATH=%q", containerHook, onNode, through.Name, hook)
	}
}

// operatorToolkitConfig is where the GPU Operator's toolkit keeps its
// configuration on the node.
const operatorToolkitConfig = "/usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml"

// mountOf is the container's mount with the longest mount path that holds
// containerPath; nil where none does.
func mountOf(c *v1.Container, containerPath string) *v1.VolumeMount {
	var through *v1.VolumeMount
	for i, m := range c.VolumeMounts {
		if strings.HasPrefix(containerPath, strings.TrimSuffix(m.MountPath, "/")+"/") && (through == nil || len(m.MountPath) > len(through.MountPath)) {
			through = &c.VolumeMounts[i]
		}
	}
	return through
}

// onNode is the node's path that the container sees at containerPath,
// through a hostPath mount (mountOf); "" where there is none.
func onNode(ds *appsv1.DaemonSet, c *v1.Container, containerPath string) string {
	through := mountOf(c, containerPath)
	if through == nil {
		return ""
	}
	v := volume(ds, through.Name)
	if v == nil || v.HostPath == nil {
		return ""
	}
	return path.Join(v.HostPath.Path, strings.TrimPrefix(containerPath, through.MountPath))
}

// checkUnprivileged: a container that needs no privilege runs without
// capabilities or privilege escalation, under the runtime's default
// seccomp profile (set on the pod or the container).
func checkUnprivileged(t *testing.T, what string, pod *v1.PodSpec, c *v1.Container) {
	t.Helper()
	sc := c.SecurityContext
	if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.Capabilities == nil ||
		!slices.Equal(sc.Capabilities.Drop, []v1.Capability{"ALL"}) || len(sc.Capabilities.Add) != 0 {
		t.Errorf("%s: want allowPrivilegeEscalation false and capabilities {drop: [ALL]}, got %+v", what, sc)
	}
	seccomp := pod.SecurityContext != nil && pod.SecurityContext.SeccompProfile != nil && pod.SecurityContext.SeccompProfile.Type == v1.SeccompProfileTypeRuntimeDefault
	if sc != nil && sc.SeccompProfile != nil {
		seccomp = sc.SeccompProfile.Type == v1.SeccompProfileTypeRuntimeDefault
	}
	if !seccomp {
		t.Errorf("%s: want seccompProfile RuntimeDefault", what)
	}
}

// TestOverlays checks what each install variant must get right: where the
// driver root comes from, how privileged the agent is, and what every
// variant shares (probes, tolerations, requests, images, least privilege).
func TestOverlays(t *testing.T) {
	testcases := map[string]struct {
		// driverRoot is DRIVER_ROOT: a path on the node, "auto", or ""
		// for no driver root at all (mock).
		driverRoot string
		nvml       string
		hook       string
		// hookVolume is the volume through which the agent sees hook.
		hookVolume string
		// toolkitConfig is where the agent's CONTAINER_TOOLKIT_CONFIG is
		// on the node: the toolkit's configuration.
		toolkitConfig string
		privileged    bool
	}{
		"overlays/host":                     {driverRoot: "/", nvml: "real", hook: "/usr/bin/nvidia-cdi-hook", hookVolume: "driver-root", toolkitConfig: "/etc/nvidia-container-runtime/config.toml", privileged: true},
		"overlays/gpu-operator":             {driverRoot: driverroot.Auto, nvml: "real", hook: "/usr/local/nvidia/toolkit/nvidia-cdi-hook", hookVolume: "nvidia-toolkit", toolkitConfig: operatorToolkitConfig, privileged: true},
		"overlays/mock":                     {nvml: "mock:dgx-h100"},
		"overlays/gpu-operator-host-driver": {driverRoot: "/", nvml: "real", hook: "/usr/local/nvidia/toolkit/nvidia-cdi-hook", hookVolume: "nvidia-toolkit", toolkitConfig: operatorToolkitConfig, privileged: true},
	}
	for _, o := range Overlays {
		if _, ok := testcases["overlays/"+o]; !ok {
			t.Errorf("overlay %s has no test case", o)
		}
	}
	for dir, tc := range testcases {
		t.Run(dir, func(t *testing.T) {
			data, err := Render(dir)
			if err != nil {
				t.Fatal(err)
			}
			objs := decodeAll(t, dir, data)
			ds, c, env := agentOf(t, objs)

			if env["NVML"] != tc.nvml {
				t.Errorf("NVML=%q, want %q", env["NVML"], tc.nvml)
			}
			privileged := c.SecurityContext != nil && c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged
			if privileged != tc.privileged {
				t.Errorf("privileged %v, want %v", privileged, tc.privileged)
			}
			if !tc.privileged {
				checkUnprivileged(t, "agent", &ds.Spec.Template.Spec, c)
			}
			rootVolume, rootMount := volume(ds, "driver-root"), mount(c, "driver-root")
			devVolume, devMount := volume(ds, "host-dev"), mount(c, "host-dev")
			if tc.driverRoot == "" {
				if rootVolume != nil || rootMount != nil || volume(ds, "sys") != nil || devVolume != nil || devMount != nil {
					t.Error("mock agent mounts a driver root, /sys or the node's /dev")
				}
			} else {
				// Device nodes where the driver root has none: the
				// node's /dev, live, not the container's copy.
				if devVolume == nil || devVolume.HostPath == nil || devVolume.HostPath.Path != "/dev" || devMount == nil {
					t.Fatal("no host-dev hostPath volume of /dev and mount")
				}
				if want := env["CONTAINER_DEV_ROOT"] + "/dev"; !strings.HasPrefix(want, "/") || devMount.MountPath != want {
					t.Errorf("CONTAINER_DEV_ROOT=%q, the node's /dev mounted at %q, want it at %q", env["CONTAINER_DEV_ROOT"], devMount.MountPath, want)
				}
				// Writable exactly where the agent creates missing
				// device nodes (CREATE_DEVICE_NODES, on by default).
				if creates := env["CREATE_DEVICE_NODES"] != "false"; devMount.ReadOnly == creates {
					t.Errorf("CREATE_DEVICE_NODES=%q, the node's /dev mounted read-only %v, want read-only %v", env["CREATE_DEVICE_NODES"], devMount.ReadOnly, !creates)
				}
				if rootVolume == nil || rootVolume.HostPath == nil || rootMount == nil {
					t.Fatal("no driver-root hostPath volume and mount")
				}
				// The volume is the driver root on the node; with auto,
				// the node's "/", below which the agent sees each
				// candidate root at its node path.
				wantVolume := tc.driverRoot
				if tc.driverRoot == driverroot.Auto {
					wantVolume = "/"
				}
				if env["DRIVER_ROOT"] != tc.driverRoot || rootVolume.HostPath.Path != wantVolume {
					t.Errorf("DRIVER_ROOT=%q, volume %q, want %q and %q", env["DRIVER_ROOT"], rootVolume.HostPath.Path, tc.driverRoot, wantVolume)
				}
				if tc.driverRoot == driverroot.Auto {
					for _, candidate := range driverroot.AutoHostPaths {
						if got := onNode(ds, c, path.Join(env["CONTAINER_DRIVER_ROOT"], candidate)+"/"); got != candidate {
							t.Errorf("driver root %s is seen in the agent as the node's %q, want %s", candidate, got, candidate)
						}
					}
				}
				if env["CONTAINER_DRIVER_ROOT"] != rootMount.MountPath || !rootMount.ReadOnly {
					t.Errorf("CONTAINER_DRIVER_ROOT=%q, mounted read-only %v at %q", env["CONTAINER_DRIVER_ROOT"], rootMount.ReadOnly, rootMount.MountPath)
				}
				if rootMount.MountPropagation == nil || *rootMount.MountPropagation != v1.MountPropagationHostToContainer {
					t.Error("driver root mounted without HostToContainer propagation: a driver container started later stays invisible")
				}
				if env["NVIDIA_CDI_HOOK_PATH"] != tc.hook {
					t.Errorf("NVIDIA_CDI_HOOK_PATH=%q, want %q", env["NVIDIA_CDI_HOOK_PATH"], tc.hook)
				}
				checkHookMount(t, ds, c, env, tc.hookVolume)
				if got := onNode(ds, c, env["CONTAINER_TOOLKIT_CONFIG"]); got != tc.toolkitConfig {
					t.Errorf("CONTAINER_TOOLKIT_CONFIG=%q is the node's %q, want %q", env["CONTAINER_TOOLKIT_CONFIG"], got, tc.toolkitConfig)
				}
			}

			// Shared by every variant.
			// A read-only root: the agent writes only to the node's
			// directories it mounts, and to /tmp.
			if sc := c.SecurityContext; sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
				t.Error("the agent's root file system is writable")
			}
			if m, v := mount(c, "tmp"), volume(ds, "tmp"); m == nil || m.MountPath != "/tmp" || v == nil || v.EmptyDir == nil {
				t.Error("the agent has no emptyDir at /tmp")
			}
			// The kubelet's PodResources API, which tells the agent
			// which claims the node's containers use (the stale claim
			// check), at POD_RESOURCES_SOCKET or the flag's default
			// below KUBELET_DIR.
			kubeletSocket := path.Join(env["KUBELET_DIR"], "pod-resources", "kubelet.sock")
			socket := env["POD_RESOURCES_SOCKET"]
			if socket == "" {
				socket = kubeletSocket
			}
			if got := onNode(ds, c, socket); env["KUBELET_DIR"] == "" || got != kubeletSocket {
				t.Errorf("the agent's PodResources socket %q is the node's %q, want the kubelet's (KUBELET_DIR=%q)", socket, got, env["KUBELET_DIR"])
			}
			// A rollout starts the new agent beside the old one, which
			// needs the pod's UID (sockets of its own): without it two
			// agents would share the plugin sockets.
			if u := ds.Spec.UpdateStrategy; u.Type != appsv1.RollingUpdateDaemonSetStrategyType || u.RollingUpdate == nil ||
				u.RollingUpdate.MaxSurge == nil || u.RollingUpdate.MaxSurge.IntValue() != 1 ||
				u.RollingUpdate.MaxUnavailable == nil || u.RollingUpdate.MaxUnavailable.IntValue() != 0 {
				t.Errorf("agent update strategy %+v, want RollingUpdate with maxUnavailable 0 and maxSurge 1 set", u)
			}
			// The new agent of a rollout never preempts a workload on a
			// full node; it waits for room.
			if name := ds.Spec.Template.Spec.PriorityClassName; name == "" {
				t.Error("the agent has no priority class")
			} else {
				class, ok := find(objs, func(pc *schedulingv1.PriorityClass) bool { return pc.Name == name })
				switch {
				case !ok:
					t.Errorf("priority class %s of the agent is not among the manifests", name)
				case class.PreemptionPolicy == nil || *class.PreemptionPolicy != v1.PreemptNever:
					t.Errorf("priority class %s preempts (%v): a surge agent on a full node would evict a workload", name, class.PreemptionPolicy)
				case class.Value < 1000000000 || class.GlobalDefault:
					t.Errorf("priority class %s: value %d, global default %v; want the highest a class outside system- may have, not the default", name, class.Value, class.GlobalDefault)
				}
			}
			fromPod := map[string]string{}
			for _, ev := range ds.Spec.Template.Spec.Containers[0].Env {
				if ev.ValueFrom != nil && ev.ValueFrom.FieldRef != nil {
					fromPod[ev.Name] = ev.ValueFrom.FieldRef.FieldPath
				}
			}
			if fromPod["POD_UID"] != "metadata.uid" {
				t.Error("the agent has no POD_UID from metadata.uid: with maxSurge two agents would share the kubelet sockets")
			}
			if fromPod["POD_NAME"] != "metadata.name" || fromPod["POD_NAMESPACE"] != "metadata.namespace" {
				t.Error("the agent has no POD_NAME and POD_NAMESPACE from its pod's metadata: it would trust a kubelet that has not read the node's pods yet")
			}
			// Namespaced objects in kube-system only: the policies, the
			// lease and the RoleBindings name it.
			for _, obj := range objs {
				if m, err := meta.Accessor(obj); err == nil && m.GetNamespace() != "" && m.GetNamespace() != metav1.NamespaceSystem {
					t.Errorf("%T %s in namespace %s, want %s", obj, m.GetName(), m.GetNamespace(), metav1.NamespaceSystem)
				}
			}
			deploy, ok := find(objs, func(d *appsv1.Deployment) bool { return d.Name == "topodra-scheduler" })
			if !ok {
				t.Fatal("no scheduler Deployment")
			}
			checkUnprivileged(t, "scheduler", &deploy.Spec.Template.Spec, &deploy.Spec.Template.Spec.Containers[0])
			if sc := deploy.Spec.Template.Spec.Containers[0].SecurityContext; sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot ||
				sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
				t.Error("scheduler may run as root or write its root file system")
			}
			kubeletDir := env["KUBELET_DIR"]
			for _, name := range []string{"plugins", "plugins-registry"} {
				m, v := mount(c, name), volume(ds, name)
				if m == nil || v == nil || v.HostPath == nil || m.MountPath != v.HostPath.Path || !strings.HasPrefix(m.MountPath, kubeletDir+"/") {
					t.Errorf("%s must be mounted at its host path below KUBELET_DIR %q", name, kubeletDir)
				}
			}
			if !slices.ContainsFunc(ds.Spec.Template.Spec.Tolerations, func(tol v1.Toleration) bool {
				return tol.Key == "" && tol.Operator == v1.TolerationOpExists && tol.Effect == ""
			}) {
				t.Error("no toleration of every taint: the agent would not run on GPU nodes with taints of their own")
			}
			if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() {
				t.Error("no resource requests")
			}
			for what, p := range map[string]*v1.Probe{"liveness": c.LivenessProbe, "readiness": c.ReadinessProbe} {
				if p == nil || p.HTTPGet == nil {
					t.Errorf("no HTTP %s probe", what)
					continue
				}
				if p.HTTPGet.Port.String() != "health" || !strings.HasSuffix(env["HEALTH_ADDRESS"], ":8081") ||
					!slices.ContainsFunc(c.Ports, func(p v1.ContainerPort) bool { return p.Name == "health" && p.ContainerPort == 8081 }) {
					t.Errorf("%s probe does not reach HEALTH_ADDRESS %q", what, env["HEALTH_ADDRESS"])
				}
			}
			if !strings.HasPrefix(c.Image, "ghcr.io/topodra/topodra-node-agent:") {
				t.Errorf("agent image %s", c.Image)
			}
			if _, ok := find(objs, func(p *admissionv1.ValidatingAdmissionPolicy) bool { return p.Name == "topodra-node-agent-own-slices" }); !ok {
				t.Error("no policy limiting agents to their own node's slices")
			}
			if _, ok := find(objs, func(b *admissionv1.ValidatingAdmissionPolicyBinding) bool {
				return b.Spec.PolicyName == "topodra-node-agent-own-slices" && slices.Contains(b.Spec.ValidationActions, admissionv1.Deny)
			}); !ok {
				t.Error("own-slices policy not bound with Deny")
			}
			agentRole, ok := find(objs, func(r *rbacv1.ClusterRole) bool { return r.Name == "topodra-node-agent" })
			if !ok {
				t.Fatal("no agent ClusterRole")
			}
			for _, rule := range agentRole.Rules {
				// Slices: what the kubelet plugin helper's ResourceSlice
				// controller and the agent call, one object at a time.
				if slices.Contains(rule.Resources, "resourceslices") {
					if want := []string{"list", "watch", "create", "update", "delete"}; !slices.Equal(rule.Verbs, want) {
						t.Errorf("agent may %v resourceslices, want %v", rule.Verbs, want)
					}
				}
				if slices.Contains(rule.Resources, "events") {
					if want := []string{"create", "patch"}; !slices.Equal(rule.APIGroups, []string{"events.k8s.io"}) || !slices.Equal(rule.Verbs, want) {
						t.Errorf("agent may %v events of %q, want %v of events.k8s.io only", rule.Verbs, rule.APIGroups, want)
					}
				}
				if !slices.Contains(rule.APIGroups, "") {
					continue
				}
				for _, r := range rule.Resources {
					switch r {
					case "pods", "secrets", "pods/exec", "*":
						t.Errorf("agent may %v %s", rule.Verbs, r)
					}
				}
			}
			role, ok := find(objs, func(r *rbacv1.Role) bool { return r.Name == "topodra-scheduler-leases" })
			if !ok {
				t.Fatal("no lease Role")
			}
			for _, rule := range role.Rules {
				if !slices.Equal(rule.Verbs, []string{"create"}) && !slices.Equal(rule.ResourceNames, []string{"topodra-scheduler"}) {
					t.Errorf("lease rule %v is not limited to the topodra-scheduler lease", rule)
				}
			}
		})
	}
}

// TestAgentNodeSelection: the agent's node affinity, as each overlay
// renders it, takes nodes labelled for topodra, by Node Feature Discovery
// or by the GPU Operator (the mock overlay only the first), and leaves out
// a node labelled topodra.io/gpu=false, whatever else labels it, and a
// node labelled topodra.io/driver-upgrade.
func TestAgentNodeSelection(t *testing.T) {
	nodes := map[string]struct {
		labels map[string]string
		// want: the agent runs there (real overlays; mock: only with
		// topodra.io/gpu=true).
		want, mock bool
	}{
		"topodra":                      {labels: map[string]string{"topodra.io/gpu": "true"}, want: true, mock: true},
		"nfd vendor":                   {labels: map[string]string{"feature.node.kubernetes.io/pci-10de.present": "true"}, want: true},
		"nfd class":                    {labels: map[string]string{"feature.node.kubernetes.io/pci-0302_10de.present": "true"}, want: true},
		"gpu operator":                 {labels: map[string]string{"nvidia.com/gpu.present": "true"}, want: true},
		"nfd, opted out":               {labels: map[string]string{"feature.node.kubernetes.io/pci-10de.present": "true", "nvidia.com/gpu.present": "true", "topodra.io/gpu": "false"}},
		"topodra, driver upgrade":      {labels: map[string]string{"topodra.io/gpu": "true", "topodra.io/driver-upgrade": "true"}},
		"gpu operator, driver upgrade": {labels: map[string]string{"nvidia.com/gpu.present": "true", "topodra.io/driver-upgrade": ""}},
		"no gpu":                       {labels: map[string]string{"kubernetes.io/os": "linux"}},
		"nfd other vendor":             {labels: map[string]string{"feature.node.kubernetes.io/pci-1002.present": "true"}},
	}
	for _, dir := range overlayDirs() {
		objs := sets(t)[dir]
		ds, _, _ := agentOf(t, objs)
		pod := &v1.Pod{Spec: ds.Spec.Template.Spec}
		affinity := nodeaffinity.GetRequiredNodeAffinity(pod)
		for name, n := range nodes {
			node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: n.labels}}
			got, err := affinity.Match(node)
			if err != nil {
				t.Fatalf("%s: %v", dir, err)
			}
			want := n.want
			if dir == "overlays/mock" {
				want = n.mock
			}
			if got != want {
				t.Errorf("%s: the agent runs on a node labelled %v: %v, want %v", dir, n.labels, got, want)
			}
		}
	}
}
