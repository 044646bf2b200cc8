package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// OverheadConfig configures RunOverhead: the measurement of issue 30 of what
// idem on memstore and Fiber's idempotency middleware each add to their own
// bare server, in server CPU per request.
type OverheadConfig struct {
	// Concurrency lists the numbers of closed-loop clients. Defaults to 1, 8, 64.
	Concurrency []int
	// Rounds is how many interleaved rounds run: round r runs every (target,
	// variant) once at every concurrency, in an order rotated by r. Defaults to 3.
	Rounds int
	// Duration is the measured time of one cell, split over the rounds.
	// Defaults to 4 s.
	Duration time.Duration
	// Warmup is the unmeasured load before every measured slice, on the same
	// connections. Defaults to 300 ms.
	Warmup time.Duration
	// ReplayKeys is how many keys the replay variant completes first and then
	// cycles through. Defaults to 512.
	ReplayKeys int
	// ServerCommand runs Serve (idem bench --serve); LoaderCommand runs Load
	// (idem bench load). Both required.
	ServerCommand []string
	LoaderCommand []string
	// Pin runs servers with taskset on CPU 0 and loaders on CPU 1 (both with
	// GOMAXPROCS=1).
	Pin bool
	// CPUProfileDir, when set, gets a CPU profile of every server process,
	// named TARGET-VARIANT-cN-rR.pprof (the whole time it served: the replay
	// keys' completion and the warm-up included).
	CPUProfileDir string
	// Log receives one line per slice. Defaults to io.Discard.
	Log io.Writer
}

// OverheadCell is one (target, variant, concurrency) over all rounds.
type OverheadCell struct {
	Target      string  `json:"target"` // memory (idem + memstore on net/http) or fiber
	Variant     string  `json:"variant"`
	Concurrency int     `json:"concurrency"`
	Requests    int64   `json:"requests"`
	Seconds     float64 `json:"seconds"`
	Throughput  float64 `json:"throughput_rps"`
	P50Micros   float64 `json:"p50_us"` // the median of the rounds' p50
	// ServerCPUMicros is the server's CPU per answered request; ExtraMicros
	// that minus the same target's bare handler's, summed over the same rounds.
	ServerCPUMicros float64 `json:"server_cpu_us_per_req"`
	ExtraMicros     float64 `json:"extra_server_cpu_us_per_req"`
	// RoundExtra is ExtraMicros of each round alone, for the spread, and
	// MedianExtra their median: on a busy machine one disturbed round moves
	// the sum, not the median.
	RoundExtra  []float64 `json:"extra_per_round"`
	MedianExtra float64   `json:"median_extra_per_round"`
	Allocs      float64   `json:"allocs_per_req"`
	AllocBytes  float64   `json:"alloc_bytes_per_req"`
	// PeakRSSMiB is the highest VmHWM of the rounds' server processes (each
	// fresh) after their slice; HeapLiveMiB the live heap after a GC.
	PeakRSSMiB  float64 `json:"peak_rss_mib"`
	HeapLiveMiB float64 `json:"heap_live_mib"`
	LoaderBusy  float64 `json:"loader_busy"`
	Check       string  `json:"check,omitempty"`

	cpu, tick, loaderCPU int64
	mallocs, bytes       uint64
	rows                 int64
	executed, replayed   int64
	other                int64
	p50s                 []float64
	roundCPU             []int64
	roundReq             []int64
}

// OverheadReport is what RunOverhead measured.
type OverheadReport struct {
	Started  time.Time      `json:"started"`
	Seconds  float64        `json:"seconds"`
	Command  string         `json:"command,omitempty"`
	Machine  Machine        `json:"machine"`
	Duration string         `json:"cell_duration"`
	Rounds   int            `json:"rounds"`
	Pinned   bool           `json:"pinned"`
	Fiber    string         `json:"fiber_version"`
	Cells    []OverheadCell `json:"cells"`
}

// Failed reports whether any cell's consistency check failed.
func (r *OverheadReport) Failed() bool {
	for _, c := range r.Cells {
		if c.Check != "" {
			return true
		}
	}
	return false
}

var overheadVariants = []struct {
	name, path, keys string
}{
	{VariantBaseline, "/bare/orders", "none"},
	{VariantFirst, "/idem/orders", "fresh"},
	{VariantReplay, "/idem/orders", "pool"},
}

