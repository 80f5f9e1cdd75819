package allocator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	"github.com/topodra/topodra/pkg/topology"
)

func TestAllocateShapes(t *testing.T) {
	const nodeName = "worker"
	gpus := func(name string, n int64) *claimBuilder { return claim(name).request("gpus", "gpu", n) }

	testcases := map[string]struct {
		slices    []*resourceapi.ResourceSlice
		allocated *structured.AllocatedState
		claims    []*resourceapi.ResourceClaim
		policy    *Policy

		// want are the chosen devices (sorted); nil means infeasible.
		want []string
		// upstreamWant documents (and checks) what first-fit picks.
		upstreamWant []string
		wantLevel    resourceapi.QualifiedName // "" = do not check; "node" = spanning
		wantAligned  bool
		wantExplain  string // substring of Explanation.String(); "" = no explanation expected
	}{
		"dgx-empty-1gpu": {
			slices:       dgx(nodeName),
			claims:       []*resourceapi.ResourceClaim{gpus("c", 1).obj()},
			want:         []string{"gpu-0"},
			upstreamWant: []string{"gpu-0"},
			wantLevel:    "device",
			wantAligned:  true,
		},
		"dgx-first-fit-trap": {
			// gpu-0 is taken: first-fit pairs gpu-1 and gpu-2 across two
			// PCIe roots; the aligned pair gpu-2,gpu-3 is free.
			slices:       dgx(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-0"),
			claims:       []*resourceapi.ResourceClaim{gpus("c", 2).obj()},
			want:         []string{"gpu-2", "gpu-3"},
			upstreamWant: []string{"gpu-1", "gpu-2"},
			wantLevel:    topology.AttrPCIeRoot,
			wantAligned:  true,
		},
		"dgx-best-fit-1gpu": {
			// gpu-2 is taken: the half-used pair (gpu-3) is filled before
			// a fresh pair is opened.
			slices:       dgx(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-2"),
			claims:       []*resourceapi.ResourceClaim{gpus("c", 1).obj()},
			want:         []string{"gpu-3"},
			upstreamWant: []string{"gpu-0"},
			wantLevel:    "device",
			wantAligned:  true,
		},
		"dgx-best-fit-prefers-fuller-numa": {
			// Two half-used pairs: gpu-1 (NUMA 0 has 3 free) and gpu-5
			// (NUMA 1 has 1 free). Take gpu-5, NUMA 0 keeps a 2+1 block.
			slices:       dgx(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-0", "gpu-4", "gpu-6", "gpu-7"),
			claims:       []*resourceapi.ResourceClaim{gpus("c", 1).obj()},
			want:         []string{"gpu-5"},
			upstreamWant: []string{"gpu-1"},
			wantAligned:  true,
		},
		"dgx-4gpu-one-numa": {
			// The clique holds all 8 GPUs; within it, prefer one NUMA node:
			// NUMA 0 has gpu-0 taken, so all of NUMA 1.
			slices:       dgx(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-0"),
			claims:       []*resourceapi.ResourceClaim{gpus("c", 4).obj()},
			want:         []string{"gpu-4", "gpu-5", "gpu-6", "gpu-7"},
			upstreamWant: []string{"gpu-1", "gpu-2", "gpu-3", "gpu-4"},
			wantLevel:    topology.AttrNUMANode,
			wantAligned:  true,
		},
		"dgx-two-claims-two-pairs": {
			slices:    dgx(nodeName),
			allocated: allocated(gpuDriver, nodeName, "gpu-0"),
			claims:    []*resourceapi.ResourceClaim{gpus("a", 2).obj(), gpus("b", 2).obj()},
			// a: pair 1 (NUMA 0, best fit); b: a pair of NUMA 1.
			want:         []string{"gpu-2", "gpu-3", "gpu-4", "gpu-5"},
			upstreamWant: []string{"gpu-1", "gpu-2", "gpu-3", "gpu-4"},
			wantAligned:  true,
		},
		"pcie-box-nvlink-pairs": {
			// gpu-0 taken: first-fit takes gpu-1 (bridged to gpu-0) and
			// gpu-2; topodra takes the bridged pair gpu-2,gpu-3.
			slices:       pcieBox(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-0"),
			claims:       []*resourceapi.ResourceClaim{gpus("c", 2).obj()},
			want:         []string{"gpu-2", "gpu-3"},
			upstreamWant: []string{"gpu-1", "gpu-2"},
			wantLevel:    topology.AttrNVLinkClique,
			wantAligned:  true,
		},
		"pcie-box-nvlink-first": {
			// With NVLink as the top priority the same pair is chosen, at
			// the clique level.
			slices:       pcieBox(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-0", "gpu-5"),
			claims:       []*resourceapi.ResourceClaim{gpus("c", 2).obj()},
			policy:       &Policy{Attributes: []resourceapi.QualifiedName{topology.AttrNVLinkClique, topology.AttrPCIeRoot}, Packing: true},
			want:         []string{"gpu-2", "gpu-3"},
			upstreamWant: []string{"gpu-1", "gpu-2"},
			wantLevel:    topology.AttrNVLinkClique,
			wantAligned:  true,
		},
		"gpu-nic-share-pcie-root": {
			// GPU and NIC from different drivers, aligned by pcieRoot.
			slices: gpuNIC(nodeName),
			claims: []*resourceapi.ResourceClaim{
				gpus("gpu", 1).annotate(topology.AnnotationAlignWith, "pod").obj(),
				claim("nic").request("nic", "nic", 1).annotate(topology.AnnotationAlignWith, "pod").obj(),
			},
			want:         []string{"gpu-0", "nic-1"},
			upstreamWant: []string{"gpu-0", "nic-0"},
			wantLevel:    topology.AttrPCIeRoot,
			wantAligned:  true,
		},
		"gpu-nic-one-claim": {
			// One claim with two requests: aligned without annotations.
			slices:       gpuNIC(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-2"),
			claims:       []*resourceapi.ResourceClaim{claim("c").request("gpu", "gpu", 1).request("nic", "nic", 1).obj()},
			want:         []string{"gpu-3", "nic-0"},
			upstreamWant: []string{"gpu-0", "nic-0"},
			wantLevel:    topology.AttrPCIeRoot,
			wantAligned:  true,
		},
		"multi-claim-pod-aligned-on-numa": {
			// NICs only publish numaNode (list-typed): the pod's GPU pair
			// and NIC share NUMA node 0 (nic-1), not nic-0 on NUMA 1.
			slices: numaNICs(nodeName),
			claims: []*resourceapi.ResourceClaim{
				gpus("gpu", 2).annotate(topology.AnnotationAlignWith, "pod").obj(),
				claim("nic").request("nic", "nic", 1).annotate(topology.AnnotationAlignWith, "pod").obj(),
			},
			want:         []string{"gpu-0", "gpu-1", "nic-1"},
			upstreamWant: []string{"gpu-0", "gpu-1", "nic-0"},
			wantLevel:    topology.AttrNUMANode,
			wantAligned:  true,
		},
		"no-topology-attributes": {
			slices:       plainGPUs(nodeName, 4),
			allocated:    allocated(gpuDriver, nodeName, "gpu-0"),
			claims:       []*resourceapi.ResourceClaim{gpus("c", 2).obj()},
			want:         []string{"gpu-1", "gpu-2"},
			upstreamWant: []string{"gpu-1", "gpu-2"},
			wantLevel:    "node",
			wantAligned:  false,
			wantExplain:  "publish no topology attributes",
		},
		"alignment-none-is-first-fit": {
			slices:       dgx(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-0"),
			claims:       []*resourceapi.ResourceClaim{gpus("c", 2).annotate(topology.AnnotationAlignment, "none").obj()},
			want:         []string{"gpu-1", "gpu-2"},
			upstreamWant: []string{"gpu-1", "gpu-2"},
			wantLevel:    topology.AttrNUMANode,
			wantAligned:  true,
		},
		"prefer-spans-when-nothing-fits": {
			// 5 free GPUs, no pcieRoot/NUMA has 4 free, no NVLink clique
			// holds 4: span, filling as few domains as possible.
			slices:       pcieBox(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-0", "gpu-4", "gpu-5"),
			claims:       []*resourceapi.ResourceClaim{gpus("c", 4).obj()},
			want:         []string{"gpu-1", "gpu-2", "gpu-3", "gpu-6"},
			upstreamWant: []string{"gpu-1", "gpu-2", "gpu-3", "gpu-6"},
			wantLevel:    "node",
			wantAligned:  false,
			wantExplain:  "has 3 of 4 needed free devices (alignment=prefer)",
		},
		"require-infeasible": {
			slices:       pcieBox(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-0", "gpu-4", "gpu-5"),
			claims:       []*resourceapi.ResourceClaim{gpus("c", 4).annotate(topology.AnnotationAlignment, "require").obj()},
			want:         nil,
			upstreamWant: []string{"gpu-1", "gpu-2", "gpu-3", "gpu-6"},
			wantExplain:  "claim c request gpus: 5 devices free but not within one nvlinkClique or pcieRoot or numaNode (alignment=require)",
		},
		"require-feasible": {
			slices:       pcieBox(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-0", "gpu-4"),
			claims:       []*resourceapi.ResourceClaim{gpus("c", 2).annotate(topology.AnnotationAlignment, "require").obj()},
			want:         []string{"gpu-2", "gpu-3"},
			upstreamWant: []string{"gpu-1", "gpu-2"},
			wantAligned:  true,
		},
		"policy-require-from-options": {
			slices:       pcieBox(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-0", "gpu-4", "gpu-5"),
			claims:       []*resourceapi.ResourceClaim{gpus("c", 4).obj()},
			policy:       &Policy{Alignment: AlignmentRequire},
			want:         nil,
			upstreamWant: []string{"gpu-1", "gpu-2", "gpu-3", "gpu-6"},
			wantExplain:  "not within one",
		},
		"too-few-devices": {
			slices:       dgx(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6"),
			claims:       []*resourceapi.ResourceClaim{gpus("gpu-claim", 2).obj()},
			want:         nil,
			upstreamWant: nil,
			wantExplain:  "claim gpu-claim request gpus: only 1 free device matches (needs 2)",
		},
		"more-than-the-node-has": {
			slices:       dgx(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-0"),
			claims:       []*resourceapi.ResourceClaim{gpus("big", 16).obj()},
			want:         nil,
			upstreamWant: nil,
			wantExplain:  "claim big request gpus: the node has only 8 matching devices (needs 16)",
		},
		"no-matching-device": {
			slices:       dgx(nodeName),
			claims:       []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", 1, `device.attributes["gpu.topodra.io"].model == "B200"`).obj()},
			want:         nil,
			upstreamWant: nil,
			wantExplain:  "claim c request gpus: the node has 8 devices of class gpu but none matches the request's selectors",
		},
		"no-device-of-the-class": {
			slices:       dgx(nodeName),
			claims:       []*resourceapi.ResourceClaim{claim("c").request("nics", "nic", 1).obj()},
			want:         nil,
			upstreamWant: nil,
			wantExplain:  "claim c request nics: the node has no device of class nic",
		},
		"spread-policy": {
			// LeastAllocated: the single GPU goes to the emptiest domain.
			slices:       dgx(nodeName),
			allocated:    allocated(gpuDriver, nodeName, "gpu-0"),
			claims:       []*resourceapi.ResourceClaim{gpus("c", 1).obj()},
			policy:       &Policy{Packing: false},
			want:         []string{"gpu-4"},
			upstreamWant: []string{"gpu-1"},
			wantAligned:  true,
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			policy := DefaultPolicy()
			if tc.policy != nil {
				policy = *tc.policy
			}
			_, res, upResult := allocateBoth(ctx, t, nodeName, tc.slices, tc.allocated, policy, tc.claims)
			if got := deviceNames(res.Allocations); !slices.Equal(got, tc.want) {
				t.Errorf("devices: got %v, want %v (explanation: %s)", got, tc.want, res.Explanation.String())
			}
			if tc.want == nil && res.Allocations != nil {
				t.Errorf("expected infeasible, got allocations")
			}
			if tc.want != nil && len(res.Allocations) != len(tc.claims) {
				t.Errorf("got %d allocations for %d claims", len(res.Allocations), len(tc.claims))
			}

			if got := deviceNames(upResult); !slices.Equal(got, tc.upstreamWant) {
				t.Errorf("upstream devices: got %v, want %v", got, tc.upstreamWant)
			}

			if tc.want != nil {
				q := res.Quality
				if tc.wantLevel != "" && q.LevelName != string(tc.wantLevel) {
					t.Errorf("level: got %s (%d), want %s", q.LevelName, q.Level, tc.wantLevel)
				}
				if q.Aligned != tc.wantAligned {
					t.Errorf("aligned: got %v, want %v", q.Aligned, tc.wantAligned)
				}
				if q.Score < 0 || q.Score > 100 || q.Packing < 0 || q.Packing > 1 {
					t.Errorf("score %d / packing %f out of range", q.Score, q.Packing)
				}
				if len(q.Devices) != len(tc.want) {
					t.Errorf("quality lists %v", q.Devices)
				}
			}
			if tc.wantExplain == "" {
				if res.Explanation != nil {
					t.Errorf("unexpected explanation: %s", res.Explanation)
				}
			} else if !strings.Contains(res.Explanation.String(), tc.wantExplain) {
				t.Errorf("explanation %q does not contain %q", res.Explanation.String(), tc.wantExplain)
			}
		})
	}
}

// TestScoreOrdersNodes checks that the score prefers an aligned allocation
// over a spanning one and a best-fit one over a fresh domain.
func TestScoreOrdersNodes(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	score := func(state *structured.AllocatedState, c *resourceapi.ResourceClaim) Quality {
		t.Helper()
		a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: dgx("n"), Policy: DefaultPolicy()})
		if err != nil {
			t.Fatal(err)
		}
		res, err := a.Allocate(ctx, node("n"), []*resourceapi.ResourceClaim{c})
		if err != nil || res.Allocations == nil {
			t.Fatalf("allocate: %v %v", err, res.Explanation)
		}
		return res.Quality
	}
	two := claim("c").request("gpus", "gpu", 2).obj()
	one := claim("c").request("gpus", "gpu", 1).obj()
	aligned := score(allocated(gpuDriver, "n", "gpu-0"), two)
	// Every pair broken: the best is one NUMA node (4 GPUs), tighter than
	// the clique of all 8.
	broken := score(allocated(gpuDriver, "n", "gpu-0", "gpu-2", "gpu-4", "gpu-6"), two)
	if aligned.LevelName != string(topology.AttrPCIeRoot) || broken.LevelName != string(topology.AttrNUMANode) {
		t.Fatalf("levels: %s, %s", aligned.LevelName, broken.LevelName)
	}
	if aligned.Score <= broken.Score {
		t.Errorf("aligned score %d should beat NUMA-level score %d", aligned.Score, broken.Score)
	}
	half := score(allocated(gpuDriver, "n", "gpu-2"), one)
	empty := score(allocated(gpuDriver, "n"), one)
	if half.Packing <= empty.Packing || half.Score < empty.Score {
		t.Errorf("best-fit on a half-used node should pack better: %+v vs %+v", half, empty)
	}
}

func TestBadInput(t *testing.T) {
	testcases := map[string]struct {
		claim   *resourceapi.ResourceClaim
		classes classLister
		want    []string
	}{
		"invalid-cel-in-request": {
			claim: claim("my-claim").request("my-request", "gpu", 1, `device.attributes["gpu.topodra.io"].model ==`).obj(),
			want:  []string{"default/my-claim", "my-request", "`device.attributes[\"gpu.topodra.io\"].model ==`"},
		},
		"invalid-cel-in-class": {
			claim:   claim("my-claim").request("my-request", "broken", 1).obj(),
			classes: classes(class("broken", `device.driver = "x"`)),
			want:    []string{"default/my-claim", "my-request", "broken", "`device.driver = \"x\"`"},
		},
		"unknown-class": {
			claim: claim("my-claim").request("my-request", "no-such-class", 1).obj(),
			want:  []string{"default/my-claim", "my-request", "no-such-class"},
		},
		"cel-runtime-error-one-device": {
			claim: claim("my-claim").request("my-request", "gpu", 1, `device.attributes["gpu.topodra.io"].noSuchAttribute > 3`).obj(),
			want:  []string{"default/my-claim", "my-request", "`device.attributes[\"gpu.topodra.io\"].noSuchAttribute > 3`", "fails on device", "no such key"},
		},
		"cel-runtime-error-other-drivers-domain": {
			// Written for NVIDIA's driver: the device's domains say so.
			claim: claim("my-claim").request("my-request", "gpu", 1, `device.attributes["gpu.nvidia.com"].productName == "H100"`).obj(),
			want: []string{"fails on device", "no such key: productName",
				"(the device's attribute domains: gpu.topodra.io, resource.kubernetes.io; capacity domains: none)"},
		},
		"cel-runtime-error-two-devices": {
			claim: claim("my-claim").request("my-request", "gpu", 2, `device.attributes["gpu.topodra.io"].noSuchAttribute > 3`).obj(),
			want:  []string{"default/my-claim", "my-request", "`device.attributes[\"gpu.topodra.io\"].noSuchAttribute > 3`", "fails on device"},
		},
		"cel-runtime-error-in-class": {
			claim:   claim("my-claim").request("my-request", "odd", 1).obj(),
			classes: classes(class("odd", `device.attributes["gpu.topodra.io"].noSuchAttribute > 3`)),
			want:    []string{"default/my-claim", "my-request", "device class odd", "noSuchAttribute"},
		},
		// A selector of a type newer than this package (an API server
		// newer than the scheduler): upstream refuses it in a request and
		// dereferences its nil CEL in a class.
		"selector-without-cel": {
			claim: func() *resourceapi.ResourceClaim {
				c := claim("my-claim").request("my-request", "gpu", 1).obj()
				c.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{}}
				return c
			}(),
			want: []string{"default/my-claim", "my-request", "selector #0", "does not know"},
		},
		"class-selector-without-cel": {
			claim: claim("my-claim").request("my-request", "newer", 1).obj(),
			classes: func() classLister {
				c := class("newer")
				c.Spec.Selectors = []resourceapi.DeviceSelector{{}}
				return classes(c)
			}(),
			want: []string{"default/my-claim", "my-request", "device class newer: selector #0 is of a type", "does not know"},
		},
		"more-devices-than-a-claim-holds": {
			claim: claim("my-claim").request("my-request", "gpu", 33).obj(),
			want:  []string{"default/my-claim", "my-request", "asks for 33 devices", "exceeds the claim limit of 32"},
		},
		"requests-together-more-than-a-claim-holds": {
			claim: claim("my-claim").request("a", "gpu", 20).request("b", "gpu", 20).obj(),
			want:  []string{"default/my-claim", "at least 40 devices", "exceeds the claim limit of 32"},
		},
		"bad-annotation": {
			claim: claim("my-claim").request("my-request", "gpu", 1).annotate(topology.AnnotationAlignment, "always").obj(),
			want:  []string{"default/my-claim", topology.AnnotationAlignment, "always"},
		},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			cl := tc.classes
			if cl == nil {
				cl = defaultClasses
			}
			a, err := New(ctx, Options{Features: allFeatures, ClassLister: cl, Slices: dgx("n"), Policy: DefaultPolicy()})
			if err != nil {
				t.Fatal(err)
			}
			res, err := a.Allocate(ctx, node("n"), []*resourceapi.ResourceClaim{tc.claim})
			if err == nil {
				t.Fatalf("expected an error, got %+v", res)
			}
			if res != nil {
				t.Errorf("expected a nil result with the error")
			}
			if !errors.Is(err, ErrInvalidInput) {
				t.Errorf("error does not wrap ErrInvalidInput: %v", err)
			}
			for _, want := range tc.want {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not mention %q", err, want)
				}
			}
		})
	}
}

// TestSelectorRuntimeErrorLikeUpstream: a selector that fails at run time
// on some devices of a node (they lack the attribute). Upstream reports
// the error when its search reaches such a device, so whether the node
// gives an allocation or an error depends on upstream's order; topodra
// answers as upstream does on the node's own slices (error or the same
// devices), whichever strategy serves the pod.
func TestSelectorRuntimeErrorLikeUpstream(t *testing.T) {
	sel := `device.attributes["` + gpuDriver + `"].mem >= 40`
	withMem := func(lacking ...int) []*resourceapi.ResourceSlice {
		s := dgx("node-a")
		for i := range s[0].Spec.Devices {
			if !slices.Contains(lacking, i) {
				s[0].Spec.Devices[i].Attributes["mem"] = num(80)
			}
		}
		return s
	}
	testcases := map[string]struct {
		slices  []*resourceapi.ResourceSlice
		inUse   []string
		count   int64
		wantErr bool
	}{
		// Best fit would try gpu-7 (the last free one of a busy NUMA
		// node) first; upstream's order gets to gpu-0 before it.
		"one device, the failing one preferred": {slices: withMem(7), inUse: []string{"gpu-4", "gpu-5", "gpu-6"}, count: 1},
		// A view without gpu-0 would allocate; upstream meets gpu-0 first.
		"two devices, the failing one first in the node's order": {slices: withMem(0), count: 2, wantErr: true},
		"two devices, the failing one last in the node's order":  {slices: withMem(7), inUse: []string{"gpu-0"}, count: 2},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			ctx := quietContext(t)
			state := allocated(gpuDriver, "node-a", tc.inUse...)
			claims := []*resourceapi.ResourceClaim{claim("c").request("gpu", "gpu", tc.count, sel).obj()}
			allocateLikeUpstream(ctx, t, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: tc.slices, CELCache: newCELCache(), Policy: DefaultPolicy()}, claims, tc.wantErr)
		})
	}
}

// allocateLikeUpstream allocates claims on node-a with an Allocator of opts
// (verifying an unverified result) and with upstream's structured
// allocator on the same input. It fails the test unless upstream errs
// exactly when wantErr says, topodra errs exactly when upstream does, and
// both allocate the same devices where neither errs. It returns topodra's
// error.
func allocateLikeUpstream(ctx context.Context, t *testing.T, opts Options, claims []*resourceapi.ResourceClaim, wantErr bool) error {
	t.Helper()
	a, err := New(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	res, err := a.Allocate(ctx, node("node-a"), claims)
	if err == nil && res.Unverified {
		res, err = a.Verify(ctx, node("node-a"), claims, res)
	}
	up, upErr := structured.NewAllocator(ctx, opts.Features, *opts.AllocatedState, opts.ClassLister, opts.Slices, newCELCache())
	if upErr != nil {
		t.Fatal(upErr)
	}
	upRes, upErr := up.Allocate(ctx, node("node-a"), claims)
	var got []string
	if res != nil {
		got = deviceNames(res.Allocations)
	}
	t.Logf("topodra: %v, %v; upstream: %v, %v", got, err, deviceNames(upRes), upErr)
	if (upErr != nil) != wantErr {
		t.Fatalf("upstream error %v; the case expects an error: %v", upErr, wantErr)
	}
	if (err != nil) != (upErr != nil) {
		t.Fatalf("topodra error %v, upstream error %v", err, upErr)
	}
	if err == nil && !slices.Equal(got, deviceNames(upRes)) {
		t.Errorf("topodra allocated %v, upstream %v", got, deviceNames(upRes))
	}
	return err
}

// TestSelectorRuntimeErrorOnAnotherNodesDeviceLikeUpstream: a slice with
// per-device node selection holds devices of node-a and node-b, and a
// selector fails at run time on node-b's device. Upstream evaluates the
// selectors on every device of the slice before it checks the device's
// node, so on node-a it reports the error when its search reaches node-b's
// device, and allocates when it finds the devices before. topodra answers
// as upstream does, whether counting may decide or not.
func TestSelectorRuntimeErrorOnAnotherNodesDeviceLikeUpstream(t *testing.T) {
	sel := `device.attributes["` + gpuDriver + `"].model == "x"`
	onNode := func(nodeName, name string, a attrs) resourceapi.Device {
		d := device(name, a)
		d.NodeName = ptr.To(nodeName)
		return d
	}
	otherNodes := onNode("node-b", "b0", attrs{}) // no model: the selector fails
	perDevice := func(devices ...resourceapi.Device) []*resourceapi.ResourceSlice {
		s := slice("shared", gpuDriver, devices...)
		s.Spec.NodeName = nil
		s.Spec.PerDeviceNodeSelection = ptr.To(true)
		return []*resourceapi.ResourceSlice{s}
	}
	a0 := onNode("node-a", "a0", attrs{"model": str("x"), topology.AttrPCIeRoot: str("r0")})
	a1 := onNode("node-a", "a1", attrs{"model": str("x"), topology.AttrPCIeRoot: str("r0")})
	testcases := map[string]struct {
		slices  []*resourceapi.ResourceSlice
		count   int64 // 0: All
		wantErr bool
	}{
		"one device, the other node's device first":  {slices: perDevice(otherNodes, a0), count: 1, wantErr: true},
		"two devices, the other node's device first": {slices: perDevice(otherNodes, a0, a1), count: 2, wantErr: true},
		// Upstream finds a0 before it gets to b0.
		"one device, the other node's device last": {slices: perDevice(a0, otherNodes), count: 1},
		// All looks at every device.
		"all devices, the other node's device last": {slices: perDevice(a0, a1, otherNodes), wantErr: true},
	}
	for name, tc := range testcases {
		for _, counting := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s, counting %v", name, counting), func(t *testing.T) {
				ctx := quietContext(t)
				state := allocated(gpuDriver, "none")
				claims := []*resourceapi.ResourceClaim{claim("c").request("gpu", "gpu", tc.count, sel).obj()}
				if tc.count == 0 {
					claims[0].Spec.Devices.Requests[0].Exactly.AllocationMode = resourceapi.DeviceAllocationModeAll
				}
				opts := Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: tc.slices, CELCache: newCELCache(), Policy: DefaultPolicy()}
				if !counting {
					opts.SkipCounting = func(string) bool { return true }
				}
				if err := allocateLikeUpstream(ctx, t, opts, claims, tc.wantErr); err != nil {
					if !errors.Is(err, ErrInvalidInput) || !strings.Contains(err.Error(), gpuDriver+"/shared/b0") {
						t.Errorf("error %q is not an input error that names the failing device", err)
					}
				}
			})
		}
	}
}

// TestAllRequestConstraintLikeUpstream: a claim asks for one GPU and all
// NICs, which must share the GPU's PCIe root, beside a claim for one more
// GPU. Upstream picks the claim's GPU first, then adds every NIC and fails
// with an error where a NIC breaks the constraint, so its order decides
// between an error and an allocation: topodra fails where upstream's order
// on the node fails, and allocates where it allocates.
func TestAllRequestConstraintLikeUpstream(t *testing.T) {
	onRoot := func(name, root string) resourceapi.Device {
		return device(name, attrs{topology.AttrPCIeRoot: str(root)})
	}
	gpus := slice("node-a", gpuDriver, onRoot("gpu-0", "r0"), onRoot("gpu-1", "r0"), onRoot("gpu-2", "r1"), onRoot("gpu-3", "r1"))
	testcases := map[string]struct {
		nicRoot string
		wantErr bool
	}{
		// Upstream takes gpu-0 for the first claim; best fit would take
		// gpu-2, beside the NIC.
		"the NIC behind the root upstream takes last":  {nicRoot: "r1", wantErr: true},
		"the NIC behind the root upstream takes first": {nicRoot: "r0"},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			ctx := quietContext(t)
			slices := []*resourceapi.ResourceSlice{gpus, slice("node-a", nicDriver, onRoot("nic-0", tc.nicRoot))}
			withNICs := claim("c1").request("gpu", "gpu", 1).request("nics", "nic", 0).obj()
			withNICs.Spec.Devices.Requests[1].Exactly.AllocationMode = resourceapi.DeviceAllocationModeAll
			withNICs.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(topology.AttrPCIeRoot))}}
			claims := []*resourceapi.ResourceClaim{withNICs, claim("c2").request("gpu", "gpu", 1).obj()}
			state := allocated(gpuDriver, "node-a", "gpu-3")
			allocateLikeUpstream(ctx, t, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: slices, CELCache: newCELCache(), Policy: DefaultPolicy()}, claims, tc.wantErr)
		})
	}
}

