package allocator

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/topodra/topodra/pkg/topology"
)

// twoProfiles are two policies that define domains by different attributes.
var twoProfiles = []Policy{
	{Attributes: []resourceapi.QualifiedName{topology.AttrPCIeRoot}, Alignment: AlignmentPrefer, Packing: true},
	{Attributes: []resourceapi.QualifiedName{topology.AttrNUMANode}, Alignment: AlignmentPrefer, Packing: true},
}

// TestProfilesDoNotShareCaches runs cycles of two profiles with different
// topology attributes on the same node, interleaved: each sees the domains
// of its own attributes, and neither evicts the other's cached node, with
// a Cache per profile or one Cache for both.
func TestProfilesDoNotShareCaches(t *testing.T) {
	const nodeName = "node-0"
	ctx := quietContext(t)
	slices := dgx(nodeName)
	claims := []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", 2).obj()}
	for name, shared := range map[string]bool{"cache per profile": false, "one cache": true} {
		t.Run(name, func(t *testing.T) {
			caches := []*Cache{NewCache(), NewCache()}
			if shared {
				caches[1] = caches[0]
			}
			cached := make([]*nodeStatic, len(twoProfiles))
			for round := range 3 {
				for k, policy := range twoProfiles {
					a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, nodeName),
						ClassLister: defaultClasses, Slices: slices, CELCache: newCELCache(), Cache: caches[k], Policy: policy})
					if err != nil {
						t.Fatal(err)
					}
					res, err := a.Allocate(ctx, node(nodeName), claims)
					if err != nil || res.Allocations == nil {
						t.Fatalf("round %d, profile %d: %v %v", round, k, err, res.Explanation)
					}
					if want := string(policy.Attributes[0]) + "="; !strings.HasPrefix(res.Quality.Domain, want) {
						t.Errorf("round %d, profile %d: domain %q, want one of %s", round, k, res.Quality.Domain, want)
					}
					st := caches[k].node(nodeKey{name: nodeName, attrsKey: a.attrsKey, features: allFeatures})
					if st == nil {
						t.Fatalf("round %d, profile %d: node not cached", round, k)
					}
					if round > 0 && st != cached[k] {
						t.Errorf("round %d, profile %d: node rebuilt after the other profile's cycle", round, k)
					}
					cached[k] = st
				}
			}
		})
	}
}

// BenchmarkAlternatingPolicies runs scheduling cycles of two profiles with
// different topology attributes in turn on the same nodes, as a scheduler
// with two profiles does: build the allocator, allocate a 1-GPU pod on
// every node; then the other profile.
func BenchmarkAlternatingPolicies(b *testing.B) {
	ctx := benchContext()
	for _, numNodes := range []int{50, 500} {
		all, nodes, state := benchCluster(numNodes)
		claims := []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", 1).obj()}
		celCache := newCELCache()
		b.Run(fmt.Sprintf("%dnodes", numNodes), func(b *testing.B) {
			caches := []*Cache{NewCache(), NewCache()}
			for b.Loop() {
				for k, policy := range twoProfiles {
					a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses,
						Slices: all, CELCache: celCache, Cache: caches[k], Policy: policy})
					if err != nil {
						b.Fatal(err)
					}
					for _, n := range nodes {
						if _, err := a.Allocate(ctx, n, claims); err != nil {
							b.Fatal(err)
						}
					}
				}
			}
		})
	}
}

