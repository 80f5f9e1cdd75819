// Package agent is the topodra node agent: it publishes a node's GPUs as
// ResourceSlices (driver gpu.topodra.io, one pool per node) and implements
// the kubelet DRA plugin that prepares them for containers through CDI.
//
// # Running an agent
//
// [New] wires everything: the lock on the state directory, discovery,
// kubeletplugin.Start, health watching, then publishing. The agent
// republishes when discovery reports a change (polled every
// [Options.RescanInterval]) and when a device becomes unhealthy.
// Publishing goes through the upstream resourceslice controller, owned by
// the Node: a restart with the same devices finds the existing slices
// equal to the desired ones and changes nothing in the API.
//
// # Rolling updates
//
// With [Options.RollingUpdateUID] (the pod's UID) the kubelet sockets are
// the pod's own, and the agent starts them before it waits for the lock
// that the agent it replaces holds: the kubelet registers the new agent
// beside the old one, never has the driver unregistered (so it never wipes
// the node's slices), and sends its calls to the newer agent, which answers
// them once the old one has exited and it has taken over the checkpoint.
// Before it starts its sockets the new agent checks, without the lock,
// that it can take over: that it reads the checkpoint and writes CDI
// specs ([Start] fails otherwise), and a dry run of discovery, of the
// devices it would publish and of their CDI spec (it waits and retries
// otherwise, see [ReasonTakeOverBlocked]). Until both pass it is not
// ready, so that a rollout of a bad build stops at the first node.
//
// # Publish-only mode (simulators)
//
// A real agent registers with the kubelet through sockets below
// /var/lib/kubelet. A simulator has no kubelet. With [Options.PublishOnly]
// the agent starts the kubeletplugin helper with its registration and DRA
// gRPC services disabled (kubeletplugin.RegistrationService(false),
// kubeletplugin.DRAService(false)): no socket, no directory, no kubelet, but
// the same ResourceSlice publishing, republishing and health taints as on a
// real node. Prepare and Unprepare still work when called directly if
// [Options.StateDir] and [Options.CDIDir] are set. [StartSimulated] builds a
// mock machine and a publish-only agent for one simulated node in one call.
//
// # Taints
//
// With [Options.OwnedTaint] every device carries the NoSchedule device taint
// [Options.OwnedTaintKey]: the default scheduler does not allocate these
// devices, topodra tolerates its own taint. A device
// that NVML reports as faulty (critical XID, lost GPU) carries the
// taint [HealthTaintKey] with the reason ("xid-79") as value and the
// effect [Options.UnhealthyTaintEffect] (NoSchedule by default; NoExecute
// has the device taint eviction controller evict the pods that use it)
// until the node reboots or [ClearFaultsAnnotation] clears it: the fault
// belongs to the GPU's UUID, stays while
// the GPU is missing from discovery, and is kept in the checkpoint (where
// the agent has one) across agent restarts. While the agent cannot use
// NVML (see [Agent.NVMLUnusable]) every device carries the NoSchedule taint
// [NVMLUnusableTaintKey]. With [Options.OtherDriverCheck] a device whose
// GPU another DRA driver publishes on the node too carries the NoSchedule
// taint [OtherDriverTaintKey]. A GPU whose NVLink fabric is not ready carries
// the NoSchedule taint [FabricNotReadyTaintKey] until a rescan finds it
// ready; likewise a GPU that needs a reset to apply a repair of its memory
// (row remapping or page retirement pending) carries
// [ResetRequiredTaintKey], and one whose compute mode is Prohibited
// [ComputeProhibitedTaintKey]. A GPU whose row remapping failed carries
// [HealthTaintKey] with the value "row-remap-failure" and the effect
// [Options.UnhealthyTaintEffect], and is Unhealthy to the kubelet, for as
// long as discovery reads the failure. Unlike for a fault that NVML
// reported as an event, Prepare does not refuse a claim that was allocated
// such a GPU before it was tainted.
package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/agent/cdi"
	"github.com/topodra/topodra/pkg/agent/checkpoint"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/eventnote"
	"github.com/topodra/topodra/pkg/topology"
)

// HealthTaintKey is the device taint that marks a faulty device
// (topology.HealthTaintKey).
const HealthTaintKey = topology.HealthTaintKey

// NVMLUnusableTaintKey is the device taint on every device while the agent
// cannot use NVML: such devices cannot be prepared
// (topology.NVMLUnusableTaintKey).
const NVMLUnusableTaintKey = topology.NVMLUnusableTaintKey

// DefaultRescanInterval is how often the agent rediscovers devices.
const DefaultRescanInterval = time.Minute

// healthResendInterval keeps the kubelet's health data fresh; the kubelet
// treats data older than healthCheckTimeout as unknown.
const (
	healthResendInterval = 10 * time.Second
	healthCheckTimeout   = 30 * time.Second
)

// DefaultOwnedTaint is the node agent command's default for
// [Options.OwnedTaint]: on, because topodra-scheduler and the default
// scheduler run as separate processes and double-book untainted devices.
const DefaultOwnedTaint = true

// Options configure [New]. NodeName, KubeClient and Discovery are required.
type Options struct {
	// NodeName is the node whose devices are published; it owns the slices.
	NodeName string
	// KubeClient talks to the API server.
	KubeClient kubernetes.Interface
	// Discovery finds the node's devices.
	Discovery discovery.Interface
	// Health watches device faults. Nil means: use Discovery if it
	// implements discovery.HealthWatcher, otherwise no health reporting
	// (WatchHealthStatus returns kubeletplugin.ErrHealthNotSupported).
	Health discovery.HealthWatcher

	// DriverName defaults to topology.DriverName.
	DriverName string
	// PoolName defaults to NodeName.
	PoolName string

	// PublishOnly disables the kubelet registration and DRA gRPC services:
	// the agent only publishes ResourceSlices. For simulators and tests.
	PublishOnly bool
	// PluginDataDir holds the DRA socket; it defaults to
	// /var/lib/kubelet/plugins/<driver>. Unused with PublishOnly.
	PluginDataDir string
	// RegistrarDir is the kubelet's plugin registry directory; it defaults
	// to /var/lib/kubelet/plugins_registry. Unused with PublishOnly.
	RegistrarDir string
	// RollingUpdateUID is the UID of the agent's pod. Where it is set
	// (and not PublishOnly) the agent registers with the kubelet through
	// sockets of its own (kubeletplugin.RollingUpdate; kubelet 1.33 or
	// later), so that a new agent pod can run beside the old one during a
	// DaemonSet rolling update and the kubelet always has a registered
	// plugin of the driver: the agent starts the kubelet sockets before
	// it takes the lock on StateDir, once its takeover check passes (see
	// ReasonTakeOverBlocked), Ready succeeds once the kubelet has
	// registered them (so that the rollout stops the old pod), and the
	// kubelet's calls that arrive before the old agent has exited and
	// this one has started wait for that. Empty: the sockets are named
	// by the driver alone and start only once the lock is held, so a
	// second agent must not start before the first has stopped.
	RollingUpdateUID types.UID
	// RegistrationTimeout is how long the kubelet may take to register
	// the plugin after New before the agent records a Warning
	// (ReasonNotRegistered) on the Node; zero means
	// DefaultRegistrationTimeout, negative never. Until the kubelet
	// registers the plugin, Ready fails. Unused with PublishOnly.
	RegistrationTimeout time.Duration
	// StateDir holds the checkpoint of prepared claims; it defaults to
	// PluginDataDir. With PublishOnly and no StateDir, Prepare fails.
	StateDir string
	// CDIDir receives the per-claim CDI specs; it defaults to /var/run/cdi.
	// With PublishOnly and no CDIDir, Prepare fails.
	CDIDir string
	// CDIGenerator produces the content of the CDI specs; nil means
	// cdi.Static{} (device nodes that exist, no driver files).
	CDIGenerator cdi.Generator
	// BootIDPath is read for the node's boot id; prepared claims recorded
	// under another boot id are dropped at start (Prepare then refuses
	// such a claim if its device names now name other GPUs). Default
	// DefaultBootIDPath; a file that cannot be read disables the check.
	BootIDPath string
	// StaleClaimCheck is how often prepared claims are checked against the
	// API server (see CleanupStaleClaims): a claim that no longer exists
	// (or was recreated with another UID) is reported on the Node and
	// dropped after StaleClaimGrace. Zero or negative disables the check
	// (the command's default is DefaultRescanInterval); when enabled it
	// also runs once at start.
	StaleClaimCheck time.Duration
	// StaleClaimGrace is how long a prepared claim that the API server no
	// longer has keeps its GPUs before the agent drops it, which it does
	// only where the kubelet reports no container on the node using the
	// claim (see CleanupStaleClaims). Until then the kubelet unprepares it
	// once its containers are gone. Zero
	// means DefaultStaleClaimGrace; negative: never dropped. The time a
	// claim was first found gone is kept in the checkpoint, so that agent
	// restarts do not start the grace period again.
	StaleClaimGrace time.Duration
	// PodResourcesSocket is the kubelet's PodResources API (a unix
	// socket), which tells the stale-claim check which claims the
	// containers on the node use; where it cannot be reached, no claim is
	// dropped. Default DefaultPodResourcesSocket.
	PodResourcesSocket string
	// Pod is the agent's own pod, where it runs in one: the stale-claim
	// check trusts an answer of the kubelet's PodResources API only where
	// it lists this pod (see CleanupStaleClaims). Empty: not checked.
	Pod types.NamespacedName
	// Clock tells the time that StaleClaimGrace is measured in; nil
	// means the real clock.
	Clock clock.PassiveClock

	// OwnedTaint publishes the NoSchedule taint OwnedTaintKey on every
	// device, so that only topodra (which tolerates it) allocates them.
	// The command's default is DefaultOwnedTaint. Without it, a default
	// scheduler running beside topodra hands out the same devices.
	OwnedTaint bool
	// OwnedTaintKey defaults to topology.DefaultTaintKey; New refuses a
	// key that is not a qualified name.
	OwnedTaintKey string
	// UnhealthyTaintEffect is the effect of the health taint
	// (HealthTaintKey) of a faulty GPU: NoSchedule (the default where
	// empty) keeps new allocations off it and leaves the pods that use it
	// alone; NoExecute also has the device taint eviction controller of
	// kube-controller-manager evict them (pods whose claims do not
	// tolerate the taint), running or not yet started, so that their
	// controllers create them again elsewhere. New refuses other effects.
	UnhealthyTaintEffect resourceapi.DeviceTaintEffect

	// DevicePluginResources name the extended resources of a device
	// plugin that hands out the same GPUs (a name, or a prefix ending in
	// "*"; the command's default is DefaultDevicePluginResources): while
	// the Node's allocatable has any of them, every device carries the
	// NoSchedule taint DevicePluginTaintKey (see CheckNode).
	// Empty disables the check.
	DevicePluginResources []string
	// OtherDriverCheck watches the ResourceSlices of other DRA drivers on
	// the node (NVIDIA's gpu.nvidia.com): a device of theirs whose
	// resource.kubernetes.io/pciBusID or uuid attribute is that of one of
	// the agent's GPUs is the same GPU, which the default scheduler hands
	// out through that driver, so while one does the agent's device
	// carries the NoSchedule taint OtherDriverTaintKey, the Node gets a
	// ReasonOtherDriver Warning, and claims not prepared yet are refused
	// with ErrOtherDriverConflict. The slices are read at start before
	// the first publish, then watched. The command's default is
	// DefaultOtherDriverCheck.
	OtherDriverCheck bool
	// NodeCheck is how often the Node is read after the read at start
	// (default DefaultRescanInterval): for DevicePluginResources, and
	// for its UID, which owns the published ResourceSlices (see
	// CheckNode).
	NodeCheck time.Duration

	// RescanInterval is how often devices are rediscovered (default
	// DefaultRescanInterval); negative disables rescanning. It is also
	// how often health watching is retried while it does not watch every
	// GPU (every DefaultRescanInterval where rescanning is disabled).
	RescanInterval time.Duration
	// NoGPURetry is the first delay before discovery is retried while it
	// finds no GPU (default DefaultNoGPURetry); the delay doubles up to
	// RescanInterval. Retrying happens even when rescanning is disabled.
	NoGPURetry time.Duration

	// ToolkitConfig is where the node's NVIDIA Container Toolkit
	// configuration (config.toml) is visible to the agent, checked at
	// start (see ReasonVisibleDevicesEnvAccepted); empty: not checked.
	ToolkitConfig string

	// Recorder, if set, receives events about the Node: a Warning
	// (reason ReasonNoGPU) when discovery finds no GPU, a Normal one
	// (ReasonGPUsFound) when it finds GPUs after that; Warnings about
	// conditions that last (ReasonNoGPU, ReasonNVMLUnusable,
	// ReasonDeviceUnhealthy) again every EventRepeat while they last; a Warning
	// (ReasonCDIHookMissing) at start when CDIGenerator is a
	// cdi.HookChecker that finds its hook missing; a Warning
	// (ReasonVisibleDevicesEnvAccepted) at start when ToolkitConfig lets
	// unprivileged containers choose GPUs; a Warning
	// (ReasonDeviceNodeMissing) when Prepare fails for a device node
	// missing on the node; a Warning (ReasonSliceFieldsDropped) when the API server drops fields of a
	// published slice; a Warning (ReasonPublishFailed) when it refuses the
	// slices for a cause that retrying does not fix, a Normal one
	// (ReasonPublished) once it takes them after that; a Warning (ReasonCheckpointUnreadable) before New
	// fails on an unreadable checkpoint; a Warning (ReasonTakeOverBlocked)
	// while an agent with RollingUpdateUID does not take over; a Warning
	// (ReasonPreparedClaimsRecovered) at start when the checkpoint is
	// missing and CDIDir holds the specs of prepared claims; a Warning
	// (ReasonHealthPartlyWatched) when health watching leaves some GPUs
	// unwatched, a Normal one (ReasonHealthWatched) when a retry watches
	// them all; a Warning (ReasonGPUNotPublished) when discovery finds
	// GPUs that it does not publish, a Normal one (ReasonAllGPUsPublished)
	// when it publishes them all after that; a Warning
	// (ReasonFabricNotReady) when discovery finds GPUs whose NVLink
	// fabric is not ready, a Normal one (ReasonFabricReady) once every
	// fabric is ready after that; a Warning (ReasonOtherDriver) when
	// another DRA driver publishes GPUs of the agent, a Normal one
	// (ReasonOtherDriverGone) once none does after that; a Warning (ReasonStateLocked) when New waits for another
	// agent's lock on StateDir; see also CleanupStaleClaims.
	Recorder events.EventRecorder
}

