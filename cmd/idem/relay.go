package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem/internal/dbopen"
	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/natsjs"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

func init() {
	register(&command{
		name:    "relay",
		summary: "publish the committed messages of an outbox table to NATS JetStream or RabbitMQ; list its dead letters",
		run:     runRelay,
	})
}

const relayUsage = `Usage: idem relay --db URL (--nats URL | --amqp URL) [flags]
       idem relay --db URL --dead-letters [--limit N] [--json]
       idem relay --db URL --stats
       idem relay --db URL --redrive SEQ,… (or all)

Runs the outbox relay on its own: it leases the committed, unpublished
messages of the outbox table (PREFIXidem_outbox, as idem demo --events and
your handlers' outbox.Enqueue write them), publishes each to the broker with
its message ID (Nats-Msg-Id on JetStream, message-id on RabbitMQ), and marks
it published only once the broker confirmed. It survives broker and database
outages (it retries with backoff, no operator needed) and its own crashes (a
message it leased and did not mark is published again, with the same ID, once
its --lease lapses). Several relays may run on one PostgreSQL or MySQL
database: they share the work and never publish one message at once; on
SQLite several are safe but no faster than one. The messages of one partition (by default,
one request's) are published in order. A message the broker refuses for good
(too large, no stream for its subject, unroutable) is moved to the
dead-letter table (PREFIXidem_outbox_dead) with the reason: --dead-letters
lists them, and once the cause is repaired (a stream created, a limit
raised) --redrive moves them back into the outbox, under their own IDs.
Published messages are deleted after --retention.

It creates the outbox tables if they are missing. On JetStream a stream must
capture the messages' subjects (idem demo --events creates one for its
subject); a message no stream captures is dead-lettered.

Ctrl-C (SIGINT) or SIGTERM stops it: publications in flight finish first.

Example:
  idem relay --db postgres://postgres@127.0.0.1:5432/test --nats nats://127.0.0.1:4222
  idem relay --db postgres://postgres@127.0.0.1:5432/test --dead-letters

Every flag can also be set by an environment variable (shown in brackets); a
flag on the command line wins.

Flags:
`

// relayEnv maps each relay flag to its environment variable.
var relayEnv = []storeEnvVar{
	{"db", "IDEM_DB"}, {"prefix", "IDEM_PREFIX"}, {"schema", "IDEM_SCHEMA"}, {"outbox-table", "IDEM_OUTBOX_TABLE"},
	{"nats", "IDEM_RELAY_NATS"}, {"amqp", "IDEM_RELAY_AMQP"}, {"amqp-exchange", "IDEM_RELAY_AMQP_EXCHANGE"},
	{"batch", "IDEM_RELAY_BATCH"}, {"concurrency", "IDEM_RELAY_CONCURRENCY"}, {"poll", "IDEM_RELAY_POLL"},
	{"lease", "IDEM_RELAY_LEASE"}, {"retention", "IDEM_RELAY_RETENTION"}, {"metrics-addr", "IDEM_RELAY_METRICS_ADDR"},
}

