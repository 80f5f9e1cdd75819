// Package cluster runs a Kubernetes control plane inside the calling
// process: embedded etcd (go.etcd.io/etcd/server/v3/embed) and a
// kube-apiserver built from its own options and server chain, serving
// resource.k8s.io/v1. On top of it a caller may start the ResourceClaim
// controller and any number of schedulers (topodra-scheduler or stock
// kube-scheduler) from their real commands.
//
// The simulator ships it; integration tests and benchmarks use it through
// thin wrappers. Nothing here depends on package testing.
//
// The control plane has no kubelets, no controller manager and no service
// account token controller. Nodes are API objects that callers create (see
// CreateReadyNode).
package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
)

// DefaultAPIServerFlags are kube-apiserver flags applied before
// Options.APIServerFlags. Admission plugins that need controllers this
// control plane does not run are disabled: ServiceAccount (no token
// controller, no default ServiceAccount) and TaintNodesByCondition (no node
// lifecycle controller to lift the not-ready taint from created nodes).
// Priority and fairness is off so that benchmarks measure the scheduler,
// not request queueing. On shutdown the server answers new requests with
// 429 and Retry-After until the requests in flight are done, then closes
// its connections within seconds, instead of waiting for open watches for
// the whole request timeout (StopAPIServer while components run).
var DefaultAPIServerFlags = []string{
	"--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
	"--enable-priority-and-fairness=false",
	"--shutdown-send-retry-after=true",
}

// Options configure Start. The zero value is a valid configuration.
type Options struct {
	// Dir holds the cluster's files: etcd data, certificates, keys,
	// kubeconfig, scheduler configurations. Empty means a new temporary
	// directory that Stop removes; a given directory is created if needed
	// and left in place.
	Dir string
	// APIServerFlags are extra kube-apiserver command-line flags, parsed
	// after DefaultAPIServerFlags. Feature gates set here
	// (--feature-gates) are also set on the process' default feature gate,
	// because most apiserver code reads that one.
	APIServerFlags []string
	// StartTimeout bounds the wait for etcd and for the apiserver to become
	// ready, each. Zero means one minute.
	StartTimeout time.Duration
	// QPS and Burst of the admin client config. Zero means 5000 and 10000:
	// in-process components should not be throttled on their client side.
	QPS   float32
	Burst int
}

func (o *Options) setDefaults() {
	if o.StartTimeout == 0 {
		o.StartTimeout = time.Minute
	}
	if o.QPS == 0 {
		o.QPS = 5000
	}
	if o.Burst == 0 {
		o.Burst = 10000
	}
}

// Cluster is a running etcd + kube-apiserver pair. Its fields are set by
// Start and not changed afterwards; its methods are safe for concurrent use.
type Cluster struct {
	// Config is an admin client config for the apiserver (a static token
	// of group system:masters over TLS). It stays valid across
	// StopAPIServer and StartAPIServer. Callers may copy it, not change it.
	Config *rest.Config
	// Client is an admin clientset for Config.
	Client kubernetes.Interface
	// Kubeconfig is the path of a kubeconfig file for Config, usable by
	// components that take --kubeconfig or clientConnection.kubeconfig.
	Kubeconfig string
	// Dir is the cluster's directory (Options.Dir or the temporary one).
	Dir string

	removeDir bool
	etcd      *etcdServer

	mu sync.Mutex
	// apiserver is the running apiserver, nil while stopped; guarded by mu.
	apiserver *apiServer
	// apiserverConfig starts it again, on the same port; guarded by mu.
	apiserverConfig apiServerConfig
	stops           []func()
	stopOnce        sync.Once
}

