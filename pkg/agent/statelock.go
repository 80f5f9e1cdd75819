package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// LockFileName is the file in Options.StateDir on which a running agent
// holds an exclusive flock(2), from before it reads the checkpoint and
// starts its kubelet sockets until Stop (or its process ends: the kernel
// releases the lock of a process that dies). Two agents on one node (a
// force-deleted agent pod whose container still runs, a rolling update
// with maxSurge) would otherwise overwrite each other's record of
// prepared claims, and, without Options.RollingUpdateUID, the one that
// stops first would remove the other's kubelet sockets. The file holds the host name (in a pod: the pod name)
// of the agent that holds the lock; its content is informational only.
const LockFileName = "agent.lock"

// ReasonStateLocked (Warning, at start, once): another agent holds the
// lock on the state directory (see LockFileName); this one waits for it
// before it does anything else. With Options.RollingUpdateUID, where the
// agent it replaces exits once this one is ready, only after it has
// waited rollingLockPatience.
const ReasonStateLocked = "TopodraStateLocked"

// rollingLockPatience is how long an agent with Options.RollingUpdateUID
// waits for the lock before it reports the wait on the Node: the rollout
// stops the agent it replaces once this one is ready (the kubelet has
// registered it, and the readiness probe has seen that), and that agent
// then has its termination grace period to stop.
const rollingLockPatience = 2 * time.Minute

// stateLockRetry is how often a waiting agent tries to take the lock.
const stateLockRetry = 100 * time.Millisecond

// lockState takes the exclusive lock on LockFileName in StateDir, waiting
// while another agent holds it, until ctx ends. The first time it has to
// wait it says so in the log and as a ReasonStateLocked Warning on the
// Node. The lock is held until unlockState.
func (a *Agent) lockState(ctx context.Context) error {
	dir := a.opts.StateDir
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return a.stateUnwritable(ctx, "Start", fmt.Errorf("%w: create state directory %s: %w", ErrStateUnwritable, dir, err))
	}
	path := filepath.Join(dir, LockFileName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return a.stateUnwritable(ctx, "Start", fmt.Errorf("%w: open lock file %s: %w", ErrStateUnwritable, path, err))
	}
	logger := klog.FromContext(ctx)
	var patience time.Duration
	if a.opts.RollingUpdateUID != "" {
		patience = rollingLockPatience
	}
	holder := func() string {
		if data, err := os.ReadFile(path); err == nil && len(strings.TrimSpace(string(data))) > 0 {
			return fmt.Sprintf("another agent (%s)", strings.TrimSpace(string(data)))
		}
		return "another agent"
	}
	// since is when the agent found the lock held, zero where it was not.
	var since time.Time
	reported := false
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			_ = f.Close()
			return fmt.Errorf("lock %s: %w", path, err)
		}
		if since.IsZero() {
			since = time.Now()
			logger.Info("Another node agent holds the state directory, waiting for it to exit", "lockFile", path, "holder", holder(), "rollingUpdate", a.opts.RollingUpdateUID != "")
		}
		if !reported && time.Since(since) >= patience {
			reported = true
			if a.opts.RollingUpdateUID != "" {
				a.nodeEvent(v1.EventTypeWarning, ReasonStateLocked, "Start",
					"%s waits to start: %s holds %s after %s; two agents on one node would overwrite each other's prepared claims. A rolling update stops the old agent pod once this one is ready: if it does not exit, find the second agent pod or container on this node (a pod stuck terminating, a force-deleted pod whose container still runs) and stop it; the kubelet's calls wait meanwhile",
					a.opts.DriverName, holder(), path, time.Since(since).Round(time.Second))
			} else {
				a.nodeEvent(v1.EventTypeWarning, ReasonStateLocked, "Start",
					"%s waits to start: %s holds %s; two agents on one node would overwrite each other's prepared claims. If it does not exit, find the second agent pod or container on this node (a force-deleted pod, a DaemonSet update with maxSurge without the agent's POD_UID: use maxUnavailable, or set POD_UID) and stop it",
					a.opts.DriverName, holder(), path)
			}
		}
		timer := time.NewTimer(stateLockRetry)
		select {
		case <-ctx.Done():
			timer.Stop()
			_ = f.Close()
			return fmt.Errorf("wait for the lock %s held by another agent: %w", path, context.Cause(ctx))
		case <-timer.C:
		}
	}
	if !since.IsZero() {
		logger.Info("Took over the state directory", "lockFile", path)
	}
	if host, err := os.Hostname(); err == nil && f.Truncate(0) == nil {
		_, _ = f.WriteAt([]byte(host+"\n"), 0)
	}
	a.mutex.Lock()
	a.stateLock = f
	a.mutex.Unlock()
	return nil
}

// unlockState releases the lock that lockState took, if any. It may be
// called more than once.
func (a *Agent) unlockState() {
	a.mutex.Lock()
	f := a.stateLock
	a.stateLock = nil
	a.mutex.Unlock()
	if f != nil {
		// Closing the only descriptor of the open file releases the lock.
		_ = f.Close()
	}
}

// stateLockHeld reports whether another agent holds the lock on
// LockFileName in dir, without waiting: it takes a shared lock, which
// fails only while another holds the exclusive one, and releases it at
// once. A missing file is a lock that nobody holds.
func stateLockHeld(dir string) (bool, error) {
	path := filepath.Join(dir, LockFileName)
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("open lock file %s: %w", path, err)
	}
	// Closing the only descriptor of the open file releases the lock.
	defer func() { _ = f.Close() }()
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB)
		switch {
		case err == nil:
			return false, nil
		case errors.Is(err, unix.EINTR):
		case errors.Is(err, unix.EWOULDBLOCK):
			return true, nil
		default:
			return false, fmt.Errorf("lock %s: %w", path, err)
		}
	}
}
