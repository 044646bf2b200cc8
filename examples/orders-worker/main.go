// Command orders-worker is the consumer half of the demo: it consumes
// orders.create from NATS JetStream and inserts each order into the same
// orders table as `idem demo`, once per message ID however often JetStream
// delivers it (github.com/idemkit/idem/consumer).
//
//	go run ./examples/orders-worker                      # worker, SQLite file orders.db
//	go run ./examples/orders-worker -publish -id o-1 '{"cart_id":"c_1","total_cents":500}'
//	go run ./examples/orders-worker -publish -id o-1 '{"cart_id":"c_1","total_cents":500}'
//	go run ./examples/orders-worker -count               # 1 order
//	go run ./examples/orders-worker -publish -tenant t2 -id o-1 '{"cart_id":"c_9","total_cents":900}'
//	go run ./examples/orders-worker -count               # 2 orders (past JetStream's window): t2's o-1 is not t1's
//
// Each order is filed under its Tenant header (default "demo"), and dedupe is
// per tenant (consumer.Config.Scope): two tenants' message o-1 are two
// orders. (JetStream's own duplicate window, 2 min by default, knows no
// tenants: within it, it drops t2's o-1 at publish, and the publisher is told
// so in the ack's Duplicate flag.) The worker's records share the demo's idem_records table but never
// an HTTP tenant's scope (consumer.StoredScope).
//
// With -events it is the consumer of `idem demo --events`: it consumes the
// demo's orders.created events (published through the demo's transactional
// outbox, one per order, with a message ID derived from the order's
// idempotency key) and applies each event's effect — a row in its
// fulfilments table — exactly once per message ID, however often the relay
// republished it or JetStream redelivered it:
//
//	go run ./cmd/idem demo --events nats://127.0.0.1:4222   # publishes orders.created
//	go run ./examples/orders-worker -events -db fulfilments.db
//	go run ./examples/orders-worker -events -db fulfilments.db -count   # N fulfilments of N orders
//
// -db takes a SQLite file (default orders.db) or a postgres:// URL; -nats the
// server (default nats://127.0.0.1:4222, started with nats-server -js).
package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/consumer/natsjs"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// Subject is the subject orders are published on; Stream captures it.
const (
	Subject = "orders.create"
	Stream  = "ORDERS"
)

// TenantHeader names the tenant an order belongs to; DefaultTenant is the
// tenant of an order without it.
const (
	TenantHeader  = "Tenant"
	DefaultTenant = "demo"
)

// tenantOf is the message's tenant: the dedupe scope (consumer.Config.Scope)
// and the tenant the order is filed under, read in one place so that both
// always agree.
// The header is read as consumer.Config.FingerprintHeaders reads it: by its
// exact name, else case-insensitively (a producer that sends "tenant" gets
// its own tenant, not DefaultTenant's).
func tenantOf(m *consumer.Message) string {
	vs, ok := m.Header[TenantHeader]
	if !ok {
		var keys []string
		for k := range m.Header {
			if strings.EqualFold(k, TenantHeader) {
				keys = append(keys, k)
			}
		}
		sort.Strings(keys)
		for _, k := range keys {
			vs = append(vs, m.Header[k]...)
		}
	}
	if len(vs) > 0 && vs[0] != "" {
		return vs[0]
	}
	return DefaultTenant
}

