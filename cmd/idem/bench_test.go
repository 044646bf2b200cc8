package main

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/go-sql-driver/mysql"
	"github.com/idemkit/idem/internal/bench"
)

// TestBenchSmoke runs a tiny benchmark on memstore and Fiber and checks the
// outputs and that the numbers mean what they say.
func TestBenchSmoke(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"bench", "--isolate=false", "--stores", "memory", "--duration", "200ms", "--concurrency", "1,2", "--replay-keys", "32", "--out", dir}, &stdout, &stderr)
	if code != exitOK {
		t.Fatalf("exit %d; stderr:\n%s\nstdout:\n%s", code, stderr.String(), stdout.String())
	}
	for _, s := range []string{"| target | variant | clients | req/s |", "| memory | first | 1 |", "| memory | replay | 2 |", "| fiber | hot key | 2 |"} {
		if !strings.Contains(stdout.String(), s) {
			t.Errorf("stdout lacks %q:\n%s", s, stdout.String())
		}
	}
	b, err := os.ReadFile(filepath.Join(dir, "results.json"))
	if err != nil {
		t.Fatal(err)
	}
	var rep bench.Report
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatalf("results.json: %v", err)
	}
	// memory and fiber, 4 variants each, 2 concurrencies.
	if len(rep.Results) != 16 {
		t.Fatalf("results.json has %d results; want 16", len(rep.Results))
	}
	for _, r := range rep.Results {
		name := fmt.Sprintf("%s/%s/%d", r.Target, r.Variant, r.Concurrency)
		if r.Throughput <= 0 || r.Requests <= 0 || r.P50Micros <= 0 || r.P99Micros < r.P50Micros {
			t.Errorf("%s: implausible numbers: %+v", name, r)
		}
		if r.Check != "" {
			t.Errorf("%s: check failed: %s", name, r.Check)
		}
		switch r.Variant {
		case bench.VariantFirst:
			// Every request executed once: one row each, no replays.
			if r.Executed != r.Requests || r.Rows != r.Requests || r.Replayed != 0 {
				t.Errorf("%s: %d requests, %d executed, %d rows, %d replayed; want all executed, one row each", name, r.Requests, r.Executed, r.Rows, r.Replayed)
			}
		case bench.VariantReplay:
			if r.Rows != 0 || r.Replayed != r.Requests {
				t.Errorf("%s: %d requests, %d replayed, %d rows; want every answer a replay and no row", name, r.Requests, r.Replayed, r.Rows)
			}
			if r.Target == "memory" && r.Status["201 replayed"] != r.Requests {
				t.Errorf("%s: %d answers carried Idempotent-Replayed: true; want %d", name, r.Status["201 replayed"], r.Requests)
			}
		case bench.VariantHot:
			if r.Executed < 1 || r.Executed > r.Keys || r.Rows != r.Executed {
				t.Errorf("%s: %d executed, %d rows for %d keys", name, r.Executed, r.Rows, r.Keys)
			}
		case bench.VariantBaseline:
			if r.Rows != r.Requests || r.Ratio != 1 {
				t.Errorf("%s: %d rows for %d requests, ratio %v", name, r.Rows, r.Requests, r.Ratio)
			}
		}
	}
	svg, err := os.ReadFile(filepath.Join(dir, "throughput.svg"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(svg, []byte("<svg")) || !bytes.Contains(svg, []byte("polyline")) {
		t.Errorf("throughput.svg does not look like a chart: %.200s", svg)
	}
	d := xml.NewDecoder(bytes.NewReader(svg))
	for {
		if _, err := d.Token(); err == io.EOF {
			break
		} else if err != nil {
			t.Fatalf("throughput.svg is not well-formed: %v", err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "results.md")); err != nil {
		t.Error(err)
	}
}

func TestBenchUsage(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		code int
	}{
		{[]string{"bench", "--help"}, exitOK},
		{[]string{"bench", "--stores", "oracle"}, exitUsage},
		{[]string{"bench", "--concurrency", "0"}, exitUsage},
		{[]string{"bench", "--duration", "fast"}, exitUsage},
		{[]string{"bench", "extra"}, exitUsage},
		{[]string{"bench", "--isolate=false", "--cpuprofile", "prof"}, exitUsage},
	} {
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), c.args, &stdout, &stderr); code != c.code {
			t.Errorf("%v: exit %d; want %d (stderr: %s)", c.args, code, c.code, stderr.String())
		}
	}
	var stdout bytes.Buffer
	run(context.Background(), []string{"bench", "--help"}, &stdout, io.Discard)
	if !strings.Contains(stdout.String(), "--concurrency") && !strings.Contains(stdout.String(), "-concurrency") {
		t.Errorf("--help does not list the flags:\n%s", stdout.String())
	}
}

