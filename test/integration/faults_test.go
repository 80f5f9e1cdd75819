package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/kubernetes/test/utils/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/config"
	"github.com/topodra/topodra/pkg/invariant"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// The tests of this file inject one fault each and check three things: the
// scheduler keeps placing other pods, the invariant checker finds nothing
// in the test's namespace, and the user reads what went wrong on the pod
// or the claim.

// newFaultEnv is newEnv for a fault test: the test's pods are deleted when
// it ends, so that pods left failing on purpose do not keep later tests'
// schedulers busy.
func newFaultEnv(tCtx ktesting.TContext, prefix string) *env {
	e := newEnv(tCtx, prefix)
	tCtx.Cleanup(func() {
		ctx := context.WithoutCancel(tCtx)
		if err := cp.Client.CoreV1().Pods(e.ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}, metav1.ListOptions{}); err != nil {
			tCtx.Logf("delete the test's pods: %v", err)
		}
	})
	return e
}

// expectClean fails the test for every invariant violation that involves
// the test's namespace (other tests share the cluster).
func (e *env) expectClean() {
	e.tCtx.Helper()
	violations, err := invariant.Check(e.tCtx, cp.Client)
	e.tCtx.ExpectNoError(err, "invariant check")
	for _, v := range violations {
		mine := strings.HasPrefix(v.Pod, e.ns+"/")
		for _, c := range v.Claims {
			mine = mine || strings.HasPrefix(c, e.ns+"/")
		}
		if mine {
			e.tCtx.Errorf("invariant violated: %s", v)
		}
	}
}

// waitEvent waits for an event with reason on the named object of the
// test's namespace whose note contains all of parts, and returns the note.
func (e *env) waitEvent(object, reason string, parts ...string) string {
	e.tCtx.Helper()
	var note, seen string
	err := wait.PollUntilContextTimeout(e.tCtx, framework.PollInterval, waitTimeout, true, func(ctx context.Context) (bool, error) {
		events, err := cp.Client.EventsV1().Events(e.ns).List(ctx, metav1.ListOptions{FieldSelector: "regarding.name=" + object})
		if err != nil {
			return false, nil
		}
		for _, ev := range events.Items {
			if ev.Reason != reason {
				continue
			}
			seen = ev.Note
			ok := true
			for _, p := range parts {
				ok = ok && strings.Contains(ev.Note, p)
			}
			if ok {
				note = ev.Note
				return true, nil
			}
		}
		return false, nil
	})
	e.tCtx.ExpectNoError(err, fmt.Sprintf("%s event on %s containing %q (last %s event: %q)", reason, object, parts, reason, seen))
	return note
}

// claimOf returns the name of the one claim of a pod (generated claims are
// named in the pod status once the claim controller created them).
func (e *env) claimOf(podName string) string {
	e.tCtx.Helper()
	var name string
	_, err := framework.WaitForPod(e.tCtx, cp.Client, e.ns, podName, waitTimeout, "claim created", func(p *v1.Pod) (bool, error) {
		claims, err := framework.PodClaims(e.tCtx, cp.Client, p)
		if err != nil || len(claims) != 1 {
			return false, nil
		}
		name = claims[0].Name
		return true, nil
	})
	e.tCtx.ExpectNoError(err)
	return name
}

// selectorTemplate creates a template with one request for one GPU with
// the CEL selector and returns the error of the create.
func (e *env) selectorTemplate(name, class, expression string) error {
	tmpl := framework.ClaimTemplate(e.ns, name, class, 1)
	tmpl.Spec.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: expression}}}
	_, err := cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(e.tCtx, tmpl, metav1.CreateOptions{})
	return err
}

// expectScheduledAll waits until each named pod is bound and its claims are
// allocated on its node and reserved for it.
func (e *env) expectScheduledAll(names ...string) {
	e.tCtx.Helper()
	for _, name := range names {
		e.devicesOf(e.waitScheduled(name))
	}
}

