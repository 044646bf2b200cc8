package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/consumer"
	consumeramqp "github.com/idemkit/idem/consumer/amqp"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// amqpWorker is the RabbitMQ half of the pipeline proof: a consumer
// (consumer/amqp, dedupe on SQLite) that applies each event's effect — a
// fulfilments row, in the store's transaction — while its connection to
// RabbitMQ is cut at random through a fault proxy of its own, so that
// unacknowledged deliveries come again.
type amqpWorker struct {
	path  string
	mu    sync.Mutex
	seen  []streamEvent // every delivery, redeliveries included
	stop  func()
	cuts  *atomic.Int64
	conns *atomic.Int64
}

// startAMQPWorker declares queue as consumer/amqp wants it (a quorum queue
// with its retry and dead-letter queues, deleted when the test ends) and
// consumes it until stop.
//
// Without dedupe (IDEM_PIPELINE_BROKEN=no-dedupe) it applies every delivery
// in a transaction of its own, and acks: the broken variant the exactly-once
// check must catch.
func startAMQPWorker(t *testing.T, amqpURL, queue string, dedupe bool) *amqpWorker {
	t.Helper()
	conn, err := amqp091.Dial(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := consumeramqp.Declare(ch, queue); err != nil {
		t.Fatal(err)
	}
	conn.Close()
	t.Cleanup(func() {
		if conn, err := amqp091.Dial(amqpURL); err == nil {
			if ch, err := conn.Channel(); err == nil {
				for _, q := range append([]string{queue, queue + ".dead"}, consumeramqp.RetryQueues(queue)...) {
					_, _ = ch.QueueDelete(q, false, false, false)
				}
			}
			conn.Close()
		}
	})
	path := filepath.Join(t.TempDir(), "fulfilments.db")
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	store, err := sqlitestore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE fulfilments (order_id TEXT NOT NULL, tenant TEXT NOT NULL, message_id TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	p, err := consumer.New(store, consumer.Config{Name: "pipeline-amqp", Lease: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	apply := func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		var ev orderEvent
		if err := json.Unmarshal(m.Payload, &ev); err != nil || ev.OrderID == "" {
			return nil, consumer.Permanent(fmt.Errorf("not an order event: %q", m.Payload))
		}
		_, err := sqlitestore.Tx(ctx).ExecContext(ctx, `INSERT INTO fulfilments (order_id, tenant, message_id) VALUES (?, ?, ?)`, ev.OrderID, ev.Tenant, m.ID)
		return nil, err
	}
	if !dedupe {
		apply = func(ctx context.Context, m *consumer.Message) ([]byte, error) {
			var ev orderEvent
			_ = json.Unmarshal(m.Payload, &ev)
			_, err := db.ExecContext(ctx, `INSERT INTO fulfilments (order_id, tenant, message_id) VALUES (?, ?, ?)`, ev.OrderID, ev.Tenant, m.ID)
			return nil, err
		}
		p = nil
	}
	fp, err := faults.Listen(amqpHost(t, amqpURL))
	if err != nil {
		t.Fatal(err)
	}
	viaProxy := replaceHost(amqpURL, amqpHost(t, amqpURL), fp.Addr())
	w := &amqpWorker{path: path, cuts: new(atomic.Int64), conns: new(atomic.Int64)}
	rctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // consume, reconnecting after every cut
		defer wg.Done()
		for rctx.Err() == nil {
			consumeOnce(rctx, viaProxy, queue, p, apply, w.record)
			w.conns.Add(1)
			select {
			case <-rctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	go func() { // cut its connection every 0.3-1.5 s
		defer wg.Done()
		for {
			select {
			case <-rctx.Done():
				return
			case <-time.After(time.Duration(300+rand.IntN(1200)) * time.Millisecond):
				if fp.Cut() > 0 {
					w.cuts.Add(1)
				}
			}
		}
	}()
	w.stop = func() { cancel(); wg.Wait(); fp.Close() }
	return w
}

// consumeOnce consumes queue on one connection until it breaks or ctx ends.
func consumeOnce(ctx context.Context, url, queue string, p *consumer.Processor, h consumer.Handler, record func(*amqp091.Delivery)) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	if err := ch.Confirm(false); err != nil {
		return
	}
	if err := ch.Qos(16, 0, false); err != nil {
		return
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return
	}
	cfg := &consumeramqp.Config{Queue: queue, Publisher: ch}
	for {
		select {
		case <-ctx.Done():
			return
		case d, ok := <-deliveries:
			if !ok {
				return
			}
			record(&d)
			if p == nil { // no dedupe: apply, then ack
				if _, err := h(ctx, consumeramqp.Message(&d, "")); err == nil {
					_ = d.Ack(false)
				} else {
					_ = d.Nack(false, true)
				}
				continue
			}
			_, _ = consumeramqp.Handle(ctx, p, &d, h, cfg)
		}
	}
}

// applied counts the worker's fulfilments per order.
func (w *amqpWorker) applied(t *testing.T) map[string]int { return sqliteApplied(t, w.path) }

// queueDepth returns the messages ready in queue.
func queueDepth(t *testing.T, url, queue string) int {
	t.Helper()
	conn, err := amqp091.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, amqp091.Table{"x-queue-type": "quorum", "x-dead-letter-exchange": "", "x-dead-letter-routing-key": queue + ".dead"})
	if err != nil {
		t.Fatal(err)
	}
	return q.Messages
}

// record keeps what a delivery carried, for the checks: the events as the
// broker delivered them.
func (w *amqpWorker) record(d *amqp091.Delivery) {
	e := streamEvent{msgID: d.MessageId}
	if v, ok := d.Headers[eventTenantHeader].(string); ok {
		e.header = v
	}
	_ = json.Unmarshal(d.Body, &e.orderEvent)
	w.mu.Lock()
	w.seen = append(w.seen, e)
	w.mu.Unlock()
}

// deliveries returns every delivery recorded.
func (w *amqpWorker) deliveries() []streamEvent {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]streamEvent(nil), w.seen...)
}

// replaceHost puts host instead of old in the URL raw.
func replaceHost(raw, old, host string) string { return strings.Replace(raw, old, host, 1) }
