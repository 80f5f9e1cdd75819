#!/usr/bin/env bash
# Render a topodra-sim HTML report to a PNG with headless Chromium.
#
#   hack/render-report.sh REPORT.html [OUT.png] [WIDTH]
#
# Installs Debian's chromium with apt-get when no chromium is on PATH (needs
# root or sudo). Not part of `make test`. The report is self-contained, so
# Chromium runs without network access.
set -euo pipefail

report=${1:?usage: $0 REPORT.html [OUT.png] [WIDTH]}
out=${2:-${report%.html}.png}
width=${3:-1600}

[[ -f $report ]] || { echo "no such file: $report" >&2; exit 1; }

find_chromium() {
	for c in chromium chromium-browser google-chrome chrome; do
		if command -v "$c" >/dev/null 2>&1; then
			command -v "$c"
			return 0
		fi
	done
	return 1
}

if ! chrome=$(find_chromium); then
	echo "chromium not found; installing Debian's chromium with apt-get" >&2
	sudo=""
	[[ $(id -u) -eq 0 ]] || sudo=sudo
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
	chrome=$(find_chromium) || { echo "chromium still not found after install" >&2; exit 1; }
fi

# The page height: tall enough for every map. Chromium cannot size the
# screenshot to the page, so estimate from the number of node maps.
maps=$(grep -o 'class="node-map"' "$report" | wc -l)
height=${HEIGHT:-$((1000 + maps * 40))}

abs=$(cd "$(dirname "$report")" && pwd)/$(basename "$report")
out_abs=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT

"$chrome" --headless --no-sandbox --disable-gpu --hide-scrollbars \
	--user-data-dir="$profile" --no-first-run --no-default-browser-check \
	--disable-extensions --disable-background-networking \
	--window-size="${width},${height}" \
	--screenshot="$out_abs" "file://$abs" >/dev/null 2>&1 || {
	echo "chromium failed to render $report" >&2
	exit 1
}
[[ -s $out_abs ]] || { echo "no screenshot written to $out" >&2; exit 1; }
echo "$out"