// TestBadCELDoesNotBlockOthers: CEL selectors that are broken in four ways,
// each in a claim of its own pod, while good pods keep arriving.
//
// A syntax error and an expression over the cost limit never reach a
// scheduler: the apiserver refuses them, naming the field (that is where
// the user sees them). A runtime type error and a selector on an attribute
// that no device has fail at run time on every device: such pods fail
// their cycle with the request and the expression named on the pod and a
// warning event on the claim, and are retried with backoff. The same
// missing attribute guarded with has() is no error: the pod is just
// unschedulable, saying that no device matches. Good pods created before
// and after the bad ones are all placed.
func TestBadCELDoesNotBlockOthers(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newFaultEnv(tCtx, "badcel4")
	e.dgxNodes("a", 2, "256")
	one := e.template(1, nil)

	refused := map[string]struct{ expression, want string }{
		"syntax": {`device.attributes["gpu.topodra.io"].index >`, "compilation failed"},
		"cost": {`[1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(x, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(y, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z3, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z4, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z5, int('1'.find('[0-9]*')) < 100)))))))`,
			"too complex, exceeds cost limit"},
	}
	for name, c := range refused {
		err := e.selectorTemplate(name, e.class, c.expression)
		switch {
		case err == nil:
			t.Errorf("%s: the apiserver accepted the selector %q", name, c.expression)
		case !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "spec.spec.devices.requests[0].exactly.selectors[0].cel.expression") || !strings.Contains(err.Error(), c.want):
			t.Errorf("%s: the apiserver refused the template with %q, want an Invalid error naming the field and %q", name, err, c.want)
		default:
			t.Logf("%s: refused by the apiserver: %v", name, err)
		}
	}

	failing := map[string]struct{ expression, want string }{
		"type-error":        {`device.attributes["gpu.topodra.io"].productName > 3`, "no such overload"},
		"missing-attribute": {`device.attributes["gpu.topodra.io"].vendorSKU == "sxm5"`, "no such key: vendorSKU (the device's attribute domains: gpu.topodra.io"},
	}
	for name, c := range failing {
		tCtx.ExpectNoError(e.selectorTemplate(name, e.class, c.expression), "template "+name)
	}
	const guarded = `has(device.attributes["gpu.topodra.io"].vendorSKU) && device.attributes["gpu.topodra.io"].vendorSKU == "sxm5"`
	tCtx.ExpectNoError(e.selectorTemplate("guarded", e.class, guarded))
	startTopodra(tCtx)

	e.pod("good-0", topodraName, "a", one)
	e.pod("good-1", topodraName, "a", one)
	for name := range failing {
		e.pod(name, topodraName, "a", name)
	}
	e.pod("guarded", topodraName, "a", "guarded")
	for i := 2; i < 8; i++ {
		e.pod(fmt.Sprintf("good-%d", i), topodraName, "a", one)
	}

	var good []string
	for i := range 8 {
		good = append(good, fmt.Sprintf("good-%d", i))
	}
	e.expectScheduledAll(good...)

	for name, c := range failing {
		pod := e.waitFailed(name)
		cond := framework.PodScheduledCondition(pod)
		t.Logf("%s: pod condition %s: %s", name, cond.Reason, cond.Message)
		for _, part := range []string{c.expression, "req-0", c.want} {
			if !strings.Contains(cond.Message, part) {
				t.Errorf("%s: pod condition %q does not contain %q", name, cond.Message, part)
			}
		}
		claim := e.claimOf(name)
		note := e.waitEvent(claim, "InvalidClaim", c.expression)
		t.Logf("%s: claim event: %s", name, note)
	}
	pod, err := framework.WaitForPodUnschedulable(tCtx, cp.Client, e.ns, "guarded", waitTimeout)
	tCtx.ExpectNoError(err)
	if msg := framework.PodScheduledCondition(pod).Message; strings.Contains(msg, "no such key") {
		t.Errorf("the has()-guarded selector failed like an unguarded one: %q", msg)
	} else {
		t.Logf("guarded: %s", msg)
	}

	// Still serving after the bad pods went through several attempts.
	e.pod("good-late", topodraName, "a", one)
	e.expectScheduledAll("good-late")
	e.expectClean()
}

// TestMissingClassThenCreated: a claim names a DeviceClass that does not
// exist yet. The pod stays pending and says which class is missing, the
// claim gets a warning event, other pods are placed. Creating the class
// requeues the pod (DeviceClass add event), and the same pod — not a new
// one — is scheduled.
func TestMissingClassThenCreated(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newFaultEnv(tCtx, "lateclass")
	e.dgxNodes("a", 1, "256")
	late := e.ns + "-late"
	_, err := cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(tCtx, framework.ClaimTemplate(e.ns, "late", late, 2), metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	one := e.template(1, nil)
	startTopodra(tCtx)

	waiting := e.pod("waiting", topodraName, "a", "late")
	e.pod("other", topodraName, "a", one)
	pod := e.waitFailed("waiting")
	msg := framework.PodScheduledCondition(pod).Message
	want := "device class " + late + " does not exist"
	if !strings.Contains(msg, want) || !strings.Contains(msg, "req-0") {
		t.Errorf("pod condition %q does not say %q for request req-0", msg, want)
	}
	e.waitEvent(e.claimOf("waiting"), "InvalidClaim", want)
	e.expectScheduledAll("other")

	_, err = cp.Client.ResourceV1().DeviceClasses().Create(tCtx, framework.DeviceClass(late, topology.DriverName), metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	pod = e.waitScheduled("waiting")
	if pod.UID != waiting.UID {
		t.Errorf("pod was recreated (uid %s, was %s)", pod.UID, waiting.UID)
	}
	if devices := e.devicesOf(pod); len(devices) != 2 {
		t.Errorf("pod got %v, want 2 GPUs", devices)
	}
	e.expectClean()
}

// bindingConditionNode creates a node in group whose eight GPUs have the
// binding condition "Attached" (and failure condition "AttachFailed"): a
// pod placed there waits in PreBind, its claim allocated and reserved,
// until the test confirms the devices. Returns the node and its slice.
func (e *env) bindingConditionNode(group string) (string, *resourceapi.ResourceSlice) {
	e.tCtx.Helper()
	node := fmt.Sprintf("%s-%s-0", e.ns, group)
	_, err := framework.CreateReadyNode(e.tCtx, cp.Client, node, map[string]string{"test": e.ns, "group": group})
	e.tCtx.ExpectNoError(err)
	slice := framework.SliceForNode(node, topology.DriverName, framework.DGXLikeGPUs(node))
	for i := range slice.Spec.Devices {
		slice.Spec.Devices[i].BindsToNode = ptr.To(true)
		slice.Spec.Devices[i].BindingConditions = []string{"Attached"}
		slice.Spec.Devices[i].BindingFailureConditions = []string{"AttachFailed"}
	}
	slice, err = cp.Client.ResourceV1().ResourceSlices().Create(e.tCtx, slice, metav1.CreateOptions{})
	e.tCtx.ExpectNoError(err)
	return node, slice
}

// attach sets the binding condition of every allocated device of the claim,
// as the driver does once the devices are attached.
func (e *env) attach(claimName string) {
	e.tCtx.Helper()
	claim, err := cp.Client.ResourceV1().ResourceClaims(e.ns).Get(e.tCtx, claimName, metav1.GetOptions{})
	e.tCtx.ExpectNoError(err)
	claim.Status.Devices = nil
	for _, r := range claim.Status.Allocation.Devices.Results {
		st := resourceapi.AllocatedDeviceStatus{Driver: r.Driver, Pool: r.Pool, Device: r.Device}
		apimeta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: "Attached", Status: metav1.ConditionTrue, Reason: "Attached", ObservedGeneration: claim.Generation})
		claim.Status.Devices = append(claim.Status.Devices, st)
	}
	_, err = cp.Client.ResourceV1().ResourceClaims(e.ns).UpdateStatus(e.tCtx, claim, metav1.UpdateOptions{})
	e.tCtx.ExpectNoError(err)
}

