// Package version holds the topodra release version. Release builds set it
// with -ldflags "-X github.com/topodra/topodra/pkg/version.Version=v1.2.3".
package version

// Version is the topodra version of this binary.
var Version = "v0.1.0-dev"
