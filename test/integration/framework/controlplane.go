// Package framework runs a real Kubernetes control plane in process for
// topodra's integration tests, benchmarks and simulator: embedded etcd,
// kube-apiserver (serving resource.k8s.io/v1), the ResourceClaim controller
// and any number of schedulers (topodra-scheduler or stock kube-scheduler)
// started from their real commands.
package framework

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/google/uuid"
	"k8s.io/apiserver/pkg/storage/etcd3/testserver"
	"k8s.io/apiserver/pkg/storage/storagebackend"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/klog/v2"
	kubeapiservertesting "k8s.io/kubernetes/cmd/kube-apiserver/app/testing"
	"k8s.io/kubernetes/pkg/controller/resourceclaim"
)

// ControlPlane is a running etcd + kube-apiserver pair.
type ControlPlane struct {
	// Config is an admin client config for the apiserver.
	Config *rest.Config
	// Client is an admin clientset.
	Client kubernetes.Interface
	// Kubeconfig is the path of a kubeconfig file for Config, usable by
	// components that take --kubeconfig or clientConnection.kubeconfig.
	Kubeconfig string
	// Dir is a scratch directory removed at teardown.
	Dir string

	tb       testing.TB
	tearDown func()
	mu       sync.Mutex
	stops    []func()
}

// Start starts embedded etcd and a kube-apiserver. Everything is torn down by
// tb's cleanup (for a *testing.T: at the end of the test; for a ProcessTB: on
// Close), components started through the ControlPlane first.
//
// Admission plugins that need controllers we do not run are disabled:
// ServiceAccount (no token controller, no default ServiceAccount) and
// TaintNodesByCondition (no node lifecycle controller to lift the not-ready
// taint from nodes the tests create).
func Start(tb testing.TB, extraFlags ...string) (*ControlPlane, error) {
	etcdConfig := testserver.NewTestConfig(tb)
	testserver.RunEtcd(tb, etcdConfig)

	storage := storagebackend.NewDefaultConfig("/"+uuid.New().String()+"/registry", nil)
	storage.Transport.ServerList = []string{etcdConfig.ListenClientUrls[0].String()}

	flags := append([]string{
		"--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
		"--enable-priority-and-fairness=false",
	}, extraFlags...)
	server, err := kubeapiservertesting.StartTestServer(tb, kubeapiservertesting.NewDefaultTestServerOptions(), flags, storage)
	if err != nil {
		return nil, fmt.Errorf("start kube-apiserver: %w", err)
	}
	cp := &ControlPlane{tb: tb, tearDown: server.TearDownFn, Dir: tb.TempDir()}
	// Stop watchers before the apiserver: otherwise its shutdown waits for
	// their long-running requests (~60 s).
	tb.Cleanup(cp.stop)

	cfg := rest.CopyConfig(server.ClientConfig)
	cfg.QPS = 5000
	cfg.Burst = 10000
	cp.Config = cfg
	cp.Client, err = kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("create client: %w", err)
	}
	cp.Kubeconfig = filepath.Join(cp.Dir, "kubeconfig")
	if err := WriteKubeconfig(cfg, cp.Kubeconfig); err != nil {
		return nil, err
	}
	return cp, nil
}

// WriteKubeconfig writes a kubeconfig file for cfg. The apiserver's loopback
// certificate is issued for cfg.ServerName, not for 127.0.0.1, so the file
// carries tls-server-name.
func WriteKubeconfig(cfg *rest.Config, path string) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["topodra"] = &clientcmdapi.Cluster{
		Server:                   cfg.Host,
		CertificateAuthorityData: cfg.TLSClientConfig.CAData,
		TLSServerName:            cfg.TLSClientConfig.ServerName,
		InsecureSkipTLSVerify:    cfg.TLSClientConfig.Insecure,
	}
	kc.AuthInfos["admin"] = &clientcmdapi.AuthInfo{
		Token:                 cfg.BearerToken,
		ClientCertificateData: cfg.TLSClientConfig.CertData,
		ClientKeyData:         cfg.TLSClientConfig.KeyData,
	}
	kc.Contexts["topodra"] = &clientcmdapi.Context{Cluster: "topodra", AuthInfo: "admin"}
	kc.CurrentContext = "topodra"
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("write kubeconfig: %w", err)
	}
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		return fmt.Errorf("write kubeconfig %s: %w", path, err)
	}
	return nil
}

// AddStop registers a function that stops a component; all run (last first)
// before the apiserver shuts down.
func (cp *ControlPlane) AddStop(stop func()) {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	cp.stops = append(cp.stops, stop)
}

func (cp *ControlPlane) stop() {
	cp.mu.Lock()
	stops := cp.stops
	cp.stops = nil
	cp.mu.Unlock()
	for i := len(stops) - 1; i >= 0; i-- {
		stops[i]()
	}
	if cp.tearDown != nil {
		cp.tearDown()
	}
}

// StartClaimController runs the upstream ResourceClaim controller, which
// creates claims from ResourceClaimTemplates for pods and removes pods from
// reservedFor when they are done. The returned function stops it; it is also
// stopped at teardown.
func (cp *ControlPlane) StartClaimController(ctx context.Context) (func(), error) {
	ctx, cancel := context.WithCancel(ctx)
	logger := klog.FromContext(ctx).WithName("resourceclaim-controller")
	factory := informers.NewSharedInformerFactory(cp.Client, 0)
	ctrl, err := resourceclaim.NewController(logger, cp.Client,
		factory.Core().V1().Pods(),
		nil, // PodGroups: only used with the GenericWorkload feature, which is off.
		factory.Resource().V1().ResourceClaims(),
		factory.Resource().V1().ResourceClaimTemplates())
	if err != nil {
		cancel()
		return nil, fmt.Errorf("create resourceclaim controller: %w", err)
	}
	factory.Start(ctx.Done())
	var wg sync.WaitGroup
	wg.Go(func() { ctrl.Run(klog.NewContext(ctx, logger), 5) })
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			wg.Wait()
			factory.Shutdown()
		})
	}
	cp.AddStop(stop)
	return stop, nil
}
