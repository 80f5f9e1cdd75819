package manifests

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/topodra/topodra/pkg/invariant"
)

// monitoringGroup is the API group of the Prometheus operator's kinds,
// which the client-go scheme does not know.
const monitoringGroup = "monitoring.coreos.com"

// rendered is a rendered kustomization: the objects of the client-go
// scheme, decoded strictly, and the documents of the Prometheus operator's
// kinds as they are, by kind.
type rendered struct {
	objs       []runtime.Object
	monitoring map[string][][]byte
	// ids are the identities (apiVersion, kind, namespace, name) of all
	// documents, each with its document.
	ids map[string]string
}

// renderComposed renders dir with the optional components and decodes it.
func renderComposed(t *testing.T, dir string, components ...string) rendered {
	t.Helper()
	var data []byte
	var err error
	if len(components) == 0 {
		data, err = Render(dir)
	} else {
		data, err = RenderWithComponents(dir, components...)
	}
	if err != nil {
		t.Fatalf("render %s with %v: %v", dir, components, err)
	}
	r := rendered{monitoring: map[string][][]byte{}, ids: map[string]string{}}
	var scheme bytes.Buffer
	for _, d := range documents(data) {
		r.ids[d.APIVersion+"|"+d.Kind+"|"+d.Metadata.Namespace+"|"+d.Metadata.Name] = string(d.doc)
		if strings.HasPrefix(d.APIVersion, monitoringGroup+"/") {
			r.monitoring[d.Kind] = append(r.monitoring[d.Kind], d.doc)
			continue
		}
		scheme.WriteString("---\n")
		scheme.Write(d.doc)
	}
	r.objs = decodeAll(t, dir, scheme.Bytes())
	return r
}

// document is one object of a rendered set: its text and what every
// object has.
type document struct {
	doc        []byte
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   metav1.ObjectMeta `json:"metadata"`
}

// documents splits rendered YAML into its objects, leaving out documents
// without a kind.
func documents(data []byte) []document {
	var out []document
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		doc, err := reader.Read()
		if err != nil {
			return out
		}
		d := document{doc: doc}
		if err := yaml.Unmarshal(doc, &d); err != nil || d.Kind == "" {
			continue
		}
		out = append(out, d)
	}
}

// TestOptionalComponentsOnlyAdd: each optional component, added to each
// overlay, adds objects (all in kube-system, like the overlay's) and
// leaves every object of the overlay as it is.
func TestOptionalComponentsOnlyAdd(t *testing.T) {
	entries, err := os.ReadDir("components")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.Name() != "gpu-operator-toolkit" && !slices.Contains(Optional, e.Name()) {
			t.Errorf("components/%s is not in Optional", e.Name())
		}
	}
	for _, dir := range overlayDirs() {
		plain := renderComposed(t, dir)
		for _, c := range Optional {
			t.Run(dir+"+"+c, func(t *testing.T) {
				with := renderComposed(t, dir, "components/"+c)
				for id, doc := range plain.ids {
					if with.ids[id] != doc {
						t.Errorf("the component changes or drops %s", id)
					}
				}
				added := 0
				for id := range with.ids {
					if _, ok := plain.ids[id]; ok {
						continue
					}
					added++
					if parts := strings.Split(id, "|"); parts[2] != "" && parts[2] != metav1.NamespaceSystem {
						t.Errorf("%s is in namespace %s, want %s", id, parts[2], metav1.NamespaceSystem)
					}
				}
				if added == 0 {
					t.Error("the component adds nothing")
				}
			})
		}
	}
}

// podMonitor is the part of a monitoring.coreos.com/v1 PodMonitor that the
// shipped ones use, with the Prometheus operator's field names (its
// PodMonitorSpec, PodMetricsEndpoint, SafeAuthorization, SafeTLSConfig
// and RelabelConfig). It is decoded strictly (decodeStrict): a field that
// is not here (misspelled, or of another version) fails the test.
type podMonitor struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   metav1.ObjectMeta `json:"metadata"`
	Spec       struct {
		JobLabel          string `json:"jobLabel"`
		NamespaceSelector struct {
			MatchNames []string `json:"matchNames"`
		} `json:"namespaceSelector"`
		Selector            metav1.LabelSelector `json:"selector"`
		PodMetricsEndpoints []struct {
			Port      string `json:"port"`
			Path      string `json:"path"`
			Scheme    string `json:"scheme"`
			TLSConfig *struct {
				InsecureSkipVerify bool `json:"insecureSkipVerify"`
			} `json:"tlsConfig"`
			Authorization *struct {
				Type        string                `json:"type"`
				Credentials *v1.SecretKeySelector `json:"credentials"`
			} `json:"authorization"`
			Relabelings []struct {
				Action       string   `json:"action"`
				SourceLabels []string `json:"sourceLabels"`
				TargetLabel  string   `json:"targetLabel"`
			} `json:"relabelings"`
		} `json:"podMetricsEndpoints"`
	} `json:"spec"`
}