// TestCacheForgets: ForgetSlice drops the entries of one version of a
// slice, ForgetNode those of a node, and the counts that bound the cache
// follow.
func TestCacheForgets(t *testing.T) {
	const nodeName = "node-0"
	ctx := quietContext(t)
	slices := dgx(nodeName)
	cache := NewCache()
	// allocate runs one cycle on list with the cache.
	allocate := func(list []*resourceapi.ResourceSlice) *Allocator {
		t.Helper()
		a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, nodeName),
			ClassLister: defaultClasses, Slices: list, CELCache: newCELCache(), Cache: cache, Policy: twoProfiles[0]})
		if err != nil {
			t.Fatal(err)
		}
		if res, err := a.Allocate(ctx, node(nodeName), []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", 2).obj()}); err != nil || res.Allocations == nil {
			t.Fatalf("Allocate: %v", err)
		}
		return a
	}
	a := allocate(slices)
	key := nodeKey{name: nodeName, attrsKey: a.attrsKey, features: allFeatures}
	if cache.node(key) == nil || cache.numNodes.Load() != 1 || cache.numSlices.Load() == 0 {
		t.Fatalf("after a cycle: node cached %v, %d nodes, %d slices; want the node and its slices", cache.node(key) != nil, cache.numNodes.Load(), cache.numSlices.Load())
	}
	for _, s := range slices {
		if s.UID == "" {
			t.Fatalf("slice %s has no UID: not cached", s.Name)
		}
		cache.ForgetSlice(s.UID, s.Generation)
	}
	if n := cache.numSlices.Load(); n != 0 {
		t.Errorf("%d slice entries after every slice was forgotten", n)
	}
	// A cycle still holding the versions forgotten allocates as before
	// without caching them again: nothing would drop them but the bound.
	// Newer versions are cached.
	allocate(slices)
	if n := cache.numSlices.Load(); n != 0 {
		t.Errorf("%d slice entries after a cycle with the versions forgotten", n)
	}
	var newer []*resourceapi.ResourceSlice
	for _, s := range slices {
		s = s.DeepCopy()
		s.Generation++
		newer = append(newer, s)
	}
	allocate(newer)
	if n := cache.numSlices.Load(); n == 0 {
		t.Error("no slice entries after a cycle with newer versions")
	}
	cache.ForgetNode("other-node")
	if cache.node(key) == nil {
		t.Error("another node forgotten dropped this one")
	}
	cache.ForgetNode(nodeName)
	if cache.node(key) != nil || cache.numNodes.Load() != 0 {
		t.Errorf("node still cached (%d entries) after it was forgotten", cache.numNodes.Load())
	}
}

// TestSelectorMemoBounded: pods whose claims bring selectors of their own
// (2,000 distinct expressions) on one slice keep at most maxMemoExprs
// expressions memoised for it, and every allocation still gets the
// devices its selector picks.
func TestSelectorMemoBounded(t *testing.T) {
	const nodeName = "node-0"
	ctx := quietContext(t)
	node0 := dgx(nodeName)
	cache := NewCache()
	celCache := newCELCache()
	for i := range 2000 {
		a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, nodeName), ClassLister: defaultClasses,
			Slices: node0, CELCache: celCache, Cache: cache, Policy: DefaultPolicy()})
		if err != nil {
			t.Fatal(err)
		}
		root := i % 4
		expr := fmt.Sprintf(`device.attributes[%q].pcieRoot == "pci%04x:00" && %d >= 0`, "resource.kubernetes.io", root, i)
		res, err := a.Allocate(ctx, node(nodeName), []*resourceapi.ResourceClaim{claim(fmt.Sprintf("c%d", i)).request("gpus", "gpu", 2, expr).obj()})
		if err != nil || res.Allocations == nil {
			t.Fatalf("pod %d: %v", i, err)
		}
		if got, want := deviceNames(res.Allocations), []string{fmt.Sprintf("gpu-%d", 2*root), fmt.Sprintf("gpu-%d", 2*root+1)}; !slices.Equal(got, want) {
			t.Fatalf("pod %d, selector %s: got devices %v, want %v", i, expr, got, want)
		}
		sm := cache.forSlice(node0[0].UID, node0[0].Generation, allFeatures.ListTypeAttributes)
		sm.mu.RLock()
		n := len(sm.byExpr)
		sm.mu.RUnlock()
		if n > maxMemoExprs {
			t.Fatalf("after pod %d the slice memoises %d selector expressions, want at most %d", i, n, maxMemoExprs)
		}
	}
}