func TestNewRequiresClassLister(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	if _, err := New(ctx, Options{}); err == nil {
		t.Fatal("expected an error without ClassLister")
	}
	if _, err := New(ctx, Options{ClassLister: defaultClasses, Policy: Policy{Alignment: "sometimes"}}); err == nil {
		t.Fatal("expected an error for an invalid policy alignment")
	}
}

// TestTaintPatchedCopies: the DRA manager hands out copies of slices with
// taints from DeviceTaintRules patched in, under the same UID and
// generation. Caches keyed by UID and generation must not serve stale
// taints, in the single-device (ordered) path or the view path.
func TestTaintPatchedCopies(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	original := dgx("n")
	for _, count := range []int64{1, 2} {
		c := claim("c").request("gpus", "gpu", count).obj()
		allocate := func(slices []*resourceapi.ResourceSlice) []string {
			t.Helper()
			a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "n", "gpu-2"), ClassLister: defaultClasses, Slices: slices, Policy: DefaultPolicy()})
			if err != nil {
				t.Fatal(err)
			}
			res, err := a.Allocate(ctx, node("n"), []*resourceapi.ResourceClaim{c})
			if err != nil || res.Allocations == nil {
				t.Fatalf("allocate: %v %v", err, res.Explanation)
			}
			return deviceNames(res.Allocations)
		}
		first := allocate(original)
		patched := original[0].DeepCopy()
		for i := range patched.Spec.Devices {
			if slices.Contains(first, patched.Spec.Devices[i].Name) {
				patched.Spec.Devices[i].Taints = []resourceapi.DeviceTaint{{Key: "broken", Effect: resourceapi.DeviceTaintEffectNoSchedule}}
			}
		}
		second := allocate([]*resourceapi.ResourceSlice{patched})
		for _, d := range second {
			if slices.Contains(first, d) {
				t.Errorf("count %d: tainted device %s allocated (first %v, then %v)", count, d, first, second)
			}
		}
	}
}

