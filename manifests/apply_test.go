package manifests_test

import (
	"context"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	batchv1 "k8s.io/api/batch/v1"
	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/manifests"
	"github.com/topodra/topodra/pkg/cluster"
	"github.com/topodra/topodra/pkg/invariant"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// startCluster starts a real kube-apiserver configured as clusters are
// (the test server's defaults differ): RBAC authorization, privileged
// containers allowed.
func startCluster(t *testing.T, ctx context.Context) *framework.ControlPlane {
	t.Helper()
	cp, err := framework.Start(t, "--authorization-mode=Node,RBAC", "--allow-privileged=true")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cp.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: metav1.NamespaceSystem}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	return cp
}

// startInstalled starts a control plane and applies the host overlay, as
// `kubectl apply -k manifests/overlays/host` would; it returns the rendered
// manifests too.
func startInstalled(t *testing.T, ctx context.Context) (*framework.ControlPlane, []byte) {
	t.Helper()
	cp := startCluster(t, ctx)
	data, err := manifests.Render("overlays/host")
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.Apply(ctx, data, nil); err != nil {
		t.Fatal(err)
	}
	return cp, data
}

// TestManifestsApply: every rendered overlay, and then every example, is
// accepted by a real API server (schema, CEL of the admission policies,
// references between objects resolved by the server).
func TestManifestsApply(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	cp := startCluster(t, ctx)
	for _, o := range manifests.Overlays {
		data, err := manifests.Render("overlays/" + o)
		if err != nil {
			t.Fatal(err)
		}
		if err := cp.Apply(ctx, data, nil); err != nil {
			t.Errorf("apply overlay %s: %v", o, err)
		}
	}
	checkClaimPolicy(t, ctx, cp.Client)
	checkDefaultSchedulerPolicy(t, ctx, cp)
	checkAgentPriorityPolicy(t, ctx, cp.Client)
	examples, err := fs.Glob(manifests.FS, "examples/*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, path := range examples {
		data, err := manifests.FS.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		// As `kubectl apply -f` does: namespaced objects without a
		// namespace go to the current one.
		if err := cp.Apply(ctx, data, func(obj *unstructured.Unstructured) bool {
			if obj.GetNamespace() == "" && namespaced[obj.GetKind()] {
				obj.SetNamespace(metav1.NamespaceDefault)
			}
			return true
		}); err != nil {
			t.Errorf("apply %s: %v", path, err)
		}
	}
}

// checkClaimPolicy checks the claim policy as rendered and applied: a
// claim that tolerates the owned key, which kustomize copied into the
// policy, is refused (the policy takes effect asynchronously), and one
// without tolerations is admitted.
func checkClaimPolicy(t *testing.T, ctx context.Context, client kubernetes.Interface) {
	t.Helper()
	claim := func(name string, tolerations ...resourceapi.DeviceToleration) *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: metav1.NamespaceDefault},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name: "gpu",
				Exactly: &resourceapi.ExactDeviceRequest{
					DeviceClassName: topology.DriverName, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
					Tolerations: tolerations,
				},
			}}}},
		}
	}
	owned := resourceapi.DeviceToleration{Key: topology.DefaultTaintKey, Operator: resourceapi.DeviceTolerationOpExists}
	var lastErr error
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, lastErr = client.ResourceV1().ResourceClaims(metav1.NamespaceDefault).Create(ctx, claim("owned-toleration", owned), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return lastErr != nil, nil
	})
	if err != nil {
		t.Errorf("the rendered claim policy never refused a claim tolerating %s", topology.DefaultTaintKey)
	} else if !apierrors.IsForbidden(lastErr) || !strings.Contains(lastErr.Error(), "topodra-scheduler") {
		t.Errorf("a claim tolerating %s: refused, but not by the claim policy: %v", topology.DefaultTaintKey, lastErr)
	}
	if _, err := client.ResourceV1().ResourceClaims(metav1.NamespaceDefault).Create(ctx, claim("plain"), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}); err != nil {
		t.Errorf("the rendered claim policy refuses a claim without tolerations: %v", err)
	}
}

