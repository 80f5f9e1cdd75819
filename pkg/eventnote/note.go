// Package eventnote holds what topodra's components share about the events
// they record.
package eventnote

import (
	"fmt"
	"strings"
)

// Limit is the longest note of an events.k8s.io/v1 Event that the API
// server accepts; client-go's recorder does not shorten a longer one, and
// the event is lost.
const Limit = 1024

// Format formats an event note and cuts it to Limit bytes, ending it in
// "..." where it was cut (never inside a UTF-8 sequence).
func Format(format string, args ...any) string {
	note := fmt.Sprintf(format, args...)
	if len(note) > Limit {
		note = strings.ToValidUTF8(note[:Limit-3], "") + "..."
	}
	return note
}
