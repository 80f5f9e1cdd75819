package integration

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/kubernetes/test/utils/ktesting"

	"github.com/topodra/topodra/manifests"
	"github.com/topodra/topodra/test/integration/framework"
)

// warnings collects the warnings the API server sends a client.
type warnings struct {
	mu   sync.Mutex
	msgs []string
}

func (w *warnings) HandleWarningHeaderWithContext(_ context.Context, _ int, _ string, text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.msgs = append(w.msgs, text)
}

// take returns the warnings since the last take.
func (w *warnings) take() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := w.msgs
	w.msgs = nil
	return out
}

// TestAnnotationPolicyWarns applies the shipped annotation policy to a real
// API server and checks that it warns, and never refuses, where a
// topodra.io/ annotation would do nothing or be refused by the scheduler:
// on pods and workloads' pod templates, on a ResourceClaimTemplate's own
// metadata, a misspelled key, a value topodra refuses; and that it says
// nothing about annotations that take effect.
func TestAnnotationPolicyWarns(t *testing.T) {
	tCtx := ktesting.Init(t)
	c, err := framework.Start(t)
	tCtx.ExpectNoError(err, "start control plane")
	data, err := manifests.FS.ReadFile("base/annotation-policy.yaml")
	tCtx.ExpectNoError(err)
	tCtx.ExpectNoError(c.Apply(tCtx, data, nil), "apply the annotation policy")
	ns, err := framework.CreateNamespace(tCtx, c.Client, "annotations")
	tCtx.ExpectNoError(err)

	w := &warnings{}
	cfg := rest.CopyConfig(c.Config)
	cfg.WarningHandlerWithContext = w
	client, err := kubernetes.NewForConfig(cfg)
	tCtx.ExpectNoError(err)

	n := 0
	name := func() string { n++; return fmt.Sprintf("o-%d", n) }
	container := []v1.Container{{Name: "c", Image: "registry.example/app"}}
	podMeta := func(annotations map[string]string) metav1.ObjectMeta {
		return metav1.ObjectMeta{Labels: map[string]string{"app": "a"}, Annotations: annotations}
	}
	spec := resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
		Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.topodra.io"},
	}}}}
	create := map[string]func(annotations map[string]string) error{
		"pod": func(a map[string]string) error {
			meta := podMeta(a)
			meta.Name = name()
			_, err := client.CoreV1().Pods(ns).Create(tCtx, &v1.Pod{ObjectMeta: meta, Spec: v1.PodSpec{Containers: container}}, metav1.CreateOptions{})
			return err
		},
		"deployment": func(a map[string]string) error {
			_, err := client.AppsV1().Deployments(ns).Create(tCtx, &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: name()}, Spec: appsv1.DeploymentSpec{
				Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "a"}},
				Template: v1.PodTemplateSpec{ObjectMeta: podMeta(a), Spec: v1.PodSpec{Containers: container}},
			}}, metav1.CreateOptions{})
			return err
		},
		"cronjob": func(a map[string]string) error {
			_, err := client.BatchV1().CronJobs(ns).Create(tCtx, &batchv1.CronJob{ObjectMeta: metav1.ObjectMeta{Name: name()}, Spec: batchv1.CronJobSpec{
				Schedule: "0 * * * *",
				JobTemplate: batchv1.JobTemplateSpec{Spec: batchv1.JobSpec{Template: v1.PodTemplateSpec{
					ObjectMeta: podMeta(a), Spec: v1.PodSpec{Containers: container, RestartPolicy: v1.RestartPolicyNever},
				}}},
			}}, metav1.CreateOptions{})
			return err
		},
		"claim": func(a map[string]string) error {
			_, err := client.ResourceV1().ResourceClaims(ns).Create(tCtx, &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name(), Annotations: a}, Spec: spec}, metav1.CreateOptions{})
			return err
		},
		"template spec": func(a map[string]string) error {
			_, err := client.ResourceV1().ResourceClaimTemplates(ns).Create(tCtx, &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: name()},
				Spec: resourceapi.ResourceClaimTemplateSpec{ObjectMeta: metav1.ObjectMeta{Annotations: a}, Spec: spec}}, metav1.CreateOptions{})
			return err
		},
		"template own": func(a map[string]string) error {
			_, err := client.ResourceV1().ResourceClaimTemplates(ns).Create(tCtx, &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: name(), Annotations: a},
				Spec: resourceapi.ResourceClaimTemplateSpec{Spec: spec}}, metav1.CreateOptions{})
			return err
		},
	}
	require := map[string]string{"topodra.io/alignment": "require"}
	// A policy takes effect asynchronously: wait for its first warning.
	err = wait.PollUntilContextTimeout(tCtx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		tCtx.ExpectNoError(create["pod"](require), "create a pod")
		return len(w.take()) > 0, nil
	})
	tCtx.ExpectNoError(err, "the policy never warned")

	for _, tc := range []struct {
		kind        string
		annotations map[string]string
		want        string // "" for no warning
	}{
		{"pod", require, "topodra.io/ annotations do nothing on a pod (topodra.io/alignment)"},
		{"pod", map[string]string{"example.com/other": "x"}, ""},
		{"deployment", map[string]string{"topodra.io/align-with": "pod"}, "do nothing on a pod (topodra.io/align-with)"},
		{"deployment", nil, ""},
		{"cronjob", require, "do nothing on a pod"},
		{"template own", require, "the claims of this template do not get its own annotations (topodra.io/alignment)"},
		{"template spec", require, ""},
		{"template spec", map[string]string{"topodra.io/alignement": "require"}, "unknown annotation topodra.io/alignement"},
		{"claim", map[string]string{"topodra.io/alignment": "prefer", "topodra.io/align-with": "pod"}, ""},
		{"claim", map[string]string{"topodra.io/alignment": "strict"}, `topodra.io/alignment: "strict" is not require, prefer or none`},
		{"claim", map[string]string{"topodra.io/align-with": "node"}, `topodra.io/align-with: "node" is not pod`},
	} {
		if err := create[tc.kind](tc.annotations); err != nil {
			t.Errorf("%s with %v refused: %v", tc.kind, tc.annotations, err)
			continue
		}
		got := w.take()
		switch {
		case tc.want == "" && len(got) > 0:
			t.Errorf("%s with %v: warnings %q, want none", tc.kind, tc.annotations, got)
		case tc.want != "" && (len(got) != 1 || !strings.Contains(got[0], tc.want)):
			t.Errorf("%s with %v: warnings %q, want one containing %q", tc.kind, tc.annotations, got, tc.want)
		}
	}
}