// checkDefaultSchedulerPolicy checks the default-scheduler policy as
// rendered and applied: the default scheduler's user may not write an
// allocation with a device of driver gpu.topodra.io (the policy takes
// effect asynchronously), and may write one of another driver; an admin
// may write either.
func checkDefaultSchedulerPolicy(t *testing.T, ctx context.Context, cp *framework.ControlPlane) {
	t.Helper()
	cfg := rest.CopyConfig(cp.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: "system:kube-scheduler", Groups: []string{"system:authenticated"}}
	defaultScheduler, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	claim, err := cp.Client.ResourceV1().ResourceClaims(metav1.NamespaceDefault).Create(ctx, &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "allocated-by-default-scheduler", Namespace: metav1.NamespaceDefault},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "gpu",
			Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: topology.DriverName, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
			},
		}}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	allocated := func(driver string) *resourceapi.ResourceClaim {
		c := claim.DeepCopy()
		c.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
			Results: []resourceapi.DeviceRequestAllocationResult{{Request: "gpu", Driver: driver, Pool: "node-a", Device: "gpu-0"}},
		}}
		return c
	}
	dryRun := metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}}
	var lastErr error
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, lastErr = defaultScheduler.ResourceV1().ResourceClaims(metav1.NamespaceDefault).UpdateStatus(ctx, allocated(topology.DriverName), dryRun)
		return lastErr != nil, nil
	})
	if err != nil {
		t.Errorf("the rendered default-scheduler policy never refused the default scheduler an allocation of %s", topology.DriverName)
	} else if !apierrors.IsForbidden(lastErr) || !strings.Contains(lastErr.Error(), "set spec.schedulerName: topodra-scheduler") {
		t.Errorf("the default scheduler's allocation of %s: refused, but not by the policy: %v", topology.DriverName, lastErr)
	}
	if _, err := defaultScheduler.ResourceV1().ResourceClaims(metav1.NamespaceDefault).UpdateStatus(ctx, allocated("nic.example.com"), dryRun); err != nil {
		t.Errorf("the default scheduler's allocation of another driver's device: %v", err)
	}
	if _, err := cp.Client.ResourceV1().ResourceClaims(metav1.NamespaceDefault).UpdateStatus(ctx, allocated(topology.DriverName), dryRun); err != nil {
		t.Errorf("an admin's allocation of %s: %v", topology.DriverName, err)
	}
}

// checkAgentPriorityPolicy checks the agent's PriorityClass policy as
// rendered and applied: a pod of class topodra-node-agent outside
// kube-system, or there under another service account, is refused (the
// policy takes effect asynchronously); the agent's own pod, and pods of
// other classes, are admitted.
func checkAgentPriorityPolicy(t *testing.T, ctx context.Context, client kubernetes.Interface) {
	t.Helper()
	const class = "topodra-node-agent"
	pod := func(namespace, serviceAccount, priorityClass string) *v1.Pod {
		return &v1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "priority-" + namespace + "-" + serviceAccount, Namespace: namespace},
			Spec: v1.PodSpec{
				ServiceAccountName: serviceAccount,
				PriorityClassName:  priorityClass,
				Containers:         []v1.Container{{Name: "c", Image: "busybox"}},
			},
		}
	}
	dryRun := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	create := func(p *v1.Pod) error {
		_, err := client.CoreV1().Pods(p.Namespace).Create(ctx, p, dryRun)
		return err
	}
	var lastErr error
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		lastErr = create(pod(metav1.NamespaceDefault, "default", class))
		return lastErr != nil, nil
	})
	if err != nil {
		t.Errorf("the rendered agent priority policy never refused a workload of class %s", class)
	} else if !apierrors.IsForbidden(lastErr) || !strings.Contains(lastErr.Error(), "use a PriorityClass of your own") {
		t.Errorf("a workload of class %s: refused, but not by the policy: %v", class, lastErr)
	}
	if err := create(pod(metav1.NamespaceSystem, "default", class)); !apierrors.IsForbidden(err) {
		t.Errorf("a pod of class %s in kube-system under another service account: %v, want refused", class, err)
	}
	if err := create(pod(metav1.NamespaceSystem, class, class)); err != nil {
		t.Errorf("the agent's pod: %v", err)
	}
	if err := create(pod(metav1.NamespaceDefault, "default", "")); err != nil {
		t.Errorf("a pod without a PriorityClass: %v", err)
	}
}