func runRelay(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idem relay", flag.ContinueOnError)
	db := fs.String("db", "", "the database of the outbox table: sqlite:PATH, postgres://… or mysql://USER@HOST:PORT/DB (required)")
	prefix := fs.String("prefix", "", "prefix of the tables' names, as in idem demo: PREFIXidem_outbox")
	schema := fs.String("schema", "", "PostgreSQL only: the schema the outbox table lives in, as in idem demo")
	table := fs.String("outbox-table", "", "the outbox table; empty for PREFIXidem_outbox (dead letters: the same name with _dead)")
	natsURL := fs.String("nats", "", "publish to NATS JetStream at `nats://HOST:PORT`")
	amqpURL := fs.String("amqp", "", "publish to RabbitMQ at `amqp://USER:PASS@HOST:PORT/VHOST`")
	amqpExchange := fs.String("amqp-exchange", "", "with --amqp: the exchange messages are published to, with their subject as the routing key; empty for the default exchange (the subject names a queue)")
	batch := fs.Int("batch", outbox.DefaultBatchSize, "the most messages leased at once")
	concurrency := fs.Int("concurrency", outbox.DefaultConcurrency, "the most publications in flight at once (of different partitions)")
	poll := fs.Duration("poll", outbox.DefaultPollInterval, "how long to wait after a batch that found nothing")
	lease := fs.Duration("lease", outbox.DefaultLeaseDuration, "how long a leased message is this relay's; after a crash another relay publishes it again once this lapses")
	retention := fs.Duration("retention", outbox.DefaultRetention, "how long published messages are kept before they are deleted; negative keeps them forever")
	metricsAddr := fs.String("metrics-addr", "", "`host:port` serving GET /metrics (Prometheus text format); empty for none")
	deadLetters := fs.Bool("dead-letters", false, "list the dead-lettered messages with their reasons, oldest first, and exit")
	limit := fs.Int("limit", 100, "with --dead-letters: the most messages listed")
	asJSON := fs.Bool("json", false, "with --dead-letters or --stats: print JSON")
	stats := fs.Bool("stats", false, "print how many messages wait (and the age of the oldest) and how many are dead-lettered, and exit")
	redrive := fs.String("redrive", "", "move the dead letters of these sequence numbers (`SEQ,…`, as --dead-letters shows them; all: every one) back into the outbox, and exit")
	untilEmpty := fs.Bool("exit-when-empty", false, "exit (0) as soon as no message waits: drain the outbox and stop")
	fs.Usage = storeUsage(fs, relayUsage, relayEnv)
	pos, code, ok := parseFlags(fs, args, relayEnv, stdout, stderr)
	if !ok {
		return code
	}
	if len(pos) > 0 {
		return storeUsageError(stderr, fs, fmt.Sprintf("unexpected argument %q; idem relay takes flags only", pos[0]))
	}
	if *db == "" {
		return storeUsageError(stderr, fs, "--db is required: the database your service writes its outbox in, for example --db postgres://postgres@127.0.0.1:5432/test")
	}
	var redriveSeqs []int64
	if *redrive != "" && *redrive != "all" {
		for _, f := range strings.Split(*redrive, ",") {
			n, err := strconv.ParseInt(strings.TrimSpace(f), 10, 64)
			if err != nil || n < 1 {
				return storeUsageError(stderr, fs, fmt.Sprintf("--redrive %q: give sequence numbers as --dead-letters shows them, separated by commas (12,15), or all", *redrive))
			}
			redriveSeqs = append(redriveSeqs, n)
		}
	}
	inspecting := *deadLetters || *stats || *redrive != ""
	switch {
	case inspecting && (*natsURL != "" || *amqpURL != ""):
		return storeUsageError(stderr, fs, "--dead-letters, --stats and --redrive only work on the database; drop --nats and --amqp")
	case !inspecting && *natsURL == "" && *amqpURL == "":
		return storeUsageError(stderr, fs, "name the broker: --nats nats://HOST:PORT or --amqp amqp://USER:PASS@HOST:PORT/ (or --dead-letters, --stats to inspect the outbox)")
	case *natsURL != "" && *amqpURL != "":
		return storeUsageError(stderr, fs, "--nats and --amqp are exclusive: run one relay per broker")
	}
	if *natsURL != "" {
		if msg := checkNATSURL("--nats", *natsURL); msg != "" {
			return storeUsageError(stderr, fs, msg)
		}
	}
	if *amqpURL != "" {
		if msg := checkAMQPURL(*amqpURL); msg != "" {
			return storeUsageError(stderr, fs, msg)
		}
	}
	for _, c := range []struct {
		name string
		v    int
	}{{"--batch", *batch}, {"--concurrency", *concurrency}, {"--limit", *limit}} {
		if c.v < 1 {
			return storeUsageError(stderr, fs, fmt.Sprintf("%s %d is not positive; use a whole number of 1 or more", c.name, c.v))
		}
	}
	if *poll <= 0 {
		return storeUsageError(stderr, fs, fmt.Sprintf("--poll %v is not positive; use a duration such as 200ms", *poll))
	}
	if *lease < time.Second {
		return storeUsageError(stderr, fs, fmt.Sprintf("--lease %v is too short; use 1s or more (a publication may take up to half of it)", *lease))
	}
	if *retention == 0 {
		return storeUsageError(stderr, fs, "--retention 0 would delete published messages at once; use a duration such as 168h, or a negative one to keep them")
	}
	if *metricsAddr != "" {
		if msg := listenAddrProblem("--metrics-addr", *metricsAddr); msg != "" {
			return storeUsageError(stderr, fs, msg+", or empty for no metrics")
		}
	}
	opts := dbopen.Options{DB: *db, Prefix: *prefix, Schema: *schema, MustExist: true}
	if err := opts.Check(); err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	name := *table
	if name == "" {
		name = *prefix + outboxTableName
		if *schema != "" {
			name = *schema + "." + name
		}
	}

	h, err := dbopen.Open(ctx, opts)
	if err != nil {
		fmt.Fprintf(stderr, "idem relay: %v\n", err)
		return exitFailure
	}
	defer h.Close()
	ob, err := openOutbox(h, name)
	if err != nil {
		fmt.Fprintf(stderr, "idem relay: %v\n", err)
		return exitFailure
	}
	if *stats || *deadLetters {
		// Read-only: create nothing, so a wrong --prefix is an error, not
		// an empty outbox reported as "0 pending".
		if err := outboxTableExists(ctx, h, ob.table); err != nil {
			fmt.Fprintf(stderr, "idem relay: the outbox table %s cannot be read (%v): check --prefix, --schema and --outbox-table, or run the relay once with --nats or --amqp to create it\n", ob.table, err)
			return exitFailure
		}
	} else if err := ob.migrate(ctx); err != nil {
		fmt.Fprintf(stderr, "idem relay: create the outbox table %s: %v\n", ob.table, err)
		return exitFailure
	}
	if *stats {
		return relayStats(ctx, ob, *asJSON, stdout, stderr)
	}
	if *deadLetters {
		return relayDeadLetters(ctx, ob, *limit, *asJSON, stdout, stderr)
	}
	if *redrive != "" {
		return relayRedrive(ctx, ob, redriveSeqs, stdout, stderr)
	}

	logger := demoLogger(stderr)
	var pub outbox.Publisher
	broker := ""
	switch {
	case *natsURL != "":
		nc, js, err := connectNATS(*natsURL, "idem relay", logger)
		if err != nil {
			fmt.Fprintf(stderr, "idem relay: %v\n", err)
			return exitFailure
		}
		defer nc.Close()
		pub, broker = natsjs.NewPublisher(js), natsDisplay(*natsURL)
	case *amqpURL != "":
		p, closeFn, err := amqpPublisher(*amqpURL, *amqpExchange, logger)
		if err != nil {
			fmt.Fprintf(stderr, "idem relay: %v\n", err)
			return exitFailure
		}
		defer closeFn()
		pub, broker = p, amqpDisplay(*amqpURL)
	}

	var obs outbox.Observer = &relayLogger{logger: logger}
	if *metricsAddr != "" {
		reg := prometheus.NewRegistry()
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		m, err := relayMetrics(reg)
		if err != nil {
			fmt.Fprintf(stderr, "idem relay: %v\n", err)
			return exitFailure
		}
		obs = outboxMulti(obs, m)
		ln, err := net.Listen("tcp", *metricsAddr)
		if err != nil {
			fmt.Fprintf(stderr, "idem relay: cannot listen on --metrics-addr %s (%v); pick another address, or empty for no metrics\n", *metricsAddr, err)
			return exitFailure
		}
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelWarn)}))
		msrv := &http.Server{Handler: mux, ReadHeaderTimeout: demoHeaderTimeout, ReadTimeout: demoReadTimeout, WriteTimeout: demoReadTimeout, IdleTimeout: demoIdleTimeout}
		go func() { _ = msrv.Serve(ln) }()
		defer msrv.Close()
		fmt.Fprintf(stdout, "idem relay: metrics on %s/metrics\n", demoBaseURL(ln.Addr()))
	}

	rctx, stop := context.WithCancel(ctx)
	defer stop()
	r := &outbox.Relay{
		Source: ob.source, Publisher: pub, Observer: obs,
		BatchSize: *batch, Concurrency: *concurrency, PollInterval: *poll,
		LeaseDuration: *lease, Retention: *retention,
	}
	if *untilEmpty {
		go relayStopWhenEmpty(rctx, ob.source, *poll, stop)
	}
	fmt.Fprintf(stdout, "idem relay: publishing the outbox %s of %s to %s\n", ob.table, h.Target.Display, broker)
	if err := r.Run(rctx); err != nil {
		fmt.Fprintf(stderr, "idem relay: %v\n", err)
		return exitFailure
	}
	if ctx.Err() != nil {
		fmt.Fprintln(stderr, "idem relay: interrupted (SIGINT or SIGTERM); stopped")
	} else {
		fmt.Fprintln(stdout, "idem relay: the outbox is empty; stopped")
	}
	return exitOK
}

