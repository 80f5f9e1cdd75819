// Package cdi writes the Container Device Interface specs through which the
// container runtime gives a container the GPUs of a prepared claim.
//
// There is one spec file per ResourceClaim, named after the claim UID, so
// that a spec is never reused for another claim (the runtime may cache
// specs). The spec has one CDI device per allocated GPU, each setting
// TOPODRA_GPU_<n> to its UUID ([DeviceEnv]), and spec-wide edits that every
// container using any of the claim's GPUs needs.
//
// What goes into the edits comes from a [Generator]:
//   - [NVCDI] (real GPUs) asks NVIDIA's nvcdi library, on the driver root:
//     the GPU's device nodes, the control device nodes that exist, the
//     driver libraries, nvidia-smi and the other driver binaries, firmware
//     and the nvidia-cdi-hook hooks (ldcache, symlinks), with paths as the
//     container runtime on the node sees them, and
//     NVIDIA_VISIBLE_DEVICES=void, which keeps the NVIDIA Container Runtime
//     from injecting GPUs a second time. It fails where the GPU's device
//     node or /dev/nvidiactl is missing, and, where it can look, where the
//     nvidia-cdi-hook that the hooks run is missing on the node
//     ([HookChecker]); [Hooks] lists the hooks and the NVIDIA Container
//     Toolkit release each needs.
//   - [Static] (mock machines, simulators) lists device nodes by minor
//     number, only those that exist, or none at all with EnvOnly. It sets
//     no NVIDIA_VISIBLE_DEVICES, so the spec sets it to the UUIDs of all
//     the claim's GPUs.
package cdi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"k8s.io/apimachinery/pkg/types"

	"github.com/topodra/topodra/pkg/agent/driverroot"
)

// Vendor and Class make up the CDI kind "gpu.topodra.io/gpu".
const (
	Vendor = "gpu.topodra.io"
	Class  = "gpu"
	Kind   = Vendor + "/" + Class
)

// DefaultDir is where container runtimes look for dynamic CDI specs.
const DefaultDir = "/var/run/cdi"

