// Package monitoring holds the test of the monitoring component's alert
// rules against the metrics that topodra's binaries register. It lives
// apart from package manifests: it links the node agent (go-nvml's cgo
// bindings), which cannot share a test binary with kustomize.
package monitoring

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/legacyregistry"
	"k8s.io/klog/v2/ktesting"
	schedulermetrics "k8s.io/kubernetes/pkg/scheduler/metrics"
	"sigs.k8s.io/yaml"

	// What the scheduler's main and the agent's command import for their
	// metrics: client-go's (REST requests, leader election) and the
	// build's version.
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"

	"github.com/topodra/topodra/manifests"
	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/plugins/topologydra"
)

// The jobs that the PodMonitors give (manifests/components_test.go
// checks that the alerts select only these).
const (
	schedulerJob = "topodra-scheduler"
	agentJob     = "topodra-node-agent"
)

// targetLabels are the labels that the Prometheus operator gives every
// series of a PodMonitor's targets.
var targetLabels = []string{"job", "namespace", "pod", "container", "endpoint", "instance"}

// upstream are the series that come from no binary's registry: "up",
// which Prometheus writes for every target it scrapes, with the target's
// labels only.
var upstream = map[string][]string{"up": nil}

// stateMetric is a series of kube-state-metrics that alerts use: its
// labels and, where it writes only some values of a label, those values
// (kube-state-metrics' documentation, and its source for the values).
type stateMetric struct {
	labels []string
	values map[string][]string
}

// stateMetrics are the series of kube-state-metrics that alerts use. They
// describe objects, so an alert selects them by object, not by the job
// that scrapes kube-state-metrics, whose name each installation chooses.
var stateMetrics = map[string]stateMetric{
	"kube_cronjob_created":                     {labels: []string{"namespace", "cronjob"}},
	"kube_cronjob_status_last_successful_time": {labels: []string{"namespace", "cronjob"}},
	"kube_job_created":                         {labels: []string{"namespace", "job_name"}},
	"kube_job_owner":                           {labels: []string{"namespace", "job_name", "owner_kind", "owner_name", "owner_is_controller"}},
	"kube_job_failed": {
		labels: []string{"namespace", "job_name", "condition"},
		values: map[string][]string{"condition": {"true", "false", "unknown"}},
	},
	// The reasons of a Failed condition that it knows, each 1 or 0, or
	// "" with the count of failed pods for any other reason.
	"kube_job_status_failed": {
		labels: []string{"namespace", "job_name", "reason"},
		values: map[string][]string{"reason": {"BackoffLimitExceeded", "DeadlineExceeded", "Evicted", ""}},
	},
}

// stateMetricsJob stands for the job of kube-state-metrics' targets.
const stateMetricsJob = "kube-state-metrics"

// metric is what the binaries register under one name.
type metric struct {
	labels []string
	// values, where known, are every value of a label: the agent's
	// collector reports each of its states and reasons at every scrape.
	values map[string][]string
	// jobs are the jobs whose targets serve it.
	jobs []string
}

