// Command topodra-scheduler is kube-scheduler with the TopologyDRA plugin
// compiled in. This file is wiring only; see ./app.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"

	"github.com/topodra/topodra/cmd/scheduler/app"
)

func main() {
	os.Exit(cli.Run(app.NewCommand()))
}
