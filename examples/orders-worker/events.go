package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/consumer/natsjs"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/sqlitestore"
)

// EventsSubject is the subject `idem demo --events` publishes an event on for
// every order it creates (its --events-subject); EventsStream is the stream
// the worker creates for it when no stream captures it (the demo does the
// same).
const (
	EventsSubject = "orders.created"
	EventsStream  = "ORDER_EVENTS"
)

// Event is the payload of an orders.created event, as `idem demo --events`
// writes it into its outbox in the order's transaction.
type Event struct {
	OrderID    string    `json:"order_id"` // the order's id, as GET /orders returns it
	CartID     string    `json:"cart_id"`
	Tenant     string    `json:"tenant"`
	TotalCents int64     `json:"total_cents"`
	CreatedAt  time.Time `json:"created_at"`
}

// The fulfilments table holds the effect of each orders.created event: one
// row per application. It deliberately has no unique key on order_id: what
// keeps one row per order is the consumer's dedupe (the record and the row
// commit in one transaction), so a second application would show as a
// second row, and Applied counts it.
const fulfilmentsDDL = `CREATE TABLE IF NOT EXISTS %s (order_id TEXT NOT NULL, tenant TEXT NOT NULL, cart_id TEXT NOT NULL, total_cents BIGINT NOT NULL, message_id TEXT NOT NULL, applied_at TEXT NOT NULL)`

// EnsureEventsStream returns the name of the stream that captures subject,
// creating EventsStream for it when there is none.
func EnsureEventsStream(ctx context.Context, js jetstream.JetStream, subject string) (string, error) {
	name, err := js.StreamNameBySubject(ctx, subject)
	if err == nil {
		return name, nil
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return "", fmt.Errorf("find the stream of %s: %w", subject, err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: EventsStream, Subjects: []string{subject}}); err != nil {
		return "", fmt.Errorf("create stream %s for %s: %w", EventsStream, subject, err)
	}
	return EventsStream, nil
}

// fulfil is the events handler: it applies the event's effect (a fulfilment
// row) through idem's transaction, so that the row and the "processed" record
// commit together, once per message ID.
func (w *Worker) fulfil(ctx context.Context, m *consumer.Message) ([]byte, error) {
	ev, err := parseEvent(m.Payload)
	if err != nil {
		return nil, consumer.Permanent(err)
	}
	if ev.Tenant != tenantOf(m) {
		return nil, consumer.Permanent(fmt.Errorf("event of order %s: tenant %q in the payload, %q in the %s header", ev.OrderID, ev.Tenant, tenantOf(m), TenantHeader))
	}
	q := "INSERT INTO " + w.Effects + " (order_id, tenant, cart_id, total_cents, message_id, applied_at) VALUES ($1, $2, $3, $4, $5, $6)"
	now := time.Now().UTC().Format(time.RFC3339Nano)
	if w.pool != nil {
		_, err = pgstore.Tx(ctx).Exec(ctx, q, ev.OrderID, ev.Tenant, ev.CartID, ev.TotalCents, m.ID, now)
	} else {
		_, err = sqlitestore.Tx(ctx).ExecContext(ctx, q, ev.OrderID, ev.Tenant, ev.CartID, ev.TotalCents, m.ID, now)
	}
	if err != nil {
		return nil, err
	}
	if w.Verbose {
		log.Printf("event %s (delivery %d): fulfilled order %s", m.ID, m.Delivery, ev.OrderID)
	}
	return []byte(ev.OrderID), nil
}

func parseEvent(payload []byte) (Event, error) {
	var ev Event
	if err := json.Unmarshal(payload, &ev); err != nil || ev.OrderID == "" || ev.Tenant == "" {
		return ev, fmt.Errorf(`not an orders.created event (want {"order_id":"ord_…","cart_id":"c_1","tenant":"t1",…}): %q`, payload)
	}
	return ev, nil
}

