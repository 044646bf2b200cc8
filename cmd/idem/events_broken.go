//go:build idem_broken_outbox

package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/outbox"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The deliberately broken variants of the demo's events, built only with the
// build tag idem_broken_outbox, for the pipeline proof (TestOutboxPipeline)
// to see each of its checks fail. IDEM_BROKEN_OUTBOX selects one:
//
//	before-commit  publish from the handler, inside the transaction, before
//	               the commit; no outbox (an event for an order a crash or a
//	               rollback undoes)
//	after-commit   publish after the commit, from the process, no outbox (a
//	               crash between the two loses the event)
//	unstable-id    the outbox, but the relay publishes a republication under
//	               another ID (the message ID with the attempt number)
//
// Anything else is the outbox, as built without the tag.
func demoEnqueue(ctx context.Context, ev *demoEventsRun, tx orders.Tx, m outbox.Message) error {
	mode := os.Getenv("IDEM_BROKEN_OUTBOX")
	if mode != "before-commit" && mode != "after-commit" {
		return ev.ob.enqueue(ctx, tx, m)
	}
	m, err := outbox.Prepare(ctx, m, 0)
	if err != nil {
		return err
	}
	msg := nats.NewMsg(m.Subject)
	msg.Data = m.Payload
	for k, v := range m.Headers {
		msg.Header.Set(k, v)
	}
	msg.Header.Set(jetstream.MsgIDHeader, m.ID)
	if mode == "before-commit" {
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		if _, err := ev.js.PublishMsg(pctx, msg); err != nil {
			return fmt.Errorf("publish: %w", err)
		}
		return nil
	}
	// after-commit: publish once the transaction is over (give it the time a
	// commit takes), from the process.
	go func() {
		time.Sleep(200 * time.Millisecond)
		pctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, _ = ev.js.PublishMsg(pctx, msg)
	}()
	return nil
}

// demoPublisher, with IDEM_BROKEN_OUTBOX=unstable-id, publishes every
// attempt after the first under an ID of its own.
func demoPublisher(p outbox.Publisher) outbox.Publisher {
	if os.Getenv("IDEM_BROKEN_OUTBOX") != "unstable-id" {
		return p
	}
	return outbox.PublisherFunc(func(ctx context.Context, m *outbox.Stored) error {
		if m.Attempts > 0 {
			c := *m
			c.ID = m.ID + "-" + strconv.Itoa(m.Attempts)
			return p.Publish(ctx, &c)
		}
		return p.Publish(ctx, m)
	})
}
