package bench

import (
	"encoding/json"
	"encoding/xml"
	"fmt"
	"io"
	"math"
	"sort"
	"strconv"
	"strings"
)

// Goal is one of the performance targets BENCHMARKS.md sets, judged on a run.
type Goal struct {
	Name     string `json:"name"`
	Want     string `json:"want"`
	Measured string `json:"measured"`
	// Met is "yes", "no", "not measured" (the run lacked the cells it needs), or
	// "—" for a figure reported without a target.
	Met string `json:"met"`
}

func (r *Report) find(target, variant string, conc int) *Result {
	for i := range r.Results {
		res := &r.Results[i]
		if res.Target == target && res.Variant == variant && res.Concurrency == conc {
			return res
		}
	}
	return nil
}

func (r *Report) concurrencies() []int {
	seen := map[int]bool{}
	var cs []int
	for _, res := range r.Results {
		if !seen[res.Concurrency] {
			seen[res.Concurrency] = true
			cs = append(cs, res.Concurrency)
		}
	}
	sort.Ints(cs)
	return cs
}

// goals judges the targets of BENCHMARKS.md on rep.
func goals(rep *Report) []Goal {
	var out []Goal
	perConc := func(name, want string, value func(c int) (float64, bool), ok func(v float64) bool, format string) {
		g := Goal{Name: name, Want: want, Met: "not measured"}
		var parts []string
		met, any := true, false
		for _, c := range rep.concurrencies() {
			v, have := value(c)
			if !have {
				continue
			}
			any = true
			parts = append(parts, fmt.Sprintf(format+" at %d", v, c))
			if !ok(v) {
				met = false
			}
		}
		if any {
			g.Measured = strings.Join(parts, ", ")
			g.Met = yesNo(met)
			if want == "—" {
				g.Met = "—"
			}
		}
		out = append(out, g)
	}
	ratioGoal := func(name, want, target, variant string, min float64) {
		perConc(name, want, func(c int) (float64, bool) {
			return ratio(rep.find(target, variant, c))
		}, func(v float64) bool { return v >= min }, "%.2f×")
	}
	ratioGoal("PostgreSQL first-time throughput, default flow", "≥ 0.7× baseline", "postgres", VariantFirst, 0.7)
	ratioGoal("PostgreSQL claim-then-complete first-time throughput (no target; for comparison)", "—", "postgres", VariantClaim, 0)
	ratioGoal("PostgreSQL single-tx first-time throughput (no target; for comparison)", "—", "postgres", VariantSingleTx, 0)
	ratioGoal("PostgreSQL hand-written pgx reference throughput (no target; for comparison)", "—", "postgres", VariantHand, 0)
	overHand := func(name, target string, min float64) {
		perConc(name, fmt.Sprintf("≥ %.2f×", min), func(c int) (float64, bool) {
			i, h := rep.find(target, VariantFirst, c), rep.find(target, VariantHand, c)
			if i == nil || h == nil || h.Throughput == 0 {
				return 0, false
			}
			return i.Throughput / h.Throughput, true
		}, func(v float64) bool { return v >= min }, "%.2f×")
	}
	overHand("PostgreSQL idem first-time (default flow) ÷ hand-written reference, throughput", "postgres", 0.97)
	ratioGoal("SQLite first-time throughput, default flow", "≥ 0.5× baseline", "sqlite", VariantFirst, 0.5)
	ratioGoal("MariaDB first-time throughput, default flow (no target; for comparison)", "—", "mysql", VariantFirst, 0)
	ratioGoal("MariaDB hand-written 3-round-trip reference throughput (no target; for comparison)", "—", "mysql", VariantHand, 0)
	overHand("MariaDB idem first-time (default flow) ÷ hand-written reference, throughput", "mysql", 0.95)
	perConc("PostgreSQL replay vs first-time throughput", "≥ 1.5×", func(c int) (float64, bool) {
		rp, f := rep.find("postgres", VariantReplay, c), rep.find("postgres", VariantFirst, c)
		if rp == nil || f == nil || f.Throughput == 0 {
			return 0, false
		}
		return rp.Throughput / f.Throughput, true
	}, func(v float64) bool { return v >= 1.5 }, "%.2f×")
	if rep.Isolated {
		overhead := func(target, variant string) func(c int) (float64, float64, bool) {
			return func(c int) (float64, float64, bool) {
				m, f := rep.find(target, variant, c), rep.find("fiber", variant, c)
				if m == nil || f == nil || m.ExtraCPUMicros == -1 || f.ExtraCPUMicros == -1 {
					return 0, 0, false
				}
				return m.ExtraCPUMicros, f.ExtraCPUMicros, true
			}
		}
		pair := func(name, want string, value func(c int) (float64, float64, bool), ok func(idem, fiber float64) bool) {
			g := Goal{Name: name, Want: want, Met: "not measured"}
			var parts []string
			met, any := true, false
			for _, c := range rep.concurrencies() {
				a, b, have := value(c)
				if !have {
					continue
				}
				any = true
				parts = append(parts, fmt.Sprintf("%+.1f vs %+.1f µs at %d", a, b, c))
				met = met && ok(a, b)
			}
			if any {
				g.Measured, g.Met = strings.Join(parts, ", "), yesNo(met)
			}
			out = append(out, g)
		}
		pair("memstore first-time: extra server CPU per request over bare, idem vs Fiber's middleware", "≤ Fiber's", overhead("memory", VariantFirst),
			func(a, b float64) bool { return a <= b })
		pair("memstore replay: extra server CPU per request over bare, idem vs Fiber's middleware", "idem < 0 (cheaper than bare)", overhead("memory", VariantReplay),
			func(a, _ float64) bool { return a < 0 })
		g := Goal{Name: "memory per stored record (peak RSS, net of the bare handler), memstore vs Fiber", Want: "≤ Fiber's", Met: "not measured"}
		var m, f *MemoryResult
		for i := range rep.Memory {
			if rep.Memory[i].Variant == VariantFirst {
				switch rep.Memory[i].Target {
				case "memory":
					m = &rep.Memory[i]
				case "fiber":
					f = &rep.Memory[i]
				}
			}
		}
		if m != nil && f != nil {
			g.Measured = fmt.Sprintf("%.2f vs %.2f KiB/record (%d records; live heap %.2f vs %.2f KiB/record)", m.NetPerRecord/1024, f.NetPerRecord/1024, m.Records, m.HeapPerRecord/1024, f.HeapPerRecord/1024)
			g.Met = yesNo(m.NetPerRecord <= f.NetPerRecord)
		}
		out = append(out, g)
	} else {
		perConc("idem overhead on memstore vs Fiber's idempotency overhead (first-time keys, client latency)", "≤ 1", func(c int) (float64, bool) {
			m, f := rep.find("memory", VariantFirst, c), rep.find("fiber", VariantFirst, c)
			if m == nil || f == nil || f.OverheadMicros <= 0 {
				return 0, false
			}
			return m.OverheadMicros / f.OverheadMicros, true
		}, func(v float64) bool { return v <= 1 }, "%.2f")
	}

	g := Goal{Name: "PostgreSQL claim p99, largest table vs the reference table (smallest size), timed in the same window", Want: "≤ 1.5×", Met: "not measured"}
	if gr := rep.Growth; gr != nil && len(gr.Steps) >= 1 {
		last, first := gr.Steps[len(gr.Steps)-1], gr.Steps[0]
		if last.RefP99Micros > 0 && first.P99Micros > 0 {
			v := last.P99Micros / last.RefP99Micros
			g.Measured = fmt.Sprintf("%.2f× (%.0f µs at %s records vs %.0f µs at %s, alternating claims; p50 %.0f vs %.0f µs). Step to step: %.0f µs at %s → %.0f µs at %s (%.2f×)",
				v, last.P99Micros, count(last.Records), last.RefP99Micros, count(gr.RefRecords), last.P50Micros, last.RefP50Micros,
				first.P99Micros, count(first.Records), last.P99Micros, count(last.Records), last.P99Micros/first.P99Micros)
			g.Met = yesNo(v <= 1.5)
		}
	}
	out = append(out, g)
	return out
}