// decodeStrict decodes a YAML document into v as the API server decodes
// an object with strict field validation: a field that v does not have,
// also one that differs from v's only in case, is an error.
func decodeStrict(doc []byte, v any) error {
	data, err := yaml.YAMLToJSON(doc)
	if err != nil {
		return err
	}
	strict, err := sigsjson.UnmarshalStrict(data, v)
	if err != nil {
		return err
	}
	return errors.Join(strict...)
}

// prometheusRule is the part of a monitoring.coreos.com/v1 PrometheusRule
// that the shipped one uses, with the operator's field names, decoded
// strictly.
type prometheusRule struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   metav1.ObjectMeta `json:"metadata"`
	Spec       struct {
		Groups []struct {
			Name  string `json:"name"`
			Rules []struct {
				Alert       string            `json:"alert"`
				Expr        string            `json:"expr"`
				For         string            `json:"for"`
				Labels      map[string]string `json:"labels"`
				Annotations map[string]string `json:"annotations"`
			} `json:"rules"`
		} `json:"groups"`
	} `json:"spec"`
}

// runbookPrefix starts every alert's runbook_url: a heading of
// docs/operations.md (docs/links_test.go checks that it exists).
const runbookPrefix = "https://github.com/topodra/topodra/blob/main/docs/operations.md#"

// jobMatcher finds the job label's matchers in a PromQL expression.
var jobMatcher = regexp.MustCompile(`\bjob\s*(=~|=|!=|!~)\s*"([^"]*)"`)

// scrapedPod is a workload's pod template and its first container.
type scrapedPod struct {
	namespace string
	template  *v1.PodTemplateSpec
}

// TestMonitoringComponent: in every overlay with the monitoring
// component, each PodMonitor selects the pods of exactly one workload in
// their namespace, names a port of its container, and takes its job
// label from a label of the pods; the scheduler's is scraped over HTTPS
// with the token of a ServiceAccount bound to topodra-metrics-reader, the
// agent's over HTTP with the pod's node as label "node"; every alert
// selects the jobs that the PodMonitors give, has a severity and
// annotations, and names a runbook in docs/operations.md.
func TestMonitoringComponent(t *testing.T) {
	for _, dir := range overlayDirs() {
		t.Run(dir, func(t *testing.T) {
			r := renderComposed(t, dir, "components/monitoring")
			workloads := map[string]scrapedPod{}
			for _, obj := range r.objs {
				switch o := obj.(type) {
				case *appsv1.Deployment:
					workloads[o.Name] = scrapedPod{o.Namespace, &o.Spec.Template}
				case *appsv1.DaemonSet:
					workloads[o.Name] = scrapedPod{o.Namespace, &o.Spec.Template}
				}
			}
			jobs := map[string]string{} // job -> workload
			if len(r.monitoring["PodMonitor"]) != 2 {
				t.Fatalf("%d PodMonitors, want the scheduler's and the agent's", len(r.monitoring["PodMonitor"]))
			}
			for _, doc := range r.monitoring["PodMonitor"] {
				var pm podMonitor
				if err := decodeStrict(doc, &pm); err != nil {
					t.Fatalf("PodMonitor: %v\n%s", err, doc)
				}
				checkPodMonitor(t, r, &pm, workloads, jobs)
			}
			if _, ok := jobs["topodra-scheduler"]; !ok {
				t.Error("no PodMonitor gives job topodra-scheduler")
			}
			if _, ok := jobs["topodra-node-agent"]; !ok {
				t.Error("no PodMonitor gives job topodra-node-agent")
			}
			if len(r.monitoring["PrometheusRule"]) != 1 {
				t.Fatalf("%d PrometheusRules, want 1", len(r.monitoring["PrometheusRule"]))
			}
			var rule prometheusRule
			if err := decodeStrict(r.monitoring["PrometheusRule"][0], &rule); err != nil {
				t.Fatalf("PrometheusRule: %v", err)
			}
			checkAlerts(t, &rule, jobs)
		})
	}
}

