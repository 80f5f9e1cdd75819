package integration

import (
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	kubeletdra "k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/test/utils/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
	"github.com/topodra/topodra/pkg/topology"
	"github.com/topodra/topodra/test/integration/framework"
)

// TestStaleClaimDroppedOnceKubeletReportsItUnused: the agent learns which
// claims the node's containers use from the kubelet's own PodResources
// server, fed by the kubelet's DRA manager, as on a node. A claim that
// the kubelet prepared for a running pod and that is then deleted from the
// API server is kept past its grace period while the pod runs; once the
// pod is no longer active (and the kubelet, having lost its state, does
// not unprepare it), the agent drops it at its second check and its GPU
// can be prepared again.
func TestStaleClaimDroppedOnceKubeletReportsItUnused(t *testing.T) {
	tCtx := ktesting.Init(t)
	e := newEnv(tCtx, "podres")
	nodeName := e.ns + "-node"
	_, err := framework.CreateReadyNode(tCtx, cp.Client, nodeName, map[string]string{"test": e.ns, "group": "podres"})
	tCtx.ExpectNoError(err)
	dirs := shortDirs(tCtx, "tpr", "p", "r", "k", "s")
	pluginDir, registryDir, kubeletState, podResourcesDir := dirs[0], dirs[1], dirs[2], dirs[3]
	manager := startKubeletDRA(tCtx, nodeName, registryDir, kubeletState)
	active := &activePods{}
	socket := servePodResources(tCtx, podResourcesDir, active, manager)

	machine, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: nodeName})
	tCtx.ExpectNoError(err)
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: machine.NVML(), Sysfs: machine.Sysfs()})
	tCtx.ExpectNoError(err)
	a, err := agent.New(tCtx, agent.Options{
		NodeName:           nodeName,
		KubeClient:         cp.Client,
		Discovery:          disc,
		PluginDataDir:      pluginDir,
		RegistrarDir:       registryDir,
		StateDir:           tCtx.TempDir(),
		CDIDir:             tCtx.TempDir(),
		OwnedTaint:         agent.DefaultOwnedTaint,
		RescanInterval:     -1,
		StaleClaimGrace:    time.Nanosecond,
		PodResourcesSocket: socket,
	})
	tCtx.ExpectNoError(err, "start agent")
	tCtx.Cleanup(a.Stop)
	waitForSlice(tCtx, t, cp.Client, topology.DriverName, nodeName, "8 devices", func(s *resourceapi.ResourceSlice) bool {
		return len(s.Spec.Devices) == 8
	})

	// topodra allocates a GPU to the pod's claim, the kubelet prepares it
	// and runs the pod.
	startTopodra(tCtx)
	e.pod("trainer", topodraName, "podres", e.template(1, nil))
	pod := e.waitScheduled("trainer")
	claims, err := framework.PodClaims(tCtx, cp.Client, pod)
	tCtx.ExpectNoError(err)
	claim := claims[0]
	device := e.devicesOf(pod)[0]
	prepareOnKubelet(tCtx, manager, pod, cdi.DeviceID(claim.UID, device))
	active.set(pod)

	// The claim is deleted from the API server while the pod runs (its
	// finalizers removed by hand).
	tCtx.ExpectNoError(cp.Client.ResourceV1().ResourceClaims(e.ns).Delete(tCtx, claim.Name, metav1.DeleteOptions{}))
	_, err = cp.Client.ResourceV1().ResourceClaims(e.ns).Patch(tCtx, claim.Name, types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		tCtx.Fatalf("remove the claim's finalizers: %v", err)
	}
	check := func(what string, want ...types.UID) {
		tCtx.Helper()
		removed, err := a.CleanupStaleClaims(tCtx)
		if err != nil || !slices.Equal(removed, want) {
			tCtx.Fatalf("%s: removed %v (%v), want %v", what, removed, err, want)
		}
	}
	for range 3 {
		check("past the grace period, while the kubelet reports the pod's container using it")
	}
	other := allocatedClaim(e.ns, "next", nodeName, device)
	if err := prepareAgent(tCtx, a, other); err == nil {
		tCtx.Fatalf("%s of a claim that a running container uses was prepared for another claim", device)
	}

	// The pod stops; the kubelet lost its state and does not unprepare
	// the claim.
	active.set()
	check("first check that the kubelet reports it unused")
	check("second check", claim.UID)
	tCtx.ExpectNoError(prepareAgent(tCtx, a, other), "prepare the dropped claim's GPU for another claim")
}

// prepareAgent has the agent prepare one claim, as the kubelet asks it.
func prepareAgent(tCtx ktesting.TContext, a *agent.Agent, c *resourceapi.ResourceClaim) error {
	res, err := a.PrepareResourceClaims(tCtx, []*resourceapi.ResourceClaim{c})
	if err != nil {
		return err
	}
	return res[c.UID].Err
}

