package agent

import (
	"errors"
	"strings"
	"testing"
	"time"

	"k8s.io/dynamic-resource-allocation/resourceslice"
)

// TestSyncState: the publisher's slices count as synced only after a sync
// that began once the latest resources were handed over, wrote them
// without error and had no field dropped; a failed sync of a pool that is
// no longer wanted (its slices are still there) counts too.
func TestSyncState(t *testing.T) {
	resources := func(pools ...string) *resourceslice.DriverResources {
		r := &resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{}}
		for _, p := range pools {
			r.Pools[p] = resourceslice.Pool{}
		}
		return r
	}
	// Steps: "update <pools>", "begin", "fail", "drop", "end <pool>"; what
	// synced says after each step follows it after "=".
	testcases := map[string][]string{
		"first sync":                    {"begin=false", "end node-1=true"},
		"failed sync":                   {"begin=false", "fail=false", "end node-1=false", "begin=false", "end node-1=true"},
		"resources changed, not synced": {"begin=false", "end node-1=true", "update node-1=false", "begin=false", "end node-1=true"},
		"sync began before the update":  {"begin=false", "update node-1=false", "end node-1=false", "begin=false", "end node-1=true"},
		"fields dropped":                {"begin=false", "drop=false", "end node-1=false", "begin=false", "end node-1=false", "update node-1=false", "begin=false", "end node-1=true"},
		"fields dropped again":          {"begin=false", "drop=false", "end node-1=false", "update node-1=false", "begin=false", "drop=false", "end node-1=false"},
		"old pool's slices not deleted": {"begin=false", "end node-1=true", "begin=true", "fail=true", "end old=false", "begin=false", "end old=true"},
		"another pool wanted":           {"begin=false", "end node-1=true", "update node-1 nics=false", "begin=false", "end node-1=false", "begin=false", "end nics=true"},
	}
	for name, steps := range testcases {
		t.Run(name, func(t *testing.T) {
			s := newSyncState(resources("node-1"))
			for i, step := range steps {
				op, want, _ := strings.Cut(step, "=")
				fields := strings.Fields(op)
				var got bool
				switch fields[0] {
				case "update":
					s.update(resources(fields[1:]...))
					got = s.synced()
				case "begin":
					s.begin()
					got = s.synced()
				case "fail":
					s.report(errors.New("update resource slice: refused"))
					got = s.synced()
				case "drop":
					s.report(&resourceslice.DroppedFieldsError{PoolName: "node-1"})
					got = s.synced()
				case "end":
					got = s.end(fields[1])
					if s.synced() != got {
						t.Fatalf("step %d %q: end says %v, synced %v", i, op, got, s.synced())
					}
				}
				if (want == "true") != got {
					t.Fatalf("step %d %q: synced %v, want %s (steps %q)", i, op, got, want, steps)
				}
			}
		})
	}
}

// TestPublishRetryCapped: a sync that keeps failing (the API server is
// down for half an hour) is retried at least once a minute, so that a
// taint reaches the API within a minute of the API server coming back.
func TestPublishRetryCapped(t *testing.T) {
	limiter := publishRateLimiter()
	var delay time.Duration
	for range 40 {
		delay = limiter.When("node-1")
	}
	if delay > time.Minute || delay < 30*time.Second {
		t.Errorf("retry after 40 failures in %v, want between 30 s and a minute", delay)
	}
}