// DefaultBootIDPath is where Linux publishes the boot id.
const DefaultBootIDPath = "/proc/sys/kernel/random/boot_id"

// DefaultNoGPURetry is the default first retry delay while no GPU is found.
const DefaultNoGPURetry = 5 * time.Second

// Event reasons on the Node.
const (
	// ReasonNoGPU (Warning, when discovery finds no GPU, its cause
	// changes, and every EventRepeat while it lasts): the note says why.
	ReasonNoGPU = "TopodraNoGPU"
	// ReasonGPUsFound (Normal): discovery finds GPUs, after ReasonNoGPU
	// or ReasonNVMLUnusable.
	ReasonGPUsFound = "TopodraGPUsFound"
	// ReasonNVMLReload (Warning): NVML lost the kernel driver (an
	// upgrade or unload), or another driver root holds the library to
	// load now (--driver-root=auto); the agent stops so that its restart
	// loads it.
	ReasonNVMLReload = "TopodraNVMLReload"
	// ReasonNVMLUnusable (Warning, when discovery fails, its error
	// changes, and every EventRepeat while it lasts): discovery fails
	// (NVML cannot be initialized, see discovery.ErrNVMLUnusable), so
	// GPUs cannot be prepared; the note names the error. A Normal
	// ReasonGPUsFound follows once discovery works.
	ReasonNVMLUnusable = "TopodraNVMLUnusable"
	// ReasonCDIHookMissing (Warning, at start): the program that the CDI
	// specs' hooks run is missing on the node (cdi.HookChecker); Prepare
	// fails for every claim until it is there.
	ReasonCDIHookMissing = "TopodraCDIHookMissing"
	// ReasonDeviceNodeMissing (Warning, at Prepare): a device node that
	// every container of a GPU needs (cdi.ErrMissingDeviceNode:
	// /dev/nvidiactl, the GPU's, those of nvidia-uvm) is missing on the
	// node; Prepare fails until it is there, and the note says what to do.
	// The claim is the event's related object.
	ReasonDeviceNodeMissing = "TopodraDeviceNodeMissing"
	// ReasonSliceFieldsDropped (Warning, once per distinct problem): the
	// API server stored a published ResourceSlice without some of its
	// fields (a feature gate such as DRADeviceTaints is off).
	ReasonSliceFieldsDropped = "TopodraSliceFieldsDropped"
	// ReasonCheckpointUnreadable (Warning, at start): the checkpoint of
	// prepared claims cannot be read (ErrCheckpoint); New fails.
	ReasonCheckpointUnreadable = "TopodraCheckpointUnreadable"
	// ReasonStateUnwritable (Warning, once per distinct error): the agent
	// cannot write its state directory or the CDI directory (a full or
	// read-only file system): at start (ErrStateUnwritable; New fails),
	// or in a Prepare or Unprepare, which fails until it can.
	ReasonStateUnwritable = "TopodraStateUnwritable"
	// ReasonHealthPartlyWatched (Warning, when health watching starts,
	// and when a retry watches more GPUs but not all): the health source
	// watches some GPUs but not the ones the event names; the kubelet
	// gets those as Unknown.
	ReasonHealthPartlyWatched = "TopodraHealthPartlyWatched"
	// ReasonHealthWatched (Normal): a retry of health watching watches
	// every GPU, after the health of some or all was not watched.
	ReasonHealthWatched = "TopodraHealthWatched"
	// ReasonGPUNotPublished (Warning, once per distinct set): discovery
	// found GPUs that it does not publish (discovery.Skipped: NVML cannot
	// read them, or MIG is enabled); the note names each one's NVML
	// index, PCI bus id and reason.
	ReasonGPUNotPublished = "TopodraGPUNotPublished"
	// ReasonAllGPUsPublished (Normal): discovery publishes every GPU it
	// finds, after a ReasonGPUNotPublished.
	ReasonAllGPUsPublished = "TopodraAllGPUsPublished"
)

