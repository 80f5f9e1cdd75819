package invariant

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clienttesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// writeKubeconfig writes a kubeconfig of one cluster that nothing serves
// and returns its path.
func writeKubeconfig(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	cfg := clientcmdapi.Config{
		Clusters:       map[string]*clientcmdapi.Cluster{"c": {Server: "https://127.0.0.1:1"}},
		AuthInfos:      map[string]*clientcmdapi.AuthInfo{"u": {Token: "t"}},
		Contexts:       map[string]*clientcmdapi.Context{"c": {Cluster: "c", AuthInfo: "u"}},
		CurrentContext: "c",
	}
	if err := clientcmd.WriteToFile(cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestCommandClientFlags: --kube-api-qps and --kube-api-burst set the
// rate limits of the client's configuration (DefaultKubeAPIQPS and
// DefaultKubeAPIBurst without them), --timeout bounds the check, and
// values that would stall the client, lift its limit or end the check at
// once are refused.
func TestCommandClientFlags(t *testing.T) {
	kubeconfig := writeKubeconfig(t)
	for name, tc := range map[string]struct {
		args        []string
		wantQPS     float32
		wantBurst   int
		wantTimeout time.Duration
		// wantErr, if set, is in the message of flags that are refused.
		wantErr string
	}{
		"defaults": {wantQPS: DefaultKubeAPIQPS, wantBurst: DefaultKubeAPIBurst},
		"set": {
			args:    []string{"--kube-api-qps=20.5", "--kube-api-burst", "40", "--timeout=25m"},
			wantQPS: 20.5, wantBurst: 40, wantTimeout: 25 * time.Minute,
		},
		"no qps":         {args: []string{"--kube-api-qps=0"}, wantErr: "--kube-api-qps must be more than 0"},
		"negative qps":   {args: []string{"--kube-api-qps=-1"}, wantErr: "--kube-api-qps must be more than 0"},
		"no burst":       {args: []string{"--kube-api-burst=0"}, wantErr: "--kube-api-burst must be at least 1"},
		"negative limit": {args: []string{"--timeout=-1s"}, wantErr: "--timeout must not be negative"},
	} {
		t.Run(name, func(t *testing.T) {
			var stderr bytes.Buffer
			c, code, ok := parse(append([]string{"--kubeconfig", kubeconfig}, tc.args...), &stderr)
			if tc.wantErr != "" {
				if ok || code != ExitError || !strings.Contains(stderr.String(), tc.wantErr) {
					t.Errorf("parse: ok %v, code %d, stderr %q; want exit %d and %q", ok, code, stderr.String(), ExitError, tc.wantErr)
				}
				return
			}
			if !ok {
				t.Fatalf("parse: code %d, stderr %q", code, stderr.String())
			}
			if c.timeout != tc.wantTimeout {
				t.Errorf("timeout %s, want %s", c.timeout, tc.wantTimeout)
			}
			cfg, err := c.restConfig()
			if err != nil {
				t.Fatal(err)
			}
			if cfg.QPS != tc.wantQPS || cfg.Burst != tc.wantBurst {
				t.Errorf("client QPS %v and burst %d, want %v and %d", cfg.QPS, cfg.Burst, tc.wantQPS, tc.wantBurst)
			}
			if cfg.Host != "https://127.0.0.1:1" {
				t.Errorf("host %q, want the kubeconfig's", cfg.Host)
			}
		})
	}
}

// TestCommandTimeout: a check that runs out of --timeout exits with
// ExitError; where a re-read is cut short it prints what the reads before
// found, marked unconfirmed; stderr's last line says that --timeout ran
// out.
func TestCommandTimeout(t *testing.T) {
	twice := State{
		Slices: []*resourceapi.ResourceSlice{poolSlice("first", 1, 1, devices("gpu-0")...)},
		Claims: []*resourceapi.ResourceClaim{claim("a", "node-a", "", "gpu-0"), claim("b", "node-a", "", "gpu-0")},
	}
	for name, tc := range map[string]struct {
		// ctx is the context of the check, from a cluster that it reads.
		ctx        func(t *testing.T, c *fakeCluster) context.Context
		timeout    time.Duration
		wantStdout string
	}{
		"during the first read": {
			ctx: func(t *testing.T, _ *fakeCluster) context.Context {
				ctx, cancel := withTimeout(context.Background(), time.Nanosecond)
				t.Cleanup(cancel)
				<-ctx.Done()
				return ctx
			},
			timeout: time.Nanosecond,
		},
		// The wait before the re-read (an hour) outlasts the timeout,
		// which runs out as the first read lists its last kind.
		"while waiting to re-read": {
			ctx: func(t *testing.T, c *fakeCluster) context.Context {
				ctx, cancel := context.WithCancelCause(context.Background())
				t.Cleanup(func() { cancel(nil) })
				c.PrependReactor("list", "devicetaintrules", func(clienttesting.Action) (bool, runtime.Object, error) {
					cancel(timeoutError{25 * time.Minute})
					return false, nil, nil
				})
				return ctx
			},
			timeout:    25 * time.Minute,
			wantStdout: "1 violation(s), unconfirmed: a re-read failed\n",
		},
	} {
		t.Run(name, func(t *testing.T) {
			client := newFakeCluster(fakeRead{state: twice})
			ctx := tc.ctx(t, client)
			var stdout, stderr bytes.Buffer
			code := check(ctx, client, CheckOptions{Interval: time.Hour}, "text", &stdout, &stderr)
			t.Logf("stdout:\n%sstderr:\n%s", stdout.String(), stderr.String())
			if code != ExitError {
				t.Errorf("exit code %d, want %d", code, ExitError)
			}
			if !strings.Contains(stdout.String(), tc.wantStdout) || tc.wantStdout == "" && stdout.Len() > 0 {
				t.Errorf("stdout %q, want %q", stdout.String(), tc.wantStdout)
			}
			lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
			if last := lines[len(lines)-1]; !strings.Contains(last, "ran out of its --timeout of "+tc.timeout.String()) {
				t.Errorf("stderr's last line %q does not say that --timeout ran out", last)
			}
		})
	}
}
