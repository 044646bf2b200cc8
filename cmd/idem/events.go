package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/dbopen"
	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/mysqlstore/mysqloutbox"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/natsjs"
	"github.com/idemkit/idem/pgstore/pgoutbox"
	"github.com/idemkit/idem/sqlitestore/sqliteoutbox"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The outbox as the demo and `idem relay` use it: one table per database
// (PREFIXidem_outbox, in --schema on PostgreSQL), its dead letters next to it
// (PREFIXidem_outbox_dead).

// defaultEventsSubject is the subject of the demo's events (--events-subject).
const defaultEventsSubject = "orders.created"

// eventName is the outbox.Message Name of an order's event: with the
// request's scope and key it makes the message ID.
const eventName = "order.created"

// unkeyedEventName is the Name an order's event ID derives from, with the
// order's id as the key, when the ID cannot derive from the request's key
// (orderEventMessage): never eventName, so that no keyed order's event
// shares it.
const unkeyedEventName = "order.created/by-order-id"

// eventsOutbox is an outbox table, whatever the database.
type eventsOutbox struct {
	table   string
	source  outbox.Source
	migrate func(ctx context.Context) error
	// enqueue writes m in tx, the order's transaction.
	enqueue func(ctx context.Context, tx orders.Tx, m outbox.Message) error
	// dead lists up to limit dead letters, oldest first.
	dead func(ctx context.Context, limit int) ([]deadLetter, error)
	// redrive moves dead letters back into the outbox.
	redrive func(ctx context.Context, seqs ...int64) (int, error)
}

// deadLetter is a dead-lettered message as `idem relay --dead-letters` shows it.
type deadLetter struct {
	Seq        int64     `json:"seq"`
	ID         string    `json:"id"`
	Subject    string    `json:"subject"`
	Attempts   int       `json:"attempts"`
	EnqueuedAt time.Time `json:"enqueued_at"`
	DeadAt     time.Time `json:"dead_at"`
	Reason     string    `json:"reason"`
	Payload    string    `json:"payload"`
}

// deadLetters converts a store's dead letters for listing.
func deadLetters(list []outbox.DeadLetter, err error) ([]deadLetter, error) {
	out := make([]deadLetter, 0, len(list))
	for _, d := range list {
		out = append(out, deadLetter{d.Seq, d.ID, d.Subject, d.Attempts, d.EnqueuedAt, d.DeadAt, d.Reason, string(d.Payload)})
	}
	return out, err
}

// openOutbox returns the outbox table of h's database, named table.
func openOutbox(h *dbopen.Handle, table string) (*eventsOutbox, error) {
	switch h.Target.Dialect {
	case orders.Postgres:
		ob, err := pgoutbox.New(h.Pool, &pgoutbox.Config{Table: table})
		if err != nil {
			return nil, err
		}
		return &eventsOutbox{
			table: table, source: ob, migrate: ob.Migrate, redrive: ob.Redrive,
			enqueue: func(ctx context.Context, tx orders.Tx, m outbox.Message) error {
				return ob.Enqueue(ctx, tx.Pgx, m)
			},
			dead: func(ctx context.Context, limit int) ([]deadLetter, error) {
				return deadLetters(ob.DeadLetters(ctx, limit))
			},
		}, nil
	case orders.SQLite:
		ob, err := sqliteoutbox.New(h.SQL, &sqliteoutbox.Config{Table: table})
		if err != nil {
			return nil, err
		}
		return &eventsOutbox{
			table: table, source: ob, migrate: ob.Migrate, redrive: ob.Redrive,
			enqueue: func(ctx context.Context, tx orders.Tx, m outbox.Message) error {
				return ob.Enqueue(ctx, tx.SQL, m)
			},
			dead: func(ctx context.Context, limit int) ([]deadLetter, error) {
				return deadLetters(ob.DeadLetters(ctx, limit))
			},
		}, nil
	case orders.MySQL:
		ob, err := mysqloutbox.New(h.SQL, &mysqloutbox.Config{Table: table})
		if err != nil {
			return nil, err
		}
		return &eventsOutbox{
			table: table, source: ob, migrate: ob.Migrate, redrive: ob.Redrive,
			enqueue: func(ctx context.Context, tx orders.Tx, m outbox.Message) error {
				return ob.Enqueue(ctx, tx.SQL, m)
			},
			dead: func(ctx context.Context, limit int) ([]deadLetter, error) {
				return deadLetters(ob.DeadLetters(ctx, limit))
			},
		}, nil
	}
	return nil, fmt.Errorf("no outbox for %s", h.Target.Display)
}