func checkPodMonitor(t *testing.T, r rendered, pm *podMonitor, workloads map[string]scrapedPod, jobs map[string]string) {
	t.Helper()
	if pm.APIVersion != monitoringGroup+"/v1" || pm.Metadata.Namespace != metav1.NamespaceSystem {
		t.Errorf("PodMonitor %s: %s in namespace %q, want %s/v1 in %s", pm.Metadata.Name, pm.APIVersion, pm.Metadata.Namespace, monitoringGroup, metav1.NamespaceSystem)
	}
	selector, err := metav1.LabelSelectorAsSelector(&pm.Spec.Selector)
	if err != nil || selector.Empty() {
		t.Fatalf("PodMonitor %s: selector %v (%v)", pm.Metadata.Name, pm.Spec.Selector, err)
	}
	var selected []string
	for name, w := range workloads {
		if selector.Matches(labels.Set(w.template.Labels)) {
			selected = append(selected, name)
		}
	}
	if len(selected) != 1 {
		t.Fatalf("PodMonitor %s selects the pods of %v, want one workload's", pm.Metadata.Name, selected)
	}
	w := workloads[selected[0]]
	if !slices.Equal(pm.Spec.NamespaceSelector.MatchNames, []string{w.namespace}) {
		t.Errorf("PodMonitor %s looks in namespaces %v, want [%s] of %s", pm.Metadata.Name, pm.Spec.NamespaceSelector.MatchNames, w.namespace, selected[0])
	}
	job := w.template.Labels[pm.Spec.JobLabel]
	if pm.Spec.JobLabel == "" || job == "" {
		t.Errorf("PodMonitor %s: jobLabel %q is no label of the pods of %s", pm.Metadata.Name, pm.Spec.JobLabel, selected[0])
	}
	jobs[job] = selected[0]
	if len(pm.Spec.PodMetricsEndpoints) != 1 {
		t.Fatalf("PodMonitor %s has %d endpoints, want 1", pm.Metadata.Name, len(pm.Spec.PodMetricsEndpoints))
	}
	ep := pm.Spec.PodMetricsEndpoints[0]
	c := w.template.Spec.Containers[0]
	i := slices.IndexFunc(c.Ports, func(p v1.ContainerPort) bool { return p.Name == ep.Port })
	if i < 0 {
		t.Fatalf("PodMonitor %s scrapes port %q, which container %s of %s does not name", pm.Metadata.Name, ep.Port, c.Name, selected[0])
	}
	if ep.Path != "/metrics" {
		t.Errorf("PodMonitor %s scrapes path %q, want /metrics", pm.Metadata.Name, ep.Path)
	}
	switch selected[0] {
	case "topodra-scheduler":
		// kube-scheduler's secure port, which the probes use too.
		if probe := c.LivenessProbe; probe == nil || probe.HTTPGet == nil || probe.HTTPGet.Port.IntValue() != int(c.Ports[i].ContainerPort) || probe.HTTPGet.Scheme != v1.URISchemeHTTPS {
			t.Errorf("PodMonitor %s scrapes port %d, which is not the scheduler's secure port", pm.Metadata.Name, c.Ports[i].ContainerPort)
		}
		if !strings.EqualFold(ep.Scheme, "https") || ep.TLSConfig == nil || !ep.TLSConfig.InsecureSkipVerify {
			t.Errorf("PodMonitor %s: scheme %q, TLS %+v; want HTTPS without verifying the scheduler's self-signed certificate", pm.Metadata.Name, ep.Scheme, ep.TLSConfig)
		}
		if ep.Authorization == nil || ep.Authorization.Type != "Bearer" || ep.Authorization.Credentials == nil {
			t.Fatalf("PodMonitor %s sends no bearer token: the API server refuses an anonymous scrape of /metrics", pm.Metadata.Name)
		}
		checkScraperToken(t, r, pm.Metadata.Namespace, ep.Authorization.Credentials)
	case "topodra-node-agent":
		if !strings.EqualFold(ep.Scheme, "http") || ep.Authorization != nil {
			t.Errorf("PodMonitor %s: scheme %q, authorization %+v; want plain HTTP without a token (the agent's health port)", pm.Metadata.Name, ep.Scheme, ep.Authorization)
		}
		if !slices.ContainsFunc(ep.Relabelings, func(rl struct {
			Action       string   `json:"action"`
			SourceLabels []string `json:"sourceLabels"`
			TargetLabel  string   `json:"targetLabel"`
		}) bool {
			return (rl.Action == "" || rl.Action == "replace") && slices.Equal(rl.SourceLabels, []string{"__meta_kubernetes_pod_node_name"}) && rl.TargetLabel == "node"
		}) {
			t.Errorf("PodMonitor %s does not label the agent's series with its pod's node (node from __meta_kubernetes_pod_node_name)", pm.Metadata.Name)
		}
	default:
		t.Errorf("PodMonitor %s scrapes %s, neither the scheduler nor the agent", pm.Metadata.Name, selected[0])
	}
}

