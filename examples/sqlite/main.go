// Command sqlite is the README's SQLite example: the handler inserts its order
// in the transaction idem opened, and the stored answer commits with it. Run it
// with `go run ./examples/sqlite` (it writes app.db in the working directory).
package main

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"net/http"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

func main() {
	db, err := embedded.Open("app.db")
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	handler, err := newServer(context.Background(), db)
	if err != nil {
		log.Fatal(err)
	}
	log.Println("listening on http://127.0.0.1:8080")
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", handler))
}

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
	return mux, nil
}
