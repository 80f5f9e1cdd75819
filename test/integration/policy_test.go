package integration

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/kubernetes/test/utils/ktesting"

	"github.com/topodra/topodra/config"
	"github.com/topodra/topodra/manifests"
	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// startOwnedCluster starts a control plane of its own (the policy and the
// DeviceTaintRules are cluster-wide) and applies the shipped ownership
// manifests: ConfigMap topodra-ownership, the DeviceTaintRule for the GPUs,
// the claim policy and the default-scheduler policy with their bindings.
func startOwnedCluster(t *testing.T, tCtx ktesting.TContext) *framework.ControlPlane {
	c, err := framework.Start(t)
	tCtx.ExpectNoError(err, "start control plane")
	_, err = c.Client.CoreV1().Namespaces().Create(tCtx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: metav1.NamespaceSystem}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		tCtx.ExpectNoError(err)
	}
	for _, file := range []string{"base/deviceclasses.yaml", "base/ownership.yaml", "base/admission-policy.yaml", "base/default-scheduler-policy.yaml"} {
		data, err := manifests.FS.ReadFile(file)
		tCtx.ExpectNoError(err)
		tCtx.ExpectNoError(c.Apply(tCtx, data, nil), "apply "+file)
	}
	return c
}

func toleration(key string, op resourceapi.DeviceTolerationOperator) resourceapi.DeviceToleration {
	t := resourceapi.DeviceToleration{Key: key, Operator: op}
	if op == resourceapi.DeviceTolerationOpEqual {
		t.Value = "x"
	}
	return t
}

// withEffect sets the effect of a toleration.
func withEffect(t resourceapi.DeviceToleration, effect resourceapi.DeviceTaintEffect) resourceapi.DeviceToleration {
	t.Effect = effect
	return t
}

// claimSpec returns a spec with one request; with firstAvailable the
// tolerations sit on the second subrequest.
func claimSpec(firstAvailable bool, tolerations ...resourceapi.DeviceToleration) resourceapi.ResourceClaimSpec {
	if firstAvailable {
		return resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "gpu",
			FirstAvailable: []resourceapi.DeviceSubRequest{
				{Name: "h100", DeviceClassName: "h100.gpu.topodra.io", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
				{Name: "any", DeviceClassName: topology.DriverName, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1, Tolerations: tolerations},
			},
		}}}}
	}
	return resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
		Name: "gpu",
		Exactly: &resourceapi.ExactDeviceRequest{
			DeviceClassName: topology.DriverName, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
			Tolerations: tolerations,
		},
	}}}}
}

