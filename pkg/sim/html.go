package sim

import (
	"bufio"
	"fmt"
	"html"
	"io"
	"math"
	"slices"
	"strings"
)

// WriteHTML writes the report as one self-contained HTML page (inline CSS
// and SVG, nothing fetched): the side-by-side table, the per-node free
// capacity at the end, and for each scheduler a map of every node's GPUs at
// the end and at each checkpoint, and per scheduler a plot of the run over
// time (see writeTimelines). A map groups GPUs by NUMA node and PCIe
// root, colors them by pod and draws NVLink cliques as bars under their
// members. Each map is an <svg class="node-map"> with data-scheduler,
// data-node and data-snapshot ("end" or "tick N") attributes.
func (r *Report) WriteHTML(out io.Writer) error {
	w := bufio.NewWriter(out)
	e := html.EscapeString
	p := func(format string, args ...any) { fmt.Fprintf(w, format, args...) }

	p("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n")
	p("<title>topodra-sim report</title>\n<style>%s</style>\n</head>\n<body>\n", css)
	p("<h1>topodra-sim</h1>\n<p class=\"meta\">%s &middot; %d pods over %d ticks &middot; %d nodes (%s) &middot; %.1f s</p>\n",
		e(r.Description()), r.Pods, r.Ticks, len(r.Nodes), e(r.Profile), r.WallSeconds)
	if s := r.Summary(); s != "" {
		p("<p class=\"summary\">%s</p>\n", e(s))
	}

	// The table.
	p("<h2>Side by side</h2>\n<table class=\"results\">\n<thead><tr><th></th>")
	for _, res := range r.Results {
		p("<th>%s</th>", e(res.Scheduler))
	}
	p("</tr></thead>\n<tbody>\n")
	for _, row := range resultRows(r.Results) {
		class := ""
		if row.sub {
			class = " class=\"sub\""
		}
		p("<tr%s><th>%s</th>", class, e(row.label))
		for _, res := range r.Results {
			p("<td>%s</td>", e(row.cell(res)))
		}
		p("</tr>\n")
	}
	p("</tbody>\n</table>\n")
	p("<p class=\"note\">Alignment: allocations inside one domain / allocations for which such a domain with enough free devices existed, at the moment the allocation was written, on a node the pod could use; &ldquo;aligned, where a placement there could miss&rdquo; leaves out the allocations on a node where every GPU (for GPU+NIC pairs every GPU and NIC) is in one domain of the level, aligned whatever the scheduler does. Attempt latency: the scheduler's scheduling_attempt_duration_seconds histogram (algorithm + binding), successful attempts. Create→bind: from the pod's creation to its binding being seen, for pods bound on arrival. Throughput: those pods per second of waiting for them.</p>\n")

	// What the run noticed beyond the numbers, and inconsistencies (a
	// run with any exits 1).
	var notes []string
	for _, res := range r.Results {
		for _, n := range res.Notes {
			notes = append(notes, res.Scheduler+": "+n)
		}
		for _, n := range res.Errors {
			notes = append(notes, res.Scheduler+": inconsistency: "+n)
		}
	}
	if len(notes) > 0 {
		p("<h2>Notes</h2>\n<ul>\n")
		for _, n := range notes {
			p("<li>%s</li>\n", e(n))
		}
		p("</ul>\n")
	}

	writeWaitCauses(p, e, r)
	writeRunTargets(p, e, r)

	writeTimelines(w, r)

	// Per node at the end.
	p("<h2>Free capacity at the end</h2>\n<table class=\"results\">\n<thead><tr><th>node</th><th>profile</th>")
	for _, res := range r.Results {
		p("<th>%s</th>", e(res.Scheduler))
	}
	p("</tr></thead>\n<tbody>\n")
	for i, n := range r.Nodes {
		p("<tr><th>%s</th><td>%s</td>", e(n.Node), e(n.Profile))
		for _, res := range r.Results {
			if i < len(res.Nodes) {
				ne := res.Nodes[i]
				unhealthy := ""
				if ne.Unhealthy > 0 {
					unhealthy = fmt.Sprintf(" &middot; %d unhealthy", ne.Unhealthy)
				}
				p("<td>%d free &middot; block %d &middot; 8-GPU %d &middot; 4-GPU %d%s</td>", ne.FreeGPUs, ne.LargestBlock, ne.Fit8, ne.Fit4, unhealthy)
			} else {
				p("<td></td>")
			}
		}
		p("</tr>\n")
	}
	p("</tbody>\n</table>\n")
	p("<p class=\"note\">block: most free GPUs sharing one NUMA node and NVLink clique; 4-GPU: jobs that fit inside one NUMA node; unhealthy: GPUs tainted by a fault, free or not, which count as free nowhere.</p>\n")

	// Maps: the end first, then the checkpoints, schedulers side by side.
	labels := []string{}
	for _, res := range r.Results {
		for _, s := range res.Snapshots {
			if !slices.Contains(labels, s.Label) {
				labels = append(labels, s.Label)
			}
		}
	}
	if i := slices.Index(labels, "end"); i > 0 {
		labels = append([]string{"end"}, slices.Delete(labels, i, i+1)...)
	}
	colors := podColors(r)
	p("<h2>GPU maps</h2>\n<p class=\"note\">Each box is a node: NUMA nodes (outer), PCIe roots (inner), GPUs (squares, colored by pod; gray dashed = free; a red frame: unhealthy, tainted by a GPU fault) and NICs (small, after a root's GPUs). Colored bars under GPUs join the members of an NVLink clique (a DGX H100 is one clique of 8 through NVSwitch; the PCIe machine has bridged pairs). Hover a device for its pod.</p>\n")
	for _, label := range labels {
		title := "at the end"
		if label != "end" {
			title = "at " + label
		}
		p("<section class=\"snapshot\" data-snapshot=\"%s\">\n<h3>%s</h3>\n<div class=\"columns\">\n", e(label), e(title))
		for _, res := range r.Results {
			var snap *Snapshot
			for i := range res.Snapshots {
				if res.Snapshots[i].Label == label {
					snap = &res.Snapshots[i]
				}
			}
			p("<div class=\"column\"><h4>%s</h4>\n", e(res.Scheduler))
			if snap != nil {
				for _, n := range r.Nodes {
					p("<div class=\"node\"><div class=\"node-title\">%s <span>%s</span></div>\n", e(n.Node), e(n.Profile))
					writeNodeSVG(w, res.Scheduler, label, n, snap.Used, snap.Unhealthy, colors)
					p("</div>\n")
				}
			}
			p("</div>\n")
		}
		p("</div>\n</section>\n")
	}
	p("</body>\n</html>\n")
	return w.Flush()
}