// TestPoolsLikeUpstream: incomplete pools and duplicate device names make a
// node infeasible for topodra exactly as for upstream, for single-device
// (ordered path) and multi-device (planned path) claims. The explanation
// names an incomplete pool also when the devices already published are all
// in use.
func TestPoolsLikeUpstream(t *testing.T) {
	incomplete := dgx("n")
	incomplete[0].Spec.Pool.ResourceSliceCount = 2
	duplicate := dgx("n")
	for i := range duplicate[0].Spec.Devices {
		duplicate[0].Spec.Devices[i].Name = fmt.Sprintf("gpu-%d", i/2)
	}
	// A DGX whose pool also has a counter set and one partition: the pod
	// selects whole GPUs, so counting decides, and the partition alone
	// decides whether upstream uses the pool at all.
	partitioned := func(consumption resourceapi.DeviceCounterConsumption) []*resourceapi.ResourceSlice {
		slices := dgx("n")
		slices[0].Spec.Pool.ResourceSliceCount = 2
		part := device("part-0", attrs{"partition": str("1g")})
		part.ConsumesCounters = []resourceapi.DeviceCounterConsumption{consumption}
		slices[0].Spec.Devices = append(slices[0].Spec.Devices, part)
		counters := slice("n", gpuDriver)
		counters.Name = "n-counters"
		counters.Spec.Pool.ResourceSliceCount = 2
		counters.Spec.SharedCounters = []resourceapi.CounterSet{{Name: "mem", Counters: map[string]resourceapi.Counter{"gb": {Value: resource.MustParse("80")}}}}
		return append(slices, counters)
	}
	gb := map[string]resourceapi.Counter{"gb": {Value: resource.MustParse("10")}}
	var all []string
	for _, d := range incomplete[0].Spec.Devices {
		all = append(all, d.Name)
	}
	for name, tc := range map[string]struct {
		slices      []*resourceapi.ResourceSlice
		inUse       []string
		wantExplain string
	}{
		"incomplete-pool":            {slices: incomplete, wantExplain: "the node's usable resource pools have no device of class gpu; some of the node's resource pools are incomplete"},
		"incomplete-pool-all-in-use": {slices: incomplete, inUse: all, wantExplain: "resource pools are incomplete"},
		"duplicate-device-names":     {slices: duplicate, wantExplain: "invalid resource pools"},
		"missing-counter-set":        {slices: partitioned(resourceapi.DeviceCounterConsumption{CounterSet: "gone", Counters: gb}), wantExplain: "invalid resource pools"},
		"missing-counter":            {slices: partitioned(resourceapi.DeviceCounterConsumption{CounterSet: "mem", Counters: map[string]resourceapi.Counter{"bw": {Value: resource.MustParse("1")}}}), wantExplain: "invalid resource pools"},
		// While DRADeviceCompatibilityGroups is off, upstream ignores the
		// slice, which leaves the pool incomplete.
		"compatibility-groups-feature-off": {slices: partitioned(resourceapi.DeviceCounterConsumption{CounterSet: "mem", Counters: gb, CompatibilityGroups: []string{"a"}}), wantExplain: "resource pools are incomplete"},
	} {
		for _, count := range []int64{1, 2} {
			t.Run(fmt.Sprintf("%s/%d", name, count), func(t *testing.T) {
				_, ctx := ktesting.NewTestContext(t)
				claims := []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", count, `!("partition" in device.attributes["`+gpuDriver+`"])`).obj()}
				state := allocated(gpuDriver, "n", tc.inUse...)
				up, err := structured.NewAllocator(ctx, allFeatures, *state, defaultClasses, tc.slices, newCELCache())
				if err != nil {
					t.Fatal(err)
				}
				upResult, upErr := up.Allocate(ctx, node("n"), claims)
				if upResult != nil {
					t.Fatalf("upstream allocates: %v", deviceNames(upResult))
				}
				a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: tc.slices, Policy: DefaultPolicy()})
				if err != nil {
					t.Fatal(err)
				}
				res, err := a.Allocate(ctx, node("n"), claims)
				if err != nil {
					t.Fatalf("Allocate: %v (upstream: %v)", err, upErr)
				}
				if res.Allocations != nil {
					t.Fatalf("topodra allocates %v where upstream does not", deviceNames(res.Allocations))
				}
				if !strings.Contains(res.Explanation.String(), tc.wantExplain) {
					t.Errorf("explanation %q does not contain %q", res.Explanation, tc.wantExplain)
				}
				if strings.Contains(res.Explanation.String(), "gpu.topodra.io/n") {
					t.Errorf("explanation %q names the node's pool: it would differ from node to node", res.Explanation)
				}
				if named := res.Explanation.Requests[0].UnusablePools; strings.Contains(tc.wantExplain, "incomplete") && named != "gpu.topodra.io/n (incomplete)" {
					t.Errorf("UnusablePools %q, want the pool named with why, for the log", named)
				}
			})
		}
	}
}