// Agent is a running node agent. It implements kubeletplugin.DRAPlugin.
type Agent struct {
	opts      Options
	discovery discovery.Interface
	health    discovery.HealthWatcher
	store     *checkpoint.Store
	cdi       *cdi.Writer

	ctx    context.Context
	cancel context.CancelCauseFunc
	wg     sync.WaitGroup
	// started is closed once start has succeeded, startDone once it has
	// returned; startErr is why it failed.
	started, startDone chan struct{}
	startErr           atomic.Pointer[error]
	// step is what start does now (nil before it begins).
	step atomic.Pointer[startStep]
	// helper is the kubelet plugin helper (nil with PublishOnly). The
	// agent publishes through its own publisher, not the helper's, so
	// that the owner of its slices can follow the Node (see CheckNode).
	// It is set before helperUp is closed, or before started where
	// helperUp stays open.
	helper   *kubeletplugin.Helper
	helperUp chan struct{}
	// takeOverRun is the dry run of the takeover check that has not
	// returned yet (see checkTakeOver), nil otherwise; only the starting
	// goroutine uses it.
	takeOverRun *dryRun
	// publisher publishes the devices (nil until the first publish),
	// with the Node of UID ownerUID as owner of the slices ("": the
	// controller looks the Node up). Both change under publishMutex.
	publisher *Publisher
	ownerUID  types.UID
	// publishing is publisher, for readers that must not wait for
	// publishMutex, which is held while a new publisher waits for the API
	// server (see setPublisherLocked).
	publishing atomic.Pointer[Publisher]
	// nodeCheckNow asks the node loop for a check before its interval
	// ends (see checkNodeSoon).
	nodeCheckNow chan struct{}

	// staleMutex serializes CleanupStaleClaims and guards goneReported:
	// the prepared claims that this process has reported gone from the
	// API server (when they were first found gone is in the checkpoint).
	staleMutex   sync.Mutex
	goneReported map[types.UID]bool
	// unusedBefore, guarded by staleMutex, holds the prepared claims gone
	// from the API server that the kubelet reported unused in the last
	// check (see unreferenced).
	unusedBefore sets.Set[types.UID]
	// podResourcesReported, guarded by staleMutex: a
	// ReasonPodResourcesUnavailable event was recorded and no check has
	// reached the kubelet since.
	podResourcesReported bool
	// podResourcesLogged, guarded by staleMutex: what the log last said
	// of a check that could not learn from the kubelet which claims are
	// in use (see podResourcesFailed), "" once a check has learnt it.
	podResourcesLogged string

	// claimLocks serialize the Prepare and Unprepare calls of each claim
	// (the kubelet plugin helper does not serialize calls). A Prepare
	// holds its claims' locks across CDI spec generation, which calls
	// NVML and can hang; nothing else waits for it.
	claimLocks claimLocks
	// prepareMutex serializes the changes to prepared claims: the
	// checkpoint's Claims and PreviousBoot change only under it, and it
	// guards preparing. It is never held across CDI spec generation.
	// Lock order: a claim's lock, then prepareMutex.
	prepareMutex sync.Mutex
	// preparing holds the claims whose Prepare generates their CDI spec
	// now, with their devices, so that no other claim is prepared with
	// them meanwhile.
	preparing map[types.UID]checkpoint.PreparedClaim
	// checkpointMutex serializes the read-modify-write cycles of the
	// checkpoint file (see updateCheckpoint). It is held only while the
	// file is read, changed in memory and written, never across CDI spec
	// generation or API calls, so that recording a GPU fault does not
	// wait for a Prepare. Lock order: prepareMutex, then checkpointMutex.
	checkpointMutex sync.Mutex

	// calls is held for reading by every Prepare and Unprepare while it
	// runs; Stop takes it for writing before it releases the lock on
	// StateDir.
	calls sync.RWMutex

	// publishMutex keeps publish calls in order and guards publisher
	// and ownerUID.
	publishMutex sync.Mutex

	// preparedClaims and staleClaims are the numbers of prepared claims
	// and of those found gone (MetricPreparedClaims,
	// MetricStalePreparedClaims) as the checkpoint had them when it was
	// last read at start or written; prepareErrors counts the claims
	// that Prepare did not prepare (MetricPrepareErrors).
	preparedClaims, staleClaims atomic.Int64
	prepareErrors               prepareErrorCounts
	// publishErrors counts the errors that publishing reports
	// (MetricPublishErrors).
	publishErrors publishErrorCounts

	// mutex guards the fields below.
	mutex sync.Mutex
	// registration is what the kubelet said of the plugin's registration.
	registration registration
	inventory    *discovery.Inventory
	// noGPU is why the last discovery found no GPU, nil once it found some.
	noGPU error
	// nvmlUnusable is why discovery fails while the agent runs on the
	// devices it published before (see New), nil otherwise.
	nvmlUnusable error
	// holdPublishing is set while nvmlUnusable and the devices published
	// before could not be read from the API: nothing is published then.
	holdPublishing bool
	discovered     bool
	// faults are the faulty GPUs by UUID, with Device set to the name
	// the GPU had when the fault was seen.
	faults map[string]discovery.HealthEvent
	// faultLast is, for a fault reported again, when it was last
	// reported (see markUnhealthy).
	faultLast map[string]time.Time
	// faultsCleared are the UUIDs whose faults ClearFaultsAnnotation
	// cleared and that the checkpoint may still hold, each with the
	// clearGen of its clear (see writeFaults).
	faultsCleared map[string]uint64
	clearGen      uint64
	// created is when New made the agent: a ClearFaultsAnnotation set
	// before it that clears nothing was reported by an agent before.
	created time.Time
	// clearAnnotation is the ClearFaultsAnnotation at the last Node check, so
	// that a value is reported once (see clearFaults).
	clearAnnotation clearFaultsState
	// faultsUnsaved is set while faults holds one that could not be
	// written to the checkpoint; a retry runs meanwhile.
	faultsUnsaved bool
	published     *resourceslice.DriverResources
	// droppedFields holds the messages of the DroppedFieldsErrors
	// reported on the Node.
	droppedFields map[string]bool
	// publishRefused holds the causes (refusalCause) of the
	// ReasonPublishFailed events recorded since the slices were last
	// published, at most maxPublishRefused (see publishFailed).
	publishRefused sets.Set[string]
	// warned holds when the last Warning about each condition that
	// lasts was recorded, while it lasts (see warnDueLocked).
	warned map[warning]time.Time
	// devicePlugin lists the device plugin's resources the Node
	// advertises ("name=quantity, ..."), empty where it has none.
	devicePlugin string
	// foreign are the devices of other drivers on the node that name a
	// GPU (see OtherDriverCheck); otherDrivers identifies the agent's
	// GPUs among them as last reported (see reportOtherDrivers), "" for
	// none.
	foreign      []foreignDevice
	otherDrivers string
	// healthChanged is closed (and replaced) when a device becomes
	// unhealthy or healthActive changes: it wakes up the kubelet's health
	// streams.
	healthChanged chan struct{}
	// skipped identifies the GPUs that the last successful discovery
	// found and does not publish (see skippedKey), "" for none.
	skipped string
	// fabricNotReady, resetRequired, rowRemapFailed and
	// computeProhibited identify the GPUs that the last successful
	// discovery found with each gpuCondition (see recordCondition), ""
	// for none.
	fabricNotReady, resetRequired, rowRemapFailed, computeProhibited string
	// healthActive says whether the health source is watching now.
	healthActive bool
	// unwatched are the GPUs that the health source does not watch while
	// healthActive, by UUID, with why; nil otherwise.
	unwatched discovery.Unwatched
	// healthDown says why the health source stopped watching, while it
	// does not watch; "" otherwise.
	healthDown string
	// healthRun is the watcher whose state healthActive, unwatched and
	// healthDown describe; healthRetry is a retry that has not said yet
	// what it watches (see retryHealth). Either may be nil.
	healthRun, healthRetry *healthRun
	// stateLock is the open lock file (see LockFileName) while the agent
	// holds the lock on StateDir, nil otherwise.
	stateLock *os.File
}

var _ kubeletplugin.DRAPlugin = &Agent{}

// New discovers devices, starts the kubelet plugin helper (or, with
// PublishOnly, only its publishing part), publishes the node's pool and
// starts rescanning and health watching in the background. Everything stops
// when ctx is canceled or Stop is called. A node without GPUs (discovery
// returns discovery.ErrNoGPU: no library, no kernel driver, no device yet)
// publishes an empty pool, stays Ready, reports it on the Node and retries
// with backoff (NoGPURetry doubling up to RescanInterval).
//
// Other discovery errors (NVML cannot be initialized, as after a driver
// upgrade without a reboot: discovery.ErrNVMLUnusable) do not fail New:
// the agent must run so that the kubelet can unprepare the claims of
// pods that go away. It reports the error on the Node
// (ReasonNVMLUnusable) and retries with the same backoff. Meanwhile it
// publishes the devices of its pool as they are in the API (published
// before it started), each with the NoSchedule taint NVMLUnusableTaintKey:
// claims allocated before keep their devices, and no new claim gets
// them; where the slices cannot be read it publishes nothing until they
// can or discovery works. Prepare refuses claims it has not prepared
// before, Unprepare works. NVMLUnusable says why.
//
// With a checkpoint (StateDir and CDIDir set), New first takes the lock
// on StateDir (see LockFileName), waiting while another agent holds it,
// until ctx ends; then claims prepared during another boot are dropped.
//
// New is [Start] followed by waiting until the agent has started; where
// starting fails it returns why, with everything stopped.
func New(ctx context.Context, opts Options) (*Agent, error) {
	a, err := Start(ctx, opts)
	if err != nil {
		return nil, err
	}
	select {
	case <-a.started:
		return a, nil
	case <-a.Done():
		select {
		case <-a.started:
			// Started, then stopped at once (a fatal error): the
			// caller sees it through Done and Err, as later.
			return a, nil
		default:
		}
		err := a.Err()
		a.Stop()
		return nil, err
	}
}