// TestBenchHelpStores: every store an example of `idem bench --help` names is
// accepted, and the store packages' names work as aliases: the help suggested
// --stores memstore,postgres, which exited 2 (unknown store "memstore").
func TestBenchHelpStores(t *testing.T) {
	t.Parallel()
	var help bytes.Buffer
	run(context.Background(), []string{"bench", "--help"}, &help, io.Discard)
	examples := regexp.MustCompile(`(?m)^ *idem bench .*--stores ([a-z,]+)`).FindAllStringSubmatch(help.String(), -1)
	if len(examples) == 0 {
		t.Fatalf("--help shows no --stores example:\n%s", help.String())
	}
	for _, m := range examples {
		for _, s := range strings.Split(m[1], ",") {
			if _, ok := benchStoreName(s); !ok {
				t.Errorf("the help's example --stores %s names %q, which --stores refuses", m[1], s)
			}
		}
	}
	// The alias runs, as the store it names (a tiny run on memory only).
	dir := t.TempDir()
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"bench", "--isolate=false", "--fiber=false", "--stores", "memstore", "--duration", "20ms", "--rounds", "1", "--concurrency", "1", "--replay-keys", "4", "--memory-records", "0", "--out", dir}, &stdout, &stderr)
	if code != exitOK || !strings.Contains(stdout.String(), "| memory | first | 1 |") {
		t.Fatalf("--stores memstore: exit %d; stderr:\n%s\nstdout:\n%s", code, stderr.String(), stdout.String())
	}
}

// TestBenchIsolated runs the built binary the way a user would: each server in a
// process of its own (the binary re-executed with --serve), the load generator
// pinned away from it, and server CPU and memory per record reported.
func TestBenchIsolated(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	code, stdout, stderr := runIdem(t, dir, nil, "bench", "--stores", "memory", "--duration", "150ms", "--rounds", "1",
		"--concurrency", "2", "--replay-keys", "8", "--memory-records", "300", "--out", dir)
	if code != exitOK {
		t.Fatalf("exit %d; stderr:\n%s\nstdout:\n%s", code, stderr, stdout)
	}
	b, err := os.ReadFile(filepath.Join(dir, "results.json"))
	if err != nil {
		t.Fatal(err)
	}
	var rep bench.Report
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatalf("results.json: %v", err)
	}
	if !rep.Isolated || len(rep.Results) != 8 || len(rep.Memory) != 4 {
		t.Fatalf("isolated %v, %d results, %d memory results; want an isolated run with 8 cells and 4 memory results", rep.Isolated, len(rep.Results), len(rep.Memory))
	}
	for _, r := range rep.Results {
		if r.Check != "" || r.ServerCPUMicros <= 0 {
			t.Errorf("%s %s: check %q, server CPU %.1f µs/request", r.Target, r.Variant, r.Check, r.ServerCPUMicros)
		}
	}
	for _, s := range []string{"srv CPU µs/req", "Memory per stored record", "memstore first-time: extra server CPU"} {
		if !strings.Contains(stdout, s) {
			t.Errorf("stdout lacks %q:\n%s", s, stdout)
		}
	}
}

// TestBenchMySQLDefault checks that --mysql's default, as idem bench --help shows
// it, gives a DSN with multiStatements and interpolateParams: the configuration
// BENCHMARKS.md's figures were measured with, so that the documented command
// reproduces them.
func TestBenchMySQLDefault(t *testing.T) {
	t.Parallel()
	var stdout bytes.Buffer
	if code := run(context.Background(), []string{"bench", "--help"}, &stdout, io.Discard); code != exitOK {
		t.Fatalf("bench --help: exit %d", code)
	}
	m := regexp.MustCompile(`--mysql URL\n[^\n]*\(default "([^"]+)"\)`).FindStringSubmatch(stdout.String())
	if m == nil {
		t.Fatalf("bench --help shows no default for --mysql:\n%s", stdout.String())
	}
	dsn, err := benchMySQL(m[1])
	if err != nil {
		t.Fatalf("benchMySQL(%q) = %q, error %v", m[1], dsn, err)
	}
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		t.Fatalf("ParseDSN(%q): %v", dsn, err)
	}
	if !cfg.MultiStatements || !cfg.InterpolateParams || !cfg.ParseTime {
		t.Errorf("default --mysql %q gives DSN %q: multiStatements %v, interpolateParams %v, parseTime %v; want all true",
			m[1], dsn, cfg.MultiStatements, cfg.InterpolateParams, cfg.ParseTime)
	}
}

