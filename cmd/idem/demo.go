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
	"net/url"
	"os"
	"os/signal"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/go-chi/httprate"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemobs"
	"github.com/idemkit/idem/idemprom"
	"github.com/idemkit/idem/idemslog"
	"github.com/idemkit/idem/internal/dbopen"
	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/outbox"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
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
GET /orders?cart_id=… (paged: ?limit=, ?after=, "next") and GET /healthz read.
The order and its stored answer commit in one database transaction. The tenant
is the bearer token ("Authorization: Bearer t1"; demo-only, nothing is
verified); requests without one get 401 and are never bound to a key.

It CREATES TABLES in the --db database at start, if they are missing: "orders"
(the orders) and "idem_records" (the key records; "idem_records_migrations" on
MySQL, "idem_migrations" on SQLite). --prefix puts a prefix on both names,
--schema (PostgreSQL) puts both in a schema of their own, --table names the
key records' table alone.

By default it serves 127.0.0.1:8080 with the SQLite file idem-demo.db in the
working directory. The first line of output, printed as soon as the port is
open and before the database is reached, is
"idem demo: listening on http://HOST:PORT" (useful with --addr 127.0.0.1:0);
until the database is ready every request gets 503 with Retry-After. Then it
prints a curl command to paste, ending with "Press Ctrl-C to stop.".

Prometheus metrics (idem_requests_total by outcome, idem_in_flight, store
operation timings, …) are served at GET /metrics on --metrics-addr
(127.0.0.1:9464 by default; empty turns them off), without the bearer token
the API wants. When that address is taken the demo runs without metrics and
says so. idem's decisions are logged on stderr (store errors, lost leases,
released keys, takeovers), with hashes of keys and scopes, never the raw ones.

With --payment-url URL every new order is first charged at a payment provider
(POST URL/charges, {"amount_cents": …, "cart_id": …}, the charge step's
derived key as Idempotency-Key); the order stores the charge id and its 201
carries it as "charge_id". A decline (4xx) is a stored 402 payment_failed; a
provider that fails or does not answer a 502 payment_unavailable, not stored:
the retry asks again with the same key. See docs/demo.md.

With --events nats://HOST:PORT every order created also writes an event
(order_id, cart_id, tenant, total_cents, created_at) into the outbox table
PREFIXidem_outbox, in the order's transaction, and a relay running in the
demo publishes it to JetStream on --events-subject with Nats-Msg-Id set to
its message ID, the same for every publication; the demo creates a stream
for the subject if none captures it. examples/orders-worker -events consumes
them. See docs/outbox.md.

Ctrl-C (SIGINT) or SIGTERM stops it: requests in flight finish, a second one
stops it at once. It also stops when the process that started it exits (for
example a killed "go run"), unless --exit-with-parent=false.

Example:
  idem demo
  idem demo --db postgres://postgres@127.0.0.1:5432/test --schema shop --handler-delay 2s
  IDEM_DB=mysql://root@127.0.0.1:3306/test idem demo --addr 127.0.0.1:3000 --prefix demo_
  idem demo --db postgres://postgres@127.0.0.1:5432/test --events nats://127.0.0.1:4222

Every flag can also be set by an environment variable (shown in brackets); a
flag on the command line wins.

