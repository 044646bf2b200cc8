// Command sqlite is the README's SQLite example: the handler inserts its order
// in the transaction idem opened, and the stored answer commits with it. Run it
// with `go run ./examples/sqlite` (it writes app.db in the working directory;
// -db names another file):
//
//	go run ./examples/sqlite -db app.db -addr 127.0.0.1:8080
package main

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

func main() {
	path := flag.String("db", "app.db", "SQLite file (created if missing)")
	addr := flag.String("addr", "127.0.0.1:8080", "listen address")
	flag.Parse()
	db, err := embedded.Open(*path)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	handler, err := newServer(context.Background(), db)
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

func newServer(ctx context.Context, db *sql.DB) (http.Handler, error) {
	// The business table lives in the same database as idem's records.
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, cart_id TEXT NOT NULL)`); err != nil {
		return nil, err
	}
	store, err := sqlitestore.New(db, nil)
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
		tx := sqlitestore.Tx(r.Context()) // the request's transaction: do not commit it
		res, err := tx.ExecContext(r.Context(), `INSERT INTO orders (cart_id) VALUES (?)`, "c_42")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		id, _ := res.LastInsertId()
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
