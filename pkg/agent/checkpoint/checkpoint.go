// Package checkpoint persists which ResourceClaims the node agent has
// prepared, so that Prepare and Unprepare stay idempotent across agent
// restarts and a device is never handed to two claims.
//
// The file is written atomically: encode to a temporary file in the same
// directory, fsync it, rename it over the checkpoint, fsync the directory.
// A crash at any point leaves either the old or the new checkpoint, never a
// mix; stray temporary files are removed by [New]. The file carries a
// version and a checksum; a file with an unknown version or a bad checksum
// is an error, not an empty checkpoint, because silently forgetting
// prepared claims could double-allocate a GPU.
package checkpoint

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"
)

// Version identifies the newest checkpoint format: v4 adds Gone to v3.
// [Store.Save] writes a checkpoint with Gone entries as v4 and one without
// as v3 (its content is then a valid v3 file): agents that read only v3
// refuse a v4 file (by its version), so an agent can be rolled back to
// one that reads only v3 except while a prepared claim is recorded as
// gone.
//
// v3 added PreviousBoot, Faults and PreparedClaim.AllocatedAt to v2.
// Agents that read only v2 refuse a v3 file, so an agent cannot be rolled
// back across v3 without removing the file (and with it the record of
// prepared claims).
const Version = "checkpoint.gpu.topodra.io/v4"

// versionV3 is the format without Gone, written for checkpoints without
// it; versionV2 the one without PreviousBoot, Faults and AllocatedAt;
// versionV1 the one without BootID. Those two are read, never written.
const (
	versionV3 = "checkpoint.gpu.topodra.io/v3"
	versionV2 = "checkpoint.gpu.topodra.io/v2"
	versionV1 = "checkpoint.gpu.topodra.io/v1"
)

// FileName is the checkpoint's name inside its directory.
const FileName = "checkpoint.json"

const tempPrefix = FileName + ".tmp-"

var (
	// ErrUnknownVersion means the file was written by an incompatible agent.
	ErrUnknownVersion = errors.New("unknown checkpoint version")
	// ErrCorrupt means the checksum does not match the content.
	ErrCorrupt = errors.New("checkpoint checksum mismatch")
)

// Checkpoint is the persisted state: prepared claims by UID, what claims
// held before the last reboot, and the GPU faults seen during this boot.
//
// The fields that v3 and v4 added are optional: older files load without
// them, and they are left out of the file while empty.
type Checkpoint struct {
	// BootID is the node's boot id (/proc/sys/kernel/random/boot_id) when
	// the claims were prepared. Prepared state does not survive a reboot
	// (device nodes, minor numbers and CDI specs may all differ), so an
	// agent that finds another boot id drops the claims. Empty in files
	// written before boot ids were recorded.
	BootID string                      `json:"bootID,omitempty"`
	Claims map[types.UID]PreparedClaim `json:"claims"`
	// PreviousBoot holds the claims that were prepared during an earlier
	// boot and have not been prepared again since: which GPU (by UUID)
	// each of their device names stood for then. The kubelet prepares
	// the claims of surviving pods again after a reboot; a device name
	// that now names another GPU must not be prepared for them.
	PreviousBoot map[types.UID]PreparedClaim `json:"previousBoot,omitempty"`
	// Faults are the GPUs found faulty during this boot, by GPU UUID. A
	// reboot resets the GPUs and clears them.
	Faults map[string]Fault `json:"faults,omitempty"`
	// Gone holds, for prepared claims (keys of Claims) that the API server
	// no longer has or has without an allocation, when an agent first
	// found them so, so that the grace period before the agent drops such
	// a claim does not start again with every agent restart. Written as
	// v4 (see Version).
	Gone map[types.UID]time.Time `json:"gone,omitempty"`
}

// PreparedClaim is one claim that Prepare handled.
type PreparedClaim struct {
	Namespace string           `json:"namespace"`
	Name      string           `json:"name"`
	Devices   []PreparedDevice `json:"devices"`
	// AllocatedAt is the claim's allocation timestamp when it was
	// prepared, if the API server recorded one: it tells a reallocation
	// of the same claim from the allocation that was prepared.
	AllocatedAt *time.Time `json:"allocatedAt,omitempty"`
}

// Fault is a GPU fault (critical XID, lost GPU) as the agent publishes it.
type Fault struct {
	// Device is the GPU's device name when the fault was seen.
	Device  string    `json:"device,omitempty"`
	Reason  string    `json:"reason"`
	Message string    `json:"message,omitempty"`
	Time    time.Time `json:"time"`
}

// PreparedDevice is one allocated device of a prepared claim.
type PreparedDevice struct {
	Requests     []string `json:"requests"`
	Pool         string   `json:"pool"`
	Device       string   `json:"device"`
	UUID         string   `json:"uuid"`
	Minor        int      `json:"minor"`
	AdminAccess  bool     `json:"adminAccess,omitempty"`
	CDIDeviceIDs []string `json:"cdiDeviceIDs"`
}

