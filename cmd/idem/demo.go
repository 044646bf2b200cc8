package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-chi/httprate"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/dbopen"
	"github.com/idemkit/idem/internal/orders"
)

func init() {
	register(&command{
		name:    "demo",
		summary: "run the reference orders service (POST /orders made idempotent) on SQLite, PostgreSQL or MySQL",
		run:     runDemo,
	})
}

const demoUsage = `Usage: idem demo [flags]

Runs the reference checkout service of the idem articles: POST /orders creates an
order and is made idempotent by the Idempotency-Key header; GET /orders/{id},
GET /orders?cart_id=… and GET /healthz read. The order and its stored answer
commit in one database transaction. The tenant is the bearer token
("Authorization: Bearer t1"; demo-only, nothing is verified); requests without
one get 401 and are never bound to a key.

By default it serves 127.0.0.1:8080 with the SQLite file idem-demo.db in the
working directory, and prints a curl command to paste. The first line of output
is "idem demo: listening on http://HOST:PORT" (useful with --addr 127.0.0.1:0).

Example:
  idem demo
  idem demo --db postgres://postgres@127.0.0.1:5432/test --handler-delay 2s
  IDEM_DB=mysql://root@127.0.0.1:3306/test idem demo --addr 127.0.0.1:3000

Every flag can also be set by an environment variable (shown in brackets); a
flag on the command line wins.

Flags:
`

// demoEnv maps each demo flag to the environment variable that mirrors it.
var demoEnv = []storeEnvVar{
	{"addr", "IDEM_ADDR"}, {"db", "IDEM_DB"}, {"keys", "IDEM_KEYS"}, {"table", "IDEM_TABLE"},
	{"lease", "IDEM_LEASE"}, {"ttl", "IDEM_TTL"}, {"handler-delay", "IDEM_HANDLER_DELAY"},
	{"require-key", "IDEM_REQUIRE_KEY"}, {"rate-limit", "IDEM_RATE_LIMIT"},
}