// timelineSeries are the lines of a timeline plot: label, color, value.
var timelineSeries = []struct {
	label, color string
	value        func(TickPoint) int
}{
	{"pods waiting", "#d1495b", func(p TickPoint) int { return p.Waiting }},
	{"whole free nodes", "#00798c", func(p TickPoint) int { return p.FreeNodes }},
	{"whole free NUMA nodes", "#edae49", func(p TickPoint) int { return p.FreeNUMA }},
}

// writeTimelines writes, per scheduler, an <svg class="timeline"
// data-scheduler="..."> that plots each tick's pods waiting, whole free
// nodes and whole free NUMA nodes (Result.Timeline), all schedulers on one
// scale, and a note that one run is not a verdict. Nothing when no result
// has a timeline.
func writeTimelines(w io.Writer, r *Report) {
	e := html.EscapeString
	ticks, top := 0, 1
	for _, res := range r.Results {
		for _, pt := range res.Timeline {
			ticks = max(ticks, pt.Tick+1)
			for _, s := range timelineSeries {
				top = max(top, s.value(pt))
			}
		}
	}
	if ticks == 0 {
		return
	}
	const width, height, left, bottom, pad = 520.0, 200.0, 34.0, 22.0, 8.0
	x := func(tick int) float64 { return left + (width-left-pad)*float64(tick)/float64(max(1, ticks-1)) }
	y := func(v int) float64 { return pad + (height-bottom-pad)*(1-float64(v)/float64(top)) }
	fmt.Fprintf(w, "<h2>Over time</h2>\n<p class=\"note\">At the end of each tick: pods waiting (created, not bound), whole free nodes and whole free NUMA nodes (4 free GPUs). Fragmentation shows as free nodes and NUMA nodes that vanish while pods wait. Runs vary with timing: which of a tick's pods are in the scheduling queue together and in which order they are scheduled, how far the scheduler's informers lag behind the bindings and releases, the order in which bindings land and, between nodes of equal score, the order in which the parallel Filter calls finish (kube-scheduler does not shuffle equal scores). That changes one run's outcome: the same seed has given the stock scheduler twice the pod-ticks of another run. Judge over many seeds: <code>make placement</code> (<code>--seeds 1-8</code>) is the verdict, not one run.</p>\n<div class=\"columns\">\n")
	for _, res := range r.Results {
		fmt.Fprintf(w, "<div class=\"column\"><h4>%s</h4>\n", e(res.Scheduler))
		fmt.Fprintf(w, "<svg class=\"timeline\" data-scheduler=\"%s\" xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\">\n", e(res.Scheduler), width, height+18, width, height+18)
		fmt.Fprintf(w, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"white\" stroke=\"#d8dde5\"/>\n", left, pad, width-left-pad, height-bottom-pad)
		for _, v := range []int{0, top / 2, top} {
			fmt.Fprintf(w, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\" text-anchor=\"end\">%d</text>\n", left-4, y(v)+3, v)
		}
		for _, t := range []int{0, (ticks - 1) / 2} {
			fmt.Fprintf(w, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\" text-anchor=\"middle\">%d</text>\n", x(t), height-bottom+14, t)
		}
		fmt.Fprintf(w, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\" text-anchor=\"end\">tick %d</text>\n", width-pad, height-bottom+14, ticks-1)
		for i, s := range timelineSeries {
			var pts []string
			for _, pt := range res.Timeline {
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(pt.Tick), y(s.value(pt))))
			}
			fmt.Fprintf(w, "<polyline data-series=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.8\" points=\"%s\"/>\n", e(s.label), s.color, strings.Join(pts, " "))
			lx := left + float64(i)*160
			fmt.Fprintf(w, "<rect x=\"%.1f\" y=\"%.1f\" width=\"12\" height=\"4\" fill=\"%s\"/><text x=\"%.1f\" y=\"%.1f\" font-size=\"11\">%s</text>\n", lx, height+8, s.color, lx+16, height+13, e(s.label))
		}
		fmt.Fprintf(w, "</svg>\n</div>\n")
	}
	fmt.Fprintf(w, "</div>\n")
}

