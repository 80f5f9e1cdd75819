package agent

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
)

// maxSocketPath is the longest path of a unix socket on Linux (108 bytes
// with the terminating NUL).
const maxSocketPath = 107

// draSocketName is the name of the DRA socket in dir: dra.sock, or with
// a pod UID dra-<uid>.sock where that path fits in a unix socket path and
// dra-<base64 of 8 bytes of the UID's SHA-256>.sock where it does not.
func draSocketName(dir string, uid types.UID) string {
	if uid == "" {
		return "dra.sock"
	}
	if name := "dra-" + string(uid) + ".sock"; len(filepath.Join(dir, name)) <= maxSocketPath {
		return name
	}
	sum := sha256.Sum256([]byte(uid))
	return "dra-" + base64.RawURLEncoding.EncodeToString(sum[:8]) + ".sock"
}

// ErrSocketPath is returned (wrapped) by Start where a kubelet socket's
// path would be too long for a unix socket.
var ErrSocketPath = errors.New("socket path too long")

// checkSocketPaths fails where the kubelet sockets would not fit in a
// unix socket path: the kubelet plugin helper would fail with "bind:
// invalid argument", which does not say what to change.
func checkSocketPaths(opts *Options) error {
	dra := filepath.Join(opts.PluginDataDir, draSocketName(opts.PluginDataDir, opts.RollingUpdateUID))
	if len(dra) > maxSocketPath {
		return fmt.Errorf("%w: the DRA socket %s is longer than the %d bytes of a unix socket path: choose a shorter plugin data directory", ErrSocketPath, dra, maxSocketPath)
	}
	if path := filepath.Join(opts.RegistrarDir, registrationSocketName(opts)); len(path) > maxSocketPath {
		return fmt.Errorf("%w: the registration socket %s is longer than the %d bytes of a unix socket path: choose a shorter registration directory", ErrSocketPath, path, maxSocketPath)
	}
	return nil
}

// socketDialTimeout bounds the connect that tells a served socket from a
// stale one.
const socketDialTimeout = time.Second

// removeStaleSockets removes the kubelet sockets of this driver that no
// process serves: those of an earlier agent that was killed before it
// could remove them (with Options.RollingUpdateUID each agent pod has
// sockets of its own, so no later agent replaces them). The kubelet keeps
// such a registration socket registered, and tries to reach it, until the
// file goes. A socket counts as stale only where connecting to it is
// refused: the sockets of a running agent, this one's included, and of
// an agent that is starting beside this one are left alone. It looks at
// the registration sockets named after the driver in RegistrarDir and at
// the DRA sockets in PluginDataDir, which belongs to the driver.
func (a *Agent) removeStaleSockets(ctx context.Context) {
	logger := klog.FromContext(ctx)
	own := map[string]bool{
		a.registrationSocket(): true,
		filepath.Join(a.opts.PluginDataDir, draSocketName(a.opts.PluginDataDir, a.opts.RollingUpdateUID)): true,
	}
	var candidates []string
	if entries, err := os.ReadDir(a.opts.RegistrarDir); err == nil {
		for _, e := range entries {
			name := e.Name()
			if strings.HasPrefix(name, a.opts.DriverName+"-") && strings.HasSuffix(name, "-reg.sock") {
				candidates = append(candidates, filepath.Join(a.opts.RegistrarDir, name))
			}
		}
	}
	if entries, err := os.ReadDir(a.opts.PluginDataDir); err == nil {
		for _, e := range entries {
			name := e.Name()
			if name == "dra.sock" || strings.HasPrefix(name, "dra-") && strings.HasSuffix(name, ".sock") {
				candidates = append(candidates, filepath.Join(a.opts.PluginDataDir, name))
			}
		}
	}
	for _, path := range candidates {
		if own[path] {
			continue
		}
		info, err := os.Lstat(path)
		if err != nil || info.Mode()&os.ModeSocket == 0 {
			continue
		}
		conn, err := net.DialTimeout("unix", path, socketDialTimeout)
		if err == nil {
			_ = conn.Close()
			continue
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			continue
		}
		if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
			logger.Error(err, "Cannot remove a kubelet socket that no agent serves", "socket", path)
			continue
		}
		logger.Info("Removed a kubelet socket that no agent serves (left by an agent that did not stop cleanly)", "socket", path)
	}
}
