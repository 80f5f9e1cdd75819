package cluster

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/spf13/pflag"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apiserver/pkg/util/compatibility"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/keyutil"
	basecompatibility "k8s.io/component-base/compatibility"
	"k8s.io/component-base/featuregate"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
	"k8s.io/kubernetes/cmd/kube-apiserver/app/options"
)

// serviceAccountIssuer is the issuer of service account tokens. No token
// controller runs, but the apiserver requires an issuer and a signing key.
const serviceAccountIssuer = "https://kubernetes.default.svc.cluster.local"

// serviceClusterIPRange is the (unused) service network.
const serviceClusterIPRange = "10.0.0.0/16"

// apiServerConfig is what startAPIServer needs.
type apiServerConfig struct {
	dir     string // certificates, keys, token file
	etcdURL string
	flags   []string
	timeout time.Duration
	logger  klog.Logger
	// port to serve on, on 127.0.0.1; 0 means a free one.
	port int
	// adminToken authenticates the admin client (group system:masters).
	adminToken string
	// loopback adjusts the admin client config before it is returned.
	loopback func(*rest.Config)
}

// apiServer is a running kube-apiserver (with its aggregator and
// apiextensions servers, as the binary runs them).
type apiServer struct {
	// config is the admin client config: the static admin token and the
	// serving certificate's CA, both kept in the server's directory, so
	// that it stays valid for a server started again on the same port.
	config *rest.Config
	// port is the port it serves on.
	port   int
	logger klog.Logger
	cancel context.CancelFunc
	done   chan error // receives Run's result, then is closed
}

// startAPIServer configures a kube-apiserver the way its command does
// (NewServerRunOptions, flags, Complete, Validate, NewConfig,
// CreateServerChain), with serving certificates generated into cfg.dir and
// a free loopback port, runs it and waits until /healthz is ok and the
// default namespace exists.
func startAPIServer(ctx context.Context, cfg apiServerConfig) (_ *apiServer, err error) {
	if err := os.MkdirAll(cfg.dir, 0o700); err != nil {
		return nil, fmt.Errorf("kube-apiserver: %w", err)
	}
	s, err := apiServerOptions(cfg)
	if err != nil {
		return nil, fmt.Errorf("kube-apiserver options: %w", err)
	}
	// The server runs until stop, not until the caller's ctx ends; it
	// keeps ctx's values (the logger).
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	srv := &apiServer{cancel: cancel, logger: cfg.logger}
	defer func() {
		if err != nil {
			srv.stop()
		}
	}()
	// Listener ownership passes to the server once it runs; close it
	// ourselves if we fail before that.
	listener := s.SecureServing.Listener
	closeListener := true
	defer func() {
		if closeListener && listener != nil {
			_ = listener.Close()
		}
	}()

	completedOptions, err := s.Complete(runCtx)
	if err != nil {
		return nil, fmt.Errorf("complete kube-apiserver options: %w", err)
	}
	if errs := completedOptions.Validate(); len(errs) != 0 {
		return nil, fmt.Errorf("validate kube-apiserver options: %w", utilerrors.NewAggregate(errs))
	}
	config, err := app.NewConfig(completedOptions)
	if err != nil {
		return nil, fmt.Errorf("kube-apiserver config: %w", err)
	}
	completed, err := config.Complete()
	if err != nil {
		return nil, fmt.Errorf("complete kube-apiserver config: %w", err)
	}
	chain, err := app.CreateServerChain(completed)
	if err != nil {
		return nil, fmt.Errorf("create kube-apiserver server chain: %w", err)
	}
	prepared, err := chain.PrepareRun()
	if err != nil {
		return nil, fmt.Errorf("prepare kube-apiserver: %w", err)
	}
	ca, err := os.ReadFile(completedOptions.SecureServing.ServerCert.CertKey.CertFile)
	if err != nil {
		return nil, fmt.Errorf("kube-apiserver serving certificate: %w", err)
	}
	srv.port = s.SecureServing.BindPort
	srv.config = rest.CopyConfig(chain.GenericAPIServer.LoopbackClientConfig)
	srv.config.Host = "https://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(srv.port))
	srv.config.BearerToken = cfg.adminToken
	srv.config.TLSClientConfig = rest.TLSClientConfig{CAData: ca}
	if cfg.loopback != nil {
		cfg.loopback(srv.config)
	}

	srv.done = make(chan error, 1)
	closeListener = false
	go func() {
		defer close(srv.done)
		srv.done <- prepared.Run(runCtx)
	}()

	if err := srv.waitReady(ctx, cfg.timeout); err != nil {
		return nil, err
	}
	return srv, nil
}

