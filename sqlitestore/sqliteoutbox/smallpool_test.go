package sqliteoutbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
	"github.com/idemkit/idem/sqlitestore/sqliteoutbox"
)

// TestSmallPools (guard): pools of one and two connections, and one whose
// connections are never idle and live 1 ms (every statement prepared on a
// new connection), serve concurrent duplicates of handlers that write an
// order, enqueue its event and record a step in the request's transaction,
// in both flows, while a relay publishes on the same pool and a janitor
// sweeps the records: every request answers, one order, one event and one
// step call per key, and the relay publishes every event.
func TestSmallPools(t *testing.T) {
	t.Parallel()
	pools := map[string]func(*sql.DB){
		"one": func(db *sql.DB) { db.SetMaxOpenConns(1) },
		"two": func(db *sql.DB) { db.SetMaxOpenConns(2) },
		"churn": func(db *sql.DB) {
			db.SetMaxOpenConns(2)
			db.SetMaxIdleConns(0)
			db.SetConnMaxLifetime(time.Millisecond)
		},
	}
	for name, setup := range pools {
		for _, flow := range []idem.Flow{idem.FlowSingleTx, idem.FlowClaimComplete} {
			t.Run(name+"/"+flow.String(), func(t *testing.T) {
				t.Parallel()
				testSmallPool(t, setup, flow)
			})
		}
	}
}

func testSmallPool(t *testing.T, setup func(*sql.DB), flow idem.Flow) {
	ctx := context.Background()
	db, err := embedded.Open(filepath.Join(t.TempDir(), "shop.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	setup(db)
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
	var mu sync.Mutex
	calls := map[string]int{}
	published := map[string]int{}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, key, _ := idem.KeyFrom(r.Context())
		if _, err := sqlitestore.Tx(r.Context()).ExecContext(r.Context(), "INSERT INTO orders (key) VALUES (?)", key); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if err := ob.Enqueue(r.Context(), nil, outbox.Message{Name: "order.created", Subject: "orders.created", Payload: []byte(key)}); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if _, err := idem.Step(r.Context(), "charge", func(ctx context.Context, k string) (string, error) {
			mu.Lock()
			calls[key]++
			mu.Unlock()
			return k, nil
		}); err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	mw, err := idem.New(store, &idem.Config{Flow: flow})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(h))
	// Closed on success only: Close waits for the handlers, which stand
	// still for ever when something waits for a connection it cannot get.

	rctx, stop := context.WithCancel(ctx)
	var bg sync.WaitGroup
	relay := &outbox.Relay{Source: ob, Publisher: outbox.PublisherFunc(func(_ context.Context, m *outbox.Stored) error {
		mu.Lock()
		published[m.ID]++
		mu.Unlock()
		return nil
	}), PollInterval: 5 * time.Millisecond}
	bg.Add(2)
	go func() { defer bg.Done(); _ = relay.Run(rctx) }()
	go func() {
		defer bg.Done()
		for rctx.Err() == nil {
			_, _ = store.DeleteExpired(rctx, time.Now(), 100)
			_, _ = store.DeleteExpiredSteps(rctx, time.Now(), 100)
			time.Sleep(time.Millisecond)
		}
	}()

	const keys, copies = 6, 3
	client := &http.Client{Timeout: 60 * time.Second}
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan error, keys*copies)
	for k := range keys {
		for range copies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				for {
					req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{}`))
					req.Header.Set("Idempotency-Key", fmt.Sprint("order-", k))
					resp, err := client.Do(req)
					if err != nil {
						errs <- err
						return
					}
					b, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					switch resp.StatusCode {
					case http.StatusCreated:
						errs <- nil
						return
					case http.StatusConflict:
						time.Sleep(5 * time.Millisecond)
						continue
					}
					errs <- fmt.Errorf("order-%d: %d %s", k, resp.StatusCode, b)
					return
				}
			}()
		}
	}
	close(start)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(45 * time.Second):
		t.Fatal("requests did not all answer within 45 s: something waits for a connection it cannot get")
	}
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		mu.Lock()
		n := len(published)
		mu.Unlock()
		if n == keys || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	bg.Wait()
	srv.Close()
	if err := store.Close(); err != nil {
		t.Fatal(err)
	}
	var orders, events int
	if err := db.QueryRow("SELECT count(*) FROM orders").Scan(&orders); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRow("SELECT count(*) FROM idem_outbox").Scan(&events); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if orders != keys || events != keys || len(calls) != keys || len(published) != keys {
		t.Fatalf("%d orders, %d events, %d keys' steps, %d published; want %d of each", orders, events, len(calls), len(published), keys)
	}
	for k, c := range calls {
		if c != 1 {
			t.Errorf("step of %s ran %d times", k, c)
		}
	}
	for id, c := range published {
		if c != 1 {
			t.Errorf("event %s published %d times", id, c)
		}
	}
}
