package cluster

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	componentbaseconfig "k8s.io/component-base/config"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/cmd/kube-scheduler/app/options"
)

// The leaderElection section that writeSchedulerConfig writes is what
// kube-scheduler's own loader reads: off by default, and with a Lease of the
// given name and durations when asked for.
func TestWriteSchedulerConfigLeaderElection(t *testing.T) {
	defaults := componentbaseconfig.LeaderElectionConfiguration{
		LeaderElect:       false,
		LeaseDuration:     metav1.Duration{Duration: 15 * time.Second},
		RenewDeadline:     metav1.Duration{Duration: 10 * time.Second},
		RetryPeriod:       metav1.Duration{Duration: 2 * time.Second},
		ResourceLock:      "leases",
		ResourceName:      "kube-scheduler",
		ResourceNamespace: "kube-system",
	}
	for name, tc := range map[string]struct {
		config   string
		election *LeaderElection
		want     func(*componentbaseconfig.LeaderElectionConfiguration)
	}{
		"default off, even if the config asks for it": {
			config: DefaultStockConfig + "leaderElection:\n  leaderElect: true\n",
			want:   func(*componentbaseconfig.LeaderElectionConfiguration) {},
		},
		"on with a lease and durations": {
			config:   DefaultStockConfig,
			election: &LeaderElection{Namespace: "ns", Name: "lease", LeaseDuration: 4 * time.Second, RenewDeadline: 2 * time.Second, RetryPeriod: time.Second},
			want: func(le *componentbaseconfig.LeaderElectionConfiguration) {
				le.LeaderElect = true
				le.ResourceNamespace, le.ResourceName = "ns", "lease"
				le.LeaseDuration.Duration, le.RenewDeadline.Duration, le.RetryPeriod.Duration = 4*time.Second, 2*time.Second, time.Second
			},
		},
		"on with default durations": {
			config:   DefaultStockConfig,
			election: &LeaderElection{Namespace: "ns", Name: "lease"},
			want: func(le *componentbaseconfig.LeaderElectionConfiguration) {
				le.LeaderElect = true
				le.ResourceNamespace, le.ResourceName = "ns", "lease"
			},
		},
	} {
		t.Run(name, func(t *testing.T) {
			c := &Cluster{Dir: t.TempDir(), Kubeconfig: "/kubeconfig"}
			path, err := c.writeSchedulerConfig("sched", []byte(tc.config), tc.election, "")
			if err != nil {
				t.Fatal(err)
			}
			cfg, err := options.LoadConfigFromFile(klog.Background(), path)
			if err != nil {
				t.Fatalf("kube-scheduler cannot load the written config: %v", err)
			}
			want := defaults
			tc.want(&want)
			if diff := cmp.Diff(want, cfg.LeaderElection); diff != "" {
				t.Errorf("leaderElection (-want +got):\n%s", diff)
			}
			if cfg.ClientConnection.Kubeconfig != "/kubeconfig" {
				t.Errorf("kubeconfig %q, want /kubeconfig", cfg.ClientConnection.Kubeconfig)
			}
		})
	}
	c := &Cluster{Dir: t.TempDir()}
	if _, err := c.writeSchedulerConfig("sched", []byte(DefaultStockConfig), &LeaderElection{Name: "lease"}, ""); err == nil {
		t.Error("a lease without a namespace was accepted")
	}
}