// namespaced are the namespaced kinds the examples use.
var namespaced = map[string]bool{"Pod": true, "ResourceClaim": true, "ResourceClaimTemplate": true, "ConfigMap": true}

// agentClient is the node agent's identity as the API server sees a pod's
// service-account token on the given node ("" for a token without node).
func agentClient(t *testing.T, cp *framework.ControlPlane, node string) kubernetes.Interface {
	t.Helper()
	cfg := rest.CopyConfig(cp.Config)
	cfg.Impersonate = rest.ImpersonationConfig{
		UserName: "system:serviceaccount:kube-system:topodra-node-agent",
		Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"},
	}
	if node != "" {
		cfg.Impersonate.Extra = map[string][]string{"authentication.kubernetes.io/node-name": {node}}
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return client
}

// TestAgentOwnNodeOnly: with the shipped RBAC and policy, node A's agent
// writes node A's ResourceSlice and is refused node B's, another driver's
// on node A, cluster-wide slices, and everything when its token names no
// node; it cannot read
// Secrets, and Pods only by listing. Other identities are not affected
// by the policy.
func TestAgentOwnNodeOnly(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	cp, _ := startInstalled(t, ctx)
	agentA := agentClient(t, cp, "node-a")
	sliceA := framework.SliceForNode("node-a", topology.DriverName, nil)

	// Policies take effect asynchronously after creation: retry the
	// allowed write until RBAC and the policy are both in place, then
	// expect refusals to be stable.
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := agentA.ResourceV1().ResourceSlices().Create(ctx, sliceA, metav1.CreateOptions{})
		return err == nil, nil
	}); err != nil {
		t.Fatalf("node A's agent cannot create its own slice: %v", err)
	}
	sliceB, err := cp.Client.ResourceV1().ResourceSlices().Create(ctx, framework.SliceForNode("node-b", topology.DriverName, nil), metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("admin creates node B's slice: %v", err)
	}
	refused := func(what string, err error, want string) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: got %v, want a refusal containing %q", what, err, want)
		}
	}
	// The policy is loaded asynchronously: wait until it refuses.
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		created, err := agentA.ResourceV1().ResourceSlices().Create(ctx, framework.SliceForNode("node-c", topology.DriverName, nil), metav1.CreateOptions{})
		if err == nil {
			_ = cp.Client.ResourceV1().ResourceSlices().Delete(ctx, created.Name, metav1.DeleteOptions{})
		}
		return err != nil, nil
	}); err != nil {
		t.Fatal("the own-slices policy never refused node A's agent writing node C's slice")
	}

	_, err = agentA.ResourceV1().ResourceSlices().Create(ctx, framework.SliceForNode("node-d", topology.DriverName, nil), metav1.CreateOptions{})
	refused("create another node's slice", err, "may only write its own ResourceSlices")
	err = agentA.ResourceV1().ResourceSlices().Delete(ctx, sliceB.Name, metav1.DeleteOptions{})
	refused("delete another node's slice", err, "those of node node-b")
	changed := sliceB.DeepCopy()
	changed.Spec.Devices = []resourceapi.Device{{Name: "gpu-0"}}
	_, err = agentA.ResourceV1().ResourceSlices().Update(ctx, changed, metav1.UpdateOptions{})
	refused("update another node's slice", err, "those of node node-b")
	otherPool := framework.SliceForNode("node-a", topology.DriverName, nil)
	otherPool.Name, otherPool.Spec.Pool.Name = "node-a-posing-as-b", "node-b"
	_, err = agentA.ResourceV1().ResourceSlices().Create(ctx, otherPool, metav1.CreateOptions{})
	refused("create a slice of its node in another node's pool", err, "may only write pools named after its node, not pool node-b")
	otherDriver := framework.SliceForNode("node-a", "gpu.nvidia.com", nil)
	otherDriver.Name = "node-a-nvidia"
	_, err = agentA.ResourceV1().ResourceSlices().Create(ctx, otherDriver, metav1.CreateOptions{})
	refused("create a slice of another driver on its node", err, "may only write slices of driver gpu.topodra.io, not of gpu.nvidia.com")
	otherDriver, err = cp.Client.ResourceV1().ResourceSlices().Create(ctx, otherDriver, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("admin creates another driver's slice on node A: %v", err)
	}
	err = agentA.ResourceV1().ResourceSlices().Delete(ctx, otherDriver.Name, metav1.DeleteOptions{})
	refused("delete another driver's slice on its node", err, "not of gpu.nvidia.com")
	clusterWide := framework.SliceForNode("x", topology.DriverName, nil)
	clusterWide.Name = "cluster-wide"
	clusterWide.Spec.NodeName = nil
	clusterWide.Spec.AllNodes = ptrTo(true)
	_, err = agentA.ResourceV1().ResourceSlices().Create(ctx, clusterWide, metav1.CreateOptions{})
	refused("create a cluster-wide slice", err, "slices without a node")
	_, err = agentClient(t, cp, "").ResourceV1().ResourceSlices().Create(ctx, framework.SliceForNode("node-e", topology.DriverName, nil), metav1.CreateOptions{})
	refused("write without a node in the token", err, "has no node")
	if err := agentA.ResourceV1().ResourceSlices().Delete(ctx, sliceA.Name, metav1.DeleteOptions{}); err != nil {
		t.Errorf("node A's agent deletes its own slice: %v", err)
	}

	_, err = agentA.CoreV1().Secrets(metav1.NamespaceSystem).List(ctx, metav1.ListOptions{})
	if !apierrors.IsForbidden(err) {
		t.Errorf("agent lists Secrets: %v, want Forbidden", err)
	}
	// Pods: not readable at all, not even its own node's (the kubelet's
	// PodResources API tells it which claims the node's containers use).
	_, err = agentA.CoreV1().Pods(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=node-a"})
	if !apierrors.IsForbidden(err) {
		t.Errorf("agent lists its node's pods: %v, want Forbidden", err)
	}
	_, err = agentA.CoreV1().Pods(metav1.NamespaceDefault).Get(ctx, "any", metav1.GetOptions{})
	if !apierrors.IsForbidden(err) {
		t.Errorf("agent gets a Pod: %v, want Forbidden", err)
	}
	// The policy matches only the agent: an admin still manages any slice.
	if err := cp.Client.ResourceV1().ResourceSlices().Delete(ctx, sliceB.Name, metav1.DeleteOptions{}); err != nil {
		t.Errorf("admin deletes node B's slice: %v", err)
	}
}

