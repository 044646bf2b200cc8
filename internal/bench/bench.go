package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Stores are the store names Run knows, in the order they run.
var Stores = []string{"memory", "sqlite", "postgres", "mysql", "redis"}

// Config configures Run. Zero fields take the defaults named in their docs.
type Config struct {
	// Stores are the stores to benchmark (see Stores). Nil means all of them; an
	// empty, non-nil slice none (for a growth-only or Fiber-only run).
	Stores []string
	// Duration is the measured time of one cell (store × variant × concurrency),
	// split into Rounds slices. Defaults to 3 seconds.
	Duration time.Duration
	// Rounds is how many interleaved slices each cell's Duration is split into:
	// round r runs every variant once, in an order rotated by r, so that drift of a
	// shared machine hits baseline and variants alike. Defaults to 3.
	Rounds int
	// Concurrency lists the numbers of concurrent clients. Defaults to 1, 8, 64.
	Concurrency []int
	// Fiber adds the Fiber v2 idempotency middleware, on its default in-memory
	// storage, as a target. Its overhead is compared with idem's on memstore.
	Fiber bool
	// PoolSize is the connection pool size for PostgreSQL and MySQL (the same for
	// baseline and idem). Defaults to 32.
	PoolSize int
	// ReplayKeys is how many keys are completed before the cells start, for the
	// replay case to cycle through. Defaults to 512.
	ReplayKeys int
	// PostgresURL, MySQLDSN and RedisURL locate the servers. Default to the
	// services on 127.0.0.1 (postgres://postgres@127.0.0.1:5432/test,
	// root@tcp(127.0.0.1:3306)/test, redis://127.0.0.1:6379/0).
	PostgresURL string
	MySQLDSN    string
	RedisURL    string
	// Growth runs the PostgreSQL growth benchmark (see Growth) after the cells.
	Growth bool
	// GrowthSizes are the numbers of stored records claim latency is measured at.
	// Defaults to 10 000, 1 000 000 and 10 000 000.
	GrowthSizes []int
	// GrowthClaims is how many claims are timed at each size. Defaults to 3000.
	GrowthClaims int
	// JanitorBacklog is how many expired records the janitor deletes while claims
	// are timed, after the growth steps: the oldest records of the table (the
	// first loaded) are loaded expired. Defaults to 1 000 000 (at most the
	// largest size); a negative value skips that phase.
	JanitorBacklog int
	// GrowthConns is how many connections bulk-load the growth table in
	// parallel. Defaults to 2.
	GrowthConns int
	// GrowthChunk is how many records the growth loader sends per COPY (one
	// transaction), sorted by key. Defaults to 1 000 000. Each chunk walks the
	// primary key's leaves once: past some 20 M records, larger chunks (5–10 M)
	// visit each leaf, and write its full-page image after a checkpoint, less
	// often per record; the loader holds a chunk's keys in memory (24 bytes
	// each, per connection).
	GrowthChunk int
	// GrowthBudget, when positive, bounds the growth run's time: a size whose
	// load, projected at the last step's rate, would not end within the budget
	// is not loaded, and the report says why.
	GrowthBudget time.Duration
	// Isolate runs the server of each target in a process of its own, started
	// as ServerCommand with the spec in the environment variable ServeEnv, while
	// the load generator runs in this process. Only then are the server's CPU
	// time, allocations and memory per stored record measured.
	Isolate bool
	// ServerCommand is the command that runs Serve (for the idem binary:
	// `idem bench --serve`). Required with Isolate.
	ServerCommand []string
	// Pin, with Isolate, pins the server process to CPU 0 and this process (the
	// load generator) to CPU 1 with taskset, for the cells; the databases are left
	// to the scheduler.
	Pin bool
	// MemoryRecords is how many first-time requests the memory-per-record phase
	// sends to a fresh memstore server and a fresh Fiber server (with Isolate,
	// when memory is among the Stores). Defaults to 150 000; negative skips it.
	MemoryRecords int
	// Log receives one progress line per step. Defaults to io.Discard.
	Log io.Writer
	// CPUProfileDir, with Isolate, gets a CPU profile of every target's server
	// process, DIR/TARGET.pprof, in which every request of a store's server runs
	// under the pprof label variant=NAME (baseline, first, replay, …), so that
	// go tool pprof -tagfocus 'variant=^first$' shows one variant's CPU alone
	// (Fiber's server, a fasthttp one, is profiled without labels). Requests of
	// all the concurrencies of the run share one profile.
	CPUProfileDir string

	serverCPU, loaderCPU int      // -1: not pinned
	serverEnv            []string // added to the server processes' environment
}

