package measure

import (
	"context"
	"runtime"
	"runtime/pprof"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestCPUProfileCountsLabelledGoroutines(t *testing.T) {
	p := StartCPUProfile()
	if !p.started {
		t.Skip("a CPU profile is already running (go test -cpuprofile): this one would record nothing")
	}
	// spin burns d of CPU time on its own OS thread, however long that
	// takes on a loaded machine (a spin timed by the wall clock got less
	// than half of its CPU while other tests ran).
	spin := func(d time.Duration) {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		threadCPU := func() (time.Duration, bool) {
			var ru unix.Rusage
			if err := unix.Getrusage(unix.RUSAGE_THREAD, &ru); err != nil {
				t.Errorf("getrusage: %v", err) // spin may run on another goroutine: no Fatal
				return 0, false
			}
			return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
		}
		start, ok := threadCPU()
		for ok {
			var now time.Duration
			if now, ok = threadCPU(); now-start >= d {
				return
			}
		}
	}
	pprof.Do(context.Background(), pprof.Labels("component", "busy"), func(context.Context) {
		done := make(chan struct{})
		go func() { // a goroutine started under the label carries it
			spin(300 * time.Millisecond)
			close(done)
		}()
		<-done
	})
	spin(100 * time.Millisecond) // unlabelled
	busy, process, raw, err := p.Stop("component", "busy")
	if err != nil {
		t.Fatal(err)
	}
	if busy < 0.15 || busy > process {
		t.Errorf("labelled CPU %.3fs, process CPU %.3fs; want about 0.3s, at most the process'", busy, process)
	}
	idle, err := labelledCPU(raw, "component", "idle")
	if err != nil {
		t.Fatal(err)
	}
	if idle != 0 {
		t.Errorf("CPU labelled component=idle = %dns, want 0 (no goroutine carried it)", idle)
	}
}