func ptrTo[T any](v T) *T { return &v }

// saKubeconfig writes a kubeconfig that acts as the given ServiceAccount
// (impersonated by the admin credentials of the control plane).
func saKubeconfig(t *testing.T, cp *framework.ControlPlane, namespace, name string) string {
	t.Helper()
	kc, err := clientcmd.LoadFromFile(cp.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	for _, auth := range kc.AuthInfos {
		auth.Impersonate = "system:serviceaccount:" + namespace + ":" + name
		auth.ImpersonateGroups = []string{"system:serviceaccounts", "system:serviceaccounts:" + namespace, "system:authenticated"}
	}
	path := filepath.Join(t.TempDir(), name+".kubeconfig")
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestSchedulerRBAC runs topodra-scheduler as the manifest's ServiceAccount
// with the configuration of the manifest's ConfigMap, on a real API server
// that enforces RBAC and the shipped policies: it schedules a pod with a
// DRA claim for an owned GPU. The same identity may neither write
// ResourceSlices nor read Secrets.
func TestSchedulerRBAC(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	cp, data := startInstalled(t, ctx)
	var schedulerConfig string
	for _, obj := range decodeAllObjects(t, data) {
		if cm, ok := obj.(*v1.ConfigMap); ok && strings.HasPrefix(cm.Name, "topodra-scheduler-config-") {
			schedulerConfig = cm.Data["scheduler-config.yaml"]
		}
	}
	if schedulerConfig == "" {
		t.Fatal("no scheduler configuration in the manifests")
	}

	// One node with two GPUs, published as the agent would (the owned
	// DeviceTaintRule of the manifests taints them).
	if _, err := framework.CreateReadyNode(ctx, cp.Client, "gpu-node", nil); err != nil {
		t.Fatal(err)
	}
	slice := framework.SliceForNode("gpu-node", topology.DriverName, []framework.Device{{Name: "gpu-0"}, {Name: "gpu-1"}})
	if _, err := cp.Client.ResourceV1().ResourceSlices().Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := cp.StartClaimController(ctx); err != nil {
		t.Fatal(err)
	}

	// The scheduler as its ServiceAccount: a control plane view whose
	// kubeconfig impersonates it.
	saCP := &framework.ControlPlane{Cluster: &cluster.Cluster{Config: cp.Config, Client: cp.Client, Kubeconfig: saKubeconfig(t, cp, metav1.NamespaceSystem, "topodra-scheduler"), Dir: t.TempDir()}}
	defer saCP.Stop()
	stop, err := saCP.StartScheduler(ctx, framework.SchedulerOptions{Name: "topodra-rbac", Config: []byte(schedulerConfig)})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()

	ns := metav1.NamespaceDefault
	if _, err := cp.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, framework.ClaimTemplate(ns, "one-gpu", topology.DriverName, 1), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod, err := cp.Client.CoreV1().Pods(ns).Create(ctx, framework.PodWithClaims(ns, "trainer", "topodra-scheduler", "one-gpu"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		pod, err = cp.Client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		return err == nil && pod.Spec.NodeName != "", nil
	}); err != nil {
		t.Fatalf("pod not scheduled by topodra-scheduler running as its ServiceAccount: %+v", pod.Status.Conditions)
	}

	sa, err := kubernetes.NewForConfig(impersonate(cp.Config, metav1.NamespaceSystem, "topodra-scheduler"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = sa.ResourceV1().ResourceSlices().Create(ctx, framework.SliceForNode("other", topology.DriverName, nil), metav1.CreateOptions{})
	if !apierrors.IsForbidden(err) {
		t.Errorf("scheduler identity creates a ResourceSlice: %v, want Forbidden", err)
	}
	_, err = sa.CoreV1().Secrets(metav1.NamespaceSystem).List(ctx, metav1.ListOptions{})
	if !apierrors.IsForbidden(err) {
		t.Errorf("scheduler identity lists Secrets: %v, want Forbidden", err)
	}
}

func impersonate(cfg *rest.Config, namespace, name string) *rest.Config {
	cfg = rest.CopyConfig(cfg)
	cfg.Impersonate = rest.ImpersonationConfig{
		UserName: "system:serviceaccount:" + namespace + ":" + name,
		Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:" + namespace, "system:authenticated"},
	}
	return cfg
}

// decodeAllObjects decodes a multi-document manifest with the client-go
// scheme.
func decodeAllObjects(t *testing.T, data []byte) []runtime.Object {
	t.Helper()
	var out []runtime.Object
	for _, doc := range strings.Split(string(data), "\n---\n") {
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
		if err == nil {
			out = append(out, obj)
		}
	}
	return out
}

// TestMetricsReaderRole: the shipped ClusterRole topodra-metrics-reader,
// bound to a monitoring ServiceAccount, lets it get the scheduler's
// /metrics, as the API server authorizes it for kube-scheduler's secure
// port, and nothing else; a ServiceAccount without the binding may not.
func TestMetricsReaderRole(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	cp, _ := startInstalled(t, ctx)
	bindClusterRole(ctx, t, cp, "topodra-metrics-reader", "monitoring", "prometheus")
	allowed := func(sa string, attrs authorizationv1.SubjectAccessReviewSpec) bool {
		t.Helper()
		attrs.User = "system:serviceaccount:monitoring:" + sa
		attrs.Groups = []string{"system:serviceaccounts", "system:serviceaccounts:monitoring", "system:authenticated"}
		review, err := cp.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{Spec: attrs}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return review.Status.Allowed
	}
	metrics := authorizationv1.SubjectAccessReviewSpec{NonResourceAttributes: &authorizationv1.NonResourceAttributes{Path: "/metrics", Verb: "get"}}
	pods := authorizationv1.SubjectAccessReviewSpec{ResourceAttributes: &authorizationv1.ResourceAttributes{Verb: "list", Resource: "pods"}}
	// RBAC's authorizer learns of the new binding from its informer.
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return allowed("prometheus", metrics), nil
	}); err != nil {
		t.Fatal("the bound ServiceAccount may not get /metrics")
	}
	if allowed("prometheus", pods) {
		t.Error("the bound ServiceAccount may list pods")
	}
	if allowed("other", metrics) {
		t.Error("a ServiceAccount without the binding may get /metrics")
	}
}

// TestCheckerRole: topodra-check, run as a ServiceAccount bound to the
// shipped ClusterRole topodra-checker, reads everything it judges (no
// part is left unjudged for want of permission) and may change nothing;
// without the binding it cannot read the cluster.
func TestCheckerRole(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	cp, _ := startInstalled(t, ctx)
	bindClusterRole(ctx, t, cp, "topodra-checker", "sre", "checker")
	as := func(sa string) kubernetes.Interface {
		t.Helper()
		config := rest.CopyConfig(cp.Config)
		config.Impersonate = rest.ImpersonationConfig{
			UserName: "system:serviceaccount:sre:" + sa,
			Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:sre", "system:authenticated"},
		}
		client, err := kubernetes.NewForConfig(config)
		if err != nil {
			t.Fatal(err)
		}
		return client
	}
	opts := invariant.CheckOptions{Reads: 2, Interval: 10 * time.Millisecond}
	var report invariant.Report
	// RBAC's authorizer learns of the new binding from its informer.
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		var err error
		report, err = invariant.CheckWith(ctx, as("checker"), opts)
		return err == nil, nil
	})
	if err != nil {
		_, err := invariant.CheckWith(ctx, as("checker"), opts)
		t.Fatalf("checker bound to topodra-checker cannot read the cluster: %v", err)
	}
	for _, why := range report.NotJudged {
		if strings.Contains(why, "forbidden") {
			t.Errorf("not judged for want of permission: %s", why)
		}
	}
	if _, err := invariant.CheckWith(ctx, as("other"), opts); err == nil {
		t.Error("a ServiceAccount without the binding read the cluster")
	}
	review, err := cp.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
		User:               "system:serviceaccount:sre:checker",
		Groups:             []string{"system:serviceaccounts", "system:serviceaccounts:sre", "system:authenticated"},
		ResourceAttributes: &authorizationv1.ResourceAttributes{Verb: "update", Group: "resource.k8s.io", Resource: "resourceclaims"},
	}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if review.Status.Allowed {
		t.Error("the checker's role may update resourceclaims")
	}
}

