// Command outbox is docs/outbox.md's example: the handler inserts its order
// and enqueues an orders.created event in the transaction idem opened, so the
// order, the event and the stored answer commit together; a relay publishes
// the committed events to NATS JetStream with a stable message ID.
//
//	go run ./examples/outbox -db postgres://postgres@127.0.0.1:5432/test -nats nats://127.0.0.1:4222
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/natsjs"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/pgstore/pgoutbox"
)

func main() {
	dbURL := flag.String("db", "postgres://postgres@127.0.0.1:5432/test", "PostgreSQL URL")
	natsURL := flag.String("nats", nats.DefaultURL, "NATS server with JetStream")
	addr := flag.String("addr", "127.0.0.1:8080", "listen address")
	flag.Parse()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, *dbURL)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	nc, err := nats.Connect(*natsURL, nats.MaxReconnects(-1))
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	// A stream must capture the subject before the relay publishes to it.
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: "EXAMPLE_ORDERS", Subjects: []string{"example.orders.created"}}); err != nil {
		log.Fatal(err)
	}
	handler, relay, err := newServer(ctx, pool, js, "example.orders.created")
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = relay.Run(ctx) }()
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("listening on http://%s", ln.Addr())
	log.Fatal(http.Serve(ln, handler))
}

func newServer(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, subject string) (http.Handler, *outbox.Relay, error) {
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS example_orders (id BIGSERIAL PRIMARY KEY, cart_id TEXT NOT NULL)`); err != nil {
		return nil, nil, err
	}
	store, err := pgstore.New(pool, nil)
	if err != nil {
		return nil, nil, err
	}
	if err := store.Migrate(ctx); err != nil {
		return nil, nil, err
	}
	events, err := pgoutbox.New(pool, nil) // table idem_outbox (and idem_outbox_dead)
	if err != nil {
		return nil, nil, err
	}
	if err := events.Migrate(ctx); err != nil {
		return nil, nil, err
	}
	protect, err := idem.New(store, nil)
	if err != nil {
		return nil, nil, err
	}
	orders := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			CartID string `json:"cart_id"`
		}
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.CartID == "" {
			http.Error(w, `send {"cart_id":"…"}`, http.StatusBadRequest)
			return
		}
		ctx := r.Context()
		tx := pgstore.Tx(ctx) // the request's transaction: do not commit it
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO example_orders (cart_id) VALUES ($1) RETURNING id`, in.CartID).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		payload, _ := json.Marshal(map[string]any{"order_id": id, "cart_id": in.CartID})
		// In the same transaction: the event commits with the order and the
		// stored answer, or not at all. Its ID is derived from the request's
		// scope, key and Name, so a takeover of the key enqueues the same ID.
		err := events.Enqueue(ctx, tx, outbox.Message{Name: "order.created", Subject: subject, Payload: payload})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, id)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", protect(orders))
	// The relay publishes what committed, with Nats-Msg-Id = the message ID,
	// and marks it published once JetStream acknowledged it.
	relay := &outbox.Relay{Source: events, Publisher: natsjs.NewPublisher(js)}
	return mux, relay, nil
}
