package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/idemkit/idem/internal/bench"
)

// runOverhead is idem bench --overhead: bench.RunOverhead with this binary as
// the server (idem bench --serve) and the loader (idem bench load).
func runOverhead(ctx context.Context, args []string, fs *flag.FlagSet, concurrency string, duration time.Duration, rounds, replayKeys int, warmup time.Duration, pin bool, out, cpuprofile string, stdout, stderr io.Writer) int {
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "idem bench --overhead: needs this binary's path to start the servers and loaders: %v\n", err)
		return exitFailure
	}
	cfg := bench.OverheadConfig{
		Duration: duration, Rounds: rounds, ReplayKeys: replayKeys, Warmup: warmup, Log: stderr,
		ServerCommand: []string{exe, "bench", "--serve"}, LoaderCommand: []string{exe, "bench", "load"},
		CPUProfileDir: cpuprofile,
	}
	if cpuprofile != "" {
		if err := os.MkdirAll(cpuprofile, 0o755); err != nil {
			fmt.Fprintf(stderr, "idem bench: --cpuprofile: %v\n", err)
			return exitFailure
		}
	}
	if warmup == 0 {
		cfg.Warmup = -1
	}
	if cfg.Concurrency, err = benchInts(concurrency); err != nil {
		return storeUsageError(stderr, fs, "--concurrency: "+err.Error())
	}
	if duration < 10*time.Millisecond || rounds < 1 || replayKeys < 1 || warmup < 0 {
		return storeUsageError(stderr, fs, "--duration must be at least 10ms, --rounds and --replay-keys at least 1, --warmup at least 0")
	}
	if pin {
		if _, err := exec.LookPath("taskset"); err != nil || runtime.NumCPU() < 2 {
			fmt.Fprintf(stderr, "idem bench: not pinning (--pin needs taskset and 2 CPUs; %d CPUs here)\n", runtime.NumCPU())
		} else {
			cfg.Pin = true
		}
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		fmt.Fprintf(stderr, "idem bench: create the output directory: %v\n", err)
		return exitFailure
	}
	rep, err := bench.RunOverhead(ctx, cfg)
	if rep != nil {
		rep.Command = strings.TrimSpace("idem bench " + strings.Join(args, " "))
		if werr := writeOverheadOutputs(rep, out, stdout); werr != nil {
			fmt.Fprintf(stderr, "idem bench: %v\n", werr)
			return exitFailure
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "idem bench --overhead: %v\n", err)
		return exitFailure
	}
	if rep.Failed() {
		fmt.Fprintln(stderr, "idem bench: some cells failed their consistency check (see the check column)")
		return exitFailure
	}
	return exitOK
}

func writeOverheadOutputs(rep *bench.OverheadReport, dir string, stdout io.Writer) error {
	if err := rep.WriteMarkdown(stdout); err != nil {
		return err
	}
	for _, f := range []struct {
		name  string
		write func(io.Writer) error
	}{{"overhead.md", rep.WriteMarkdown}, {"overhead.json", rep.WriteJSON}} {
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
	fmt.Fprintf(stdout, "\nWrote %s and %s.\n", filepath.Join(dir, "overhead.md"), filepath.Join(dir, "overhead.json"))
	return nil
}

const benchLoadUsage = `Usage: idem bench load [flags]

The load generator of idem bench --overhead, in a process of its own: closed-loop,
kept-alive fasthttp clients POST the benchmark's order to --url for --duration
after a --warmup, and one line of JSON on stdout says what they measured: answers,
latencies, and the server's CPU (read from /proc for --server-pid) and counters
(from its /_bench/stats) over the measured window only. idem bench --overhead
starts it with its arguments in IDEM_BENCH_LOAD; the flags are for running it
by hand against an idem bench --serve server.

Flags:
`

// runBenchLoad is idem bench load: bench.Load with the spec from the
// environment (as idem bench --overhead starts it) or from flags.
func runBenchLoad(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idem bench load", flag.ContinueOnError)
	url := fs.String("url", "", "the endpoint, such as http://127.0.0.1:PORT/idem/orders")
	keys := fs.String("keys", "fresh", "Idempotency-Key per request: none, fresh (a new one each) or pool (--replay-keys keys completed first, then replayed)")
	clients := fs.Int("clients", 8, "closed-loop clients, each on a kept-alive connection")
	duration := fs.Duration("duration", time.Second, "measured time")
	warmup := fs.Duration("warmup", 300*time.Millisecond, "unmeasured load first")
	replayKeys := fs.Int("replay-keys", 512, "keys of --keys pool")
	pid := fs.Int("server-pid", 0, "the server process whose CPU is read from /proc around the measured window (0: none)")
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, benchLoadUsage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return exitOK
		}
		return exitUsage
	}
	spec := os.Getenv(bench.LoadEnv)
	if spec == "" {
		if *url == "" {
			fmt.Fprintln(stderr, "idem bench load: give --url (or run it through idem bench --overhead)")
			return exitUsage
		}
		b, _ := json.Marshal(bench.LoadSpec{URL: *url, Keys: *keys, Clients: *clients, Duration: *duration, Warmup: *warmup, ReplayKeys: *replayKeys, ServerPID: *pid})
		spec = string(b)
	}
	if err := bench.Load(ctx, spec, stdout); err != nil {
		fmt.Fprintf(stderr, "idem bench load: %v\n", err)
		return exitFailure
	}
	return exitOK
}
