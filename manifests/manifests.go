// Package manifests embeds the deployment manifests of this directory so
// that tests apply exactly the files an admin applies.
package manifests

import "embed"

// FS holds *.yaml and examples/*.yaml.
//
//go:embed *.yaml examples/*.yaml
var FS embed.FS
