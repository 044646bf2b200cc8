package sqliteoutbox_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
	"github.com/idemkit/idem/sqlitestore/sqliteoutbox"
)

func post(url, key string) (int, error) {
	req, _ := http.NewRequest("POST", url+"/orders", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", key)
	c := &http.Client{Timeout: 30 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		return 0, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode, nil
}

// TestEnqueueWithTheAnswer: through idem.New + sqlitestore over loopback
// HTTP, concurrent sends of each key: the committed orders have their event
// with ID MessageID(scope, key, name), once; replays enqueue nothing;
// handlers that roll back leave none. Then a relay publishes them all.
func TestEnqueueWithTheAnswer(t *testing.T) {
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
		_, key, _ := idem.KeyFrom(r.Context())
		if _, err := tx.ExecContext(r.Context(), "INSERT INTO orders (key) VALUES (?)", key); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if err := ob.Enqueue(r.Context(), nil, outbox.Message{Name: "order.created", Subject: "orders.created", Payload: []byte(key)}); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if strings.HasPrefix(key, "fail-") {
			_ = tx.Rollback()
			http.Error(w, "refused", http.StatusPaymentRequired)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	mw, err := idem.New(store, nil)
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
	const keys, sends = 12, 3
	start := make(chan struct{})
	errs := make(chan error, keys*sends)
	for k := range keys {
		key := fmt.Sprint("order-", k)
		if k%3 == 0 {
			key = "fail-" + key
		}
		for range sends {
			go func() {
				<-start
				for {
					code, err := post(url, key)
					// A handler that rolls idem's SQLite transaction back
					// gets 503 (nothing committed, the key released): final
					// for the fail- keys, which always roll back.
					failed := strings.HasPrefix(key, "fail-") && code == http.StatusServiceUnavailable
					if err == nil && !failed && (code == http.StatusConflict || code == http.StatusServiceUnavailable) {
						time.Sleep(10 * time.Millisecond)
						continue
					}
					if err == nil && !failed && code != http.StatusCreated && code != http.StatusPaymentRequired {
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
	ids := map[string]string{}
	rows, err := db.Query("SELECT id, payload FROM idem_outbox")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		var p []byte
		if err := rows.Scan(&id, &p); err != nil {
			t.Fatal(err)
		}
		if _, dup := ids[id]; dup {
			t.Fatalf("event %s enqueued twice", id)
		}
		ids[id] = string(p)
	}
	_ = rows.Close()
	for k := range keys {
		key := fmt.Sprint("order-", k)
		if k%3 == 0 {
			key = "fail-" + key
			if _, ok := ids[outbox.MessageID("", key, "order.created")]; ok {
				t.Fatalf("rolled-back %s left an event", key)
			}
		} else if ids[outbox.MessageID("", key, "order.created")] != key {
			t.Fatalf("%s has no event", key)
		}
	}
	if len(ids) != keys-keys/3 {
		t.Fatalf("%d events, want %d", len(ids), keys-keys/3)
	}
	published := map[string]bool{}
	r := &outbox.Relay{Source: ob, Publisher: outbox.PublisherFunc(func(_ context.Context, m *outbox.Stored) error {
		published[m.ID] = true // Concurrency 1 below: no race
		return nil
	}), Concurrency: 1}
	for {
		n, err := r.PublishBatch(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
	}
	if len(published) != len(ids) {
		t.Fatalf("published %d of %d", len(published), len(ids))
	}
}
