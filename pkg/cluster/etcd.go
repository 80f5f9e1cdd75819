package cluster

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"k8s.io/klog/v2"
)

// etcdServer is a single-member etcd embedded in the process.
type etcdServer struct {
	etcd      *embed.Etcd
	clientURL string
	log       *klogWriter
}

// etcdStartAttempts bounds the retries of a start whose free ports were
// taken by someone else between choosing and binding them.
const etcdStartAttempts = 3

// startEtcd starts a single-member etcd with its data in dir, listening on
// free loopback ports, and waits until it serves. fsync is off: the data
// lives as long as the process and is never restarted from.
func startEtcd(ctx context.Context, dir string, timeout time.Duration) (*etcdServer, error) {
	ctx = klog.NewContext(ctx, klog.LoggerWithName(klog.FromContext(ctx), "etcd"))
	var errs []string
	for attempt := range etcdStartAttempts {
		memberDir := fmt.Sprintf("%s-%d", dir, attempt)
		s, err := startEtcdOnce(ctx, memberDir, timeout)
		if err == nil {
			return s, nil
		}
		_ = os.RemoveAll(memberDir)
		errs = append(errs, err.Error())
		if ctx.Err() != nil {
			break
		}
	}
	return nil, fmt.Errorf("start etcd: %s", strings.Join(errs, "; "))
}

func startEtcdOnce(ctx context.Context, dir string, timeout time.Duration) (*etcdServer, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	ports, err := freePorts(2)
	if err != nil {
		return nil, err
	}
	clientURL := url.URL{Scheme: "http", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[0]))}
	peerURL := url.URL{Scheme: "http", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[1]))}

	cfg := embed.NewConfig()
	cfg.Name = "topodra"
	cfg.Dir = dir
	cfg.UnsafeNoFsync = true
	cfg.ListenClientUrls = []url.URL{clientURL}
	cfg.AdvertiseClientUrls = []url.URL{clientURL}
	cfg.ListenPeerUrls = []url.URL{peerURL}
	cfg.AdvertisePeerUrls = []url.URL{peerURL}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	log := &klogWriter{logger: klog.FromContext(ctx)}
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(log.zap())

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, err
	}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		return nil, fmt.Errorf("etcd failed while starting: %w", err)
	case <-timer.C:
		e.Close()
		return nil, fmt.Errorf("etcd not ready after %s", timeout)
	case <-ctx.Done():
		e.Close()
		return nil, fmt.Errorf("etcd: %w: %w", errStopped, context.Cause(ctx))
	}
	return &etcdServer{etcd: e, clientURL: clientURL.String(), log: log}, nil
}

// stop closes etcd and waits until it has stopped.
func (s *etcdServer) stop() {
	s.log.stopping.Store(true)
	s.etcd.Close()
}

// freePorts returns n distinct TCP ports on 127.0.0.1 that were free a
// moment ago. All n listeners are held until all are chosen.
func freePorts(n int) ([]int, error) {
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("find a free port: %w", err)
		}
		defer func() { _ = l.Close() }()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// klogWriter passes etcd's errors to a klog logger, one entry per line;
// etcd's info and warning lines (many per start) are dropped. Once stopping
// is set, errors are expected (closed listeners) and logged at V(4).
type klogWriter struct {
	logger   klog.Logger
	stopping atomic.Bool
}

func (w *klogWriter) zap() *zap.Logger {
	enc := zapcore.NewConsoleEncoder(zap.NewDevelopmentEncoderConfig())
	return zap.New(zapcore.NewCore(enc, zapcore.AddSync(w), zapcore.ErrorLevel))
}

func (w *klogWriter) Write(p []byte) (int, error) {
	msg := strings.TrimRight(string(p), "\n")
	if w.stopping.Load() {
		w.logger.V(4).Info(msg)
	} else {
		w.logger.Error(nil, msg)
	}
	return len(p), nil
}
