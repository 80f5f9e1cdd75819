package sim

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
)

func TestPlanNodes(t *testing.T) {
	tests := map[string]struct {
		profile string
		nodes   int
		want    map[string]int
		wantErr string
	}{
		"single profile, default count": {profile: "dgx-h100", want: map[string]int{"dgx-h100": 8}},
		"single profile":                {profile: "workstation-2gpu", nodes: 3, want: map[string]int{"workstation-2gpu": 3}},
		"mix used as is":                {profile: "dgx-h100=6,pcie-nvlink-pairs=2", want: map[string]int{"dgx-h100": 6, "pcie-nvlink-pairs": 2}},
		"mix matching nodes":            {profile: "dgx-h100=6,pcie-nvlink-pairs=2", nodes: 8, want: map[string]int{"dgx-h100": 6, "pcie-nvlink-pairs": 2}},
		"mix scaled down":               {profile: "dgx-h100=6,pcie-nvlink-pairs=2", nodes: 4, want: map[string]int{"dgx-h100": 3, "pcie-nvlink-pairs": 1}},
		"mix scaled up":                 {profile: "dgx-h100=1,pcie-nvlink-pairs=1", nodes: 5, want: map[string]int{"dgx-h100": 3, "pcie-nvlink-pairs": 2}},
		"unknown profile":               {profile: "dgx-b200", wantErr: `unknown machine profile "dgx-b200"`},
		"bad count":                     {profile: "dgx-h100=x", wantErr: "count must be a positive integer"},
		"empty":                         {profile: " , ", wantErr: "no machine profile"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			specs, err := PlanNodes(tc.profile, tc.nodes)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := map[string]int{}
			for i, s := range specs {
				got[s.Profile]++
				if want := fmt.Sprintf("sim-node-%d", i); s.Name != want {
					t.Errorf("node %d named %q, want %q", i, s.Name, want)
				}
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got %v, want %v", got, tc.want)
			}
		})
	}
}

func TestOptionsValidate(t *testing.T) {
	o := Options{Schedulers: []string{"topodra", "kube"}}
	o.setDefaults()
	if err := o.validate(); err == nil || !strings.Contains(err.Error(), `unknown scheduler "kube"`) {
		t.Errorf("got %v, want an unknown-scheduler error", err)
	}
	if got := ParseSchedulers(" topodra, ,stock"); !reflect.DeepEqual(got, []string{"topodra", "stock"}) {
		t.Errorf("ParseSchedulers = %v", got)
	}
}

// TestCheckSaysEachProblemOnce: one problem with the options is one
// message.
func TestCheckSaysEachProblemOnce(t *testing.T) {
	tests := map[string]struct {
		opts Options
		want string
	}{
		"negative nodes":  {opts: Options{Nodes: -1}, want: "nodes must not be negative, got -1"},
		"negative faults": {opts: Options{Faults: -2}, want: "faults must not be negative, got -2"},
		"unknown profile": {opts: Options{Profile: "dgx-b200"}, want: `unknown machine profile "dgx-b200"`},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			err := tc.opts.Check()
			if err == nil {
				t.Fatalf("no error, want %q", tc.want)
			}
			if err.Error() != tc.want && !strings.HasPrefix(err.Error(), tc.want+" (") {
				t.Errorf("Check() = %q, want one message: %q", err, tc.want)
			}
		})
	}
}

// TestWorkloadRefusesGeneratorOptions: a workload of its own is not
// pinned and not a trace; the options that would not apply are refused.
func TestWorkloadRefusesGeneratorOptions(t *testing.T) {
	w := &Workload{}
	tests := map[string]struct {
		opts Options
		want string
	}{
		"pin":           {opts: Options{Workload: w, Pin: true}, want: "pin applies to the builtin workload only"},
		"trace":         {opts: Options{Workload: w, Trace: TracePoisson}, want: "trace poisson generates a workload: not with a workload of its own"},
		"default trace": {opts: Options{Workload: w, Trace: TraceBuiltin}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			err := tc.opts.Check()
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("Check() = %v, want no error", err)
			case tc.want != "" && (err == nil || err.Error() != tc.want):
				t.Errorf("Check() = %v, want %q", err, tc.want)
			}
		})
	}
}
