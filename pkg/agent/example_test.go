package agent_test

import (
	"context"
	"fmt"

	"k8s.io/client-go/kubernetes"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
)

// A simulator runs one publish-only agent per simulated node, each on its
// own mock machine. The Node objects must exist first: they own the slices.
func ExampleStartSimulated() {
	ctx := context.Background()
	var client kubernetes.Interface // from the embedded control plane

	var nodes []*agent.Simulated
	for i := range 4 {
		profile := mockgpu.ProfileDGXH100
		if i%2 == 1 {
			profile = mockgpu.ProfilePCIeNVLinkPairs
		}
		s, err := agent.StartSimulated(ctx, agent.SimulatedOptions{
			NodeName:   fmt.Sprintf("gpu-node-%d", i),
			Profile:    profile,
			KubeClient: client,
			OwnedTaint: true, // only topodra allocates these GPUs
			NICs:       true, // nic.topodra.io devices on the GPU pairs' PCIe roots (dgx-h100)
		})
		if err != nil {
			panic(err)
		}
		nodes = append(nodes, s)
	}
	// Fault injection: an XID 79 on GPU 3 of node 0 taints gpu-3 there.
	_ = nodes[0].Machine.InjectXID(3, 79)

	for _, s := range nodes {
		s.Stop()
	}
}