// registered returns the metrics of both binaries by name.
func registered(t *testing.T) map[string]*metric {
	t.Helper()
	out := map[string]*metric{}
	add := func(name string, labels []string, jobs ...string) *metric {
		m := out[name]
		if m == nil {
			m = &metric{values: map[string][]string{}}
			out[name] = m
		}
		for _, l := range labels {
			if !slices.Contains(m.labels, l) {
				m.labels = append(m.labels, l)
			}
		}
		for _, j := range jobs {
			if !slices.Contains(m.jobs, j) {
				m.jobs = append(m.jobs, j)
			}
		}
		return m
	}

	// The scheduler: TopologyDRA's metrics (registered as the package
	// loads), kube-scheduler's (scheduler.New registers them) and
	// client-go's leader election's (registered as the first elector is
	// made, as kube-scheduler's Run makes one), all in legacyregistry,
	// beside the process's and client-go's REST client's (registered as
	// the first client is made, as both binaries make theirs).
	if _, err := kubernetes.NewForConfig(&rest.Config{Host: "https://127.0.0.1:1"}); err != nil {
		t.Fatal(err)
	}
	schedulermetrics.Register()
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: metav1.NamespaceSystem, Name: schedulerJob},
		LockConfig: resourcelock.ResourceLockConfig{Identity: "test"},
	}
	if _, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock: lock, LeaseDuration: 15 * time.Second, RenewDeadline: 10 * time.Second, RetryPeriod: 2 * time.Second,
		Callbacks: leaderelection.LeaderCallbacks{OnStartedLeading: func(context.Context) {}, OnStoppedLeading: func() {}},
		Name:      "kube-scheduler",
	}); err != nil {
		t.Fatal(err)
	}
	legacy, ok := legacyregistry.Registerer().(prometheus.Collector)
	if !ok {
		t.Fatalf("legacyregistry's registerer is a %T, not a collector", legacyregistry.Registerer())
	}
	descs := make(chan *prometheus.Desc)
	go func() {
		legacy.Describe(descs)
		close(descs)
	}()
	for d := range descs {
		name, labels, err := parseDesc(d)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case strings.HasPrefix(name, "topodra_agent_"):
			add(name, labels, agentJob)
		case strings.HasPrefix(name, "topodra_"), strings.HasPrefix(name, "scheduler_"), strings.HasPrefix(name, "leader_election_"),
			strings.HasPrefix(name, "go_"):
			// The agent serves legacyregistry without its Go collector
			// (below).
			add(name, labels, schedulerJob)
		default:
			// The process's and client-go's: both binaries.
			add(name, labels, schedulerJob, agentJob)
		}
	}
	// The agent's Go metrics: the Go collector's default set, as its
	// command serves them beside legacyregistry's other metrics.
	goDescs := make(chan *prometheus.Desc)
	go func() {
		collectors.NewGoCollector().Describe(goDescs)
		close(goDescs)
	}()
	for d := range goDescs {
		name, labels, err := parseDesc(d)
		if err != nil {
			t.Fatal(err)
		}
		add(name, labels, agentJob)
	}

	// The agent: the collector its command serves on the health port,
	// gathered from an agent of mock GPUs.
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
	reg := metrics.NewKubeRegistry()
	reg.CustomMustRegister(a.MetricsCollector())
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		var labels []string
		values := map[string][]string{}
		for _, s := range f.GetMetric() {
			for _, lp := range s.GetLabel() {
				if !slices.Contains(labels, lp.GetName()) {
					labels = append(labels, lp.GetName())
				}
				if !slices.Contains(values[lp.GetName()], lp.GetValue()) {
					values[lp.GetName()] = append(values[lp.GetName()], lp.GetValue())
				}
			}
		}
		add(f.GetName(), labels, agentJob).values = values
	}

	// The plugin that the alerts watch in kube-scheduler's per-plugin
	// metrics.
	if m := out["scheduler_unschedulable_pods"]; m != nil {
		m.values["plugin"] = []string{topologydra.Name}
	}
	for name, labels := range upstream {
		add(name, labels, schedulerJob, agentJob)
	}
	cronJob := checkCronJob(t)
	for name, sm := range stateMetrics {
		m := add(name, sm.labels, stateMetricsJob)
		for l, v := range sm.values {
			m.values[l] = v
		}
		// The objects the shipped components create: the CronJob, and
		// the Jobs it owns.
		m.values["namespace"] = []string{metav1.NamespaceSystem}
		if slices.Contains(sm.labels, "cronjob") {
			m.values["cronjob"] = []string{cronJob}
		}
		if slices.Contains(sm.labels, "owner_name") {
			m.values["owner_kind"] = []string{"CronJob"}
			m.values["owner_name"] = []string{cronJob}
		}
	}
	return out
}

// descPattern reads prometheus.Desc's String: its name, constant labels
// and variable labels (constrained ones as c(name)).
var descPattern = regexp.MustCompile(`^Desc\{fqName: "([^"]+)", help: ".*", unit: ".*", constLabels: \{(.*)\}, variableLabels: \{(.*)\}\}$`)

func parseDesc(d *prometheus.Desc) (string, []string, error) {
	m := descPattern.FindStringSubmatch(d.String())
	if m == nil {
		return "", nil, fmt.Errorf("cannot read the descriptor %s", d)
	}
	var labels []string
	for _, c := range strings.Split(m[2], ",") {
		if name, _, ok := strings.Cut(c, "="); ok {
			labels = append(labels, name)
		}
	}
	for _, v := range strings.Split(m[3], ",") {
		if v = strings.TrimSuffix(strings.TrimPrefix(v, "c("), ")"); v != "" {
			labels = append(labels, v)
		}
	}
	return m[1], labels, nil
}

