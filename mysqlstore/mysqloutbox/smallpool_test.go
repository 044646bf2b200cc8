package mysqloutbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/mysqlstore/mysqloutbox"
	"github.com/idemkit/idem/outbox"
)

// TestSmallPools (guard): pools of one and two connections, and one of two
// whose connections are never idle and live 1 ms, serve concurrent
// duplicates whose handlers write an order and enqueue its event in the
// request's transaction, in both flows, while a relay publishes and a
// janitor sweeps the records on the same pool: every request answers, one
// order per key, and every event is published.
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
	big := testDB(t)
	obTable := "outbox_" + randHex(5)
	table := "records_" + randHex(5)
	orders := "orders_" + randHex(5)
	if _, err := big.Exec("CREATE TABLE " + orders + " (k VARCHAR(255) PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = big.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_migrations, " + table + "_steps, " + orders + ", " + obTable + ", " + obTable + "_dead, " + obTable + "_locks")
	})
	db, err := sql.Open("mysql", testenv.MySQLDSN(testenv.MySQLURL(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	setup(db)
	store, err := mysqlstore.New(db, &mysqlstore.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	ob, err := mysqloutbox.New(db, &mysqloutbox.Config{Table: obTable})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, key, _ := idem.KeyFrom(r.Context())
		if _, err := mysqlstore.Tx(r.Context()).ExecContext(r.Context(), "INSERT INTO "+orders+" (k) VALUES (?)", key); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if err := ob.Enqueue(r.Context(), nil, outbox.Message{Name: "order.created", Subject: "orders.created", Payload: []byte(key)}); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
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

	var mu sync.Mutex
	published := map[string]int{}
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
			time.Sleep(2 * time.Millisecond)
		}
	}()

	prefix := randHex(4)
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
				for attempt := 0; ; attempt++ {
					req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{}`))
					req.Header.Set("Idempotency-Key", fmt.Sprintf("%s-%d", prefix, k))
					resp, err := client.Do(req)
					if err != nil {
						errs <- err
						return
					}
					b, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					switch {
					case resp.StatusCode == http.StatusCreated:
						errs <- nil
						return
					case resp.StatusCode == http.StatusConflict && attempt < 400:
						time.Sleep(5 * time.Millisecond)
						continue
					}
					errs <- fmt.Errorf("key %d: %d %s", k, resp.StatusCode, b)
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
	case <-time.After(60 * time.Second):
		t.Fatal("requests did not all answer within 60 s: something waits for a connection it cannot get")
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
		if n >= keys || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	bg.Wait()
	srv.Close()
	var n int
	if err := big.QueryRow("SELECT count(*) FROM " + orders).Scan(&n); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if n != keys || len(published) != keys {
		t.Fatalf("%d orders, %d events published; want %d of each", n, len(published), keys)
	}
	for id, c := range published {
		if c != 1 {
			t.Errorf("event %s published %d times", id, c)
		}
	}
}
