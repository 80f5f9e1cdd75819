package topologydra

import (
	"context"
	"fmt"
	"runtime/debug"
	"time"

	"k8s.io/apimachinery/pkg/util/version"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
)

// skewTimeout bounds the start's one request for the API server's version.
const skewTimeout = 10 * time.Second

// builtOn returns the Kubernetes release this binary's scheduler comes
// from (the k8s.io/kubernetes module), nil where the build does not say
// (test binaries list no modules).
func builtOn() *version.Version {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return nil
	}
	for _, dep := range info.Deps {
		if dep.Path == "k8s.io/kubernetes" {
			if dep.Replace != nil {
				dep = dep.Replace
			}
			v, err := version.ParseGeneric(dep.Version)
			if err != nil {
				return nil
			}
			return v
		}
	}
	return nil
}

// skewProblem says what is wrong where an API server of version server
// serves a kube-scheduler built on release built, and "" where nothing
// is: kube-scheduler may be as new as the API server or one minor older.
func skewProblem(server, built *version.Version) string {
	if server == nil || built == nil || server.Major() != built.Major() {
		return ""
	}
	switch {
	case server.Minor() < built.Minor():
		return fmt.Sprintf("the API server (%s) is older than the kube-scheduler release %s is built on (%s): upgrade the control plane first", server, Name, built)
	case server.Minor() > built.Minor()+1:
		return fmt.Sprintf("the API server (%s) is more than one minor release newer than the kube-scheduler release %s is built on (%s): fields and features it adds are unknown here, while the default scheduler honours them; run a build on a matching release", server, Name, built)
	}
	return ""
}

// warnVersionSkew logs a warning where the API server's version is outside
// kube-scheduler's skew rules for the release this binary is built on
// (skewProblem). Nothing is refused: the warning says where to look.
func warnVersionSkew(ctx context.Context, client kubernetes.Interface) {
	logger := klog.FromContext(ctx)
	built := builtOn()
	if built == nil || client == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, skewTimeout)
	defer cancel()
	info, err := discovery.ToServerVersionInterfaceWithContext(client.Discovery()).ServerVersionWithContext(ctx)
	if err != nil {
		logger.V(2).Info("API server version not read; version skew not checked", "err", err)
		return
	}
	server, err := version.ParseGeneric(info.GitVersion)
	if err != nil {
		logger.V(4).Info("API server version not understood; version skew not checked", "version", info.GitVersion)
		return
	}
	if problem := skewProblem(server, built); problem != "" {
		logger.Info("Warning: " + problem)
	}
}
