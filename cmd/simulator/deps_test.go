package main

import (
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// forbiddenDeps are packages that shipped binaries must not link: package
// testing, our own test scaffolding, and upstream test servers and helpers.
var forbiddenDeps = []struct {
	pkg    string // exact import path
	prefix string // or an import path prefix
}{
	{pkg: "testing"},
	{prefix: "testing/"},
	{pkg: "net/http/httptest"},
	{prefix: "github.com/topodra/topodra/test/"},
	{prefix: "k8s.io/kubernetes/test/"},
	{pkg: "k8s.io/kubernetes/cmd/kube-apiserver/app/testing"},
	{pkg: "k8s.io/apiserver/pkg/storage/etcd3/testserver"},
}

// forbidden returns the packages of deps that forbiddenDeps names.
func forbidden(deps []string) []string {
	var out []string
	for _, dep := range deps {
		for _, f := range forbiddenDeps {
			if (f.pkg != "" && dep == f.pkg) || (f.prefix != "" && strings.HasPrefix(dep, f.prefix)) {
				out = append(out, dep)
				break
			}
		}
	}
	return out
}

func TestForbiddenMatches(t *testing.T) {
	tests := map[string]struct {
		deps []string
		want []string
	}{
		"testing":          {deps: []string{"fmt", "testing"}, want: []string{"testing"}},
		"httptest":         {deps: []string{"net/http", "net/http/httptest"}, want: []string{"net/http/httptest"}},
		"testing subpkgs":  {deps: []string{"testing/fstest", "testing/iotest"}, want: []string{"testing/fstest", "testing/iotest"}},
		"own test tree":    {deps: []string{"github.com/topodra/topodra/test/integration/framework"}, want: []string{"github.com/topodra/topodra/test/integration/framework"}},
		"own product":      {deps: []string{"github.com/topodra/topodra/pkg/cluster"}},
		"apiserver tester": {deps: []string{"k8s.io/kubernetes/cmd/kube-apiserver/app/testing", "k8s.io/kubernetes/cmd/kube-apiserver/app"}, want: []string{"k8s.io/kubernetes/cmd/kube-apiserver/app/testing"}},
		"upstream tests":   {deps: []string{"k8s.io/kubernetes/test/utils/ktesting"}, want: []string{"k8s.io/kubernetes/test/utils/ktesting"}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			if got := forbidden(tc.deps); !slices.Equal(got, tc.want) {
				t.Errorf("forbidden(%v) = %v, want %v", tc.deps, got, tc.want)
			}
		})
	}
}

// TestShippedBinariesLinkNoTestCode lists the dependencies of every
// command of the module (`go list -deps ./cmd/...`) and fails if package
// testing or test scaffolding is among them.
func TestShippedBinariesLinkNoTestCode(t *testing.T) {
	goBin, root := goAndModule(t)
	cmd := exec.Command(goBin, "list", "-deps", "./cmd/...")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps ./cmd/...: %v", err)
	}
	deps := strings.Fields(string(out))
	// The listing must cover the commands, or an empty one would pass.
	for _, want := range []string{"github.com/topodra/topodra/cmd/simulator", "github.com/topodra/topodra/cmd/scheduler", "github.com/topodra/topodra/pkg/cluster"} {
		if !slices.Contains(deps, want) {
			t.Fatalf("go list -deps ./cmd/... does not list %s; got %d packages", want, len(deps))
		}
	}
	if bad := forbidden(deps); len(bad) > 0 {
		t.Errorf("shipped commands link test code: %s", strings.Join(bad, ", "))
	}
}

// testDoubles are fakes and mocks: a shipped binary may link them only
// where an upstream package does (kube-scheduler's queue links client-go's
// fake clientset, client-go's typed clients its testing package), never
// through a package of topodra's, except as perBinary allows.
var testDoubles = []string{
	"k8s.io/client-go/kubernetes/fake",
	"k8s.io/client-go/testing",
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock",
	"github.com/topodra/topodra/pkg/agent/mockgpu",
}