// standaloneClaim creates a claim named name for count GPUs of the test's
// class.
func (e *env) standaloneClaim(name string, count int64) *resourceapi.ResourceClaim {
	e.tCtx.Helper()
	tmpl := framework.ClaimTemplate(e.ns, name, e.class, count)
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}, Spec: tmpl.Spec.Spec}
	created, err := cp.Client.ResourceV1().ResourceClaims(e.ns).Create(e.tCtx, claim, metav1.CreateOptions{})
	e.tCtx.ExpectNoError(err)
	return created
}

// podWithClaim creates a pod in group that uses the named claim.
func (e *env) podWithClaim(name, group, claim string) *v1.Pod {
	e.tCtx.Helper()
	pod := framework.PodWithClaims(e.ns, name, topodraName)
	pod.Spec.NodeSelector = map[string]string{"test": e.ns, "group": group}
	pod.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpus", ResourceClaimName: ptr.To(claim)}}
	pod.Spec.Containers[0].Resources.Claims = []v1.ResourceClaim{{Name: "gpus"}}
	created, err := cp.Client.CoreV1().Pods(e.ns).Create(e.tCtx, pod, metav1.CreateOptions{})
	e.tCtx.ExpectNoError(err)
	return created
}

// waitClaimGone waits until the claim no longer exists.
func (e *env) waitClaimGone(name string) {
	e.tCtx.Helper()
	var last *resourceapi.ResourceClaim
	err := wait.PollUntilContextTimeout(e.tCtx, framework.PollInterval, waitTimeout, true, func(ctx context.Context) (bool, error) {
		claim, err := cp.Client.ResourceV1().ResourceClaims(e.ns).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		if err == nil {
			last = claim
		}
		return false, nil
	})
	if err != nil {
		e.tCtx.Fatalf("claim %s not gone: %v; last: finalizers %v, reservedFor %v, allocated %v", name, err, last.Finalizers, last.Status.ReservedFor, last.Status.Allocation != nil)
	}
}

