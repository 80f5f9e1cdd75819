// Package cdi writes the Container Device Interface specs through which the
// container runtime gives a container the GPUs of a prepared claim.
//
// There is one spec file per ResourceClaim, named after the claim UID, so
// that a spec is never reused for another claim (the runtime may cache
// specs). The spec has one CDI device per allocated GPU with its device node
// /dev/nvidia<minor>, plus spec-wide edits that every container using any of
// the claim's GPUs needs: /dev/nvidiactl, /dev/nvidia-uvm,
// /dev/nvidia-uvm-tools and NVIDIA_VISIBLE_DEVICES with the UUIDs of all the
// claim's GPUs.
package cdi

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"k8s.io/apimachinery/pkg/types"
)

// Vendor and Class make up the CDI kind "gpu.topodra.io/gpu".
const (
	Vendor = "gpu.topodra.io"
	Class  = "gpu"
	Kind   = Vendor + "/" + Class
)

// DefaultDir is where container runtimes look for dynamic CDI specs.
const DefaultDir = "/var/run/cdi"

// ControlDeviceNodes are the device nodes every CUDA container needs in
// addition to its GPUs' /dev/nvidia<minor>.
var ControlDeviceNodes = []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}

// Device is one GPU to expose.
type Device struct {
	// Name is the DRA device name ("gpu-3").
	Name  string
	UUID  string
	Minor int
}

// Writer writes and removes claim specs in one directory.
type Writer struct {
	dir   string
	cache *cdiapi.Cache
}

// New returns a writer for dir (created on first write).
func New(dir string) (*Writer, error) {
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		return nil, fmt.Errorf("create CDI cache for %s: %w", dir, err)
	}
	return &Writer{dir: dir, cache: cache}, nil
}

// DeviceID is the fully qualified CDI device id of one GPU of one claim.
func DeviceID(claimUID types.UID, device string) string {
	return parser.QualifiedName(Vendor, Class, deviceName(claimUID, device))
}

func deviceName(claimUID types.UID, device string) string {
	return string(claimUID) + "-" + device
}

func specName(claimUID types.UID) string {
	return cdiapi.GenerateTransientSpecName(Vendor, Class, string(claimUID)) + ".json"
}

// SpecPath is the file that holds the spec of a claim.
func (w *Writer) SpecPath(claimUID types.UID) string {
	return filepath.Join(w.dir, specName(claimUID))
}

// Spec builds the spec of a claim without writing it.
func Spec(claimUID types.UID, devices []Device) *cdispec.Spec {
	spec := &cdispec.Spec{
		Kind: Kind,
	}
	uuids := make([]string, 0, len(devices))
	for _, d := range devices {
		uuids = append(uuids, d.UUID)
		spec.Devices = append(spec.Devices, cdispec.Device{
			Name: deviceName(claimUID, d.Name),
			ContainerEdits: cdispec.ContainerEdits{
				DeviceNodes: []*cdispec.DeviceNode{{Path: fmt.Sprintf("/dev/nvidia%d", d.Minor)}},
			},
		})
	}
	slices.SortFunc(spec.Devices, func(a, b cdispec.Device) int { return strings.Compare(a.Name, b.Name) })
	for _, path := range ControlDeviceNodes {
		spec.ContainerEdits.DeviceNodes = append(spec.ContainerEdits.DeviceNodes, &cdispec.DeviceNode{Path: path})
	}
	spec.ContainerEdits.Env = []string{"NVIDIA_VISIBLE_DEVICES=" + strings.Join(uuids, ",")}
	if v, err := cdiapi.MinimumRequiredVersion(spec); err == nil {
		spec.Version = v
	} else {
		spec.Version = cdispec.CurrentVersion
	}
	return spec
}

// WriteClaimSpec writes (or atomically replaces) the spec of a claim and
// returns the CDI device id of each GPU, by DRA device name.
func (w *Writer) WriteClaimSpec(claimUID types.UID, devices []Device) (map[string]string, error) {
	spec := Spec(claimUID, devices)
	if err := w.cache.WriteSpec(spec, specName(claimUID)); err != nil {
		return nil, fmt.Errorf("write CDI spec for claim %s: %w", claimUID, err)
	}
	ids := make(map[string]string, len(devices))
	for _, d := range devices {
		ids[d.Name] = DeviceID(claimUID, d.Name)
	}
	return ids, nil
}

// DeleteClaimSpec removes the spec of a claim. A missing spec is no error.
func (w *Writer) DeleteClaimSpec(claimUID types.UID) error {
	if err := w.cache.RemoveSpec(specName(claimUID)); err != nil {
		return fmt.Errorf("remove CDI spec for claim %s: %w", claimUID, err)
	}
	return nil
}
