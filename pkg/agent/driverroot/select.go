package driverroot

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
)

// Auto is the driver root setting (--driver-root=auto) that has the agent
// pick the root on each node among [AutoHostPaths] (see [AutoCandidates]).
const Auto = "auto"

// AutoHostPaths are the driver roots, as the node sees them, that [Auto]
// looks at, in order: the GPU Operator's driver container, then the host.
// The driver container's root comes first: it holds the library only
// while that container serves the node, as the library of the kernel
// module it loaded, where the host may keep the userspace libraries of
// another driver (a package left installed). An empty directory left at
// /run/nvidia/driver holds no library and is passed over.
var AutoHostPaths = []string{GPUOperatorHostPath, DefaultHostPath}

// AutoCandidates returns the roots of [AutoHostPaths] as the agent sees
// them where the node's "/" is mounted at hostRoot: /run/nvidia/driver at
// hostRoot/run/nvidia/driver, "/" at hostRoot. An empty hostRoot means
// "/" (the agent runs on the host). hostRoot must be absolute. The
// mount must propagate mounts made on the node after the agent started
// (a driver container mounts /run/nvidia/driver when it is ready).
func AutoCandidates(hostRoot string) ([]Root, error) {
	if hostRoot == "" {
		hostRoot = "/"
	}
	if !filepath.IsAbs(hostRoot) {
		return nil, fmt.Errorf("the node's root must be absolute, got %q", hostRoot)
	}
	roots := make([]Root, 0, len(AutoHostPaths))
	for _, hostPath := range AutoHostPaths {
		r, err := New(hostPath, filepath.Join(hostRoot, hostPath))
		if err != nil {
			return nil, err
		}
		roots = append(roots, r)
	}
	return roots, nil
}

// WithNVMLLibrary returns roots, each set to look for the NVML library at
// path ([Root.WithNVMLLibrary]), less those that an absolute path is not
// below. The error wraps [ErrOutsideRoot] where it is below none.
func WithNVMLLibrary(roots []Root, path string) ([]Root, error) {
	var out []Root
	var errs []error
	for _, r := range roots {
		with, err := r.WithNVMLLibrary(path)
		switch {
		case errors.Is(err, ErrOutsideRoot):
			errs = append(errs, err)
			continue
		case err != nil:
			return nil, err
		}
		out = append(out, with)
	}
	if len(out) == 0 {
		return nil, errors.Join(errs...)
	}
	return out, nil
}

// Choice is the driver root that a [Selector] found first to hold the
// NVML library.
type Choice struct {
	Root Root
	// Library is the agent-side path of the NVML library in Root.
	Library string
	// Passed are the candidates before Root, each with why it was not
	// taken.
	Passed []Miss
}

// String says which root, where the library is and why the candidates
// before it were passed over.
func (c Choice) String() string {
	s := fmt.Sprintf("%s (library %s)", describe(c.Root), c.Library)
	if len(c.Passed) > 0 {
		s += ", passed over " + describeMisses(c.Passed)
	}
	return s
}

// Miss is a candidate root that does not hold the NVML library, and why.
type Miss struct {
	Root Root
	Err  error
}

// NotFoundError is returned by [Selector.Detect] where none of several
// candidates holds the NVML library. It wraps [ErrNotFound].
type NotFoundError struct {
	Misses []Miss
}

func (e *NotFoundError) Error() string {
	return "no driver root holds the NVML library: " + describeMisses(e.Misses)
}

func (e *NotFoundError) Unwrap() error { return ErrNotFound }

// ChangedError is returned by [Selector.Load] and [Selector.Check] where
// the candidate found first to hold the NVML library (To) is not the root
// whose library the process loaded (From). A process keeps the first
// libnvidia-ml it loaded (its symbols are bound for good), so only a new
// process can load To's.
type ChangedError struct {
	From Root
	To   Choice
}

func (e *ChangedError) Error() string {
	return fmt.Sprintf("driver root %s now holds the NVML library and comes before %s, whose library this process loaded; a new process must load it", describe(e.To.Root), describe(e.From))
}

// Selector picks the driver root to load NVML from: the first of its
// candidates that holds the library ([Root.NVMLLibraryPath]). It looks
// again at every call, and remembers the root whose library was loaded
// ([Selector.Load]). It is safe for concurrent use.
type Selector struct {
	candidates []Root

	mutex  sync.Mutex
	loaded *Choice
	notify func(Choice)
}