// TestOwnedTaintPolicy applies the shipped admission policy to a real API
// server and checks what it refuses and admits, in claims and templates,
// with the shipped key and with another one written into the policy, and
// that it needs no ConfigMap to do so.
func TestOwnedTaintPolicy(t *testing.T) {
	tCtx := ktesting.Init(t)
	c := startOwnedCluster(t, tCtx)
	ns, err := framework.CreateNamespace(tCtx, c.Client, "policy")
	tCtx.ExpectNoError(err)

	n := 0
	create := func(template bool, spec resourceapi.ResourceClaimSpec) error {
		n++
		meta := metav1.ObjectMeta{Name: fmt.Sprintf("c-%d", n)}
		if template {
			_, err := c.Client.ResourceV1().ResourceClaimTemplates(ns).Create(tCtx, &resourceapi.ResourceClaimTemplate{
				ObjectMeta: meta, Spec: resourceapi.ResourceClaimTemplateSpec{Spec: spec},
			}, metav1.CreateOptions{})
			return err
		}
		_, err := c.Client.ResourceV1().ResourceClaims(ns).Create(tCtx, &resourceapi.ResourceClaim{ObjectMeta: meta, Spec: spec}, metav1.CreateOptions{})
		return err
	}
	// waitRefused polls until a claim tolerating key is refused: a policy
	// and a change of it take effect asynchronously.
	waitRefused := func(key string) {
		tCtx.Helper()
		err := wait.PollUntilContextTimeout(tCtx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			return create(false, claimSpec(false, toleration(key, resourceapi.DeviceTolerationOpExists))) != nil, nil
		})
		tCtx.ExpectNoError(err, "the policy never refused a toleration of "+key)
	}
	owned := topology.DefaultTaintKey
	other := "example.com/other-owner"
	type testCase struct {
		template, firstAvailable bool
		tolerations              []resourceapi.DeviceToleration
		noRequests               bool
		refused                  bool
		// says is what the refusal must say; "topodra-scheduler" where
		// empty. lacks is what it must not say.
		says, lacks string
	}
	devicePlugin := toleration(agent.DevicePluginTaintKey, resourceapi.DeviceTolerationOpExists)
	const disable = "ask the cluster admin to disable the device plugin on that node"
	const removeDriver = "ask the cluster admin to remove that driver from the node"
	const fabricManager = "ask the cluster admin to get the NVIDIA fabric manager running on that node"
	const resetGPUs = "ask the cluster admin to reset those GPUs"
	const computeDefault = "ask the cluster admin to set their compute mode back to Default"
	const emptyKeyHint = "a claim not meant for topodra's GPUs should name the keys of the taints it tolerates"

	cases := func(owned string) map[string]testCase {
		return map[string]testCase{
			"owned key, Exists":                     {tolerations: []resourceapi.DeviceToleration{toleration(owned, resourceapi.DeviceTolerationOpExists)}, refused: true, lacks: emptyKeyHint},
			"owned key, Equal":                      {tolerations: []resourceapi.DeviceToleration{toleration(owned, resourceapi.DeviceTolerationOpEqual)}, refused: true},
			"empty key, Exists":                     {tolerations: []resourceapi.DeviceToleration{toleration("", resourceapi.DeviceTolerationOpExists)}, refused: true, says: emptyKeyHint},
			"owned key after another":               {tolerations: []resourceapi.DeviceToleration{toleration("example.com/flaky", resourceapi.DeviceTolerationOpExists), toleration(owned, resourceapi.DeviceTolerationOpExists)}, refused: true},
			"owned key in firstAvailable":           {firstAvailable: true, tolerations: []resourceapi.DeviceToleration{toleration(owned, resourceapi.DeviceTolerationOpExists)}, refused: true},
			"empty key in firstAvailable":           {firstAvailable: true, tolerations: []resourceapi.DeviceToleration{toleration("", resourceapi.DeviceTolerationOpExists)}, refused: true, says: emptyKeyHint},
			"empty key, NoSchedule":                 {tolerations: []resourceapi.DeviceToleration{withEffect(toleration("", resourceapi.DeviceTolerationOpExists), resourceapi.DeviceTaintEffectNoSchedule)}, refused: true},
			"owned key, NoExecute":                  {tolerations: []resourceapi.DeviceToleration{withEffect(toleration(owned, resourceapi.DeviceTolerationOpExists), resourceapi.DeviceTaintEffectNoExecute)}, refused: true},
			"empty key, NoExecute":                  {tolerations: []resourceapi.DeviceToleration{withEffect(toleration("", resourceapi.DeviceTolerationOpExists), resourceapi.DeviceTaintEffectNoExecute)}},
			"empty key, NoExecute, firstAvailable":  {firstAvailable: true, tolerations: []resourceapi.DeviceToleration{withEffect(toleration("", resourceapi.DeviceTolerationOpExists), resourceapi.DeviceTaintEffectNoExecute)}},
			"template, owned key":                   {template: true, tolerations: []resourceapi.DeviceToleration{toleration(owned, resourceapi.DeviceTolerationOpExists)}, refused: true},
			"template, empty key in firstAvailable": {template: true, firstAvailable: true, tolerations: []resourceapi.DeviceToleration{toleration("", resourceapi.DeviceTolerationOpExists)}, refused: true, says: emptyKeyHint},
			"no tolerations":                        {},
			"no requests":                           {noRequests: true},
			"template, no requests":                 {template: true, noRequests: true},
			"other taint":                           {tolerations: []resourceapi.DeviceToleration{toleration("gpu.topodra.io/unhealthy", resourceapi.DeviceTolerationOpExists)}},
			"other taint in firstAvailable":         {firstAvailable: true, tolerations: []resourceapi.DeviceToleration{toleration("example.com/flaky", resourceapi.DeviceTolerationOpEqual)}},
			"template, other taint":                 {template: true, tolerations: []resourceapi.DeviceToleration{toleration("example.com/flaky", resourceapi.DeviceTolerationOpExists)}},
			"device-plugin key":                     {tolerations: []resourceapi.DeviceToleration{devicePlugin}, refused: true, says: disable},
			"device-plugin key, Equal":              {tolerations: []resourceapi.DeviceToleration{toleration(agent.DevicePluginTaintKey, resourceapi.DeviceTolerationOpEqual)}, refused: true, says: disable},
			"device-plugin key in firstAvailable":   {firstAvailable: true, tolerations: []resourceapi.DeviceToleration{toleration("example.com/flaky", resourceapi.DeviceTolerationOpExists), devicePlugin}, refused: true, says: disable},
			"template, device-plugin key":           {template: true, tolerations: []resourceapi.DeviceToleration{devicePlugin}, refused: true, says: disable},
			"other-driver key":                      {tolerations: []resourceapi.DeviceToleration{toleration(agent.OtherDriverTaintKey, resourceapi.DeviceTolerationOpExists)}, refused: true, says: removeDriver},
			"other-driver key in firstAvailable":    {firstAvailable: true, tolerations: []resourceapi.DeviceToleration{toleration("example.com/flaky", resourceapi.DeviceTolerationOpExists), toleration(agent.OtherDriverTaintKey, resourceapi.DeviceTolerationOpEqual)}, refused: true, says: removeDriver},
			"fabric key":                            {tolerations: []resourceapi.DeviceToleration{toleration(agent.FabricNotReadyTaintKey, resourceapi.DeviceTolerationOpExists)}, refused: true, says: fabricManager},
			"template, fabric key":                  {template: true, tolerations: []resourceapi.DeviceToleration{toleration(agent.FabricNotReadyTaintKey, resourceapi.DeviceTolerationOpExists)}, refused: true, says: fabricManager},
			"reset key":                             {tolerations: []resourceapi.DeviceToleration{toleration(agent.ResetRequiredTaintKey, resourceapi.DeviceTolerationOpExists)}, refused: true, says: resetGPUs},
			"reset key in firstAvailable, Equal":    {firstAvailable: true, tolerations: []resourceapi.DeviceToleration{toleration(agent.ResetRequiredTaintKey, resourceapi.DeviceTolerationOpEqual)}, refused: true, says: resetGPUs},
			"compute key":                           {tolerations: []resourceapi.DeviceToleration{toleration(agent.ComputeProhibitedTaintKey, resourceapi.DeviceTolerationOpExists)}, refused: true, says: computeDefault},
			"template, compute key":                 {template: true, tolerations: []resourceapi.DeviceToleration{toleration(agent.ComputeProhibitedTaintKey, resourceapi.DeviceTolerationOpExists)}, refused: true, says: computeDefault},
		}
	}
	run := func(owned string) {
		tCtx.Helper()
		for name, tc := range cases(owned) {
			spec := claimSpec(tc.firstAvailable, tc.tolerations...)
			if tc.noRequests {
				spec = resourceapi.ResourceClaimSpec{}
			}
			err := create(tc.template, spec)
			switch {
			case tc.refused && err == nil:
				t.Errorf("key %s, %s: admitted, want refused", owned, name)
			case tc.refused && !(apierrors.IsForbidden(err) || apierrors.IsInvalid(err)):
				t.Errorf("key %s, %s: refused with an unexpected error: %v", owned, name, err)
			case tc.refused && !strings.Contains(err.Error(), cmp.Or(tc.says, "topodra-scheduler")):
				t.Errorf("key %s, %s: the refusal does not tell the user what to do: %v", owned, name, err)
			case tc.refused && tc.lacks != "" && strings.Contains(err.Error(), tc.lacks):
				t.Errorf("key %s, %s: the refusal says %q, which does not apply: %v", owned, name, tc.lacks, err)
			case !tc.refused && err != nil:
				t.Errorf("key %s, %s: refused, want admitted: %v", owned, name, err)
			}
		}
	}

	waitRefused(owned)
	run(owned)
	// Admitted while the owned key is another one; they tolerate other,
	// and the second is protected by the allocation finalizer.
	preexisting, err := c.Client.ResourceV1().ResourceClaims(ns).Create(tCtx, &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "preexisting"}, Spec: claimSpec(false, toleration(other, resourceapi.DeviceTolerationOpExists)),
	}, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	protected, err := c.Client.ResourceV1().ResourceClaims(ns).Create(tCtx, &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "protected", Finalizers: []string{resourceapi.Finalizer}},
		Spec:       claimSpec(false, toleration(other, resourceapi.DeviceTolerationOpExists)),
	}, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)

	// writeStatus changes a claim's status the way a scheduler or a
	// driver does, through the status subresource.
	writeStatus := func(name string, change func(*resourceapi.ResourceClaim)) error {
		tCtx.Helper()
		claim, err := c.Client.ResourceV1().ResourceClaims(ns).Get(tCtx, name, metav1.GetOptions{})
		tCtx.ExpectNoError(err)
		change(claim)
		_, err = c.Client.ResourceV1().ResourceClaims(ns).UpdateStatus(tCtx, claim, metav1.UpdateOptions{})
		return err
	}
	allocate := func(claim *resourceapi.ResourceClaim) {
		claim.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
			Request: "gpu", Driver: topology.DriverName, Pool: "node", Device: "gpu-0",
		}}}}
	}
	// Allocations of claims without the owned key's toleration, and of
	// claims that tolerate another key, are admitted.
	_, err = c.Client.ResourceV1().ResourceClaims(ns).Create(tCtx, &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "status-write"}, Spec: claimSpec(false)}, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	tCtx.ExpectNoError(writeStatus("status-write", allocate), "allocation of a claim without tolerations")
	allocated, err := c.Client.ResourceV1().ResourceClaims(ns).Create(tCtx, &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "allocated", Finalizers: []string{resourceapi.Finalizer}},
		Spec:       claimSpec(false, toleration(other, resourceapi.DeviceTolerationOpExists)),
	}, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	tCtx.ExpectNoError(writeStatus(allocated.Name, allocate), "allocation of a claim tolerating another key")

	// The policy with another key, as kustomize writes it where the
	// ConfigMap names that key (manifests.TestOwnedKeyCopiedFromConfigMap).
	policy, err := manifests.FS.ReadFile("base/admission-policy.yaml")
	tCtx.ExpectNoError(err)
	literal := "'" + owned + "'"
	if !bytes.Contains(policy, []byte(literal)) {
		t.Fatalf("base/admission-policy.yaml does not hold the key as %s", literal)
	}
	tCtx.ExpectNoError(c.Apply(tCtx, bytes.ReplaceAll(policy, []byte(literal), []byte("'"+other+"'")), nil), "apply the policy with key "+other)
	waitRefused(other)
	run(other)
	if err := create(false, claimSpec(false, toleration(owned, resourceapi.DeviceTolerationOpExists))); err != nil {
		t.Errorf("with the key configured to %s, a toleration of %s is refused: %v", other, owned, err)
	}
	// A claim admitted before its toleration named the owned key: it may
	// change otherwise, but no scheduler may protect an allocation of it
	// (add the finalizer it writes before allocating).
	update := func(name string, change func(*resourceapi.ResourceClaim)) error {
		claim, err := c.Client.ResourceV1().ResourceClaims(ns).Get(tCtx, name, metav1.GetOptions{})
		tCtx.ExpectNoError(err)
		change(claim)
		_, err = c.Client.ResourceV1().ResourceClaims(ns).Update(tCtx, claim, metav1.UpdateOptions{})
		return err
	}
	addFinalizer := func(claim *resourceapi.ResourceClaim) {
		claim.Finalizers = append(claim.Finalizers, resourceapi.Finalizer)
	}
	if err := update(preexisting.Name, func(claim *resourceapi.ResourceClaim) { claim.Labels = map[string]string{"team": "a"} }); err != nil {
		t.Errorf("a label on a claim that tolerates the owned key: %v", err)
	}
	if err := update(preexisting.Name, addFinalizer); err == nil || !strings.Contains(err.Error(), "topodra-scheduler") {
		t.Errorf("the allocation finalizer on a claim that tolerates the owned key: %v, want refused", err)
	}
	if err := update("status-write", addFinalizer); err != nil {
		t.Errorf("the allocation finalizer on a claim without tolerations: %v", err)
	}
	// Nor may any scheduler allocate such a claim where it kept the
	// finalizer from before; its allocation from before can still be used
	// and given back.
	if err := writeStatus(protected.Name, allocate); err == nil || !strings.Contains(err.Error(), "topodra-scheduler") || !strings.Contains(err.Error(), "allocate it") {
		t.Errorf("an allocation of a claim that tolerates the owned key and kept the finalizer: %v, want refused", err)
	}
	if err := writeStatus(allocated.Name, func(claim *resourceapi.ResourceClaim) {
		claim.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: "user", UID: "1234"}}
	}); err != nil {
		t.Errorf("reserving an allocated claim that tolerates the owned key: %v", err)
	}
	if err := writeStatus(allocated.Name, func(claim *resourceapi.ResourceClaim) {
		claim.Status.ReservedFor = nil
		claim.Status.Allocation = nil
	}); err != nil {
		t.Errorf("deallocating a claim that tolerates the owned key: %v", err)
	}
	if err := writeStatus(allocated.Name, allocate); err == nil {
		t.Error("a claim that tolerates the owned key was allocated again after its deallocation")
	}
	if err := writeStatus("status-write", func(claim *resourceapi.ResourceClaim) { claim.Status.Allocation = nil }); err != nil {
		t.Errorf("deallocating a claim without tolerations: %v", err)
	}
	if err := writeStatus("status-write", allocate); err != nil {
		t.Errorf("allocating a claim without tolerations: %v", err)
	}
	if err := update(protected.Name, func(claim *resourceapi.ResourceClaim) { claim.Finalizers = nil }); err != nil {
		t.Errorf("the finalizer of a claim that tolerates the owned key cannot be removed: %v", err)
	}

	// The policy takes no parameter: without ConfigMap topodra-ownership
	// (deleted by hand, or first by `kubectl delete -k`) it goes on
	// checking claims, and admits those of other drivers.
	tCtx.ExpectNoError(c.Client.CoreV1().ConfigMaps(metav1.NamespaceSystem).Delete(tCtx, "topodra-ownership", metav1.DeleteOptions{}))
	// The API server's informer for parameters would see the deletion
	// within this time; a policy that read the ConfigMap would refuse.
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if err := create(false, claimSpec(false)); err != nil {
			t.Fatalf("without ConfigMap topodra-ownership, a claim without tolerations is refused: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err := create(false, claimSpec(false, toleration(other, resourceapi.DeviceTolerationOpExists))); err == nil {
		t.Error("without ConfigMap topodra-ownership, a claim tolerating the owned key was admitted")
	}
	if err := update(preexisting.Name, addFinalizer); err == nil {
		t.Error("without ConfigMap topodra-ownership, the allocation finalizer was added to a claim tolerating the owned key")
	}
	if err := writeStatus("status-write", func(claim *resourceapi.ResourceClaim) { claim.Status.Allocation = nil }); err != nil {
		t.Errorf("without ConfigMap topodra-ownership, a claim's allocation could not be given back: %v", err)
	}
	if err := writeStatus("status-write", allocate); err != nil {
		t.Errorf("without ConfigMap topodra-ownership, a claim without tolerations could not be allocated: %v", err)
	}

	// A claim that tolerated the device-plugin taint before the policy
	// refused it: no scheduler may allocate it.
	dpLiteral := "'" + agent.DevicePluginTaintKey + "'"
	if !bytes.Contains(policy, []byte(dpLiteral)) {
		t.Fatalf("base/admission-policy.yaml does not hold the device-plugin key as %s", dpLiteral)
	}
	tCtx.ExpectNoError(c.Apply(tCtx, bytes.ReplaceAll(policy, []byte(dpLiteral), []byte("'example.com/none'")), nil), "apply the policy without the device-plugin key")
	var before *resourceapi.ResourceClaim
	err = wait.PollUntilContextTimeout(tCtx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		before, err = c.Client.ResourceV1().ResourceClaims(ns).Create(tCtx, &resourceapi.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{Name: "device-plugin-before", Finalizers: []string{resourceapi.Finalizer}},
			Spec:       claimSpec(false, devicePlugin),
		}, metav1.CreateOptions{})
		return err == nil, nil
	})
	tCtx.ExpectNoError(err, "a claim tolerating the device-plugin key was never admitted by a policy without that key")
	tCtx.ExpectNoError(c.Apply(tCtx, policy, nil), "apply the shipped policy again")
	err = wait.PollUntilContextTimeout(tCtx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return create(false, claimSpec(false, devicePlugin)) != nil, nil
	})
	tCtx.ExpectNoError(err, "the shipped policy never refused the device-plugin key again")
	if err := writeStatus(before.Name, allocate); err == nil || !strings.Contains(err.Error(), "allocate it") || !strings.Contains(err.Error(), disable) {
		t.Errorf("an allocation of a claim that tolerates the device-plugin key: %v, want refused", err)
	}

	// Likewise a claim that tolerated the fabric taint before.
	fabric := toleration(agent.FabricNotReadyTaintKey, resourceapi.DeviceTolerationOpExists)
	fabricLiteral := "'" + agent.FabricNotReadyTaintKey + "'"
	if !bytes.Contains(policy, []byte(fabricLiteral)) {
		t.Fatalf("base/admission-policy.yaml does not hold the fabric key as %s", fabricLiteral)
	}
	tCtx.ExpectNoError(c.Apply(tCtx, bytes.ReplaceAll(policy, []byte(fabricLiteral), []byte("'example.com/none'")), nil), "apply the policy without the fabric key")
	err = wait.PollUntilContextTimeout(tCtx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		before, err = c.Client.ResourceV1().ResourceClaims(ns).Create(tCtx, &resourceapi.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{Name: "fabric-before", Finalizers: []string{resourceapi.Finalizer}},
			Spec:       claimSpec(false, fabric),
		}, metav1.CreateOptions{})
		return err == nil, nil
	})
	tCtx.ExpectNoError(err, "a claim tolerating the fabric key was never admitted by a policy without that key")
	tCtx.ExpectNoError(c.Apply(tCtx, policy, nil), "apply the shipped policy again")
	err = wait.PollUntilContextTimeout(tCtx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return create(false, claimSpec(false, fabric)) != nil, nil
	})
	tCtx.ExpectNoError(err, "the shipped policy never refused the fabric key again")
	if err := writeStatus(before.Name, allocate); err == nil || !strings.Contains(err.Error(), "allocate it") || !strings.Contains(err.Error(), fabricManager) {
		t.Errorf("an allocation of a claim that tolerates the fabric key: %v, want refused", err)
	}
}