// allocatedClaim is a claim named name with device of the agent's pool on
// node allocated, as the kubelet passes it to the agent.
func allocatedClaim(namespace, name, node, device string) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name, UID: types.UID(namespace + "-" + name)},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{
			Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
				Request: "gpus", Driver: topology.DriverName, Pool: node, Device: device,
			}}},
		}},
	}
}

// servePodResources serves the kubelet's PodResources API (its own server)
// on a socket in dir until the test ends: the pods that active holds, with
// the claims that the kubelet's DRA manager has prepared for their
// containers. The glue between the two (draResources) is the test's, as
// the kubelet's container manager has it.
func servePodResources(tCtx ktesting.TContext, dir string, active *activePods, manager *kubeletdra.Manager) string {
	tCtx.Helper()
	socket := filepath.Join(dir, "kubelet.sock")
	l, err := net.Listen("unix", socket)
	tCtx.ExpectNoError(err)
	srv := grpc.NewServer()
	podresourcesv1.RegisterPodResourcesListerServer(srv, podresources.NewV1PodResourcesServer(tCtx, podresources.PodResourcesProviders{
		Pods:             active,
		Devices:          noDevices{},
		Cpus:             noCPUs{},
		Memory:           noMemory{},
		DynamicResources: draResources{manager: manager},
	}))
	go func() { _ = srv.Serve(l) }()
	tCtx.Cleanup(srv.Stop)
	tCtx.Cleanup(func() { _ = os.Remove(socket) })
	return socket
}

// activePods are the pods that the kubelet runs.
type activePods struct {
	mutex sync.Mutex
	pods  []*v1.Pod
}

func (p *activePods) set(pods ...*v1.Pod) {
	p.mutex.Lock()
	defer p.mutex.Unlock()
	p.pods = pods
}

func (p *activePods) GetActivePods() []*v1.Pod {
	p.mutex.Lock()
	defer p.mutex.Unlock()
	return slices.Clone(p.pods)
}

func (p *activePods) GetPods() []*v1.Pod { return p.GetActivePods() }

func (p *activePods) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	for _, pod := range p.GetActivePods() {
		if pod.Namespace == namespace && pod.Name == name {
			return pod, true
		}
	}
	return nil, false
}

// draResources reports the claims of a container that the kubelet's DRA
// manager has prepared, with their devices.
type draResources struct{ manager *kubeletdra.Manager }

func (d draResources) GetDynamicResources(logger klog.Logger, pod *v1.Pod, container *v1.Container) []*podresourcesv1.DynamicResource {
	infos, err := d.manager.GetContainerClaimInfos(pod, container)
	if err != nil {
		logger.Error(err, "Claims of container", "pod", klog.KObj(pod), "container", container.Name)
		return nil
	}
	var out []*podresourcesv1.DynamicResource
	for _, info := range infos {
		r := &podresourcesv1.DynamicResource{ClaimName: info.ClaimName, ClaimNamespace: info.Namespace}
		for driver, state := range info.DriverState {
			for _, device := range state.Devices {
				claimResource := &podresourcesv1.ClaimResource{DriverName: driver, PoolName: device.PoolName, DeviceName: device.DeviceName}
				for _, id := range device.CDIDeviceIDs {
					claimResource.CdiDevices = append(claimResource.CdiDevices, &podresourcesv1.CDIDevice{Name: id})
				}
				r.ClaimResources = append(r.ClaimResources, claimResource)
			}
		}
		out = append(out, r)
	}
	return out
}

// noDevices, noCPUs and noMemory: a kubelet without device plugins, CPU
// or memory manager assignments.
type noDevices struct{}

func (noDevices) UpdateAllocatedDevices(klog.Logger) {}
func (noDevices) GetDevices(string, string) []*podresourcesv1.ContainerDevices {
	return nil
}
func (noDevices) GetAllocatableDevices(klog.Logger) []*podresourcesv1.ContainerDevices {
	return nil
}

type noCPUs struct{}

func (noCPUs) GetCPUs(*v1.Pod, *v1.Container) []int64 { return nil }
func (noCPUs) GetPodCPUs(string) []int64              { return nil }
func (noCPUs) GetAllocatableCPUs() []int64            { return nil }

type noMemory struct{}

func (noMemory) GetMemory(klog.Logger, *v1.Pod, *v1.Container) []*podresourcesv1.ContainerMemory {
	return nil
}
func (noMemory) GetPodMemory(klog.Logger, string) []*podresourcesv1.ContainerMemory { return nil }
func (noMemory) GetAllocatableMemory(klog.Logger) []*podresourcesv1.ContainerMemory {
	return nil
}