// Start is [New] without the wait: it checks the options and returns an
// agent that starts in the background (Started is closed once it has,
// Done and Err tell where starting fails; Stop stops it either way), so
// that its health endpoints can answer while it waits for the lock on
// StateDir. With RollingUpdateUID it first starts the kubelet sockets, and
// an error doing so is returned. Ready fails until the agent has started,
// except with RollingUpdateUID, where it succeeds once the kubelet has
// registered the sockets. The kubelet's calls that arrive before the agent
// has started wait for it.
func Start(ctx context.Context, opts Options) (*Agent, error) {
	if opts.NodeName == "" {
		return nil, errors.New("node name must be set")
	}
	if opts.KubeClient == nil {
		return nil, errors.New("kube client must be set")
	}
	if opts.Discovery == nil {
		return nil, errors.New("discovery must be set")
	}
	opts.setNames()
	if opts.OwnedTaintKey == "" {
		opts.OwnedTaintKey = topology.DefaultTaintKey
	}
	if err := ValidateTaintKey(opts.OwnedTaintKey); err != nil {
		return nil, fmt.Errorf("owned taint key: %w", err)
	}
	if opts.UnhealthyTaintEffect == "" {
		opts.UnhealthyTaintEffect = resourceapi.DeviceTaintEffectNoSchedule
	}
	if err := ValidateUnhealthyTaintEffect(opts.UnhealthyTaintEffect); err != nil {
		return nil, err
	}
	if opts.RescanInterval == 0 {
		opts.RescanInterval = DefaultRescanInterval
	}
	if opts.NoGPURetry <= 0 {
		opts.NoGPURetry = DefaultNoGPURetry
	}
	if opts.StaleClaimGrace == 0 {
		opts.StaleClaimGrace = DefaultStaleClaimGrace
	}
	if opts.PodResourcesSocket == "" {
		opts.PodResourcesSocket = DefaultPodResourcesSocket
	}
	if opts.NodeCheck <= 0 {
		opts.NodeCheck = DefaultRescanInterval
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.PublishOnly {
		opts.RollingUpdateUID = ""
	} else {
		if opts.PluginDataDir == "" {
			opts.PluginDataDir = filepath.Join(kubeletplugin.KubeletPluginsDir, opts.DriverName)
		}
		if opts.RegistrarDir == "" {
			opts.RegistrarDir = kubeletplugin.KubeletRegistryDir
		}
		if opts.StateDir == "" {
			opts.StateDir = opts.PluginDataDir
		}
		if opts.CDIDir == "" {
			opts.CDIDir = cdi.DefaultDir
		}
		if err := checkSocketPaths(&opts); err != nil {
			return nil, err
		}
	}
	logger := klog.LoggerWithValues(klog.FromContext(ctx), "node", opts.NodeName, "driver", opts.DriverName)
	ctx = klog.NewContext(ctx, logger)

	a := &Agent{
		opts:           opts,
		discovery:      opts.Discovery,
		health:         opts.Health,
		faults:         map[string]discovery.HealthEvent{},
		faultLast:      map[string]time.Time{},
		faultsCleared:  map[string]uint64{},
		created:        time.Now(),
		healthChanged:  make(chan struct{}),
		goneReported:   map[types.UID]bool{},
		droppedFields:  map[string]bool{},
		publishRefused: sets.New[string](),
		warned:         map[warning]time.Time{},
		nodeCheckNow:   make(chan struct{}, 1),
		started:        make(chan struct{}),
		startDone:      make(chan struct{}),
		helperUp:       make(chan struct{}),
	}
	if a.health == nil {
		if hw, ok := opts.Discovery.(discovery.HealthWatcher); ok {
			a.health = hw
		}
	}
	a.ctx, a.cancel = context.WithCancelCause(ctx)
	if opts.RollingUpdateUID != "" {
		if err := a.canTakeOver(ctx); err != nil {
			a.cancel(err)
			return nil, err
		}
	}
	a.wg.Go(func() {
		defer close(a.startDone)
		if err := a.takeOver(); err != nil {
			a.startErr.Store(&err)
			a.cancel(err)
			return
		}
		if err := a.start(); err != nil {
			a.startErr.Store(&err)
			a.cancel(err)
			return
		}
		close(a.started)
	})
	return a, nil
}

// Started is closed once the agent has started: it holds its state,
// serves the kubelet (unless PublishOnly) and has published its devices.
func (a *Agent) Started() <-chan struct{} { return a.started }

// hasStarted says whether Started is closed.
func (a *Agent) hasStarted() bool {
	select {
	case <-a.started:
		return true
	default:
		return false
	}
}

// takeOver does, with RollingUpdateUID, what comes before start: it
// waits until the takeover check passes (see awaitTakeOver), then starts
// the kubelet sockets, beside those of the running agent. Without
// RollingUpdateUID it does nothing.
func (a *Agent) takeOver() error {
	if a.opts.RollingUpdateUID == "" {
		return nil
	}
	if err := a.awaitTakeOver(a.ctx); err != nil {
		return err
	}
	return a.startHelper()
}

// start does what New does after the checks of Start and takeOver, in
// a.ctx. Where it fails, Stop releases what it took.
func (a *Agent) start() error {
	ctx, opts := a.ctx, a.opts
	logger := klog.FromContext(ctx)
	if opts.StateDir != "" && opts.CDIDir != "" {
		a.setStep("waiting for the lock on "+filepath.Join(opts.StateDir, LockFileName)+" and reading the checkpoint", true)
		if err := a.openState(ctx); err != nil {
			return err
		}
		a.setStep("checking the CDI hook", false)
		a.checkCDIHook(ctx)
		a.checkToolkitConfig(ctx)
	}

	a.setStep("discovering GPUs", false)
	inv, err := opts.Discovery.Discover(ctx)
	switch {
	case errors.Is(err, discovery.ErrNoGPU):
		inv = &discovery.Inventory{}
	case err != nil:
		err = fmt.Errorf("discover devices: %w", err)
		a.setStep("reading the published devices", false)
		published, ok := a.publishedInventory(ctx)
		inv, a.holdPublishing = published, !ok
	}
	a.mutex.Lock()
	a.inventory = inv
	a.mutex.Unlock()
	a.recordDiscovery(ctx, inv, err)
	logDiscovery(logger, inv)
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}

	a.setStep("starting the kubelet plugin", false)
	if !opts.PublishOnly && opts.RollingUpdateUID == "" {
		if err := a.startHelper(); err != nil {
			return err
		}
	}
	if !opts.PublishOnly {
		a.removeStaleSockets(ctx)
	}
	a.setStep("reading the Node and publishing", false)

	// Before the first publish, so that the slices are owned by the Node
	// as it is now and a node with a device plugin never publishes its
	// devices untainted; where the Node cannot be read the resourceslice
	// controller looks it up, and the devices are tainted until it can
	// be read.
	node, nodeErr := a.readNode(ctx)
	if nodeErr == nil {
		a.ownerUID = node.UID
	}
	if len(opts.DevicePluginResources) > 0 {
		found := devicePlugin(node, opts.DevicePluginResources)
		if nodeErr != nil {
			utilruntime.HandleErrorWithContext(ctx, nodeErr, "device plugin check failed at start, publishing the devices tainted until it succeeds")
			// An action of its own: the event broadcaster would count a
			// conflict found later as a repeat of this one, and keep this
			// note.
			a.nodeEvent(v1.EventTypeWarning, ReasonDevicePlugin, "ReadNode", "cannot read the Node to check for a device plugin that hands out the same GPUs (%v): %s devices are tainted %s (NoSchedule) until it can", nodeErr, opts.DriverName, DevicePluginTaintKey)
			found = devicePluginUnknown
		}
		a.setDevicePlugin(ctx, found)
	}
	if opts.OtherDriverCheck {
		a.listOtherDrivers(ctx)
	}
	// After the device plugin check: a clear publishes.
	if nodeErr == nil {
		a.clearFaults(ctx, node)
	}
	if err := a.publish(ctx); err != nil {
		return err
	}
	if opts.OtherDriverCheck {
		a.wg.Go(func() { a.watchOtherDrivers(ctx) })
	}
	// Health watching is retried, and Warnings about conditions that
	// last are repeated, every rescan, every DefaultRescanInterval where
	// rescans are off.
	every := opts.RescanInterval
	if every < 0 {
		every = DefaultRescanInterval
	}
	if a.health != nil {
		a.startHealth(inv)
		a.wg.Go(func() { a.healthRetryLoop(ctx, every) })
	}
	a.wg.Go(func() { a.repeatLoop(ctx, every) })
	a.wg.Go(func() { a.rescanLoop(ctx) })
	a.wg.Go(func() { a.nodeLoop(ctx, opts.NodeCheck) })
	if a.store != nil && opts.StaleClaimCheck > 0 {
		a.wg.Go(func() { a.staleClaimLoop(ctx) })
	}
	return nil
}

// startHelper starts the kubelet plugin helper: the registration and DRA
// sockets, per pod with RollingUpdateUID.
func (a *Agent) startHelper() error {
	opts := a.opts
	helperOpts := []kubeletplugin.Option{
		// The agent serializes per claim (claimLocks): a Prepare
		// that hangs in NVML must not hold up every other call.
		kubeletplugin.Serialize(false),
		kubeletplugin.DriverName(opts.DriverName),
		kubeletplugin.NodeName(opts.NodeName),
		kubeletplugin.KubeClient(opts.KubeClient),
		kubeletplugin.PluginDataDirectoryPath(opts.PluginDataDir),
		kubeletplugin.RegistrarDirectoryPath(opts.RegistrarDir),
		kubeletplugin.PluginSocket(draSocketName(opts.PluginDataDir, opts.RollingUpdateUID)),
		kubeletplugin.GRPCInterceptor(a.watchRegistration),
	}
	if opts.RollingUpdateUID != "" {
		helperOpts = append(helperOpts, kubeletplugin.RollingUpdate(opts.RollingUpdateUID))
	}
	helper, err := kubeletplugin.Start(a.ctx, a, helperOpts...)
	if err != nil {
		return fmt.Errorf("start kubelet plugin: %w", err)
	}
	a.helper = helper
	close(a.helperUp)
	if timeout := opts.RegistrationTimeout; timeout >= 0 {
		if timeout == 0 {
			timeout = DefaultRegistrationTimeout
		}
		a.wg.Go(func() { a.awaitRegistration(a.ctx, timeout) })
	}
	return nil
}

// startStep is a step of start: what it does, since when, and whether it
// waits for another agent, or for its takeover check to pass (which may
// take as long as that agent runs).
type startStep struct {
	what      string
	since     time.Time
	waitsForA bool
}

// maxStartStep is how long a step of start may take, other than waiting
// for another agent, before Live fails: a start that hangs (in NVML) is
// restarted by the liveness probe, as the startup probe did while the
// health endpoints came up only after the start.
var maxStartStep = 5 * time.Minute

// setStep records what start does now.
func (a *Agent) setStep(what string, waitsForAgent bool) {
	a.step.Store(&startStep{what: what, since: time.Now(), waitsForA: waitsForAgent})
}

