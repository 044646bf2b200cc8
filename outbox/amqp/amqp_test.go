package amqp_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
	outboxamqp "github.com/idemkit/idem/outbox/amqp"
	"github.com/idemkit/idem/pgstore/pgoutbox"
)

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// newOutbox returns a migrated pgoutbox on a fresh schema, and its pool.
func newOutbox(t *testing.T) (*pgoutbox.Outbox, *pgxpool.Pool) {
	t.Helper()
	url := testenv.PostgresURL(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	schema := "idem_outbox_amqp_" + randHex(5)
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
		pool.Close()
	})
	o, err := pgoutbox.New(pool, &pgoutbox.Config{Table: schema + ".outbox", MaxPayload: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return o, pool
}

func enqueue(t *testing.T, o *pgoutbox.Outbox, pool *pgxpool.Pool, msgs ...outbox.Message) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range msgs {
		if err := o.Enqueue(ctx, tx, m); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// queue declares a fresh queue, deleted when t ends.
func queue(t *testing.T) (*amqp091.Channel, string) {
	t.Helper()
	conn, err := amqp091.Dial(testenv.AMQPURL(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	q, err := ch.QueueDeclare("idem-outbox-"+randHex(5), false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = ch.QueueDelete(q.Name, false, false, false) })
	return ch, q.Name
}

// drain reads every message in the queue, by message-id.
func drain(t *testing.T, ch *amqp091.Channel, q string) map[string][]amqp091.Delivery {
	t.Helper()
	got := map[string][]amqp091.Delivery{}
	for {
		d, ok, err := ch.Get(q, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			return got
		}
		got[d.MessageId] = append(got[d.MessageId], d)
	}
}

func drainRelay(t *testing.T, o *pgoutbox.Outbox, r *outbox.Relay, within time.Duration) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(within)
	for {
		st, err := o.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d messages still unpublished after %v", st.Pending, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestPublishAndUnroutable: routable messages arrive persistent with
// message-id = ID and their headers; one whose routing key no queue is bound
// to is returned (mandatory) and dead-lettered with the reason, without
// holding up the others.
func TestPublishAndUnroutable(t *testing.T) {
	o, pool := newOutbox(t)
	ch, q := queue(t)
	enqueue(t, o, pool,
		outbox.Message{ID: "m1", Subject: q, Payload: []byte("one"), Headers: map[string]string{"Content-Type": "text/plain", "X-Tenant": "acme"}},
		outbox.Message{ID: "lost", Subject: "nobody-" + randHex(4), Payload: []byte("x")},
		outbox.Message{ID: "m2", Subject: q, Payload: []byte("two")},
	)
	p, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: testenv.AMQPURL(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	drainRelay(t, o, &outbox.Relay{Source: o, Publisher: p, PollInterval: 10 * time.Millisecond}, 20*time.Second)
	got := drain(t, ch, q)
	if len(got) != 2 || len(got["m1"]) != 1 || len(got["m2"]) != 1 {
		t.Fatalf("queue holds %v", got)
	}
	d := got["m1"][0]
	if string(d.Body) != "one" || d.DeliveryMode != amqp091.Persistent || d.Headers["X-Tenant"] != "acme" || d.ContentType != "text/plain" {
		t.Fatalf("delivered %+v", d)
	}
	dead, err := o.DeadLetters(context.Background(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 1 || dead[0].ID != "lost" || !strings.Contains(dead[0].Reason, "NO_ROUTE") {
		t.Fatalf("dead letters %+v", dead)
	}
}

// TestBrokerOutage: the connection to RabbitMQ is cut every 20 ms for 2 s
// (every publication and every redial in that time fails), then restored:
// every message arrives, none is dead-lettered, no operator.
func TestBrokerOutage(t *testing.T) {
	o, pool := newOutbox(t)
	ch, q := queue(t)
	u, _ := url.Parse(testenv.AMQPURL(t))
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "5672")
	}
	proxy, err := faults.Listen(host)
	if err != nil {
		t.Fatal(err)
	}
	defer proxy.Close()
	u.Host = proxy.Addr()
	p, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: u.String()})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	const n = 300
	var msgs []outbox.Message
	for i := range n {
		msgs = append(msgs, outbox.Message{ID: fmt.Sprint("m", i), Subject: q, Payload: []byte(fmt.Sprint(i)), PartitionKey: fmt.Sprint("p", i%10)})
	}
	failed := 0
	obs := &countObserver{failed: &failed}
	r := &outbox.Relay{Source: o, Publisher: p, Observer: obs, BatchSize: 20, PollInterval: 10 * time.Millisecond, MinBackoff: 10 * time.Millisecond, MaxBackoff: 300 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	stop := proxy.CutEvery(20 * time.Millisecond)
	enqueue(t, o, pool, msgs[:n/2]...)
	time.Sleep(time.Second)
	enqueue(t, o, pool, msgs[n/2:]...)
	time.Sleep(time.Second)
	stop()
	recovered := time.Now()
	for {
		st, err := o.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending == 0 {
			if st.DeadLetters != 0 {
				t.Fatalf("%d messages dead-lettered by an outage", st.DeadLetters)
			}
			break
		}
		if time.Since(recovered) > 20*time.Second {
			t.Fatalf("%d messages unpublished 20 s after the broker came back", st.Pending)
		}
		time.Sleep(20 * time.Millisecond)
	}
	drainTime := time.Since(recovered)
	cancel()
	<-done
	got := drain(t, ch, q)
	for _, m := range msgs {
		if len(got[m.ID]) == 0 {
			t.Fatalf("message %s lost in the outage", m.ID)
		}
	}
	if proxy.Cuts() == 0 || obs.n() == 0 {
		t.Fatalf("the outage cut %d connections and failed %d publications: it proved nothing", proxy.Cuts(), obs.n())
	}
	t.Logf("%d messages through a 2 s outage (%d cuts, %d failed publications retried): all delivered %v after recovery", n, proxy.Cuts(), obs.n(), drainTime.Round(time.Millisecond))
}

// TestDeadPort: the publisher first dials a port nothing listens on (the
// broker is down), then, after a second, the broker: every message arrives,
// none is dead-lettered.
func TestDeadPort(t *testing.T) {
	o, pool := newOutbox(t)
	ch, q := queue(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	_ = ln.Close() // nothing listens there now
	up := time.Now().Add(time.Second)
	var deadDials int
	p, err := outboxamqp.NewPublisher(outboxamqp.Config{Dial: func() (*amqp091.Connection, error) {
		if time.Now().Before(up) {
			deadDials++
			return amqp091.Dial("amqp://guest:guest@" + dead + "/")
		}
		return amqp091.Dial(testenv.AMQPURL(t))
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var msgs []outbox.Message
	for i := range 50 {
		msgs = append(msgs, outbox.Message{ID: fmt.Sprint("d", i), Subject: q, Payload: []byte("x")})
	}
	enqueue(t, o, pool, msgs...)
	drainRelay(t, o, &outbox.Relay{Source: o, Publisher: p, PollInterval: 10 * time.Millisecond, MinBackoff: 10 * time.Millisecond, MaxBackoff: 200 * time.Millisecond}, 20*time.Second)
	got := drain(t, ch, q)
	if len(got) != 50 || deadDials == 0 {
		t.Fatalf("%d of 50 delivered, %d dials of the dead port", len(got), deadDials)
	}
	if st, _ := o.Stats(context.Background()); st.DeadLetters != 0 {
		t.Fatalf("%d dead letters", st.DeadLetters)
	}
}
