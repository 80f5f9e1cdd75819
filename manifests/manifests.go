// Package manifests embeds the deployment manifests of this directory so
// that tests apply exactly the files an admin applies. The package's tests
// render the kustomize overlays the way `kubectl apply -k` does; rendering
// lives there, not here, because kustomize links Go's plugin package, which
// makes a binary bind all symbols at load time, and go-nvml's cgo bindings,
// linked into the same test binaries, rely on lazy binding.
package manifests

import "embed"

// FS holds base/*.yaml, overlays/*/*.yaml, components/*/*.yaml and
// examples/*.yaml.
//
//go:embed base/*.yaml overlays/*/*.yaml components/*/*.yaml examples/*.yaml
var FS embed.FS

// Overlays are the install variants, each a directory overlays/<name>.
var Overlays = []string{"host", "gpu-operator", "gpu-operator-host-driver", "mock"}

// Optional are the components, each a directory components/<name>, that
// an admin may add to any overlay in a kustomization of their own: they
// add objects and change none of the overlay's.
var Optional = []string{"invariant-check", "monitoring"}
