package invariant

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Exit codes of [Run].
const (
	ExitClean      = 0
	ExitViolations = 1
	ExitError      = 2
)

// Defaults of Run's --kube-api-qps and --kube-api-burst: the most list
// requests per second, and at once, that its client sends. Run lists one
// page after another, so the rate stays below this wherever a page takes
// the API server more than 20 ms; client-go's own defaults (5 and 10)
// would make a read of 300 pages take a minute however fast the server.
const (
	DefaultKubeAPIQPS   = 50
	DefaultKubeAPIBurst = 100
)

// Run is the topodra-check command line: it checks the cluster named by
// --kubeconfig / --context (default: $KUBECONFIG, ~/.kube/config or the
// in-cluster configuration) with [CheckWith], as many reads and as far
// apart as --reads and --interval say (default: as [Check]),
// prints every confirmed violation on stdout (text, or JSON with -o json)
// and returns ExitViolations if there is one and ExitClean if there is
// none. A pending violation (see [Report.Pending]) is noted on stderr and
// does not change the exit code; JSON lists it too, with "pending": true
// and why in "pendingReason" (the violations have "pending": false). It
// returns ExitError if the flags are
// wrong or the cluster could not be read, the reason on stderr; when a
// re-read failed ([IncompleteError]) it first prints the violations found
// so far on stdout, marked unconfirmed (the text ends with
// "unconfirmed: a re-read failed"; in JSON each violation has
// "confirmed": false). A check that runs out of --timeout returns
// ExitError in the same way (on stdout only if a re-read was cut short),
// and says so on stderr's last line. It takes no positional arguments.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	c, code, ok := parse(args, stderr)
	if !ok {
		return code
	}
	cfg, err := c.restConfig()
	if err != nil {
		fmt.Fprintf(stderr, "topodra-check: load kubeconfig: %v\n", err)
		return ExitError
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		fmt.Fprintf(stderr, "topodra-check: create client: %v\n", err)
		return ExitError
	}
	if c.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = withTimeout(ctx, c.timeout)
		defer cancel()
	}
	return check(ctx, client, c.opts, c.output, stdout, stderr)
}

// command is what Run's flags ask for.
type command struct {
	kubeconfig, context string
	output              string
	opts                CheckOptions
	// qps and burst are the client's rate limits.
	qps   float32
	burst int
	// timeout bounds the whole check; 0: no bound.
	timeout time.Duration
}