// checkScraperToken: the token Secret that a PodMonitor in namespace
// names is a ServiceAccount token, of a ServiceAccount in the render that
// is bound to topodra-metrics-reader.
func checkScraperToken(t *testing.T, r rendered, namespace string, ref *v1.SecretKeySelector) {
	t.Helper()
	secret, ok := find(r.objs, func(s *v1.Secret) bool { return s.Namespace == namespace && s.Name == ref.Name })
	if !ok {
		t.Fatalf("no Secret %s/%s for the scheduler's PodMonitor", namespace, ref.Name)
	}
	sa := secret.Annotations[v1.ServiceAccountNameKey]
	if secret.Type != v1.SecretTypeServiceAccountToken || ref.Key != v1.ServiceAccountTokenKey || sa == "" {
		t.Errorf("Secret %s: type %s, key %q, ServiceAccount %q; want a ServiceAccount's token, key %s", secret.Name, secret.Type, ref.Key, sa, v1.ServiceAccountTokenKey)
	}
	if _, ok := find(r.objs, func(s *v1.ServiceAccount) bool { return s.Namespace == namespace && s.Name == sa }); !ok {
		t.Errorf("no ServiceAccount %s/%s for the token Secret %s", namespace, sa, secret.Name)
	}
	if _, ok := find(r.objs, func(b *rbacv1.ClusterRoleBinding) bool {
		return b.RoleRef.Kind == "ClusterRole" && b.RoleRef.Name == "topodra-metrics-reader" &&
			slices.Contains(b.Subjects, rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Namespace: namespace, Name: sa})
	}); !ok {
		t.Errorf("ServiceAccount %s/%s is not bound to ClusterRole topodra-metrics-reader", namespace, sa)
	}
}

// selectorPattern finds the metric of each selector with label matchers.
var selectorPattern = regexp.MustCompile(`([a-zA-Z_:][a-zA-Z0-9_:]*)\{`)

// stateMetricsOnly reports whether every selector of expr is of a
// kube-state-metrics series (kube_*), which describe objects: an alert
// selects them by object, whatever job scrapes kube-state-metrics
// (monitoring/rules_test.go checks their names and labels).
func stateMetricsOnly(expr string) bool {
	found := selectorPattern.FindAllStringSubmatch(expr, -1)
	for _, m := range found {
		if !strings.HasPrefix(m[1], "kube_") {
			return false
		}
	}
	return len(found) > 0
}

func checkAlerts(t *testing.T, rule *prometheusRule, jobs map[string]string) {
	t.Helper()
	if rule.Metadata.Namespace != metav1.NamespaceSystem {
		t.Errorf("PrometheusRule in namespace %q, want %s", rule.Metadata.Namespace, metav1.NamespaceSystem)
	}
	alerts := map[string]bool{}
	for _, g := range rule.Spec.Groups {
		for _, a := range g.Rules {
			if a.Alert == "" || alerts[a.Alert] {
				t.Errorf("group %s: a rule without an alert name, or alert %q twice", g.Name, a.Alert)
			}
			alerts[a.Alert] = true
			if a.For != "" {
				if _, err := time.ParseDuration(a.For); err != nil {
					t.Errorf("alert %s: for %q: %v", a.Alert, a.For, err)
				}
			}
			if s := a.Labels["severity"]; s != "critical" && s != "warning" && s != "info" {
				t.Errorf("alert %s: severity %q, want critical, warning or info", a.Alert, s)
			}
			if a.Annotations["summary"] == "" || a.Annotations["description"] == "" {
				t.Errorf("alert %s has no summary or description", a.Alert)
			}
			if url := a.Annotations["runbook_url"]; url != runbookPrefix+strings.ToLower(a.Alert) {
				t.Errorf("alert %s: runbook_url %q, want %s%s", a.Alert, url, runbookPrefix, strings.ToLower(a.Alert))
			}
			matchers := jobMatcher.FindAllStringSubmatch(a.Expr, -1)
			if len(matchers) == 0 && !stateMetricsOnly(a.Expr) {
				t.Errorf("alert %s selects no job: %s", a.Alert, a.Expr)
			}
			for _, m := range matchers {
				values := []string{m[2]}
				switch m[1] {
				case "=~":
					values = strings.Split(m[2], "|")
				case "=":
				default:
					t.Errorf("alert %s: job%s%q; select the jobs with = or =~", a.Alert, m[1], m[2])
				}
				for _, v := range values {
					if _, ok := jobs[v]; !ok {
						t.Errorf("alert %s selects job %q, which no PodMonitor gives (they give %v)", a.Alert, v, jobs)
					}
				}
			}
			if !strings.Contains(a.Expr, `namespace="`+metav1.NamespaceSystem+`"`) {
				t.Errorf("alert %s does not select namespace %s: %s", a.Alert, metav1.NamespaceSystem, a.Expr)
			}
		}
	}
	if len(alerts) == 0 {
		t.Error("no alerts")
	}
}