// orderEvent is the payload of an order's event.
type orderEvent struct {
	OrderID    string    `json:"order_id"`
	CartID     string    `json:"cart_id"`
	Tenant     string    `json:"tenant"`
	TotalCents int64     `json:"total_cents"`
	CreatedAt  time.Time `json:"created_at"`
}

// eventTenantHeader carries the order's tenant with the event (the worker's
// dedupe scope).
const eventTenantHeader = "Tenant"

// orderEventMessage is the outbox message of order o of tenant. Its ID is
// the default, derived from the request's scope and key, when the order
// commits with its key record (keyed, transactional): every attempt and every
// publication of the order's event then carries the same ID. Without a key,
// or with the keys elsewhere (Redis), where a crash can let a retry make a
// second order, the ID is derived from the order's own id.
func orderEventMessage(ctx context.Context, subject, tenant string, o orders.Order, keyedTx bool) (outbox.Message, error) {
	payload, err := json.Marshal(orderEvent{OrderID: o.ID, CartID: o.CartID, Tenant: tenant, TotalCents: o.TotalCents, CreatedAt: o.CreatedAt})
	if err != nil {
		return outbox.Message{}, err
	}
	m := outbox.Message{Name: eventName, Subject: subject, Payload: payload, Headers: map[string]string{eventTenantHeader: tenant}}
	if _, _, ok := idem.KeyFrom(ctx); !ok || !keyedTx {
		// Under a Name of its own: a key is the client's to choose, so a key
		// of the order id's form must not give a keyed order this ID.
		m.ID = outbox.MessageID(tenant, o.ID, unkeyedEventName)
		m.PartitionKey = m.ID
	}
	return m, nil
}

// publishableSubject reports whether s is a NATS subject one can publish
// on: dot-separated tokens, none empty, none a wildcard, no white space or
// control character, not reserved (outbox.ReservedSubject: $JS., $SYS.,
// _INBOX.…). The demo checks --events-subject with it, for the relay
// could publish nothing else (each event would be dead-lettered, and
// ensureEventsStream would wait for ever, JetStream refusing the subject).
func publishableSubject(s string) bool {
	if s == "" || strings.ContainsAny(s, "*>") || outbox.ReservedSubject(s) {
		return false
	}
	for _, r := range s {
		if r <= ' ' || r == 0x7f {
			return false
		}
	}
	for _, tok := range strings.Split(s, ".") {
		if tok == "" {
			return false
		}
	}
	return true
}

// natsDisplay is a NATS URL without its password, for messages.
func natsDisplay(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.User == nil {
		return raw
	}
	if _, ok := u.User.Password(); ok {
		u.User = url.UserPassword(u.User.Username(), "xxxxx")
	}
	return u.String()
}

// checkNATSURL says what is wrong with a --events or --nats value.
func checkNATSURL(flag, raw string) string {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "nats" && u.Scheme != "tls") || u.Host == "" {
		return fmt.Sprintf("%s %q is not a NATS URL; use nats://HOST:PORT, such as nats://127.0.0.1:4222 (a server started with nats-server -js)", flag, natsDisplay(raw))
	}
	return ""
}