// currentStep returns what start does now and for how long, nil once the
// agent has started.
func (a *Agent) currentStep() (*startStep, time.Duration) {
	if a.hasStarted() {
		return nil, 0
	}
	step := a.step.Load()
	if step == nil {
		return &startStep{what: "checking its options"}, 0
	}
	return step, time.Since(step.since)
}

// startingErr says what the agent does while it has not started, nil
// once it has.
func (a *Agent) startingErr() error {
	step, took := a.currentStep()
	if step == nil {
		return nil
	}
	return fmt.Errorf("the agent is starting: %s (for %s)", step.what, took.Round(time.Second))
}

// startHung returns an error where a step of start other than waiting for
// another agent has taken longer than maxStartStep.
func (a *Agent) startHung() error {
	step, took := a.currentStep()
	if step == nil || step.waitsForA || took <= maxStartStep {
		return nil
	}
	return fmt.Errorf("the agent has been starting for too long: %s for %s", step.what, took.Round(time.Second))
}

// awaitStart waits until the agent has started, for a call of the kubelet
// that can come before (with RollingUpdateUID, while the agent waits for
// the lock on StateDir that the agent it replaces holds).
func (a *Agent) awaitStart(ctx context.Context) error {
	if a.hasStarted() {
		return nil
	}
	klog.FromContext(ctx).V(2).Info("The kubelet's call waits until the agent has started")
	select {
	case <-a.started:
		return nil
	case <-ctx.Done():
		if err := a.startingErr(); err != nil {
			return fmt.Errorf("%w: %w", err, context.Cause(ctx))
		}
		return context.Cause(ctx)
	case <-a.ctx.Done():
		if a.hasStarted() {
			return nil
		}
		return fmt.Errorf("the agent stopped before it started: %w", a.Err())
	}
}

// ValidateTaintKey checks a device taint key as the API server does (a
// qualified name, like a label key): a key it refuses would make every
// ResourceSlice write fail.
func ValidateTaintKey(key string) error {
	if errs := validation.IsQualifiedName(key); len(errs) > 0 {
		return fmt.Errorf("%q is not a valid taint key: %s", key, strings.Join(errs, "; "))
	}
	return nil
}

// setNames fills in the default driver and pool names.
func (o *Options) setNames() {
	if o.DriverName == "" {
		o.DriverName = topology.DriverName
	}
	if o.PoolName == "" {
		o.PoolName = o.NodeName
	}
}

// openState takes the lock on StateDir (waiting while another agent holds
// it, see LockFileName), opens the checkpoint there and the CDI spec
// writer on CDIDir (removing the temporary spec files that an agent left
// behind there, and checking, unless PublishOnly, that specs can be written there:
// the kubelet's first Prepare must not be what finds out), drops claims prepared during another boot, records
// the claims whose CDI specs exist where the checkpoint is missing (see
// recoverClaims) and takes over the GPU
// faults recorded during this one. It fails on an
// unreadable checkpoint at once rather than on the first Prepare: the
// agent must not forget prepared devices. Where it fails it does not hold
// the lock.
func (a *Agent) openState(ctx context.Context) (err error) {
	if err := a.lockState(ctx); err != nil {
		return err
	}
	defer func() {
		if err != nil {
			a.unlockState()
		}
	}()
	store, err := checkpoint.New(a.opts.StateDir)
	if err != nil {
		return err
	}
	var cdiOpts []cdi.Option
	if a.opts.CDIGenerator != nil {
		cdiOpts = append(cdiOpts, cdi.WithGenerator(a.opts.CDIGenerator))
	}
	writer, err := cdi.New(a.opts.CDIDir, cdiOpts...)
	if err != nil {
		return err
	}
	// With the lock held no other agent writes specs there: what
	// temporary files of this driver are there, an agent that ended while
	// it wrote left behind, and they would keep their space on a tmpfs.
	// One that cannot be removed costs space only, not the start.
	removed, rmErr := writer.RemoveTempFiles()
	if len(removed) > 0 {
		klog.FromContext(ctx).Info("Removed temporary CDI spec files left behind", "files", removed)
	}
	if rmErr != nil {
		klog.FromContext(ctx).Error(rmErr, "Cannot remove temporary CDI spec files left behind", "cdiDir", a.opts.CDIDir)
	}
	if !a.opts.PublishOnly {
		if err := probeDir(a.opts.CDIDir); err != nil {
			return fmt.Errorf("%w: %s: %w", ErrCDIDir, a.opts.CDIDir, err)
		}
	}
	a.store, a.cdi = store, writer
	if err := a.checkBootID(ctx); err != nil {
		if errors.Is(err, ErrCheckpoint) {
			a.checkpointUnreadable(ctx, err)
			return err
		}
		return a.stateUnwritable(ctx, "Start", fmt.Errorf("%w: %w", ErrStateUnwritable, err))
	}
	return a.loadFaults()
}

// ErrStateUnwritable is returned (wrapped) where the agent cannot read or
// write its state directory or the CDI directory: by New for the state it
// found at start (the claims of an earlier boot, the claims recovered from
// their CDI specs), by Prepare and Unprepare for their checkpoint and the
// claims' CDI specs.
var ErrStateUnwritable = errors.New("the agent's state cannot be written")

// stateUnwritable reports err, a failure to read or write the agent's
// state directory or the CDI directory, in the log and as a
// ReasonStateUnwritable Warning on the Node (one per distinct error), and
// returns it. action is what failed: Start, Prepare or Unprepare.
func (a *Agent) stateUnwritable(ctx context.Context, action string, err error) error {
	klog.FromContext(ctx).Error(err, "Cannot read or write the agent's state", "action", action, "stateDir", a.opts.StateDir, "cdiDir", a.opts.CDIDir)
	a.stateUnwritableEvent(action, err)
	return err
}

// stateUnwritableEvent is stateUnwritable's event alone, for an error
// already logged.
func (a *Agent) stateUnwritableEvent(action string, err error) {
	a.nodeCauseEvent(v1.EventTypeWarning, ReasonStateUnwritable, action,
		"%s: %s failed: %v; GPU claims on this node are not prepared or unprepared until the agent can write %s and %s (a full or read-only file system?); running containers keep their GPUs",
		a.opts.DriverName, action, err, a.opts.StateDir, a.opts.CDIDir)
}

// ErrCheckpoint is returned (wrapped) by New when the checkpoint of
// prepared claims exists and cannot be read (damaged, or written by an
// agent with a newer checkpoint format), or does not exist while a claim
// spec in Options.CDIDir cannot be read (wrapping cdi.ErrUnreadableSpec).
var ErrCheckpoint = errors.New("checkpoint of prepared claims is unreadable")

// checkpointUnreadable reports an unreadable checkpoint in the log and as
// a ReasonCheckpointUnreadable Warning on the Node, with the file and
// what to do: the agent does not start without it, so that it never
// prepares a GPU that a running container uses for another claim.
func (a *Agent) checkpointUnreadable(ctx context.Context, err error) {
	path := a.store.Path()
	todo := "cordon the node, move the file aside, restart the agent and then the kubelet, which prepares the claims of running pods again (docs/agent.md: \"Unreadable checkpoint\")"
	switch {
	case errors.Is(err, checkpoint.ErrUnknownVersion):
		todo = "it was written by a newer agent: run that version again (docs/agent.md: \"Unreadable checkpoint\")"
	case errors.Is(err, cdi.ErrUnreadableSpec):
		todo = "the checkpoint is missing, and without the claim's spec the agent cannot tell which GPUs its containers hold: cordon the node, delete the pods on it that use the claim with the UID in the file name (or make sure none does), then remove the file and restart the agent"
	}
	klog.FromContext(ctx).Error(err, "Cannot start: the record of prepared claims is unreadable", "path", path, "todo", todo)
	a.nodeEvent(v1.EventTypeWarning, ReasonCheckpointUnreadable, "Start",
		"%s cannot start: %v; no GPU claim can be prepared or unprepared on this node until it is fixed, running containers keep their GPUs; %s",
		a.opts.DriverName, err, todo)
}

// ErrCDIDir is returned (wrapped) by New when Options.CDIDir cannot be
// created or written.
var ErrCDIDir = errors.New("CDI directory is not usable")

// probeDir creates dir if needed and creates and removes a file in it.
func probeDir(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, ".topodra-probe-*")
	if err != nil {
		return err
	}
	name := f.Name()
	if err := f.Close(); err != nil {
		_ = os.Remove(name)
		return err
	}
	return os.Remove(name)
}

func logDiscovery(logger klog.Logger, inv *discovery.Inventory) {
	names := make([]string, 0, len(inv.GPUs))
	for _, g := range inv.GPUs {
		names = append(names, g.Name)
	}
	logger.V(2).Info("Discovered devices", "devices", names)
	for _, s := range inv.Skipped {
		logger.Info("GPU not published", "index", s.Index, "uuid", s.UUID, "pciBusID", s.PCIBusID, "reason", s.Reason)
	}
}

// Stop stops publishing, health watching and the kubelet plugin and waits
// for background work and for the Prepare and Unprepare calls still
// running to finish, then releases the lock on StateDir; later calls fail.
// Published slices stay in the API (a restarted agent takes them over);
// they are garbage collected with the Node. Stop may be called more than
// once.
func (a *Agent) Stop() {
	a.cancel(errors.New("agent stopped"))
	// Starting ends with a.ctx; it sets what is stopped below.
	<-a.startDone
	a.helper.Stop()
	a.publishMutex.Lock()
	a.publisher.Stop()
	a.publishMutex.Unlock()
	a.wg.Wait()
	// The gRPC server's stop does not wait for the calls it was serving:
	// those still running must not change the checkpoint once another
	// agent can have the lock. A call that hangs (in NVML) keeps the
	// lock until the process is killed, which releases it.
	a.calls.Lock()
	a.unlockState()
	a.calls.Unlock()
}