// ControlDeviceNodes are the device nodes a CUDA container needs besides
// its GPUs' /dev/nvidia<minor>, where they exist: nvidia-uvm is created
// only once the nvidia-uvm module is loaded, and a spec that names a
// missing node makes the container fail to start.
var ControlDeviceNodes = []string{driverroot.ControlDevice, "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}

// Device is one GPU to expose.
type Device struct {
	// Name is the DRA device name ("gpu-3").
	Name  string
	UUID  string
	Minor int
}

// Generator produces the container edits of a claim's spec. Implementations
// must be safe for concurrent use.
type Generator interface {
	// CommonEdits are the edits that every container using any GPU
	// needs (driver libraries, control device nodes, hooks).
	CommonEdits() (cdispec.ContainerEdits, error)
	// DeviceEdits are the edits for one whole GPU.
	DeviceEdits(d Device) (cdispec.ContainerEdits, error)
}

// Static is a [Generator] that knows device nodes only: /dev/nvidia<minor>
// per GPU and the [ControlDeviceNodes], each only if it exists below DevRoot
// (default "/"). With EnvOnly it lists no device nodes at all: for mock
// GPUs that the containers of a cluster without GPUs can still start with.
type Static struct {
	DevRoot string
	EnvOnly bool
}

var _ Generator = Static{}

func (s Static) nodes(paths ...string) []*cdispec.DeviceNode {
	if s.EnvOnly {
		return nil
	}
	root := s.DevRoot
	if root == "" {
		root = "/"
	}
	var nodes []*cdispec.DeviceNode
	for _, p := range paths {
		if info, err := os.Stat(filepath.Join(root, p)); err == nil && info.Mode()&os.ModeCharDevice != 0 {
			nodes = append(nodes, &cdispec.DeviceNode{Path: p})
		}
	}
	return nodes
}

// CommonEdits implements [Generator].
func (s Static) CommonEdits() (cdispec.ContainerEdits, error) {
	return cdispec.ContainerEdits{DeviceNodes: s.nodes(ControlDeviceNodes...)}, nil
}

// DeviceEdits implements [Generator].
func (s Static) DeviceEdits(d Device) (cdispec.ContainerEdits, error) {
	return cdispec.ContainerEdits{DeviceNodes: s.nodes(fmt.Sprintf("/dev/nvidia%d", d.Minor))}, nil
}

// Writer writes and removes claim specs in one directory. It keeps no
// CDI cache of the directory: it validates each spec it writes as the CDI
// library validates a spec file that a container runtime loads, and the
// runtimes' caches read the files.
type Writer struct {
	dir       string
	generator Generator
	// write writes data to the temporary file of a spec: writeAll.
	write func(f *os.File, data []byte) error
}

// Option configures [New].
type Option func(*Writer)

// WithGenerator sets the generator; the default is Static{}.
func WithGenerator(g Generator) Option {
	return func(w *Writer) { w.generator = g }
}

// New returns a writer for dir (created on first write).
func New(dir string, opts ...Option) (*Writer, error) {
	w := &Writer{dir: dir, generator: Static{}, write: writeAll}
	for _, opt := range opts {
		opt(w)
	}
	if w.generator == nil {
		return nil, errors.New("CDI generator must not be nil")
	}
	return w, nil
}

// writeAll writes data to f.
func writeAll(f *os.File, data []byte) error {
	_, err := f.Write(data)
	return err
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

// specPrefix starts the file names that specName gives.
var specPrefix = cdiapi.GenerateSpecName(Vendor, Class) + "_"

// Temporary files, in which the writer writes a claim's spec before it
// renames the file to the spec's name, are named tempPrefix, the claim
// UID, ".json.", a random part and tempSuffix: hidden, and without the
// .json or .yaml extension that container runtimes read, so that no
// runtime takes one for a spec, and distinct from the "spec.*.tmp" of
// other writers of the directory (the CDI library, nvidia-ctk), so that
// [Writer.RemoveTempFiles] removes only this driver's.
const tempSuffix = ".tmp"

var tempPrefix = "." + specPrefix

func tempPattern(claimUID types.UID) string {
	return "." + specName(claimUID) + ".*" + tempSuffix
}

// SpecPath is the file that holds the spec of a claim.
func (w *Writer) SpecPath(claimUID types.UID) string {
	return filepath.Join(w.dir, specName(claimUID))
}

// DeviceEnv is the environment variable that a container gets for each of
// its GPUs, set to the GPU's UUID: TOPODRA_GPU_3 for device gpu-3.
func DeviceEnv(device string) string {
	return "TOPODRA_" + strings.ToUpper(strings.NewReplacer("-", "_", ".", "_").Replace(device))
}

// VisibleDevicesEnv is the variable through which the NVIDIA Container
// Runtime is told which GPUs to inject.
const VisibleDevicesEnv = "NVIDIA_VISIBLE_DEVICES"

// Spec builds the spec of a claim with g without writing it. Where g's
// common edits do not set [VisibleDevicesEnv], the spec sets it to the
// UUIDs of the claim's GPUs.
func Spec(g Generator, claimUID types.UID, devices []Device) (*cdispec.Spec, error) {
	uuids := make([]string, 0, len(devices))
	names := make([]string, 0, len(devices))
	for _, d := range devices {
		uuids = append(uuids, d.UUID)
		names = append(names, fmt.Sprintf("%s (%s)", d.Name, d.UUID))
	}
	common, err := g.CommonEdits()
	if err != nil {
		return nil, fmt.Errorf("generate common CDI edits for %s: %w", strings.Join(names, ", "), err)
	}
	spec := &cdispec.Spec{Kind: Kind, ContainerEdits: common}
	for _, d := range devices {
		edits, err := g.DeviceEdits(d)
		if err != nil {
			return nil, fmt.Errorf("generate CDI edits for %s (%s): %w", d.Name, d.UUID, err)
		}
		// Every device sets its own variable, so that its edits are never
		// empty (CDI refuses such devices) and a container can tell
		// which GPUs it got even without device nodes (mock GPUs).
		edits.Env = append(edits.Env, DeviceEnv(d.Name)+"="+d.UUID)
		spec.Devices = append(spec.Devices, cdispec.Device{
			Name:           deviceName(claimUID, d.Name),
			ContainerEdits: edits,
		})
	}
	slices.SortFunc(spec.Devices, func(a, b cdispec.Device) int { return strings.Compare(a.Name, b.Name) })
	if !slices.ContainsFunc(spec.ContainerEdits.Env, func(e string) bool { return strings.HasPrefix(e, VisibleDevicesEnv+"=") }) {
		spec.ContainerEdits.Env = append(spec.ContainerEdits.Env, VisibleDevicesEnv+"="+strings.Join(uuids, ","))
	}
	if v, err := cdiapi.MinimumRequiredVersion(spec); err == nil {
		spec.Version = v
	} else {
		spec.Version = cdispec.CurrentVersion
	}
	return spec, nil
}

// WriteClaimSpec generates the spec of a claim, writes it (or atomically
// replaces the claim's spec) unless the file already holds the same spec,
// and returns the CDI device id of each GPU, by DRA device name. Where
// generating, validating (as a container runtime validates the file) or
// writing fails, the claim's spec file stays as it was and no temporary
// file is left behind, so a write that failed for lack of space succeeds
// once there is space again.
func (w *Writer) WriteClaimSpec(claimUID types.UID, devices []Device) (map[string]string, error) {
	spec, err := Spec(w.generator, claimUID, devices)
	if err != nil {
		return nil, fmt.Errorf("CDI spec for claim %s: %w", claimUID, err)
	}
	if !sameSpec(w.SpecPath(claimUID), spec) {
		if err := w.writeSpec(claimUID, spec); err != nil {
			return nil, fmt.Errorf("%w for claim %s: %w", ErrWriteSpec, claimUID, err)
		}
	}
	ids := make(map[string]string, len(devices))
	for _, d := range devices {
		ids[d.Name] = DeviceID(claimUID, d.Name)
	}
	return ids, nil
}

// writeSpec replaces the claim's spec file with spec, atomically and
// durably: it writes a temporary file (mode 0600) in the directory,
// syncs it, reads it back through the CDI library's validation, renames
// it to the spec's name and syncs the directory. It removes the temporary
// file on any error.
func (w *Writer) writeSpec(claimUID types.UID, spec *cdispec.Spec) error {
	data, err := json.Marshal(spec)
	if err != nil {
		return fmt.Errorf("encode: %w", err)
	}
	if err := os.MkdirAll(w.dir, 0o755); err != nil {
		return fmt.Errorf("create directory: %w", err)
	}
	tmp, err := os.CreateTemp(w.dir, tempPattern(claimUID))
	if err != nil {
		return fmt.Errorf("create temporary file: %w", err)
	}
	fail := func(what string, err error) error {
		_ = tmp.Close()
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("%s temporary file: %w", what, err)
	}
	if err := w.write(tmp, data); err != nil {
		return fail("write", err)
	}
	if err := tmp.Sync(); err != nil {
		return fail("sync", err)
	}
	if err := tmp.Close(); err != nil {
		return fail("close", err)
	}
	if _, err := cdiapi.ReadSpec(tmp.Name(), 0); err != nil {
		return fail("validate", err)
	}
	if err := os.Rename(tmp.Name(), w.SpecPath(claimUID)); err != nil {
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("replace spec: %w", err)
	}
	return syncDir(w.dir)
}

// syncDir makes the changes to dir's entries durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open directory: %w", err)
	}
	defer func() { _ = d.Close() }()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	return nil
}

