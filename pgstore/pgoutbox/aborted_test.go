package pgoutbox_test

import (
	"net/http"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/pgstore"
)

// TestNoEventWithoutTheOrder: in both flows, a handler that enqueued and
// then fails leaves no event: a statement that aborts PostgreSQL's
// transaction although the handler answers 201 (idem.ErrTxAborted), a
// panic, and an outcome KeepFunc refuses; a replay of the one that
// committed enqueues nothing.
func TestNoEventWithoutTheOrder(t *testing.T) {
	for _, fl := range flows {
		t.Run(fl.name, func(t *testing.T) {
			pool, schema := testDB(t)
			s := newService(t, pool, schema, true)
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				ctx := r.Context()
				tx := pgstore.Tx(ctx)
				_, key, _ := idem.KeyFrom(ctx)
				if _, err := tx.Exec(ctx, "INSERT INTO "+s.schema+".orders (key, by) VALUES ($1, 'x')", key); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				if err := s.outbox.Enqueue(ctx, nil, outbox.Message{Name: "order.created", Subject: "orders.created", Payload: []byte(key)}); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				switch {
				case strings.HasPrefix(key, "aborted-"):
					_, _ = tx.Exec(ctx, "SELECT 1/0") // aborts the transaction; ignored
					w.WriteHeader(http.StatusCreated)
				case strings.HasPrefix(key, "panic-"):
					panic("handler failed")
				case strings.HasPrefix(key, "unkept-"):
					http.Error(w, "upstream down", http.StatusBadGateway)
				default:
					w.WriteHeader(http.StatusCreated)
				}
			})
			mw, err := idem.New(s.store, &idem.Config{Flow: fl.flow, KeepFunc: func(status int) bool { return status < 500 }})
			if err != nil {
				t.Fatal(err)
			}
			url := serve(t, mw(h))
			for round := range 2 {
				for _, key := range []string{"ok-1", "aborted-1", "panic-1", "unkept-1"} {
					code, body, err := post(url, key)
					switch {
					case key == "ok-1" && (err != nil || code != http.StatusCreated):
						t.Fatalf("%s (round %d): %d %s %v", key, round, code, body, err)
					case key == "aborted-1" && code == http.StatusCreated:
						t.Fatalf("%s: 201 although the transaction was aborted", key)
					}
				}
			}
			rows := outboxRows(t, pool, schema)
			if len(rows) != 1 || rows[0].payload != "ok-1" || rows[0].id != outbox.MessageID("", "ok-1", "order.created") {
				t.Fatalf("outbox %+v; want ok-1's event only", rows)
			}
		})
	}
}