// demoShutdownTimeout bounds how long in-flight requests may take to finish after
// SIGINT or SIGTERM.
const demoShutdownTimeout = 30 * time.Second

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idem demo", flag.ContinueOnError)
	addr := fs.String("addr", "127.0.0.1:8080", "`host:port` to listen on; port 0 picks a free one")
	dbURL := fs.String("db", dbopen.DefaultDB, "business database: sqlite:PATH, postgres://… or mysql://USER@HOST:PORT/DB")
	keys := fs.String("keys", "", "where the key records live: empty for the --db database, or redis://HOST:PORT/N (weaker: see the docs)")
	table := fs.String("table", "", "advanced: the key records' table (or Redis key prefix); empty for the store's default (idem_records, idem:)")
	lease := fs.Duration("lease", idem.DefaultLease, "how long a claimed key stays in flight without renewal (renewed while the handler runs)")
	ttl := fs.Duration("ttl", idem.DefaultTTL, "how long a key's outcome is kept and replayed; must be at least --lease")
	delay := fs.Duration("handler-delay", 0, "sleep this long inside the order's transaction after the insert (widens race windows)")
	requireKey := fs.Bool("require-key", true, "answer 400 to POST /orders without an Idempotency-Key; false lets it through unprotected")
	rate := fs.Int("rate-limit", 0, "per-tenant `requests` per second, answered 429 beyond (never bound to a key); 0 is off")
	fs.Usage = storeUsage(fs, demoUsage, demoEnv)
	pos, code, ok := storeParse(fs, args, demoEnv, stdout, stderr)
	if !ok {
		return code
	}
	if len(pos) > 0 {
		return storeUsageError(stderr, fs, fmt.Sprintf("unexpected argument %q; idem demo takes flags only", pos[0]))
	}
	if *delay < 0 {
		return storeUsageError(stderr, fs, fmt.Sprintf("--handler-delay %v is negative; use 0 or a duration such as 500ms", *delay))
	}
	if *rate < 0 {
		return storeUsageError(stderr, fs, fmt.Sprintf("--rate-limit %d is negative; use 0 (off) or requests per second", *rate))
	}
	logger := slog.New(slog.NewTextHandler(&demoLockedWriter{w: stderr}, nil))
	mwCfg := &idem.Config{
		Lease:       *lease,
		TTL:         *ttl,
		KeyOptional: !*requireKey,
		Observer:    demoObserver(logger),
	}
	if err := mwCfg.Validate(); err != nil {
		return storeUsageError(stderr, fs, strings.NewReplacer("Lease", "--lease", "TTL", "--ttl").Replace(err.Error()))
	}

	opts := dbopen.Options{DB: *dbURL, Keys: *keys, KeyTable: *table}
	if err := opts.Check(); err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	h, err := dbopen.Open(ctx, opts)
	if err != nil {
		fmt.Fprintf(stderr, "idem demo: %v\n", err)
		return exitFailure
	}
	defer h.Close()
	if err := h.Migrate(ctx); err != nil {
		fmt.Fprintf(stderr, "idem demo: %v\n", err)
		return exitFailure
	}
	svc, err := orders.New(h.Orders, &orders.Config{HandlerDelay: *delay})
	if err != nil {
		fmt.Fprintf(stderr, "idem demo: %v\n", err)
		return exitFailure
	}
	if err := svc.Migrate(ctx); err != nil {
		fmt.Fprintf(stderr, "idem demo: %v\n", err)
		return exitFailure
	}
	mw, err := idem.New(h.Store, mwCfg)
	if err != nil {
		fmt.Fprintf(stderr, "idem demo: %v\n", err)
		return exitFailure
	}

	// auth → rate limit → routing → idem (POST /orders only) → orders.
	var app http.Handler = svc.Handler(mw)
	if *rate > 0 {
		app = httprate.LimitBy(*rate, time.Second,
			func(r *http.Request) (string, error) { return idem.ScopeFrom(r.Context()), nil },
			httprate.WithLimitHandler(func(w http.ResponseWriter, r *http.Request) {
				orders.WriteProblem(w, http.StatusTooManyRequests, "rate_limited",
					fmt.Sprintf("this tenant sent more than %d requests in a second; wait for Retry-After and retry with the same Idempotency-Key (nothing was recorded)", *rate))
			}),
		)(app)
	}
	root := http.NewServeMux()
	root.HandleFunc("GET /healthz", svc.Healthz)
	root.Handle("/", orders.Authenticate(app))

	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		fmt.Fprintf(stderr, "idem demo: cannot listen on %s (%v); is another process using it? Pick another address with --addr\n", *addr, err)
		return exitFailure
	}
	srv := &http.Server{
		Handler:           root,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}
	base := demoBaseURL(ln.Addr())
	demoBanner(stdout, base, h, svc, *lease, *ttl, *delay, *requireKey, *rate)

	jctx, jcancel := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		j := &idem.Janitor{
			Store:    h.Store,
			Interval: time.Minute, // expired records already count as absent
			OnSweep: func(n int, err error) {
				if err != nil {
					logger.Warn("janitor", "deleted", n, "err", err)
				} else if n > 0 {
					logger.Info("janitor", "deleted", n)
				}
			},
		}
		_ = j.Run(jctx)
	}()

	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	code = exitOK
	select {
	case err := <-serveErr:
		fmt.Fprintf(stderr, "idem demo: the server stopped: %v\n", err)
		code = exitFailure
	case <-ctx.Done():
		// A second Ctrl-C kills the process at once.
		signal.Reset(os.Interrupt, syscall.SIGTERM)
		fmt.Fprintf(stderr, "idem demo: shutting down; waiting up to %v for requests in flight (Ctrl-C again to stop at once)\n", demoShutdownTimeout)
		sctx, cancel := context.WithTimeout(context.Background(), demoShutdownTimeout)
		err := srv.Shutdown(sctx)
		cancel()
		if err != nil {
			fmt.Fprintf(stderr, "idem demo: requests still in flight after %v were cut off: %v\n", demoShutdownTimeout, err)
			code = exitFailure
		}
	}
	jcancel()
	wg.Wait()
	if err := h.Close(); err != nil {
		fmt.Fprintf(stderr, "idem demo: closing the database: %v\n", err)
		code = exitFailure
	}
	fmt.Fprintln(stderr, "idem demo: stopped")
	return code
}

// demoBaseURL is the URL clients reach addr at: an unspecified host (":8080",
// "0.0.0.0:8080") is shown as 127.0.0.1.
func demoBaseURL(addr net.Addr) string {
	host, port, err := net.SplitHostPort(addr.String())
	if err != nil {
		return "http://" + addr.String()
	}
	if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port)
}

func demoBanner(w io.Writer, base string, h *dbopen.Handle, svc *orders.Service, lease, ttl, delay time.Duration, requireKey bool, rate int) {
	fmt.Fprintf(w, "idem demo: listening on %s\n", base)
	fmt.Fprintf(w, "  orders: %s (table %s)\n", h.Target.Display, svc.Table())
	if h.Transactional() {
		fmt.Fprintf(w, "  keys:   %s; an order and its stored answer commit in one transaction\n", h.KeysAt)
	} else {
		fmt.Fprintf(w, "  keys:   %s; orders commit on their own, so a crash between the two can let a retry order twice\n", h.KeysAt)
	}
	req := "key required"
	if !requireKey {
		req = "key optional"
	}
	rl := "no rate limit"
	if rate > 0 {
		rl = fmt.Sprintf("rate limit %d/s per tenant", rate)
	}
	fmt.Fprintf(w, "  lease %v, ttl %v, %s, %s, handler delay %v\n", lease, ttl, req, rl, delay)
	fmt.Fprintf(w, `
Create an order; run the curl twice: the second answer is the stored one, with
"Idempotent-Replayed: true", and there is still one order.

  KEY=$(uuidgen 2>/dev/null || cat /proc/sys/kernel/random/uuid)
  curl -i -X POST %[1]s/orders \
    -H "Authorization: Bearer t1" \
    -H "Idempotency-Key: $KEY" \
    -H "Content-Type: application/json" \
    -d '{"cart_id":"c_42","total_cents":1900}'
  curl -s '%[1]s/orders?cart_id=c_42' -H "Authorization: Bearer t1"

Press Ctrl-C to stop.
`, base)
}

