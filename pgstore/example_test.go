package pgstore_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"os"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A service whose order handler writes through the transaction idem opened, so
// that the order and the stored response commit together.
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
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var id int64
		err := pgstore.Tx(r.Context()).QueryRow(r.Context(),
			`INSERT INTO orders (item) VALUES ($1) RETURNING id`, r.FormValue("item")).Scan(&id)
		if err != nil {
			http.Error(w, "could not create the order", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
	})
	// A short handler whose effects all live in this database: the single
	// transaction flow is the cheaper one.
	mw, err := idem.New(store, &idem.Config{Flow: idem.FlowSingleTx})
	if err != nil {
		log.Fatal(err)
	}
	http.Handle("POST /orders", mw(createOrder))
	log.Fatal(http.ListenAndServe(":8080", nil))
}

// New checks the table name before anything reaches the database.
func ExampleNew() {
	pool, err := pgxpool.New(context.Background(), "postgres://localhost/app") // connects lazily
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store, err := pgstore.New(pool, &pgstore.Config{Table: "billing.idem_records"})
	fmt.Println(store.Table(), err)
	_, err = pgstore.New(pool, &pgstore.Config{Table: "idem records"})
	fmt.Println(err)
	// Output:
	// "billing"."idem_records" <nil>
	// pgstore: Config.Table "idem records" is not a plain or schema-qualified SQL identifier; use letters, digits and underscores (at most 63 bytes per part), not starting with a digit, for example "idem_records" or "billing.idem_records"
}

// The janitor deletes expired records in bounded batches.
func ExampleStore_DeleteExpired() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	store, err := pgstore.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	j := &idem.Janitor{Store: store, BatchSize: 1000}
	go func() { _ = j.Run(ctx) }()
}
