// Command mysql is the README's MySQL/MariaDB example: the handler inserts its
// order in the transaction idem opened, and the stored answer commits with it.
// Run it with `go run ./examples/mysql` (it creates the tables example_orders,
// idem_records and idem_records_migrations in the database; -dsn names another
// one, in go-sql-driver/mysql's form or as the mysql:// URL idem's CLI takes):
//
//	go run ./examples/mysql -dsn 'root@tcp(127.0.0.1:3306)/test' -addr 127.0.0.1:8080
//	go run ./examples/mysql -dsn mysql://root@127.0.0.1:3306/test
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql" // the driver mysqlstore is tested with; the store registers none
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

func main() {
	dsn := flag.String("dsn", "root@tcp(127.0.0.1:3306)/test", "the database: a go-sql-driver/mysql DSN, USER[:PASS]@tcp(HOST:PORT)/DB, or the URL idem's CLI takes, mysql://USER[:PASS]@HOST:PORT/DB")
	addr := flag.String("addr", "127.0.0.1:8080", "listen address")
	flag.Parse()
	driverDSN, err := mysqlDSN(*dsn)
	if err != nil {
		log.Fatal(err)
	}
	db, err := sql.Open("mysql", driverDSN)
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

// mysqlDSN returns the go-sql-driver/mysql DSN of s: s itself, or the DSN of a
// mysql://USER[:PASS]@HOST[:PORT]/DB[?options] URL.
func mysqlDSN(s string) (string, error) {
	if !strings.HasPrefix(s, "mysql://") {
		return s, nil
	}
	u, err := url.Parse(s)
	if err != nil {
		return "", fmt.Errorf("-dsn %q: %w", s, err)
	}
	cfg := mysql.NewConfig()
	cfg.User = u.User.Username()
	cfg.Passwd, _ = u.User.Password()
	cfg.Net, cfg.Addr, cfg.DBName = "tcp", u.Host, strings.TrimPrefix(u.Path, "/")
	if u.Port() == "" {
		cfg.Addr = net.JoinHostPort(u.Hostname(), "3306")
	}
	dsn := cfg.FormatDSN()
	if u.RawQuery != "" {
		dsn += "?" + u.RawQuery // driver options (tls=true, timeout=5s, …)
	}
	if _, err := mysql.ParseDSN(dsn); err != nil {
		return "", fmt.Errorf("-dsn %q: %w", s, err)
	}
	return dsn, nil
}

// janitorEvery is how often the janitor deletes expired key records.
var janitorEvery = time.Minute

func newServer(ctx context.Context, db *sql.DB) (http.Handler, error) {
	// The business table lives in the same database as idem's records (InnoDB,
	// so that both commit in one transaction).
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS example_orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, cart_id VARCHAR(255) NOT NULL) ENGINE=InnoDB`); err != nil {
		return nil, err
	}
	store, err := mysqlstore.New(db, nil) // table idem_records; &mysqlstore.Config{Table: "shop_idem"} names another
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
		q := mysqlstore.Conn(r.Context()) // the request's transaction: do not commit it
		res, err := q.ExecContext(r.Context(), `INSERT INTO example_orders (cart_id) VALUES (?)`, in.CartID)
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