// TestAllRequestOnUnusablePool: an allocationMode All request on a node
// whose pool is incomplete or invalid fails on that node (upstream refuses
// it there), with an explanation that names no pool; it is not an error,
// which would end the pod's scheduling cycle on every node.
func TestAllRequestOnUnusablePool(t *testing.T) {
	incomplete := dgx("n")
	incomplete[0].Spec.Pool.ResourceSliceCount = 2
	duplicate := dgx("n")
	duplicate[0].Spec.Devices[1].Name = duplicate[0].Spec.Devices[0].Name
	for name, tc := range map[string]struct {
		slices []*resourceapi.ResourceSlice
		want   string
	}{
		"incomplete": {incomplete, "resource pools are incomplete"},
		"invalid":    {duplicate, "invalid resource pools"},
	} {
		t.Run(name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			c := claim("c").request("gpus", "gpu", 1).obj()
			c.Spec.Devices.Requests[0].Exactly.AllocationMode = resourceapi.DeviceAllocationModeAll
			c.Spec.Devices.Requests[0].Exactly.Count = 0
			a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "n"), ClassLister: defaultClasses, Slices: tc.slices, Policy: DefaultPolicy()})
			if err != nil {
				t.Fatal(err)
			}
			res, err := a.Allocate(ctx, node("n"), []*resourceapi.ResourceClaim{c})
			if err != nil {
				t.Fatalf("Allocate: %v, want a failure of this node", err)
			}
			if res.Allocations != nil {
				t.Fatalf("allocated %v", deviceNames(res.Allocations))
			}
			got := res.Explanation.String()
			if !strings.Contains(got, "claim c request gpus: asks for all matching devices") || !strings.Contains(got, tc.want) || strings.Contains(got, "gpu.topodra.io/n") {
				t.Errorf("explanation %q, want the All request and %q, without the node's pool", got, tc.want)
			}
			if pools := res.Explanation.Requests[0].UnusablePools; !strings.Contains(pools, gpuDriver+"/n") {
				t.Errorf("UnusablePools %q, want the pool named for the log", pools)
			}
		})
	}
}

