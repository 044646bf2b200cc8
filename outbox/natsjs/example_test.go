package natsjs_test

import (
	"context"
	"log"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/natsjs"
	"github.com/idemkit/idem/pgstore/pgoutbox"
)

// A relay process: it publishes the events a service enqueued in its
// PostgreSQL outbox to JetStream, with Nats-Msg-Id = the event's ID. Run as
// many as you like; they share the work.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	events, err := pgoutbox.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	// Reconnect forever: the relay retries until the broker is back.
	nc, err := nats.Connect(os.Getenv("NATS_URL"), nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true))
	if err != nil {
		log.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	relay := &outbox.Relay{Source: events, Publisher: natsjs.NewPublisher(js)}
	log.Fatal(relay.Run(ctx))
}
