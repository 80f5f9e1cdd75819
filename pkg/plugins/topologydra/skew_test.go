package topologydra

import (
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/util/version"
)

// TestSkewProblem: kube-scheduler's skew rules, an API server as new as
// the release the scheduler is built on or one minor newer, hold; an older
// API server, or one two minors newer, is named.
func TestSkewProblem(t *testing.T) {
	built := version.MustParseGeneric("v1.37.2")
	for server, want := range map[string]string{
		"v1.37.0":         "",
		"v1.38.1":         "",
		"v1.36.5":         "older than the kube-scheduler release",
		"v1.39.0":         "more than one minor release newer",
		"v1.40.0-alpha.1": "more than one minor release newer",
		"v2.0.0":          "",
	} {
		got := skewProblem(version.MustParseGeneric(server), built)
		if want == "" && got != "" || want != "" && !strings.Contains(got, want) {
			t.Errorf("API server %s, built on %s: %q, want %q", server, built, got, want)
		}
	}
	if got := skewProblem(nil, built); got != "" {
		t.Errorf("unknown API server version: %q, want none", got)
	}
}
