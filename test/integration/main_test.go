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

func run(m *testing.M) (code int) {
	logger := klog.Background()
	tb := framework.NewProcessTB("integration", logger)
	defer tb.Close()
	defer func() {
		if r := recover(); r != nil {
			fmt.Fprintf(os.Stderr, "control plane: %v\n", r)
			code = 1
		}
	}()
	var err error
	cp, err = framework.Start(tb)
	if err != nil {
		fmt.Fprintf(os.Stderr, "start control plane: %v\n", err)
		return 1
	}
	if _, err := cp.StartClaimController(klog.NewContext(context.Background(), logger)); err != nil {
		fmt.Fprintf(os.Stderr, "start claim controller: %v\n", err)
		return 1
	}
	return m.Run()
}
