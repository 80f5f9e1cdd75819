package allocator

import (
	"sync"
	"sync/atomic"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/structured"

	"github.com/topodra/topodra/pkg/topology"
)

// selectorMemo remembers CEL selector results per device across scheduling
// cycles. ResourceSlices rarely change while pods come and go, so after the
// first cycle counting matching devices costs map lookups, not CEL runs.
//
// Entries are keyed by slice UID and metadata.generation (the API server
// bumps the generation whenever the spec changes), then by expression, then
// by device index. Slices without a UID (objects built in memory) are not
// memoised. The memo is dropped as a whole when it grows past
// maxMemoSlices, which bounds memory without bookkeeping in the hot path.
type selectorMemo struct {
	slices sync.Map // sliceMemoKey -> *sliceMemo
	size   atomic.Int64
}

const maxMemoSlices = 200000

type sliceMemoKey struct {
	uid        types.UID
	generation int64
	// listTypes separates results of the two CEL environments.
	listTypes bool
}

// Per-device memo states.
const (
	memoUnknown uint8 = iota
	memoTrue
	memoFalse
	memoError
)

type sliceMemo struct {
	mu     sync.RWMutex
	byExpr map[string][]uint8
	// info holds the slice's device IDs, names and coordinates.
	info atomic.Pointer[sliceInfo]
	// permuted is the slice's last reordered copy (ordered view).
	permuted atomic.Pointer[permutedSlice]
}

// sliceInfo is per-device data of one slice that stays valid for as long as
// the slice does not change.
type sliceInfo struct {
	// attrsKey names the attributes that coords were computed for.
	attrsKey string
	ids      []structured.DeviceID
	names    []string // "driver/pool/device"
	coords   []topology.Coordinates
	// dup is true if device names repeat within the slice.
	dup bool
	// dom[j*levels+l] numbers device j's value of attribute l among
	// domVals[l] (-1: absent), for counting without string compares.
	dom     []int32
	domVals [][]string
}

var globalMemo selectorMemo

// forSlice returns the memo of one slice, or nil if the slice cannot be memoised.
func (m *selectorMemo) forSlice(uid types.UID, generation int64, listTypes bool) *sliceMemo {
	if uid == "" {
		return nil
	}
	key := sliceMemoKey{uid: uid, generation: generation, listTypes: listTypes}
	if sm, ok := m.slices.Load(key); ok {
		return sm.(*sliceMemo)
	}
	if m.size.Load() > maxMemoSlices {
		m.slices.Clear()
		m.size.Store(0)
	}
	sm, loaded := m.slices.LoadOrStore(key, &sliceMemo{byExpr: map[string][]uint8{}})
	if !loaded {
		m.size.Add(1)
	}
	return sm.(*sliceMemo)
}

func (sm *sliceMemo) get(expr string, deviceIndex int) uint8 {
	sm.mu.RLock()
	defer sm.mu.RUnlock()
	states := sm.byExpr[expr]
	if deviceIndex < len(states) {
		return states[deviceIndex]
	}
	return memoUnknown
}

func (sm *sliceMemo) set(expr string, deviceIndex, numDevices int, state uint8) {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	states := sm.byExpr[expr]
	if states == nil {
		states = make([]uint8, numDevices)
		sm.byExpr[expr] = states
	}
	if deviceIndex < len(states) {
		states[deviceIndex] = state
	}
}