// TestNodeGenerationLikeUpstream: a driver that publishes one slice per
// node and moves nodes to a new pool generation one by one leaves a node
// on the older generation; upstream allocates from it as long as the
// node's slices of that generation are the whole pool, and so does
// topodra (by counting, with Verify confirming).
func TestNodeGenerationLikeUpstream(t *testing.T) {
	for _, tc := range []struct {
		name        string
		count       int64 // ResourceSliceCount of both generations
		wantAllowed bool
	}{
		{name: "older-generation-complete-on-node", count: 1, wantAllowed: true},
		{name: "older-generation-being-replaced", count: 2, wantAllowed: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			mine := dgx("n")[0]
			mine.Spec.Pool = resourceapi.ResourcePool{Name: "shared", Generation: 1, ResourceSliceCount: tc.count}
			theirs := dgx("m")[0]
			theirs.Spec.Pool = resourceapi.ResourcePool{Name: "shared", Generation: 2, ResourceSliceCount: tc.count}
			for i := range theirs.Spec.Devices {
				theirs.Spec.Devices[i].Name = fmt.Sprintf("m-gpu-%d", i)
			}
			all := []*resourceapi.ResourceSlice{mine, theirs}
			claims := []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", 2).obj()}
			state := allocated(gpuDriver, "shared")
			up, err := structured.NewAllocator(ctx, allFeatures, *state, defaultClasses, all, newCELCache())
			if err != nil {
				t.Fatal(err)
			}
			upResult, err := up.Allocate(ctx, node("n"), claims)
			if err != nil && !errors.Is(err, structured.ErrFailedAllocationOnNode) {
				t.Fatal(err)
			}
			if (upResult != nil) != tc.wantAllowed {
				t.Fatalf("upstream allocates %v, the test expects %v: the test's premise is wrong", deviceNames(upResult), tc.wantAllowed)
			}
			a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: all, Policy: DefaultPolicy()})
			if err != nil {
				t.Fatal(err)
			}
			res, err := a.Allocate(ctx, node("n"), claims)
			if err != nil {
				t.Fatal(err)
			}
			if (res.Allocations != nil) != tc.wantAllowed {
				t.Fatalf("topodra allocates %v (%s), upstream %v", deviceNames(res.Allocations), res.Explanation, deviceNames(upResult))
			}
			if res.Allocations == nil {
				return
			}
			verified, err := a.Verify(ctx, node("n"), claims, res)
			if err != nil || verified.CountingRefused || verified.Allocations == nil {
				t.Fatalf("Verify: %v, refused %v", err, verified != nil && verified.CountingRefused)
			}
			for _, d := range deviceNames(verified.Allocations) {
				if strings.HasPrefix(d, "m-") {
					t.Errorf("allocated %s of node m", d)
				}
			}
		})
	}
}

// TestVerifyKeepsInvalidPoolsInvalid: Verify shows upstream only the
// chosen devices, but never in a way that turns an invalid pool valid: a
// counted result that names devices of such a pool is refused.
func TestVerifyKeepsInvalidPoolsInvalid(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	slices := dgx("n")
	slices[0].Spec.Pool.ResourceSliceCount = 2
	part := device("part-0", attrs{"partition": str("1g")})
	part.ConsumesCounters = []resourceapi.DeviceCounterConsumption{{CounterSet: "gone", Counters: map[string]resourceapi.Counter{"gb": {Value: resource.MustParse("1")}}}}
	slices[0].Spec.Devices = append(slices[0].Spec.Devices, part)
	counters := slice("n", gpuDriver)
	counters.Name = "n-counters"
	counters.Spec.Pool.ResourceSliceCount = 2
	counters.Spec.SharedCounters = []resourceapi.CounterSet{{Name: "mem", Counters: map[string]resourceapi.Counter{"gb": {Value: resource.MustParse("80")}}}}
	slices = append(slices, counters)
	claims := []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", 1, `!("partition" in device.attributes["`+gpuDriver+`"])`).obj()}
	a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "n"), ClassLister: defaultClasses, Slices: slices, Policy: DefaultPolicy()})
	if err != nil {
		t.Fatal(err)
	}
	// What counting would have returned had it not known the pool rules.
	stale := &Result{Unverified: true, Allocations: []resourceapi.AllocationResult{{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{
		{Request: "gpus", Driver: gpuDriver, Pool: "n", Device: "gpu-0"},
	}}}}}
	verified, err := a.Verify(ctx, node("n"), claims, stale)
	if err != nil {
		t.Fatal(err)
	}
	if verified.Allocations != nil {
		t.Fatalf("Verify confirms %v from an invalid pool", deviceNames(verified.Allocations))
	}
	if !verified.CountingRefused {
		t.Error("Verify does not report that upstream refused the counted allocation")
	}
}

// TestConcurrentAllocate calls Allocate for many nodes at once, as Filter
// does, on both paths, and expects the results of sequential calls (run
// with -race to check the shared caches).
func TestConcurrentAllocate(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	// A fresh cluster (new slice UIDs) per pod, so that the concurrent
	// calls also fill the caches.
	cluster := func() ([]*resourceapi.ResourceSlice, []*v1.Node, *structured.AllocatedState) {
		var all []*resourceapi.ResourceSlice
		var nodes []*v1.Node
		state := allocated(gpuDriver, "none")
		for i := range 24 {
			name := fmt.Sprintf("node-%d", i)
			nodes = append(nodes, node(name))
			all = append(all, dgxWithNICs(name)...)
			for j := range i % 8 {
				state.AllocatedDevices.Insert(structured.MakeDeviceID(gpuDriver, name, fmt.Sprintf("gpu-%d", (j*3)%8)))
			}
		}
		return all, nodes, state
	}
	pods := map[string][]*resourceapi.ResourceClaim{
		"one-gpu":  {claim("c").request("gpus", "gpu", 1).obj()},
		"two-gpus": {claim("c").request("gpus", "gpu", 2).obj()},
		"gpu-nic": {
			claim("g").request("gpus", "gpu", 2).annotate(topology.AnnotationAlignWith, "pod").obj(),
			claim("n").request("nic", "nic", 1).annotate(topology.AnnotationAlignWith, "pod").obj(),
		},
	}
	for name, claims := range pods {
		t.Run(name, func(t *testing.T) {
			all, nodes, state := cluster()
			a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: all, Policy: DefaultPolicy()})
			if err != nil {
				t.Fatal(err)
			}
			got := make([][]string, len(nodes))
			var wg sync.WaitGroup
			for i, n := range nodes {
				wg.Go(func() {
					res, err := a.Allocate(ctx, n, claims)
					if err != nil {
						t.Error(err)
						return
					}
					got[i] = deviceNames(res.Allocations)
				})
			}
			wg.Wait()
			want := make([][]string, len(nodes))
			for i, n := range nodes {
				res, err := a.Allocate(ctx, n, claims)
				if err != nil {
					t.Fatal(err)
				}
				want[i] = deviceNames(res.Allocations)
			}
			for i := range nodes {
				if !slices.Equal(got[i], want[i]) {
					t.Errorf("node %d: concurrent %v, sequential %v", i, got[i], want[i])
				}
				if want[i] == nil && i%8 < 6 {
					t.Errorf("node %d: nothing allocated", i)
				}
			}
		})
	}
}

// TestQualityStrandedRoots: on a DGX with one NIC per PCIe root, a GPU-only
// allocation of a whole node's GPUs strands every root whose NIC is free;
// a pod that asks for GPUs and NICs strands none; smaller allocations and
// policies without pcieRoot among the attributes count none.
func TestQualityStrandedRoots(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	// inUse: GPUs and NICs in use. NIC i sits on root 3-i, beside GPUs
	// 2(3-i) and 2(3-i)+1.
	quality := func(policy Policy, inUse []string, claims ...*resourceapi.ResourceClaim) Quality {
		t.Helper()
		state := allocated(gpuDriver, "n")
		for _, d := range inUse {
			driver := gpuDriver
			if strings.HasPrefix(d, "nic") {
				driver = nicDriver
			}
			state.AllocatedDevices.Insert(structured.MakeDeviceID(driver, "n", d))
		}
		a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: dgxWithNICs("n"), Policy: policy})
		if err != nil {
			t.Fatal(err)
		}
		res, err := a.Allocate(ctx, node("n"), claims)
		if err != nil || res.Allocations == nil {
			t.Fatalf("allocate: %v %v", err, res.Explanation)
		}
		return res.Quality
	}
	gpus := func(n int64) *resourceapi.ResourceClaim { return claim("c").request("gpus", "gpu", n).obj() }
	for _, tc := range []struct {
		name  string
		inUse []string
		claim *resourceapi.ResourceClaim
		want  int
	}{
		// Smaller allocations are not counted: the last free GPU of root
		// 0, beside its free NIC, goes to this one.
		{"1 GPU beside a used one", []string{"gpu-0", "nic-2"}, gpus(1), 0},
		{"8 GPUs", nil, gpus(8), 4},
		{"8 GPUs, one NIC in use", []string{"nic-2"}, gpus(8), 3},
		{"GPU and NIC", nil, claim("c").request("gpu", "gpu", 8).request("nic", "nic", 1).obj(), 0},
	} {
		if q := quality(DefaultPolicy(), tc.inUse, tc.claim); q.StrandedRoots != tc.want {
			t.Errorf("%s: %d stranded roots on %v, want %d", tc.name, q.StrandedRoots, q.Devices, tc.want)
		}
	}
	noRoot := DefaultPolicy()
	noRoot.Attributes = []resourceapi.QualifiedName{topology.AttrNUMANode}
	if q := quality(noRoot, nil, gpus(8)); q.StrandedRoots != 0 {
		t.Errorf("without pcieRoot: %d stranded roots, want 0", q.StrandedRoots)
	}
}

