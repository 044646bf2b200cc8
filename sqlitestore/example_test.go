package sqlitestore_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// A handler writes its order through sqlitestore.Tx: the order and the stored
// answer commit together, and a retry with the same key is replayed.
func Example() {
	dir, err := os.MkdirTemp("", "idem-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	db, err := embedded.Open(filepath.Join(dir, "app.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(`CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	store, err := sqlitestore.New(db, nil)
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		log.Fatal(err)
	}
	mw, err := idem.New(store, nil)
	if err != nil {
		log.Fatal(err)
	}
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx := sqlitestore.Tx(r.Context())
		res, err := tx.ExecContext(r.Context(), `INSERT INTO orders (item) VALUES ('book')`)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		id, _ := res.LastInsertId()
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d\n", id)
	})
	h := mw(createOrder)

	for range 2 {
		r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"item":"book"}`))
		r.Header.Set("Idempotency-Key", "3f1c9a52-order-1")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		fmt.Printf("%d replayed=%q %s", w.Code, w.Header().Get(idem.ReplayedHeader), w.Body)
	}
	var n int
	_ = db.QueryRow(`SELECT count(*) FROM orders`).Scan(&n)
	fmt.Println("orders:", n)
	// Output:
	// 201 replayed="" order 1
	// 201 replayed="true" order 1
	// orders: 1
}

// The janitor deletes expired records in bounded batches.
func ExampleStore_DeleteExpired() {
	dir, err := os.MkdirTemp("", "idem-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	db, err := embedded.Open(filepath.Join(dir, "app.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	store, err := sqlitestore.New(db, &sqlitestore.Config{Table: "idem_keys"})
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		log.Fatal(err)
	}
	j := &idem.Janitor{Store: store, BatchSize: 500}
	deleted, err := j.Sweep(context.Background())
	fmt.Println(deleted, err)
	// Output: 0 <nil>
}
