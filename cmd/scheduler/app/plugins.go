package app

import (
	schedapp "k8s.io/kubernetes/cmd/kube-scheduler/app"

	"github.com/topodra/topodra/pkg/plugins/topologydra"
)

func init() {
	registryOptions = append(registryOptions,
		schedapp.WithPlugin(topologydra.Name, topologydra.New),
		schedapp.WithPlugin(topologydra.SortName, topologydra.NewSort))
}
