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
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go command not found: %v", err)
	}
	gomod, err := exec.Command(goBin, "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("go env GOMOD: %v", err)
	}
	root := filepath.Dir(strings.TrimSpace(string(gomod)))
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
