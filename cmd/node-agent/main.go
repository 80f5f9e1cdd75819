// Command topodra-node-agent publishes a node's NVIDIA GPUs, with their
// topology, as ResourceSlices of driver gpu.topodra.io and serves the
// kubelet DRA plugin that prepares them for containers (CDI).
//
// Every flag has an environment-variable twin: --node-name and NODE_NAME,
// --nvml and NVML, and so on (upper case, dashes become underscores); a flag
// on the command line wins over the environment.
//
//	topodra-node-agent --node-name=$(hostname)            # on a GPU node, in the DaemonSet
//	topodra-node-agent --nvml=mock:dgx-h100 --dry-run     # print the slice a DGX H100 gets
//	topodra-node-agent --dry-run                          # what would this node publish?
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
)

func main() {
	os.Exit(cli.Run(newCommand()))
}
