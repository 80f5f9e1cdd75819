package discovery

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/klog/v2"

	"github.com/topodra/topodra/pkg/agent/driverroot"
)

// OpenFunc returns a fresh, uninitialized NVML library, or an error
// wrapping [ErrNoGPU] when there is nothing to load yet (for example
// libnvidia-ml.so.1 is not in the driver root).
type OpenFunc func() (nvml.Interface, error)

// OpenFromRoot opens libnvidia-ml.so.1 of a driver root (the real NVML
// library); while the root has none, the error wraps [ErrNoGPU]. The path
// is resolved again on every call, so that after a driver upgrade the new
// library file is loaded.
func OpenFromRoot(root driverroot.Root) OpenFunc {
	return func() (nvml.Interface, error) {
		path, err := root.NVMLLibraryPath()
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrNoGPU, err)
		}
		return nvml.New(nvml.WithLibraryPath(path)), nil
	}
}

// Lazy is NVML discovery for a node whose driver may appear after the agent
// starts (a driver container still installing, a driver installed later).
// Each Discover call first tries to open and initialize NVML if that has
// not succeeded yet; until it does, Discover returns an error wrapping
// [ErrNoGPU] and the agent retries. Once open, NVML stays open until Close
// or until NVML reports that it lost the kernel driver ([ErrDriverChanged]:
// a driver upgrade or unload): then Lazy shuts the library down, forgets
// it and returns that error, and the next call opens the library again
// (from a path resolved anew). A real libnvidia-ml stays mapped in the
// process once used (go-nvml binds its symbols globally), so opening it
// again reaches the old library: only a new process loads a new driver's
// (the agent stops and is restarted); reopening serves libraries
// that can load again, such as mocks. Lazy implements [Interface] and
// [HealthWatcher] and is safe for concurrent use.
type Lazy struct {
	open OpenFunc
	opts NVMLOptions

	mutex   sync.Mutex
	current *NVML
}

var _ Interface = &Lazy{}
var _ HealthWatcher = &Lazy{}

// NewLazy returns a discovery that opens NVML through open on first use;
// opts.Lib is ignored.
func NewLazy(open OpenFunc, opts NVMLOptions) *Lazy {
	return &Lazy{open: open, opts: opts}
}

// get returns the open NVML discovery, opening it if needed.
func (l *Lazy) get() (*NVML, error) {
	l.mutex.Lock()
	defer l.mutex.Unlock()
	if l.current != nil {
		return l.current, nil
	}
	lib, err := l.open()
	if err != nil {
		return nil, err
	}
	opts := l.opts
	opts.Lib = lib
	d, err := NewNVML(opts)
	if err != nil {
		return nil, err
	}
	l.current = d
	return d, nil
}

// Lib returns the initialized NVML library, nil while NVML is not open.
func (l *Lazy) Lib() nvml.Interface {
	l.mutex.Lock()
	defer l.mutex.Unlock()
	if l.current == nil {
		return nil
	}
	return l.current.lib
}

// Discover implements [Interface].
func (l *Lazy) Discover(ctx context.Context) (*Inventory, error) {
	d, err := l.get()
	if err != nil {
		return nil, err
	}
	inv, err := d.Discover(ctx)
	if errors.Is(err, ErrDriverChanged) {
		l.drop(ctx, d)
	}
	return inv, err
}

// WatchHealth implements [HealthWatcher]. While NVML is not open it
// returns an error wrapping [ErrHealthUnsupported]; the agent retries.
// An error wrapping
// [ErrDriverChanged] drops the library as Discover does.
func (l *Lazy) WatchHealth(ctx context.Context, inv *Inventory, watching func(Unwatched), events chan<- HealthEvent) error {
	l.mutex.Lock()
	d := l.current
	l.mutex.Unlock()
	if d == nil {
		return fmt.Errorf("%w: NVML is not loaded", ErrHealthUnsupported)
	}
	err := d.WatchHealth(ctx, inv, watching, events)
	if errors.Is(err, ErrDriverChanged) {
		l.drop(ctx, d)
	}
	return err
}

// drop shuts d down and forgets it, unless another call already replaced
// it. Shutdown may fail on a library that lost its driver; it is
// forgotten all the same.
func (l *Lazy) drop(ctx context.Context, d *NVML) {
	l.mutex.Lock()
	defer l.mutex.Unlock()
	if l.current != d {
		return
	}
	l.current = nil
	if err := d.Close(); err != nil {
		klog.FromContext(ctx).V(2).Info("shutting down NVML after it lost the driver", "err", err)
	}
}

// Close shuts NVML down if it was opened.
func (l *Lazy) Close() error {
	l.mutex.Lock()
	defer l.mutex.Unlock()
	if l.current == nil {
		return nil
	}
	err := l.current.Close()
	l.current = nil
	return err
}
