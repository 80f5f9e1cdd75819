package workload

import (
	"os"
	"path/filepath"
	"testing"
)

// FuzzWorkloadYAML feeds arbitrary documents to the simulator's workload
// reader: it must return a workload or an error, never panic, and a
// workload it returns must be usable (every job has a pod, arrival and
// lifetime are not negative, the run has ticks).
func FuzzWorkloadYAML(f *testing.F) {
	example, err := os.ReadFile(filepath.Join("..", "..", "..", "cmd", "simulator", "testdata", "workload.yaml"))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(string(example))
	for _, seed := range []string{
		"",
		"---\n---\n",
		"apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\n  annotations:\n    sim.topodra.io/arrival: \"-1\"\n",
		"apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\n  annotations:\n    sim.topodra.io/lifetime: \"x\"\n",
		"apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Pod\n  metadata:\n    name: q\n",
		"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\n",
		"kind: Pod\n",
		"{",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, doc string) {
		w, err := Parse([]byte(doc))
		if err != nil {
			if w != nil {
				t.Errorf("a workload and an error: %v", err)
			}
			return
		}
		if w == nil {
			t.Fatal("no workload and no error")
		}
		for i, j := range w.Jobs {
			if j.Pod == nil {
				t.Errorf("job %d has no pod", i)
			}
			if j.Arrival < 0 || j.Lifetime < 0 {
				t.Errorf("job %d: arrival %d, lifetime %d", i, j.Arrival, j.Lifetime)
			}
		}
		if w.Ticks() < 0 {
			t.Errorf("Ticks() = %d", w.Ticks())
		}
	})
}
