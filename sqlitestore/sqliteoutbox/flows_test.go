package sqliteoutbox_test

import (
	"context"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
	"github.com/idemkit/idem/sqlitestore/sqliteoutbox"
)

// TestEnqueueEveryFlow: in both of idem's flows, an order handler that
// enqueues commits its event with the order only when its outcome is kept:
// a panic, an outcome KeepFunc refuses (5xx here) and a handler that rolls
// the transaction back leave no event, and a replay enqueues nothing.
func TestEnqueueEveryFlow(t *testing.T) {
	for _, fl := range []struct {
		name string
		flow idem.Flow
	}{{"ClaimComplete", idem.FlowClaimComplete}, {"SingleTx", idem.FlowSingleTx}} {
		t.Run(fl.name, func(t *testing.T) {
			ctx := context.Background()
			db, err := embedded.Open(filepath.Join(t.TempDir(), "shop.db"))
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			store, err := sqlitestore.New(db, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := store.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			ob, err := sqliteoutbox.New(db, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := ob.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			if _, err := db.Exec("CREATE TABLE orders (key TEXT PRIMARY KEY)"); err != nil {
				t.Fatal(err)
			}
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				tx := sqlitestore.Tx(r.Context())
				if tx == nil {
					http.Error(w, "no transaction", 500)
					return
				}
				_, key, _ := idem.KeyFrom(r.Context())
				if _, err := tx.ExecContext(r.Context(), "INSERT INTO orders (key) VALUES (?)", key); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				if err := ob.Enqueue(r.Context(), nil, outbox.Message{Name: "order.created", Subject: "orders.created", Payload: []byte("\x00" + key)}); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				switch {
				case strings.HasPrefix(key, "panic-"):
					panic("handler failed")
				case strings.HasPrefix(key, "unkept-"):
					http.Error(w, "upstream down", http.StatusBadGateway)
				case strings.HasPrefix(key, "rollback-"):
					_ = tx.Rollback()
					http.Error(w, "refused", http.StatusPaymentRequired)
				default:
					w.WriteHeader(http.StatusCreated)
				}
			})
			mw, err := idem.New(store, &idem.Config{Flow: fl.flow, KeepFunc: func(status int) bool { return status < 500 }})
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
			keys := []string{"ok-1", "panic-1", "unkept-1", "rollback-1", "ok-2"}
			for round := 0; round < 2; round++ { // the second round replays the ok ones
				for _, key := range keys {
					code, err := post(url, key)
					if strings.HasPrefix(key, "ok-") && (err != nil || code != http.StatusCreated) {
						t.Fatalf("%s (round %d): %d %v", key, round, code, err)
					}
				}
			}
			rows, err := db.Query("SELECT id, payload FROM idem_outbox ORDER BY seq")
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for rows.Next() {
				var id string
				var p []byte
				if err := rows.Scan(&id, &p); err != nil {
					t.Fatal(err)
				}
				got = append(got, string(p[1:]))
				if id != outbox.MessageID("", string(p[1:]), "order.created") || p[0] != 0 {
					t.Fatalf("event %s: payload %q", id, p)
				}
			}
			_ = rows.Close()
			if strings.Join(got, ",") != "ok-1,ok-2" {
				t.Fatalf("events of %v, want those of ok-1 and ok-2 only, once each", got)
			}
			var orders int
			if err := db.QueryRow("SELECT count(*) FROM orders").Scan(&orders); err != nil || orders != 2 {
				t.Fatalf("%d orders (%v), want 2", orders, err)
			}
		})
	}
}