// TestDefaultSchedulerMayNotAllocateGPUs: where the owned taint is missing
// (the API server drops device taints while DRADeviceTaints is off, or an
// agent runs without it), the shipped policy topodra-default-scheduler
// still keeps the default kube-scheduler, acting as its user
// system:kube-scheduler, from allocating topodra's GPUs: its pod stays
// pending with a condition that says which scheduler to use, and its claim
// stays unallocated. topodra-scheduler, beside it, places a pod on the
// same GPUs.
func TestDefaultSchedulerMayNotAllocateGPUs(t *testing.T) {
	tCtx := ktesting.Init(t)
	c, err := framework.Start(t)
	tCtx.ExpectNoError(err, "start control plane")
	_, err = c.Client.CoreV1().Namespaces().Create(tCtx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: metav1.NamespaceSystem}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		tCtx.ExpectNoError(err)
	}
	// No ownership.yaml: its DeviceTaintRule would taint the GPUs.
	for _, file := range []string{"base/deviceclasses.yaml", "base/admission-policy.yaml", "base/default-scheduler-policy.yaml"} {
		data, err := manifests.FS.ReadFile(file)
		tCtx.ExpectNoError(err)
		tCtx.ExpectNoError(c.Apply(tCtx, data, nil), "apply "+file)
	}
	ns, err := framework.CreateNamespace(tCtx, c.Client, "writer")
	tCtx.ExpectNoError(err)
	// The policy takes effect asynchronously: wait until it refuses the
	// default scheduler's user an allocation (a dry run).
	cfg := rest.CopyConfig(c.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: "system:kube-scheduler"}
	asDefault, err := kubernetes.NewForConfig(cfg)
	tCtx.ExpectNoError(err)
	probe, err := c.Client.ResourceV1().ResourceClaims(ns).Create(tCtx, &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "probe"}, Spec: claimSpec(false),
	}, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	probe.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
		Results: []resourceapi.DeviceRequestAllocationResult{{Request: "gpu", Driver: topology.DriverName, Pool: "gpu-node", Device: "gpu-0"}},
	}}
	err = wait.PollUntilContextTimeout(tCtx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := asDefault.ResourceV1().ResourceClaims(ns).UpdateStatus(ctx, probe, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
		return apierrors.IsForbidden(err), nil
	})
	tCtx.ExpectNoError(err, "the default-scheduler policy never took effect")
	_, err = framework.CreateReadyNode(tCtx, c.Client, "gpu-node", nil)
	tCtx.ExpectNoError(err)
	_, err = c.Client.ResourceV1().ResourceSlices().Create(tCtx, framework.SliceForNode("gpu-node", topology.DriverName, framework.DGXLikeGPUs("gpu-node")), metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	_, err = c.StartClaimController(tCtx)
	tCtx.ExpectNoError(err)
	_, err = c.StartScheduler(tCtx, framework.SchedulerOptions{Name: "default", Stock: true, User: "system:kube-scheduler"})
	tCtx.ExpectNoError(err)

	claimFor := func(name string) {
		_, err := c.Client.ResourceV1().ResourceClaims(ns).Create(tCtx, &resourceapi.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec:       claimSpec(false),
		}, metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
	}
	podFor := func(name, scheduler, claim string) {
		pod := framework.PodWithClaims(ns, name, scheduler)
		pod.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &claim}}
		_, err := c.Client.CoreV1().Pods(ns).Create(tCtx, pod, metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
	}
	claimFor("for-default")
	podFor("default", "default-scheduler", "for-default")
	_, err = framework.WaitForPod(tCtx, c.Client, ns, "default", waitTimeout, "refused by the policy", func(p *v1.Pod) (bool, error) {
		cond := framework.PodScheduledCondition(p)
		return cond != nil && strings.Contains(cond.Message, "set spec.schedulerName: topodra-scheduler"), nil
	})
	tCtx.ExpectNoError(err)
	claim, err := c.Client.ResourceV1().ResourceClaims(ns).Get(tCtx, "for-default", metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	if claim.Status.Allocation != nil {
		tCtx.Errorf("the default scheduler's claim got allocated: %+v", claim.Status.Allocation)
	}
	pod, err := c.Client.CoreV1().Pods(ns).Get(tCtx, "default", metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	if pod.Spec.NodeName != "" {
		tCtx.Errorf("the default scheduler's pod bound to %s", pod.Spec.NodeName)
	}

	_, err = c.StartScheduler(tCtx, framework.SchedulerOptions{Name: "topodra", Config: config.SchedulerConfig})
	tCtx.ExpectNoError(err)
	claimFor("for-topodra")
	podFor("topodra", topodraName, "for-topodra")
	_, err = framework.WaitForPodScheduled(tCtx, c.Client, ns, "topodra", waitTimeout)
	tCtx.ExpectNoError(err)
}