Flags:
`

// demoEnv maps each demo flag to the environment variable that mirrors it.
var demoEnv = []storeEnvVar{
	{"addr", "IDEM_ADDR"}, {"db", "IDEM_DB"}, {"keys", "IDEM_KEYS"}, {"table", "IDEM_TABLE"},
	{"prefix", "IDEM_PREFIX"}, {"schema", "IDEM_SCHEMA"},
	{"lease", "IDEM_LEASE"}, {"ttl", "IDEM_TTL"}, {"handler-delay", "IDEM_HANDLER_DELAY"},
	{"require-key", "IDEM_REQUIRE_KEY"}, {"rate-limit", "IDEM_RATE_LIMIT"},
	{"read-timeout", "IDEM_READ_TIMEOUT"}, {"exit-with-parent", "IDEM_EXIT_WITH_PARENT"},
	{"metrics-addr", "IDEM_METRICS_ADDR"}, {"flow", "IDEM_FLOW"},
	{"in-flight-wait", "IDEM_IN_FLIGHT_WAIT"},
	{"payment-url", "IDEM_PAYMENT_URL"}, {"payment-timeout", "IDEM_PAYMENT_TIMEOUT"},
	{"payment-unknown", "IDEM_PAYMENT_UNKNOWN"},
	{"events", "IDEM_EVENTS"}, {"events-subject", "IDEM_EVENTS_SUBJECT"}, {"events-lease", "IDEM_EVENTS_LEASE"},
	{"events-relay", "IDEM_EVENTS_RELAY"},
}

// demoShutdownTimeout bounds how long in-flight requests may take to finish after
// SIGINT or SIGTERM, on top of --handler-delay.
const demoShutdownTimeout = 30 * time.Second

// The demo server's limits. A request's headers must arrive within
// demoHeaderTimeout, the whole request within --read-timeout; the answer must be
// written within --read-timeout + --handler-delay + demoHandlerBudget (database
// work and the middleware's bounded cleanup); an idle keep-alive connection is
// closed after demoIdleTimeout.
const (
	demoHeaderTimeout  = 10 * time.Second
	demoReadTimeout    = 30 * time.Second
	demoHandlerBudget  = 30 * time.Second
	demoIdleTimeout    = 2 * time.Minute
	demoMaxHeaderBytes = 64 << 10
)

// demoParentPoll is how often the demo checks that the process that started it
// still runs.
const demoParentPoll = 500 * time.Millisecond

// demoNameRE is what --prefix and --schema accept: lower-case SQL identifier
// characters, so that quoted (store) and unquoted (orders) names agree.
var demoNameRE = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	ppid := os.Getppid()
	fs := flag.NewFlagSet("idem demo", flag.ContinueOnError)
	addr := fs.String("addr", "127.0.0.1:8080", "`host:port` to listen on; port 0 picks a free one")
	dbURL := fs.String("db", dbopen.DefaultDB, "business database: sqlite:PATH, postgres://… or mysql://USER@HOST:PORT/DB")
	keys := fs.String("keys", "", "where the key records live: empty for the --db database, or redis://HOST:PORT/N (weaker: see the docs)")
	table := fs.String("table", "", "advanced: the key records' table (or Redis key prefix); empty for the store's default (PREFIXidem_records, idem:)")
	prefix := fs.String("prefix", "", "prefix of the tables' names: PREFIXorders and PREFIXidem_records (lower-case letters, digits, _)")
	schema := fs.String("schema", "", "PostgreSQL only: the schema both tables live in, created if missing (on MySQL name another database in --db)")
	lease := fs.Duration("lease", idem.DefaultLease, "how long a claimed key stays in flight without renewal (renewed while the handler runs)")
	ttl := fs.Duration("ttl", idem.DefaultTTL, "how long a key's outcome is kept and replayed; must be at least --lease")
	delay := fs.Duration("handler-delay", 0, "sleep this long inside the order's transaction after the insert (widens race windows)")
	requireKey := fs.Bool("require-key", true, "answer 400 to POST /orders without an Idempotency-Key; false lets it through unprotected")
	rate := fs.Int("rate-limit", 0, "per-tenant `requests` per second, answered 429 beyond (never bound to a key); 0 is off")
	readTimeout := fs.Duration("read-timeout", demoReadTimeout, "how long a client may take to send a whole request, headers and body; a slower one is disconnected")
	metricsAddr := fs.String("metrics-addr", "127.0.0.1:9464", "`host:port` serving GET /metrics (Prometheus text format, no token); empty for none")
	flowName := fs.String("flow", "auto", "auto (the store's preferred flow: single-tx on SQL databases), claim-complete (an in-flight record with a lease while the handler runs, as in the articles) or single-tx")
	inFlightWait := fs.Duration("in-flight-wait", 0, "how long a retry that finds its key still running waits for the outcome, answered with the replay instead of 409; 0 answers 409 at once")
	paymentURL := fs.String("payment-url", "", "charge every new order's total at this payment provider (POST URL/charges, the charge step's derived key as Idempotency-Key) before inserting it; empty charges nothing")
	paymentTimeout := fs.Duration("payment-timeout", orders.DefaultPaymentTimeout, "how long one call to the payment provider may take; a slower one is a 502 and the retry asks again with the same key")
	paymentUnknown := fs.String("payment-unknown", "rerun", "a charge begun by an attempt that died before recording it: rerun (charge again with the same key: safe when the provider honours Idempotency-Key) or refuse (the order's outcome is unknown until idem resolve settles the charge: for a provider that ignores keys)")
	events := fs.String("events", "", "`nats://HOST:PORT`: publish an event for every order created, through a transactional outbox and a relay running in the demo, to JetStream; empty for none")
	eventsSubject := fs.String("events-subject", defaultEventsSubject, "with --events: the `subject` of the orders' events (a stream is created for it if none captures it)")
	eventsLease := fs.Duration("events-lease", outbox.DefaultLeaseDuration, "with --events: how long the relay holds a message it publishes; after a crash another relay publishes it again (same ID) once this lapses")
	eventsRelay := fs.Bool("events-relay", true, "with --events: run the relay in the demo; false only writes the events into the outbox, for `idem relay` to publish")
	withParent := fs.Bool("exit-with-parent", true, "stop when the process that started the demo exits (for example a killed go run); false for nohup and the like")
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
	if *readTimeout <= 0 {
		return storeUsageError(stderr, fs, fmt.Sprintf("--read-timeout %v is not positive; use a duration such as 30s", *readTimeout))
	}
	if *prefix != "" && (!demoNameRE.MatchString(*prefix) || len(*prefix) > 32) {
		return storeUsageError(stderr, fs, fmt.Sprintf("--prefix %q is not usable; use up to 32 lower-case letters, digits and underscores, not starting with a digit, such as demo_", *prefix))
	}
	if *schema != "" && (!demoNameRE.MatchString(*schema) || len(*schema) > 63) {
		return storeUsageError(stderr, fs, fmt.Sprintf("--schema %q is not usable; use up to 63 lower-case letters, digits and underscores, not starting with a digit, such as shop", *schema))
	}
	if msg := listenAddrProblem("--addr", *addr); msg != "" {
		return storeUsageError(stderr, fs, msg)
	}
	if *metricsAddr != "" {
		if msg := listenAddrProblem("--metrics-addr", *metricsAddr); msg != "" {
			return storeUsageError(stderr, fs, msg+", or empty for no metrics")
		}
	}
	var payments *orders.Payments
	if *paymentURL != "" {
		if u, err := url.Parse(*paymentURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return storeUsageError(stderr, fs, fmt.Sprintf("--payment-url %q is not an http:// or https:// URL; give the provider's base URL, such as http://127.0.0.1:9000", *paymentURL))
		}
		if *paymentTimeout <= 0 {
			return storeUsageError(stderr, fs, fmt.Sprintf("--payment-timeout %v is not positive; use a duration such as 10s", *paymentTimeout))
		}
		if *paymentUnknown != "rerun" && *paymentUnknown != "refuse" {
			return storeUsageError(stderr, fs, fmt.Sprintf("invalid value %q for --payment-unknown; use rerun or refuse", *paymentUnknown))
		}
		payments = &orders.Payments{URL: *paymentURL, Timeout: *paymentTimeout, RefuseUnknown: *paymentUnknown == "refuse"}
	}
	if *events != "" {
		if msg := checkNATSURL("--events", *events); msg != "" {
			return storeUsageError(stderr, fs, msg)
		}
		if !publishableSubject(*eventsSubject) {
			return storeUsageError(stderr, fs, fmt.Sprintf("--events-subject %q is not a subject to publish on; use a NATS subject of dot-separated tokens without spaces, empty tokens or wildcards, not starting with $ or _INBOX. (reserved by NATS), such as orders.created", *eventsSubject))
		}
		if *eventsLease < time.Second {
			return storeUsageError(stderr, fs, fmt.Sprintf("--events-lease %v is too short; use 1s or more (a publication may take up to half of it)", *eventsLease))
		}
	}
	logger := demoLogger(stderr)
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics, err := idemprom.New(reg, nil)
	if err != nil {
		fmt.Fprintf(stderr, "idem demo: %v\n", err)
		return exitFailure
	}
	var outboxMetrics outbox.Observer
	if *events != "" {
		if outboxMetrics, err = idemprom.NewOutbox(reg, nil); err != nil {
			fmt.Fprintf(stderr, "idem demo: %v\n", err)
			return exitFailure
		}
	}
	flow, ok := map[string]idem.Flow{"auto": idem.FlowAuto, "claim-complete": idem.FlowClaimComplete, "single-tx": idem.FlowSingleTx}[*flowName]
	if !ok {
		return storeUsageError(stderr, fs, fmt.Sprintf("invalid value %q for --flow; use auto, claim-complete or single-tx", *flowName))
	}
	mwCfg := &idem.Config{
		Flow:        flow,
		Lease:       *lease,
		TTL:         *ttl,
		KeyOptional: !*requireKey,
		Observer:    idemobs.Multi(metrics, demoObserver(logger)),
		// InFlightWait: a retry of an order still being made waits for it.
		InFlightWait: *inFlightWait,
		// A 5xx says the order was not made (the database failed, the request was
		// cancelled): keeping it would replay the failure to every retry until the
		// TTL; releasing the key lets a retry try again.
		KeepFunc: func(status int) bool { return status < 500 },
	}
	if err := mwCfg.Validate(); err != nil {
		// The core's error reads "idem: invalid config: …"; after this
		// command's own "idem demo: " prefix only the finding is news.
		msg := strings.TrimPrefix(err.Error(), "idem: invalid config: ")
		return storeUsageError(stderr, fs, strings.NewReplacer("InFlightWait", "--in-flight-wait", "Lease", "--lease", "TTL", "--ttl").Replace(msg))
	}
	// 0 means the default: the banner shows what is in force.
	if *lease == 0 {
		*lease = idem.DefaultLease
	}
	if *ttl == 0 {
		*ttl = idem.DefaultTTL
	}
	opts := dbopen.Options{DB: *dbURL, Keys: *keys, KeyTable: *table}
	if err := opts.Check(); err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	target, _ := dbopen.ParseDB(opts.DB)
	if *schema != "" && target.Dialect != orders.Postgres {
		return storeUsageError(stderr, fs, fmt.Sprintf("--schema works on PostgreSQL only; on MySQL a schema is a database: name it in --db (mysql://USER@HOST/DB), and use --prefix for the table names (--db is %s)", target.Display))
	}
	qualify := func(name string) string {
		name = *prefix + name
		if *schema != "" {
			name = *schema + "." + name
		}
		return name
	}
	ordersTable := qualify(orders.DefaultTable)
	if opts.KeyTable == "" && opts.Keys == "" && (*prefix != "" || *schema != "") {
		opts.KeyTable = qualify("idem_records")
	}

	ctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	if *withParent {
		go demoWatchParent(ctx, ppid, stop)
	}

	// Listen first and say so at once: whatever follows (reaching the database,
	// migrating) may be slow, and a newcomer must see that the demo runs.
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		hint := "is another process using it?"
		if !errors.Is(err, syscall.EADDRINUSE) {
			hint = "is the host an address of this machine?"
		}
		fmt.Fprintf(stderr, "idem demo: cannot listen on %s (%v); %s Pick another address with --addr\n", *addr, err, hint)
		return exitFailure
	}
	base := demoBaseURL(ln.Addr())
	fmt.Fprintf(stdout, "idem demo: listening on %s\n", base)

	var app atomic.Pointer[http.Handler]
	var starting http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "1")
		orders.WriteProblem(w, http.StatusServiceUnavailable, "database_unavailable", "the demo is still connecting to its database and creating its tables; retry in a second")
	})
	app.Store(&starting)
	srv := &http.Server{
		Handler:           http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { (*app.Load()).ServeHTTP(w, r) }),
		ReadHeaderTimeout: min(demoHeaderTimeout, *readTimeout),
		ReadTimeout:       *readTimeout,
		WriteTimeout:      *readTimeout + *delay + demoHandlerBudget,
		IdleTimeout:       demoIdleTimeout,
		MaxHeaderBytes:    demoMaxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	metricsURL := ""
	if *metricsAddr != "" {
		if mln, err := net.Listen("tcp", *metricsAddr); err != nil {
			fmt.Fprintf(stderr, "idem demo: metrics are not served: cannot listen on %s (%v); pick another --metrics-addr, or empty for none\n", *metricsAddr, err)
		} else {
			metricsURL = demoBaseURL(mln.Addr()) + "/metrics"
			mux := http.NewServeMux()
			mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelWarn)}))
			msrv := &http.Server{Handler: mux, ReadHeaderTimeout: demoHeaderTimeout, ReadTimeout: demoReadTimeout, WriteTimeout: demoReadTimeout, IdleTimeout: demoIdleTimeout}
			go func() { _ = msrv.Serve(mln) }()
			defer msrv.Close()
		}
	}

	code = demoServe(ctx, srv, serveErr, &app, demoSetup{
		base: base, opts: opts, ordersTable: ordersTable, schema: *schema, delay: *delay, lease: *lease, ttl: *ttl,
		requireKey: *requireKey, rate: *rate, mwCfg: mwCfg, logger: logger, metrics: metrics, metricsURL: metricsURL,
		payments: payments,
		events:   *events, eventsSubject: *eventsSubject, eventsLease: *eventsLease, eventsRelay: *eventsRelay, outboxTable: qualify(outboxTableName), outboxMetrics: outboxMetrics,
	}, stdout, stderr)
	fmt.Fprintln(stderr, "idem demo: stopped")
	return code
}

