package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"
)

// ServeEnv is the environment variable that carries the server spec (JSON) to a
// server process started by Run with Config.Isolate; the command it runs
// (Config.ServerCommand) must hand it to Serve.
const ServeEnv = "IDEM_BENCH_SERVE"

// CPUProfileEnv, when set for a server process, names the file Serve writes a
// CPU profile of the whole time it serves to (idem bench --overhead
// --cpuprofile DIR sets it for every server process).
const CPUProfileEnv = "IDEM_BENCH_CPUPROFILE"

// statsPath is the server's bookkeeping endpoint: a snapshot of serverStats.
const statsPath = "/_bench/stats"

// serverStats is a snapshot of cumulative counters of a server process. The
// harness takes one before and one after every slice and divides the
// differences by the requests of the slice.
type serverStats struct {
	Rows       int64  `json:"rows"`         // orders stored so far
	CPUNanos   int64  `json:"cpu_ns"`       // user + system CPU of the server process
	Mallocs    uint64 `json:"mallocs"`      // heap allocations of the server process
	AllocBytes uint64 `json:"alloc_bytes"`  // bytes allocated on the heap
	RoundTrips int64  `json:"round_trips"`  // to the database (see wireCounter); -1 when not counted
	Statements int64  `json:"statements"`   // sent to the database; -1 when not counted
	DBCPUNanos int64  `json:"db_cpu_ns"`    // CPU of the database (see target.dbCPU); -1 when not measured
	HeapLive   uint64 `json:"heap_live"`    // live heap after a GC, only when asked (?gc=1)
	RSSKiB     int64  `json:"rss_kib"`      // resident set size
	PeakRSSKiB int64  `json:"peak_rss_kib"` // peak resident set size (VmHWM)
}

// stats takes a snapshot of the server's counters; gc runs a garbage
// collection first and reports the live heap.
func (t *target) snapshot(ctx context.Context, gc bool) (serverStats, error) {
	var s serverStats
	s.RoundTrips, s.Statements, s.DBCPUNanos = -1, -1, -1
	if t.wire != nil {
		s.RoundTrips, s.Statements = t.wire.roundTrips.Load(), t.wire.statements.Load()
	}
	if t.dbCPU != nil {
		s.DBCPUNanos = t.dbCPU(ctx)
	}
	var err error
	if s.Rows, err = t.backend.count(ctx); err != nil {
		return s, err
	}
	if gc {
		runtime.GC()
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	s.Mallocs, s.AllocBytes = ms.Mallocs, ms.TotalAlloc
	if gc {
		s.HeapLive = ms.HeapAlloc
	}
	s.RSSKiB, s.PeakRSSKiB = procKiB(os.Getpid())
	s.CPUNanos = selfCPU()
	return s, nil
}

// statsHandler serves snapshot as JSON on statsPath.
func statsHandler(t *target) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s, err := t.snapshot(r.Context(), r.URL.Query().Get("gc") == "1")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(s)
	})
}

// fetchStats asks the server of t for a snapshot.
func fetchStats(ctx context.Context, client *http.Client, url string, gc bool) (serverStats, error) {
	var s serverStats
	if gc {
		url += "?gc=1"
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return s, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return s, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		return s, fmt.Errorf("server stats: %s: %s", resp.Status, strings.TrimSpace(string(b)))
	}
	return s, json.NewDecoder(resp.Body).Decode(&s)
}

// serveSpec is what the parent tells a server process to set up.
type serveSpec struct {
	Target      string `json:"target"` // a store name or "fiber"
	Suffix      string `json:"suffix"`
	PoolSize    int    `json:"pool_size"`
	PostgresURL string `json:"postgres_url"`
	MySQLDSN    string `json:"mysql_dsn"`
	RedisURL    string `json:"redis_url"`
}

// hello is the first line a server process prints: where it listens and what
// it serves.
type hello struct {
	PID          int           `json:"pid"`
	URL          string        `json:"url"`
	Version      string        `json:"version"`
	Store        string        `json:"store"`
	Orders       string        `json:"orders"`
	ReplayHeader bool          `json:"replay_header"`
	Variants     []wireVariant `json:"variants"`
	Error        string        `json:"error,omitempty"`
	Unavailable  bool          `json:"unavailable,omitempty"`
}

type wireVariant struct {
	Name string  `json:"name"`
	Path string  `json:"path"`
	Keys keyKind `json:"keys"`
}