// file is the on-disk envelope.
type file struct {
	Version  string          `json:"version"`
	Checksum uint32          `json:"checksum"`
	Data     json.RawMessage `json:"data"`
}

// Store reads and writes one checkpoint file. It is safe for concurrent use.
type Store struct {
	dir   string
	mutex sync.Mutex
	// beforeRename, if set, runs after the temporary file is synced and
	// before it replaces the checkpoint. Tests use it to simulate a crash.
	beforeRename func()
}

// New creates the directory if needed and removes temporary files that a
// crash during Save left behind.
func New(dir string) (*Store, error) {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("create checkpoint directory %s: %w", dir, err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("read checkpoint directory %s: %w", dir, err)
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), tempPrefix) {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
				return nil, fmt.Errorf("remove stale temporary checkpoint: %w", err)
			}
		}
	}
	return &Store{dir: dir}, nil
}

// Path is the checkpoint file's path.
func (s *Store) Path() string { return filepath.Join(s.dir, FileName) }

// Exists says whether the checkpoint file exists.
func (s *Store) Exists() (bool, error) {
	s.mutex.Lock()
	defer s.mutex.Unlock()
	_, err := os.Stat(s.Path())
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, fs.ErrNotExist):
		return false, nil
	default:
		return false, fmt.Errorf("check checkpoint %s: %w", s.Path(), err)
	}
}

// Read returns the checkpoint in dir as Load does, without changing
// anything there (New removes what a crashed Save left): for an agent that
// checks, before it takes over, that it can read what the running agent
// writes.
func Read(dir string) (*Checkpoint, error) {
	return (&Store{dir: dir}).Load()
}

// Load returns the stored checkpoint; an empty one if there is no file yet
// (see Exists).
func (s *Store) Load() (*Checkpoint, error) {
	s.mutex.Lock()
	defer s.mutex.Unlock()
	data, err := os.ReadFile(s.Path())
	if errors.Is(err, fs.ErrNotExist) {
		return &Checkpoint{Claims: map[types.UID]PreparedClaim{}}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read checkpoint %s: %w", s.Path(), err)
	}
	var f file
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("decode checkpoint %s: %w", s.Path(), err)
	}
	if f.Version != Version && f.Version != versionV3 && f.Version != versionV2 && f.Version != versionV1 {
		return nil, fmt.Errorf("read checkpoint %s: %w %q (want %q)", s.Path(), ErrUnknownVersion, f.Version, Version)
	}
	if crc32.ChecksumIEEE(f.Data) != f.Checksum {
		return nil, fmt.Errorf("read checkpoint %s: %w", s.Path(), ErrCorrupt)
	}
	cp := &Checkpoint{}
	dec := json.NewDecoder(bytes.NewReader(f.Data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(cp); err != nil {
		return nil, fmt.Errorf("decode checkpoint %s: %w", s.Path(), err)
	}
	if cp.Claims == nil {
		cp.Claims = map[types.UID]PreparedClaim{}
	}
	return cp, nil
}

// Save replaces the checkpoint atomically, as v4 where cp has Gone
// entries and as v3 otherwise (see Version).
func (s *Store) Save(cp *Checkpoint) error {
	s.mutex.Lock()
	defer s.mutex.Unlock()
	data, err := json.Marshal(cp)
	if err != nil {
		return fmt.Errorf("encode checkpoint: %w", err)
	}
	version := Version
	if len(cp.Gone) == 0 {
		version = versionV3
	}
	// Compact on purpose: the checksum covers the exact bytes of Data.
	out, err := json.Marshal(file{Version: version, Checksum: crc32.ChecksumIEEE(data), Data: data})
	if err != nil {
		return fmt.Errorf("encode checkpoint: %w", err)
	}

	tmp, err := os.CreateTemp(s.dir, tempPrefix+"*")
	if err != nil {
		return fmt.Errorf("create temporary checkpoint: %w", err)
	}
	fail := func(what string, err error) error {
		_ = tmp.Close()
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("%s %s: %w", what, tmp.Name(), err)
	}
	if _, err := tmp.Write(out); err != nil {
		return fail("write temporary checkpoint", err)
	}
	if err := tmp.Sync(); err != nil {
		return fail("sync temporary checkpoint", err)
	}
	if err := tmp.Close(); err != nil {
		return fail("close temporary checkpoint", err)
	}
	if s.beforeRename != nil {
		s.beforeRename()
	}
	if err := os.Rename(tmp.Name(), s.Path()); err != nil {
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("replace checkpoint %s: %w", s.Path(), err)
	}
	// Make the rename durable.
	dir, err := os.Open(s.dir)
	if err != nil {
		return fmt.Errorf("open checkpoint directory: %w", err)
	}
	defer func() { _ = dir.Close() }()
	if err := dir.Sync(); err != nil {
		return fmt.Errorf("sync checkpoint directory: %w", err)
	}
	return nil
}