const css = `
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #1d2430; background: #fafbfc; }
h1 { margin: 0 0 4px; } h2 { margin-top: 28px; } h3 { margin: 18px 0 6px; } h4 { margin: 6px 0; font-size: 16px; }
.meta, .note { color: #5b6575; font-size: 13px; }
.summary { font-weight: 600; }
table.results { border-collapse: collapse; font-size: 14px; background: white; }
table.results th, table.results td { border: 1px solid #d8dde5; padding: 4px 10px; text-align: left; }
table.results thead th { background: #eef1f5; }
table.results tr.sub th { font-weight: normal; padding-left: 24px; }
.columns { display: flex; gap: 24px; align-items: flex-start; }
.column { flex: 1; min-width: 0; }
.node { display: inline-block; vertical-align: top; margin: 0 6px 6px 0; background: white; border: 1px solid #d8dde5; border-radius: 6px; padding: 6px; }
.node-title { font-size: 12px; font-weight: 600; margin-bottom: 2px; }
.node-title span { font-weight: normal; color: #5b6575; }
svg.node-map text, svg.timeline text { font-family: system-ui, sans-serif; }
`

// Geometry of a node map.
const (
	gpuSize   float64 = 26
	nicW      float64 = 10
	devGap    float64 = 4
	rootPad   float64 = 4
	rootLabel float64 = 11
	numaPad   float64 = 5
	numaLabel float64 = 13
	cliqueGap float64 = 8
)