// demoObserver logs what an operator must know about: store failures, lost
// leases and released keys.
func demoObserver(logger *slog.Logger) idem.Observer {
	return idem.ObserverFunc(func(ctx context.Context, e idem.Event) {
		switch e.Kind {
		case idem.EventStoreError, idem.EventLeaseLost:
			logger.Warn("idem: "+e.Kind.String(), "scope", e.Scope, "key", e.Key, "status", e.Status, "err", e.Err)
		case idem.EventReleased, idem.EventTakenOver:
			logger.Info("idem: "+e.Kind.String(), "scope", e.Scope, "key", e.Key, "err", e.Err)
		}
	})
}

// demoLockedWriter serialises writes from concurrent goroutines.
type demoLockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *demoLockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// The helpers below are shared by demo, migrate, gc and inspect.

// storeEnvVar names the environment variable that mirrors a flag.
type storeEnvVar struct{ flag, env string }

// storeUsage returns a FlagSet.Usage that prints text, then the flags with their
// defaults and environment variables.
func storeUsage(fs *flag.FlagSet, text string, env []storeEnvVar) func() {
	return func() {
		w := fs.Output()
		fmt.Fprint(w, text)
		names := map[string]string{}
		for _, e := range env {
			names[e.flag] = e.env
		}
		fs.VisitAll(func(f *flag.Flag) {
			name, usage := flag.UnquoteUsage(f)
			line := "  --" + f.Name
			if name != "" {
				line += " " + name
			}
			fmt.Fprintln(w, line)
			usage = "    \t" + usage
			if f.DefValue != "" && f.DefValue != "0" && f.DefValue != "0s" && f.DefValue != "false" {
				usage += " (default " + strconv.Quote(f.DefValue) + ")"
			}
			if e := names[f.Name]; e != "" {
				usage += " [" + e + "]"
			}
			fmt.Fprintln(w, usage)
		})
	}
}

// storeParse applies the environment, then parses args (flags may follow
// positional arguments; after "--" everything is positional). It returns the
// positional arguments; ok is false when the command must stop with code: after
// --help (0, usage on stdout) or a usage error (2, message on stderr).
func storeParse(fs *flag.FlagSet, args []string, env []storeEnvVar, stdout, stderr io.Writer) (pos []string, code int, ok bool) {
	fs.SetOutput(io.Discard)
	for _, e := range env {
		v, set := os.LookupEnv(e.env)
		if !set {
			continue
		}
		if err := fs.Set(e.flag, v); err != nil {
			return nil, storeUsageError(stderr, fs, fmt.Sprintf("%s=%q is not a valid value for --%s; %s", e.env, v, e.flag, storeHint(fs, e.flag))), false
		}
	}
	for {
		err := fs.Parse(args)
		if errors.Is(err, flag.ErrHelp) {
			fs.SetOutput(stdout)
			fs.Usage()
			return nil, exitOK, false
		}
		if err != nil {
			msg := err.Error()
			if m := storeBadValueRE.FindStringSubmatch(msg); m != nil {
				msg = fmt.Sprintf("invalid value %s for flag -%s; %s", m[1], m[2], storeHint(fs, m[2]))
			}
			return nil, storeUsageError(stderr, fs, msg), false
		}
		rest := fs.Args()
		if consumed := args[:len(args)-len(rest)]; len(consumed) > 0 && consumed[len(consumed)-1] == "--" {
			return append(pos, rest...), 0, true
		}
		if len(rest) == 0 {
			return pos, 0, true
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// storeBadValueRE matches the flag package's error for a value it cannot parse.
var storeBadValueRE = regexp.MustCompile(`^invalid (?:boolean )?value (".*") for (?:flag )?-([\w-]+): `)

// storeHint says what a valid value of the named flag looks like.
func storeHint(fs *flag.FlagSet, name string) string {
	f := fs.Lookup(name)
	if f == nil {
		return "see --help"
	}
	switch f.Value.(flag.Getter).Get().(type) {
	case time.Duration:
		return "use a duration such as 500ms, 30s or 24h"
	case bool:
		return "use true or false"
	case int:
		return "use a whole number"
	}
	return "see --help"
}

// storeUsageError prints msg and a pointer to --help on stderr and returns
// exitUsage.
func storeUsageError(stderr io.Writer, fs *flag.FlagSet, msg string) int {
	fmt.Fprintf(stderr, "%s: %s\nRun `%s --help` for the flags.\n", fs.Name(), msg, fs.Name())
	return exitUsage
}