// relayStopWhenEmpty calls stop once the source has no pending message.
func relayStopWhenEmpty(ctx context.Context, src outbox.Source, every time.Duration, stop func()) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if s, err := src.Stats(ctx); err == nil && s.Pending == 0 {
			stop()
			return
		}
	}
}

func relayStats(ctx context.Context, ob *eventsOutbox, asJSON bool, stdout, stderr io.Writer) int {
	s, err := ob.source.Stats(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "idem relay: %v\n", err)
		return exitFailure
	}
	if asJSON {
		b, _ := json.Marshal(map[string]any{"table": ob.table, "pending": s.Pending, "oldest_pending_seconds": s.OldestPending.Seconds(), "dead_letters": s.DeadLetters})
		fmt.Fprintln(stdout, string(b))
		return exitOK
	}
	fmt.Fprintf(stdout, "outbox %s: %d pending (oldest %v), %d dead-lettered\n", ob.table, s.Pending, s.OldestPending.Round(time.Millisecond), s.DeadLetters)
	return exitOK
}

func relayDeadLetters(ctx context.Context, ob *eventsOutbox, limit int, asJSON bool, stdout, stderr io.Writer) int {
	list, err := ob.dead(ctx, limit)
	if err != nil {
		fmt.Fprintf(stderr, "idem relay: %v\n", err)
		return exitFailure
	}
	if asJSON {
		enc := json.NewEncoder(stdout)
		for _, d := range list {
			_ = enc.Encode(d)
		}
		return exitOK
	}
	if len(list) == 0 {
		fmt.Fprintf(stdout, "no dead letters in %s_dead\n", strings.Trim(ob.table, `"`))
		return exitOK
	}
	for _, d := range list {
		fmt.Fprintf(stdout, "seq %d  id %s  subject %s  attempts %d  enqueued %s  dead %s\n  reason: %s\n",
			d.Seq, d.ID, d.Subject, d.Attempts, d.EnqueuedAt.UTC().Format(time.RFC3339), d.DeadAt.UTC().Format(time.RFC3339), d.Reason)
	}
	if len(list) == limit {
		fmt.Fprintf(stdout, "(the first %d; --limit lists more)\n", limit)
	}
	return exitOK
}