// TestInvariantCheckComponent: in every overlay with the invariant-check
// component, a CronJob runs topodra-check from the scheduler's image, as
// a ServiceAccount bound to the ClusterRole topodra-checker, with flags
// that topodra-check accepts, reading for longer than --stale-after and
// --unpublished-after, within its --timeout, which ends before the Job's
// deadline, which ends before the next run is due; with GOMEMLIMIT at
// its memory limit. A Job fails at once however the checker fails, and
// through the pod failure policy (the Failed condition's reason that
// the alerts read) only on topodra-check's code for violations; a pod
// evicted or preempted is run again whatever its exit code. Failed Jobs,
// with their pods and logs, are kept for hours.
func TestInvariantCheckComponent(t *testing.T) {
	for _, dir := range overlayDirs() {
		t.Run(dir, func(t *testing.T) {
			r := renderComposed(t, dir, "components/invariant-check")
			cron, ok := find(r.objs, func(c *batchv1.CronJob) bool { return c.Name == "topodra-check" })
			if !ok {
				t.Fatal("no CronJob topodra-check")
			}
			scheduler, ok := find(r.objs, func(d *appsv1.Deployment) bool { return d.Name == "topodra-scheduler" })
			if !ok {
				t.Fatal("no scheduler Deployment")
			}
			job := cron.Spec.JobTemplate.Spec
			pod := job.Template.Spec
			if len(pod.Containers) != 1 {
				t.Fatalf("%d containers, want 1", len(pod.Containers))
			}
			c := pod.Containers[0]
			// The same image name and tag: `kustomize edit set image`
			// of the scheduler's image points both at a build.
			if c.Image != scheduler.Spec.Template.Spec.Containers[0].Image {
				t.Errorf("the checker runs %s, the scheduler %s: want the scheduler's image, which holds /topodra-check", c.Image, scheduler.Spec.Template.Spec.Containers[0].Image)
			}
			if len(c.Command) == 0 || c.Command[0] != "/topodra-check" || len(c.Args) != 0 {
				t.Fatalf("command %q, args %q; want /topodra-check and its flags", c.Command, c.Args)
			}
			period := schedulePeriod(t, cron.Spec.Schedule)
			checkCheckerFlags(t, c.Command[1:], job.ActiveDeadlineSeconds, period)
			checkMemoryLimit(t, &c)
			checkUnprivileged(t, "checker", &pod, &c)
			if sc := c.SecurityContext; sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
				t.Error("the checker may run as root or write its root file system")
			}
			if cron.Spec.ConcurrencyPolicy != batchv1.ForbidConcurrent {
				t.Errorf("concurrency policy %s, want Forbid: a slow check must not overlap the next", cron.Spec.ConcurrencyPolicy)
			}
			// Long enough for whoever TopodraInvariantViolations
			// wakes to read the failed run's log, even if the runs
			// after it fail too.
			if kept := time.Duration(ptrValue(cron.Spec.FailedJobsHistoryLimit)) * period; kept < 4*time.Hour {
				t.Errorf("failedJobsHistoryLimit %d keeps %s of failed runs every %s, want at least 4h: their results would be gone", ptrValue(cron.Spec.FailedJobsHistoryLimit), kept, period)
			}
			if job.TTLSecondsAfterFinished != nil {
				t.Errorf("ttlSecondsAfterFinished %d deletes a failed Job, its pod and log, before failedJobsHistoryLimit does", *job.TTLSecondsAfterFinished)
			}
			// A failed check is the result, not to be retried until it
			// passes by chance.
			if job.BackoffLimit == nil || *job.BackoffLimit != 0 || pod.RestartPolicy != v1.RestartPolicyNever {
				t.Errorf("backoffLimit %v, restartPolicy %s; want 0 and Never", job.BackoffLimit, pod.RestartPolicy)
			}
			var failsOn []int32
			ignoresDisruption := false
			if job.PodFailurePolicy != nil {
				for _, rule := range job.PodFailurePolicy.Rules {
					// The first rule that matches decides, and a
					// disrupted checker exits with its code for an
					// unread cluster.
					if rule.Action == batchv1.PodFailurePolicyActionIgnore && slices.ContainsFunc(rule.OnPodConditions, func(p batchv1.PodFailurePolicyOnPodConditionsPattern) bool {
						// The API server defaults the status to True.
						return p.Type == v1.DisruptionTarget && (p.Status == "" || p.Status == v1.ConditionTrue)
					}) {
						ignoresDisruption = true
						continue
					}
					if rule.Action != batchv1.PodFailurePolicyActionFailJob {
						continue
					}
					if !ignoresDisruption {
						t.Errorf("a FailJob rule of the pod failure policy comes before the rule that ignores %s: a disrupted check fails the Job", v1.DisruptionTarget)
					}
					if rule.OnExitCodes == nil || rule.OnExitCodes.Operator != batchv1.PodFailurePolicyOnExitCodesOpIn || ptrValue(rule.OnExitCodes.ContainerName) != c.Name {
						t.Errorf("a FailJob rule of the pod failure policy other than for exit codes of container %s: %+v", c.Name, rule)
						continue
					}
					failsOn = append(failsOn, rule.OnExitCodes.Values...)
				}
			}
			if !ignoresDisruption {
				t.Errorf("the pod failure policy does not ignore pods with condition %s: an evicted or preempted check fails the Job", v1.DisruptionTarget)
			}
			if !slices.Equal(failsOn, []int32{invariant.ExitViolations}) {
				t.Errorf("the pod failure policy fails the Job on exit codes %v of container %s, want only %d (violations), so that its reason tells them from other failures", failsOn, c.Name, invariant.ExitViolations)
			}
			sa := pod.ServiceAccountName
			if _, ok := find(r.objs, func(s *v1.ServiceAccount) bool { return s.Namespace == cron.Namespace && s.Name == sa }); !ok {
				t.Errorf("no ServiceAccount %s/%s", cron.Namespace, sa)
			}
			if _, ok := find(r.objs, func(b *rbacv1.ClusterRoleBinding) bool {
				return b.RoleRef.Kind == "ClusterRole" && b.RoleRef.Name == "topodra-checker" &&
					slices.Contains(b.Subjects, rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Namespace: cron.Namespace, Name: sa})
			}); !ok {
				t.Errorf("ServiceAccount %s/%s is not bound to ClusterRole topodra-checker", cron.Namespace, sa)
			}
		})
	}
}