// TestRegistered: the metrics are read as the binaries register them
// (what the other tests rely on).
func TestRegistered(t *testing.T) {
	known := registered(t)
	for name, want := range map[string][]string{
		"topodra_verify_mismatch_total":           nil,
		"topodra_unowned_devices_allocated_total": {"driver"},
		"scheduler_unschedulable_pods":            {"plugin", "profile"},
		"leader_election_master_status":           {"name"},
		"rest_client_requests_total":              {"code", "method", "host"},
		"process_start_time_seconds":              nil,
		"topodra_agent_gpus":                      {"state"},
		"topodra_agent_prepare_errors_total":      {"reason"},
	} {
		m := known[name]
		if m == nil {
			t.Errorf("%s is not registered", name)
			continue
		}
		for _, l := range want {
			if !slices.Contains(m.labels, l) {
				t.Errorf("%s has labels %v, want %s among them", name, m.labels, l)
			}
		}
	}
	if got, want := known["topodra_agent_gpus"].values["state"], agent.GPUStates(); !slices.Equal(slices.Sorted(slices.Values(got)), slices.Sorted(slices.Values(want))) {
		t.Errorf("topodra_agent_gpus states %v, want %v", got, want)
	}
}

// rule is an alert of the shipped PrometheusRule.
type rule struct {
	Alert string `json:"alert"`
	Expr  string `json:"expr"`
}