// Applied returns how many times each order's event was applied (rows of the
// fulfilments table per order_id).
func (w *Worker) Applied(ctx context.Context) (map[string]int, error) {
	q := "SELECT order_id, count(*) FROM " + w.Effects + " GROUP BY order_id"
	out := map[string]int{}
	scan := func(next func() bool, s func(...any) error, errf func() error) error {
		for next() {
			var id string
			var n int
			if err := s(&id, &n); err != nil {
				return err
			}
			out[id] = n
		}
		return errf()
	}
	if w.pool != nil {
		rows, err := w.pool.Query(ctx, q)
		if err != nil {
			return nil, err
		}
		defer rows.Close()
		return out, scan(rows.Next, rows.Scan, rows.Err)
	}
	rows, err := w.db.QueryContext(ctx, q)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	return out, scan(rows.Next, rows.Scan, rows.Err)
}

// RunEvents consumes the events published on subject until ctx ends, with a
// durable consumer named w.Durable+"-events".
func (w *Worker) RunEvents(ctx context.Context, js jetstream.JetStream, subject string) error {
	stream, err := EnsureEventsStream(ctx, js, subject)
	if err != nil {
		return err
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
		Durable: w.Durable + "-events", AckPolicy: jetstream.AckExplicitPolicy,
		FilterSubject: subject,
		AckWait:       orDefault(w.AckWait, 30*time.Second), MaxDeliver: -1, // the Processor dead-letters
	})
	if err != nil {
		return err
	}
	log.Printf("consuming %s from stream %s into table %s", subject, stream, w.Effects)
	return w.consumeEvents(ctx, cons)
}

// consumeEvents runs cons through the Processor and fulfil until ctx ends.
func (w *Worker) consumeEvents(ctx context.Context, cons jetstream.Consumer) error {
	if applyWithoutDedupe {
		return w.consumeEventsNoDedupe(ctx, cons)
	}
	p, err := consumer.New(w.store, consumer.Config{Name: w.Durable + "-events", Lease: orDefault(w.Lease, 30*time.Second),
		Scope: tenantOf, FingerprintHeaders: []string{TenantHeader},
		OnOutcome: func(m *consumer.Message, out consumer.Outcome) {
			if out.Reason != consumer.Executed && w.Verbose {
				log.Printf("event %s: %s (%s) %v", m.ID, out.Action, out.Reason, out.Err)
			}
		}})
	if err != nil {
		return err
	}
	cc, err := cons.Consume(natsjs.Handler(p, w.fulfil, &natsjs.Config{Context: ctx}))
	if err != nil {
		return err
	}
	defer cc.Stop()
	<-ctx.Done()
	return ctx.Err()
}

// applyWithoutDedupe is set only by the idem_broken_worker build tag: the
// pipeline proof's deliberately broken consumer, which applies every delivery
// (no dedupe), to see the exactly-once check fail.
var applyWithoutDedupe = false

// consumeEventsNoDedupe is the broken consumer: it applies the effect of
// every delivery in a transaction of its own, then acks.
func (w *Worker) consumeEventsNoDedupe(ctx context.Context, cons jetstream.Consumer) error {
	cc, err := cons.Consume(func(msg jetstream.Msg) {
		ev, err := parseEvent(msg.Data())
		if err != nil {
			_ = msg.Term()
			return
		}
		q := "INSERT INTO " + w.Effects + " (order_id, tenant, cart_id, total_cents, message_id, applied_at) VALUES ($1, $2, $3, $4, $5, $6)"
		now := time.Now().UTC().Format(time.RFC3339Nano)
		id := msg.Headers().Get(jetstream.MsgIDHeader)
		if w.pool != nil {
			_, err = w.pool.Exec(ctx, q, ev.OrderID, ev.Tenant, ev.CartID, ev.TotalCents, id, now)
		} else {
			_, err = w.db.ExecContext(ctx, q, ev.OrderID, ev.Tenant, ev.CartID, ev.TotalCents, id, now)
		}
		if err != nil {
			_ = msg.Nak()
			return
		}
		_ = msg.Ack()
	})
	if err != nil {
		return err
	}
	defer cc.Stop()
	<-ctx.Done()
	return ctx.Err()
}

func orDefault(d, def time.Duration) time.Duration {
	if d > 0 {
		return d
	}
	return def
}