func ptrValue[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

// documentedPatch returns the last yaml block of docs/operations.md that
// holds every one of marks; what names the patch in the failure.
func documentedPatch(t *testing.T, what string, marks ...string) string {
	t.Helper()
	doc, err := os.ReadFile("../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	var patch string
	for _, block := range strings.Split(string(doc), "```yaml\n")[1:] {
		block, _, _ = strings.Cut(block, "```")
		all := true
		for _, m := range marks {
			all = all && strings.Contains(block, m)
		}
		if all {
			patch = block
		}
	}
	if patch == "" {
		t.Fatalf("docs/operations.md has no yaml block with %s", what)
	}
	return patch
}

// TestDocumentedCheckerSizing: the patch of the checker's CronJob that
// docs/operations.md gives for a large cluster keeps the reads within
// --timeout and the Job's deadline, as TestInvariantCheckComponent asks
// of the shipped one, and GOMEMLIMIT follows the raised memory limit.
func TestDocumentedCheckerSizing(t *testing.T) {
	patch := documentedPatch(t, "a patch of the CronJob topodra-check", "kind: CronJob", "name: topodra-check")
	data, err := renderMine("overlays/host", []string{"components/invariant-check"}, patch)
	if err != nil {
		t.Fatalf("the documented patch: %v", err)
	}
	var scheme bytes.Buffer
	for _, d := range documents(data) {
		scheme.WriteString("---\n")
		scheme.Write(d.doc)
	}
	cron, ok := find(decodeAll(t, "patched", scheme.Bytes()), func(c *batchv1.CronJob) bool { return c.Name == "topodra-check" })
	if !ok {
		t.Fatal("no CronJob topodra-check")
	}
	job := cron.Spec.JobTemplate.Spec
	c := job.Template.Spec.Containers[0]
	shipped := renderComposed(t, "overlays/host", "components/invariant-check")
	before, _ := find(shipped.objs, func(c *batchv1.CronJob) bool { return c.Name == "topodra-check" })
	if slices.Equal(c.Command, before.Spec.JobTemplate.Spec.Template.Spec.Containers[0].Command) {
		t.Error("the documented patch does not change the checker's flags")
	}
	checkCheckerFlags(t, c.Command[1:], job.ActiveDeadlineSeconds, schedulePeriod(t, cron.Spec.Schedule))
	checkMemoryLimit(t, &c)
}

// checkCheckerFlags runs topodra-check's command line with args and a
// kubeconfig that does not exist: flags it accepts get as far as loading
// the kubeconfig. The reads must span --stale-after and
// --unpublished-after and end within --timeout, which must end before
// the Job's deadline, with room for the pod to start (a Job past its
// deadline deletes its pod and log), which must end before the next run
// is due.
func checkCheckerFlags(t *testing.T, args []string, deadlineSeconds *int64, period time.Duration) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	missing := filepath.Join(t.TempDir(), "kubeconfig")
	code := invariant.Run(context.Background(), append(slices.Clone(args), "--kubeconfig", missing), &stdout, &stderr)
	if code != invariant.ExitError || !strings.Contains(stderr.String(), "load kubeconfig") {
		t.Fatalf("topodra-check %q: exit %d, stderr %q; want it to accept the flags and fail to load the kubeconfig", args, code, stderr.String())
	}
	flag := func(name string, def time.Duration) time.Duration {
		for _, a := range args {
			if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
				d, err := time.ParseDuration(v)
				if err != nil {
					t.Fatal(err)
				}
				return d
			}
		}
		return def
	}
	reads := 0
	var err error
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--reads="); ok {
			if reads, err = strconv.Atoi(v); err != nil {
				t.Fatal(err)
			}
		}
	}
	if reads == 0 {
		reads = invariant.DefaultReads
	}
	span := time.Duration(reads-1) * flag("interval", invariant.DefaultInterval)
	for name, def := range map[string]time.Duration{"stale-after": invariant.DefaultStaleAfter, "unpublished-after": invariant.DefaultUnpublishedAfter} {
		if after := flag(name, def); span < after {
			t.Errorf("the reads span %s, less than --%s %s: what it would report stays a note", span, name, after)
		}
	}
	timeout := flag("timeout", 0)
	if timeout < span+2*time.Minute {
		t.Errorf("--timeout %s, want the reads' %s and two minutes more", timeout, span)
	}
	if deadlineSeconds == nil {
		t.Fatal("no activeDeadlineSeconds")
	}
	deadline := time.Duration(*deadlineSeconds) * time.Second
	if deadline < timeout+2*time.Minute {
		t.Errorf("activeDeadlineSeconds %d, want --timeout %s and two minutes more for the pod to start: past the deadline, the pod and its log are deleted", *deadlineSeconds, timeout)
	}
	if deadline >= period {
		t.Errorf("activeDeadlineSeconds %d, want less than the %s between runs", *deadlineSeconds, period)
	}
}