// Serve is the server process of an isolated run: it sets up the target that
// spec (the value of ServeEnv) names, prints one JSON line on stdout that says
// where it listens, and serves until stdin is closed or ctx ends. Setup errors
// are reported on that line too, so that the parent can tell an unavailable
// store from a broken one.
func Serve(ctx context.Context, spec string, stdin io.Reader, stdout io.Writer) error {
	var sp serveSpec
	if err := json.Unmarshal([]byte(spec), &sp); err != nil {
		return fmt.Errorf("%s does not hold a server spec (%v); idem bench sets it when it starts a server process", ServeEnv, err)
	}
	cfg := Config{PoolSize: sp.PoolSize, PostgresURL: sp.PostgresURL, MySQLDSN: sp.MySQLDSN, RedisURL: sp.RedisURL}
	cfg.defaults()
	var t *target
	var err error
	if sp.Target == "fiber" {
		t, err = setupFiber()
	} else {
		t, err = setupTarget(ctx, sp.Target, &cfg, sp.Suffix)
	}
	h := hello{PID: os.Getpid()}
	if err != nil {
		h.Error, h.Unavailable = err.Error(), isUnavailable(err)
		_ = json.NewEncoder(stdout).Encode(h)
		return nil
	}
	defer t.close()
	if path := os.Getenv(CPUProfileEnv); path != "" {
		f, err := os.Create(path)
		if err != nil {
			return fmt.Errorf("%s: %w", CPUProfileEnv, err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			_ = f.Close()
			return fmt.Errorf("%s: %w", CPUProfileEnv, err)
		}
		defer func() { pprof.StopCPUProfile(); _ = f.Close() }()
	}
	h.URL, h.Version, h.Store, h.Orders, h.ReplayHeader = t.url, t.version, t.store, t.backend.where(), t.replayHeader
	for _, v := range t.variants {
		h.Variants = append(h.Variants, wireVariant{v.name, v.path, v.keys})
	}
	if err := json.NewEncoder(stdout).Encode(h); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, stdin)
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
	}
	return nil
}

// child is a server process started by the parent.
type child struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	done  chan struct{}
}

// stop closes the child's stdin, which makes Serve return, and waits for it to
// exit; after 30 seconds it kills it.
func (c *child) stop() {
	_ = c.stdin.Close()
	select {
	case <-c.done:
	case <-time.After(30 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}

// startChild starts a server process for target name, pinned to cfg.serverCPU
// with taskset when that is set, and returns the target it serves.
func startChild(ctx context.Context, name string, cfg *Config, suffix string) (*target, *child, error) {
	if len(cfg.ServerCommand) == 0 {
		return nil, nil, errors.New("isolated run without Config.ServerCommand: set the command that runs bench.Serve")
	}
	spec, _ := json.Marshal(serveSpec{Target: name, Suffix: suffix, PoolSize: cfg.PoolSize, PostgresURL: cfg.PostgresURL, MySQLDSN: cfg.MySQLDSN, RedisURL: cfg.RedisURL})
	argv := cfg.ServerCommand
	if cfg.serverCPU >= 0 {
		argv = append([]string{"taskset", "-c", strconv.Itoa(cfg.serverCPU)}, argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(append(os.Environ(), ServeEnv+"="+string(spec)), cfg.serverEnv...)
	cmd.Stderr = cfg.Log
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, nil, fmt.Errorf("start the server process %q: %w", strings.Join(argv, " "), err)
	}
	c := &child{cmd: cmd, stdin: stdin, done: make(chan struct{})}
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		if sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		_, _ = io.Copy(io.Discard, stdout)
	}()
	go func() {
		_ = cmd.Wait()
		close(c.done)
	}()
	var line string
	select {
	case line = <-lines:
	case <-time.After(2 * time.Minute):
	case <-ctx.Done():
	}
	var h hello
	if line == "" || json.Unmarshal([]byte(line), &h) != nil {
		c.stop()
		return nil, nil, fmt.Errorf("the server process %q for %s did not say where it listens (first line %q); its errors are above", strings.Join(argv, " "), name, line)
	}
	if h.Error != "" {
		c.stop()
		if h.Unavailable {
			return nil, nil, errUnavailable{errors.New(h.Error)}
		}
		return nil, nil, errors.New(h.Error)
	}
	t := &target{name: name, version: h.Version, store: h.Store, orders: h.Orders, url: h.URL, replayHeader: h.ReplayHeader, pid: h.PID, close: c.stop}
	for _, v := range h.Variants {
		t.variants = append(t.variants, variant{v.Name, v.Path, v.Keys})
	}
	return t, c, nil
}

// pinSelf pins every thread of this process to cpu with taskset and returns a
// function that restores the previous affinity and GOMAXPROCS.
func pinSelf(cpu int) (restore func(), err error) {
	pid := strconv.Itoa(os.Getpid())
	out, err := exec.Command("taskset", "-c", "-p", pid).Output()
	if err != nil {
		return nil, fmt.Errorf("read this process's CPU affinity with taskset: %w", err)
	}
	_, prev, ok := strings.Cut(strings.TrimSpace(string(out)), ": ")
	if !ok {
		return nil, fmt.Errorf("taskset -c -p %s: cannot read %q", pid, out)
	}
	if out, err := exec.Command("taskset", "-a", "-c", "-p", strconv.Itoa(cpu), pid).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("pin the load generator to CPU %d: %v: %s", cpu, err, out)
	}
	procs := runtime.GOMAXPROCS(1)
	return func() {
		_ = exec.Command("taskset", "-a", "-c", "-p", prev, pid).Run()
		runtime.GOMAXPROCS(procs)
	}, nil
}