// TestClaimDeletedMidCycle: the claim of a pod is deleted while the pod
// waits in PreBind (allocation and reservation written, binding conditions
// pending). The pod must not be bound with a claim that is going away:
// PreBind fails saying so, Unreserve takes the pod out of reservedFor, and
// the claim controller can then deallocate the claim and let it go. Other
// pods keep being placed, on the same devices too. A new claim of the same
// name is then allocated for the waiting pod, which binds.
func TestClaimDeletedMidCycle(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newFaultEnv(tCtx, "claimgone")
	e.bindingConditionNode("a")
	e.dgxNodes("b", 1, "256")
	one := e.template(1, nil)
	e.standaloneClaim("mine", 8)
	startTopodra(tCtx)

	e.podWithClaim("victim", "a", "mine")
	claim := e.waitReserved("victim", nil)
	t.Logf("claim %s allocated %v; pod waits in PreBind; deleting the claim", claim.Name, framework.AllocatedDevices(claim))
	tCtx.ExpectNoError(cp.Client.ResourceV1().ResourceClaims(e.ns).Delete(tCtx, "mine", metav1.DeleteOptions{}))

	e.waitClaimGone("mine")
	pod, err := cp.Client.CoreV1().Pods(e.ns).Get(tCtx, "victim", metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	if pod.Spec.NodeName != "" {
		t.Fatalf("pod bound to %s with a deleted claim", pod.Spec.NodeName)
	}
	pod = e.waitFailed("victim")
	cond := framework.PodScheduledCondition(pod)
	t.Logf("pod condition %s: %s", cond.Reason, cond.Message)
	if !strings.Contains(cond.Message, "mine") || !strings.Contains(cond.Message, "deleted") {
		t.Errorf("pod condition %q does not say that claim mine is being deleted", cond.Message)
	}

	// The devices are free again: another pod takes all eight.
	e.standaloneClaim("next", 8)
	e.podWithClaim("next", "a", "next")
	next := e.waitReserved("next", nil)
	e.attach(next.Name)
	e.expectScheduledAll("next")
	// Elsewhere, scheduling went on.
	e.pod("other", topodraName, "b", one)
	e.expectScheduledAll("other")

	// The victim waits for a claim of its claim's name. Once "next" is done
	// (the claim controller deallocates its claim), a new "mine" is
	// allocated the eight devices and the victim binds with it.
	tCtx.ExpectNoError(cp.Client.CoreV1().Pods(e.ns).Delete(tCtx, "next", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	e.standaloneClaim("mine", 8)
	claim = e.waitReserved("victim", nil)
	e.attach(claim.Name)
	e.expectScheduledAll("victim")
	e.expectClean()
}

// TestDeviceVanishesBeforeBind: the driver stops publishing the device that
// a waiting pod's claim was allocated (binding conditions pending, so the
// pod waits in PreBind). The pod must not be bound with it: PreBind gives
// up, the next attempt deallocates the claim (as for a failed binding) and
// allocates a device that exists. When the whole slice goes away, the
// claim is deallocated and the pod waits, saying why. Meanwhile pods on
// other nodes are placed, and in the end no allocation names a vanished
// device.
func TestDeviceVanishesBeforeBind(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newFaultEnv(tCtx, "vanish")
	_, slice := e.bindingConditionNode("a")
	_, sliceC := e.bindingConditionNode("c")
	e.dgxNodes("b", 1, "256")
	one := e.template(1, nil)
	startTopodra(tCtx)

	// The chosen device vanishes in a new generation of the pool.
	e.pod("job", topodraName, "a", one)
	claim := e.waitReserved("job", nil)
	gone := framework.AllocatedDevices(claim)[0]
	t.Logf("claim %s allocated %s; the driver publishes generation 2 without it", claim.Name, gone)
	slice.Spec.Pool.Generation++
	slice.Spec.Devices = slices.DeleteFunc(slice.Spec.Devices, func(d resourceapi.Device) bool { return d.Name == gone })
	_, err := cp.Client.ResourceV1().ResourceSlices().Update(tCtx, slice, metav1.UpdateOptions{})
	tCtx.ExpectNoError(err)
	note := e.waitEvent("job", "FailedScheduling", gone, "no longer exists")
	t.Logf("pod event: %s", note)
	claim = e.waitReserved("job", func(c *resourceapi.ResourceClaim) bool { return framework.AllocatedDevices(c)[0] != gone })
	t.Logf("reallocated to %v", framework.AllocatedDevices(claim))
	e.attach(claim.Name)
	if devices := e.devicesOf(e.waitScheduled("job")); len(devices) != 1 || devices[0] == gone {
		t.Errorf("pod bound with %v, want one device other than %s", devices, gone)
	}

	// The whole slice of another node goes away while a second pod waits
	// there.
	e.pod("job2", topodraName, "c", one)
	claim = e.waitReserved("job2", nil)
	t.Logf("claim %s allocated %v; the driver deletes its slice", claim.Name, framework.AllocatedDevices(claim))
	tCtx.ExpectNoError(cp.Client.ResourceV1().ResourceSlices().Delete(tCtx, sliceC.Name, metav1.DeleteOptions{}))
	e.waitEvent("job2", "FailedScheduling", "no longer exists")
	err = wait.PollUntilContextTimeout(tCtx, framework.PollInterval, waitTimeout, true, func(ctx context.Context) (bool, error) {
		c, err := cp.Client.ResourceV1().ResourceClaims(e.ns).Get(ctx, claim.Name, metav1.GetOptions{})
		return err == nil && c.Status.Allocation == nil, nil
	})
	tCtx.ExpectNoError(err, "claim of job2 deallocated")
	pod, err := framework.WaitForPodUnschedulable(tCtx, cp.Client, e.ns, "job2", waitTimeout)
	tCtx.ExpectNoError(err)
	t.Logf("job2: %s", framework.PodScheduledCondition(pod).Message)

	e.pod("other", topodraName, "b", one)
	e.expectScheduledAll("other")
	e.expectClean()
}

// concurrentWriter is a validating admission webhook on ResourceClaim
// status updates in one namespace. The first time a target claim's status
// update adds a reservation (the scheduler's PreBind), it runs write for
// that claim before it answers, and lets the update through if write says
// so. When write changes the claim, the scheduler's update was read before
// that change, so the apiserver refuses it with a resourceVersion
// conflict: the conflict is deterministic.
type concurrentWriter struct {
	e *env
	// write acts on the claim (one of targets) as it was before the
	// update, and returns whether to allow the update.
	write   func(ctx context.Context, claim *resourceapi.ResourceClaim) (allow bool)
	targets []string

	mu sync.Mutex
	// interfered are the claims written to so far.
	interfered map[string]bool
	// reservations counts the status updates that add a reservation, per
	// claim, as the webhook saw them (a conflicted one included).
	reservations map[string]int
	probed       bool
}

func (w *concurrentWriter) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	review := &admissionv1.AdmissionReview{}
	if err := json.NewDecoder(r.Body).Decode(review); err != nil {
		http.Error(rw, err.Error(), http.StatusBadRequest)
		return
	}
	var oldClaim, newClaim resourceapi.ResourceClaim
	if err := json.Unmarshal(review.Request.Object.Raw, &newClaim); err != nil {
		http.Error(rw, err.Error(), http.StatusBadRequest)
		return
	}
	_ = json.Unmarshal(review.Request.OldObject.Raw, &oldClaim)
	interfere := false
	w.mu.Lock()
	if newClaim.Name == "probe" {
		w.probed = true
	}
	if len(newClaim.Status.ReservedFor) > len(oldClaim.Status.ReservedFor) {
		w.reservations[newClaim.Name]++
		if slices.Contains(w.targets, newClaim.Name) && !w.interfered[newClaim.Name] {
			w.interfered[newClaim.Name] = true
			interfere = true
		}
	}
	w.mu.Unlock()
	response := &admissionv1.AdmissionResponse{UID: review.Request.UID, Allowed: true}
	if interfere && !w.write(r.Context(), &oldClaim) {
		response.Allowed = false
		response.Result = &metav1.Status{Message: "refused by the test's webhook"}
	}
	review.Response = response
	review.Request = nil
	_ = json.NewEncoder(rw).Encode(review)
}

// start serves the webhook, registers it for the test's namespace and
// waits until the apiserver calls it.
func (w *concurrentWriter) start() {
	tCtx := w.e.tCtx
	w.interfered, w.reservations = map[string]bool{}, map[string]int{}
	srv := httptest.NewUnstartedServer(w)
	srv.StartTLS()
	tCtx.Cleanup(srv.Close)
	caBundle := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	name := w.e.ns + "-concurrent-writer"
	config := &admissionregistrationv1.ValidatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Webhooks: []admissionregistrationv1.ValidatingWebhook{{
			Name:         "concurrent-writer.topodra.io",
			ClientConfig: admissionregistrationv1.WebhookClientConfig{URL: ptr.To(srv.URL + "/"), CABundle: caBundle},
			Rules: []admissionregistrationv1.RuleWithOperations{{
				Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Update},
				Rule:       admissionregistrationv1.Rule{APIGroups: []string{resourceapi.GroupName}, APIVersions: []string{"v1"}, Resources: []string{"resourceclaims/status"}},
			}},
			NamespaceSelector:       &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": w.e.ns}},
			SideEffects:             ptr.To(admissionregistrationv1.SideEffectClassNone),
			AdmissionReviewVersions: []string{"v1"},
			FailurePolicy:           ptr.To(admissionregistrationv1.Fail),
		}},
	}
	_, err := cp.Client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Create(tCtx, config, metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	tCtx.Cleanup(func() {
		_ = cp.Client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Delete(context.WithoutCancel(tCtx), name, metav1.DeleteOptions{})
	})
	// The apiserver picks the configuration up asynchronously: update a
	// probe claim's status until the webhook sees it.
	w.e.standaloneClaim("probe", 1)
	err = wait.PollUntilContextTimeout(tCtx, framework.PollInterval, waitTimeout, true, func(ctx context.Context) (bool, error) {
		probe, err := cp.Client.ResourceV1().ResourceClaims(w.e.ns).Get(ctx, "probe", metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		probe.Status.Devices = nil
		if _, err := cp.Client.ResourceV1().ResourceClaims(w.e.ns).UpdateStatus(ctx, probe, metav1.UpdateOptions{}); err != nil {
			return false, nil
		}
		w.mu.Lock()
		defer w.mu.Unlock()
		return w.probed, nil
	})
	tCtx.ExpectNoError(err, "webhook active")
}

// TestConflictingClaimWrite: another writer changes a claim between
// topodra's read and its status write in PreBind, so the write fails with a
// resourceVersion conflict (deterministically, see concurrentWriter).
//
//   - The other writer only labels the claim: topodra writes again on the
//     latest claim; the pod is bound, the label is kept.
//   - The other writer allocates the claim itself (another scheduler, say)
//     on a free device: topodra must not overwrite that allocation; the
//     pod ends up using the other writer's device, and no device is
//     allocated twice.
func TestConflictingClaimWrite(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newFaultEnv(tCtx, "conflict")
	nodes := e.dgxNodes("a", 1, "256")
	e.dgxNodes("b", 1, "256")
	one := e.template(1, nil)
	w := &concurrentWriter{e: e, targets: []string{"labelled", "stolen"}}
	// steal labels claim "labelled" and allocates claim "stolen".
	steal := func(ctx context.Context, claim *resourceapi.ResourceClaim) error {
		claims := cp.Client.ResourceV1().ResourceClaims(claim.Namespace)
		if claim.Name == "labelled" {
			_, err := claims.Patch(ctx, claim.Name, types.MergePatchType, []byte(`{"metadata":{"labels":{"fault":"concurrent-writer"}}}`), metav1.PatchOptions{})
			return err
		}
		// Allocate gpu-7 of node a, as another scheduler would have.
		latest, err := claims.Get(ctx, claim.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		latest.Status.Allocation = &resourceapi.AllocationResult{
			Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
				Request: "req-0", Driver: topology.DriverName, Pool: nodes[0], Device: "gpu-7",
			}}},
			NodeSelector: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{
				MatchFields: []v1.NodeSelectorRequirement{{Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{nodes[0]}}},
			}}},
		}
		_, err = claims.UpdateStatus(ctx, latest, metav1.UpdateOptions{})
		return err
	}
	w.write = func(ctx context.Context, claim *resourceapi.ResourceClaim) bool {
		if err := steal(ctx, claim); err != nil {
			t.Errorf("concurrent writer on claim %s: %v", claim.Name, err)
		}
		return true
	}
	w.start()
	e.standaloneClaim("labelled", 1)
	e.standaloneClaim("stolen", 1)
	startTopodra(tCtx)

	e.podWithClaim("labelled", "a", "labelled")
	pod := e.waitScheduled("labelled")
	e.devicesOf(pod)
	claim, err := cp.Client.ResourceV1().ResourceClaims(e.ns).Get(tCtx, "labelled", metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	if claim.Labels["fault"] != "concurrent-writer" {
		t.Errorf("the other writer's label is gone: %v", claim.Labels)
	}

	e.podWithClaim("stolen", "a", "stolen")
	pod = e.waitScheduled("stolen")
	if devices := e.devicesOf(pod); len(devices) != 1 || devices[0] != "gpu-7" {
		t.Errorf("pod uses %v, want the other writer's gpu-7", devices)
	}
	t.Logf("pod event: %s", e.waitEvent("stolen", "FailedScheduling", "claim stolen was allocated by someone else"))

	w.mu.Lock()
	for _, name := range []string{"labelled", "stolen"} {
		if !w.interfered[name] || w.reservations[name] < 2 {
			t.Errorf("claim %s: interfered %v, %d reservation writes seen; want the conflicted write and another one", name, w.interfered[name], w.reservations[name])
		}
	}
	w.mu.Unlock()
	e.pod("other", topodraName, "b", one)
	e.expectScheduledAll("other")
	e.expectClean()
}