// beginCall starts a Prepare or Unprepare: it waits until the agent has
// started (see awaitStart), then marks the call as running until the
// returned function is called (see calls); it fails once the agent stops.
func (a *Agent) beginCall(ctx context.Context) (func(), error) {
	if err := a.awaitStart(ctx); err != nil {
		return nil, err
	}
	a.calls.RLock()
	if a.ctx.Err() != nil {
		a.calls.RUnlock()
		return nil, fmt.Errorf("the agent is stopping: %w", a.Err())
	}
	return a.calls.RUnlock, nil
}

// Done is closed when the agent stops, because its context was canceled,
// Stop was called, or a fatal error occurred; Err then says why.
func (a *Agent) Done() <-chan struct{} { return a.ctx.Done() }

// Err returns why the agent stopped, nil while it runs.
func (a *Agent) Err() error {
	if a.ctx.Err() == nil {
		return nil
	}
	if err := a.startErr.Load(); err != nil {
		return *err
	}
	return context.Cause(a.ctx)
}

// Inventory returns the current discovery result. Callers must not modify it.
func (a *Agent) Inventory() *discovery.Inventory {
	a.mutex.Lock()
	defer a.mutex.Unlock()
	return a.inventory
}

// Resources returns what the agent currently wants published.
func (a *Agent) Resources() resourceslice.DriverResources {
	a.mutex.Lock()
	defer a.mutex.Unlock()
	return a.resourcesLocked()
}

func (a *Agent) resourcesLocked() resourceslice.DriverResources {
	unhealthy := map[string]discovery.HealthEvent{}
	for _, g := range a.inventory.GPUs {
		if ev, ok := a.faults[g.UUID]; ok {
			unhealthy[g.Name] = ev
		}
	}
	return BuildResources(a.inventory, a.opts.PoolName, unhealthy, TaintOptions{
		Owned:        a.opts.OwnedTaint,
		OwnedKey:     a.opts.OwnedTaintKey,
		DevicePlugin: a.devicePlugin != "",
		OtherDriver:  a.otherDriverTaintsLocked(),
		NVMLUnusable: a.nvmlUnusable != nil,
		Unhealthy:    a.opts.UnhealthyTaintEffect,
	})
}

// TaintOptions control the taints that [BuildResources] adds.
type TaintOptions struct {
	// Owned adds the NoSchedule taint OwnedKey to every device.
	Owned    bool
	OwnedKey string
	// DevicePlugin adds the NoSchedule taint DevicePluginTaintKey to
	// every device.
	DevicePlugin bool
	// OtherDriver adds the NoSchedule taint OtherDriverTaintKey to the
	// devices it names, with the other driver's name as value.
	OtherDriver map[string]string
	// NVMLUnusable adds the NoSchedule taint NVMLUnusableTaintKey to
	// every device.
	NVMLUnusable bool
	// Unhealthy is the effect of the health taint; empty: NoSchedule.
	Unhealthy resourceapi.DeviceTaintEffect
}

// ValidateUnhealthyTaintEffect accepts the effects the health taint may
// have: NoSchedule and NoExecute.
func ValidateUnhealthyTaintEffect(effect resourceapi.DeviceTaintEffect) error {
	switch effect {
	case resourceapi.DeviceTaintEffectNoSchedule, resourceapi.DeviceTaintEffectNoExecute:
		return nil
	}
	return fmt.Errorf("unhealthy taint effect %q: want %s or %s", effect, resourceapi.DeviceTaintEffectNoSchedule, resourceapi.DeviceTaintEffectNoExecute)
}

// BuildResources turns an inventory into the pool that the agent publishes:
// one slice with all devices in index order, each with the owned taint (if
// enabled) and the others that taints asks for, FabricNotReadyTaintKey if
// its GPU's fabric is not ready, ResetRequiredTaintKey if the GPU needs a
// reset, ComputeProhibitedTaintKey if its compute mode is Prohibited, and
// a health taint if it is in unhealthy (that fault's) or its row
// remapping failed (discovery.RowRemapFailure, without a time). The
// result is a pure function of its inputs, so republishing
// an unchanged node is a no-op.
func BuildResources(inv *discovery.Inventory, poolName string, unhealthy map[string]discovery.HealthEvent, taints TaintOptions) resourceslice.DriverResources {
	resources := inv.DriverResources(poolName)
	devices := resources.Pools[poolName].Slices[0].Devices
	for i := range devices {
		if taints.Owned {
			key := taints.OwnedKey
			if key == "" {
				key = topology.DefaultTaintKey
			}
			devices[i].Taints = append(devices[i].Taints, resourceapi.DeviceTaint{
				Key:    key,
				Effect: resourceapi.DeviceTaintEffectNoSchedule,
			})
		}
		if taints.DevicePlugin {
			devices[i].Taints = append(devices[i].Taints, resourceapi.DeviceTaint{
				Key:    DevicePluginTaintKey,
				Effect: resourceapi.DeviceTaintEffectNoSchedule,
			})
		}
		if driver, ok := taints.OtherDriver[devices[i].Name]; ok {
			devices[i].Taints = append(devices[i].Taints, resourceapi.DeviceTaint{
				Key:    OtherDriverTaintKey,
				Value:  driver,
				Effect: resourceapi.DeviceTaintEffectNoSchedule,
			})
		}
		if taints.NVMLUnusable {
			devices[i].Taints = append(devices[i].Taints, resourceapi.DeviceTaint{
				Key:    NVMLUnusableTaintKey,
				Effect: resourceapi.DeviceTaintEffectNoSchedule,
			})
		}
		gpu := inv.GPU(devices[i].Name)
		for _, taint := range []*resourceapi.DeviceTaint{fabricTaint(gpu), resetTaint(gpu), computeTaint(gpu)} {
			if taint != nil {
				devices[i].Taints = append(devices[i].Taints, *taint)
			}
		}
		ev, ok := unhealthy[devices[i].Name]
		if !ok && gpu != nil && gpu.RowRemapFailed {
			ev, ok = rowRemapFault, true
		}
		if ok {
			taint := resourceapi.DeviceTaint{
				Key:    HealthTaintKey,
				Value:  ev.Reason,
				Effect: cmp.Or(taints.Unhealthy, resourceapi.DeviceTaintEffectNoSchedule),
			}
			if !ev.Time.IsZero() {
				taint.TimeAdded = &metav1.Time{Time: ev.Time.Truncate(time.Second)}
			}
			devices[i].Taints = append(devices[i].Taints, taint)
		}
	}
	return resources
}

// publish hands the desired resources to the publisher if they changed since
// the last call. It publishes nothing while holdPublishing.
func (a *Agent) publish(ctx context.Context) error {
	a.publishMutex.Lock()
	defer a.publishMutex.Unlock()
	a.mutex.Lock()
	if a.holdPublishing {
		a.mutex.Unlock()
		return nil
	}
	resources := a.resourcesLocked()
	if a.published != nil && apiequality.Semantic.DeepEqual(a.published, &resources) {
		a.mutex.Unlock()
		return nil
	}
	a.published = &resources
	a.mutex.Unlock()

	klog.FromContext(ctx).V(2).Info("Publishing devices", "pool", a.opts.PoolName, "devices", len(resources.Pools[a.opts.PoolName].Slices[0].Devices))
	if a.publisher != nil {
		a.publisher.Update(resources)
		return nil
	}
	// The same controller that the kubelet plugin helper would run,
	// started directly and owned by the Node.
	publisher, err := publishStatic(a.ctx, a.opts.KubeClient, a.opts.DriverName, a.opts.NodeName, a.ownerUID, resources, a.publishHooks())
	if err != nil {
		return err
	}
	a.setPublisherLocked(publisher)
	return nil
}

// setPublisherLocked makes p the agent's publisher. The caller holds
// publishMutex.
func (a *Agent) setPublisherLocked(p *Publisher) {
	a.publisher = p
	a.publishing.Store(p)
}

// PublishStatus reports on publishing; ok is false until the agent has
// published.
func (a *Agent) PublishStatus() (status PublishStatus, ok bool) {
	a.publishMutex.Lock()
	defer a.publishMutex.Unlock()
	if a.publisher == nil {
		return PublishStatus{}, false
	}
	return a.publisher.Status(), true
}

// Rescan rediscovers devices now and republishes if anything changed.
// When NVML lost the kernel driver (discovery.ErrDriverChanged: a driver
// upgrade or unload) the agent stops (see driverChanged). When NVML cannot
// be initialized (discovery.ErrNVMLUnusable), or discovery still fails
// while it could not be, the agent keeps its devices tainted as New
// describes; other errors keep the last published devices as they are.
func (a *Agent) Rescan(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	inv, err := a.discovery.Discover(ctx)
	wasUnusable := a.NVMLUnusable() != nil
	switch {
	case errors.Is(err, discovery.ErrDriverChanged):
		a.driverChanged(ctx, err)
		return fmt.Errorf("discover devices: %w", err)
	case errors.Is(err, discovery.ErrNoGPU):
		inv = &discovery.Inventory{}
	case err != nil && (wasUnusable || errors.Is(err, discovery.ErrNVMLUnusable)):
		err = fmt.Errorf("discover devices: %w", err)
		a.recordDiscovery(ctx, nil, err)
		a.adoptPublished(ctx)
		if perr := a.publish(ctx); perr != nil {
			return perr
		}
		return err
	case err != nil:
		return fmt.Errorf("discover devices: %w", err)
	}
	a.recordDiscovery(ctx, inv, err)
	a.mutex.Lock()
	old := a.inventory
	changed := !apiequality.Semantic.DeepEqual(old, inv)
	// After NVML was unusable, the watcher (if any) watched the devices
	// as published, through a library that may not have worked.
	restartHealth := (changed && !sameUUIDs(old, inv)) || wasUnusable
	if changed {
		a.inventory = inv
		if !slices.Equal(rowRemapFailed(old), rowRemapFailed(inv)) {
			a.healthChangedLocked()
		}
	}
	a.holdPublishing = false
	a.mutex.Unlock()
	if !changed && !wasUnusable {
		return nil
	}
	logger.V(2).Info("Devices changed")
	logDiscovery(logger, inv)
	a.reportOtherDrivers(ctx)
	if restartHealth && a.health != nil {
		a.startHealth(inv)
	}
	return a.publish(ctx)
}

