package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	oci "github.com/opencontainers/runtime-spec/specs-go"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"sigs.k8s.io/yaml"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/topology"
)

// dryRunClaimUID is the UID of the claim that --show-cdi prepares.
const dryRunClaimUID types.UID = "dry-run"

// containerView is what a container gets when a runtime applies CDI
// devices to it: the edits the CDI library makes to its OCI spec.
type containerView struct {
	CDIDevices []string          `json:"cdiDevices"`
	Env        []string          `json:"env,omitempty"`
	Mounts     []oci.Mount       `json:"mounts,omitempty"`
	Devices    []oci.LinuxDevice `json:"devices,omitempty"`
	Hooks      *oci.Hooks        `json:"hooks,omitempty"`
}

// showPrepared prepares a claim for all of inv's GPUs with the agent's own
// Prepare (the call the kubelet makes), in a temporary checkpoint and CDI
// directory, and prints the CDI spec that preparing wrote and what a
// container of the claim gets when a runtime applies the returned CDI
// device ids with the CDI library, as containerd and CRI-O do
// (environment, mounts, device nodes, hooks). It then unprepares the claim
// and fails if the spec is still there. Nothing outside the temporary
// directory is written.
func showPrepared(ctx context.Context, src *source, nodeName string, inv *discovery.Inventory, out io.Writer) (err error) {
	dir, err := os.MkdirTemp("", "topodra-dry-run-")
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, os.RemoveAll(dir)) }()
	stateDir, cdiDir := filepath.Join(dir, "state"), filepath.Join(dir, "cdi")
	for _, d := range []string{stateDir, cdiDir} {
		if err := os.Mkdir(d, 0o700); err != nil {
			return err
		}
	}
	a, err := agent.NewOffline(ctx, agent.Options{NodeName: nodeName, CDIGenerator: src.cdi, StateDir: stateDir, CDIDir: cdiDir}, inv)
	if err != nil {
		return err
	}
	defer a.Stop()

	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: metav1.NamespaceDefault, Name: "gpu-check", UID: dryRunClaimUID},
		Status:     resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{}},
	}
	for _, g := range inv.GPUs {
		claim.Status.Allocation.Devices.Results = append(claim.Status.Allocation.Devices.Results, resourceapi.DeviceRequestAllocationResult{
			Request: "gpus", Driver: topology.DriverName, Pool: nodeName, Device: g.Name,
		})
	}
	results, err := a.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{claim})
	if err != nil {
		return fmt.Errorf("prepare claim: %w", err)
	}
	if err := results[claim.UID].Err; err != nil {
		return fmt.Errorf("prepare claim: %w", err)
	}
	view := containerView{}
	for _, d := range results[claim.UID].Devices {
		view.CDIDevices = append(view.CDIDevices, d.CDIDeviceIDs...)
	}

	// The runtime's side: a CDI cache on the spec directory resolves the ids.
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(cdiDir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		return fmt.Errorf("CDI cache on %s: %w", cdiDir, err)
	}
	if len(view.CDIDevices) == 0 {
		return errors.New("preparing the claim returned no CDI device")
	}
	device := cache.GetDevice(view.CDIDevices[0])
	if device == nil {
		return fmt.Errorf("CDI device %s does not resolve: %v", view.CDIDevices[0], cache.GetErrors())
	}
	specPath := device.GetSpec().GetPath()
	data, err := os.ReadFile(specPath)
	if err != nil {
		return fmt.Errorf("read the prepared claim's CDI spec: %w", err)
	}
	specYAML, err := yaml.JSONToYAML(data)
	if err != nil {
		return fmt.Errorf("CDI spec %s: %w", specPath, err)
	}
	if _, err := fmt.Fprintf(out, "---\n# CDI spec written by preparing claim %s/%s (UID %q) with all GPUs\n%s", claim.Namespace, claim.Name, claim.UID, specYAML); err != nil {
		return err
	}

	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	if _, err := cache.InjectDevices(spec, view.CDIDevices...); err != nil {
		return fmt.Errorf("apply CDI devices %v: %w", view.CDIDevices, err)
	}
	view.Env, view.Mounts, view.Devices, view.Hooks = spec.Process.Env, spec.Mounts, spec.Linux.Devices, spec.Hooks
	viewYAML, err := yaml.Marshal(view)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(out, "---\n# What a container of the claim gets: its CDI devices applied by the CDI library\n%s", viewYAML); err != nil {
		return err
	}

	unprepared, err := a.UnprepareResourceClaims(ctx, []kubeletplugin.NamespacedObject{{
		NamespacedName: types.NamespacedName{Namespace: claim.Namespace, Name: claim.Name}, UID: claim.UID,
	}})
	if err != nil {
		return fmt.Errorf("unprepare claim: %w", err)
	}
	if err := unprepared[claim.UID]; err != nil {
		return fmt.Errorf("unprepare claim: %w", err)
	}
	if _, err := os.Stat(specPath); !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("CDI spec %s still there after unprepare: %v", specPath, err)
	}
	return nil
}