// RemoveTempFiles removes the temporary files of this driver's writers
// from the writer's directory (those that a process which ended while it
// wrote a spec left behind) and returns their paths; other files,
// temporary files of other writers among them, stay. A directory that
// does not exist holds none. It must be called only while no other
// writer of this driver writes to the directory (the agent holds the lock
// on its state directory).
func (w *Writer) RemoveTempFiles() ([]string, error) {
	entries, err := os.ReadDir(w.dir)
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read CDI directory %s: %w", w.dir, err)
	}
	var removed []string
	var errs []error
	for _, e := range entries {
		name := e.Name()
		if !e.Type().IsRegular() || !strings.HasPrefix(name, tempPrefix) || !strings.HasSuffix(name, tempSuffix) {
			continue
		}
		path := filepath.Join(w.dir, name)
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove temporary CDI spec file: %w", err))
			continue
		}
		removed = append(removed, path)
	}
	return removed, errors.Join(errs...)
}

// sameSpec says whether the file at path holds spec: the same content in
// its JSON form, however it is laid out. An unreadable file does not.
func sameSpec(path string, spec *cdispec.Spec) bool {
	data, err := os.ReadFile(path)
	if err != nil {
		return false
	}
	old, err := cdiapi.ParseSpec(data)
	if err != nil || old == nil {
		return false
	}
	a, errA := json.Marshal(old)
	b, errB := json.Marshal(spec)
	return errA == nil && errB == nil && bytes.Equal(a, b)
}