// Start starts etcd and a kube-apiserver and returns once the apiserver
// reports healthy and has created the default namespace. ctx bounds the
// start and provides the logger; the cluster then runs until Stop, whether
// or not ctx is cancelled. On error everything already started is stopped
// again.
func Start(ctx context.Context, opts Options) (_ *Cluster, err error) {
	opts.setDefaults()
	logger := klog.FromContext(ctx).WithName("cluster")
	ctx = klog.NewContext(ctx, logger)
	c := &Cluster{Dir: opts.Dir}
	if c.Dir == "" {
		c.Dir, err = os.MkdirTemp("", "topodra-cluster-")
		if err != nil {
			return nil, fmt.Errorf("create cluster directory: %w", err)
		}
		c.removeDir = true
	} else if err := os.MkdirAll(c.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("create cluster directory: %w", err)
	}
	defer func() {
		if err != nil {
			c.Stop()
		}
	}()

	start := time.Now()
	c.etcd, err = startEtcd(ctx, filepath.Join(c.Dir, "etcd"), opts.StartTimeout)
	if err != nil {
		return nil, err
	}
	logger.V(2).Info("Started etcd", "url", c.etcd.clientURL, "elapsed", time.Since(start))

	token := make([]byte, 16)
	if _, err := rand.Read(token); err != nil {
		return nil, fmt.Errorf("admin token: %w", err)
	}
	flags := append(append([]string(nil), DefaultAPIServerFlags...), opts.APIServerFlags...)
	c.apiserverConfig = apiServerConfig{
		dir:        filepath.Join(c.Dir, "apiserver"),
		etcdURL:    c.etcd.clientURL,
		flags:      flags,
		timeout:    opts.StartTimeout,
		logger:     logger,
		adminToken: hex.EncodeToString(token),
		loopback:   func(cfg *rest.Config) { cfg.QPS, cfg.Burst = opts.QPS, opts.Burst },
	}
	c.apiserver, err = startAPIServer(ctx, c.apiserverConfig)
	if err != nil {
		return nil, err
	}
	c.apiserverConfig.port = c.apiserver.port
	logger.V(2).Info("Started kube-apiserver", "host", c.apiserver.config.Host, "elapsed", time.Since(start))

	c.Config = c.apiserver.config
	c.Client, err = kubernetes.NewForConfig(c.Config)
	if err != nil {
		return nil, fmt.Errorf("create client: %w", err)
	}
	c.Kubeconfig = filepath.Join(c.Dir, "kubeconfig")
	if err := WriteKubeconfig(c.Config, c.Kubeconfig); err != nil {
		return nil, err
	}
	return c, nil
}

// StopAPIServer stops the kube-apiserver and waits until it has shut
// down; etcd keeps running. Clients then get connection errors until
// StartAPIServer. It does nothing if the apiserver is not running.
func (c *Cluster) StopAPIServer() {
	c.mu.Lock()
	srv := c.apiserver
	c.apiserver = nil
	c.mu.Unlock()
	if srv != nil {
		srv.stop()
	}
}

// StartAPIServer starts a kube-apiserver again after StopAPIServer: on the
// same etcd (so with all objects), port, certificates and admin token, so
// that Config, Client, Kubeconfig and the clients of running components
// work again. It waits until the apiserver is ready, like Start. It does
// nothing if the apiserver is running.
func (c *Cluster) StartAPIServer(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.apiserver != nil {
		return nil
	}
	srv, err := startAPIServer(klog.NewContext(ctx, c.apiserverConfig.logger), c.apiserverConfig)
	if err != nil {
		return err
	}
	c.apiserver = srv
	return nil
}

// AddStop registers a function that stops a component running against the
// cluster. Stop calls them, last registered first, before it stops the
// apiserver: watchers that outlive the apiserver would hold up its
// shutdown.
func (c *Cluster) AddStop(stop func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stops = append(c.stops, stop)
}

// Stop stops the registered components, the apiserver and etcd, waits
// until they have stopped, and removes a temporary Dir. It may be called
// more than once and from several goroutines; later calls return at once.
func (c *Cluster) Stop() {
	c.stopOnce.Do(func() {
		c.mu.Lock()
		stops := c.stops
		c.stops = nil
		c.mu.Unlock()
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
		c.StopAPIServer()
		if c.etcd != nil {
			c.etcd.stop()
		}
		if c.removeDir {
			_ = os.RemoveAll(c.Dir)
		}
	})
}

// errStopped is returned by waits that see a component end while it
// should be starting.
var errStopped = errors.New("stopped while starting")