func main() {
	dbURL := flag.String("db", "orders.db", "SQLite file or postgres:// URL")
	natsURL := flag.String("nats", nats.DefaultURL, "NATS server with JetStream")
	publish := flag.Bool("publish", false, "publish the order given as the argument instead of consuming")
	id := flag.String("id", "", "with -publish: the message ID (Nats-Msg-Id); publish twice with one ID to see one order")
	tenant := flag.String("tenant", "", "with -publish: the Tenant header (default: none, filed as \"demo\")")
	count := flag.Bool("count", false, "print how many orders the table holds and exit (with -events: fulfilments)")
	events := flag.Bool("events", false, "consume the orders.created events of `idem demo --events` and fulfil each order once, instead of orders.create")
	subject := flag.String("subject", EventsSubject, "with -events: the subject the events are published on (the demo's --events-subject)")
	verbose := flag.Bool("v", false, "with -events: log every event")
	ackWait := flag.Duration("ack-wait", 30*time.Second, "with -events: how long JetStream waits for an ack before it redelivers (after a crash)")
	lease := flag.Duration("lease", 30*time.Second, "with -events: how long a message being processed stays claimed before another delivery may take it over (after a crash)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	nc, err := nats.Connect(*natsURL)
	if err != nil {
		log.Fatalf("connect to NATS at %s (start it with nats-server -js): %v", *natsURL, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	if *publish {
		if err := publishOrder(ctx, js, *id, *tenant, flag.Arg(0)); err != nil {
			log.Fatal(err)
		}
		return
	}
	w, err := Open(ctx, *dbURL)
	if err != nil {
		log.Fatal(err)
	}
	defer w.Close()
	w.Verbose, w.AckWait, w.Lease = *verbose, *ackWait, *lease
	if *events {
		if *count {
			applied, err := w.Applied(ctx)
			if err != nil {
				log.Fatal(err)
			}
			n := 0
			for _, c := range applied {
				n += c
			}
			fmt.Println(n, "fulfilments of", len(applied), "orders")
			return
		}
		if err := w.RunEvents(ctx, js, *subject); err != nil && !errors.Is(err, context.Canceled) {
			log.Fatal(err)
		}
		return
	}
	if *count {
		n, err := w.Count(ctx)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(n, "orders")
		return
	}
	log.Printf("consuming %s from stream %s into %s", Subject, Stream, *dbURL)
	if err := w.Run(ctx, js); err != nil && !errors.Is(err, context.Canceled) {
		log.Fatal(err)
	}
}

// publishOrder publishes body on Subject with id as its Nats-Msg-Id and
// tenant, if any, in the Tenant header. A second publish with the same id
// after JetStream's own duplicate window (2 min by default) would be stored
// again: the worker's dedupe is what keeps one order.
func publishOrder(ctx context.Context, js jetstream.JetStream, id, tenant, body string) error {
	if id == "" || body == "" {
		return errors.New(`-publish needs -id and the order as the argument, for example -publish -id o-1 '{"cart_id":"c_1","total_cents":500}'`)
	}
	if _, err := EnsureStream(ctx, js); err != nil {
		return err
	}
	msg := nats.NewMsg(Subject)
	msg.Data = []byte(body)
	if tenant != "" {
		msg.Header.Set(TenantHeader, tenant)
	}
	ack, err := js.PublishMsg(ctx, msg, jetstream.WithMsgID(id))
	if err != nil {
		return err
	}
	fmt.Printf("published %s as stream sequence %d (duplicate: %v)\n", id, ack.Sequence, ack.Duplicate)
	return nil
}

// EnsureStream creates the ORDERS stream if it does not exist.
func EnsureStream(ctx context.Context, js jetstream.JetStream) (jetstream.Stream, error) {
	return js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: Stream, Subjects: []string{Subject}})
}

// Worker inserts orders into the demo's orders table.
type Worker struct {
	store   idem.Store
	pool    *pgxpool.Pool
	db      *sql.DB
	Table   string // the orders table, "orders" unless changed before Run
	Effects string // the fulfilments table (-events), "fulfilments"
	Durable string // the JetStream consumer's name and the dedupe scope
	Verbose bool   // log every event (-events)
	// AckWait and Lease (-events) bound how long a crash delays an event:
	// JetStream redelivers after AckWait, the dedupe takes over a claim after
	// Lease. Zero means 30 s.
	AckWait, Lease time.Duration
}

// Open opens the database (a SQLite file or a postgres:// URL), migrates
// idem's records table and creates the orders table.
func Open(ctx context.Context, dbURL string) (*Worker, error) {
	w := &Worker{Table: "orders", Effects: "fulfilments", Durable: "orders-worker"}
	ddl := `CREATE TABLE IF NOT EXISTS %s (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, cart_id TEXT NOT NULL, total_cents BIGINT NOT NULL CHECK (total_cents >= 0), created_at TEXT NOT NULL)`
	if strings.HasPrefix(dbURL, "postgres://") || strings.HasPrefix(dbURL, "postgresql://") {
		ddl = strings.Replace(ddl, "created_at TEXT", "created_at TIMESTAMPTZ", 1)
		pool, err := pgxpool.New(ctx, dbURL)
		if err != nil {
			return nil, err
		}
		s, err := pgstore.New(pool, nil)
		if err == nil {
			err = s.Migrate(ctx)
		}
		if err == nil {
			_, err = pool.Exec(ctx, fmt.Sprintf(ddl, w.Table))
		}
		if err == nil {
			_, err = pool.Exec(ctx, fmt.Sprintf(fulfilmentsDDL, w.Effects))
		}
		if err != nil {
			pool.Close()
			return nil, err
		}
		w.store, w.pool = s, pool
		return w, nil
	}
	db, err := embedded.Open(dbURL)
	if err != nil {
		return nil, err
	}
	s, err := sqlitestore.New(db, nil)
	if err == nil {
		err = s.Migrate(ctx)
	}
	if err == nil {
		_, err = db.ExecContext(ctx, fmt.Sprintf(ddl, w.Table))
	}
	if err == nil {
		_, err = db.ExecContext(ctx, fmt.Sprintf(fulfilmentsDDL, w.Effects))
	}
	if err != nil {
		db.Close()
		return nil, err
	}
	w.store, w.db = s, db
	return w, nil
}

// Close closes the database.
func (w *Worker) Close() {
	if w.pool != nil {
		w.pool.Close()
	}
	if w.db != nil {
		_ = w.db.Close()
	}
}

// Count returns the number of orders.
func (w *Worker) Count(ctx context.Context) (n int, err error) {
	q := "SELECT count(*) FROM " + w.Table
	if w.pool != nil {
		err = w.pool.QueryRow(ctx, q).Scan(&n)
	} else {
		err = w.db.QueryRowContext(ctx, q).Scan(&n)
	}
	return n, err
}

type order struct {
	CartID     string `json:"cart_id"`
	TotalCents int64  `json:"total_cents"`
}

// insert is the handler: it writes the order through idem's transaction, so
// that the order and the "processed" record commit together.
func (w *Worker) insert(ctx context.Context, m *consumer.Message) ([]byte, error) {
	var o order
	if err := json.Unmarshal(m.Payload, &o); err != nil || o.CartID == "" || o.TotalCents < 0 {
		return nil, consumer.Permanent(fmt.Errorf("not an order (want {\"cart_id\":\"c_1\",\"total_cents\":500}): %q", m.Payload))
	}
	tenant := tenantOf(m)
	var b [8]byte
	_, _ = rand.Read(b[:])
	id := "ord_" + hex.EncodeToString(b[:])
	q := "INSERT INTO " + w.Table + " (id, tenant, cart_id, total_cents, created_at) VALUES ($1, $2, $3, $4, $5)"
	var err error
	if w.pool != nil {
		_, err = pgstore.Tx(ctx).Exec(ctx, q, id, tenant, o.CartID, o.TotalCents, time.Now().UTC())
	} else {
		_, err = sqlitestore.Tx(ctx).ExecContext(ctx, q, id, tenant, o.CartID, o.TotalCents, time.Now().UTC().Format(time.RFC3339Nano))
	}
	if err != nil {
		return nil, err
	}
	log.Printf("message %s (delivery %d): created order %s", m.ID, m.Delivery, id)
	return []byte(id), nil
}

// Run consumes until ctx ends.
func (w *Worker) Run(ctx context.Context, js jetstream.JetStream) error {
	if _, err := EnsureStream(ctx, js); err != nil {
		return err
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, Stream, jetstream.ConsumerConfig{
		Durable: w.Durable, AckPolicy: jetstream.AckExplicitPolicy,
		AckWait: 30 * time.Second, MaxDeliver: -1, // the Processor dead-letters
	})
	if err != nil {
		return err
	}
	return w.consume(ctx, cons)
}

// consume runs cons through the Processor until ctx ends.
func (w *Worker) consume(ctx context.Context, cons jetstream.Consumer) error {
	p, err := consumer.New(w.store, consumer.Config{Name: w.Durable,
		// Dedupe per tenant: t2's message o-1 is not t1's. The header the scope
		// reads is fingerprinted too.
		Scope: tenantOf, FingerprintHeaders: []string{TenantHeader},
		OnOutcome: func(m *consumer.Message, out consumer.Outcome) {
			if out.Reason != consumer.Executed {
				log.Printf("message %s: %s (%s) %v", m.ID, out.Action, out.Reason, out.Err)
			}
		}})
	if err != nil {
		return err
	}
	// Context: on shutdown a message waiting for the store is naked at once.
	cc, err := cons.Consume(natsjs.Handler(p, w.insert, &natsjs.Config{Context: ctx}))
	if err != nil {
		return err
	}
	defer cc.Stop()
	<-ctx.Done()
	return ctx.Err()
}
