package amqp_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	idemamqp "github.com/idemkit/idem/consumer/amqp"
	"github.com/idemkit/idem/consumer/internal/prooftest"
	"github.com/idemkit/idem/memstore"
)

// Item 8: a retry copy with a long delay (a message in flight on another
// instance for a minute) does not hold back a later retry with a short one:
// the short one runs again while the long one still waits.
func TestRetryDelaysDoNotWaitBehindEachOther(t *testing.T) {
	b := newBroker(t)
	s := memstore.New(nil)
	defer s.Close()
	p, err := consumer.New(s, consumer.Config{Name: "mixed", Backoff: func(int) time.Duration { return 20 * time.Millisecond }})
	if err != nil {
		t.Fatal(err)
	}
	// "held" is in flight on another instance for a minute.
	now := time.Now()
	if _, ok, err := s.Claim(context.Background(), idem.ClaimRequest{Scope: consumer.StoredScope("mixed", ""), Key: "held", Fingerprint: consumer.Fingerprint([]byte(payload("held"))),
		Token: "another-instance-xxxxxx", Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
		t.Fatal(ok, err)
	}
	var mu sync.Mutex
	var events []string
	var quickRuns atomic.Int32
	stop := consume(t, b, p, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		mu.Lock()
		events = append(events, "run "+m.ID)
		mu.Unlock()
		if m.ID == "quick" && quickRuns.Add(1) == 1 {
			return nil, errors.New("transient")
		}
		return nil, nil
	}, "", func(d *amqp091.Delivery, out consumer.Outcome) {
		mu.Lock()
		events = append(events, out.Reason.String()+" "+d.MessageId)
		mu.Unlock()
	})
	defer stop()
	b.publish(t, "", []string{"held"}, payload)
	waitFor(t, 10*time.Second, "held told to wait", func() bool { mu.Lock(); defer mu.Unlock(); return len(events) > 0 })
	b.publish(t, "", []string{"quick"}, payload)
	waitFor(t, 30*time.Second, "quick retried and executed while held still waits out its minute", func() bool { return quickRuns.Load() == 2 })
	mu.Lock()
	defer mu.Unlock()
	t.Logf("events: %v", events)
	if events[0] != "in_flight held" {
		t.Fatalf("events %v", events)
	}
}

// Items 5 and 11: a COMMIT the database always refuses is a failed delivery
// (x-idem-retries), dead-lettered at MaxDeliveries with our reason and error
// in its headers and without x-idem-retries; shovelled back from q.dead it
// gets its MaxDeliveries again.
func TestRefusedCommitDeadLetteredWithReason(t *testing.T) {
	for _, kind := range prooftest.Kinds {
		t.Run(kind, func(t *testing.T) {
			ctx := context.Background()
			env, err := prooftest.Open(ctx, prooftest.NewTarget(t, kind))
			if err != nil {
				t.Fatal(err)
			}
			defer env.Close(true)
			if err := env.CreateRefusedAtCommit(ctx); err != nil {
				t.Fatal(err)
			}
			b := newBroker(t)
			const maxD = 3
			p, _ := consumer.New(env.Store, consumer.Config{Name: "refused", MaxDeliveries: maxD, Backoff: func(int) time.Duration { return 10 * time.Millisecond }})
			var runs, dead atomic.Int32
			stop := consume(t, b, p, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
				runs.Add(1)
				return env.InsertRefusedAtCommit(ctx, m)
			}, "", func(_ *amqp091.Delivery, out consumer.Outcome) {
				if out.Action == consumer.DeadLetter {
					dead.Add(1)
				}
			})
			b.publish(t, "", []string{"refused-1"}, payload)
			waitFor(t, 30*time.Second, "the message dead-lettered", func() bool { return dead.Load() == 1 })
			if runs.Load() != maxD {
				t.Fatalf("the handler ran %d times; want MaxDeliveries (%d)", runs.Load(), maxD)
			}
			waitFor(t, 10*time.Second, "the dead letter in q.dead", func() bool { return b.depth(t, b.queue+".dead") == 1 })
			ch, _ := b.conn.Channel()
			defer ch.Close()
			d, ok, err := ch.Get(b.queue+".dead", true)
			if err != nil || !ok {
				t.Fatal(ok, err)
			}
			if d.Headers[idemamqp.DeadReasonHeader] != "poison" || !strings.Contains(d.Headers[idemamqp.DeadErrorHeader].(string), "refused") {
				t.Fatalf("dead letter headers %v; want our reason and error", d.Headers)
			}
			if _, ok := d.Headers[idemamqp.RetriesHeader]; ok {
				t.Fatalf("dead letter keeps %s: %v", idemamqp.RetriesHeader, d.Headers)
			}
			// Shovelled back: MaxDeliveries runs again, not one.
			c, err := b.ch.PublishWithDeferredConfirmWithContext(ctx, "", b.queue, false, false, amqp091.Publishing{MessageId: d.MessageId, Headers: d.Headers, Body: d.Body})
			if err != nil || !c.Wait() {
				t.Fatal(err)
			}
			waitFor(t, 30*time.Second, "the replayed message dead-lettered again", func() bool { return dead.Load() == 2 })
			stop()
			if runs.Load() != 2*maxD {
				t.Fatalf("the replayed message ran %d times; want MaxDeliveries (%d) again", runs.Load()-maxD, maxD)
			}
		})
	}
}

// Item 11: a dead letter RabbitMQ itself dead-lettered (our publish to q.dead
// failed) keeps x-idem-retries; shovelled back it still starts afresh.
func TestReplayedRabbitDeadLetterStartsAfresh(t *testing.T) {
	d := &amqp091.Delivery{MessageId: "m", Headers: amqp091.Table{idemamqp.RetriesHeader: int32(4), "x-first-death-reason": "rejected"}}
	if m := idemamqp.Message(d, ""); m.Delivery != 1 {
		t.Fatalf("delivery %d; want 1", m.Delivery)
	}
}

// Item 11: Handle with a nil *Config does not panic, and a key header that is
// a number or a byte string is the message's ID, not a missing one.
func TestNilConfigAndNumericKeyHeader(t *testing.T) {
	for _, v := range []any{int64(42), int32(42), []byte("42"), "42"} {
		d := &amqp091.Delivery{Headers: amqp091.Table{"order-id": v}}
		if m := idemamqp.Message(d, "order-id"); m.ID != "42" {
			t.Fatalf("key header %T: ID %q; want 42", v, m.ID)
		}
	}
	b := newBroker(t)
	p, _ := consumer.New(memstore.New(nil), consumer.Config{Name: "nil"})
	conn, err := amqp091.Dial(b.url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, _ := conn.Channel()
	b.publish(t, "", []string{"n1"}, payload)
	var d amqp091.Delivery
	waitFor(t, 10*time.Second, "the message", func() bool {
		var ok bool
		d, ok, _ = ch.Get(b.queue, false)
		return ok
	})
	out, err := idemamqp.Handle(context.Background(), p, &d, func(context.Context, *consumer.Message) ([]byte, error) { return nil, nil }, nil)
	if err != nil || out.Reason != consumer.Executed {
		t.Fatalf("Handle with nil config: %+v, %v", out, err)
	}
}
