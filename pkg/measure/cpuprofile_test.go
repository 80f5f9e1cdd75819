package measure

import (
	"context"
	"runtime/pprof"
	"testing"
	"time"
)

func TestCPUProfileCountsLabelledGoroutines(t *testing.T) {
	p := StartCPUProfile()
	if !p.started {
		t.Skip("a CPU profile is already running (go test -cpuprofile): this one would record nothing")
	}
	spin := func(d time.Duration) {
		for end := time.Now().Add(d); time.Now().Before(end); {
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