// listOwnSlices lists the slices of the agent's driver on its node.
func (a *Agent) listOwnSlices(ctx context.Context) (*resourceapi.ResourceSliceList, error) {
	return a.opts.KubeClient.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
		FieldSelector: fields.Set{
			resourceapi.ResourceSliceSelectorNodeName: a.opts.NodeName,
			resourceapi.ResourceSliceSelectorDriver:   a.opts.DriverName,
		}.AsSelector().String(),
	})
}

// publishedInventory reads the devices of the agent's pool that are in
// the API (see publishedDevices) as an inventory; ok is false where the
// slices cannot be listed.
func (a *Agent) publishedInventory(ctx context.Context) (inv *discovery.Inventory, ok bool) {
	devices, err := a.publishedDevices(ctx)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Cannot read the published devices, publishing nothing until they can be read or discovery works")
		return &discovery.Inventory{}, false
	}
	return discovery.InventoryFromDevices(devices), true
}

// publishedDevices reads the devices of the agent's pool that are in the
// API: those of the newest generation of its slices on this node.
func (a *Agent) publishedDevices(ctx context.Context) ([]resourceapi.Device, error) {
	list, err := a.listOwnSlices(ctx)
	if err != nil {
		return nil, err
	}
	var generation int64
	var devices []resourceapi.Device
	for _, s := range list.Items {
		if ptr.Deref(s.Spec.NodeName, "") != a.opts.NodeName || s.Spec.Driver != a.opts.DriverName || s.Spec.Pool.Name != a.opts.PoolName {
			continue
		}
		switch {
		case s.Spec.Pool.Generation > generation:
			generation, devices = s.Spec.Pool.Generation, slices.Clone(s.Spec.Devices)
		case s.Spec.Pool.Generation == generation:
			devices = append(devices, s.Spec.Devices...)
		}
	}
	return devices, nil
}

// adoptPublished reads the published devices again while holdPublishing.
func (a *Agent) adoptPublished(ctx context.Context) {
	a.mutex.Lock()
	hold := a.holdPublishing
	a.mutex.Unlock()
	if !hold {
		return
	}
	inv, ok := a.publishedInventory(ctx)
	if !ok {
		return
	}
	a.mutex.Lock()
	if a.holdPublishing && a.nvmlUnusable != nil {
		a.inventory, a.holdPublishing = inv, false
	}
	a.mutex.Unlock()
	logDiscovery(klog.FromContext(ctx), inv)
}

// driverChanged handles discovery.ErrDriverChanged from discovery or
// health watching: it records a ReasonNVMLReload warning on the Node and
// stops the agent (Err wraps the error). A process that has used the
// real libnvidia-ml keeps it mapped (go-nvml binds its symbols globally),
// so only a new process loads a new driver's library: the container is
// restarted, the published devices stay meanwhile and the checkpoint
// keeps the prepared claims.
func (a *Agent) driverChanged(ctx context.Context, err error) {
	if a.ctx.Err() != nil {
		return
	}
	// err says why: the kernel driver changed (ErrDriverChanged's text),
	// or another driver root holds the library to load now.
	klog.FromContext(ctx).Info("NVML must be loaded again, stopping so that a restart loads it", "err", err.Error())
	a.nodeEvent(v1.EventTypeWarning, ReasonNVMLReload, "Discover", "%s: %v; restarting the agent to load NVML again and republish the GPUs", a.opts.DriverName, err)
	a.cancel(fmt.Errorf("restart to load NVML again: %w", err))
}

// nodeRef is how events refer to the Node: the UID is the node name, as
// the kubelet's own node events and kubectl describe node have it.
func (a *Agent) nodeRef() *v1.ObjectReference {
	return &v1.ObjectReference{Kind: "Node", Name: a.opts.NodeName, UID: types.UID(a.opts.NodeName)}
}

// nodeEvent records an event on the Node (see event).
func (a *Agent) nodeEvent(eventtype, reason, action, note string, args ...any) {
	a.event(a.nodeRef(), nil, eventtype, reason, action, note, args...)
}

// nodeCauseEvent records an event on the Node whose note says a cause that
// can change while the reason stays (a driver install: the library
// missing, then the driver not loaded). Its action is qualified by a hash
// of the note ("Discover-1f2e3d4c"), so that the event broadcaster, which
// folds an event into one with the same reason, action and objects sent
// in the last minutes and keeps that one's note, records each cause with
// its own note; the same cause sent again still folds.
func (a *Agent) nodeCauseEvent(eventtype, reason, action, note string, args ...any) {
	text := eventnote.Format(note, args...)
	h := fnv.New32a()
	h.Write([]byte(text))
	a.event(a.nodeRef(), nil, eventtype, reason, fmt.Sprintf("%s-%08x", action, h.Sum32()), "%s", text)
}

// The event broadcaster (client-go tools/events) counts an event with the
// same type, reason, action, regarding and related object as one that it
// sent in the last minutes as a repetition of that one: the API server
// gets a higher count and keeps the first event's note. Events about
// different devices or claims therefore differ in one of these objects,
// or the later ones would be lost.

// devicesNodeEvent records an event on the Node about some of its devices:
// the regarding reference's FieldPath names them ("devices{gpu-0,gpu-3}").
// kubectl describe node finds events by the Node's kind, name and UID, so
// it lists these too.
func (a *Agent) devicesNodeEvent(devices []string, eventtype, reason, action, note string, args ...any) {
	a.event(devicesRef(a.nodeRef(), devices), nil, eventtype, reason, action, note, args...)
}

// claimNodeEvent records an event on the Node about a claim: the claim is
// the event's related object.
func (a *Agent) claimNodeEvent(namespace, name string, uid types.UID, eventtype, reason, action, note string, args ...any) {
	a.event(a.nodeRef(), claimRef(namespace, name, uid), eventtype, reason, action, note, args...)
}

// devicesRef returns ref with a FieldPath that names devices.
func devicesRef(ref *v1.ObjectReference, devices []string) *v1.ObjectReference {
	if len(devices) > 0 {
		ref.FieldPath = "devices{" + strings.Join(devices, ",") + "}"
	}
	return ref
}

// claimRef refers to a ResourceClaim.
func claimRef(namespace, name string, uid types.UID) *v1.ObjectReference {
	return &v1.ObjectReference{
		APIVersion: resourceapi.SchemeGroupVersion.String(),
		Kind:       "ResourceClaim",
		Namespace:  namespace,
		Name:       name,
		UID:        uid,
	}
}

// event records an event on regarding (and related, which may be nil) if
// there is a recorder, its note cut to eventnote.Limit: the API server
// refuses a longer one, and the event would be lost (a claim's devices,
// listed twice, get there on a node with a long name).
func (a *Agent) event(regarding, related runtime.Object, eventtype, reason, action, note string, args ...any) {
	if a.opts.Recorder == nil {
		return
	}
	a.opts.Recorder.Eventf(regarding, related, eventtype, reason, action, "%s", eventnote.Format(note, args...))
}

// checkCDIHook reports at start, in the log and as a Warning event on the
// Node, that the CDI generator's hook is missing: every Prepare fails
// until it is there (the generator checks again each time).
func (a *Agent) checkCDIHook(ctx context.Context) {
	checker, ok := a.opts.CDIGenerator.(cdi.HookChecker)
	if !ok {
		return
	}
	if err := checker.CheckHook(); err != nil {
		klog.FromContext(ctx).Error(err, "Prepare of GPU claims fails until this is fixed")
		a.nodeEvent(v1.EventTypeWarning, ReasonCDIHookMissing, "Prepare", "%s cannot prepare GPUs for containers: %v", a.opts.DriverName, err)
	}
}

func sameUUIDs(a, b *discovery.Inventory) bool {
	if len(a.GPUs) != len(b.GPUs) {
		return false
	}
	for i := range a.GPUs {
		if a.GPUs[i].UUID != b.GPUs[i].UUID || a.GPUs[i].Name != b.GPUs[i].Name {
			return false
		}
	}
	return true
}

// rescanLoop rediscovers every RescanInterval; while no GPU is found or
// NVML is unusable it retries sooner, after NoGPURetry, doubling up to
// RescanInterval, so that a driver that appears (or works) after the agent
// started is picked up quickly.
func (a *Agent) rescanLoop(ctx context.Context) {
	retry := a.opts.NoGPURetry
	for {
		delay := a.opts.RescanInterval
		if a.NoGPU() != nil || a.NVMLUnusable() != nil {
			delay = retry
			retry = min(2*retry, max(a.opts.RescanInterval, a.opts.NoGPURetry))
		} else {
			retry = a.opts.NoGPURetry
			if delay < 0 {
				// Rescanning disabled: nothing to do until GPUs are
				// lost, which only a rescan would notice.
				<-ctx.Done()
				return
			}
		}
		timer := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C:
			if err := a.Rescan(ctx); err != nil {
				utilruntime.HandleErrorWithContext(ctx, err, "rescan failed, keeping the last published devices")
			}
		}
	}
}