// parse reads Run's flags. Where Run is done (help, or flags it refuses,
// the reason on stderr) ok is false and code is Run's exit code.
func parse(args []string, stderr io.Writer) (c command, code int, ok bool) {
	fs := pflag.NewFlagSet("topodra-check", pflag.ContinueOnError)
	fs.SetOutput(stderr)
	kubeconfig := fs.String("kubeconfig", "", "Kubeconfig file. Empty: $KUBECONFIG, ~/.kube/config, or the in-cluster configuration.")
	kubeContext := fs.String("context", "", "Kubeconfig context. Empty: the current context.")
	output := fs.StringP("output", "o", "text", "Output format: text or json.")
	reads := fs.Int("reads", DefaultReads, "The most times the cluster is read: a violation must be found again by the second read, a StaleReservation by every read. At least 2.")
	interval := fs.Duration("interval", DefaultInterval, "The wait before each read after the first. More than 0.")
	staleAfter := fs.Duration("stale-after", DefaultStaleAfter, "How long the pods of a claim reserved only for pods that are done or gone must have been so before it is reported (StaleReservation), and how long the reads must find a claim allocated for no one (UnreservedAllocation); until then it is noted on stderr. A pod that succeeded or failed counts from its containers' latest finishedAt (or its conditions' latest change), a pod deleted before it was bound from its deletionTimestamp; a pod that is gone, or records no such time, from the first read, so such a claim is reported only if the reads span this time (e.g. --reads 6 --interval 2m: five waits, 10m). The resourceclaim controller clears reservations at kube-controller-manager's client rate (20 QPS by default), which takes minutes after thousands of pods finish. 0: report once every read finds it.")
	unpublishedAfter := fs.Duration("unpublished-after", DefaultUnpublishedAfter, "How long the reads must find a pool without any ResourceSlice whose devices are allocated before it is reported (UnpublishedPool); until then it is noted on stderr. Nothing records when a pool's slices went, so the time counts from the first read that found it: such a pool is reported only if the reads span this time (e.g. --reads 6 --interval 1m: five waits, 5m). The kubelet removes a node's slices when it starts and 30 s after a driver unregisters, and a deleted Node takes its slices (its pods are deleted within minutes). 0: report once every read finds it.")
	qps := fs.Float32("kube-api-qps", DefaultKubeAPIQPS, fmt.Sprintf("The most list requests per second that the client sends to the API server (a request reads a page of %d objects). More than 0.", DefaultPageSize))
	burst := fs.Int("kube-api-burst", DefaultKubeAPIBurst, "The most list requests that the client sends at once, above --kube-api-qps. At least 1.")
	timeout := fs.Duration("timeout", 0, "The most time the check takes: when it is up, the check stops and exits with code 2, printing the violations found so far marked unconfirmed, as when a re-read fails. Set it below the activeDeadlineSeconds of a Job that runs the check: a Job past its deadline deletes its pod and the pod's log. 0: no bound.")
	fs.Usage = func() {
		fmt.Fprintf(stderr, `Usage: topodra-check [flags]

Checks the DRA allocation invariants of a cluster: no device allocated twice
(unless it allows multiple allocations and each is a share with a share ID),
no shared counter or shared device capacity consumed beyond what its pool
publishes, no allocation of a device that no ResourceSlice publishes, no pod
bound while a claim it uses is unallocated, reserved neither for it nor
for its PodGroup, or allocated for another node (by its allocation's node
selector, or by its devices' own), no claim allocated and
reserved only for pods that are gone or done (its devices held for no one:
the resourceclaim controller of kube-controller-manager is not cleaning
up), no claim allocated devices that its spec does not allow (a request
it does not have, more or fewer devices than a request's count, a device
that does not match the selectors of its request or its DeviceClass,
devices that break a matchAttribute constraint), no device allocated
although it had, more than %s before the allocation, a NoSchedule or
NoExecute taint (of its ResourceSlice or of a DeviceTaintRule) that the
allocation does not tolerate. A violation is reported only if a second
read (--interval later) finds it again, and such a claim reserved for no
one only if every read (--reads) does and its pods have been done for
--stale-after, and allocated devices of a pool without any ResourceSlice
only if the reads span --unpublished-after (the kubelet removes a
node's slices when it starts and when a driver unregisters; a deleted
Node takes its slices). Noted on stderr, not reported: an allocated
device missing from a pool that its driver is still republishing, such
a pool found without slices for a shorter time, and a claim reserved
for no one whose pods stopped more recently. With -o json these are
listed too, with "pending": true.

Exit code 0: none found; 1: violations (printed); 2: bad flags, or the
cluster could not be read, or --timeout ran out (the reason on stderr; if
a re-read failed or was cut short, the violations found so far are
printed, marked unconfirmed). Needs list on
resourceslices, and on pods and resourceclaims in all namespaces; without
list on nodes, pods on another node than their claims' devices are not
looked for, without list on deviceclasses the selectors of classes are
not checked, and without list on devicetaintrules only the taints of
ResourceSlices are checked (each noted on stderr). A selector that does
not compile or evaluate, or a class changed after the claim was created,
leaves that part of a claim unchecked, and so does an untolerated taint
where the taint or the allocation records no time (noted on stderr).

Flags:
`, AllocationLag)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if err == pflag.ErrHelp {
			return c, ExitClean, false
		}
		fmt.Fprintf(stderr, "topodra-check: %v\nRun 'topodra-check --help' for usage.\n", err)
		return c, ExitError, false
	}
	refuse := func(format string, a ...any) (command, int, bool) {
		fmt.Fprintf(stderr, "topodra-check: "+format+"\n", a...)
		return c, ExitError, false
	}
	if rest := fs.Args(); len(rest) > 0 {
		return refuse("takes no arguments, got %q; to check the cluster of a kubeconfig file, use --kubeconfig %s", rest, rest[0])
	}
	switch {
	case *reads < 2:
		return refuse("--reads must be at least 2 (a read and one that confirms it), not %d", *reads)
	case *interval <= 0:
		return refuse("--interval must be more than 0, not %s", *interval)
	case *staleAfter < 0:
		return refuse("--stale-after must not be negative, not %s", *staleAfter)
	case *unpublishedAfter < 0:
		return refuse("--unpublished-after must not be negative, not %s", *unpublishedAfter)
	case *output != "text" && *output != "json":
		return refuse("--output must be text or json, not %q", *output)
	case !(*qps > 0):
		return refuse("--kube-api-qps must be more than 0, not %v", *qps)
	case *burst < 1:
		return refuse("--kube-api-burst must be at least 1, not %d", *burst)
	case *timeout < 0:
		return refuse("--timeout must not be negative, not %s", *timeout)
	}
	c = command{
		kubeconfig: *kubeconfig,
		context:    *kubeContext,
		output:     *output,
		opts:       CheckOptions{Reads: *reads, Interval: *interval, StaleAfter: *staleAfter, UnpublishedAfter: *unpublishedAfter},
		qps:        *qps,
		burst:      *burst,
		timeout:    *timeout,
	}
	// CheckOptions asks for no wait with a negative StaleAfter or
	// UnpublishedAfter.
	if *staleAfter == 0 {
		c.opts.StaleAfter = -1
	}
	if *unpublishedAfter == 0 {
		c.opts.UnpublishedAfter = -1
	}
	return c, 0, true
}

