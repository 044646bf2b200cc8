package amqp_test

import (
	"context"
	"errors"
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

// A key header of any number type RabbitMQ carries (the docs say "a number")
// is the message ID: floats and decimals too, published through the real
// broker. Two different numbers are two messages.
func TestNumericKeyHeaderOfEveryType(t *testing.T) {
	b := newBroker(t)
	s := memstore.New(nil)
	defer s.Close()
	p, _ := consumer.New(s, consumer.Config{Name: "num"})
	values := map[any]string{
		float64(42.5): "42.5", float32(7.25): "7.25", float64(1e21): "1e+21",
		amqp091.Decimal{Scale: 2, Value: 12345}: "123.45", amqp091.Decimal{Scale: 0, Value: -3}: "-3",
		uint16(9): "9", int8(-4): "-4",
	}
	ctx := context.Background()
	for v := range values {
		c, err := b.ch.PublishWithDeferredConfirmWithContext(ctx, "", b.queue, false, false, amqp091.Publishing{Body: []byte("{}"), Headers: amqp091.Table{"order-id": v}})
		if err != nil || !c.Wait() {
			t.Fatal(err)
		}
	}
	conn, err := amqp091.Dial(b.url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, _ := conn.Channel()
	seen := map[string]bool{}
	for range values {
		var d amqp091.Delivery
		waitFor(t, 10*time.Second, "a message", func() bool {
			var ok bool
			d, ok, _ = ch.Get(b.queue, false)
			return ok
		})
		out, err := idemamqp.Handle(ctx, p, &d, func(_ context.Context, m *consumer.Message) ([]byte, error) {
			seen[m.ID] = true
			return nil, nil
		}, &idemamqp.Config{Queue: b.queue, Publisher: b.ch, KeyHeader: "order-id"})
		if err != nil || out.Reason != consumer.Executed {
			t.Fatalf("key header %T %v: %+v, %v; want it executed under its number", d.Headers["order-id"], d.Headers["order-id"], out, err)
		}
	}
	for _, want := range values {
		if !seen[want] {
			t.Fatalf("IDs seen %v; want %q among them", seen, want)
		}
	}
}

// outageStart is a store whose outage begins between a claim and the
// transaction: BeginTx fails once, and the release after it fails too, so
// the claim is left in flight.
type outageStart struct {
	idem.TxStore
	beginFails, releaseFails atomic.Int32
}

func (s *outageStart) BeginTx(ctx context.Context) (context.Context, idem.Tx, error) {
	if s.beginFails.Add(-1) >= 0 {
		return nil, nil, errors.New("connection reset by peer")
	}
	return s.TxStore.BeginTx(ctx)
}

func (s *outageStart) Release(ctx context.Context, scope, key, token string) error {
	if s.releaseFails.Add(-1) >= 0 {
		return errors.New("connection refused")
	}
	return s.TxStore.Release(ctx, scope, key, token)
}

// An outage that begins between the claim and the transaction and leaves the
// claim in flight (its release failed too) costs the message no attempt: the
// retry copy carries the claim (x-idem-claim) and takes it back, instead of
// waiting out the lease and counting the takeover as a crash. With
// MaxDeliveries 1 the message used to be dead-lettered unrun.
func TestOutageLeavingOurClaimSpendsNoAttempt(t *testing.T) {
	ctx := context.Background()
	env, err := prooftest.Open(ctx, prooftest.NewTarget(t, "sqlite"))
	if err != nil {
		t.Fatal(err)
	}
	defer env.Close(true)
	s := &outageStart{TxStore: env.Store.(idem.TxStore)}
	s.beginFails.Store(1)
	s.releaseFails.Store(1)
	p, _ := consumer.New(s, consumer.Config{Name: "ours", MaxDeliveries: 1, Lease: 300 * time.Millisecond, Backoff: func(int) time.Duration { return 10 * time.Millisecond }})
	b := newBroker(t)
	b.publish(t, "", []string{"o-1"}, payload)
	conn, err := amqp091.Dial(b.url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, _ := conn.Channel()
	cfg := &idemamqp.Config{Queue: b.queue, Publisher: b.ch}
	var outs []consumer.Outcome
	for len(outs) < 6 {
		var d amqp091.Delivery
		waitFor(t, 10*time.Second, "a delivery", func() bool {
			var ok bool
			d, ok, _ = ch.Get(b.queue, false)
			return ok
		})
		out, _ := idemamqp.Handle(ctx, p, &d, env.Insert, cfg)
		outs = append(outs, out)
		if out.Action != consumer.Retry {
			break
		}
	}
	rows, _, _ := env.Count(ctx)
	if last := outs[len(outs)-1]; last.Reason != consumer.Executed || rows != 1 || p.Stats().Poison != 0 {
		t.Fatalf("outcomes %+v, %d rows, stats %+v; want the message executed once, nothing dead-lettered", outs, rows, p.Stats())
	}
}