func (c *Config) defaults() {
	if c.Stores == nil {
		c.Stores = Stores
	}
	if c.Duration <= 0 {
		c.Duration = 3 * time.Second
	}
	if c.Rounds <= 0 {
		c.Rounds = 3
	}
	if len(c.Concurrency) == 0 {
		c.Concurrency = []int{1, 8, 64}
	}
	if c.PoolSize <= 0 {
		c.PoolSize = 32
	}
	if c.ReplayKeys <= 0 {
		c.ReplayKeys = 512
	}
	if c.PostgresURL == "" {
		c.PostgresURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	if c.MySQLDSN == "" {
		c.MySQLDSN = "root@tcp(127.0.0.1:3306)/test"
	}
	if c.RedisURL == "" {
		c.RedisURL = "redis://127.0.0.1:6379/0"
	}
	if len(c.GrowthSizes) == 0 {
		c.GrowthSizes = []int{10_000, 1_000_000, 10_000_000}
	}
	if c.GrowthClaims <= 0 {
		c.GrowthClaims = 3000
	}
	if c.JanitorBacklog == 0 {
		c.JanitorBacklog = 1_000_000
	}
	if c.GrowthConns <= 0 {
		c.GrowthConns = 2
	}
	if c.GrowthChunk <= 0 {
		c.GrowthChunk = 1_000_000
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
	if c.MemoryRecords == 0 {
		c.MemoryRecords = 150_000
	}
	c.serverCPU, c.loaderCPU = -1, -1
	if c.Isolate && c.Pin {
		c.serverCPU, c.loaderCPU = 0, 1
	}
}

// Result is one cell: a store (or Fiber), a variant and a number of concurrent
// clients, aggregated over all rounds.
type Result struct {
	Target      string  `json:"target"`
	Variant     string  `json:"variant"`
	Concurrency int     `json:"concurrency"`
	Requests    int64   `json:"requests"`
	Seconds     float64 `json:"seconds"`
	// Throughput is answered requests per second.
	Throughput float64 `json:"throughput_rps"`
	P50Micros  float64 `json:"p50_us"`
	P99Micros  float64 `json:"p99_us"`
	MeanMicros float64 `json:"mean_us"`
	// Status counts answers by status; replays are counted as "201 replayed".
	Status map[string]int64 `json:"status"`
	// Executed counts 2xx answers that were not replays, Replayed answers with
	// Idempotent-Replayed: true, InFlight 409 answers, Other everything else.
	Executed int64 `json:"executed"`
	Replayed int64 `json:"replayed"`
	InFlight int64 `json:"in_flight_409"`
	Other    int64 `json:"other"`
	// Rows is how many orders the handler inserted during the cell, counted in
	// the backend before and after each slice.
	Rows int64 `json:"rows_inserted"`
	// Keys is how many distinct keys the cell sent (0 for the baseline).
	Keys int64 `json:"keys"`
	// Ratio is Throughput divided by the baseline's at the same concurrency,
	// measured in the same rounds.
	Ratio float64 `json:"ratio_to_baseline"`
	// OverheadMicros is the mean latency minus the baseline's: what the
	// middleware adds per request.
	OverheadMicros float64 `json:"overhead_us"`
	// ServerCPUMicros is the server process's CPU time (user + system) per
	// answered request, and ExtraCPUMicros that minus the baseline's: what the
	// middleware costs in CPU. Measured with Config.Isolate only; -1 otherwise.
	ServerCPUMicros float64 `json:"server_cpu_us_per_req"`
	ExtraCPUMicros  float64 `json:"extra_server_cpu_us_per_req"`
	// DBCPUMicros is the database's CPU time per request: the PostgreSQL
	// backends of the measured pool, or the whole MariaDB or Redis server process
	// (which includes its background threads and anyone else's queries). -1 when
	// not measured (memstore, SQLite in process, Fiber, a database elsewhere).
	DBCPUMicros float64 `json:"db_cpu_us_per_req"`
	// RoundTrips and Statements are per request, counted on the server's
	// database connections (see wireCounter); -1 when not counted.
	RoundTrips float64 `json:"db_round_trips_per_req"`
	Statements float64 `json:"db_statements_per_req"`
	// Allocs and AllocBytes are the server process's heap allocations per
	// request (Config.Isolate only; -1 otherwise).
	Allocs     float64 `json:"allocs_per_req"`
	AllocBytes float64 `json:"alloc_bytes_per_req"`
	// LoaderBusy is the CPU the load generator used over the cell's time, as a
	// fraction of one CPU (Config.Isolate only): near 1 with Config.Pin, the
	// generator, not the server, limited the throughput.
	LoaderBusy float64 `json:"loader_busy"`
	// Check is empty when the counts are consistent (every executed request
	// inserted exactly one row, replays inserted none, no errors); otherwise it
	// says what is wrong.
	Check string `json:"check,omitempty"`
}

// Target describes one server under test.
type Target struct {
	Name    string `json:"name"`
	Version string `json:"version"`
	Store   string `json:"store"`
	Orders  string `json:"orders"`
}

// Machine describes where the run happened.
type Machine struct {
	CPUs      int     `json:"cpus"`
	CPUModel  string  `json:"cpu_model"`
	MemoryGiB float64 `json:"memory_gib"`
	GoVersion string  `json:"go_version"`
	OS        string  `json:"os"`
	LoadStart string  `json:"loadavg_start"`
	LoadEnd   string  `json:"loadavg_end"`
}

// Report is everything a run measured.
type Report struct {
	Started  time.Time         `json:"started"`
	Seconds  float64           `json:"seconds"`
	Command  string            `json:"command,omitempty"`
	Machine  Machine           `json:"machine"`
	Duration string            `json:"cell_duration"`
	Rounds   int               `json:"rounds"`
	Targets  []Target          `json:"targets"`
	Skipped  map[string]string `json:"skipped,omitempty"`
	Results  []Result          `json:"results"`
	Growth   *GrowthReport     `json:"growth,omitempty"`
	// Isolated and Pinned say how the run was made (Config.Isolate, Config.Pin).
	Isolated bool `json:"isolated"`
	Pinned   bool `json:"pinned"`
	// Memory is the memory-per-record phase (Config.Isolate).
	Memory []MemoryResult `json:"memory,omitempty"`
	Goals  []Goal         `json:"targets_checked"`
}

// Failed reports whether any cell's consistency check failed.
func (r *Report) Failed() bool {
	for _, res := range r.Results {
		if res.Check != "" {
			return true
		}
	}
	for _, m := range r.Memory {
		if m.Check != "" {
			return true
		}
	}
	return false
}

// Run benchmarks every configured store (and Fiber) and, with cfg.Growth, the
// PostgreSQL growth case. A store that cannot be reached is skipped and listed in
// Report.Skipped; any other setup error ends the run.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg.defaults()
	rep := &Report{
		Started: time.Now(), Machine: machine(), Duration: cfg.Duration.String(), Rounds: cfg.Rounds,
		Skipped: map[string]string{},
	}
	suffix := randomHex(4)
	runID := randomHex(4) // the first 8 characters of every key
	targets := slices.Clone(cfg.Stores)
	if cfg.Fiber {
		targets = append(targets, "fiber")
	}
	for ti, name := range targets {
		if err := ctx.Err(); err != nil {
			return rep, err
		}
		var t *target
		var err error
		switch {
		case cfg.Isolate:
			scfg := cfg
			if cfg.CPUProfileDir != "" {
				scfg.serverEnv = append(slices.Clone(cfg.serverEnv), CPUProfileEnv+"="+filepath.Join(cfg.CPUProfileDir, name+".pprof"))
			}
			t, _, err = startChild(ctx, name, &scfg, suffix)
		case name == "fiber":
			t, err = setupFiber()
		default:
			t, err = setupTarget(ctx, name, &cfg, suffix)
		}
		if err != nil {
			if isUnavailable(err) {
				fmt.Fprintf(cfg.Log, "store not available: %s: %v (skipped)\n", name, err)
				rep.Skipped[name] = err.Error()
				continue
			}
			return rep, fmt.Errorf("set up %s: %w", name, err)
		}
		if t.orders == "" {
			t.orders = t.backend.where()
		}
		rep.Targets = append(rep.Targets, Target{Name: t.name, Version: t.version, Store: t.store, Orders: t.orders})
		var res []Result
		restore := func() {}
		if cfg.loaderCPU >= 0 {
			restore, err = pinSelf(cfg.loaderCPU)
		}
		if err == nil {
			res, err = runTarget(ctx, t, &cfg, fmt.Sprintf("%s%02x", runID[:6], ti))
			restore()
		}
		t.close()
		rep.Results = append(rep.Results, res...)
		if err != nil {
			return rep, fmt.Errorf("%s: %w", name, err)
		}
	}
	rep.Isolated, rep.Pinned = cfg.Isolate, cfg.loaderCPU >= 0
	if cfg.Isolate && cfg.MemoryRecords > 0 && slices.Contains(cfg.Stores, "memory") {
		m, err := runMemory(ctx, &cfg, suffix)
		rep.Memory = m
		if err != nil {
			return rep, fmt.Errorf("memory per record: %w", err)
		}
	}
	if cfg.Growth {
		g, err := runGrowth(ctx, &cfg, suffix)
		rep.Growth = g
		if err != nil {
			if isUnavailable(err) {
				fmt.Fprintf(cfg.Log, "store not available: growth: %v (skipped)\n", err)
				rep.Skipped["growth"] = err.Error()
			} else {
				return rep, fmt.Errorf("growth: %w", err)
			}
		}
	}
	rep.Machine.LoadEnd = loadavg()
	rep.Seconds = time.Since(rep.Started).Seconds()
	rep.Goals = goals(rep)
	return rep, nil
}

// cellKey identifies an aggregated cell.
type cellKey struct {
	variant string
	conc    int
}

type cellAcc struct {
	s    sample
	rows int64
	keys int64
	// Differences of the server's counters over the cell's slices (see
	// serverStats); a negative field was not measured.
	cpu, dbCPU, roundTrips, statements, mallocs, allocBytes int64
	loaderCPU                                               int64
}

// add accumulates the differences between two snapshots.
func (a *cellAcc) add(before, after serverStats, isolated bool) {
	a.rows += after.Rows - before.Rows
	diff := func(acc *int64, b, e int64) {
		if *acc < 0 || b < 0 || e < 0 {
			*acc = -1
			return
		}
		*acc += e - b
	}
	if isolated {
		diff(&a.cpu, before.CPUNanos, after.CPUNanos)
		diff(&a.mallocs, int64(before.Mallocs), int64(after.Mallocs))
		diff(&a.allocBytes, int64(before.AllocBytes), int64(after.AllocBytes))
	} else {
		a.cpu, a.mallocs, a.allocBytes, a.loaderCPU = -1, -1, -1, -1
	}
	diff(&a.dbCPU, before.DBCPUNanos, after.DBCPUNanos)
	diff(&a.roundTrips, before.RoundTrips, after.RoundTrips)
	diff(&a.statements, before.Statements, after.Statements)
}

// runTarget runs every variant of t at every concurrency, interleaved in rounds.
func runTarget(ctx context.Context, t *target, cfg *Config, runID string) ([]Result, error) {
	kg := &keyGen{runID: runID}
	// Complete the replay keys first, unmeasured.
	pool := make([]string, cfg.ReplayKeys)
	for i := range pool {
		pool[i] = kg.key(tagPool, int64(i))
	}
	if err := prepare(ctx, t, pool); err != nil {
		return nil, fmt.Errorf("completing %d keys for the replay case: %w", len(pool), err)
	}
	slice := cfg.Duration / time.Duration(cfg.Rounds)
	acc := map[cellKey]*cellAcc{}
	statsClient := newClient(1)
	defer statsClient.CloseIdleConnections()
	statsURL := t.url + statsPath
	for _, conc := range cfg.Concurrency {
		client := newClient(conc)
		// Warm up: open the connections and let the server settle, unmeasured.
		closedLoop(ctx, client, t.url+"/bare/orders", nil, conc, min(slice/4, 250*time.Millisecond), 0)
		for round := 0; round < cfg.Rounds; round++ {
			n := len(t.variants)
			for j := 0; j < n; j++ {
				v := t.variants[(j+round)%n]
				keys, distinct := kg.keys(v.keys, pool)
				before, err := fetchStats(ctx, statsClient, statsURL, false)
				if err != nil {
					return nil, fmt.Errorf("counting orders: %w", err)
				}
				load0 := selfCPU()
				s := closedLoop(ctx, client, t.url+v.path, keys, conc, slice, 0)
				load1 := selfCPU()
				after, err := fetchStats(ctx, statsClient, statsURL, false)
				if err != nil {
					return nil, fmt.Errorf("counting orders: %w", err)
				}
				if err := ctx.Err(); err != nil {
					return nil, err
				}
				k := cellKey{v.name, conc}
				a := acc[k]
				if a == nil {
					a = &cellAcc{}
					acc[k] = a
				}
				a.s.merge(s)
				a.add(before, after, t.pid != 0)
				if a.loaderCPU >= 0 {
					a.loaderCPU += load1 - load0
				}
				a.keys += distinct(int64(len(s.latencies)))
			}
		}
		client.CloseIdleConnections()
		for _, v := range t.variants {
			a := acc[cellKey{v.name, conc}]
			fmt.Fprintf(cfg.Log, "%-8s %-16s c=%-3d %8.0f req/s  (%d requests)\n", t.name, v.name, conc, float64(len(a.s.latencies))/a.s.elapsed.Seconds(), len(a.s.latencies))
		}
	}
	var out []Result
	for _, conc := range cfg.Concurrency {
		var base *Result
		for _, v := range t.variants {
			a := acc[cellKey{v.name, conc}]
			r := result(t, v, conc, a)
			if v.name == VariantBaseline {
				base = &r
			}
			if base != nil && base.Throughput > 0 {
				r.Ratio = r.Throughput / base.Throughput
				r.OverheadMicros = r.MeanMicros - base.MeanMicros
				if r.ServerCPUMicros >= 0 && base.ServerCPUMicros >= 0 {
					r.ExtraCPUMicros = r.ServerCPUMicros - base.ServerCPUMicros
				}
			}
			out = append(out, r)
		}
	}
	return out, nil
}

// result turns an accumulated cell into a Result and checks its counts.
func result(t *target, v variant, conc int, a *cellAcc) Result {
	s := &a.s
	p50, p99, mean := latencyStats(s.latencies)
	r := Result{
		Target: t.name, Variant: v.name, Concurrency: conc,
		Requests: int64(len(s.latencies)), Seconds: s.elapsed.Seconds(),
		P50Micros: micros(p50), P99Micros: micros(p99), MeanMicros: micros(mean),
		Status: s.status, Executed: s.executed, Replayed: s.replayed, InFlight: s.inFlight, Other: s.other,
		Rows: a.rows, Keys: a.keys,
	}
	if r.Seconds > 0 {
		r.Throughput = float64(r.Requests) / r.Seconds
	}
	perReq := func(v int64, scale float64) float64 {
		if v < 0 || r.Requests == 0 {
			return -1
		}
		return float64(v) / scale / float64(r.Requests)
	}
	r.ServerCPUMicros, r.DBCPUMicros = perReq(a.cpu, 1e3), perReq(a.dbCPU, 1e3)
	r.ExtraCPUMicros = -1
	r.RoundTrips, r.Statements = perReq(a.roundTrips, 1), perReq(a.statements, 1)
	r.Allocs, r.AllocBytes = perReq(a.mallocs, 1), perReq(a.allocBytes, 1)
	r.LoaderBusy = -1
	if a.loaderCPU >= 0 && r.Seconds > 0 {
		r.LoaderBusy = float64(a.loaderCPU) / 1e9 / r.Seconds
	}
	if !t.replayHeader && v.keys != keysNone {
		// Fiber does not mark replays: every 2xx answer that inserted no row was one.
		ok := s.executed
		r.Executed = min(a.rows, ok)
		r.Replayed = ok - r.Executed
		r.Status = map[string]int64{}
		for k, n := range s.status {
			r.Status[k] = n
		}
		if r.Replayed > 0 {
			r.Status["201"] -= r.Replayed
			r.Status["201 replayed (by row count)"] = r.Replayed
		}
	}
	var problems []string
	if r.Requests == 0 {
		problems = append(problems, "no request was answered")
	}
	if r.Other > 0 {
		problems = append(problems, fmt.Sprintf("%d answers were errors or unexpected statuses", r.Other))
	}
	if a.rows != r.Executed {
		problems = append(problems, fmt.Sprintf("%d rows were inserted for %d executed requests", a.rows, r.Executed))
	}
	switch v.keys {
	case keysFresh:
		if r.Replayed > 0 || r.InFlight > 0 {
			problems = append(problems, fmt.Sprintf("fresh keys got %d replays and %d 409s", r.Replayed, r.InFlight))
		}
	case keysPool:
		if r.Executed > 0 {
			problems = append(problems, fmt.Sprintf("%d replays of completed keys executed the handler again", r.Executed))
		}
	case keysHot:
		if r.Executed > r.Keys {
			problems = append(problems, fmt.Sprintf("%d executions for %d distinct keys", r.Executed, r.Keys))
		}
	}
	r.Check = strings.Join(problems, "; ")
	return r
}

func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// Key tags keep the key spaces of the cases apart.
const (
	tagPool  = 0x0001
	tagFresh = 0x0002
	tagHot   = 0x0003
)

// keyGen makes 36-character keys in UUID form (Fiber's default check wants that
// length): a hash of the counter first, so that keys spread over the whole key
// space like the random UUIDs real clients send (sequential keys would all land
// on the last page of a B-tree index), then the tag, the run ID and the counter,
// which make every key of a run unique.
type keyGen struct {
	runID string // 8 hex digits
	fresh atomic.Int64
	hot   atomic.Int64
}

func (g *keyGen) key(tag uint16, n int64) string {
	h := splitmix64(uint64(n) ^ uint64(tag)<<48)
	return fmt.Sprintf("%08x-%04x-%s-%s-%012x", uint32(h>>32), tag, g.runID[:4], g.runID[4:8], n)
}

// keyTag returns the tag of a key that key made, and false for any other key.
func keyTag(k string) (uint16, bool) {
	if len(k) < 14 || k[8] != '-' || k[13] != '-' {
		return 0, false
	}
	t, err := strconv.ParseUint(k[9:13], 16, 16)
	return uint16(t), err == nil
}

// splitmix64 is a bijective mix of x (Steele, Lea and Flood's SplitMix64 finalizer).
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// keys returns the key function of one slice of a variant, and a function that
// reports how many distinct keys n requests used.
func (g *keyGen) keys(kind keyKind, pool []string) (keyFunc, func(n int64) int64) {
	switch kind {
	case keysFresh:
		return func(int64) string { return g.key(tagFresh, g.fresh.Add(1)) }, func(n int64) int64 { return n }
	case keysPool:
		return func(i int64) string { return pool[i%int64(len(pool))] },
			func(n int64) int64 { return min(n, int64(len(pool))) }
	case keysHot:
		base := g.hot.Add(1 << 32) // a new key space per slice
		return func(i int64) string { return g.key(tagHot, base+i/HotKeyEvery) },
			func(n int64) int64 { return (n + HotKeyEvery - 1) / HotKeyEvery }
	}
	return nil, func(int64) int64 { return 0 }
}

// prepare completes every key of pool once, with 8 clients, and checks that each
// was executed.
func prepare(ctx context.Context, t *target, pool []string) error {
	client := newClient(8)
	defer client.CloseIdleConnections()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(len(pool)) || ctx.Err() != nil {
					return
				}
				status, replayed, err := send(ctx, client, t.url+"/idem/orders", pool[i])
				if err == nil && (status != http.StatusCreated || replayed) {
					err = fmt.Errorf("key %s: status %d, replayed %v; want a first execution", pool[i], status, replayed)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func machine() Machine {
	m := Machine{CPUs: runtime.NumCPU(), GoVersion: runtime.Version(), OS: runtime.GOOS + "/" + runtime.GOARCH, LoadStart: loadavg()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb float64
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "MemTotal:") {
				_, _ = fmt.Sscanf(strings.TrimPrefix(line, "MemTotal:"), "%g", &kb)
			}
		}
		m.MemoryGiB = float64(int(kb/1024/1024*10+0.5)) / 10
	}
	return m
}

// loadAvg1 is /proc/loadavg's 1-minute figure, or 0.
func loadAvg1() float64 {
	f := strings.Fields(loadavg())
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}