// demoSetup is what demoServe needs to open the database and build the service.
type demoSetup struct {
	base              string
	opts              dbopen.Options
	ordersTable       string
	schema            string
	delay, lease, ttl time.Duration
	requireKey        bool
	rate              int
	mwCfg             *idem.Config
	logger            *slog.Logger
	metrics           *idemprom.Metrics // fed by the middleware, the store and the janitor
	metricsURL        string            // where GET /metrics answers; empty when not served
	payments          *orders.Payments  // nil: orders are not charged
	events            string            // --events: the NATS URL; empty for no events
	eventsSubject     string
	eventsLease       time.Duration
	eventsRelay       bool            // run the relay in the demo
	outboxMetrics     outbox.Observer // the relay's metrics (idemprom.Outbox)
	outboxTable       string          // the outbox table, with --prefix and --schema
}

// demoServe opens the database while srv already answers 503, then serves the
// service until ctx ends or the server fails, and shuts down. It returns the
// exit code.
func demoServe(ctx context.Context, srv *http.Server, serveErr chan error, app *atomic.Pointer[http.Handler], c demoSetup, stdout, stderr io.Writer) int {
	shutdown := func(timeout time.Duration) int {
		// A second Ctrl-C or SIGTERM kills the process at once.
		signal.Reset(os.Interrupt, syscall.SIGTERM)
		sctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		if err := srv.Shutdown(sctx); err != nil {
			_ = srv.Close()
			fmt.Fprintf(stderr, "idem demo: requests still in flight after %v were cut off: %v\n", timeout, err)
			return exitFailure
		}
		return exitOK
	}
	fail := func(err error) int {
		if ctx.Err() != nil {
			fmt.Fprintf(stderr, "idem demo: %v before the demo was ready\n", demoStopReason(ctx))
			shutdown(time.Second)
			return exitOK
		}
		fmt.Fprintf(stderr, "idem demo: %v\n", err)
		shutdown(time.Second)
		return exitFailure
	}
	h, err := dbopen.Open(ctx, c.opts)
	if err != nil {
		return fail(err)
	}
	defer h.Close()
	if c.schema != "" {
		if err := dbopen.CreateSchema(ctx, h.Pool, c.schema); err != nil {
			return fail(fmt.Errorf("create schema %s: %w (may this role create schemas? Or create it yourself)", c.schema, err))
		}
	}
	if err := h.Migrate(ctx); err != nil {
		return fail(err)
	}
	ocfg := &orders.Config{Table: c.ordersTable, HandlerDelay: c.delay, Payments: c.payments}
	var ev *demoEventsRun
	if c.events != "" {
		ev, err = demoEventsOpen(ctx, h, c, ocfg)
		if err != nil {
			return fail(err)
		}
		defer ev.close()
	}
	svc, err := orders.New(h.Orders, ocfg)
	if err != nil {
		return fail(err)
	}
	if err := svc.Migrate(ctx); err != nil {
		return fail(err)
	}
	store := c.metrics.Store(h.Store) // times every store operation, keeps its transactions
	mw, err := idem.New(store, c.mwCfg)
	if err != nil {
		return fail(err)
	}

	// auth → rate limit → routing → idem (POST /orders only) → orders.
	keyed := mw
	if ev != nil {
		keyed = func(next http.Handler) http.Handler { return ev.wakeAfter(mw(next)) }
	}
	var routes http.Handler = svc.Handler(keyed)
	if c.rate > 0 {
		rate := c.rate
		routes = httprate.LimitBy(rate, time.Second,
			func(r *http.Request) (string, error) { return idem.ScopeFrom(r.Context()), nil },
			httprate.WithLimitHandler(func(w http.ResponseWriter, r *http.Request) {
				orders.WriteProblem(w, http.StatusTooManyRequests, "rate_limited",
					fmt.Sprintf("this tenant sent more than %d requests in a second; wait for Retry-After and retry with the same Idempotency-Key (nothing was recorded)", rate))
			}),
		)(routes)
	}
	root := http.NewServeMux()
	root.HandleFunc("GET /healthz", svc.Healthz)
	root.Handle("/", orders.Authenticate(routes))
	var ready http.Handler = root
	app.Store(&ready)
	demoBanner(stdout, c.base, h, svc, c.lease, c.ttl, c.delay, c.requireKey, c.rate, c.metricsURL, c.payments, ev)

	jctx, jcancel := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	if ev != nil && ev.nc != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ev.run(jctx)
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		j := &idem.Janitor{
			Store:    store,
			Interval: time.Minute, // expired records already count as absent
			OnSweep: func(n int, err error) {
				c.metrics.OnSweep(n, err)
				if err != nil {
					c.logger.Warn("janitor", "deleted", n, "err", err)
				} else if n > 0 {
					c.logger.Info("janitor", "deleted", n)
				}
			},
		}
		_ = j.Run(jctx)
	}()

	code := exitOK
	select {
	case err := <-serveErr:
		fmt.Fprintf(stderr, "idem demo: the server stopped: %v\n", err)
		code = exitFailure
	case <-ctx.Done():
		timeout := demoShutdownTimeout + c.delay
		fmt.Fprintf(stderr, "idem demo: %v; shutting down; waiting up to %v for requests in flight (Ctrl-C again to stop at once)\n", demoStopReason(ctx), timeout)
		code = shutdown(timeout)
	}
	jcancel()
	wg.Wait()
	if err := h.Close(); err != nil {
		fmt.Fprintf(stderr, "idem demo: closing the database: %v\n", err)
		code = exitFailure
	}
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