func writeNodeSVG(w io.Writer, scheduler, snapshot string, n NodeTopology, used, unhealthy map[string]string, colors map[string]string) {
	e := html.EscapeString
	// Group: NUMA -> root -> devices, in first-seen order (devices are
	// sorted GPUs first by index, then NICs).
	type rootGroup struct {
		root string
		devs []DeviceInfo
	}
	type numaGroup struct {
		numa  string
		roots []*rootGroup
	}
	var numas []*numaGroup
	for _, d := range n.Devices {
		var ng *numaGroup
		for _, g := range numas {
			if g.numa == d.NUMA {
				ng = g
			}
		}
		if ng == nil {
			ng = &numaGroup{numa: d.NUMA}
			numas = append(numas, ng)
		}
		var rg *rootGroup
		for _, g := range ng.roots {
			if g.root == d.Root {
				rg = g
			}
		}
		if rg == nil {
			rg = &rootGroup{root: d.Root}
			ng.roots = append(ng.roots, rg)
		}
		rg.devs = append(rg.devs, d)
	}
	slices.SortStableFunc(numas, func(a, b *numaGroup) int { return strings.Compare(a.numa, b.numa) })

	var body strings.Builder
	b := func(format string, args ...any) { fmt.Fprintf(&body, format, args...) }
	centers := map[string]float64{} // GPU key -> x center
	x := 0.0
	top := 0.0
	devTop := top + numaLabel + numaPad + rootLabel + rootPad
	height := devTop + gpuSize + rootPad + numaPad
	for _, ng := range numas {
		nx := x
		x += numaPad
		for _, rg := range ng.roots {
			rx := x
			x += rootPad
			for _, d := range rg.devs {
				wdt := gpuSize
				if !d.GPU {
					wdt = nicW
				}
				pod, busy := used[d.Key]
				fill, stroke, attrs := "#eceff3", "#9aa3af", " stroke-dasharray=\"3,2\""
				if busy {
					fill, stroke, attrs = colors[pod], "#2d3440", ""
				}
				tip := d.Name + ": free"
				if busy {
					tip = d.Name + ": " + pod
				}
				if taint, ok := unhealthy[d.Key]; ok {
					// Unhealthy: a red frame, used or not.
					stroke, attrs = "#c0392b", " stroke-width=\"2.5\""
					tip += ", unhealthy (" + taint + ")"
				}
				b("<g class=\"device\" data-device=\"%s\" data-pod=\"%s\"><title>%s</title>", e(d.Name), e(pod), e(tip))
				b("<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" rx=\"3\" fill=\"%s\" stroke=\"%s\"%s/>", x, devTop, wdt, gpuSize, fill, stroke, attrs)
				if d.GPU {
					b("<text x=\"%.0f\" y=\"%.0f\" font-size=\"9\" text-anchor=\"middle\" fill=\"#1d2430\">%s</text>", x+wdt/2, devTop+10, e(strings.TrimPrefix(d.Name, "gpu-")))
					if busy {
						b("<text x=\"%.0f\" y=\"%.0f\" font-size=\"6.5\" text-anchor=\"middle\" fill=\"#1d2430\">%s</text>", x+wdt/2, devTop+21, e(shortPod(pod)))
					}
					centers[d.Key] = x + wdt/2
				} else {
					b("<text x=\"%.0f\" y=\"%.0f\" font-size=\"6\" text-anchor=\"middle\" fill=\"#1d2430\" transform=\"rotate(-90 %.0f %.0f)\">NIC</text>", x+wdt/2, devTop+gpuSize/2+3, x+wdt/2, devTop+gpuSize/2)
				}
				b("</g>")
				x += wdt + devGap
			}
			x += rootPad - devGap
			rootName := rg.root
			if rootName == "" {
				rootName = "no PCIe root"
			}
			b("<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" rx=\"3\" fill=\"none\" stroke=\"#8fa3bf\"/>", rx, devTop-rootPad-rootLabel, x-rx, rootLabel+2*rootPad+gpuSize)
			b("<text x=\"%.0f\" y=\"%.0f\" font-size=\"8\" fill=\"#5b6575\">%s</text>", rx+3, devTop-rootPad-2, e(strings.TrimPrefix(rootName, "pci0000:")))
			x += devGap
		}
		x += numaPad - devGap
		numaName := "NUMA " + ng.numa
		if ng.numa == "" {
			numaName = "no NUMA"
		}
		b("<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" rx=\"5\" fill=\"none\" stroke=\"#4a5568\" stroke-width=\"1.5\"/>", nx, top, x-nx, height-top)
		b("<text x=\"%.0f\" y=\"%.0f\" font-size=\"10\" font-weight=\"600\" fill=\"#2d3440\">%s</text>", nx+4, top+11, e(numaName))
		x += 6
	}
	width := x - 6

	// NVLink cliques: a bar under the members of each clique with two or
	// more GPUs.
	cliques := map[string][]float64{}
	var order []string
	for _, d := range n.Devices {
		if d.GPU && d.Clique != "" {
			if _, ok := cliques[d.Clique]; !ok {
				order = append(order, d.Clique)
			}
			cliques[d.Clique] = append(cliques[d.Clique], centers[d.Key])
		}
	}
	y := height + cliqueGap
	lanes := 0
	for i, c := range order {
		xs := cliques[c]
		if len(xs) < 2 {
			continue
		}
		slices.Sort(xs)
		lane := 0
		// Overlapping cliques (not expected) get their own lane.
		for j := range i {
			other := cliques[order[j]]
			if len(other) >= 2 && other[0] <= xs[len(xs)-1] && xs[0] <= other[len(other)-1] {
				lane++
			}
		}
		lanes = max(lanes, lane+1)
		ly := y + float64(lane)*8
		color := cliqueColors[i%len(cliqueColors)]
		b("<g class=\"nvlink\" data-clique=\"%s\"><title>NVLink clique %s (%d GPUs)</title>", e(c), e(c), len(xs))
		b("<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"%s\" stroke-width=\"3\" stroke-linecap=\"round\"/>", xs[0], ly, xs[len(xs)-1], ly, color)
		for _, cx := range xs {
			b("<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"%s\" stroke-width=\"2\"/>", cx, devTop+gpuSize, cx, ly, color)
		}
		b("</g>")
	}
	total := height
	if lanes > 0 {
		total = y + float64(lanes-1)*8 + 4
	}
	fmt.Fprintf(w, "<svg class=\"node-map\" data-scheduler=\"%s\" data-node=\"%s\" data-snapshot=\"%s\" xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\">",
		e(scheduler), e(n.Node), e(snapshot), width+1, total+1, width+1, total+1)
	io.WriteString(w, body.String())
	io.WriteString(w, "</svg>\n")
}

