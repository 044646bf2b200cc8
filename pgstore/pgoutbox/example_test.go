package pgoutbox_test

import (
	"context"
	"encoding/json"
	"log"
	"net/http"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/pgstore/pgoutbox"
)

// A service whose order handler writes the order and its order.created event
// in idem's transaction, and a relay that publishes the events after the
// commit (here through a Publisher that logs; use outbox/natsjs,
// outbox/amqp or outbox/watermill).
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	store, err := pgstore.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	events, err := pgoutbox.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	if err := events.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		var id int64
		if err := pgstore.Tx(ctx).QueryRow(ctx, `INSERT INTO orders (item) VALUES ($1) RETURNING id`, r.FormValue("item")).Scan(&id); err != nil {
			http.Error(w, "could not create the order", http.StatusInternalServerError)
			return
		}
		payload, _ := json.Marshal(map[string]any{"order_id": id})
		// No ID: it is outbox.MessageID(scope, key, "order.created"), the same
		// on every attempt. No transaction: pgstore.Tx(ctx).
		if err := events.Enqueue(ctx, nil, outbox.Message{Name: "order.created", Subject: "orders.created", Payload: payload}); err != nil {
			http.Error(w, "could not create the order", http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	mw, err := idem.New(store, nil)
	if err != nil {
		log.Fatal(err)
	}
	relay := &outbox.Relay{Source: events, Publisher: outbox.PublisherFunc(func(ctx context.Context, m *outbox.Stored) error {
		log.Printf("publish %s to %s", m.ID, m.Subject)
		return nil
	})}
	go func() { log.Fatal(relay.Run(ctx)) }()
	http.Handle("POST /orders", mw(createOrder))
	log.Fatal(http.ListenAndServe(":8080", nil))
}
