package eventnote

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestFormat(t *testing.T) {
	if got := Format("allocated %s on node %s", "gpu-0", "node-a"); got != "allocated gpu-0 on node node-a" {
		t.Errorf("short note changed: %q", got)
	}
	exact := strings.Repeat("a", Limit)
	if got := Format("%s", exact); got != exact {
		t.Errorf("a note of exactly %d bytes was cut", Limit)
	}
	// A multi-byte rune across the cut is dropped whole.
	long := strings.Repeat("a", Limit-4) + "äöü" + strings.Repeat("b", 100)
	got := Format("%s", long)
	if len(got) > Limit || !strings.HasSuffix(got, "...") || !utf8.ValidString(got) {
		t.Errorf("long note: %d bytes, valid UTF-8 %v, ends %q", len(got), utf8.ValidString(got), got[len(got)-8:])
	}
}