// recordDiscovery remembers whether discovery found GPUs (err wraps
// discovery.ErrNoGPU when it did not, err is another error when NVML is
// unusable) and reports a change in the log and as an event on the Node;
// a Warning that still holds is reported again once it is EventRepeat
// old.
func (a *Agent) recordDiscovery(ctx context.Context, inv *discovery.Inventory, err error) {
	logger := klog.FromContext(ctx)
	var noGPU, unusable error
	switch {
	case errors.Is(err, discovery.ErrNoGPU):
		noGPU = err
	case err != nil:
		unusable = err
	}
	a.mutex.Lock()
	first := !a.discovered
	prev, prevUnusable := a.noGPU, a.nvmlUnusable
	a.noGPU, a.nvmlUnusable, a.discovered = noGPU, unusable, true
	held, devices := a.holdPublishing, len(a.inventory.GPUs)
	warnNoGPU := noGPU != nil && a.warnDueLocked(warning{reason: ReasonNoGPU}, first || prev == nil || prev.Error() != noGPU.Error())
	warnUnusable := unusable != nil && a.warnDueLocked(warning{reason: ReasonNVMLUnusable}, prevUnusable == nil || prevUnusable.Error() != unusable.Error())
	if noGPU == nil {
		delete(a.warned, warning{reason: ReasonNoGPU})
	}
	if unusable == nil {
		delete(a.warned, warning{reason: ReasonNVMLUnusable})
	}
	a.mutex.Unlock()

	switch {
	case warnNoGPU:
		logger.Info("No GPUs found, publishing an empty pool and retrying", "reason", noGPU.Error())
		a.nodeCauseEvent(v1.EventTypeWarning, ReasonNoGPU, "Discover", "%s found no GPU, retrying: %v", a.opts.DriverName, noGPU)
	case warnUnusable:
		published := fmt.Sprintf("the %d published GPUs stay, tainted %s (NoSchedule)", devices, NVMLUnusableTaintKey)
		switch {
		case held:
			published = "the published GPUs cannot be read from the API and are left as they are"
		case devices == 0:
			published = "no GPU was published"
		}
		logger.Error(unusable, "cannot use NVML, retrying; GPUs cannot be prepared for new claims, prepared claims can be unprepared", "publishedGPUs", devices, "published", !held)
		a.nodeCauseEvent(v1.EventTypeWarning, ReasonNVMLUnusable, "Discover",
			"%s cannot use NVML, retrying: %v; GPUs cannot be prepared for new claims until it can (after a driver upgrade: reboot the node), prepared claims can be unprepared; %s",
			a.opts.DriverName, unusable, published)
	case noGPU == nil && unusable == nil && (prev != nil || prevUnusable != nil):
		logger.Info("GPUs found", "devices", len(inv.GPUs))
		a.nodeEvent(v1.EventTypeNormal, ReasonGPUsFound, "Discover", "%s found %d GPUs", a.opts.DriverName, len(inv.GPUs))
	}
	if err == nil && inv != nil {
		a.recordSkipped(ctx, inv)
		a.recordConditions(ctx, inv)
	}
}

// swap sets *field, a field of the agent that a.mutex guards, to now and
// returns what it was.
func (a *Agent) swap(field *string, now string) (prev string) {
	a.mutex.Lock()
	defer a.mutex.Unlock()
	prev, *field = *field, now
	return prev
}

// recordSkipped reports the GPUs that a successful discovery found and
// does not publish, when they differ from those of the discovery before:
// a ReasonGPUNotPublished Warning on the Node naming them, or a
// ReasonAllGPUsPublished Normal event once there are none. The log names
// them at every discovery (logDiscovery).
func (a *Agent) recordSkipped(ctx context.Context, inv *discovery.Inventory) {
	key := skippedKey(inv.Skipped)
	if a.swap(&a.skipped, key) == key {
		return
	}
	if len(inv.Skipped) == 0 {
		klog.FromContext(ctx).Info("Every GPU that NVML finds is published", "devices", len(inv.GPUs))
		a.nodeEvent(v1.EventTypeNormal, ReasonAllGPUsPublished, "Discover", "%s publishes every GPU that NVML finds (%d)", a.opts.DriverName, len(inv.GPUs))
		return
	}
	ids := make([]string, 0, len(inv.Skipped))
	descs := make([]string, 0, len(inv.Skipped))
	for _, s := range inv.Skipped {
		id := s.PCIBusID
		if id == "" {
			id = fmt.Sprintf("index-%d", s.Index)
		}
		ids = append(ids, id)
		descs = append(descs, fmt.Sprintf("NVML index %d (PCI bus id %s, UUID %s): %s", s.Index, orUnknown(s.PCIBusID), orUnknown(s.UUID), s.Reason))
	}
	a.devicesNodeEvent(ids, v1.EventTypeWarning, ReasonGPUNotPublished, "Discover",
		"%s does not publish %d of the GPUs that NVML finds, no pod can get them: %s; check them with nvidia-smi -q -i <index> (a GPU that fell off the bus needs a reset or a reboot); a GPU that NVML can read again is published at the next rescan",
		a.opts.DriverName, len(inv.Skipped), strings.Join(descs, "; "))
}

// skippedKey identifies a set of skipped GPUs, with their reasons.
func skippedKey(skipped []discovery.Skipped) string {
	keys := make([]string, 0, len(skipped))
	for _, s := range skipped {
		keys = append(keys, fmt.Sprintf("%d/%s/%s/%s", s.Index, s.PCIBusID, s.UUID, s.Reason))
	}
	slices.Sort(keys)
	return strings.Join(keys, "\n")
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

// NVMLUnusable returns why the agent cannot discover its devices (an error
// wrapping discovery.ErrNVMLUnusable where NVML cannot be initialized) while
// it runs on the devices it published before (see New), nil once
// discovery works.
func (a *Agent) NVMLUnusable() error {
	a.mutex.Lock()
	defer a.mutex.Unlock()
	return a.nvmlUnusable
}

// NoGPU returns why the last discovery found no GPU (an error wrapping
// discovery.ErrNoGPU), nil if it found GPUs.
func (a *Agent) NoGPU() error {
	a.mutex.Lock()
	defer a.mutex.Unlock()
	return a.noGPU
}

// Ready returns nil when the agent serves: it is live and, unless it is
// publish-only, the kubelet has registered the plugin (an agent whose
// registration directory is not the kubelet's is never ready; see also
// ReasonNotRegistered). A node without GPUs (no driver yet, none
// installed) is ready, with an empty pool, a TopodraNoGPU event on the
// Node and NoGPU saying why: a DaemonSet's rolling update counts a pod
// that is not ready as unavailable, so one such node would hold up the
// update of every other node.
//
// Until the agent has started Ready fails, except with RollingUpdateUID,
// where the kubelet's registration of its sockets is enough: the rollout
// stops the agent that this one replaces (and that holds the lock on
// StateDir) only once this one is ready. Those sockets start once the
// takeover check passes; until then Ready says why it does not.
//
// Publishing does not affect readiness: where the API server refuses or
// does not take the agent's slice writes, the cause is mostly the
// cluster's (the API server, RBAC, an admission policy), so every agent
// would be unready at once. MetricSlicesSynced, MetricPublishErrors and
// the ReasonPublishFailed events on the Node say so instead.
func (a *Agent) Ready() error {
	if err := a.Err(); err != nil {
		return err
	}
	if !a.helperStarted() {
		return a.startingErr()
	}
	return a.registrationErr()
}

// helperStarted says whether a.helper may be read (it is set, or nil
// for PublishOnly): with RollingUpdateUID once the takeover check has
// passed and the sockets have started, otherwise once the agent has
// started.
func (a *Agent) helperStarted() bool {
	select {
	case <-a.helperUp:
		return true
	default:
		return a.hasStarted()
	}
}

// Live returns nil while the agent runs and, unless it is publish-only,
// the kubelet has not refused its registration (a refused plugin restarts
// to register again). It is the agent's liveness. While the agent starts
// it is live, waiting for another agent as long as that takes, but not
// where another step (discovery: NVML can hang) has taken longer than
// five minutes.
func (a *Agent) Live() error {
	if err := a.Err(); err != nil {
		return err
	}
	if err := a.startHung(); err != nil {
		return err
	}
	if err := a.socketsGone(); err != nil {
		return err
	}
	return a.registrationRefused()
}

// HandleError implements kubeletplugin.DRAPlugin: recoverable errors are
// logged, fatal ones stop the agent (Done is closed, Err says why). A
// resourceslice.DroppedFieldsError is also reported on the Node (see
// checkDroppedFields).
func (a *Agent) HandleError(ctx context.Context, err error, msg string) {
	utilruntime.HandleErrorWithContext(ctx, err, msg)
	a.checkDroppedFields(ctx, err)
	if !errors.Is(err, kubeletplugin.ErrRecoverable) {
		a.cancel(fmt.Errorf("fatal error: %s: %w", msg, err))
	}
}

// checkDroppedFields reports a resourceslice.DroppedFieldsError (the API
// server stored a published slice without some of its fields, because a
// feature gate is off) as a ReasonSliceFieldsDropped Warning on the Node,
// once per distinct error message. Without DRADeviceTaints the device
// taints are gone: the owned taint that keeps the default scheduler away,
// the health taints of faulty GPUs and the device plugin taint.
//
// Readiness is not affected: the feature gates are the cluster's, so every
// agent would be unready at once, which stalls the DaemonSet's rolling
// updates (fixes included) and changes nothing else (no traffic goes to the
// agents); the agent keeps publishing and preparing.
func (a *Agent) checkDroppedFields(_ context.Context, err error) {
	var dropped *resourceslice.DroppedFieldsError
	if !errors.As(err, &dropped) {
		return
	}
	msg := dropped.Error()
	a.mutex.Lock()
	seen := a.droppedFields[msg]
	a.droppedFields[msg] = true
	a.mutex.Unlock()
	if seen {
		return
	}
	consequence := "the published devices lack what the API server dropped"
	if slices.Contains(dropped.DisabledFeatures(), "DRADeviceTaints") {
		consequence = fmt.Sprintf("without device taints the devices lack the owned taint %s, so the default scheduler can allocate the GPUs that topodra-scheduler allocates (double-booking), and faulty GPUs lack the health taint %s", a.opts.OwnedTaintKey, HealthTaintKey)
		if !a.opts.OwnedTaint {
			consequence = fmt.Sprintf("without device taints faulty GPUs lack the health taint %s and stay allocatable", HealthTaintKey)
		}
	}
	a.nodeCauseEvent(v1.EventTypeWarning, ReasonSliceFieldsDropped, "Publish", "the API server dropped fields of the ResourceSlice that %s published (%v): %s; enable the feature gate(s) on the kube-apiserver (and kube-scheduler)",
		a.opts.DriverName, dropped, consequence)
}