// TestBenchOverhead runs idem bench --overhead with the built binary as the
// server (--serve) and the loader (bench load), as a user would.
func TestBenchOverhead(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	code, stdout, stderr := runIdem(t, dir, nil, "bench", "--overhead", "--duration", "100ms", "--rounds", "1",
		"--concurrency", "2", "--replay-keys", "8", "--warmup", "20ms", "--out", dir)
	if code != exitOK {
		t.Fatalf("exit %d; stderr:\n%s\nstdout:\n%s", code, stderr, stdout)
	}
	b, err := os.ReadFile(filepath.Join(dir, "overhead.json"))
	if err != nil {
		t.Fatal(err)
	}
	var rep bench.OverheadReport
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatalf("overhead.json: %v", err)
	}
	if len(rep.Cells) != 6 {
		t.Fatalf("%d cells; want 6 (memory and fiber × baseline, first, replay)", len(rep.Cells))
	}
	for _, c := range rep.Cells {
		if c.Check != "" || c.ServerCPUMicros <= 0 || c.Requests <= 0 {
			t.Errorf("%s %s: check %q, %d requests, server CPU %.1f µs/request", c.Target, c.Variant, c.Check, c.Requests, c.ServerCPUMicros)
		}
	}
	if !strings.Contains(stdout, "| clients | idem first | Fiber first |") {
		t.Errorf("stdout lacks the comparison:\n%s", stdout)
	}
}

// TestBenchCPUProfileStores: --cpuprofile on a store run writes one profile per
// store's server process, in which the requests carry the variant they belong
// to, so that one variant's CPU can be read alone.
func TestBenchCPUProfileStores(t *testing.T) {
	t.Parallel()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go tool pprof reads the profile, and there is no go command on PATH: %v", err)
	}
	dir, prof := t.TempDir(), filepath.Join(t.TempDir(), "prof")
	code, stdout, stderr := runIdem(t, dir, nil, "bench", "--stores", "sqlite", "--fiber=false", "--memory-records", "0",
		"--duration", "600ms", "--rounds", "1", "--concurrency", "2", "--replay-keys", "8", "--cpuprofile", prof, "--out", dir)
	if code != exitOK {
		t.Fatalf("exit %d; stderr:\n%s\nstdout:\n%s", code, stderr, stdout)
	}
	path := filepath.Join(prof, "sqlite.pprof")
	out, err := exec.Command(goTool, "tool", "pprof", "-tags", path).CombinedOutput()
	if err != nil {
		t.Fatalf("go tool pprof -tags %s: %v\n%s", path, err, out)
	}
	// A cell is 600 ms of 2 clients, and the profile samples the server's CPU
	// every 10 ms: every variant shows among the label's values.
	for _, v := range []string{"baseline", "first", "replay", "single-tx first"} {
		if !regexp.MustCompile(`(?m)^\s+\S+ \(\s*[\d.]+%\): ` + regexp.QuoteMeta(v) + `$`).Match(out) {
			t.Errorf("no CPU samples labelled variant=%q in %s:\n%s", v, path, out)
		}
	}
}

// TestBenchLoadNeedsURL: idem bench load run by hand without --url says what
// to give.
func TestBenchLoadNeedsURL(t *testing.T) {
	t.Setenv(bench.LoadEnv, "")
	var stderr bytes.Buffer
	if code := run(context.Background(), []string{"bench", "load"}, io.Discard, &stderr); code != exitUsage || !strings.Contains(stderr.String(), "--url") {
		t.Fatalf("exit %d, stderr %q; want usage exit and a hint at --url", code, stderr.String())
	}
}
