package mysqlstore_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"net/http"

	_ "github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

// A store on a MySQL or MariaDB database, migrated at start-up, with a handler that
// writes its order in the request's transaction. (Compile-only: it needs a server.)
func Example() {
	db, err := sql.Open("mysql", "app:secret@tcp(127.0.0.1:3306)/shop?multiStatements=true&interpolateParams=true")
	if err != nil {
		log.Fatal(err)
	}
	store, err := mysqlstore.New(db, nil)
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
		q := mysqlstore.Conn(r.Context()) // commits together with the stored response
		res, err := q.ExecContext(r.Context(), "INSERT INTO orders (item) VALUES (?)", r.FormValue("item"))
		if err != nil {
			http.Error(w, "could not store the order", http.StatusInternalServerError)
			return
		}
		id, _ := res.LastInsertId()
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
	})
	http.Handle("POST /orders", mw(createOrder))

	// Expired records are deleted in bounded batches.
	janitor := &idem.Janitor{Store: store}
	go func() { _ = janitor.Run(context.Background()) }()
	log.Fatal(http.ListenAndServe(":8080", nil))
}

// New validates the configuration without touching the database, and says what
// to change.
func ExampleNew() {
	db, _ := sql.Open("mysql", "app@tcp(127.0.0.1:3306)/shop") // not dialled yet
	defer db.Close()
	_, err := mysqlstore.New(db, &mysqlstore.Config{Table: "shop.idem"})
	fmt.Println(err)
	store, _ := mysqlstore.New(db, nil)
	fmt.Println(store.Table())
	// Output:
	// mysqlstore: Config.Table "shop.idem" is not a usable table name; use letters, digits and underscores, not starting with a digit, at most 53 characters (the table lives in the DSN's database; a schema-qualified name is not accepted)
	// idem_records
}

// Outside a request that idem executes, Tx is nil.
func ExampleTx() {
	fmt.Println(mysqlstore.Tx(context.Background()) == nil)
	// Output: true
}

// Outside a request that idem executes, Conn is nil.
func ExampleConn() {
	fmt.Println(mysqlstore.Conn(context.Background()) == nil)
	// Output: true
}
