package amqp_test

import (
	"context"
	"testing"
	"time"

	"github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	idemamqp "github.com/idemkit/idem/consumer/amqp"
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