// bindClusterRole binds the ClusterRole role to the ServiceAccount
// namespace/name, as an admin does for a shipped role.
func bindClusterRole(ctx context.Context, t *testing.T, cp *framework.ControlPlane, role, namespace, name string) {
	t.Helper()
	binding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: namespace + "-" + name + "-" + role},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: namespace, Name: name}},
	}
	if _, err := cp.Client.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestAgentSurgeDoesNotPreempt: during a rollout the DaemonSet controller
// creates each node's new agent pod beside the old one, bound to the node
// by affinity, and the default scheduler places it. On a node whose CPU a
// workload requests in full, the new agent of the shipped manifests waits
// instead of preempting the workload; with system-node-critical, the usual
// class of node agents, the same pod evicts it.
func TestAgentSurgeDoesNotPreempt(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	cp, data := startInstalled(t, ctx)
	var template *v1.PodTemplateSpec
	for _, obj := range decodeAllObjects(t, data) {
		if ds, ok := obj.(*appsv1.DaemonSet); ok && ds.Name == "topodra-node-agent" {
			template = &ds.Spec.Template
		}
	}
	if template == nil {
		t.Fatal("no agent DaemonSet in the manifests")
	}
	stop, err := cp.StartScheduler(ctx, framework.SchedulerOptions{Name: v1.DefaultSchedulerName, Stock: true})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()

	for _, tc := range []struct {
		priorityClass string
		wantPreempted bool
	}{
		{priorityClass: template.Spec.PriorityClassName},
		{priorityClass: "system-node-critical", wantPreempted: true},
	} {
		t.Run(tc.priorityClass, func(t *testing.T) {
			node := "full-" + strings.ReplaceAll(tc.priorityClass, "-", "")
			if _, err := framework.CreateReadyNodeWithCPU(ctx, cp.Client, node, nil, "4"); err != nil {
				t.Fatal(err)
			}
			ns := metav1.NamespaceDefault
			workload := &v1.Pod{
				ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "trainer-" + node},
				Spec: v1.PodSpec{
					NodeSelector: map[string]string{"kubernetes.io/hostname": node},
					Containers: []v1.Container{{Name: "c", Image: "trainer", Resources: v1.ResourceRequirements{
						Requests: v1.ResourceList{v1.ResourceCPU: resource.MustParse("4")},
					}}},
				},
			}
			if _, err := cp.Client.CoreV1().Pods(ns).Create(ctx, workload, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			if _, err := framework.WaitForPodScheduled(ctx, cp.Client, ns, workload.Name, 30*time.Second); err != nil {
				t.Fatal(err)
			}

			// The surge pod as the DaemonSet controller makes it: the
			// template, bound to the node by a required affinity on its
			// name (the controller also adds tolerations the template
			// already has).
			agent := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: metav1.NamespaceSystem, Name: "agent-" + node, Labels: template.Labels}, Spec: *template.Spec.DeepCopy()}
			agent.Spec.PriorityClassName = tc.priorityClass
			agent.Spec.Priority, agent.Spec.PreemptionPolicy = nil, nil
			agent.Spec.Affinity = &v1.Affinity{NodeAffinity: &v1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &v1.NodeSelector{
				NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchFields: []v1.NodeSelectorRequirement{{
					Key: metav1.ObjectNameField, Operator: v1.NodeSelectorOpIn, Values: []string{node},
				}}}},
			}}}
			if _, err := cp.Client.CoreV1().Pods(metav1.NamespaceSystem).Create(ctx, agent, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			if _, err := framework.WaitForPodUnschedulable(ctx, cp.Client, metav1.NamespaceSystem, agent.Name, 30*time.Second); err != nil {
				t.Fatal(err)
			}
			// Preemption, where it happens, follows the failed attempt
			// at once: the victim is deleted (nothing runs it here, so
			// it goes at once) or marked.
			preempted := func() (bool, error) {
				p, err := cp.Client.CoreV1().Pods(ns).Get(ctx, workload.Name, metav1.GetOptions{})
				if apierrors.IsNotFound(err) {
					return true, nil
				}
				if err != nil {
					return false, err
				}
				if p.DeletionTimestamp != nil {
					return true, nil
				}
				for _, c := range p.Status.Conditions {
					if c.Type == v1.DisruptionTarget && c.Status == v1.ConditionTrue {
						return true, nil
					}
				}
				return false, nil
			}
			got := false
			_ = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 5*time.Second, true, func(ctx context.Context) (bool, error) {
				var err error
				got, err = preempted()
				return got, err
			})
			if got != tc.wantPreempted {
				t.Errorf("agent pod with priority class %s on a full node: workload preempted %v, want %v", tc.priorityClass, got, tc.wantPreempted)
			}
			if !tc.wantPreempted {
				p, err := cp.Client.CoreV1().Pods(metav1.NamespaceSystem).Get(ctx, agent.Name, metav1.GetOptions{})
				if err != nil {
					t.Fatal(err)
				}
				if p.Spec.NodeName != "" || p.Status.NominatedNodeName != "" {
					t.Errorf("agent pod bound to %q, nominated for %q; want it pending", p.Spec.NodeName, p.Status.NominatedNodeName)
				}
			}
		})
	}
}

