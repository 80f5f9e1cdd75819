// Package docs holds the project's documents; its test checks the links
// between them.
package docs

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode"
)

// mdLink matches an inline Markdown link's target.
var mdLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// anchor returns the fragment GitHub gives a heading: lower case, letters,
// digits, '-' and '_' kept, spaces turned into '-', everything else dropped.
func anchor(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case unicode.IsLetter(r) || unicode.IsDigit(r) || r == '-' || r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteByte('-')
		}
	}
	return b.String()
}

// anchors returns the fragments of a Markdown file's headings, outside
// code blocks, with GitHub's suffixes for repeated ones.
func anchors(text string) map[string]bool {
	found := map[string]bool{}
	seen := map[string]int{}
	inCode := false
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, "```") {
			inCode = !inCode
			continue
		}
		if inCode || !strings.HasPrefix(line, "#") {
			continue
		}
		heading := strings.TrimSpace(strings.TrimLeft(line, "#"))
		a := anchor(heading)
		if n := seen[a]; n > 0 {
			found[a+"-"+strconv.Itoa(n)] = true
		} else {
			found[a] = true
		}
		seen[a]++
	}
	return found
}

// Every relative link of the README and of the documents here names a file
// of the repository and, where it has a fragment, a heading of that file.
func TestLinks(t *testing.T) {
	files, err := filepath.Glob("*.md")
	if err != nil {
		t.Fatal(err)
	}
	files = append(files, "../README.md")
	checked := 0
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range mdLink.FindAllStringSubmatch(string(data), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path, fragment, _ := strings.Cut(target, "#")
			dest := file
			if path != "" {
				dest = filepath.Join(filepath.Dir(file), path)
			}
			content, err := os.ReadFile(dest)
			if err != nil {
				t.Errorf("%s: link %s: %v", file, target, err)
				continue
			}
			if fragment != "" && !anchors(string(content))[fragment] {
				t.Errorf("%s: link %s: %s has no heading with the anchor %q", file, target, dest, fragment)
			}
			checked++
		}
	}
	if checked < 10 {
		t.Fatalf("checked %d links, want the README's and the documents' (at least 10)", checked)
	}
}

// runbookURL matches the runbook_url annotations of the alerts.
var runbookURL = regexp.MustCompile(`runbook_url:\s*(\S+)`)

// The runbook_url of every alert the monitoring component ships names
// this repository's documents on GitHub, and a heading of the document.
func TestRunbookURLs(t *testing.T) {
	const repo = "https://github.com/topodra/topodra/blob/main/"
	data, err := os.ReadFile("../manifests/components/monitoring/prometheusrule.yaml")
	if err != nil {
		t.Fatal(err)
	}
	urls := runbookURL.FindAllStringSubmatch(string(data), -1)
	if len(urls) == 0 {
		t.Fatal("no runbook_url in the alerts")
	}
	for _, m := range urls {
		path, ok := strings.CutPrefix(m[1], repo)
		file, fragment, _ := strings.Cut(path, "#")
		if !ok || fragment == "" {
			t.Errorf("runbook_url %s: want %s<file>#<heading>", m[1], repo)
			continue
		}
		content, err := os.ReadFile(filepath.Join("..", file))
		if err != nil {
			t.Errorf("runbook_url %s: %v", m[1], err)
			continue
		}
		if !anchors(string(content))[fragment] {
			t.Errorf("runbook_url %s: %s has no heading with the anchor %q", m[1], file, fragment)
		}
	}
}

func TestAnchor(t *testing.T) {
	for heading, want := range map[string]string{
		"The node agent (`topodra-node-agent`)":                  "the-node-agent-topodra-node-agent",
		"Beside the default scheduler: topodra owns its devices": "beside-the-default-scheduler-topodra-owns-its-devices",
		"Beside NVIDIA's device plugin":                          "beside-nvidias-device-plugin",
		"Beside NVIDIA's DRA driver":                             "beside-nvidias-dra-driver",
		"`NVIDIA_VISIBLE_DEVICES` in pods":                       "nvidia_visible_devices-in-pods",
		"Rules 1-5, the final sweep":                             "rules-1-5-the-final-sweep",
	} {
		if got := anchor(heading); got != want {
			t.Errorf("anchor(%q) = %q, want %q", heading, got, want)
		}
	}
}