// connectNATS connects to a NATS server and keeps reconnecting for ever: a
// broker outage is waited out, never fatal. It does not wait for the first
// connection, and buffers nothing while disconnected.
func connectNATS(raw, name string, logger *slog.Logger) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := nats.Connect(raw,
		nats.Name(name),
		nats.RetryOnFailedConnect(true),
		nats.MaxReconnects(-1),
		// Nothing buffered while disconnected (as natsjs.NewPublisher asks):
		// a publication fails at once and the relay retries it, rather than
		// one that timed out being sent late from the buffer.
		nats.ReconnectBufSize(-1),
		nats.ReconnectWait(250*time.Millisecond),
		nats.ReconnectJitter(100*time.Millisecond, time.Second),
		nats.Timeout(2*time.Second),
		nats.PingInterval(2*time.Second),
		nats.MaxPingsOutstanding(2),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				logger.Warn("events: NATS connection lost; reconnecting", "err", err)
			}
		}),
		nats.ReconnectHandler(func(c *nats.Conn) { logger.Info("events: NATS reconnected", "server", c.ConnectedUrlRedacted()) }),
	)
	if err != nil {
		return nil, nil, fmt.Errorf("NATS at %s: %w", natsDisplay(raw), err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, js, nil
}

// eventsStreamName is the stream the demo creates for subject when no stream
// captures it: IDEM_ and the subject in capitals, "." and wildcards as "_"
// (IDEM_ORDERS_CREATED).
func eventsStreamName(subject string) string {
	return "IDEM_" + strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z':
			return r - 'a' + 'A'
		case r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_':
			return r
		}
		return '_'
	}, subject)
}

// ensureEventsStream returns the stream that captures subject, creating one
// (eventsStreamName) when none does. It retries until ctx ends while JetStream
// does not answer: the relay must not start before the stream exists (a
// message no stream captures is dead-lettered).
func ensureEventsStream(ctx context.Context, js jetstream.JetStream, subject string, logger *slog.Logger) (string, error) {
	warned := false
	for {
		name, err, fatal := tryEventsStream(ctx, js, subject, logger)
		if err == nil || fatal {
			return name, err
		}
		if ctx.Err() != nil {
			return "", ctx.Err()
		}
		if !warned {
			logger.Warn("events: JetStream does not answer yet; the relay waits for it (orders are still taken, their events wait in the outbox)", "err", err)
			warned = true
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// tryEventsStream is one try of ensureEventsStream, bounded in time; fatal
// says that trying again will not help.
func tryEventsStream(ctx context.Context, js jetstream.JetStream, subject string, logger *slog.Logger) (name string, err error, fatal bool) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	name, err = js.StreamNameBySubject(ctx, subject)
	if err == nil || !errors.Is(err, jetstream.ErrStreamNotFound) {
		return name, err, false
	}
	name = eventsStreamName(subject)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subject}, Storage: jetstream.FileStorage})
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		return "", fmt.Errorf("no stream captures %s, and a stream named %s already exists for other subjects; add %s to a stream's subjects, or pick another --events-subject", subject, name, subject), true
	}
	if err == nil {
		logger.Info("events: created stream", "stream", name, "subject", subject)
	}
	return name, err, false
}

// relayLogger is an outbox.Observer that logs what an operator must know:
// dead letters (Error), failing publications and database calls (Warn, at
// most once every few seconds each, for an outage fails every message).
type relayLogger struct {
	outbox.NopObserver
	logger *slog.Logger
	failed rateLimit
	source rateLimit
}

func (l *relayLogger) Failed(m *outbox.Stored, err error, retryIn time.Duration) {
	if l.failed.allow() {
		l.logger.Warn("relay: publication failed; retried", "msg_id", m.ID, "subject", m.Subject, "attempts", m.Attempts+1, "retry_in", retryIn, "err", err)
	}
}

func (l *relayLogger) DeadLettered(m *outbox.Stored, reason string) {
	l.logger.Error("relay: message dead-lettered (see idem relay --dead-letters)", "msg_id", m.ID, "subject", m.Subject, "reason", reason)
}