// shippedRules reads the alerts of the monitoring component.
func shippedRules(t *testing.T) []rule {
	t.Helper()
	data, err := manifests.FS.ReadFile("components/monitoring/prometheusrule.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var pr struct {
		Spec struct {
			Groups []struct {
				Rules []rule `json:"rules"`
			} `json:"groups"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(data, &pr); err != nil {
		t.Fatal(err)
	}
	var out []rule
	for _, g := range pr.Spec.Groups {
		out = append(out, g.Rules...)
	}
	if len(out) == 0 {
		t.Fatal("no rules")
	}
	return out
}

// relabelled returns, by job, the labels that the PodMonitors' relabelings
// add to every series of their targets (the agent's "node").
func relabelled(t *testing.T) map[string][]string {
	t.Helper()
	data, err := manifests.FS.ReadFile("components/monitoring/podmonitors.yaml")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	for _, doc := range strings.Split(string(data), "\n---\n") {
		var pm struct {
			Spec struct {
				Selector struct {
					MatchLabels map[string]string `json:"matchLabels"`
				} `json:"selector"`
				JobLabel            string `json:"jobLabel"`
				PodMetricsEndpoints []struct {
					Relabelings []struct {
						TargetLabel string `json:"targetLabel"`
					} `json:"relabelings"`
				} `json:"podMetricsEndpoints"`
			} `json:"spec"`
		}
		if err := yaml.Unmarshal([]byte(doc), &pm); err != nil {
			t.Fatal(err)
		}
		// The pods' job label is the one the PodMonitor selects them by
		// (manifests/components_test.go checks the pods carry it).
		job := pm.Spec.Selector.MatchLabels[pm.Spec.JobLabel]
		for _, ep := range pm.Spec.PodMetricsEndpoints {
			for _, r := range ep.Relabelings {
				if r.TargetLabel != "" && !strings.HasPrefix(r.TargetLabel, "__") {
					out[job] = append(out[job], r.TargetLabel)
				}
			}
		}
	}
	return out
}

// TestAlertsUseRegisteredMetrics: every metric that an alert's expression
// selects is one that the binaries of the jobs it selects register (or
// Prometheus' "up"), every label it matches or groups by is one of the
// metric's or of the scrape targets', and every value it matches a label
// of the agent's states and reasons with is one the agent reports.
func TestAlertsUseRegisteredMetrics(t *testing.T) {
	c := checker{known: registered(t), relabelled: relabelled(t)}
	if len(c.relabelled[agentJob]) == 0 {
		t.Fatal("the agent's PodMonitor adds no label: the node label is missing")
	}
	for _, r := range shippedRules(t) {
		for _, err := range c.check(r.Expr) {
			t.Errorf("alert %s: %v", r.Alert, err)
		}
	}
}

// TestAlertCheckerFails: the check of TestAlertsUseRegisteredMetrics
// finds what would keep an alert from ever firing.
func TestAlertCheckerFails(t *testing.T) {
	c := checker{known: registered(t), relabelled: relabelled(t)}
	for name, tc := range map[string]struct {
		expr string
		want string
	}{
		"misspelled metric": {
			expr: `topodra_uncertain_allocation_write{job="topodra-scheduler"} > 0`,
			want: "topodra_uncertain_allocation_write is not registered",
		},
		"misspelled label": {
			expr: `topodra_agent_gpus{job="topodra-node-agent", sate="unhealthy"} > 0`,
			want: `label "sate"`,
		},
		"misspelled state": {
			expr: `topodra_agent_gpus{job="topodra-node-agent", state="unhealty"} > 0`,
			want: `state="unhealty"`,
		},
		"another CronJob's name": {
			expr: `time() - kube_cronjob_status_last_successful_time{namespace="kube-system", cronjob="topodra-checker"} > 4500`,
			want: `cronjob="topodra-checker"`,
		},
		"a kube-state-metrics series misspelled": {
			expr: `time() - kube_cronjob_status_last_successfull_time{namespace="kube-system", cronjob="topodra-check"} > 4500`,
			want: `kube_cronjob_status_last_successfull_time is not registered`,
		},
		"a Job owned by another CronJob": {
			expr: `kube_job_failed{namespace="kube-system", condition="true"} == 1 and on (namespace, job_name) kube_job_owner{namespace="kube-system", owner_kind="CronJob", owner_name="topodra-checker"}`,
			want: `owner_name="topodra-checker"`,
		},
		"a condition kube-state-metrics does not write": {
			expr: `kube_job_failed{namespace="kube-system", condition="True"} == 1`,
			want: `condition="True"`,
		},
		"a failure reason misspelled among others": {
			expr: `kube_job_status_failed{namespace="kube-system", reason=~"BackoffLimitExceeded|DeadlineExceed"} == 1`,
			want: `reason is never "DeadlineExceed"`,
		},
		"a Job series by the CronJob's label": {
			expr: `kube_job_failed{namespace="kube-system", cronjob="topodra-check"} == 1`,
			want: `label "cronjob"`,
		},
		"joining on a misspelled label": {
			expr: `kube_job_failed{namespace="kube-system", condition="true"} == 1 and on (namespace, job_nme) kube_job_owner{namespace="kube-system", owner_name="topodra-check"}`,
			want: `grouping by label "job_nme"`,
		},
		"another plugin's name": {
			expr: `scheduler_unschedulable_pods{job="topodra-scheduler", plugin="TopologyDra"} > 0`,
			want: `plugin="TopologyDra"`,
		},
		"agent metric of the scheduler's job": {
			expr: `topodra_agent_nvml_usable{job="topodra-scheduler"} == 0`,
			want: "not by job topodra-scheduler",
		},
		"Go runtime metric the agent does not serve": {
			expr: `rate(go_gc_heap_allocs_bytes_total{job="topodra-node-agent"}[5m]) > 1e9`,
			want: "not by job topodra-node-agent",
		},
		"scheduler metric without a job": {
			expr: `topodra_uncertain_allocation_writes > 0`,
			want: "selects no job",
		},
		"node label on the scheduler": {
			expr: `sum by (node) (topodra_uncertain_allocation_writes{job="topodra-scheduler"}) > 0`,
			want: `label "node"`,
		},
		"misspelled function": {
			expr: `increse(topodra_verify_mismatch_total{job="topodra-scheduler"}[1h]) > 0`,
			want: "function increse",
		},
		"in a binary expression": {
			expr: `rate(rest_client_requests_total{job="topodra-node-agent"}[5m]) / rate(rest_client_request_total{job="topodra-node-agent"}[5m]) > 0.5`,
			want: "rest_client_request_total is not registered",
		},
	} {
		t.Run(name, func(t *testing.T) {
			errs := c.check(tc.expr)
			if !slices.ContainsFunc(errs, func(err error) bool { return strings.Contains(err.Error(), tc.want) }) {
				t.Errorf("check(%s) = %v, want an error with %q", tc.expr, errs, tc.want)
			}
		})
	}
	if errs := c.check(`sum by (node, reason) (rate(topodra_agent_prepare_errors_total{job="topodra-node-agent", reason="device_in_use"}[5m])) > 0`); len(errs) > 0 {
		t.Errorf("a valid expression: %v", errs)
	}
}

// checker checks PromQL expressions against the registered metrics.
type checker struct {
	known map[string]*metric
	// relabelled are the labels that the PodMonitors add, by job.
	relabelled map[string][]string
}

// selector is a metric selector of an expression: the metric and its
// label matchers.
type selector struct {
	metric   string
	matchers []matcher
}

type matcher struct {
	label, op, value string
}

// functions are PromQL's functions and aggregations; a name before "("
// that is not one is a typo, which Prometheus refuses as it loads the
// rules.
var functions = strings.Fields(`abs absent absent_over_time avg_over_time ceil changes clamp clamp_max clamp_min
	count_over_time day_of_month day_of_week day_of_year days_in_month delta deriv exp floor histogram_quantile
	hour idelta increase irate label_join label_replace last_over_time ln log10 log2 max_over_time min_over_time
	minute month predict_linear present_over_time quantile_over_time rate resets round scalar sgn sort sort_desc
	sqrt stddev_over_time stdvar_over_time sum_over_time time timestamp vector year
	sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio`)

// keywords are PromQL's words that are neither metrics nor functions;
// those in grouping take a list of label names.
var (
	keywords = []string{"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}
	grouping = []string{"by", "without", "on", "ignoring", "group_left", "group_right"}
)

// check returns what is wrong with expr.
func (c checker) check(expr string) []error {
	selectors, groups, err := parse(expr)
	if err != nil {
		return []error{err}
	}
	var errs []error
	// The jobs the expression selects, as a whole.
	var jobs []string
	for _, s := range selectors {
		jobs = append(jobs, jobsOf(s)...)
	}
	if len(jobs) == 0 && !c.onlyStateMetrics(selectors) {
		errs = append(errs, fmt.Errorf("%s selects no job (job=%q or job=%q)", expr, schedulerJob, agentJob))
	}
	// Labels that a grouping may name: those of its metrics and targets.
	groupable := slices.Clone(targetLabels)
	for _, s := range selectors {
		m := c.known[s.metric]
		if m == nil {
			errs = append(errs, fmt.Errorf("%s is not registered by topodra-scheduler or topodra-node-agent", s.metric))
			continue
		}
		own := jobsOf(s)
		if len(own) == 0 {
			own = jobs
		}
		if len(own) == 0 && slices.Equal(m.jobs, []string{stateMetricsJob}) {
			own = m.jobs
		}
		allowed := slices.Concat(targetLabels, m.labels)
		for _, j := range own {
			if !slices.Contains(m.jobs, j) {
				errs = append(errs, fmt.Errorf("%s is served by job %v, not by job %s", s.metric, m.jobs, j))
			}
			allowed = append(allowed, c.relabelled[j]...)
		}
		groupable = append(groupable, m.labels...)
		for _, j := range own {
			groupable = append(groupable, c.relabelled[j]...)
		}
		for _, mt := range s.matchers {
			if !slices.Contains(allowed, mt.label) {
				errs = append(errs, fmt.Errorf("%s has no label %q (it has %v)", s.metric, mt.label, allowed))
				continue
			}
			values, ok := m.values[mt.label]
			if !ok {
				continue
			}
			switch {
			case mt.op == "=" && !slices.Contains(values, mt.value):
				errs = append(errs, fmt.Errorf("%s{%s=%q}: %s is never %q (it is one of %v)", s.metric, mt.label, mt.value, mt.label, mt.value, values))
			case mt.op == "=~":
				// An alternation of plain values: each must be one.
				for _, v := range strings.Split(mt.value, "|") {
					if regexp.QuoteMeta(v) == v && !slices.Contains(values, v) {
						errs = append(errs, fmt.Errorf("%s{%s=~%q}: %s is never %q (it is one of %v)", s.metric, mt.label, mt.value, mt.label, v, values))
					}
				}
			}
		}
	}
	for _, l := range groups {
		if !slices.Contains(groupable, l) {
			errs = append(errs, fmt.Errorf("grouping by label %q, which none of the metrics or targets has", l))
		}
	}
	return errs
}

// onlyStateMetrics reports whether every selector is of a
// kube-state-metrics series.
func (c checker) onlyStateMetrics(selectors []selector) bool {
	for _, s := range selectors {
		if m := c.known[s.metric]; m == nil || !slices.Equal(m.jobs, []string{stateMetricsJob}) {
			return false
		}
	}
	return len(selectors) > 0
}

// checkCronJob returns the name of the invariant-check component's
// CronJob.
func checkCronJob(t *testing.T) string {
	t.Helper()
	data, err := manifests.FS.ReadFile("components/invariant-check/invariant-check.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, doc := range strings.Split(string(data), "\n---\n") {
		var obj metav1.PartialObjectMetadata
		if err := yaml.Unmarshal([]byte(doc), &obj); err != nil {
			t.Fatal(err)
		}
		if obj.Kind == "CronJob" {
			return obj.Name
		}
	}
	t.Fatal("the invariant-check component has no CronJob")
	return ""
}

// jobsOf returns the jobs that a selector's job matcher names.
func jobsOf(s selector) []string {
	for _, m := range s.matchers {
		switch {
		case m.label != "job":
		case m.op == "=":
			return []string{m.value}
		case m.op == "=~":
			return strings.Split(m.value, "|")
		}
	}
	return nil
}

// token is one lexical token of PromQL: an identifier, a string (its
// value, unquoted), a number or duration, or punctuation.
type token struct {
	kind string // "ident", "string", "number", "punct"
	text string
}

var (
	identPattern  = regexp.MustCompile(`^[a-zA-Z_:][a-zA-Z0-9_:]*`)
	numberPattern = regexp.MustCompile(`^[0-9.][0-9a-zA-Z.+]*`)
	punctPattern  = regexp.MustCompile(`^(=~|!~|!=|==|<=|>=|[-+*/%^<>=(){}\[\],@:])`)
)

// tokenize splits a PromQL expression into tokens, leaving out comments.
func tokenize(expr string) ([]token, error) {
	var out []token
	for s := strings.TrimSpace(expr); s != ""; s = strings.TrimSpace(s) {
		switch {
		case s[0] == '#':
			_, s, _ = strings.Cut(s, "\n")
		case s[0] == '"' || s[0] == '\'' || s[0] == '`':
			quote := s[0]
			i := 1
			for ; i < len(s) && s[i] != quote; i++ {
				if s[i] == '\\' && quote != '`' {
					i++
				}
			}
			if i >= len(s) {
				return nil, fmt.Errorf("unterminated string in %s", expr)
			}
			out = append(out, token{"string", s[1:i]})
			s = s[i+1:]
		case identPattern.MatchString(s):
			m := identPattern.FindString(s)
			out = append(out, token{"ident", m})
			s = s[len(m):]
		case numberPattern.MatchString(s):
			m := numberPattern.FindString(s)
			out = append(out, token{"number", m})
			s = s[len(m):]
		case punctPattern.MatchString(s):
			m := punctPattern.FindString(s)
			out = append(out, token{"punct", m})
			s = s[len(m):]
		default:
			return nil, fmt.Errorf("cannot read %q in %s", s, expr)
		}
	}
	return out, nil
}