// checkMemoryLimit: the container has a memory limit, and GOMEMLIMIT is
// that limit in bytes.
func checkMemoryLimit(t *testing.T, c *v1.Container) {
	t.Helper()
	if _, ok := c.Resources.Limits[v1.ResourceMemory]; !ok {
		t.Errorf("container %s has no memory limit", c.Name)
	}
	for _, e := range c.Env {
		if e.Name != "GOMEMLIMIT" {
			continue
		}
		var ref *v1.ResourceFieldSelector
		if e.ValueFrom != nil {
			ref = e.ValueFrom.ResourceFieldRef
		}
		if ref == nil || ref.Resource != "limits.memory" || (ref.ContainerName != "" && ref.ContainerName != c.Name) || (!ref.Divisor.IsZero() && ref.Divisor.Value() != 1) {
			t.Errorf("GOMEMLIMIT of container %s is %+v, want its limits.memory in bytes", c.Name, e)
		}
		return
	}
	t.Errorf("container %s has no GOMEMLIMIT: its heap may grow past its memory limit", c.Name)
}

// schedulePeriod is the time between the runs of a CronJob of schedule
// "*/N * * * *".
func schedulePeriod(t *testing.T, schedule string) time.Duration {
	t.Helper()
	every, ok := strings.CutPrefix(schedule, "*/")
	every, ok2 := strings.CutSuffix(every, " * * * *")
	minutes, err := strconv.Atoi(every)
	if !ok || !ok2 || err != nil || minutes < 1 || 60%minutes != 0 {
		t.Fatalf("schedule %q is not */N * * * * with N a divisor of 60", schedule)
	}
	return time.Duration(minutes) * time.Minute
}