// DeleteClaimSpec removes the spec of a claim. A missing spec is no error.
func (w *Writer) DeleteClaimSpec(claimUID types.UID) error {
	if err := os.Remove(w.SpecPath(claimUID)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove CDI spec for claim %s: %w", claimUID, err)
	}
	return nil
}

// ErrWriteSpec is returned (wrapped) by [Writer.WriteClaimSpec] where the
// spec was generated but could not be written to the directory (a full
// or read-only file system).
var ErrWriteSpec = errors.New("cannot write CDI spec")

// ErrUnreadableSpec is returned (wrapped) by [Writer.ListClaimSpecs] and
// [ReadClaimSpec] for a claim spec file of this driver that cannot be
// read or does not record its claim's GPUs.
var ErrUnreadableSpec = errors.New("claim CDI spec is unreadable")

// SpecFile is a claim spec file of this driver, as listed, not read.
type SpecFile struct {
	// UID is the claim's UID, from the file name.
	UID types.UID
	// Path is the spec file.
	Path string
	// ModTime is when the file was last written.
	ModTime time.Time
}

// ClaimSpec is what a claim's spec file records about the claim.
type ClaimSpec struct {
	SpecFile
	// Devices are the claim's GPUs: the DRA device name and the GPU UUID
	// of each (from its [DeviceEnv] variable) and the minor number of its
	// /dev/nvidia<minor> device node, -1 where the spec lists none.
	Devices []Device
}

// ListClaimSpecs lists the claim spec files in the writer's directory
// (the files named as [Writer.SpecPath] names them), in the order of their
// names, without reading them; other files are left out. A path that
// does not exist or is not a directory holds none. A claim spec file
// whose modification time cannot be read fails the call with
// ErrUnreadableSpec.
func (w *Writer) ListClaimSpecs() ([]SpecFile, error) {
	entries, err := os.ReadDir(w.dir)
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read CDI directory %s: %w", w.dir, err)
	}
	var out []SpecFile
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasPrefix(name, specPrefix) || !strings.HasSuffix(name, ".json") {
			continue
		}
		path := filepath.Join(w.dir, name)
		info, err := os.Stat(path)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrUnreadableSpec, path, err)
		}
		out = append(out, SpecFile{
			UID:     types.UID(strings.TrimSuffix(strings.TrimPrefix(name, specPrefix), ".json")),
			Path:    path,
			ModTime: info.ModTime(),
		})
	}
	return out, nil
}

// ReadClaimSpec reads a claim spec file that [Writer.ListClaimSpecs]
// listed. A file that cannot be read or parsed, is empty, is of another
// kind, or lacks a device's name or UUID fails it with ErrUnreadableSpec.
func ReadClaimSpec(f SpecFile) (ClaimSpec, error) {
	path, uid := f.Path, f.UID
	fail := func(format string, args ...any) (ClaimSpec, error) {
		return ClaimSpec{}, fmt.Errorf("%w: %s: %s", ErrUnreadableSpec, path, fmt.Sprintf(format, args...))
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return fail("%v", err)
	}
	spec, err := cdiapi.ParseSpec(data)
	switch {
	case err != nil:
		return fail("%v", err)
	case spec == nil:
		return fail("no spec")
	case spec.Kind != Kind:
		return fail("kind %q, want %q", spec.Kind, Kind)
	case len(spec.Devices) == 0:
		return fail("no device")
	}
	out := ClaimSpec{SpecFile: f}
	for _, d := range spec.Devices {
		name, ok := strings.CutPrefix(d.Name, string(uid)+"-")
		if !ok || name == "" {
			return fail("device %q is not named after claim %s", d.Name, uid)
		}
		dev := Device{Name: name, Minor: -1}
		for _, env := range d.ContainerEdits.Env {
			if v, ok := strings.CutPrefix(env, DeviceEnv(name)+"="); ok {
				dev.UUID = v
			}
		}
		if dev.UUID == "" {
			return fail("device %s does not set %s to its GPU's UUID", name, DeviceEnv(name))
		}
		for _, n := range d.ContainerEdits.DeviceNodes {
			var minor int
			if _, err := fmt.Sscanf(n.Path, "/dev/nvidia%d", &minor); err == nil && n.Path == fmt.Sprintf("/dev/nvidia%d", minor) {
				dev.Minor = minor
			}
		}
		out.Devices = append(out.Devices, dev)
	}
	return out, nil
}
