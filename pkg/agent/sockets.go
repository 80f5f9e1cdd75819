package agent

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"
)

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
	own := map[string]bool{}
	if uid := a.opts.RollingUpdateUID; uid != "" {
		own[filepath.Join(a.opts.RegistrarDir, kubeletplugin.RollingUpdateRegistrarSocketFile(a.opts.RegistrarDir, a.opts.DriverName, uid))] = true
		own[filepath.Join(a.opts.PluginDataDir, "dra-"+string(uid)+".sock")] = true
	} else {
		own[filepath.Join(a.opts.RegistrarDir, a.opts.DriverName+"-reg.sock")] = true
		own[filepath.Join(a.opts.PluginDataDir, "dra.sock")] = true
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