// dockerTargets reads the Dockerfile: for each stage built from the build
// stage, the files it copies from there, each with the ./cmd package that
// the build stage compiles to it.
func dockerTargets(t *testing.T) map[string]map[string]string {
	t.Helper()
	data, err := os.ReadFile("../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	from := regexp.MustCompile(`(?i)^FROM\s+\S+\s+AS\s+(\S+)`)
	build := regexp.MustCompile(`\bgo build\b.*\s-o\s+(\S+)\s+(\./cmd/\S+)`)
	copyFrom := regexp.MustCompile(`^COPY\s+--from=(\S+)\s+(\S+)\s+(\S+)$`)
	built := map[string]string{}
	targets := map[string]map[string]string{}
	stage := ""
	for _, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if m := from.FindStringSubmatch(line); m != nil {
			stage = m[1]
			continue
		}
		if m := build.FindStringSubmatch(line); m != nil {
			built[stage+":"+m[1]] = m[2]
		}
		if m := copyFrom.FindStringSubmatch(line); m != nil {
			if targets[stage] == nil {
				targets[stage] = map[string]string{}
			}
			targets[stage][m[3]] = built[m[1]+":"+m[2]]
		}
	}
	return targets
}

// TestImagesHoldCommands: every container of the install variants and
// the optional components runs a program that the Dockerfile's target of
// its image (ghcr.io/topodra/topodra-<target>) copies in, built from a
// package of cmd/, and hack/build-images.sh builds each such target.
func TestImagesHoldCommands(t *testing.T) {
	targets := dockerTargets(t)
	script, err := os.ReadFile("../hack/build-images.sh")
	if err != nil {
		t.Fatal(err)
	}
	loop := regexp.MustCompile(`(?m)^for target in ([a-z -]+); do`).FindSubmatch(script)
	if loop == nil {
		t.Fatal("hack/build-images.sh has no loop over its targets")
	}
	scripted := strings.Fields(string(loop[1]))
	seen := 0
	for _, dir := range overlayDirs() {
		r := renderComposed(t, dir, prefixed("components/", Optional)...)
		for _, obj := range r.objs {
			var spec *v1.PodSpec
			switch o := obj.(type) {
			case *appsv1.Deployment:
				spec = &o.Spec.Template.Spec
			case *appsv1.DaemonSet:
				spec = &o.Spec.Template.Spec
			case *batchv1.CronJob:
				spec = &o.Spec.JobTemplate.Spec.Template.Spec
			default:
				continue
			}
			for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
				name, _, _ := strings.Cut(c.Image, ":")
				target, ok := strings.CutPrefix(name, "ghcr.io/topodra/topodra-")
				if !ok {
					t.Errorf("%s: container %s runs image %s, not one of topodra's", dir, c.Name, c.Image)
					continue
				}
				seen++
				if !slices.Contains(scripted, target) {
					t.Errorf("%s: image %s is the Dockerfile's target %s, which hack/build-images.sh does not build (it builds %v)", dir, c.Image, target, scripted)
				}
				if len(c.Command) == 0 {
					t.Errorf("%s: container %s names no command", dir, c.Name)
					continue
				}
				pkg := targets[target][c.Command[0]]
				if pkg == "" {
					t.Errorf("%s: container %s runs %s, which the Dockerfile's target %s does not copy from a go build of ./cmd (it has %v)", dir, c.Name, c.Command[0], target, targets[target])
					continue
				}
				if _, err := os.Stat(filepath.Join("..", pkg)); err != nil {
					t.Errorf("%s: %s is built from %s: %v", dir, c.Command[0], pkg, err)
				}
			}
		}
	}
	if seen < 3*len(Overlays) {
		t.Errorf("checked %d containers, want the scheduler's, the agent's and the checker's of every overlay", seen)
	}
}

func prefixed(prefix string, names []string) []string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = prefix + n
	}
	return out
}

// TestDocumentedMonitoringLabel: the patch that docs/operations.md gives
// for a Prometheus that selects PodMonitors and PrometheusRules by label
// (kube-prometheus-stack's release label) labels those, and nothing else.
func TestDocumentedMonitoringLabel(t *testing.T) {
	patch := documentedPatch(t, "a patch of the monitoring kinds", "group: "+monitoringGroup)
	data, err := renderMine("overlays/host", []string{"components/monitoring"}, patch)
	if err != nil {
		t.Fatalf("the documented patch: %v", err)
	}
	labelled := 0
	for _, head := range documents(data) {
		_, has := head.Metadata.Labels["release"]
		if monitoring := strings.HasPrefix(head.APIVersion, monitoringGroup+"/"); has != monitoring {
			t.Errorf("%s %s: release label %v, want it on the Prometheus operator's kinds only", head.Kind, head.Metadata.Name, has)
		}
		if has {
			labelled++
		}
	}
	if labelled != 3 {
		t.Errorf("%d objects labelled, want the 2 PodMonitors and the PrometheusRule", labelled)
	}
}