var cliqueColors = []string{"#7b3fe4", "#0f9d8a", "#d9480f", "#1c7ed6", "#c2255c", "#5c940d"}

// podColors gives every pod of the report a color, the same in every map:
// pods in name order walk the hue circle by the golden angle, so pods near
// each other in the workload get clearly different colors.
func podColors(r *Report) map[string]string {
	var pods []string
	seen := map[string]bool{}
	for _, res := range r.Results {
		for _, s := range res.Snapshots {
			for _, pod := range s.Used {
				if !seen[pod] {
					seen[pod] = true
					pods = append(pods, pod)
				}
			}
		}
	}
	slices.Sort(pods)
	colors := map[string]string{}
	for i, pod := range pods {
		hue := math.Mod(float64(i)*137.508, 360)
		light := 68 + (i%3)*6
		colors[pod] = fmt.Sprintf("hsl(%.0f,65%%,%d%%)", hue, light)
	}
	return colors
}

// shortPod shortens "train-2g-012" to "2g-012" to fit a GPU box.
func shortPod(pod string) string {
	if i := strings.IndexByte(pod, '-'); i >= 0 && len(pod) > 7 {
		pod = pod[i+1:]
	}
	if len(pod) > 7 {
		pod = pod[len(pod)-7:]
	}
	return pod
}