// TestQualityOtherDevices: a pod that asks for GPUs only sees the node's
// NICs on the PCIe roots of its GPUs as other devices, counted whole and
// free; one that asks for both sees none. Devices of a pool that is not
// the node's own (network-attached NICs), devices without a PCIe root (a
// CPU driver's, which publish a NUMA node), and a NIC on a root without
// GPUs are not other devices of the node; without pcieRoot among the
// attributes there are none.
func TestQualityOtherDevices(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	gpus := func(n int64) *resourceapi.ResourceClaim { return claim("c").request("gpus", "gpu", n).obj() }
	noRoot := DefaultPolicy()
	noRoot.Attributes = []resourceapi.QualifiedName{topology.AttrNUMANode}
	for _, tc := range []struct {
		name      string
		inUse     []string
		claim     *resourceapi.ResourceClaim
		policy    Policy
		all, free int
	}{
		{"1 GPU", nil, gpus(1), DefaultPolicy(), 4, 4},
		{"4 GPUs, one NIC in use", []string{"nic-1", "gpu-0"}, gpus(4), DefaultPolicy(), 4, 3},
		{"GPU and NIC", []string{"nic-1"}, claim("c").request("gpu", "gpu", 1).request("nic", "nic", 1).obj(), DefaultPolicy(), 0, 0},
		{"without pcieRoot", nil, gpus(1), noRoot, 0, 0},
	} {
		state := allocated(gpuDriver, "n")
		for _, d := range tc.inUse {
			driver := gpuDriver
			if strings.HasPrefix(d, "nic") {
				driver = nicDriver
			}
			state.AllocatedDevices.Insert(structured.MakeDeviceID(driver, "n", d))
		}
		fabric := slice("fabric", nicDriver, device("fabric-nic-0", attrs{topology.AttrPCIeRoot: str("pci0000:00")}))
		fabric.Spec.NodeName, fabric.Spec.AllNodes = nil, ptr.To(true)
		cpus := slice("n", "cpu.example.com",
			device("cpu-0", attrs{topology.AttrNUMANode: num(0)}),
			device("cpu-1", attrs{topology.AttrNUMANode: num(1)}))
		lone := slice("n", "storage.example.com", device("nvme-0", attrs{topology.AttrPCIeRoot: str("pci00ff:00")}))
		slices := append(dgxWithNICs("n"), fabric, cpus, lone)
		a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: slices, Policy: tc.policy})
		if err != nil {
			t.Fatal(err)
		}
		res, err := a.Allocate(ctx, node("n"), []*resourceapi.ResourceClaim{tc.claim})
		if err != nil || res.Allocations == nil {
			t.Fatalf("%s: allocate: %v %v", tc.name, err, res.Explanation)
		}
		if q := res.Quality; q.OtherDevices != tc.all || q.OtherFree != tc.free {
			t.Errorf("%s: other devices %d, %d free; want %d, %d free", tc.name, q.OtherDevices, q.OtherFree, tc.all, tc.free)
		}
	}
}

// TestNICReserveScore: an allocation of fewer than half a whole node's
// devices marked InNICReserve scores in the lowest band: below every
// unmarked allocation of rank 1 or more, however aligned it is itself, and
// below an unmarked one that shares nothing with the same room and
// packing; among marked allocations the better aligned wins, as it does
// unmarked; a well aligned one beats an unmarked one that shares nothing
// and has little room. A larger one gives up one rank: it ties with an
// unmarked one a rank looser, beats one two ranks looser, and keeps rank 1
// (it beats one of rank 0). Nothing is lowered when spreading.
func TestNICReserveScore(t *testing.T) {
	p := DefaultPolicy()
	best := Quality{Shared: 3, Room: 1, Packing: 1, InNICReserve: true}
	if got := p.Rank(best); got != 0 {
		t.Errorf("rank 3 in the reserve: rank %d, want 0", got)
	}
	loosest := Quality{Shared: 1, Room: 0, Packing: 0}
	if p.Score(best) >= p.Score(loosest) {
		t.Errorf("rank 3 in the reserve scores %d, not below %d of rank 1 outside it", p.Score(best), p.Score(loosest))
	}
	scattered := Quality{Shared: 0, Room: 1, Packing: 1, InNICReserve: true}
	if nothing := (Quality{Shared: 0, Room: 1, Packing: 1}); p.Score(scattered) >= p.Score(nothing) {
		t.Errorf("rank 0 in the reserve scores %d, not below %d of rank 0 outside it with the same room and packing", p.Score(scattered), p.Score(nothing))
	}
	if emptier := (Quality{Shared: 0, Room: 0.7, Packing: 0.2}); p.Score(best) <= p.Score(emptier) {
		t.Errorf("rank 3 in the reserve (%d) should beat rank 0 outside it with less room and packing (%d)", p.Score(best), p.Score(emptier))
	}
	for _, looser := range []Quality{
		{Shared: 2, Room: 1, Packing: 1, InNICReserve: true},
		{Shared: 1, Room: 1, Packing: 1, InNICReserve: true},
		scattered,
	} {
		tight := Quality{Shared: looser.Shared + 1, Room: 0, Packing: 0, InNICReserve: true}
		if p.Score(tight) <= p.Score(looser) {
			t.Errorf("in the reserve, rank %d with no room scores %d, not above rank %d with all room (%d)", tight.Shared, p.Score(tight), looser.Shared, p.Score(looser))
		}
	}

	four := []string{"a", "b", "c", "d"}
	numa := Quality{Shared: 2, Room: 1, Packing: 1, InNICReserve: true, Devices: four}
	if got := p.Rank(numa); got != 1 {
		t.Errorf("4 devices of rank 2 in the reserve: rank %d, want 1", got)
	}
	if looser := (Quality{Shared: 1, Room: 1, Packing: 1, Devices: four}); p.Score(numa) != p.Score(looser) {
		t.Errorf("4 devices of rank 2 in the reserve score %d, rank 1 outside it with the same room and packing %d: want a tie", p.Score(numa), p.Score(looser))
	}
	if rootPairs := (Quality{Shared: 3, Room: 1, Packing: 1, InNICReserve: true, Devices: four}); p.Score(rootPairs) <= p.Score(Quality{Shared: 1, Room: 1, Packing: 1, Devices: four}) {
		t.Errorf("4 devices of rank 3 in the reserve should beat rank 1 outside it")
	}
	clique := Quality{Shared: 1, Room: 0, Packing: 0, InNICReserve: true, Devices: append(four, "e", "f", "g", "h")}
	if p.Rank(clique) != 1 || p.Score(clique) <= p.Score(Quality{Shared: 0, Room: 1, Packing: 1}) {
		t.Errorf("8 devices of rank 1 in the reserve: rank %d, score %d; want rank 1, above rank 0 outside it", p.Rank(clique), p.Score(clique))
	}
	small := p
	small.WholeNode = 4
	if got := small.Rank(Quality{Shared: 2, InNICReserve: true, Devices: []string{"a", "b"}}); got != 1 {
		t.Errorf("2 devices of rank 2 in the reserve where 4 make a whole node: rank %d, want 1", got)
	}

	draining := Quality{Shared: 2, Room: 1, Packing: 1, InNICReserve: true}
	if got := p.RankOn(draining, true); got != 0 {
		t.Errorf("in the reserve on a draining node: rank %d, want 0", got)
	}
	plain := best
	plain.InNICReserve = false
	spread := p
	spread.Packing = false
	if spread.Score(best) != spread.Score(plain) {
		t.Errorf("spreading: %d in the reserve, %d outside", spread.Score(best), spread.Score(plain))
	}
}

// TestNICRootTrade: an allocation marked StrandsNICs gives up NICRootTrade
// ranks, down to 0, and scores below an equal one that is not marked; the
// trade needs packing.
func TestNICRootTrade(t *testing.T) {
	p := DefaultPolicy()
	p.NICRootTrade = 1
	for _, tc := range []struct{ shared, want int }{{3, 2}, {2, 1}, {1, 0}, {0, 0}} {
		q := Quality{Shared: tc.shared, StrandsNICs: true, Room: 0.5, Packing: 0.5}
		if got := p.Rank(q); got != tc.want {
			t.Errorf("rank %d stranding: %d, want %d", tc.shared, got, tc.want)
		}
		kept := q
		kept.StrandsNICs = false
		if got := p.Rank(kept); got != tc.shared {
			t.Errorf("rank %d: %d", tc.shared, got)
		}
		// Within one rank the stranding allocation comes last.
		lower := kept
		lower.Shared = tc.want
		if tc.shared > 0 && p.Score(q) >= p.Score(lower) {
			t.Errorf("rank %d stranding scores %d, not below %d of rank %d without", tc.shared, p.Score(q), p.Score(lower), tc.want)
		}
	}
	// Whole-node trade and NIC trade add up; the former stops at rank 1.
	if got := p.Rank(Quality{Shared: 2, BreaksNode: true, StrandsNICs: true}); got != 1 {
		t.Errorf("with a whole-node trade of 0: rank %d, want 1", got)
	}
	p.WholeNodeTrade = 5
	if got := p.Rank(Quality{Shared: 3, BreaksNode: true, StrandsNICs: true}); got != 0 {
		t.Errorf("both trades: rank %d, want 0", got)
	}
	off := DefaultPolicy()
	if got := off.Rank(Quality{Shared: 1, StrandsNICs: true}); got != 1 {
		t.Errorf("NICRootTrade 0: rank %d, want 1", got)
	}
	spread := p
	spread.Packing = false
	if got := spread.Rank(Quality{Shared: 1, StrandsNICs: true}); got != 1 {
		t.Errorf("spreading: rank %d, want 1", got)
	}
}

// TestSkipNodeOperationsLikeUpstream: devices of a slice that skips node
// operations are allocatable only where the feature is on and the node
// declares it; counting leaves them to upstream, so topodra allocates
// exactly when upstream does, on the first try.
func TestSkipNodeOperationsLikeUpstream(t *testing.T) {
	ctx := quietContext(t)
	s := dgx("node-a")
	s[0].Spec.SkipNodeOperations = []resourceapi.SkipNodeOperation{"*"}
	c := claim("c").request("gpus", "gpu", 2).obj()
	_, res, up := allocateBoth(ctx, t, "node-a", s, nil, DefaultPolicy(), []*resourceapi.ResourceClaim{c})
	t.Logf("topodra %v (unverified %v), upstream %v", deviceNames(res.Allocations), res.Unverified, deviceNames(up))
	if (res.Allocations == nil) != (up == nil) || res.Unverified {
		t.Errorf("topodra allocated %v (unverified %v), upstream %v", deviceNames(res.Allocations), res.Unverified, deviceNames(up))
	}
}