// demoBanner prints, after the "listening on" line, where the data lives and a
// curl command to paste.
func demoBanner(w io.Writer, base string, h *dbopen.Handle, svc *orders.Service, lease, ttl, delay time.Duration, requireKey bool, rate int, metricsURL string, payments *orders.Payments, ev *demoEventsRun) {
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
	if metricsURL != "" {
		fmt.Fprintf(w, "  metrics: %s (Prometheus text format, no token)\n", metricsURL)
	}
	if payments != nil {
		unknown := "rerun with the same key"
		if payments.RefuseUnknown {
			unknown = "refuse (outcome unknown until idem resolve)"
		}
		fmt.Fprintf(w, "  payments: every new order is charged at %s/charges (timeout %v; a charge begun and not recorded: %s)\n", strings.TrimRight(payments.URL, "/"), payments.Timeout, unknown)
	}
	switch {
	case ev != nil && ev.nc != nil:
		fmt.Fprintf(w, "  events: every order's event is written to %s in the order's transaction; the relay publishes it to %s on %s\n", ev.ob.table, ev.subject, natsDisplay(ev.url))
	case ev != nil:
		fmt.Fprintf(w, "  events: every order's event is written to %s in the order's transaction; no relay runs here (--events-relay=false): run idem relay\n", ev.ob.table)
	}
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

// errParentExited is the cause of the demo's stop when the process that
// started it exits.
var errParentExited = errors.New("the process that started the demo exited")

// demoWatchParent stops the demo (stop(errParentExited)) when its parent
// process changes from ppid: on Unix an orphan is re-parented, to init or a
// subreaper. It returns when ctx ends. With ppid 1 (started by init, or already
// orphaned) there is nothing to watch.
func demoWatchParent(ctx context.Context, ppid int, stop context.CancelCauseFunc) {
	if ppid <= 1 {
		return
	}
	t := time.NewTicker(demoParentPoll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if os.Getppid() != ppid {
				stop(fmt.Errorf("%w (pid %d)", errParentExited, ppid))
				return
			}
		}
	}
}