// RunOverhead measures idem on memstore and Fiber's idempotency middleware,
// each over its own bare server: for every round, concurrency, target and
// variant a fresh server process (GOMAXPROCS=1, on CPU 0 with Pin) and a
// separate loader process (fasthttp clients, GOMAXPROCS=1, on CPU 1), the
// server's CPU read from /proc around the measured window.
func RunOverhead(ctx context.Context, cfg OverheadConfig) (*OverheadReport, error) {
	if len(cfg.Concurrency) == 0 {
		cfg.Concurrency = []int{1, 8, 64}
	}
	if cfg.Rounds <= 0 {
		cfg.Rounds = 3
	}
	if cfg.Duration <= 0 {
		cfg.Duration = 4 * time.Second
	}
	if cfg.Warmup < 0 {
		cfg.Warmup = 0
	} else if cfg.Warmup == 0 {
		cfg.Warmup = 300 * time.Millisecond
	}
	if cfg.ReplayKeys <= 0 {
		cfg.ReplayKeys = 512
	}
	if cfg.Log == nil {
		cfg.Log = io.Discard
	}
	if len(cfg.ServerCommand) == 0 || len(cfg.LoaderCommand) == 0 {
		return nil, errors.New("overhead run without ServerCommand or LoaderCommand")
	}
	rep := &OverheadReport{
		Started: time.Now(), Machine: machine(), Duration: cfg.Duration.String(), Rounds: cfg.Rounds,
		Pinned: cfg.Pin, Fiber: FiberVersion,
	}
	slice := cfg.Duration / time.Duration(cfg.Rounds)
	cells := map[string]*OverheadCell{}
	var order []string
	type job struct {
		target string
		v      int
	}
	var jobs []job
	for _, t := range []string{"memory", "fiber"} {
		for v := range overheadVariants {
			jobs = append(jobs, job{t, v})
		}
	}
	bcfg := Config{ServerCommand: cfg.ServerCommand, Log: cfg.Log, Isolate: true, Pin: cfg.Pin}
	bcfg.defaults()
	bcfg.serverEnv = []string{"GOMAXPROCS=1"}
	for round := 0; round < cfg.Rounds; round++ {
		for _, conc := range cfg.Concurrency {
			for j := range jobs {
				jb := jobs[(j+round)%len(jobs)]
				v := overheadVariants[jb.v]
				id := fmt.Sprintf("%s|%s|%d", jb.target, v.name, conc)
				c := cells[id]
				if c == nil {
					c = &OverheadCell{Target: jb.target, Variant: v.name, Concurrency: conc}
					cells[id] = c
					order = append(order, id)
				}
				scfg := bcfg
				if cfg.CPUProfileDir != "" {
					name := fmt.Sprintf("%s-%s-c%d-r%d.pprof", jb.target, strings.ReplaceAll(v.name, " ", "-"), conc, round+1)
					scfg.serverEnv = append(slices.Clone(bcfg.serverEnv), CPUProfileEnv+"="+filepath.Join(cfg.CPUProfileDir, name))
				}
				res, err := overheadSlice(ctx, &cfg, &scfg, jb.target, LoadSpec{
					Keys: v.keys, Clients: conc, Duration: slice, Warmup: cfg.Warmup, ReplayKeys: cfg.ReplayKeys,
					RunID: randomHex(4),
				}, v.path)
				if err != nil {
					return rep, fmt.Errorf("%s %s c=%d round %d: %w", jb.target, v.name, conc, round+1, err)
				}
				c.add(res)
				fmt.Fprintf(cfg.Log, "overhead %-6s %-8s c=%-3d round %d: %7.0f req/s, server %.2f µs/req, peak RSS %.0f MiB\n",
					jb.target, v.name, conc, round+1, float64(res.Requests)/res.Seconds, float64(res.ServerCPUNanos)/1e3/float64(max(res.Requests, 1)), float64(res.PeakRSSKiB)/1024)
			}
		}
	}
	for _, id := range order {
		c := cells[id]
		c.finish()
		if c.Variant != VariantBaseline {
			if b := cells[fmt.Sprintf("%s|%s|%d", c.Target, VariantBaseline, c.Concurrency)]; b != nil {
				c.ExtraMicros = c.ServerCPUMicros - b.ServerCPUMicros
				for r := range c.roundCPU {
					if r < len(b.roundCPU) && c.roundReq[r] > 0 && b.roundReq[r] > 0 {
						c.RoundExtra = append(c.RoundExtra, float64(c.roundCPU[r])/1e3/float64(c.roundReq[r])-float64(b.roundCPU[r])/1e3/float64(b.roundReq[r]))
					}
				}
				c.MedianExtra = median(c.RoundExtra)
			}
		}
		rep.Cells = append(rep.Cells, *c)
	}
	rep.Machine.LoadEnd = loadavg()
	rep.Seconds = time.Since(rep.Started).Seconds()
	return rep, nil
}

