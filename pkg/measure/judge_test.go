package measure

import (
	"testing"
)

// twoNodes returns nodes a and b, each with GPUs g0..g3 (PCIe roots r0: g0,
// g1 and r1: g2, g3; NUMA node 0; one NVLink clique) and NICs n0 (r0) and
// n1 (r1). Keys are node/name.
func twoNodes() *Inventory {
	inv := NewInventory()
	for _, node := range []string{"a", "b"} {
		for i, root := range []string{"r0", "r0", "r1", "r1"} {
			name := "g" + string(rune('0'+i))
			inv.Add(Device{Key: node + "/" + name, Name: name, Node: node, NVLink: "c", PCIeRoot: root, NUMA: "0"})
		}
		for i, root := range []string{"r0", "r1"} {
			name := "n" + string(rune('0'+i))
			inv.Add(Device{Key: node + "/" + name, Name: name, Node: node, NIC: true, PCIeRoot: root, NUMA: "0"})
		}
	}
	return inv
}

func TestJudge(t *testing.T) {
	tests := map[string]struct {
		used      map[string]string // device key -> owner, before the allocation
		unhealthy []string
		keys      []string
		level     Level
		scope     Scope
		want      Verdict
	}{
		"aligned pair": {
			keys: []string{"a/g0", "a/g1"}, level: LevelPCIeRoot,
			want: Verdict{Aligned: true, Possible: true, Option: DomainID{"a", "r0"}},
		},
		"split pair with a root free": {
			keys: []string{"a/g1", "a/g2"}, level: LevelPCIeRoot,
			want: Verdict{Possible: true, Option: DomainID{"a", "r0"}},
		},
		"split pair, every root half used": {
			used: map[string]string{"a/g0": "x", "a/g3": "x", "b/g0": "x", "b/g3": "x"},
			keys: []string{"a/g1", "a/g2"}, level: LevelPCIeRoot,
			want: Verdict{},
		},
		"own earlier claim counts as free": {
			used: map[string]string{"a/g0": "pod", "a/g3": "x", "b/g0": "x", "b/g3": "x"},
			keys: []string{"a/g1", "a/g2"}, level: LevelPCIeRoot, scope: Scope{Owner: "pod"},
			want: Verdict{Possible: true, Option: DomainID{"a", "r0"}},
		},
		"nodes out of scope do not count": {
			used: map[string]string{"a/g0": "x", "a/g3": "x"},
			keys: []string{"a/g1", "a/g2"}, level: LevelPCIeRoot, scope: Scope{Node: func(n string) bool { return n == "a" }},
			want: Verdict{},
		},
		"same value on two nodes is not aligned": {
			keys: []string{"a/g0", "b/g1"}, level: LevelPCIeRoot,
			want: Verdict{Possible: true, Option: DomainID{"a", "r0"}},
		},
		"GPU and NIC under one root": {
			keys: []string{"b/g2", "b/n1"}, level: LevelPCIeRoot,
			want: Verdict{Aligned: true, Possible: true, Option: DomainID{"a", "r0"}},
		},
		"GPU and NIC: no root with a free NIC": {
			used: map[string]string{"a/n0": "x", "a/n1": "x", "b/n0": "x"},
			keys: []string{"b/g0", "b/n1"}, level: LevelPCIeRoot,
			want: Verdict{Possible: true, Option: DomainID{"b", "r1"}},
		},
		"no domain at the level": {
			keys: []string{"a/n0", "a/n1"}, level: LevelNVLink,
			want: Verdict{},
		},
		"node level": {
			keys: []string{"a/g0", "a/g3"}, level: LevelNode,
			want: Verdict{Aligned: true, Possible: true, Option: DomainID{"a", "a"}},
		},
		"an unhealthy device is not free": {
			used:      map[string]string{"a/g3": "x", "b/g0": "x", "b/g3": "x"},
			unhealthy: []string{"a/g0"},
			keys:      []string{"a/g1", "a/g2"}, level: LevelPCIeRoot,
			want: Verdict{},
		},
		"an unhealthy device of the owner's earlier claim is not free": {
			used:      map[string]string{"a/g0": "pod", "a/g3": "x", "b/g0": "x", "b/g3": "x"},
			unhealthy: []string{"a/g0"},
			keys:      []string{"a/g1", "a/g2"}, level: LevelPCIeRoot, scope: Scope{Owner: "pod"},
			want: Verdict{},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			inv := twoNodes()
			for key, owner := range tc.used {
				if _, conflict := inv.Use(key, owner); conflict {
					t.Fatalf("setup: %s used twice", key)
				}
			}
			for _, key := range tc.unhealthy {
				inv.SetUnhealthy(key, true)
			}
			if got := inv.Judge(tc.keys, tc.level, tc.scope); got != tc.want {
				t.Errorf("Judge(%v, %v) = %+v, want %+v", tc.keys, tc.level, got, tc.want)
			}
		})
	}
}