func ratio(r *Result) (float64, bool) {
	if r == nil || r.Ratio == 0 {
		return 0, false
	}
	return r.Ratio, true
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// count formats n as 10k, 1M, 10M.
func count(n int) string {
	switch {
	case n >= 1_000_000 && n%1_000_000 == 0:
		return strconv.Itoa(n/1_000_000) + "M"
	case n >= 1000 && n%1000 == 0:
		return strconv.Itoa(n/1000) + "k"
	}
	return strconv.Itoa(n)
}

// opt formats v, or "—" when it was not measured (negative, unless signed).
func opt(format string, v float64, signed bool) string {
	if v == -1 || (!signed && v < 0) {
		return "—"
	}
	return fmt.Sprintf(format, v)
}

// WriteJSON writes rep as indented JSON.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// statusMix formats the answer counts compactly: "201:1200 409:30 201r:5000".
func statusMix(m map[string]int64) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		if m[k] == 0 {
			continue
		}
		name := strings.Replace(k, " replayed (by row count)", "r*", 1)
		name = strings.Replace(name, " replayed", "r", 1)
		parts = append(parts, fmt.Sprintf("%s:%d", name, m[k]))
	}
	return strings.Join(parts, " ")
}

// WriteMarkdown writes the results as markdown tables.
func (r *Report) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "Machine: %d CPUs (%s), %.1f GiB, %s %s; load average %s at start, %s at end.\n",
		r.Machine.CPUs, r.Machine.CPUModel, r.Machine.MemoryGiB, r.Machine.GoVersion, r.Machine.OS, r.Machine.LoadStart, r.Machine.LoadEnd)
	fmt.Fprintf(&b, "Each cell: %s of closed-loop clients, in %d interleaved rounds. Total run %.0f s.", r.Duration, r.Rounds, r.Seconds)
	if r.Command != "" {
		fmt.Fprintf(&b, " Command: `%s`.", r.Command)
	}
	b.WriteString("\n\n")
	if len(r.Targets) > 0 {
		b.WriteString("| target | server | idempotency records | orders written to |\n|---|---|---|---|\n")
		for _, t := range r.Targets {
			fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", t.Name, t.Version, t.Store, t.Orders)
		}
		b.WriteString("\n")
	}
	names := make([]string, 0, len(r.Skipped))
	for n := range r.Skipped {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(&b, "- store not available: %s: %s\n", n, r.Skipped[n])
	}
	if len(names) > 0 {
		b.WriteString("\n")
	}
	switch {
	case r.Isolated && r.Pinned:
		b.WriteString("Each server ran in a process of its own pinned to CPU 0, the load generator in another pinned to CPU 1; the databases were left to the scheduler.\n\n")
	case r.Isolated:
		b.WriteString("Each server ran in a process of its own (not pinned); the load generator in another.\n\n")
	default:
		b.WriteString("Server and load generator ran in one process: server CPU and allocations were not measured.\n\n")
	}
	if len(r.Results) > 0 {
		b.WriteString("| target | variant | clients | req/s | × baseline | p50 µs | p99 µs | +µs/req | srv CPU µs/req | +srv µs | DB CPU µs/req | DB round trips | DB stmts | allocs/req | loader busy | answers | rows | check |\n")
		b.WriteString("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|---|\n")
		for _, res := range r.Results {
			check := "ok"
			if res.Check != "" {
				check = "**FAIL: " + res.Check + "**"
			}
			ratio, over := "1.00", "—"
			if res.Variant != VariantBaseline {
				ratio = fmt.Sprintf("%.2f", res.Ratio)
				over = fmt.Sprintf("%+.0f", res.OverheadMicros)
			}
			extra := opt("%+.1f", res.ExtraCPUMicros, true)
			if res.Variant == VariantBaseline {
				extra = "—"
			}
			fmt.Fprintf(&b, "| %s | %s | %d | %.0f | %s | %.0f | %.0f | %s | %s | %s | %s | %s | %s | %s | %s | %s | %d | %s |\n",
				res.Target, res.Variant, res.Concurrency, res.Throughput, ratio, res.P50Micros, res.P99Micros, over,
				opt("%.1f", res.ServerCPUMicros, false), extra, opt("%.1f", res.DBCPUMicros, false),
				opt("%.2f", res.RoundTrips, false), opt("%.2f", res.Statements, false), opt("%.0f", res.Allocs, false), opt("%.2f", res.LoaderBusy, false),
				statusMix(res.Status), res.Rows, check)
		}
		b.WriteString("\nanswers: status:count; `201r` = replay (Idempotent-Replayed: true); `201r*` = Fiber replay, told apart by row count (Fiber does not mark replays). " +
			"srv CPU: user + system CPU of the server process per answer; +srv: minus the baseline's. DB CPU: the measured pool's PostgreSQL backends, or the whole MariaDB / Redis process. " +
			"DB round trips and stmts: per answer, counted on the server's database connections. loader busy: the load generator's CPU over the cell's time (1.00 = its CPU was the limit). — = not measured.\n\n")
	}
	if len(r.Memory) > 0 {
		b.WriteString("Memory per stored record (a fresh server process per line, peak RSS = VmHWM):\n\n")
		b.WriteString("| target | variant | requests | RSS at start MiB | peak RSS MiB | peak RSS B/request | net of bare B/record | live heap B/request | check |\n|---|---|--:|--:|--:|--:|--:|--:|---|\n")
		for _, m := range r.Memory {
			check, net := "ok", "—"
			if m.Check != "" {
				check = "**FAIL: " + m.Check + "**"
			}
			if m.Variant != VariantBaseline {
				net = fmt.Sprintf("%.0f", m.NetPerRecord)
			}
			fmt.Fprintf(&b, "| %s | %s | %d | %.1f | %.1f | %.0f | %s | %.0f | %s |\n", m.Target, m.Variant, m.Records, float64(m.StartRSSKiB)/1024, float64(m.PeakRSSKiB)/1024, m.PeakPerRecord, net, m.HeapPerRecord, check)
		}
		b.WriteString("\n")
	}
	if g := r.Growth; g != nil {
		writeGrowth(&b, g)
	}
	if len(r.Goals) > 0 {
		b.WriteString("| target | want | measured (by clients) | met |\n|---|---|---|---|\n")
		for _, g := range r.Goals {
			fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", g.Name, g.Want, g.Measured, g.Met)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// Colours of the variants in the chart.
var variantColors = map[string]string{
	VariantBaseline: "#555555",
	VariantFirst:    "#1f77b4",
	VariantReplay:   "#2ca02c",
	VariantHot:      "#ff7f0e",
	VariantSingleTx: "#9467bd",
	VariantClaim:    "#17becf",
	VariantHand:     "#d62728",
}

var variantOrder = []string{VariantBaseline, VariantFirst, VariantClaim, VariantSingleTx, VariantHand, VariantReplay, VariantHot}

func esc(s string) string {
	var b strings.Builder
	_ = xml.EscapeText(&b, []byte(s))
	return b.String()
}

// human formats v with a k or M suffix.
func human(v float64) string {
	switch {
	case v >= 1e6:
		return strconv.FormatFloat(v/1e6, 'g', 3, 64) + "M"
	case v >= 1e3:
		return strconv.FormatFloat(v/1e3, 'g', 3, 64) + "k"
	}
	return strconv.FormatFloat(v, 'g', 3, 64)
}

// niceMax rounds v up to 1, 2 or 5 times a power of ten.
func niceMax(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= v {
			return m * p
		}
	}
	return 10 * p
}

// WriteSVG draws throughput and p99 latency by number of clients, one row of
// two panels per target and one line per variant.
func (r *Report) WriteSVG(w io.Writer) error {
	var targets []string
	seen := map[string]bool{}
	for _, res := range r.Results {
		if !seen[res.Target] {
			seen[res.Target] = true
			targets = append(targets, res.Target)
		}
	}
	concs := r.concurrencies()
	const (
		pw, ph  = 330.0, 150.0 // plot area of one panel
		left    = 70.0
		gap     = 60.0
		top     = 95.0
		rowH    = ph + 60
		legendY = 58.0
	)
	width := left + 2*pw + gap + 30
	height := top + float64(len(targets))*rowH + 10
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" viewBox="0 0 %.0f %.0f" font-family="sans-serif" font-size="11">`+"\n", width, height, width, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%.0f" y="20" font-size="14" font-weight="bold">%s</text>`+"\n", left, esc("idem bench: throughput and p99 latency by concurrent clients"))
	fmt.Fprintf(&b, `<text x="%.0f" y="%.0f" fill="#666">%s</text>`+"\n", left, 36.0, esc(fmt.Sprintf("%d CPUs, %s, %s per cell in %d rounds", r.Machine.CPUs, r.Machine.GoVersion, r.Duration, r.Rounds)))
	x := left
	for _, v := range variantOrder {
		fmt.Fprintf(&b, `<line x1="%.0f" y1="%.0f" x2="%.0f" y2="%.0f" stroke="%s" stroke-width="3"/><text x="%.0f" y="%.0f">%s</text>`+"\n", x, legendY, x+20, legendY, variantColors[v], x+25, legendY+4, esc(v))
		x += 40 + float64(len(v))*6.5
	}
	xpos := func(i int) float64 {
		if len(concs) == 1 {
			return pw / 2
		}
		return 20 + float64(i)*(pw-40)/float64(len(concs)-1)
	}
	for ti, t := range targets {
		y0 := top + float64(ti)*rowH
		for col, metric := range []string{"throughput, req/s", "p99 latency, ms"} {
			x0 := left + float64(col)*(pw+gap)
			value := func(res *Result) float64 {
				if col == 0 {
					return res.Throughput
				}
				return res.P99Micros / 1000
			}
			maxV := 0.0
			for _, res := range r.Results {
				if res.Target == t {
					maxV = math.Max(maxV, value(&res))
				}
			}
			maxV = niceMax(maxV)
			ypos := func(v float64) float64 { return y0 + ph - v/maxV*ph }
			fmt.Fprintf(&b, `<text x="%.0f" y="%.0f" font-weight="bold">%s</text>`+"\n", x0, y0-6, esc(t+" — "+metric))
			fmt.Fprintf(&b, `<rect x="%.0f" y="%.0f" width="%.0f" height="%.0f" fill="none" stroke="#999"/>`+"\n", x0, y0, pw, ph)
			for k := 0; k <= 4; k++ {
				v := maxV * float64(k) / 4
				y := ypos(v)
				fmt.Fprintf(&b, `<line x1="%.0f" y1="%.1f" x2="%.0f" y2="%.1f" stroke="#eee"/><text x="%.0f" y="%.1f" text-anchor="end">%s</text>`+"\n", x0, y, x0+pw, y, x0-4, y+4, human(v))
			}
			for i, c := range concs {
				fmt.Fprintf(&b, `<text x="%.1f" y="%.0f" text-anchor="middle">%d</text>`+"\n", x0+xpos(i), y0+ph+14, c)
			}
			fmt.Fprintf(&b, `<text x="%.1f" y="%.0f" text-anchor="middle" fill="#666">clients</text>`+"\n", x0+pw/2, y0+ph+28)
			for _, v := range variantOrder {
				var pts []string
				for i, c := range concs {
					if res := r.find(t, v, c); res != nil {
						px, py := x0+xpos(i), ypos(value(res))
						pts = append(pts, fmt.Sprintf("%.1f,%.1f", px, py))
						fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"><title>%s</title></circle>`+"\n", px, py, variantColors[v],
							esc(fmt.Sprintf("%s %s, %d clients: %.0f req/s, p99 %.0f µs", t, v, c, res.Throughput, res.P99Micros)))
					}
				}
				if len(pts) > 1 {
					fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2"/>`+"\n", strings.Join(pts, " "), variantColors[v])
				}
			}
		}
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// writeGrowth writes the growth run's tables.
func writeGrowth(b *strings.Builder, g *GrowthReport) {
	fmt.Fprintf(b, "Growth (%s, store.Claim on fresh keys, one client, alternating with a claim on a reference table of %s records):\n\n", g.Version, count(g.RefRecords))
	if g.Loader != "" {
		fmt.Fprintf(b, "Loaded by %s.\n\n", g.Loader)
	}
	var names []string
	if len(g.Steps) > 0 {
		for _, ix := range g.Steps[0].Sizes.Indexes {
			names = append(names, ix.Name)
		}
	}
	b.WriteString("| records | load s | load rows/s | heap MB |")
	for _, n := range names {
		fmt.Fprintf(b, " %s MB |", n)
	}
	b.WriteString(" total MB | total MB per 1M records | claims | claim p50 µs | claim p99 µs | mean µs | reference p50 µs | reference p99 µs | loadavg |\n|--:|--:|--:|--:|")
	b.WriteString(strings.Repeat("--:|", len(names)))
	b.WriteString("--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, s := range g.Steps {
		fmt.Fprintf(b, "| %s | %.1f | %.0f | %.0f |", count(s.Records), s.LoadSeconds, s.LoadRate, s.Sizes.HeapMB)
		for i := range names {
			if i < len(s.Sizes.Indexes) {
				fmt.Fprintf(b, " %.0f |", s.Sizes.Indexes[i].MB)
			} else {
				b.WriteString(" — |")
			}
		}
		fmt.Fprintf(b, " %.0f | %.0f | %d | %.0f | %.0f | %.0f | %.0f | %.0f | %.2f |\n", s.TableMB, s.MBPerMillion(s.TableMB), s.Claims, s.P50Micros, s.P99Micros, s.MeanMicros, s.RefP50Micros, s.RefP99Micros, s.LoadAvg)
	}
	if len(g.Steps) > 0 {
		s := g.Steps[len(g.Steps)-1]
		fmt.Fprintf(b, "\nPer million records at %s: heap %.0f MB", count(s.Records), s.MBPerMillion(s.Sizes.HeapMB))
		for _, ix := range s.Sizes.Indexes {
			fmt.Fprintf(b, ", %s %.0f MB", ix.Name, s.MBPerMillion(ix.MB))
		}
		fmt.Fprintf(b, ", all indexes %.0f MB, total %.0f MB.\n", s.MBPerMillion(s.Sizes.IndexMB), s.MBPerMillion(s.TableMB))
	}
	if j := g.Janitor; j != nil {
		fmt.Fprintf(b, "\nJanitor: of %s records, the oldest %s had expired; Janitor.Sweep (BatchSize %d) deleted %s in %.1f s (%.0f rows/s); meanwhile %d claims on that table: p50 %.0f µs, p99 %.0f µs, mean %.0f µs (reference table in the same window: p50 %.0f µs, p99 %.0f µs; loadavg %.2f).\n",
			count(j.Records), count(j.Backlog), j.BatchSize, count(j.Deleted), j.SweepSeconds, float64(j.Deleted)/math.Max(j.SweepSeconds, 1e-9), j.Claims, j.P50Micros, j.P99Micros, j.MeanMicros, j.RefP50Micros, j.RefP99Micros, j.LoadAvg)
		fmt.Fprintf(b, "\nBloat, with the table's autovacuum set to (%s): the autovacuum starts at %d dead rows. Dead rows (n_dead_tup) after the sweep: %d; VACUUM then took %.1f s, leaving %d (autovacuums of the table that finished during the run: %d).", j.Autovacuum, j.AutovacuumTrigger, j.DeadAfterSweep, j.VacuumSeconds, j.DeadAfterVacuum, j.Autovacuums)
		if j.FreePercent >= 0 {
			fmt.Fprintf(b, " pgstattuple_approx after the VACUUM: %.1f%% of the heap free (reusable, not returned to the OS), %.1f%% dead.", j.FreePercent, j.DeadPercent)
		} else {
			b.WriteString(" (pgstattuple is not available: free space not measured.)")
		}
		b.WriteString("\n\n| MB | before the sweep | after the sweep and VACUUM |")
		if j.Refill > 0 {
			fmt.Fprintf(b, " after %s fresh records |", count(j.Refill))
		}
		b.WriteString("\n|---|--:|--:|")
		if j.Refill > 0 {
			b.WriteString("--:|")
		}
		b.WriteString("\n")
		row := func(name string, f func(Sizes) float64) {
			fmt.Fprintf(b, "| %s | %.0f | %.0f |", name, f(j.Before), f(j.AfterVacuum))
			if j.Refill > 0 {
				fmt.Fprintf(b, " %.0f |", f(j.AfterRefill))
			}
			b.WriteString("\n")
		}
		row("heap", func(s Sizes) float64 { return s.HeapMB })
		for i, ix := range j.Before.Indexes {
			row(ix.Name, func(s Sizes) float64 {
				if i < len(s.Indexes) {
					return s.Indexes[i].MB
				}
				return 0
			})
		}
		row("total", func(s Sizes) float64 { return s.TotalMB })
	}
	if g.Note != "" {
		b.WriteString("\n" + g.Note + "\n")
	}
	b.WriteString("\n")
}