// demoStopReason says why ctx ended, for the shutdown message.
func demoStopReason(ctx context.Context) string {
	if err := context.Cause(ctx); errors.Is(err, errParentExited) {
		return err.Error()
	}
	return "interrupted (SIGINT or SIGTERM)"
}

// demoMaxLogValue is the most bytes of one value a demo log line repeats.
const demoMaxLogValue = 200

// demoLogger returns the demo's logger: text lines on w, every string, error
// and message bounded to demoMaxLogValue bytes, so that a client's input
// (a bearer token, a URL, a key) is never logged whole.
func demoLogger(w io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(&demoLockedWriter{w: w}, &slog.HandlerOptions{
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			switch a.Value.Kind() {
			case slog.KindString:
				a.Value = slog.StringValue(demoBound(a.Value.String()))
			case slog.KindAny:
				if err, ok := a.Value.Any().(error); ok {
					a.Value = slog.StringValue(demoBound(err.Error()))
				} else if _, ok := a.Value.Any().(fmt.Stringer); ok {
					a.Value = slog.StringValue(demoBound(a.Value.String()))
				}
			}
			return a
		},
	}))
}

// demoBound cuts v after demoMaxLogValue bytes (on a rune boundary) and notes
// its length.
func demoBound(v string) string {
	if len(v) <= demoMaxLogValue {
		return v
	}
	cut := demoMaxLogValue
	for cut > 0 && !utf8.RuneStart(v[cut]) {
		cut--
	}
	return v[:cut] + fmt.Sprintf("…(%d bytes)", len(v))
}

// demoObserver logs, through idemslog, what an operator must know about:
// store failures and lost leases (Warn, Error), released keys and takeovers
// (Info). The client's own mistakes (409, 422, 400) and the ordinary outcomes
// are Debug, below the demo's level. Keys and scopes appear as hashes.
func demoObserver(logger *slog.Logger) idem.Observer {
	return idemslog.New(&idemslog.Config{Logger: logger, Level: func(e idem.Event) slog.Level {
		switch e.Kind {
		case idem.EventInFlight, idem.EventMismatch, idem.EventRejected:
			return slog.LevelDebug
		}
		return idemslog.DefaultLevel(e)
	}})
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
// --help (0, usage on stdout) or a usage error (2, message on stderr). It is
// parseFlags, which names flags as --name in its messages.
func storeParse(fs *flag.FlagSet, args []string, env []storeEnvVar, stdout, stderr io.Writer) (pos []string, code int, ok bool) {
	return parseFlags(fs, args, env, stdout, stderr)
}

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