// TestOptionalComponentsApply: the host overlay with every optional
// component is accepted by a real API server (the Prometheus operator's
// kinds left out: the server has no such CRDs), and so is a Job made from
// the checker's CronJob as `kubectl create job --from=cronjob/...` makes
// it; the checker's ServiceAccount reads everything topodra-check judges,
// and the metrics scraper's may get /metrics and nothing else.
func TestOptionalComponentsApply(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	cp := startCluster(t, ctx)
	data, err := manifests.RenderWithComponents("overlays/host", "components/invariant-check", "components/monitoring")
	if err != nil {
		t.Fatal(err)
	}
	skipped := 0
	if err := cp.Apply(ctx, data, func(obj *unstructured.Unstructured) bool {
		if obj.GroupVersionKind().Group == "monitoring.coreos.com" {
			skipped++
			return false
		}
		return true
	}); err != nil {
		t.Fatal(err)
	}
	if skipped == 0 {
		t.Error("no object of the Prometheus operator's kinds: the monitoring component was not rendered")
	}
	cron, err := cp.Client.BatchV1().CronJobs(metav1.NamespaceSystem).Get(ctx, "topodra-check", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	job := &batchv1.Job{
		ObjectMeta: metav1.ObjectMeta{Name: "topodra-check-manual", Namespace: cron.Namespace, Annotations: map[string]string{"cronjob.kubernetes.io/instantiate": "manual"}},
		Spec:       cron.Spec.JobTemplate.Spec,
	}
	if _, err := cp.Client.BatchV1().Jobs(job.Namespace).Create(ctx, job, metav1.CreateOptions{}); err != nil {
		t.Errorf("a Job from the CronJob's template: %v", err)
	}

	sa := cron.Spec.JobTemplate.Spec.Template.Spec.ServiceAccountName
	client, err := kubernetes.NewForConfig(impersonate(cp.Config, cron.Namespace, sa))
	if err != nil {
		t.Fatal(err)
	}
	opts := invariant.CheckOptions{Reads: 2, Interval: 10 * time.Millisecond}
	var report invariant.Report
	// RBAC's authorizer learns of the new binding from its informer.
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		var err error
		report, err = invariant.CheckWith(ctx, client, opts)
		return err == nil, nil
	}); err != nil {
		_, err := invariant.CheckWith(ctx, client, opts)
		t.Fatalf("the CronJob's ServiceAccount %s cannot read the cluster: %v", sa, err)
	}
	for _, why := range report.NotJudged {
		if strings.Contains(why, "forbidden") {
			t.Errorf("not judged for want of permission: %s", why)
		}
	}

	scraper := "system:serviceaccount:" + metav1.NamespaceSystem + ":topodra-metrics-scraper"
	allowed := func(attrs authorizationv1.SubjectAccessReviewSpec) bool {
		t.Helper()
		attrs.User = scraper
		attrs.Groups = []string{"system:serviceaccounts", "system:serviceaccounts:" + metav1.NamespaceSystem, "system:authenticated"}
		review, err := cp.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{Spec: attrs}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return review.Status.Allowed
	}
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return allowed(authorizationv1.SubjectAccessReviewSpec{NonResourceAttributes: &authorizationv1.NonResourceAttributes{Path: "/metrics", Verb: "get"}}), nil
	}); err != nil {
		t.Errorf("%s may not get /metrics", scraper)
	}
	if allowed(authorizationv1.SubjectAccessReviewSpec{ResourceAttributes: &authorizationv1.ResourceAttributes{Verb: "list", Resource: "pods"}}) {
		t.Errorf("%s may list pods", scraper)
	}
}
