package measure

import (
	"cmp"
	"maps"
	"slices"
)

// Level is a kind of topology domain by which placements are judged.
type Level int

const (
	// LevelNVLink groups the GPUs joined by NVLink (one clique).
	LevelNVLink Level = iota
	// LevelPCIeRoot groups the devices under one PCIe root complex.
	LevelPCIeRoot
	// LevelNUMA groups the devices of one NUMA node.
	LevelNUMA
	// LevelNode groups the devices of one node.
	LevelNode
)

func (l Level) String() string {
	switch l {
	case LevelNVLink:
		return "nvlink"
	case LevelPCIeRoot:
		return "pcieRoot"
	case LevelNUMA:
		return "numa"
	case LevelNode:
		return "node"
	}
	return "unknown"
}

// Device is a device as the judge sees it: where it is, what it is and to
// which domains it belongs. An empty domain value means the device is in no
// domain of that level.
type Device struct {
	// Key identifies the device in an Inventory (say driver/pool/name).
	Key  string
	Name string
	Node string
	// NIC is true for a network device, false for a GPU.
	NIC      bool
	NVLink   string
	PCIeRoot string
	NUMA     string
}

// Domain returns the device's domain value at level.
func (d *Device) Domain(level Level) string {
	switch level {
	case LevelNVLink:
		return d.NVLink
	case LevelPCIeRoot:
		return d.PCIeRoot
	case LevelNUMA:
		return d.NUMA
	case LevelNode:
		return d.Node
	}
	return ""
}

// Count is a number of GPUs and NICs.
type Count struct{ GPUs, NICs int }

// Covers reports whether c has room for want.
func (c Count) Covers(want Count) bool {
	return c.GPUs >= want.GPUs && c.NICs >= want.NICs
}

func (c *Count) add(d *Device) {
	if d.NIC {
		c.NICs++
	} else {
		c.GPUs++
	}
}

// DomainID names one domain: a value of a level on a node.
type DomainID struct{ Node, Value string }

// Inventory is the cluster's devices, who uses each of them and which are
// unhealthy. An unhealthy device is never free, whoever uses it. It is not
// safe for concurrent use; trackers guard it with their own lock.
type Inventory struct {
	devices   map[string]*Device
	nodes     map[string][]*Device // in the order added
	owner     map[string]string    // device key -> owner
	unhealthy map[string]bool
}

// NewInventory returns an empty inventory.
func NewInventory() *Inventory {
	return &Inventory{devices: map[string]*Device{}, nodes: map[string][]*Device{}, owner: map[string]string{}, unhealthy: map[string]bool{}}
}

// SetUnhealthy records whether a device is unhealthy (tainted, so that no
// new allocation may take it).
func (inv *Inventory) SetUnhealthy(key string, unhealthy bool) {
	if unhealthy {
		inv.unhealthy[key] = true
	} else {
		delete(inv.unhealthy, key)
	}
}

// Unhealthy reports whether a device is unhealthy.
func (inv *Inventory) Unhealthy(key string) bool {
	return inv.unhealthy[key]
}

// Available reports whether a device could be allocated now: healthy and
// used by nobody.
func (inv *Inventory) Available(key string) bool {
	_, used := inv.owner[key]
	return !used && !inv.unhealthy[key]
}

// free reports whether d counts as free in scope.
func (inv *Inventory) free(d *Device, scope Scope) bool {
	if inv.unhealthy[d.Key] {
		return false
	}
	owner, used := inv.owner[d.Key]
	return !used || (scope.Owner != "" && owner == scope.Owner)
}

// Add adds a device. Adding a key that is there already does nothing.
func (inv *Inventory) Add(d Device) {
	if _, ok := inv.devices[d.Key]; ok {
		return
	}
	inv.devices[d.Key] = &d
	inv.nodes[d.Node] = append(inv.nodes[d.Node], &d)
}

// Device returns the device with key.
func (inv *Inventory) Device(key string) (Device, bool) {
	d, ok := inv.devices[key]
	if !ok {
		return Device{}, false
	}
	return *d, true
}

// NodeDevices returns the devices of a node in the order they were added.
func (inv *Inventory) NodeDevices(node string) []Device {
	var out []Device
	for _, d := range inv.nodes[node] {
		out = append(out, *d)
	}
	return out
}