// NewSelector returns a selector among candidates, in order; there must be
// at least one.
func NewSelector(candidates ...Root) (*Selector, error) {
	if len(candidates) == 0 {
		return nil, errors.New("no driver root to select from")
	}
	return &Selector{candidates: candidates}, nil
}

// Candidates returns the roots it selects from, in order.
func (s *Selector) Candidates() []Root {
	return append([]Root(nil), s.candidates...)
}

// Notify has f called with the choice of the first successful Load, once,
// outside the selector's lock; f must not call the selector.
func (s *Selector) Notify(f func(Choice)) {
	s.mutex.Lock()
	defer s.mutex.Unlock()
	s.notify = f
}

// Detect returns the first candidate that holds the NVML library now. With
// one candidate the error is that candidate's (wrapping [ErrNotFound]);
// with more, a [*NotFoundError] naming each.
func (s *Selector) Detect() (Choice, error) {
	var misses []Miss
	for _, r := range s.candidates {
		lib, err := r.NVMLLibraryPath()
		if err == nil {
			return Choice{Root: r, Library: lib, Passed: misses}, nil
		}
		misses = append(misses, Miss{Root: r, Err: err})
	}
	if len(misses) == 1 {
		return Choice{}, misses[0].Err
	}
	return Choice{}, &NotFoundError{Misses: misses}
}

// Load returns the root to load NVML from, as Detect finds it, and
// remembers it as the loaded root: the caller loads its Library. Once a
// root was loaded, a later call returns it again (with its library path
// resolved anew), fails with a [*ChangedError] where Detect finds another
// root first, and with Detect's error where no candidate holds the library.
func (s *Selector) Load() (Choice, error) {
	c, err := s.Detect()
	if err != nil {
		return Choice{}, err
	}
	s.mutex.Lock()
	first := s.loaded == nil
	if !first && s.loaded.Root != c.Root {
		from := s.loaded.Root
		s.mutex.Unlock()
		return Choice{}, &ChangedError{From: from, To: c}
	}
	s.loaded = &c
	notify := s.notify
	s.mutex.Unlock()
	if first && notify != nil {
		notify(c)
	}
	return c, nil
}

// Loaded returns the root of the last successful Load; false before one.
func (s *Selector) Loaded() (Root, bool) {
	s.mutex.Lock()
	defer s.mutex.Unlock()
	if s.loaded == nil {
		return Root{}, false
	}
	return s.loaded.Root, true
}

// Check returns a [*ChangedError] where a root was loaded and Detect now
// finds another root first; nil otherwise (nothing loaded yet, or no
// candidate holds the library now: there is nothing better to load).
func (s *Selector) Check() error {
	loaded, ok := s.Loaded()
	if !ok {
		return nil
	}
	c, err := s.Detect()
	if err != nil || c.Root == loaded {
		return nil
	}
	return &ChangedError{From: loaded, To: c}
}

// describe names a root by its node path, and where the agent sees it
// where that differs.
func describe(r Root) string {
	if r.Path == r.HostPath {
		return r.HostPath
	}
	return fmt.Sprintf("%s (at %s here)", r.HostPath, r.Path)
}

func describeMisses(misses []Miss) string {
	parts := make([]string, 0, len(misses))
	for _, m := range misses {
		parts = append(parts, fmt.Sprintf("%s: %v", describe(m.Root), m.Err))
	}
	// The directories searched, where every root was searched in the same
	// ones, once at the end: the message goes into an event's note, which
	// the API server limits.
	if _, searched, ok := strings.Cut(parts[0], " (searched "); ok && len(parts) > 1 {
		suffix := " (searched " + searched
		if !strings.HasSuffix(suffix, ")") || strings.Contains(searched, " (searched ") {
			return strings.Join(parts, "; ")
		}
		for _, p := range parts {
			if !strings.HasSuffix(p, suffix) {
				return strings.Join(parts, "; ")
			}
		}
		for k := range parts {
			parts[k] = strings.TrimSuffix(parts[k], suffix)
		}
		return strings.Join(parts, "; ") + "; each searched in " + strings.TrimSuffix(searched, ")")
	}
	return strings.Join(parts, "; ")
}
