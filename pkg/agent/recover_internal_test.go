package agent

import (
	"testing"
	"time"

	"github.com/topodra/topodra/pkg/agent/cdi"
)

// TestOfEarlierBoot: without a checkpoint, a claim spec counts as of an
// earlier boot only where it was last written before a known boot time.
func TestOfEarlierBoot(t *testing.T) {
	boot := time.Date(2030, 1, 1, 12, 0, 0, 0, time.UTC)
	testcases := map[string]struct {
		written time.Time
		boot    time.Time
		want    bool
	}{
		"before boot":         {written: boot.Add(-time.Second), boot: boot, want: true},
		"at boot":             {written: boot, boot: boot},
		"after boot":          {written: boot.Add(time.Hour), boot: boot},
		"boot time unknown":   {written: boot.Add(-time.Hour)},
		"no time, boot known": {boot: boot, want: true},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			if got := ofEarlierBoot(cdi.SpecFile{ModTime: tc.written}, tc.boot); got != tc.want {
				t.Errorf("ofEarlierBoot(written %v, boot %v) = %v, want %v", tc.written, tc.boot, got, tc.want)
			}
		})
	}
}

// TestBootTime: where /proc/stat exists, the boot time is in the past and
// a file written now is not of an earlier boot.
func TestBootTime(t *testing.T) {
	boot := bootTime()
	if boot.IsZero() {
		t.Skipf("no btime in %s", procStatPath)
	}
	now := time.Now()
	if !boot.Before(now) || boot.Before(time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)) {
		t.Errorf("boot time %v, want between 2000 and now (%v)", boot, now)
	}
	if ofEarlierBoot(cdi.SpecFile{ModTime: now}, boot) {
		t.Errorf("a spec written now counts as of an earlier boot (boot time %v)", boot)
	}
}