// TestAPIServerRestart stops the kube-apiserver while topodra is placing a
// wave of pods (as soon as the wave's first claim is allocated) and starts
// it again on the same etcd, three waves in a row. topodra (its clients
// unchanged) must bind every pod, each with its claims allocated on its
// node and reserved for it, no allocated claim may be left without its
// pod, and the invariant checker must find nothing. The API server drains
// the requests in flight as it stops, so a wave can be placed completely
// before it is down; the test fails unless some pod was bound only after
// a restart.
func TestAPIServerRestart(t *testing.T) {
	tCtx := ktesting.Init(t)
	c, err := framework.Start(t)
	tCtx.ExpectNoError(err, "start a control plane of its own")
	_, err = c.StartClaimController(tCtx)
	tCtx.ExpectNoError(err)
	ns, err := framework.CreateNamespace(tCtx, c.Client, "apirestart")
	tCtx.ExpectNoError(err)
	_, err = c.Client.ResourceV1().DeviceClasses().Create(tCtx, framework.DeviceClass("gpu", topology.DriverName), metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	for i := range 6 {
		name := fmt.Sprintf("node-%d", i)
		_, err := framework.CreateReadyNode(tCtx, c.Client, name, nil)
		tCtx.ExpectNoError(err)
		_, err = c.Client.ResourceV1().ResourceSlices().Create(tCtx, framework.SliceForNode(name, topology.DriverName, framework.DGXLikeGPUs(name)), metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
	}
	for _, count := range []int64{1, 2} {
		_, err := c.Client.ResourceV1().ResourceClaimTemplates(ns).Create(tCtx, framework.ClaimTemplate(ns, fmt.Sprintf("gpus-%d", count), "gpu", count), metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
	}
	stop, err := c.StartScheduler(tCtx, framework.SchedulerOptions{Name: "topodra", Config: config.SchedulerConfig})
	tCtx.ExpectNoError(err)
	t.Cleanup(stop)

	// 30 pods of 1 and 2 GPUs: 45 of the 48 GPUs, so all fit.
	var names []string
	wave := func(w int) {
		for i := range 10 {
			name := fmt.Sprintf("w%d-%d", w, i)
			_, err := c.Client.CoreV1().Pods(ns).Create(tCtx, framework.PodWithClaims(ns, name, topodraName, fmt.Sprintf("gpus-%d", 1+i%2)), metav1.CreateOptions{})
			tCtx.ExpectNoError(err, "create pod "+name)
			names = append(names, name)
		}
	}
	// stoppedAt are the times the API server was stopped, by wave.
	var stoppedAt []time.Time
	for w := range 3 {
		watcher, err := c.Client.ResourceV1().ResourceClaims(ns).Watch(tCtx, metav1.ListOptions{})
		tCtx.ExpectNoError(err)
		wave(w)
		allocated := false
		for ev := range watcher.ResultChan() {
			if claim, ok := ev.Object.(*resourceapi.ResourceClaim); ok && claim.Status.Allocation != nil && strings.HasPrefix(claim.Name, fmt.Sprintf("w%d-", w)) {
				allocated = true
				break
			}
		}
		watcher.Stop()
		if !allocated {
			t.Fatalf("the claim watch ended before a claim of wave %d was allocated", w)
		}
		stoppedAt = append(stoppedAt, time.Now())
		c.StopAPIServer()
		t.Logf("kube-apiserver stopped while wave %d was being placed", w)
		tCtx.ExpectNoError(c.StartAPIServer(tCtx), "start the kube-apiserver again")
		t.Log("kube-apiserver started again on the same etcd")
	}

	bound := map[types.UID]*v1.Pod{}
	for _, name := range names {
		pod, err := framework.WaitForPodScheduled(tCtx, c.Client, ns, name, waitTimeout)
		tCtx.ExpectNoError(err)
		bound[pod.UID] = pod
	}
	claims, err := c.Client.ResourceV1().ResourceClaims(ns).List(tCtx, metav1.ListOptions{})
	tCtx.ExpectNoError(err)
	allocated := 0
	for _, claim := range claims.Items {
		if claim.Status.Allocation == nil {
			continue
		}
		allocated++
		if len(claim.Status.ReservedFor) != 1 || bound[claim.Status.ReservedFor[0].UID] == nil {
			t.Errorf("claim %s is allocated but not reserved for one bound pod: %v", claim.Name, claim.Status.ReservedFor)
			continue
		}
		pod := bound[claim.Status.ReservedFor[0].UID]
		for _, r := range claim.Status.Allocation.Devices.Results {
			if r.Pool != pod.Spec.NodeName {
				t.Errorf("claim %s has device %s/%s, but pod %s runs on %s", claim.Name, r.Pool, r.Device, pod.Name, pod.Spec.NodeName)
			}
		}
	}
	if allocated != len(names) {
		t.Errorf("%d claims allocated, want one per pod (%d)", allocated, len(names))
	}
	// Some restart came while its wave was being placed: pods of the
	// wave were bound after it (the condition's time has whole seconds;
	// a restart takes longer than one).
	after := make([]int, len(stoppedAt))
	for _, pod := range bound {
		cond := framework.PodScheduledCondition(pod)
		for w, at := range stoppedAt {
			if strings.HasPrefix(pod.Name, fmt.Sprintf("w%d-", w)) && cond != nil && cond.LastTransitionTime.After(at.Add(time.Second)) {
				after[w]++
			}
		}
	}
	t.Logf("pods of each wave bound after its restart: %v", after)
	if slices.Max(after) == 0 {
		t.Errorf("every wave was placed completely before the API server stopped: no restart came while pods were being placed")
	}
	violations, err := invariant.Check(tCtx, c.Client)
	tCtx.ExpectNoError(err)
	for _, v := range violations {
		t.Errorf("invariant violated: %s", v)
	}
}

// TestGenerationChangeMidRun: the driver republishes a node's two-slice
// pool under a new generation, one slice at a time, while pods arrive.
// While only one slice has the new generation the pool is incomplete: no
// new allocation comes from it (as upstream), the waiting pod says so, and
// pods on other nodes are placed. Once the second slice follows, every
// pod is placed, and no allocation names a device that the pool's newest
// generation lacks.
func TestGenerationChangeMidRun(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newFaultEnv(tCtx, "generation")
	node := e.ns + "-a-0"
	_, err := framework.CreateReadyNode(tCtx, cp.Client, node, map[string]string{"test": e.ns, "group": "a"})
	tCtx.ExpectNoError(err)
	gpus := framework.DGXLikeGPUs(node)
	var parts []*resourceapi.ResourceSlice
	for i := range 2 {
		slice := framework.SliceForNode(node, topology.DriverName, gpus[4*i:4*(i+1)])
		slice.Name = fmt.Sprintf("%s-%d", slice.Name, i)
		slice.Spec.Pool.ResourceSliceCount = 2
		slice, err := cp.Client.ResourceV1().ResourceSlices().Create(tCtx, slice, metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
		parts = append(parts, slice)
	}
	republish := func(i int) {
		parts[i].Spec.Pool.Generation = 2
		var err error
		parts[i], err = cp.Client.ResourceV1().ResourceSlices().Update(tCtx, parts[i], metav1.UpdateOptions{})
		tCtx.ExpectNoError(err)
	}
	e.dgxNodes("b", 1, "256")
	one := e.template(1, nil)
	startTopodra(tCtx)

	var onA []string
	for i := range 6 {
		name := fmt.Sprintf("p-%d", i)
		e.pod(name, topodraName, "a", one)
		onA = append(onA, name)
	}
	republish(0)
	t.Log("slice 0 republished under generation 2; slice 1 still has generation 1")
	e.pod("during", topodraName, "a", one)
	onA = append(onA, "during")
	pod, err := framework.WaitForPodUnschedulable(tCtx, cp.Client, e.ns, "during", waitTimeout)
	tCtx.ExpectNoError(err)
	msg := framework.PodScheduledCondition(pod).Message
	if !strings.Contains(msg, "incomplete") {
		t.Errorf("pod condition %q does not say that the pool is being updated", msg)
	}
	t.Logf("during: %s", msg)
	e.pod("elsewhere", topodraName, "b", one)
	e.expectScheduledAll("elsewhere")

	republish(1)
	t.Log("slice 1 republished under generation 2")
	e.expectScheduledAll(onA...)
	e.expectClean()
}

// oneGPUNodes starts a control plane of the test's own, without a claim
// controller or scheduler, with a namespace, the DeviceClass "gpu" and the
// named nodes, each with one GPU (gpu-0) in its slice.
func oneGPUNodes(t *testing.T, namespace string, nodes ...string) (ktesting.TContext, *framework.ControlPlane, string) {
	tCtx := ktesting.Init(t)
	c, err := framework.Start(t)
	tCtx.ExpectNoError(err, "start a control plane of its own")
	ns, err := framework.CreateNamespace(tCtx, c.Client, namespace)
	tCtx.ExpectNoError(err)
	_, err = c.Client.ResourceV1().DeviceClasses().Create(tCtx, framework.DeviceClass("gpu", topology.DriverName), metav1.CreateOptions{})
	tCtx.ExpectNoError(err)
	for _, node := range nodes {
		_, err = framework.CreateReadyNode(tCtx, c.Client, node, nil)
		tCtx.ExpectNoError(err)
		_, err = c.Client.ResourceV1().ResourceSlices().Create(tCtx, framework.SliceForNode(node, topology.DriverName, framework.DGXLikeGPUs(node)[:1]), metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
	}
	return tCtx, c, ns
}

// TestStaleReservationFoundUntilClaimControllerRuns: while the
// resourceclaim controller is down, a pod that topodra placed on a node's
// only GPU is deleted. Its claim stays allocated and reserved for it, so
// the next pod cannot have the GPU. The invariant checker, and
// topodra-check with exit code 1, report the claim as a StaleReservation
// that names the gone pod; once the controller runs it deallocates the
// claim, the next pod gets the GPU and the checker finds nothing.
func TestStaleReservationFoundUntilClaimControllerRuns(t *testing.T) {
	tCtx, c, ns := oneGPUNodes(t, "stale", "node-0")
	stop, err := c.StartScheduler(tCtx, framework.SchedulerOptions{Name: "topodra", Config: config.SchedulerConfig})
	tCtx.ExpectNoError(err)
	t.Cleanup(stop)

	tmpl := framework.ClaimTemplate(ns, "one", "gpu", 1)
	podWithClaim := func(name string) {
		t.Helper()
		_, err := c.Client.ResourceV1().ResourceClaims(ns).Create(tCtx, &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: tmpl.Spec.Spec}, metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
		pod := framework.PodWithClaims(ns, name, topodraName)
		pod.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpus", ResourceClaimName: ptr.To(name)}}
		pod.Spec.Containers[0].Resources.Claims = []v1.ResourceClaim{{Name: "gpus"}}
		_, err = c.Client.CoreV1().Pods(ns).Create(tCtx, pod, metav1.CreateOptions{})
		tCtx.ExpectNoError(err, "create pod "+name)
	}
	podWithClaim("first")
	_, err = framework.WaitForPodScheduled(tCtx, c.Client, ns, "first", waitTimeout)
	tCtx.ExpectNoError(err)
	tCtx.ExpectNoError(c.Client.CoreV1().Pods(ns).Delete(tCtx, "first", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	tCtx.ExpectNoError(wait.PollUntilContextTimeout(tCtx, 50*time.Millisecond, waitTimeout, true, func(ctx context.Context) (bool, error) {
		_, err := c.Client.CoreV1().Pods(ns).Get(ctx, "first", metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}), "pod first deleted")
	podWithClaim("second")
	_, err = framework.WaitForPodUnschedulable(tCtx, c.Client, ns, "second", waitTimeout)
	tCtx.ExpectNoError(err, "pod second waits: the deleted pod's claim still holds the GPU")

	// The pod is gone: with the default --stale-after the checker waits
	// for its reservation to outlast the controller's usual clean-up;
	// without a wait it reports it at once.
	report, err := invariant.CheckWith(tCtx, c.Client, invariant.CheckOptions{StaleAfter: -1})
	tCtx.ExpectNoError(err)
	violations := report.Violations
	if len(violations) != 1 || violations[0].Kind != invariant.StaleReservation || !slices.Equal(violations[0].Claims, []string{ns + "/first"}) ||
		!strings.Contains(violations[0].Message, ns+"/first (gone)") {
		t.Errorf("violations %v, want one StaleReservation of claim %s/first naming its gone pod", violations, ns)
	}
	var stdout, stderr bytes.Buffer
	if code := invariant.Run(tCtx, []string{"--kubeconfig", c.Kubeconfig, "--reads", "4", "--interval", "200ms", "--stale-after", "0"}, &stdout, &stderr); code != invariant.ExitViolations || !strings.Contains(stdout.String(), "StaleReservation") {
		t.Errorf("topodra-check: exit %d, want %d with the StaleReservation on stdout; stdout:\n%s\nstderr:\n%s", code, invariant.ExitViolations, stdout.String(), stderr.String())
	}

	_, err = c.StartClaimController(tCtx)
	tCtx.ExpectNoError(err)
	_, err = framework.WaitForPodScheduled(tCtx, c.Client, ns, "second", waitTimeout)
	tCtx.ExpectNoError(err, "pod second gets the GPU once the controller has deallocated the claim")
	first, err := c.Client.ResourceV1().ResourceClaims(ns).Get(tCtx, "first", metav1.GetOptions{})
	tCtx.ExpectNoError(err)
	if first.Status.Allocation != nil || len(first.Status.ReservedFor) != 0 {
		t.Errorf("claim first: allocation %v, reserved for %v; want neither", first.Status.Allocation, first.Status.ReservedFor)
	}
	violations, err = invariant.Check(tCtx, c.Client)
	tCtx.ExpectNoError(err)
	for _, v := range violations {
		t.Errorf("invariant violated after the controller ran: %s", v)
	}
}

// TestPodOnOtherNodeThanItsDevices: a pod bound to one node whose claim is
// allocated (and reserved for it) with devices of another node, as a
// faulty writer could leave it, is reported as a PodClaimOnOtherNode; the
// pod and claim on the same node are not.
func TestPodOnOtherNodeThanItsDevices(t *testing.T) {
	tCtx, c, ns := oneGPUNodes(t, "othernode", "node-0", "node-1")
	tmpl := framework.ClaimTemplate(ns, "one", "gpu", 1)
	// place binds pod name to podNode with a claim allocated gpu-0 of
	// deviceNode, written as the upstream allocator writes node-local
	// allocations.
	place := func(name, podNode, deviceNode string) {
		t.Helper()
		claim, err := c.Client.ResourceV1().ResourceClaims(ns).Create(tCtx, &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: tmpl.Spec.Spec}, metav1.CreateOptions{})
		tCtx.ExpectNoError(err)
		pod := framework.PodWithClaims(ns, name, topodraName)
		pod.Spec.NodeName = podNode
		pod.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpus", ResourceClaimName: ptr.To(name)}}
		pod.Spec.Containers[0].Resources.Claims = []v1.ResourceClaim{{Name: "gpus"}}
		pod, err = c.Client.CoreV1().Pods(ns).Create(tCtx, pod, metav1.CreateOptions{})
		tCtx.ExpectNoError(err, "create pod "+name)
		claim.Status.Allocation = &resourceapi.AllocationResult{
			Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{Request: tmpl.Spec.Spec.Devices.Requests[0].Name, Driver: topology.DriverName, Pool: deviceNode, Device: "gpu-0"}}},
			NodeSelector: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{
				MatchFields: []v1.NodeSelectorRequirement{{Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{deviceNode}}},
			}}},
		}
		claim.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: pod.Name, UID: pod.UID}}
		_, err = c.Client.ResourceV1().ResourceClaims(ns).UpdateStatus(tCtx, claim, metav1.UpdateOptions{})
		tCtx.ExpectNoError(err, "write the allocation of "+name)
	}
	place("right", "node-0", "node-0")
	place("wrong", "node-0", "node-1")

	violations, err := invariant.Check(tCtx, c.Client)
	tCtx.ExpectNoError(err)
	if len(violations) != 1 || violations[0].Kind != invariant.PodClaimOnOtherNode || violations[0].Pod != ns+"/wrong" || !slices.Equal(violations[0].Claims, []string{ns + "/wrong"}) {
		t.Errorf("violations %v, want one PodClaimOnOtherNode of pod %s/wrong", violations, ns)
	}
	for _, v := range violations {
		t.Logf("found: %s", v)
	}
}
