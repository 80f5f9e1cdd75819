// Command topodra-check checks a cluster's DRA allocation invariants (see
// package invariant) and exits non-zero on a violation.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/topodra/topodra/pkg/invariant"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := invariant.Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