func (c *OverheadCell) add(r *LoadResult) {
	c.Requests += r.Requests
	c.Seconds += r.Seconds
	if r.ServerCPUNanos >= 0 && c.cpu >= 0 {
		c.cpu += r.ServerCPUNanos
	} else {
		c.cpu = -1
	}
	c.tick += r.ServerTickNanos
	c.loaderCPU += r.LoaderCPUNanos
	c.mallocs += r.Mallocs
	c.bytes += r.AllocBytes
	c.rows += r.Rows
	c.executed += r.Executed
	c.replayed += r.Replayed
	c.other += r.Other
	c.p50s = append(c.p50s, r.P50Micros)
	c.roundCPU = append(c.roundCPU, r.ServerCPUNanos)
	c.roundReq = append(c.roundReq, r.Requests)
	c.PeakRSSMiB = max(c.PeakRSSMiB, float64(r.PeakRSSKiB)/1024)
	c.HeapLiveMiB = max(c.HeapLiveMiB, float64(r.HeapLiveBytes)/(1<<20))
	// Fiber does not mark replays: a 2xx answer that inserted no row was one.
	if c.Target == "fiber" && c.Variant != VariantBaseline {
		ex := min(r.Rows, r.Executed)
		c.executed -= r.Executed - ex
		c.replayed += r.Executed - ex
	}
}

func (c *OverheadCell) finish() {
	if c.Seconds > 0 {
		c.Throughput = float64(c.Requests) / c.Seconds
		c.LoaderBusy = float64(c.loaderCPU) / 1e9 / c.Seconds
	}
	if c.Requests > 0 {
		c.ServerCPUMicros = -1
		if c.cpu >= 0 {
			c.ServerCPUMicros = float64(c.cpu) / 1e3 / float64(c.Requests)
		}
		c.Allocs = float64(c.mallocs) / float64(c.Requests)
		c.AllocBytes = float64(c.bytes) / float64(c.Requests)
	}
	c.P50Micros = median(c.p50s)
	var problems []string
	if c.Requests == 0 {
		problems = append(problems, "no request was answered")
	}
	if c.other > 0 {
		problems = append(problems, fmt.Sprintf("%d answers were errors, 409s or unexpected statuses", c.other))
	}
	if c.rows != c.executed {
		problems = append(problems, fmt.Sprintf("%d rows were inserted for %d executed requests", c.rows, c.executed))
	}
	switch c.Variant {
	case VariantFirst, VariantBaseline:
		if c.replayed > 0 {
			problems = append(problems, fmt.Sprintf("%d replays", c.replayed))
		}
	case VariantReplay:
		if c.executed > 0 {
			problems = append(problems, fmt.Sprintf("%d replays of completed keys executed the handler again", c.executed))
		}
	}
	c.Check = strings.Join(problems, "; ")
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := append([]float64(nil), v...)
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
	return s[len(s)/2]
}

// overheadSlice starts a fresh server for target, runs one loader process
// against path on it, and stops the server.
func overheadSlice(ctx context.Context, cfg *OverheadConfig, bcfg *Config, target string, sp LoadSpec, path string) (*LoadResult, error) {
	t, _, err := startChild(ctx, target, bcfg, randomHex(4))
	if err != nil {
		return nil, err
	}
	defer t.close()
	sp.URL, sp.ServerPID = t.url+path, t.pid
	spec, _ := json.Marshal(sp)
	argv := cfg.LoaderCommand
	if cfg.Pin {
		argv = append([]string{"taskset", "-c", "1"}, argv...)
	}
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), LoadEnv+"="+string(spec), "GOMAXPROCS=1")
	cmd.Stderr = cfg.Log
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the loader %q: %w", strings.Join(argv, " "), err)
	}
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	var line string
	if sc.Scan() {
		line = sc.Text()
	}
	_, _ = io.Copy(io.Discard, out)
	if err := cmd.Wait(); err != nil {
		return nil, fmt.Errorf("the loader %q failed: %v (its errors are above)", strings.Join(argv, " "), err)
	}
	var res LoadResult
	if err := json.Unmarshal([]byte(line), &res); err != nil {
		return nil, fmt.Errorf("the loader printed %q, not a result: %v", line, err)
	}
	return &res, nil
}

// WriteJSON writes the report as indented JSON.
func (r *OverheadReport) WriteJSON(w io.Writer) error {
	e := json.NewEncoder(w)
	e.SetIndent("", "  ")
	return e.Encode(r)
}

