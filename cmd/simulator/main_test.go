package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/topodra/topodra/pkg/sim"
)

func TestExampleWorkloadParses(t *testing.T) {
	w, err := sim.LoadWorkload("testdata/workload.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Templates) != 4 || len(w.Jobs) != 5 {
		t.Errorf("got %d templates and %d pods, want 4 and 5", len(w.Templates), len(w.Jobs))
	}
	if got := w.Ticks(); got != 4 {
		t.Errorf("workload spans %d ticks, want 4", got)
	}
}

// Bad flags fail before anything starts.
func TestBadFlags(t *testing.T) {
	tests := map[string]struct {
		args    []string
		wantErr string
	}{
		"unknown flag":         {args: []string{"--nodez", "3"}, wantErr: "flag provided but not defined"},
		"missing workload":     {args: []string{"--workload", "testdata/nope.yaml"}, wantErr: "no such file"},
		"stray argument":       {args: []string{"extra"}, wantErr: "unexpected arguments"},
		"missing stock config": {args: []string{"--stock-scheduler-config", "testdata/nope.yaml"}, wantErr: "no such file"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if code := run(tc.args, &stdout, &stderr); code != 2 {
				t.Errorf("exit code %d, want 2", code)
			}
			if !strings.Contains(stderr.String(), tc.wantErr) {
				t.Errorf("stderr %q does not say %q", stderr.String(), tc.wantErr)
			}
		})
	}
}

func TestHelpExitsZero(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := run([]string{"--help"}, &stdout, &stderr); code != 0 {
		t.Errorf("--help: exit code %d, want 0", code)
	}
	if !strings.Contains(stderr.String(), "-seed") {
		t.Errorf("--help printed no usage: %q", stderr.String())
	}
}