func (l *relayLogger) SourceFailed(err error) {
	if l.source.allow() {
		l.logger.Warn("relay: the outbox table does not answer; retried", "err", err)
	}
}

// rateLimit allows one event per 5 s.
type rateLimit struct{ next atomic.Int64 }

func (r *rateLimit) allow() bool {
	now := time.Now()
	next := r.next.Load()
	if now.UnixNano() < next {
		return false
	}
	return r.next.CompareAndSwap(next, now.Add(5*time.Second).UnixNano())
}

// outboxTableName is the outbox table's name before --prefix and --schema.
const outboxTableName = "idem_outbox"

// demoEventsRun is the demo's events: the outbox, the NATS connection, and
// the relay that runs until the demo stops.
type demoEventsRun struct {
	url, subject string
	lease        time.Duration
	ob           *eventsOutbox
	nc           *nats.Conn
	js           jetstream.JetStream
	logger       *slog.Logger
	wake         chan struct{}
	metrics      outbox.Observer
}

// demoEventsOpen creates the outbox table, connects to NATS (without waiting
// for it) and sets ocfg.OnCreate to enqueue each order's event in the
// order's transaction.
func demoEventsOpen(ctx context.Context, h *dbopen.Handle, c demoSetup, ocfg *orders.Config) (*demoEventsRun, error) {
	ob, err := openOutbox(h, c.outboxTable)
	if err != nil {
		return nil, fmt.Errorf("--events: %w", err)
	}
	if err := ob.migrate(ctx); err != nil {
		return nil, fmt.Errorf("--events: create the outbox table %s: %w", ob.table, err)
	}
	ev := &demoEventsRun{url: c.events, subject: c.eventsSubject, lease: c.eventsLease, ob: ob, logger: c.logger, wake: make(chan struct{}, 1), metrics: c.outboxMetrics}
	if c.eventsRelay {
		ev.nc, ev.js, err = connectNATS(c.events, "idem demo", c.logger)
		if err != nil {
			return nil, fmt.Errorf("--events: %w", err)
		}
	}
	keyedTx := h.Transactional()
	ocfg.OnCreate = func(ctx context.Context, tx orders.Tx, tenant string, o orders.Order) error {
		m, err := orderEventMessage(ctx, ev.subject, tenant, o, keyedTx)
		if err != nil {
			return err
		}
		return demoEnqueue(ctx, ev, tx, m)
	}
	return ev, nil
}

// wakeAfter tells the relay to look at the outbox after every request next
// served (by then the order, if any, has committed).
func (ev *demoEventsRun) wakeAfter(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		next.ServeHTTP(w, r)
		select {
		case ev.wake <- struct{}{}:
		default:
		}
	})
}

// run waits for the stream, then relays until ctx ends.
func (ev *demoEventsRun) run(ctx context.Context) {
	stream, err := ensureEventsStream(ctx, ev.js, ev.subject, ev.logger)
	if err != nil {
		if ctx.Err() == nil {
			ev.logger.Error("events: the relay does not run; the events stay in the outbox", "err", err)
		}
		return
	}
	ev.logger.Info("events: relay running", "table", ev.ob.table, "stream", stream, "subject", ev.subject)
	r := &outbox.Relay{
		Source:        ev.ob.source,
		Publisher:     demoPublisher(natsjs.NewPublisher(ev.js)),
		Observer:      ev.observer(),
		LeaseDuration: ev.lease,
		Wake:          ev.wake,
	}
	if err := r.Run(ctx); err != nil {
		ev.logger.Error("events: the relay stopped", "err", err)
	}
}

// observer is what the demo's relay reports to: its log, and the metrics.
func (ev *demoEventsRun) observer() outbox.Observer {
	if ev.metrics == nil {
		return &relayLogger{logger: ev.logger}
	}
	return outboxMulti(&relayLogger{logger: ev.logger}, ev.metrics)
}

// close closes the NATS connection.
func (ev *demoEventsRun) close() {
	if ev.nc != nil {
		ev.nc.Close()
	}
}
