package integration

import (
	"context"
	"fmt"
	"os"
	"testing"

	"k8s.io/klog/v2"

	"github.com/topodra/topodra/test/integration/framework"
)

// cp is the control plane shared by the tests of this package. Tests isolate
// themselves with namespaces and node names of their own.
var cp *framework.ControlPlane

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	ctx := klog.NewContext(context.Background(), klog.Background())
	var err error
	cp, err = framework.StartProcess(ctx)
	if err != nil {
		fmt.Fprintf(os.Stderr, "start control plane: %v\n", err)
		return 1
	}
	defer cp.Stop()
	if _, err := cp.StartClaimController(ctx); err != nil {
		fmt.Fprintf(os.Stderr, "start claim controller: %v\n", err)
		return 1
	}
	return m.Run()
}