// Use records that owner uses the device. If another owner used it, that
// one is returned with true (a double allocation); owner takes it anyway.
func (inv *Inventory) Use(key, owner string) (previous string, conflict bool) {
	previous, used := inv.owner[key]
	inv.owner[key] = owner
	return previous, used && previous != owner
}

// Release records that the device is free.
func (inv *Inventory) Release(key string) {
	delete(inv.owner, key)
}

// Owner returns who uses the device, if anyone does.
func (inv *Inventory) Owner(key string) (string, bool) {
	o, ok := inv.owner[key]
	return o, ok
}

// Owners returns a copy of the device key -> owner map of used devices.
func (inv *Inventory) Owners() map[string]string {
	return maps.Clone(inv.owner)
}

// Count counts the GPUs and NICs among keys; unknown keys are not counted.
func (inv *Inventory) Count(keys []string) Count {
	var c Count
	for _, key := range keys {
		if d, ok := inv.devices[key]; ok {
			c.add(d)
		}
	}
	return c
}

// Scope says where an allocation could have gone and what was free for it.
type Scope struct {
	// Node reports whether a node was a candidate; nil means every node.
	Node func(node string) bool
	// Owner's devices count as free: a pod judged as a whole is judged as
	// of its first claim. "" counts every used device as used.
	Owner string
}

// Free counts the free devices per domain of level on the scope's nodes.
func (inv *Inventory) Free(level Level, scope Scope) map[DomainID]Count {
	out := map[DomainID]Count{}
	for node, devs := range inv.nodes {
		if scope.Node != nil && !scope.Node(node) {
			continue
		}
		for _, d := range devs {
			if !inv.free(d, scope) {
				continue
			}
			if v := d.Domain(level); v != "" {
				id := DomainID{Node: node, Value: v}
				c := out[id]
				c.add(d)
				out[id] = c
			}
		}
	}
	return out
}

// FreeNames lists the names of the free devices of one domain, in the
// order they were added.
func (inv *Inventory) FreeNames(level Level, id DomainID, scope Scope) []string {
	var out []string
	for _, d := range inv.nodes[id.Node] {
		if !inv.free(d, scope) {
			continue
		}
		if d.Domain(level) == id.Value {
			out = append(out, d.Name)
		}
	}
	return out
}

// Fits reports whether some domain of level, empty, could hold want with
// its healthy devices.
func (inv *Inventory) Fits(level Level, want Count) bool {
	capacity := map[DomainID]Count{}
	for node, devs := range inv.nodes {
		for _, d := range devs {
			if inv.unhealthy[d.Key] {
				continue
			}
			if v := d.Domain(level); v != "" {
				id := DomainID{Node: node, Value: v}
				c := capacity[id]
				c.add(d)
				capacity[id] = c
			}
		}
	}
	for _, c := range capacity {
		if c.Covers(want) {
			return true
		}
	}
	return false
}

// Verdict is the judgement of one allocation at one level.
type Verdict struct {
	// Aligned: all the allocation's devices are on one node and share a
	// (non-empty) domain of the level.
	Aligned bool
	// Possible: a domain of the level on a node of the scope had as many
	// GPUs and NICs free as the allocation took.
	Possible bool
	// Option is such a domain when Possible: the first by node, then
	// value, so that reports are reproducible.
	Option DomainID
}

// Judge judges an allocation (device keys) at level against the devices
// free in scope. Call it before the allocation's devices are marked used,
// or with their owner in scope.
func (inv *Inventory) Judge(keys []string, level Level, scope Scope) Verdict {
	var v Verdict
	v.Aligned = inv.aligned(keys, level)
	want := inv.Count(keys)
	free := inv.Free(level, scope)
	ids := slices.SortedFunc(maps.Keys(free), func(a, b DomainID) int {
		return cmp.Or(cmp.Compare(a.Node, b.Node), cmp.Compare(a.Value, b.Value))
	})
	for _, id := range ids {
		if free[id].Covers(want) {
			v.Possible, v.Option = true, id
			break
		}
	}
	return v
}

func (inv *Inventory) aligned(keys []string, level Level) bool {
	var first *Device
	for _, key := range keys {
		d, ok := inv.devices[key]
		if !ok {
			return false
		}
		if first == nil {
			if d.Domain(level) == "" {
				return false
			}
			first = d
			continue
		}
		if d.Node != first.Node || d.Domain(level) != first.Domain(level) {
			return false
		}
	}
	return first != nil
}