func (r *OverheadReport) cell(target, variant string, conc int) *OverheadCell {
	for i := range r.Cells {
		c := &r.Cells[i]
		if c.Target == target && c.Variant == variant && c.Concurrency == conc {
			return c
		}
	}
	return nil
}

func (r *OverheadReport) concurrencies() []int {
	var cs []int
	seen := map[int]bool{}
	for _, c := range r.Cells {
		if !seen[c.Concurrency] {
			seen[c.Concurrency] = true
			cs = append(cs, c.Concurrency)
		}
	}
	return cs
}

// WriteMarkdown writes the cells and the comparison of idem's overhead with
// Fiber's.
func (r *OverheadReport) WriteMarkdown(w io.Writer) error {
	b := &strings.Builder{}
	fmt.Fprintf(b, "# idem bench --overhead\n\n")
	if r.Command != "" {
		fmt.Fprintf(b, "Command: `%s`. ", r.Command)
	}
	fmt.Fprintf(b, "%s, %d CPUs (%s), %s; load average %s at the start, %s at the end. ", r.Started.UTC().Format("Mon 2 Jan 2006 15:04 MST"), r.Machine.CPUs, r.Machine.CPUModel, r.Machine.GoVersion, r.Machine.LoadStart, r.Machine.LoadEnd)
	pin := "not pinned"
	if r.Pinned {
		pin = "servers on CPU 0, loaders on CPU 1 (taskset)"
	}
	fmt.Fprintf(b, "Each slice: a fresh server process (GOMAXPROCS=1) and a fasthttp closed-loop loader process (GOMAXPROCS=1, keep-alive), %s; %s per cell in %d interleaved rounds; server CPU from /proc per answered request. memory = idem + memstore over bare net/http; fiber = Fiber %s's idempotency middleware over bare Fiber.\n\n", pin, r.Duration, r.Rounds, r.Fiber)
	fmt.Fprintf(b, "| target | variant | clients | req/s | p50 µs | srv CPU µs/req | + over bare | per round | allocs/req | B/req | peak RSS MiB | loader busy | check |\n")
	fmt.Fprintf(b, "|---|---|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|---|\n")
	for _, c := range r.Cells {
		extra, rounds := "—", ""
		if c.Variant != VariantBaseline {
			extra = fmt.Sprintf("%+.2f", c.ExtraMicros)
			var parts []string
			for _, x := range c.RoundExtra {
				parts = append(parts, fmt.Sprintf("%+.1f", x))
			}
			rounds = strings.Join(parts, " ")
		}
		check := "ok"
		if c.Check != "" {
			check = "**" + c.Check + "**"
		}
		fmt.Fprintf(b, "| %s | %s | %d | %.0f | %.0f | %.2f | %s | %s | %.1f | %.0f | %.0f | %.2f | %s |\n",
			c.Target, c.Variant, c.Concurrency, c.Throughput, c.P50Micros, c.ServerCPUMicros, extra, rounds, c.Allocs, c.AllocBytes, c.PeakRSSMiB, c.LoaderBusy, check)
	}
	fmt.Fprintf(b, "\n**idem on memstore against Fiber**, extra server CPU per request over each one's own bare server (µs):\n\n")
	fmt.Fprintf(b, "| clients | idem first | Fiber first | first: idem ≤ Fiber | idem replay | Fiber replay | replay: idem ≤ Fiber | medians of the rounds: first idem / Fiber, replay idem / Fiber | peak RSS first idem / Fiber MiB |\n|--:|--:|--:|---|--:|--:|---|---|---|\n")
	for _, conc := range r.concurrencies() {
		mf, ff := r.cell("memory", VariantFirst, conc), r.cell("fiber", VariantFirst, conc)
		mr, fr := r.cell("memory", VariantReplay, conc), r.cell("fiber", VariantReplay, conc)
		if mf == nil || ff == nil || mr == nil || fr == nil {
			continue
		}
		fmt.Fprintf(b, "| %d | %+.2f | %+.2f | %s | %+.2f | %+.2f | %s | %+.1f / %+.1f, %+.1f / %+.1f | %.0f / %.0f |\n", conc,
			mf.ExtraMicros, ff.ExtraMicros, yesNo(mf.ExtraMicros <= ff.ExtraMicros),
			mr.ExtraMicros, fr.ExtraMicros, yesNo(mr.ExtraMicros <= fr.ExtraMicros),
			mf.MedianExtra, ff.MedianExtra, mr.MedianExtra, fr.MedianExtra, mf.PeakRSSMiB, ff.PeakRSSMiB)
	}
	_, err := io.WriteString(w, b.String())
	return err
}