// TestRequireTakesTheFirstAlignedChoice: a claim with alignment=require
// and firstAvailable subrequests "four", then "two". Four GPUs are free
// by count but in two NUMA nodes (no NVLink clique here), two fit in one:
// the claim gets "two", aligned. Where no choice fits aligned, the node
// is rejected as before.
func TestRequireTakesTheFirstAlignedChoice(t *testing.T) {
	ctx := quietContext(t)
	noClique := func() []*resourceapi.ResourceSlice {
		s := dgx("node-a")
		for i := range s[0].Spec.Devices {
			delete(s[0].Spec.Devices[i].Attributes, "nvlinkClique")
		}
		return s
	}
	requireClaim := func(counts ...int64) *resourceapi.ResourceClaim {
		c := firstAvailableClaim(counts...)
		c.Annotations = map[string]string{topology.AnnotationAlignment: "require"}
		return c
	}
	for name, tc := range map[string]struct {
		inUse      []string
		counts     []int64
		wantSub    string
		wantReject bool
	}{
		// Each NUMA node has gpu-1 and gpu-3 (PCIe roots apart) or gpu-5, gpu-7 free.
		"four spans NUMA nodes, two fits in one": {inUse: []string{"gpu-0", "gpu-2", "gpu-4", "gpu-6"}, counts: []int64{4, 2}, wantSub: "r/n2"},
		"four fits in a NUMA node":               {inUse: []string{"gpu-0"}, counts: []int64{4, 2}, wantSub: "r/n4"},
		"no choice fits aligned":                 {inUse: []string{"gpu-0", "gpu-2", "gpu-4", "gpu-6"}, counts: []int64{4, 3}, wantReject: true},
	} {
		t.Run(name, func(t *testing.T) {
			s := noClique()
			state := allocated(gpuDriver, "node-a", tc.inUse...)
			a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: s, CELCache: newCELCache(), Policy: DefaultPolicy()})
			if err != nil {
				t.Fatal(err)
			}
			res, err := a.Allocate(ctx, node("node-a"), []*resourceapi.ResourceClaim{requireClaim(tc.counts...)})
			if err != nil {
				t.Fatal(err)
			}
			if !expectRequire(t, res, tc.wantReject) {
				return
			}
			var subs []string
			for _, r := range res.Allocations[0].Devices.Results {
				if !slices.Contains(subs, r.Request) {
					subs = append(subs, r.Request)
				}
			}
			if !res.Quality.Aligned || !slices.Equal(subs, []string{tc.wantSub}) {
				t.Errorf("got %v as %v (aligned %v), want subrequest %s, aligned", deviceNames(res.Allocations), subs, res.Quality.Aligned, tc.wantSub)
			}
		})
	}
}

// TestSharesKeepADeviceInUse: a device whose slice no longer lets it be
// shared while shares of it are still allocated is not handed out whole
// beside them (upstream would: this is stricter on purpose); the other
// device is.
func TestSharesKeepADeviceInUse(t *testing.T) {
	ctx := quietContext(t)
	s := plainGPUs("node-a", 2)
	state := allocated(gpuDriver, "node-a")
	share := types.UID("share-1")
	state.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(structured.MakeDeviceID(gpuDriver, "node-a", "gpu-0"), &share))
	for count, want := range map[int64][]string{1: {"gpu-1"}, 2: nil} {
		c := claim("c").request("gpu", "gpu", count).obj()
		a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: s, CELCache: newCELCache(), Policy: DefaultPolicy()})
		if err != nil {
			t.Fatal(err)
		}
		res, err := a.Allocate(ctx, node("node-a"), []*resourceapi.ResourceClaim{c})
		if err != nil {
			t.Fatal(err)
		}
		if got := deviceNames(res.Allocations); !slices.Equal(got, want) {
			t.Errorf("%d GPUs: got %v, want %v", count, got, want)
		}
	}
}

// TestQualityRoom: the room a placement leaves is measured by the free
// blocks it breaks: none (room 1) for a GPU beside a used one, a whole
// node (BreaksNode) for the first GPU of an empty DGX, a free NUMA node
// (less room, but not the node) for four GPUs beside a used NUMA node.
func TestQualityRoom(t *testing.T) {
	ctx := quietContext(t)
	room := func(inUse []string, count int64) Quality {
		t.Helper()
		state := allocated(gpuDriver, "node-a", inUse...)
		a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: dgx("node-a"), CELCache: newCELCache(), Policy: DefaultPolicy()})
		if err != nil {
			t.Fatal(err)
		}
		res, err := a.Allocate(ctx, node("node-a"), []*resourceapi.ResourceClaim{claim("c").request("gpu", "gpu", count).obj()})
		if err != nil || res.Allocations == nil {
			t.Fatalf("allocate %d: %v, %v", count, err, res)
		}
		return res.Quality
	}
	beside := room([]string{"gpu-0"}, 1)
	if beside.Room != 1 || beside.BreaksNode {
		t.Errorf("a GPU beside a used one: room %v, breaks node %v; want 1, false", beside.Room, beside.BreaksNode)
	}
	first := room(nil, 1)
	if first.Room >= 1 || !first.BreaksNode {
		t.Errorf("the first GPU of an empty node: room %v, breaks node %v; want below 1, true", first.Room, first.BreaksNode)
	}
	numa := room([]string{"gpu-0"}, 4)
	if numa.Room >= 1 || numa.BreaksNode || numa.Room <= first.Room {
		t.Errorf("four GPUs in the free NUMA node of a used node: room %v, breaks node %v; want below 1, above breaking a node (%v), false", numa.Room, numa.BreaksNode, first.Room)
	}
}

// TestNoSubrequestFitsNamesEach: a prioritized list none of whose
// subrequests fits is explained by all of them, not only the first: the
// pod would run with any.
func TestNoSubrequestFitsNamesEach(t *testing.T) {
	ctx := quietContext(t)
	c := claim("c").obj()
	r := resourceapi.DeviceRequest{Name: "gpus"}
	for _, n := range []int64{8, 4} {
		r.FirstAvailable = append(r.FirstAvailable, resourceapi.DeviceSubRequest{
			Name: fmt.Sprintf("n%d", n), DeviceClassName: "gpu", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: n,
		})
	}
	c.Spec.Devices.Requests = []resourceapi.DeviceRequest{r}
	state := allocated(gpuDriver, "node-a", "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4")
	a, err := New(ctx, Options{Features: allFeatures, AllocatedState: state, ClassLister: defaultClasses, Slices: dgx("node-a"), CELCache: newCELCache(), Policy: DefaultPolicy()})
	if err != nil {
		t.Fatal(err)
	}
	res, err := a.Allocate(ctx, node("node-a"), []*resourceapi.ResourceClaim{c})
	if err != nil {
		t.Fatal(err)
	}
	want := "claim c request gpus: no subrequest fits (n8: only 3 free devices match (needs 8); n4: only 3 free devices match (needs 4))"
	if res.Allocations != nil || res.Explanation.String() != want {
		t.Errorf("got %v, explanation %q; want none, %q", deviceNames(res.Allocations), res.Explanation.String(), want)
	}
}

// TestSpreadingIgnoresWeights: when spreading, the emptier placement of one
// rank scores higher whatever the weights, PackingWeight 0 included.
func TestSpreadingIgnoresWeights(t *testing.T) {
	empty := Quality{Shared: 2, Room: 0, Packing: 0.1, Settled: 0}
	full := Quality{Shared: 2, Room: 1, Packing: 0.9, Settled: 1}
	for _, w := range []struct{ room, packing, age float64 }{{70, 30, 30}, {70, 0, 0}, {70, 0, 30}, {0, 1, 0}, {0, 0, 0}} {
		p := DefaultPolicy()
		p.Packing = false
		p.RoomWeight, p.PackingWeight, p.AgeWeight = w.room, w.packing, w.age
		if p.Score(empty) <= p.Score(full) {
			t.Errorf("weights %+v: the emptier placement scores %d, not above %d", w, p.Score(empty), p.Score(full))
		}
		ref := DefaultPolicy()
		ref.Packing = false
		for _, q := range []Quality{empty, full} {
			if p.Score(q) != ref.Score(q) {
				t.Errorf("weights %+v: score %d, want %d as with the default weights", w, p.Score(q), ref.Score(q))
			}
		}
	}
}

// TestOneDevicePodKeepsItsFirstChoice: a pod of one-device claims, one of
// which asks firstAvailable for a large GPU, then any GPU. The best-fit
// order puts the free large GPU first (its PCIe root is the fuller one),
// so first-fit over it gives that GPU to the claim that asks for any GPU
// and the other claim its second choice; the pod must get its first
// choice where upstream gives it, as it does for every other pod.
func TestOneDevicePodKeepsItsFirstChoice(t *testing.T) {
	ctx := quietContext(t)
	gpu := func(name, root string, gb int64) resourceapi.Device {
		d := device(name, attrs{topology.AttrPCIeRoot: str(root), topology.AttrNUMANode: num(0)})
		d.Capacity = map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"memory": {Value: *resource.NewQuantity(gb<<30, resource.BinarySI)}}
		return d
	}
	s := []*resourceapi.ResourceSlice{slice("node-a", gpuDriver,
		gpu("gpu-0", "pci0000:00", 24), gpu("gpu-1", "pci0001:00", 80), gpu("gpu-2", "pci0001:00", 80), gpu("gpu-3", "pci0000:00", 24))}
	any := claim("c1").request("gpu", "gpu", 1).obj()
	prefer := claim("c2").obj()
	prefer.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "r", FirstAvailable: []resourceapi.DeviceSubRequest{
		{Name: "big", DeviceClassName: "gpu", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
			Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: `device.capacity["` + gpuDriver + `"].memory.compareTo(quantity("40Gi")) >= 0`}}}},
		{Name: "small", DeviceClassName: "gpu", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
	}}}
	claims := []*resourceapi.ResourceClaim{any, prefer}
	a, res, up := allocateBoth(ctx, t, "node-a", s, allocated(gpuDriver, "node-a", "gpu-2"), DefaultPolicy(), claims)
	if !a.simplePod(claims) {
		t.Fatal("the pod should be one the ordered strategy serves")
	}
	if res.Allocations == nil || up == nil {
		t.Fatalf("topodra %v, upstream %v", res.Explanation, deviceNames(up))
	}
	request := func(results []resourceapi.AllocationResult) string {
		return results[1].Devices.Results[0].Request
	}
	if got, want := request(res.Allocations), request(up); want != "r/big" || got != want {
		t.Errorf("claim c2 got %s on %v, upstream %s on %v; want r/big", got, deviceNames(res.Allocations), want, deviceNames(up))
	}
}

