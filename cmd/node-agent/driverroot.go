package main

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/driverroot"
	"github.com/topodra/topodra/pkg/eventnote"
)

// reasonDriverRoot (Normal) is the event on the Node that says which
// driver root --driver-root=auto chose, and why.
const reasonDriverRoot = "TopodraDriverRoot"

// driverRoots returns the selector among the driver roots that
// --driver-root names: that root alone, or with driverroot.Auto the
// roots of driverroot.AutoCandidates below --container-driver-root (the
// node's "/" as mounted here); each with the device root of
// --container-dev-root and the NVML library of --nvml-library.
func (o *options) driverRoots() (*driverroot.Selector, error) {
	var candidates []driverroot.Root
	// mounted is what --container-driver-root must be: a directory.
	var mounted string
	if o.driverRoot == driverroot.Auto {
		var err error
		if candidates, err = driverroot.AutoCandidates(o.containerDriverRoot); err != nil {
			return nil, fmt.Errorf("--container-driver-root (or CONTAINER_DRIVER_ROOT) with --driver-root=%s: %w", driverroot.Auto, err)
		}
		if mounted = o.containerDriverRoot; mounted == "" {
			mounted = "/"
		}
	} else {
		root, err := driverroot.New(o.driverRoot, o.containerDriverRoot)
		if err != nil {
			return nil, fmt.Errorf("--driver-root (or DRIVER_ROOT; an absolute path or %q): %w", driverroot.Auto, err)
		}
		candidates, mounted = []driverroot.Root{root}, root.Path
	}
	// A driver root that is not there is a mistyped setting, not a
	// machine without GPUs (which the dry run reports with exit 0).
	if info, err := os.Stat(mounted); err != nil || !info.IsDir() {
		return nil, fmt.Errorf("--driver-root %q (or DRIVER_ROOT; seen here as %s, --container-driver-root): not a directory: %v", o.driverRoot, mounted, errOrFile(err))
	}
	for i, r := range candidates {
		var err error
		if candidates[i], err = r.WithDevRoot("/", o.containerDevRoot); err != nil {
			return nil, fmt.Errorf("--container-dev-root (or CONTAINER_DEV_ROOT): %w", err)
		}
	}
	candidates, err := driverroot.WithNVMLLibrary(candidates, o.nvmlLibrary)
	if err != nil {
		return nil, fmt.Errorf("--nvml-library (or NVML_LIBRARY): %w", err)
	}
	return driverroot.NewSelector(candidates...)
}

// openNVML opens the NVML library of the root that roots loads
// (driverroot.Selector.Load). While no root holds the library the error
// wraps discovery.ErrNoGPU, naming --nvml-library where it is set; where
// another root than the one loaded before holds it first, the error is a
// rootChangedError.
func openNVML(roots *driverroot.Selector, library string) discovery.OpenFunc {
	return func() (nvml.Interface, error) {
		c, err := roots.Load()
		var changed *driverroot.ChangedError
		switch {
		case errors.As(err, &changed):
			return nil, rootChangedError{changed}
		case err != nil && library != "":
			return nil, fmt.Errorf("%w: --nvml-library (or NVML_LIBRARY) %s: %w", discovery.ErrNoGPU, library, err)
		case err != nil:
			return nil, fmt.Errorf("%w: %w", discovery.ErrNoGPU, err)
		}
		return nvml.New(nvml.WithLibraryPath(c.Library)), nil
	}
}

// rootChangedError is a driverroot.ChangedError that the agent handles as
// discovery.ErrDriverChanged: it records a ReasonNVMLReload event on the
// Node and exits, and the restarted container loads the library of the
// root found first, which this process cannot.
type rootChangedError struct{ *driverroot.ChangedError }

func (e rootChangedError) Is(target error) bool { return target == discovery.ErrDriverChanged }

func (e rootChangedError) Unwrap() error { return e.ChangedError }

// rootCheckingDiscovery is NVML discovery whose every Discover first asks
// whether the root whose library was loaded is still the one to load
// (driverroot.Selector.Check), so that an agent that loaded the host's
// library while the GPU Operator's driver container was being set up is
// restarted to load the container's once it is there. Health watching is
// the Lazy discovery's.
type rootCheckingDiscovery struct {
	*discovery.Lazy
	roots *driverroot.Selector
}

// Discover implements discovery.Interface; it fails with a
// rootChangedError where the root to load changed.
func (d rootCheckingDiscovery) Discover(ctx context.Context) (*discovery.Inventory, error) {
	var changed *driverroot.ChangedError
	if err := d.roots.Check(); errors.As(err, &changed) {
		return nil, rootChangedError{changed}
	}
	return d.Lazy.Discover(ctx)
}

// reportRootChoice returns what the selector calls with its choice: it
// logs the root, its library and the candidates passed over and, with a
// recorder, records a reasonDriverRoot event on the Node.
func reportRootChoice(logger klog.Logger, recorder events.EventRecorder, nodeName string) func(driverroot.Choice) {
	return func(c driverroot.Choice) {
		var passed []string
		for _, m := range c.Passed {
			passed = append(passed, fmt.Sprintf("%s: %v", m.Root.HostPath, m.Err))
		}
		logger.Info("Driver root chosen: the first that holds the NVML library", "driverRoot", c.Root.HostPath, "containerPath", c.Root.Path, "library", c.Library, "passedOver", passed)
		if recorder == nil {
			return
		}
		node := &corev1.ObjectReference{Kind: "Node", Name: nodeName, UID: types.UID(nodeName)}
		recorder.Eventf(node, nil, corev1.EventTypeNormal, reasonDriverRoot, "LoadNVML", "%s", eventnote.Format("driver root %s: the first that holds the NVML library; CDI specs name driver files below it. %s", c.Root.HostPath, c))
	}
}

// rootInUse is the node path of the driver root whose NVML library was
// loaded; "" for mock GPUs or before one was.
func (s *source) rootInUse() string {
	if s.roots == nil {
		return ""
	}
	r, ok := s.roots.Loaded()
	if !ok {
		return ""
	}
	return r.HostPath
}