// apiServerOptions builds the server's options: the defaults of
// kube-apiserver, the given flags, storage in etcd, serving on cfg.port (or
// a free port) of 127.0.0.1 with self-signed certificates in cfg.dir (made
// once, reused by a server started again), the admin token in a token
// file, and a fresh service account signing key.
func apiServerOptions(cfg apiServerConfig) (*options.ServerRunOptions, error) {
	// Each server gets its own registry of feature gates and versions, so
	// that several servers can run one after another in one process.
	featureGate := utilfeature.DefaultMutableFeatureGate.DeepCopy()
	effectiveVersion := compatibility.DefaultBuildEffectiveVersion()
	effectiveVersion.SetEmulationVersion(featureGate.EmulationVersion())
	effectiveVersion.SetMinCompatibilityVersion(featureGate.MinCompatibilityVersion())
	registry := basecompatibility.NewComponentGlobalsRegistry()
	if err := registry.Register(basecompatibility.DefaultKubeComponent, effectiveVersion, featureGate); err != nil {
		return nil, err
	}

	s := options.NewServerRunOptions()
	s.GenericServerRunOptions.ComponentGlobalsRegistry = registry
	fs := pflag.NewFlagSet("kube-apiserver", pflag.ContinueOnError)
	for _, set := range s.Flags().FlagSets {
		fs.AddFlagSet(set)
	}

	listener, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(cfg.port)))
	if err != nil {
		return nil, fmt.Errorf("listen: %w", err)
	}
	addr := listener.Addr().(*net.TCPAddr)
	s.SecureServing.Listener = listener
	s.SecureServing.BindAddress = addr.IP
	s.SecureServing.BindPort = addr.Port
	s.SecureServing.ExternalAddress = addr.IP
	s.SecureServing.ServerCert.CertDirectory = cfg.dir
	s.ServiceClusterIPRanges = serviceClusterIPRange
	s.Etcd.StorageConfig.Transport.ServerList = []string{cfg.etcdURL}

	tokenFile := filepath.Join(cfg.dir, "tokens.csv")
	if err := os.WriteFile(tokenFile, []byte(cfg.adminToken+",admin,admin,system:masters\n"), 0o600); err != nil {
		_ = listener.Close()
		return nil, fmt.Errorf("write token file: %w", err)
	}
	s.Authentication.TokenFile.TokenFile = tokenFile

	keyFile := filepath.Join(cfg.dir, "service-account.key")
	if err := writeSigningKey(keyFile); err != nil {
		_ = listener.Close()
		return nil, err
	}
	s.ServiceAccountSigningKeyFile = keyFile
	s.Authentication.ServiceAccounts.Issuers = []string{serviceAccountIssuer}
	s.Authentication.ServiceAccounts.KeyFiles = []string{keyFile}

	if err := fs.Parse(cfg.flags); err != nil {
		_ = listener.Close()
		return nil, fmt.Errorf("parse flags: %w", err)
	}
	// A loopback "external" address has no endpoints to reconcile.
	if !fs.Changed("advertise-address") && !fs.Changed("endpoint-reconciler-type") {
		s.EndpointReconcilerType = "none"
	}
	if err := registry.Set(); err != nil {
		_ = listener.Close()
		return nil, fmt.Errorf("apply feature gates: %w", err)
	}
	if err := copyFeatureOverrides(featureGate); err != nil {
		_ = listener.Close()
		return nil, err
	}
	return s, nil
}

// copyFeatureOverrides sets the features that differ between the server's
// gate and the process' default gate on the default gate: most feature
// checks in the apiserver read the default gate.
func copyFeatureOverrides(gate featuregate.FeatureGate) error {
	overrides := map[string]bool{}
	for f := range utilfeature.DefaultMutableFeatureGate.GetAll() {
		if gate.Enabled(f) != utilfeature.DefaultFeatureGate.Enabled(f) {
			overrides[string(f)] = gate.Enabled(f)
		}
	}
	if len(overrides) == 0 {
		return nil
	}
	if err := utilfeature.DefaultMutableFeatureGate.SetFromMap(overrides); err != nil {
		return fmt.Errorf("set feature gates %v: %w", overrides, err)
	}
	return nil
}

// writeSigningKey writes a new ECDSA P-256 private key in PEM to path.
func writeSigningKey(path string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("generate service account key: %w", err)
	}
	pem, err := keyutil.MarshalPrivateKeyToPEM(key)
	if err != nil {
		return fmt.Errorf("encode service account key: %w", err)
	}
	if err := keyutil.WriteKey(path, pem); err != nil {
		return fmt.Errorf("write service account key: %w", err)
	}
	return nil
}

// waitReady polls until /healthz is ok and the default namespace exists,
// the server ends, ctx ends or timeout passes, each wait.
func (s *apiServer) waitReady(ctx context.Context, timeout time.Duration) error {
	client, err := kubernetes.NewForConfig(s.config)
	if err != nil {
		return fmt.Errorf("kube-apiserver client: %w", err)
	}
	ended := func() error {
		select {
		case err, ok := <-s.done:
			if ok && err != nil {
				return fmt.Errorf("kube-apiserver failed while starting: %w", err)
			}
			return fmt.Errorf("kube-apiserver: %w", errStopped)
		default:
			return nil
		}
	}
	var lastHealth string
	err = wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		if err := ended(); err != nil {
			return false, err
		}
		status := 0
		body, err := client.CoreV1().RESTClient().Get().AbsPath("/healthz").Do(ctx).StatusCode(&status).Raw()
		if status == http.StatusOK {
			return true, nil
		}
		lastHealth = fmt.Sprintf("status %d: %s", status, body)
		if err != nil {
			lastHealth = err.Error()
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("waiting for kube-apiserver /healthz (last: %s): %w", lastHealth, err)
	}
	err = wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		if err := ended(); err != nil {
			return false, err
		}
		_, err := client.CoreV1().Namespaces().Get(ctx, metav1.NamespaceDefault, metav1.GetOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			klog.FromContext(ctx).V(4).Info("default namespace not readable yet", "err", err)
		}
		return err == nil, nil
	})
	if err != nil {
		return fmt.Errorf("waiting for the default namespace: %w", err)
	}
	return nil
}

// stop cancels the server and waits until it has shut down.
func (s *apiServer) stop() {
	s.cancel()
	if s.done == nil {
		return
	}
	if err, ok := <-s.done; ok && err != nil && !errors.Is(err, context.Canceled) {
		s.logger.Error(err, "Stopping kube-apiserver did not end cleanly")
	}
}