// TestOversizedSubrequestPassedOver: a firstAvailable subrequest that asks
// for more devices than an allocation can hold is passed over for the
// next one, as upstream does; a claim whose every subrequest asks for too
// many is refused, as by upstream.
func TestOversizedSubrequestPassedOver(t *testing.T) {
	ctx := quietContext(t)
	firstAvailable := firstAvailableClaim
	_, res, up := allocateBoth(ctx, t, "node-a", dgx("node-a"), nil, DefaultPolicy(), []*resourceapi.ResourceClaim{firstAvailable(33, 2)})
	if up == nil {
		t.Fatal("upstream allocated nothing")
	}
	if res.Allocations == nil || res.Allocations[0].Devices.Results[0].Request != "r/n2" || len(res.Allocations[0].Devices.Results) != 2 {
		t.Errorf("got %v, want two devices for subrequest r/n2, as upstream's %v", res.Allocations, up)
	}

	a, err := New(ctx, Options{Features: allFeatures, ClassLister: defaultClasses, Slices: dgx("node-a"), Policy: DefaultPolicy()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Allocate(ctx, node("node-a"), []*resourceapi.ResourceClaim{firstAvailable(33, 40)}); !errors.Is(err, ErrInvalidInput) || !strings.Contains(err.Error(), "exceeds the claim limit of 32") {
		t.Errorf("every subrequest over the limit: %v, want an input error naming the limit", err)
	}
}

// TestAdminAccessSetWithFeatureOff: with DRAAdminAccess off in the
// scheduler, upstream refuses a request that sets adminAccess, even to
// false (an API server with the feature on stored it); topodra answers as
// upstream does, in Filter, not with an unverified allocation that only
// Reserve would find wrong.
func TestAdminAccessSetWithFeatureOff(t *testing.T) {
	ctx := quietContext(t)
	features := allFeatures
	features.AdminAccess = false
	c := claim("c").request("r", "gpu", 1).obj()
	c.Spec.Devices.Requests[0].Exactly.AdminAccess = ptr.To(false)
	claims := []*resourceapi.ResourceClaim{c}
	state := allocated(gpuDriver, "node-a")
	up, err := structured.NewAllocator(ctx, features, *state, defaultClasses, dgx("node-a"), newCELCache())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := up.Allocate(ctx, node("node-a"), claims); err == nil {
		t.Fatal("upstream allocated a claim that sets adminAccess with the feature off")
	}
	a, err := New(ctx, Options{Features: features, AllocatedState: state, ClassLister: defaultClasses, Slices: dgx("node-a"), CELCache: newCELCache(), Policy: DefaultPolicy()})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := a.Allocate(ctx, node("node-a"), claims); err == nil && res.Allocations != nil {
		t.Errorf("allocated %v (unverified %v), want no allocation, as upstream", deviceNames(res.Allocations), res.Unverified)
	}
}

// firstAvailableClaim is claim "c" with request "r", whose firstAvailable
// subrequests "n<count>" ask for counts GPUs of class gpu, in that order.
func firstAvailableClaim(counts ...int64) *resourceapi.ResourceClaim {
	c := claim("c").obj()
	r := resourceapi.DeviceRequest{Name: "r"}
	for _, n := range counts {
		r.FirstAvailable = append(r.FirstAvailable, resourceapi.DeviceSubRequest{
			Name: fmt.Sprintf("n%d", n), DeviceClassName: "gpu", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: n,
		})
	}
	c.Spec.Devices.Requests = []resourceapi.DeviceRequest{r}
	return c
}

// TestRequireHoldsForClaimsLeftToUpstream: a claim with alignment=require
// whose request takes all matching devices, which the planning leaves to
// upstream as it is, gets a node only where those devices share a domain;
// under a policy without topology attributes, require is an input error.
func TestRequireHoldsForClaimsLeftToUpstream(t *testing.T) {
	ctx := quietContext(t)
	allOf := func(name string) *resourceapi.ResourceClaim {
		c := claim(name).request("gpus", "gpu", 0).annotate(topology.AnnotationAlignment, "require").obj()
		c.Spec.Devices.Requests[0].Exactly.AllocationMode = resourceapi.DeviceAllocationModeAll
		return c
	}
	for name, tc := range map[string]struct {
		slices     []*resourceapi.ResourceSlice
		claims     []*resourceapi.ResourceClaim
		wantReject bool
	}{
		"all GPUs of a PCIe box share no domain":     {slices: pcieBox("n"), claims: []*resourceapi.ResourceClaim{allOf("c")}, wantReject: true},
		"all GPUs of a DGX share its NVLink clique":  {slices: dgx("n"), claims: []*resourceapi.ResourceClaim{allOf("c")}},
		"prefer takes all GPUs of a PCIe box anyway": {slices: pcieBox("n"), claims: []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", 0).obj()}},
	} {
		t.Run(name, func(t *testing.T) {
			for _, c := range tc.claims {
				if r := c.Spec.Devices.Requests[0].Exactly; r.Count == 0 {
					r.AllocationMode = resourceapi.DeviceAllocationModeAll
				}
			}
			a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "n"), ClassLister: defaultClasses, Slices: tc.slices, CELCache: newCELCache(), Policy: DefaultPolicy()})
			if err != nil {
				t.Fatal(err)
			}
			res, err := a.Allocate(ctx, node("n"), tc.claims)
			if err != nil {
				t.Fatal(err)
			}
			if !expectRequire(t, res, tc.wantReject) {
				return
			}
			if got := len(res.Allocations[0].Devices.Results); got != 8 {
				t.Errorf("%d devices allocated, want all 8", got)
			}
		})
	}
	t.Run("no topology attributes", func(t *testing.T) {
		policy := DefaultPolicy()
		policy.Attributes = []resourceapi.QualifiedName{}
		a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "n"), ClassLister: defaultClasses, Slices: dgx("n"), CELCache: newCELCache(), Policy: policy})
		if err != nil {
			t.Fatal(err)
		}
		_, err = a.Allocate(ctx, node("n"), []*resourceapi.ResourceClaim{claim("c").request("gpus", "gpu", 2).annotate(topology.AnnotationAlignment, "require").obj()})
		var inputErr *InputError
		if !errors.As(err, &inputErr) || !strings.Contains(err.Error(), "topologyAttributes") {
			t.Errorf("got %v, want an input error that names topologyAttributes", err)
		}
	})
}

// TestNodeAllocatableDeviceRefused: a device that maps node allocatable
// resources (DRANodeAllocatableResources) is never allocated, since its
// accounting is the stock plugin's: the node is rejected with a message
// that says so, while a node whose devices map nothing serves the claim.
func TestNodeAllocatableDeviceRefused(t *testing.T) {
	ctx := quietContext(t)
	mapped := dgx("n")
	for i := range mapped[0].Spec.Devices {
		mapped[0].Spec.Devices[i].NodeAllocatableResources = map[v1.ResourceName]resourceapi.NodeAllocatableResource{
			v1.ResourceMemory: {Overhead: &resourceapi.NodeAllocatableOverhead{PerPod: ptr.To(resource.MustParse("1Gi"))}},
		}
	}
	for name, tc := range map[string]struct {
		slices     []*resourceapi.ResourceSlice
		wantReject bool
	}{
		"mapped":    {slices: mapped, wantReject: true},
		"plain DGX": {slices: dgx("n")},
	} {
		t.Run(name, func(t *testing.T) {
			a, err := New(ctx, Options{Features: allFeatures, AllocatedState: allocated(gpuDriver, "n"), ClassLister: defaultClasses, Slices: tc.slices, CELCache: newCELCache(), Policy: DefaultPolicy()})
			if err != nil {
				t.Fatal(err)
			}
			for _, claims := range [][]*resourceapi.ResourceClaim{
				{claim("one").request("gpus", "gpu", 1).obj()},
				{claim("four").request("gpus", "gpu", 4).obj()},
			} {
				res, err := a.Allocate(ctx, node("n"), claims)
				if err != nil {
					t.Fatal(err)
				}
				if got := res.Allocations != nil; got == tc.wantReject {
					t.Errorf("claim %s: allocated %v (%v)", claims[0].Name, deviceNames(res.Allocations), res.Explanation)
				}
				if tc.wantReject && !strings.Contains(res.Explanation.String(), "maps node allocatable resources") {
					t.Errorf("claim %s: explanation %q, want it to name the node allocatable mapping", claims[0].Name, res.Explanation)
				}
			}
		})
	}
}

// expectRequire checks a Result for alignment=require: with wantReject,
// that the node is rejected for it; else that there is an allocation. It
// reports whether the caller should look at the allocation.
func expectRequire(t *testing.T, res *Result, wantReject bool) bool {
	t.Helper()
	if wantReject {
		if res.Allocations != nil || res.Explanation == nil || !strings.Contains(res.Explanation.String(), "alignment=require") {
			t.Errorf("got %v (%v), want the node rejected for alignment=require", deviceNames(res.Allocations), res.Explanation)
		}
		return false
	}
	if res.Allocations == nil {
		t.Fatalf("no allocation: %v", res.Explanation)
	}
	return true
}