// perBinary holds, per shipped command other than the simulator, the test
// doubles its own packages may import, and topodra packages it must not
// link at all (the embedded control plane, the simulator).
var perBinary = map[string]struct {
	doublesAllowed []string
	noLink         []string
}{
	"./cmd/scheduler":     {noLink: []string{"github.com/topodra/topodra/pkg/cluster", "github.com/topodra/topodra/pkg/sim"}},
	"./cmd/topodra-check": {noLink: []string{"github.com/topodra/topodra/pkg/cluster", "github.com/topodra/topodra/pkg/sim"}},
	// Mock GPUs behind --nvml=mock:<profile>, for clusters without GPUs.
	"./cmd/node-agent": {
		doublesAllowed: []string{"github.com/NVIDIA/go-nvml/pkg/nvml/mock", "github.com/topodra/topodra/pkg/agent/mockgpu"},
		noLink:         []string{"github.com/topodra/topodra/pkg/cluster", "github.com/topodra/topodra/pkg/sim"},
	},
}

// underAny reports whether pkg is one of prefixes or below one.
func underAny(pkg string, prefixes []string) bool {
	for _, p := range prefixes {
		if pkg == p || strings.HasPrefix(pkg, p+"/") {
			return true
		}
	}
	return false
}

// ownDoubleImports returns "importer -> imported" for each package of
// topodra in graph (package -> its imports) that imports a test double
// other than those allowed.
func ownDoubleImports(graph map[string][]string, allowed []string) []string {
	var out []string
	for pkg, imports := range graph {
		if !strings.HasPrefix(pkg, "github.com/topodra/topodra/") {
			continue
		}
		for _, imp := range imports {
			if underAny(imp, testDoubles) && !underAny(imp, allowed) {
				out = append(out, pkg+" -> "+imp)
			}
		}
	}
	slices.Sort(out)
	return out
}

func TestOwnDoubleImports(t *testing.T) {
	graph := map[string][]string{
		"github.com/topodra/topodra/cmd/x":             {"github.com/topodra/topodra/pkg/a", "k8s.io/kubernetes/pkg/scheduler"},
		"github.com/topodra/topodra/pkg/a":             {"github.com/topodra/topodra/pkg/agent/mockgpu", "k8s.io/client-go/kubernetes/fake"},
		"github.com/topodra/topodra/pkg/agent/mockgpu": {"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"},
		"k8s.io/kubernetes/pkg/scheduler":              {"k8s.io/client-go/kubernetes/fake"},
	}
	want := []string{
		"github.com/topodra/topodra/pkg/a -> github.com/topodra/topodra/pkg/agent/mockgpu",
		"github.com/topodra/topodra/pkg/a -> k8s.io/client-go/kubernetes/fake",
		"github.com/topodra/topodra/pkg/agent/mockgpu -> github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100",
	}
	if got := ownDoubleImports(graph, nil); !slices.Equal(got, want) {
		t.Errorf("nothing allowed: %v, want %v", got, want)
	}
	allowed := []string{"github.com/NVIDIA/go-nvml/pkg/nvml/mock", "github.com/topodra/topodra/pkg/agent/mockgpu"}
	if got := ownDoubleImports(graph, allowed); !slices.Equal(got, want[1:2]) {
		t.Errorf("mocks allowed: %v, want %v", got, want[1:2])
	}
}

// TestShippedBinariesLinkNoTestDoubles: each shipped command other than
// the simulator links fakes and mocks only through upstream packages (or
// as perBinary allows), and links neither the embedded control plane nor
// the simulator.
func TestShippedBinariesLinkNoTestDoubles(t *testing.T) {
	goBin, root := goAndModule(t)
	for cmdPath, rules := range perBinary {
		cmd := exec.Command(goBin, "list", "-deps", "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}", cmdPath)
		cmd.Dir = root
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v", cmdPath, err)
		}
		graph := map[string][]string{}
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			fields := strings.Fields(line)
			graph[fields[0]] = fields[1:]
		}
		if _, ok := graph["github.com/topodra/topodra/"+strings.TrimPrefix(cmdPath, "./")]; !ok {
			t.Fatalf("go list -deps %s does not list the command itself; got %d packages", cmdPath, len(graph))
		}
		if bad := ownDoubleImports(graph, rules.doublesAllowed); len(bad) > 0 {
			t.Errorf("%s: topodra's packages import test doubles: %s", cmdPath, strings.Join(bad, ", "))
		}
		for pkg := range graph {
			if underAny(pkg, rules.noLink) {
				t.Errorf("%s links %s", cmdPath, pkg)
			}
		}
	}
}

// goAndModule returns the go command and the module's root directory.
func goAndModule(t *testing.T) (goBin, root string) {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go command not found: %v", err)
	}
	gomod, err := exec.Command(goBin, "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("go env GOMOD: %v", err)
	}
	return goBin, filepath.Dir(strings.TrimSpace(string(gomod)))
}