// relayRedrive moves the dead letters seqs (nil: all) back into the outbox.
func relayRedrive(ctx context.Context, ob *eventsOutbox, seqs []int64, stdout, stderr io.Writer) int {
	if seqs == nil { // all, a thousand at a time
		// Those there now: a relay running meanwhile may dead-letter
		// redriven messages again (the cause not fixed yet), under new
		// sequence numbers, after all of these; chasing them would never end.
		st, err := ob.source.Stats(ctx)
		if err != nil {
			fmt.Fprintf(stderr, "idem relay: %v\n", err)
			return exitFailure
		}
		total := 0
		for int64(total) < st.DeadLetters {
			list, err := ob.dead(ctx, int(min(1000, st.DeadLetters-int64(total))))
			if err != nil {
				fmt.Fprintf(stderr, "idem relay: %v\n", err)
				return exitFailure
			}
			batch := make([]int64, 0, len(list))
			for _, d := range list {
				batch = append(batch, d.Seq)
			}
			n := 0
			if len(batch) > 0 {
				if n, err = ob.redrive(ctx, batch...); err != nil {
					fmt.Fprintf(stderr, "idem relay: %v (after %d redriven)\n", err, total)
					return exitFailure
				}
			}
			total += n
			if n == 0 {
				break
			}
		}
		fmt.Fprintf(stdout, "redrove %d dead letters into the outbox\n", total)
		return exitOK
	}
	n, err := ob.redrive(ctx, seqs...)
	if err != nil {
		fmt.Fprintf(stderr, "idem relay: %v\n", err)
		return exitFailure
	}
	fmt.Fprintf(stdout, "redrove %d dead letters into the outbox\n", n)
	if n < len(seqs) {
		fmt.Fprintf(stderr, "idem relay: %d of the %d sequence numbers named no dead letter (see --dead-letters)\n", len(seqs)-n, len(seqs))
		return exitFailure
	}
	return exitOK
}

