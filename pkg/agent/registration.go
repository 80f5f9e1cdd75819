package agent

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// DefaultRegistrationTimeout is how long the kubelet may take to register
// the plugin before the agent reports it on the Node (see
// Options.RegistrationTimeout).
const DefaultRegistrationTimeout = 2 * time.Minute

const (
	// ReasonNotRegistered (Warning): the kubelet has not registered the
	// plugin within Options.RegistrationTimeout of the agent's start: it
	// has not found the registration socket (the agent's registration
	// directory is not the kubelet's), or it refused the plugin. Pods
	// with claims on the node cannot start until it does.
	ReasonNotRegistered = "TopodraNotRegistered"
	// ReasonRegistered (Normal): the kubelet registered the plugin after
	// a ReasonNotRegistered.
	ReasonRegistered = "TopodraRegistered"
)

// registration is what the kubelet said of the plugin's registration, as
// the agent saw it in the kubelet's NotifyRegistrationStatus calls.
type registration struct {
	// seen: the kubelet called NotifyRegistrationStatus.
	seen bool
	// registered and refusal are the latest call's status.
	registered bool
	refusal    string
	// reported: a ReasonNotRegistered event was recorded.
	reported bool
}

// watchRegistration is a gRPC interceptor of the kubelet plugin helper's
// servers: it records the status of every NotifyRegistrationStatus call
// of the kubelet. The helper keeps that status too, but reads and writes
// it without synchronisation; the agent reads its own copy.
func (a *Agent) watchRegistration(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	resp, err := handler(ctx, req)
	status, ok := req.(*registerapi.RegistrationStatus)
	if !ok || info.FullMethod != registerapi.Registration_NotifyRegistrationStatus_FullMethodName {
		return resp, err
	}
	a.mutex.Lock()
	was := a.registration
	a.registration.seen = true
	a.registration.registered = status.PluginRegistered
	a.registration.refusal = status.Error
	reported := a.registration.reported
	if !status.PluginRegistered {
		a.registration.reported = true
	}
	a.mutex.Unlock()
	if status.PluginRegistered && was.seen {
		// Registered again: the kubelet restarted, which it does to
		// register a Node that was deleted, so read the Node now.
		a.checkNodeSoon()
	}
	logger := klog.FromContext(ctx)
	switch {
	case status.PluginRegistered && !was.registered:
		logger.Info("The kubelet registered the plugin", "driver", a.opts.DriverName)
		if reported {
			a.nodeEvent(v1.EventTypeNormal, ReasonRegistered, "Register", "the kubelet registered %s: pods with claims of its devices can start on this node", a.opts.DriverName)
		}
	case !status.PluginRegistered:
		logger.Error(nil, "The kubelet refused the plugin's registration", "driver", a.opts.DriverName, "reason", status.Error)
		a.nodeEvent(v1.EventTypeWarning, ReasonNotRegistered, "Register", "the kubelet refused to register %s: %s; pods with claims of its devices cannot start on this node", a.opts.DriverName, status.Error)
	}
	return resp, err
}

// registrationErr returns why the plugin does not serve the kubelet yet:
// the kubelet refused its registration, or has not registered it. Nil
// once registered, and with PublishOnly.
func (a *Agent) registrationErr() error {
	if err := a.registrationRefused(); err != nil {
		return err
	}
	if a.helper == nil || a.Registered() {
		return nil
	}
	return fmt.Errorf("the kubelet has not registered the plugin yet (registration socket %s)", a.registrationSocket())
}

// registrationRefused returns the kubelet's refusal of the latest
// registration, nil if it registered the plugin or has not said yet.
func (a *Agent) registrationRefused() error {
	if !a.helperStarted() || a.helper == nil {
		return nil
	}
	a.mutex.Lock()
	r := a.registration
	a.mutex.Unlock()
	if r.seen && !r.registered {
		return fmt.Errorf("kubelet refused plugin registration: %s", r.refusal)
	}
	return nil
}

// socketsGone returns an error where the kubelet plugin helper serves
// and its registration or DRA socket is no longer in its directory (the
// kubelet's plugin directories were wiped or recreated): the kubelet
// deregisters a driver whose registration socket goes and finds nothing
// to register again, and only a new process creates the sockets. nil
// before the helper starts, with PublishOnly, and while both are there.
func (a *Agent) socketsGone() error {
	if !a.helperStarted() || a.helper == nil {
		return nil
	}
	for _, path := range []string{a.registrationSocket(), filepath.Join(a.opts.PluginDataDir, draSocketName(a.opts.PluginDataDir, a.opts.RollingUpdateUID))} {
		info, err := os.Lstat(path)
		if err == nil && info.Mode().Type() == fs.ModeSocket {
			continue
		}
		return fmt.Errorf("the kubelet plugin socket %s is gone (%v): the kubelet cannot call or register the driver; a restart creates it again", path, errOrKind(err, info))
	}
	return nil
}

// errOrKind says why a path is not a socket: err, or what it is.
func errOrKind(err error, info fs.FileInfo) string {
	if err != nil {
		return err.Error()
	}
	return "not a socket: " + info.Mode().Type().String()
}

// registrationSocket is the path of the registration socket the kubelet
// must find.
func (a *Agent) registrationSocket() string {
	return filepath.Join(a.opts.RegistrarDir, registrationSocketName(&a.opts))
}

// registrationSocketName is the name of the registration socket in
// RegistrarDir, as the kubelet plugin helper names it: by the driver, and
// with RollingUpdateUID by the pod too.
func registrationSocketName(opts *Options) string {
	if opts.RollingUpdateUID != "" {
		return kubeletplugin.RollingUpdateRegistrarSocketFile(opts.RegistrarDir, opts.DriverName, opts.RollingUpdateUID)
	}
	return opts.DriverName + "-reg.sock"
}

// Registered reports whether the kubelet has registered the plugin (false
// with PublishOnly).
func (a *Agent) Registered() bool {
	if !a.helperStarted() {
		return false
	}
	a.mutex.Lock()
	defer a.mutex.Unlock()
	return a.helper != nil && a.registration.registered
}

// awaitRegistration records a ReasonNotRegistered event on the Node if
// the kubelet has not registered the plugin within timeout.
func (a *Agent) awaitRegistration(ctx context.Context, timeout time.Duration) {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return
	case <-timer.C:
	}
	a.mutex.Lock()
	report := !a.registration.seen && !a.registration.reported
	if report {
		a.registration.reported = true
	}
	a.mutex.Unlock()
	if !report {
		return
	}
	socket := a.registrationSocket()
	klog.FromContext(ctx).Error(nil, "The kubelet has not registered the plugin", "after", timeout, "registrationSocket", socket)
	// An action of its own: the events.k8s.io broadcaster counts an
	// event with the same reason and action within minutes as a repeat
	// and keeps the first note, which would hide a refusal's reason.
	a.nodeEvent(v1.EventTypeWarning, ReasonNotRegistered, "WaitForRegistration",
		"the kubelet has not registered %s %s after the agent started: it has not used the registration socket %s. Pods with claims of its devices cannot start on this node. Check that --kubelet-dir is the kubelet's --root-dir (or --registrar-dir its plugins_registry directory) as seen on the node, and that the agent's DaemonSet mounts it at the same path",
		a.opts.DriverName, timeout, socket)
}