// writeWaitCauses adds the table of the pods that waited, by size and
// cause (Result.WaitedBy), one column per scheduler.
func writeWaitCauses(p func(string, ...any), e func(string) string, r *Report) {
	all := WaitedBy{}
	for _, res := range r.Results {
		for size, causes := range res.WaitedBy {
			for cause, n := range causes {
				all.Add(size, cause, n)
			}
		}
	}
	p("<h2>Why pods waited</h2>\n<table class=\"results\">\n<thead><tr><th>pod asks for</th>")
	for _, res := range r.Results {
		p("<th>%s</th>", e(res.Scheduler))
	}
	p("</tr></thead>\n<tbody>\n")
	if len(all) == 0 {
		p("<tr><th>every pod</th>")
		for range r.Results {
			p("<td>bound in the tick it arrived in</td>")
		}
		p("</tr>\n")
	}
	for _, size := range all.Sizes() {
		p("<tr><th>%s</th>", e(size))
		for _, res := range r.Results {
			p("<td>%s</td>", e(res.WaitedBy.Line(size, nil)))
		}
		p("</tr>\n")
	}
	p("</tbody>\n</table>\n")
	p("<p class=\"note\">Pods not bound in the tick they arrived in, by what the cluster lacked right after that tick's pods were scheduled: no GPU free, fewer GPUs free than the pod asks, enough only scattered over nodes, no node (or PCIe root, for a pod whose claim matches pcieRoot) with its GPUs and NICs, GPUs kept free by topodra's headroom for smaller pods, or room by count that the pod could not use (alignment, a constraint, or pods of the same tick scheduled before it).</p>\n")
}

// writeRunTargets writes the placement targets of this one run
// (Report.RunTargets); nothing without both schedulers.
func writeRunTargets(p func(string, ...any), e func(string) string, r *Report) {
	run := r.RunTargets()
	if len(run) == 0 {
		return
	}
	p("<h2>Placement targets in this run alone</h2>\n<table class=\"results\">\n<thead><tr><th>target</th><th>want</th><th>topodra</th><th>stock</th><th>met</th><th>behind it, topodra vs stock</th></tr></thead>\n<tbody>\n")
	for _, t := range run {
		p("<tr><th>%s</th><td>%s</td><td>%s</td><td>%s</td><td>%s</td><td>%s</td></tr>\n", e(runTargetName(t)), e(t.Want), e(t.Topodra), e(t.Stock), verdict(t), e(r.runTargetBasis(t)))
	}
	p("</tbody>\n</table>\n")
	p("<p class=\"note\">%d of %d met in this run%s. The targets are checked on medians over many runs; here each median is this run's value. Runs vary, and where the small pods' waits are near zero one pod waiting one tick decides a target: the verdict is the multi-seed sweep (<code>make placement</code>, <code>--seeds 1-8</code>).</p>\n", metCount(run), applicableCount(run), e(naNote(run, " (", ")")))
}
