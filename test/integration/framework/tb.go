package framework

import (
	"fmt"
	"os"
	"sync"
	"testing"

	"k8s.io/klog/v2"
)

// ProcessTB lets code that wants a test handle (the apiserver and etcd test
// servers) run outside a single test: in TestMain, where one control plane is
// shared by every test of a package, and in the simulator binary. Cleanup
// functions run, last first, when Close is called. Fatal errors panic with
// the message, which TestMain and the simulator turn into a clean exit.
//
// It implements testing.TB by embedding a nil testing.TB and overriding every
// exported method; the embedded value is never called.
type ProcessTB struct {
	testing.TB

	name     string
	mu       sync.Mutex
	cleanups []func()
	failed   bool
	logger   klog.Logger
}

// NewProcessTB returns a ProcessTB that logs through logger.
func NewProcessTB(name string, logger klog.Logger) *ProcessTB {
	return &ProcessTB{name: name, logger: logger}
}

// Close runs the cleanup functions, last registered first.
func (p *ProcessTB) Close() {
	p.mu.Lock()
	cleanups := p.cleanups
	p.cleanups = nil
	p.mu.Unlock()
	for i := len(cleanups) - 1; i >= 0; i-- {
		cleanups[i]()
	}
}

// FatalError is the panic value of ProcessTB.Fatal and FailNow.
type FatalError struct{ Msg string }

func (e FatalError) Error() string { return e.Msg }

// RecoverFatal turns a FatalError panic of the control plane's test servers
// (see ProcessTB) into *err; other panics go on. Use it as
// defer framework.RecoverFatal(&err).
func RecoverFatal(err *error) {
	if r := recover(); r != nil {
		fe, ok := r.(FatalError)
		if !ok {
			panic(r)
		}
		*err = fmt.Errorf("control plane: %s", fe.Msg)
	}
}

func (p *ProcessTB) Attr(key, value string)        {}
func (p *ProcessTB) Chdir(dir string)              { _ = os.Chdir(dir) }
func (p *ProcessTB) Helper()                       {}
func (p *ProcessTB) Name() string                  { return p.name }
func (p *ProcessTB) Setenv(key, value string)      { _ = os.Setenv(key, value) }
func (p *ProcessTB) Skip(args ...any)              { p.Log(args...) }
func (p *ProcessTB) Skipf(format string, a ...any) { p.Logf(format, a...) }
func (p *ProcessTB) SkipNow()                      {}
func (p *ProcessTB) Skipped() bool                 { return false }
func (p *ProcessTB) Log(args ...any)               { p.logger.V(4).Info(fmt.Sprint(args...)) }
func (p *ProcessTB) Logf(format string, a ...any)  { p.logger.V(4).Info(fmt.Sprintf(format, a...)) }
func (p *ProcessTB) Error(args ...any)             { p.fail(fmt.Sprint(args...)) }
func (p *ProcessTB) Errorf(format string, a ...any) {
	p.fail(fmt.Sprintf(format, a...))
}
func (p *ProcessTB) Fail() { p.fail("failed") }
func (p *ProcessTB) FailNow() {
	p.fail("failed")
	panic(FatalError{Msg: "FailNow"})
}
func (p *ProcessTB) Fatal(args ...any) {
	msg := fmt.Sprint(args...)
	p.fail(msg)
	panic(FatalError{Msg: msg})
}
func (p *ProcessTB) Fatalf(format string, a ...any) { p.Fatal(fmt.Sprintf(format, a...)) }
func (p *ProcessTB) Failed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.failed
}
func (p *ProcessTB) Cleanup(f func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cleanups = append(p.cleanups, f)
}
func (p *ProcessTB) TempDir() string {
	dir, err := os.MkdirTemp("", "topodra-")
	if err != nil {
		p.Fatal(err)
	}
	p.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

func (p *ProcessTB) fail(msg string) {
	p.mu.Lock()
	p.failed = true
	p.mu.Unlock()
	p.logger.Error(nil, msg)
}
