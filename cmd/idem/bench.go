package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem/internal/bench"
	"github.com/idemkit/idem/internal/dbopen"
	"github.com/idemkit/idem/internal/orders"
)

func init() {
	register(&command{name: "bench", summary: "benchmark idem on each store against a bare handler and Fiber's middleware", run: runBench})
}

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "load" {
		return runBenchLoad(ctx, args[1:], stdout, stderr)
	}
	fs := flag.NewFlagSet("idem bench", flag.ContinueOnError)
	stores := fs.String("stores", strings.Join(bench.Stores, ","), "comma-separated stores to benchmark: "+strings.Join(bench.Stores, ", ")+" (or the store packages' names: memstore, sqlitestore, pgstore, mysqlstore, redisstore)")
	duration := fs.Duration("duration", 3*time.Second, "measured time per cell (store × variant × clients), split over the rounds")
	rounds := fs.Int("rounds", 3, "interleaved rounds per cell: each round runs every variant once, so drift hits all alike")
	concurrency := fs.String("concurrency", "1,8,64", "comma-separated numbers of concurrent closed-loop clients")
	fiber := fs.Bool("fiber", true, "also benchmark Fiber v2's idempotency middleware (in-memory storage) for comparison with memstore")
	pool := fs.Int("pool", 32, "connection pool size for PostgreSQL and MySQL")
	replayKeys := fs.Int("replay-keys", 512, "keys completed before the cells, which the replay case cycles through")
	out := fs.String("out", filepath.Join("bench", "out"), "directory for results.md, results.json and throughput.svg")
	pgURL := fs.String("postgres", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable", "PostgreSQL `URL`, postgres://USER[:PASS]@HOST:PORT/DB, as idem demo --db takes it")
	myURL := fs.String("mysql", benchMySQLDefault, "MySQL/MariaDB `URL`, mysql://USER[:PASS]@HOST:PORT/DB[?go-sql-driver options], as idem demo --db takes it")
	redisURL := fs.String("redis", "redis://127.0.0.1:6379/0", "Redis `URL`, redis://HOST:PORT/DB, as idem demo --keys takes it")
	growth := fs.Bool("growth", false, "also run the PostgreSQL growth benchmark: claim latency at growing table sizes, and during a janitor sweep")
	growthSizes := fs.String("growth-sizes", "10000,1000000,10000000", "comma-separated record counts for --growth")
	growthClaims := fs.Int("growth-claims", 3000, "claims timed at each size for --growth")
	backlog := fs.Int("janitor-backlog", 1_000_000, "expired records (the oldest of the table) the janitor deletes while claims are timed (--growth); negative skips it")
	growthConns := fs.Int("growth-conns", 2, "connections that bulk-load the table in parallel for --growth")
	growthChunk := fs.Int("growth-chunk", 1_000_000, "records per COPY transaction, sorted by key, for --growth: larger chunks (5000000–10000000) load tables of tens of millions of records faster (each chunk walks the primary key once); the loader holds 24 bytes per record of a chunk per connection")
	growthBudget := fs.Duration("growth-budget", 0, "for --growth: skip the sizes whose load, projected at the last step's rate, would not end within this time of the run's start (0: no limit)")
	isolate := fs.Bool("isolate", true, "run each server in a process of its own (this binary, re-executed) and measure its CPU, allocations and memory per request; false runs server and load generator in one process")
	pin := fs.Bool("pin", true, "with --isolate, pin the server process to CPU 0 and the load generator to CPU 1 with taskset (needs 2 CPUs and taskset)")
	memRecords := fs.Int("memory-records", 150_000, "with --isolate, first-time requests sent to a fresh memstore and a fresh Fiber server to measure memory per stored record; 0 skips it")
	overhead := fs.Bool("overhead", false, "measure only what idem on memstore and Fiber's idempotency middleware add to their own bare servers, in server CPU per request (issue 30's method): a fresh server process per slice at GOMAXPROCS=1 on CPU 0, a separate fasthttp loader process (idem bench load) on CPU 1, --rounds interleaved rounds; writes overhead.md and overhead.json to --out. Takes --concurrency, --duration, --rounds, --replay-keys, --warmup, --pin, --out")
	cpuprofile := fs.String("cpuprofile", "", "write a CPU profile of every server process into this `directory`: with --overhead one per slice (TARGET-VARIANT-cN-rR.pprof); otherwise one per store (TARGET.pprof, needs --isolate), each request labelled with its variant: go tool pprof -tagfocus 'variant=^first$'")
	warmup := fs.Duration("warmup", 300*time.Millisecond, "with --overhead, unmeasured load before every measured slice")
	serve := fs.Bool("serve", false, "internal: be the server process of an isolated run (the spec is in "+bench.ServeEnv+")")
	fs.Usage = storeUsage(fs, benchUsage, benchEnvVars)
	pos, code, ok := parseFlags(fs, args, benchEnvVars, stdout, stderr)
	if !ok {
		return code
	}
	if len(pos) > 0 {
		return storeUsageError(stderr, fs, fmt.Sprintf("unexpected argument %q; all options are flags", pos[0]))
	}
	myDSN, err := benchMySQL(*myURL)
	if err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	if _, err := benchURL("--postgres", *pgURL, orders.Postgres, "postgres://USER[:PASS]@HOST:PORT/DB?sslmode=disable"); err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	if _, err := dbopen.ParseRedis("--redis", *redisURL); err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	if *serve {
		if err := bench.Serve(ctx, os.Getenv(bench.ServeEnv), os.Stdin, stdout); err != nil {
			fmt.Fprintf(stderr, "idem bench --serve: %v\n", err)
			return exitFailure
		}
		return exitOK
	}
	if *overhead {
		return runOverhead(ctx, args, fs, *concurrency, *duration, *rounds, *replayKeys, *warmup, *pin, *out, *cpuprofile, stdout, stderr)
	}
	cfg := bench.Config{
		Duration: *duration, Rounds: *rounds, Fiber: *fiber, PoolSize: *pool, ReplayKeys: *replayKeys,
		PostgresURL: *pgURL, MySQLDSN: myDSN, RedisURL: *redisURL,
		Growth: *growth, GrowthClaims: *growthClaims, JanitorBacklog: *backlog, GrowthConns: *growthConns, GrowthChunk: *growthChunk, GrowthBudget: *growthBudget, Log: stderr,
	}
	if *backlog == 0 {
		cfg.JanitorBacklog = -1
	}
	cfg.MemoryRecords = *memRecords
	if *memRecords == 0 {
		cfg.MemoryRecords = -1
	}
	if *cpuprofile != "" {
		if !*isolate {
			return storeUsageError(stderr, fs, "--cpuprofile profiles the server processes; it needs --isolate (the default)")
		}
		if err := os.MkdirAll(*cpuprofile, 0o755); err != nil {
			fmt.Fprintf(stderr, "idem bench: --cpuprofile: %v\n", err)
			return exitFailure
		}
		cfg.CPUProfileDir = *cpuprofile
	}
	if *isolate {
		exe, err := os.Executable()
		if err != nil {
			fmt.Fprintf(stderr, "idem bench: --isolate needs this binary's path to start the servers: %v; or run with --isolate=false\n", err)
			return exitFailure
		}
		cfg.Isolate, cfg.ServerCommand = true, []string{exe, "bench", "--serve"}
		if *pin {
			if _, err := exec.LookPath("taskset"); err != nil || runtime.NumCPU() < 2 {
				fmt.Fprintf(stderr, "idem bench: not pinning (--pin needs taskset and 2 CPUs; %d CPUs here)\n", runtime.NumCPU())
			} else {
				cfg.Pin = true
			}
		}
	}
	if cfg.Concurrency, err = benchInts(*concurrency); err != nil {
		return storeUsageError(stderr, fs, "--concurrency: "+err.Error())
	}
	if cfg.GrowthSizes, err = benchInts(*growthSizes); err != nil {
		return storeUsageError(stderr, fs, "--growth-sizes: "+err.Error())
	}
	for _, s := range strings.Split(*stores, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		name, known := benchStoreName(s)
		if !known {
			return storeUsageError(stderr, fs, fmt.Sprintf("--stores: unknown store %q; use some of %s", s, strings.Join(bench.Stores, ",")))
		}
		cfg.Stores = append(cfg.Stores, name)
	}
	if len(cfg.Stores) == 0 && !cfg.Fiber && !cfg.Growth {
		return storeUsageError(stderr, fs, "nothing to run; name at least one store with --stores")
	}
	if len(cfg.Stores) == 0 {
		cfg.Stores = []string{}
	}
	if *duration < 10*time.Millisecond || *rounds < 1 || *pool < 1 || *replayKeys < 1 || *memRecords < 0 || *growthClaims < 1 {
		return storeUsageError(stderr, fs, "--duration must be at least 10ms, --rounds, --pool, --replay-keys and --growth-claims at least 1, --memory-records at least 0")
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		fmt.Fprintf(stderr, "idem bench: create the output directory: %v\n", err)
		return exitFailure
	}
	rep, err := bench.Run(ctx, cfg)
	if rep != nil {
		rep.Command = strings.TrimSpace("idem bench " + strings.Join(args, " "))
		if werr := writeBenchOutputs(rep, *out, stdout); werr != nil {
			fmt.Fprintf(stderr, "idem bench: %v\n", werr)
			return exitFailure
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "idem bench: %v\n", err)
		return exitFailure
	}
	if rep.Failed() {
		fmt.Fprintln(stderr, "idem bench: some cells failed their consistency check (see the check column)")
		return exitFailure
	}
	return exitOK
}

