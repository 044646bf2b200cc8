package outbox_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemkit/idem/outbox"
)

// The same logical event gets the same ID on every attempt and every
// publication: the consumer's dedupe key.
func ExampleMessageID() {
	fmt.Println(outbox.MessageID("tenant-1", "order-42", "order.created"))
	// Output: 4100b7836331a13637c53341f52bfe88b2e56aad1237ff59397de5ca81a3d6c1
}

// The second message of one request with the same Name gets an ID of its
// own; the first keeps MessageID's.
func ExampleNthMessageID() {
	ctx := outbox.WithKey(context.Background(), "tenant-1", "order-42")
	first, _ := outbox.Prepare(ctx, outbox.Message{Name: "item.added", Subject: "orders.items"}, 0)
	second, _ := outbox.Prepare(ctx, outbox.Message{Name: "item.added", Subject: "orders.items"}, 0)
	fmt.Println(first.ID == outbox.MessageID("tenant-1", "order-42", "item.added"))
	fmt.Println(second.ID == outbox.NthMessageID("tenant-1", "order-42", "item.added", 2))
	fmt.Println(first.ID == second.ID)
	// Output:
	// true
	// true
	// false
}

// Outside a request idem executes (a batch job, a script), a message needs an
// explicit ID, and the error says so.
func ExamplePrepare() {
	_, err := outbox.Prepare(context.Background(), outbox.Message{Subject: "orders.created"}, 0)
	fmt.Println(errors.Is(err, outbox.ErrNoID))
	m, err := outbox.Prepare(context.Background(), outbox.Message{
		ID:      outbox.MessageID("", "nightly-2026-12-01", "report.ready"),
		Subject: "reports.ready",
	}, 0)
	fmt.Println(err, m.PartitionKey == m.ID)
	// Output:
	// true
	// <nil> true
}

// A relay publishes what the outbox table holds; here a Publisher that
// prints, and one refusal dead-lettered with its reason. In a service the
// Source is pgoutbox.New / sqliteoutbox.New / mysqloutbox.New and the
// Publisher natsjs.NewPublisher, amqp.NewPublisher or watermill.NewPublisher,
// and Run runs until the context ends.
func ExampleRelay() {
	src := &memSource{}
	src.add(
		outbox.Message{ID: "order-1-created", Subject: "orders.created", Payload: []byte(`{"order_id":1}`), PartitionKey: "order-1"},
		outbox.Message{ID: "order-2-created", Subject: "orders.created", Payload: make([]byte, 2<<20), PartitionKey: "order-2"},
	)
	pub := outbox.PublisherFunc(func(ctx context.Context, m *outbox.Stored) error {
		if len(m.Payload) > 1<<20 {
			return outbox.Permanent(errors.New("maximum payload exceeded"))
		}
		fmt.Printf("published %s to %s: %s\n", m.ID, m.Subject, m.Payload)
		return nil
	})
	r := &outbox.Relay{Source: src, Publisher: pub}
	n, err := r.PublishBatch(context.Background())
	st, _ := src.Stats(context.Background())
	fmt.Println(n, err, st.Pending, st.DeadLetters)
	// Output:
	// published order-1-created to orders.created: {"order_id":1}
	// 2 <nil> 0 1
}