func TestFits(t *testing.T) {
	inv := twoNodes()
	tests := map[string]struct {
		level Level
		want  Count
		fits  bool
	}{
		"2 GPUs in a root":        {LevelPCIeRoot, Count{GPUs: 2}, true},
		"3 GPUs in a root":        {LevelPCIeRoot, Count{GPUs: 3}, false},
		"3 GPUs in a NUMA node":   {LevelNUMA, Count{GPUs: 3}, true},
		"2 GPUs and a NIC, root":  {LevelPCIeRoot, Count{GPUs: 2, NICs: 1}, true},
		"2 GPUs and 2 NICs, root": {LevelPCIeRoot, Count{GPUs: 2, NICs: 2}, false},
		"NICs have no clique":     {LevelNVLink, Count{NICs: 1}, false},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			if got := inv.Fits(tc.level, tc.want); got != tc.fits {
				t.Errorf("Fits(%v, %+v) = %v, want %v", tc.level, tc.want, got, tc.fits)
			}
		})
	}
}

func TestUseReleaseAndFreeNames(t *testing.T) {
	inv := twoNodes()
	if _, conflict := inv.Use("a/g0", "p"); conflict {
		t.Fatal("first use reported as a conflict")
	}
	if prev, conflict := inv.Use("a/g0", "q"); !conflict || prev != "p" {
		t.Errorf("second owner: got (%q, %v), want (\"p\", true)", prev, conflict)
	}
	if got := inv.FreeNames(LevelPCIeRoot, DomainID{"a", "r0"}, Scope{}); len(got) != 2 || got[0] != "g1" || got[1] != "n0" {
		t.Errorf("free in a/r0: %v, want [g1 n0]", got)
	}
	inv.Release("a/g0")
	if _, used := inv.Owner("a/g0"); used {
		t.Error("released device still has an owner")
	}
	if got := inv.Free(LevelNUMA, Scope{})[DomainID{"a", "0"}]; got != (Count{GPUs: 4, NICs: 2}) {
		t.Errorf("free in a/numa 0 after release: %+v", got)
	}
}

func TestUnhealthy(t *testing.T) {
	inv := twoNodes()
	inv.SetUnhealthy("a/g1", true)
	if inv.Available("a/g1") || !inv.Unhealthy("a/g1") {
		t.Error("an unhealthy device is available")
	}
	if got := inv.Free(LevelPCIeRoot, Scope{})[DomainID{"a", "r0"}]; got != (Count{GPUs: 1, NICs: 1}) {
		t.Errorf("free in a/r0 with g1 unhealthy: %+v, want 1 GPU, 1 NIC", got)
	}
	if got := inv.FreeNames(LevelPCIeRoot, DomainID{"a", "r0"}, Scope{}); len(got) != 2 || got[0] != "g0" || got[1] != "n0" {
		t.Errorf("free names in a/r0 with g1 unhealthy: %v, want [g0 n0]", got)
	}
	for _, key := range []string{"b/g1", "a/g2", "b/g2"} {
		inv.SetUnhealthy(key, true)
	}
	if inv.Fits(LevelPCIeRoot, Count{GPUs: 2}) {
		t.Error("2 GPUs fit a root, though every root has an unhealthy GPU")
	}
	if !inv.Fits(LevelNUMA, Count{GPUs: 2}) || inv.Fits(LevelNUMA, Count{GPUs: 3}) {
		t.Error("NUMA nodes of 2 healthy GPUs: 2 GPUs should fit, 3 not")
	}
	inv.Use("a/g0", "p")
	if inv.Available("a/g0") {
		t.Error("a used device is available")
	}
	inv.SetUnhealthy("a/g1", false)
	if !inv.Available("a/g1") {
		t.Error("a device healthy again is not available")
	}
	if !inv.Available("a/g3") {
		t.Error("a healthy free device is not available")
	}
}