// benchStoreAliases are the other names --stores takes for bench.Stores: the
// store packages' names (memstore, pgstore, …) and the databases' own.
var benchStoreAliases = map[string]string{
	"memstore": "memory", "sqlitestore": "sqlite", "pgstore": "postgres", "postgresql": "postgres",
	"mysqlstore": "mysql", "mariadb": "mysql", "redisstore": "redis",
}

// benchStoreName returns the bench.Stores name of s, a name or an alias of one
// in any letter case, and whether there is one.
func benchStoreName(s string) (string, bool) {
	s = strings.ToLower(s)
	if a, ok := benchStoreAliases[s]; ok {
		s = a
	}
	for _, k := range bench.Stores {
		if k == s {
			return s, true
		}
	}
	return "", false
}

// writeBenchOutputs prints the markdown table and writes results.md,
// results.json and throughput.svg into dir.
func writeBenchOutputs(rep *bench.Report, dir string, stdout io.Writer) error {
	if err := rep.WriteMarkdown(stdout); err != nil {
		return err
	}
	files := []struct {
		name  string
		write func(io.Writer) error
	}{
		{"results.md", rep.WriteMarkdown},
		{"results.json", rep.WriteJSON},
		{"throughput.svg", rep.WriteSVG},
	}
	for _, f := range files {
		path := filepath.Join(dir, f.name)
		fh, err := os.Create(path)
		if err != nil {
			return fmt.Errorf("write %s: %w", path, err)
		}
		err = f.write(fh)
		if cerr := fh.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("write %s: %w", path, err)
		}
	}
	fmt.Fprintf(stdout, "\nWrote %s, %s and %s.\n", filepath.Join(dir, "results.md"), filepath.Join(dir, "results.json"), filepath.Join(dir, "throughput.svg"))
	return nil
}

func benchInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%q is not a positive whole number", f)
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return nil, errors.New("give at least one number")
	}
	return out, nil
}

// benchEnvVars are the environment variables that set bench's server URLs, the
// same the tests of the stores read.
var benchEnvVars = []storeEnvVar{
	{"postgres", "IDEM_TEST_POSTGRES_URL"}, {"mysql", "IDEM_TEST_MYSQL_URL"}, {"redis", "IDEM_TEST_REDIS_URL"},
}

const benchUsage = `Usage: idem bench [flags]

Starts an orders service on 127.0.0.1 for each store, without idem (baseline) and with it
(first-time keys, replays, one hot key; PostgreSQL also single-transaction), drives it with
N closed-loop clients, and reports throughput, p50/p99 and the ratio to the baseline of the
same run, as a markdown table on stdout, results.json and throughput.svg in --out.
With --isolate (the default) each server runs in a process of its own, pinned to CPU 0 with
--pin, the load generator on CPU 1, and the server's CPU, allocations, database round trips
and statements per request are reported beside throughput.

With --overhead it measures only what idem on memstore and Fiber's idempotency
middleware each add to their own bare server, in server CPU per request: a fresh
server process per slice (GOMAXPROCS=1, CPU 0), a separate fasthttp load generator
process (idem bench load, GOMAXPROCS=1, CPU 1), interleaved rounds, the server's CPU
read from /proc around the measured window; overhead.md and overhead.json in --out.

The servers are named by URL, in the forms idem demo --db and --keys take; the
environment variables in brackets set them too (a flag wins).

Example:
  idem bench --stores memory,postgres --concurrency 1,8 --duration 2s
  idem bench --stores mysql --mysql mysql://root@127.0.0.1:3306/test
  idem bench --overhead --concurrency 1,8,64 --duration 4s --rounds 3

Exit codes: 0 done, 1 a cell's counts are inconsistent (a replay that executed, a
lost or doubled row) or a store failed, 2 bad usage.

Flags:
`

// benchMySQLDefault is the default of --mysql. It sets the go-sql-driver options
// a user who wants MySQL fast would: multiStatements=true, which mysqlstore
// detects and uses to send each step's statements in one round trip, and
// interpolateParams=true, which sends the bare handler's INSERT in one round
// trip instead of two (prepare, execute). The baseline and idem share the pool,
// so both get them.
const benchMySQLDefault = "mysql://root@127.0.0.1:3306/test?multiStatements=true&interpolateParams=true"

// benchMySQL turns --mysql into a go-sql-driver DSN. It takes what idem demo
// --db takes: the mysql:// URL or the DSN form (root@tcp(127.0.0.1:3306)/test).
func benchMySQL(raw string) (dsn string, err error) {
	t, err := benchURL("--mysql", raw, orders.MySQL, "mysql://USER[:PASS]@HOST:PORT/DB, such as mysql://root@127.0.0.1:3306/test")
	return t.DSN, err
}

// benchURL parses the URL of a server flag, which must be of dialect d; use
// says what to write instead.
func benchURL(flag, raw string, d orders.Dialect, use string) (dbopen.Target, error) {
	name := map[orders.Dialect]string{orders.Postgres: "PostgreSQL", orders.MySQL: "MySQL"}[d]
	t, err := dbopen.ParseDBFlag(flag, raw)
	if err == nil && t.Dialect != d {
		err = fmt.Errorf("%s %s is not a %s URL; use %s", flag, t.Display, name, use)
	}
	if err != nil && !strings.HasPrefix(raw, string(d)) {
		err = fmt.Errorf("%s %q is not a %s URL; use %s", flag, raw, name, use)
	}
	return t, err
}