// outboxMulti is an Observer that tells each of obs.
func outboxMulti(obs ...outbox.Observer) outbox.Observer { return multiObserver(obs) }

type multiObserver []outbox.Observer

func (m multiObserver) Published(s *outbox.Stored, lag time.Duration) {
	for _, o := range m {
		o.Published(s, lag)
	}
}

func (m multiObserver) Failed(s *outbox.Stored, err error, retryIn time.Duration) {
	for _, o := range m {
		o.Failed(s, err, retryIn)
	}
}

func (m multiObserver) DeadLettered(s *outbox.Stored, reason string) {
	for _, o := range m {
		o.DeadLettered(s, reason)
	}
}

func (m multiObserver) Batch(n int, d time.Duration) {
	for _, o := range m {
		o.Batch(n, d)
	}
}

func (m multiObserver) Stats(s outbox.Stats) {
	for _, o := range m {
		o.Stats(s)
	}
}

func (m multiObserver) SourceFailed(err error) {
	for _, o := range m {
		o.SourceFailed(err)
	}
}

func (m multiObserver) Deleted(n int) {
	for _, o := range m {
		o.Deleted(n)
	}
}

// outboxTableExists reads nothing from table, but fails when it does not
// exist (or cannot be read). The name was checked by openOutbox (letters,
// digits, underscores, one optional dot), so quoting its parts is enough.
func outboxTableExists(ctx context.Context, h *dbopen.Handle, table string) error {
	parts := strings.Split(table, ".")
	if h.Pool != nil {
		_, err := h.Pool.Exec(ctx, "SELECT 1 FROM "+pgx.Identifier(parts).Sanitize()+" WHERE 1 = 0")
		return err
	}
	q := `"`
	if h.Target.Dialect == orders.MySQL {
		q = "`"
	}
	for i, p := range parts {
		parts[i] = q + p + q
	}
	rows, err := h.SQL.QueryContext(ctx, "SELECT 1 FROM "+strings.Join(parts, ".")+" WHERE 1 = 0")
	if err != nil {
		return err
	}
	return rows.Close()
}