// restConfig is the client configuration of the cluster that --kubeconfig
// and --context name, with the rate limits of --kube-api-qps and
// --kube-api-burst.
func (c command) restConfig() (*rest.Config, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = c.kubeconfig
	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: c.context}).ClientConfig()
	if err != nil {
		return nil, err
	}
	cfg.QPS, cfg.Burst = c.qps, c.burst
	return cfg, nil
}

// timeoutError is the cause of the end of a check that ran out of
// --timeout.
type timeoutError struct {
	timeout time.Duration
}

func (e timeoutError) Error() string {
	return fmt.Sprintf("the check ran out of its --timeout of %s before its reads were done (docs/operations.md, \"Sizing the invariant check\", says what to change)", e.timeout)
}

// withTimeout is ctx ending after timeout, with a timeoutError as its
// cause.
func withTimeout(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeoutCause(ctx, timeout, timeoutError{timeout})
}

// check is Run once the flags are read and the client is made.
func check(ctx context.Context, client kubernetes.Interface, opts CheckOptions, output string, stdout, stderr io.Writer) int {
	report, err := CheckWith(ctx, client, opts)
	var timedOut timeoutError
	if err != nil && errors.As(context.Cause(ctx), &timedOut) {
		defer fmt.Fprintf(stderr, "topodra-check: %v\n", timedOut)
	}
	var incomplete *IncompleteError
	if err != nil && !errors.As(err, &incomplete) {
		fmt.Fprintf(stderr, "topodra-check: %v\n", err)
		return ExitError
	}
	for _, p := range report.Pending {
		fmt.Fprintf(stderr, "topodra-check: not reported, %s: %s\n", p.Why, p.Violation)
	}
	for _, why := range report.NotJudged {
		fmt.Fprintf(stderr, "topodra-check: %s\n", why)
	}
	if werr := write(stdout, output, report.Violations, report.Pending, incomplete == nil); werr != nil {
		fmt.Fprintf(stderr, "topodra-check: write: %v\n", werr)
		return ExitError
	}
	if incomplete != nil {
		fmt.Fprintf(stderr, "topodra-check: %v\n", incomplete)
		return ExitError
	}
	if len(report.Violations) > 0 {
		return ExitViolations
	}
	return ExitClean
}

// unconfirmedText ends the text output when a re-read failed.
const unconfirmedText = ", unconfirmed: a re-read failed"

// jsonViolation is a violation as -o json prints it: its fields, whether
// every read found it (false when a re-read failed), and whether it is
// pending (not reported, see [Report.Pending]) and why.
type jsonViolation struct {
	Violation
	Confirmed     bool   `json:"confirmed"`
	Pending       bool   `json:"pending"`
	PendingReason string `json:"pendingReason,omitempty"`
}

// write prints violations as text or, with format json, as a JSON array
// of the violations followed by the pending ones (text leaves those to
// stderr); confirmed is false when a re-read failed, and the output says
// so.
func write(w io.Writer, format string, violations []Violation, pending []PendingViolation, confirmed bool) error {
	if format == "json" {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		out := make([]jsonViolation, 0, len(violations)+len(pending))
		for _, v := range violations {
			out = append(out, jsonViolation{Violation: v, Confirmed: confirmed})
		}
		for _, p := range pending {
			out = append(out, jsonViolation{Violation: p.Violation, Confirmed: confirmed, Pending: true, PendingReason: p.Why})
		}
		return enc.Encode(out)
	}
	suffix := ""
	if !confirmed {
		suffix = unconfirmedText
	}
	if len(violations) == 0 {
		_, err := fmt.Fprintf(w, "no violations%s\n", suffix)
		return err
	}
	for _, v := range violations {
		if _, err := fmt.Fprintln(w, v); err != nil {
			return err
		}
	}
	_, err := fmt.Fprintf(w, "%d violation(s)%s\n", len(violations), suffix)
	return err
}