// parse returns the metric selectors of a PromQL expression and the
// labels that its groupings (by, without, on, ignoring, group_left,
// group_right) name. It reads no more of PromQL than that.
func parse(expr string) ([]selector, []string, error) {
	tokens, err := tokenize(expr)
	if err != nil {
		return nil, nil, err
	}
	next := func(i int) token {
		if i+1 < len(tokens) {
			return tokens[i+1]
		}
		return token{}
	}
	var selectors []selector
	var groups []string
	// inRange: within [...] (a range or subquery: durations only).
	inRange := 0
	for i := 0; i < len(tokens); i++ {
		tok := tokens[i]
		switch {
		case tok.kind == "punct" && tok.text == "[":
			inRange++
		case tok.kind == "punct" && tok.text == "]":
			inRange--
		case tok.kind == "punct" && tok.text == "{":
			return nil, nil, fmt.Errorf("a selector without a metric name in %s", expr)
		case tok.kind != "ident" || inRange > 0:
		case slices.Contains(grouping, tok.text):
			if next(i).text != "(" {
				// group_left and group_right may stand alone.
				continue
			}
			for i += 2; i < len(tokens) && tokens[i].text != ")"; i++ {
				if tokens[i].kind == "ident" {
					groups = append(groups, tokens[i].text)
				}
			}
		case slices.Contains(keywords, strings.ToLower(tok.text)):
		case slices.Contains(functions, tok.text) && (next(i).text == "by" || next(i).text == "without"):
			// An aggregation with its grouping first.
		case next(i).text == "(":
			if !slices.Contains(functions, tok.text) {
				return nil, nil, fmt.Errorf("function %s is not PromQL's, in %s", tok.text, expr)
			}
		default:
			s := selector{metric: tok.text}
			if next(i).text == "{" {
				i += 2
				for ; i < len(tokens) && tokens[i].text != "}"; i++ {
					if tokens[i].text == "," {
						continue
					}
					if i+2 >= len(tokens) || tokens[i].kind != "ident" || tokens[i+1].kind != "punct" || tokens[i+2].kind != "string" {
						return nil, nil, fmt.Errorf("cannot read the matchers of %s in %s", s.metric, expr)
					}
					s.matchers = append(s.matchers, matcher{tokens[i].text, tokens[i+1].text, tokens[i+2].text})
					i += 2
				}
			}
			selectors = append(selectors, s)
		}
	}
	return selectors, groups, nil
}
