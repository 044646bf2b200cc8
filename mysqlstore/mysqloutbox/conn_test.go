package mysqloutbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/outbox"
)

// TestEnqueueAfterConn: a handler that writes its order through
// mysqlstore.Conn (the documented, fastest handle, on the connection-scoped
// transaction of the single-transaction flow) and then enqueues with a nil
// tx: the event commits with the order, a replay enqueues nothing, and a
// request whose handler panics, or whose outcome KeepFunc refuses, leaves
// neither; in both flows. With and without multiStatements (the fast path is the former).
func TestEnqueueAfterConn(t *testing.T) {
	for _, c := range []struct {
		name  string
		multi bool
		flow  idem.Flow
	}{
		{"SingleTx/multiStatements", true, idem.FlowSingleTx},
		{"SingleTx/plain", false, idem.FlowSingleTx},
		{"ClaimComplete/multiStatements", true, idem.FlowClaimComplete},
	} {
		multi := c.multi
		t.Run(c.name, func(t *testing.T) {
			ctx := context.Background()
			dsn := testenv.MySQLDSN(testenv.MySQLURL(t))
			if multi {
				dsn += "&multiStatements=true&interpolateParams=true"
			}
			db, err := sql.Open("mysql", dsn)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = db.Close() })
			ob := newOutbox(t, db)
			table := "records_" + randHex(5)
			store, err := mysqlstore.New(db, &mysqlstore.Config{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			if err := store.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			orders := "orders_" + randHex(5)
			if _, err := db.Exec("CREATE TABLE " + orders + " (k VARCHAR(255) PRIMARY KEY)"); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _, _ = db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_migrations, " + orders) })
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				q := mysqlstore.Conn(r.Context())
				_, key, _ := idem.KeyFrom(r.Context())
				if _, err := q.ExecContext(r.Context(), "INSERT INTO "+orders+" (k) VALUES (?)", key); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				if err := ob.Enqueue(r.Context(), nil, outbox.Message{Name: "order.created", Subject: "orders.created", Payload: []byte(key)}); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				if strings.HasPrefix(key, "fail-") {
					panic("refused") // rolls the transaction back
				}
				if strings.HasPrefix(key, "unkept-") {
					http.Error(w, "upstream down", http.StatusBadGateway) // KeepFunc refuses it
					return
				}
				w.WriteHeader(http.StatusCreated)
			})
			mw, err := idem.New(store, &idem.Config{Flow: c.flow, KeepFunc: func(status int) bool { return status < 500 }})
			if err != nil {
				t.Fatal(err)
			}
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			srv := &http.Server{Handler: mw(h)}
			go func() { _ = srv.Serve(ln) }()
			defer srv.Close()
			url := "http://" + ln.Addr().String()
			for _, key := range []string{"ok-1", "fail-1", "unkept-1"} {
				code, err := post(url, key)
				if !strings.HasPrefix(key, "ok-") {
					continue // whatever the answer, nothing may commit
				}
				if err != nil {
					t.Fatal(err)
				}
				if code != http.StatusCreated {
					t.Fatalf("%s: status %d, want 201", key, code)
				}
			}
			// A replay enqueues nothing.
			if code, err := post(url, "ok-1"); err != nil || code != http.StatusCreated {
				t.Fatalf("replay: %d %v", code, err)
			}
			count := func(q string, args ...any) int {
				var n int
				if err := db.QueryRow(q, args...).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			}
			if n := count("SELECT COUNT(*) FROM "+ob.Table()+" WHERE id = ?", outbox.MessageID("", "ok-1", "order.created")); n != 1 {
				t.Fatalf("ok-1: %d events, want 1", n)
			}
			if n := count("SELECT COUNT(*) FROM " + ob.Table()); n != 1 {
				t.Fatalf("%d events in all, want 1 (the rolled-back request left one)", n)
			}
			if n := count("SELECT COUNT(*) FROM " + orders); n != 1 {
				t.Fatalf("%d orders, want 1", n)
			}
		})
	}
}

// TestEnqueueAfterConnConcurrent: the fast path (single-transaction flow,
// multiStatements, the handler on mysqlstore.Conn) under concurrent sends of
// each key: one order and one event per key, whichever send ran it.
func TestEnqueueAfterConnConcurrent(t *testing.T) {
	ctx := context.Background()
	db, err := sql.Open("mysql", testenv.MySQLDSN(testenv.MySQLURL(t))+"&multiStatements=true&interpolateParams=true")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	db.SetMaxOpenConns(12)
	ob := newOutbox(t, db)
	table := "records_" + randHex(5)
	store, err := mysqlstore.New(db, &mysqlstore.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	orders := "orders_" + randHex(5)
	if _, err := db.Exec("CREATE TABLE " + orders + " (k VARCHAR(255) PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_migrations, " + orders) })
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := mysqlstore.Conn(r.Context())
		_, key, _ := idem.KeyFrom(r.Context())
		if _, err := q.ExecContext(r.Context(), "INSERT INTO "+orders+" (k) VALUES (?)", key); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if err := ob.Enqueue(r.Context(), nil, outbox.Message{Name: "order.created", Subject: "orders.created", Payload: []byte(key)}); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	mw, err := idem.New(store, &idem.Config{Flow: idem.FlowSingleTx})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mw(h)}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	url := "http://" + ln.Addr().String()
	const keys, sends = 10, 3
	start := make(chan struct{})
	errs := make(chan error, keys*sends)
	for k := range keys {
		key := "c-" + strconv.Itoa(k)
		for range sends {
			go func() {
				<-start
				deadline := time.Now().Add(30 * time.Second)
				for {
					code, err := post(url, key)
					if err == nil && (code == http.StatusConflict || code == http.StatusServiceUnavailable) && time.Now().Before(deadline) {
						time.Sleep(10 * time.Millisecond)
						continue
					}
					if err == nil && code != http.StatusCreated {
						err = fmt.Errorf("%s: %d", key, code)
					}
					errs <- err
					return
				}
			}()
		}
	}
	close(start)
	for range keys * sends {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for k := range keys {
		key := "c-" + strconv.Itoa(k)
		var n int
		if err := db.QueryRow("SELECT COUNT(*) FROM "+ob.Table()+" WHERE id = ?", outbox.MessageID("", key, "order.created")).Scan(&n); err != nil || n != 1 {
			t.Fatalf("%s: %d events (%v), want 1", key, n, err)
		}
	}
	var n int
	if err := db.QueryRow("SELECT COUNT(*) FROM " + ob.Table()).Scan(&n); err != nil || n != keys {
		t.Fatalf("%d events (%v), want %d", n, err, keys)
	}
}
