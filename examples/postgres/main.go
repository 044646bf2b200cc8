// Command postgres is the README's PostgreSQL example: the handler inserts its
// order in the transaction idem opened, and the stored answer commits with it.
// Run it with `go run ./examples/postgres` (it creates the tables example_orders and
// idem_records in the database; -db names another one):
//
//	go run ./examples/postgres -db postgres://postgres@127.0.0.1:5432/test -addr 127.0.0.1:8080
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

func main() {
	dbURL := flag.String("db", "postgres://postgres@127.0.0.1:5432/test", "PostgreSQL URL")
	addr := flag.String("addr", "127.0.0.1:8080", "listen address")
	flag.Parse()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, *dbURL)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	handler, err := newServer(ctx, pool)
	if err != nil {
		log.Fatal(err)
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("listening on http://%s", ln.Addr())
	log.Fatal(http.Serve(ln, handler))
}

// janitorEvery is how often the janitor deletes expired key records.
var janitorEvery = time.Minute

func newServer(ctx context.Context, pool *pgxpool.Pool) (http.Handler, error) {
	// The business table lives in the same database as idem's records.
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS example_orders (id BIGSERIAL PRIMARY KEY, cart_id TEXT NOT NULL)`); err != nil {
		return nil, err
	}
	store, err := pgstore.New(pool, nil) // table idem_records; &pgstore.Config{Table: "billing.idem_records"} names another
	if err != nil {
		return nil, err
	}
	if err := store.Migrate(ctx); err != nil { // creates idem_records; safe to run again
		return nil, err
	}
	protect, err := idem.New(store, nil)
	if err != nil {
		return nil, err
	}
	orders := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			CartID string `json:"cart_id"`
		}
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.CartID == "" {
			http.Error(w, `send {"cart_id":"…"}`, http.StatusBadRequest) // a 4xx is stored and replayed too
			return
		}
		tx := pgstore.Tx(r.Context()) // the request's transaction: do not commit it
		var id int64
		if err := tx.QueryRow(r.Context(), `INSERT INTO example_orders (cart_id) VALUES ($1) RETURNING id`, in.CartID).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, id) // sent only after the commit
	})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", protect(orders))
	// Expired key records stay in the table until they are deleted: the janitor
	// sweeps them in bounded batches, in the background, until ctx ends.
	janitor := &idem.Janitor{Store: store, Interval: janitorEvery, OnSweep: func(_ int, err error) {
		if err != nil {
			log.Printf("janitor: %v", err)
		}
	}}
	go func() { _ = janitor.Run(ctx) }()
	return mux, nil
}
