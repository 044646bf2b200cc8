package mysqlstore_test

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
	"github.com/idemkit/idem/mysqlstore"
)

// TestSmallPoolsSteps (guard): a pool of two connections, and one of three
// whose connections are never idle and live 1 ms (every statement prepared
// again on a new connection), serve concurrent duplicates of handlers that
// write an order in the request's transaction and record a step, in both
// flows, while a janitor sweeps the records on the same pool. Every request
// answers: a step that finds no connection beside the handlers'
// transactions gives up within seconds saying to raise SetMaxOpenConns
// (502), and in claim-then-complete a lease whose renewal found none either
// may lapse. Then each key's retries, one at a time, succeed: one order per
// key, its step run with one derived key (a run whose outcome was not
// recorded runs again with it).
func TestSmallPoolsSteps(t *testing.T) {
	t.Parallel()
	pools := map[string]func(*sql.DB){
		"two": func(db *sql.DB) { db.SetMaxOpenConns(2) },
		"churn": func(db *sql.DB) {
			db.SetMaxOpenConns(3)
			db.SetMaxIdleConns(0)
			db.SetConnMaxLifetime(time.Millisecond)
		},
	}
	for name, setup := range pools {
		for _, flow := range []idem.Flow{idem.FlowSingleTx, idem.FlowClaimComplete} {
			t.Run(name+"/"+flow.String(), func(t *testing.T) {
				t.Parallel()
				testSmallPoolSteps(t, setup, flow)
			})
		}
	}
}

func testSmallPoolSteps(t *testing.T, setup func(*sql.DB), flow idem.Flow) {
	db := openDB(t, 8, "")
	setup(db)
	s := newStore(t, db)
	orders := randomName("orders_")
	if _, err := db.Exec("CREATE TABLE `" + orders + "` (k VARCHAR(64) PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	dropAtEnd(t, db, orders)
	var mu sync.Mutex
	calls := map[string]map[string]bool{} // key -> derived keys its step ran with
	mw, err := idem.New(s, &idem.Config{Flow: flow, KeepFunc: func(st int) bool { return st < 500 }})
	if err != nil {
		t.Fatal(err)
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, key, _ := idem.KeyFrom(r.Context())
		tx := mysqlstore.Tx(r.Context())
		if _, err := tx.ExecContext(r.Context(), "INSERT INTO `"+orders+"` (k) VALUES (?)", key); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if _, err := idem.Step(r.Context(), "charge", func(ctx context.Context, k string) (string, error) {
			mu.Lock()
			if calls[key] == nil {
				calls[key] = map[string]bool{}
			}
			calls[key][k] = true
			mu.Unlock()
			return k, nil
		}); err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	srv := httptest.NewServer(mw(h))
	// Closed on success only: Close waits for the handlers, which stand
	// still for ever when something waits for a connection it cannot get.

	jctx, stop := context.WithCancel(context.Background())
	var bg sync.WaitGroup
	bg.Add(1)
	go func() {
		defer bg.Done()
		for jctx.Err() == nil {
			_, _ = s.DeleteExpired(jctx, time.Now(), 100)
			time.Sleep(2 * time.Millisecond)
		}
	}()
	prefix := randomName("sp-")
	client := &http.Client{Timeout: 60 * time.Second}
	post := func(k int) (int, string, error) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", fmt.Sprintf("%s-%d", prefix, k))
		resp, err := client.Do(req)
		if err != nil {
			return 0, "", err
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode, string(b), nil
	}
	const keys, copies = 4, 2
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan error, keys*copies)
	for k := range keys {
		for range copies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				code, b, err := post(k)
				switch {
				case err != nil:
				case code == http.StatusCreated, code == http.StatusConflict:
				case code == http.StatusBadGateway && strings.Contains(b, "SetMaxOpenConns"):
				case code == http.StatusBadGateway && strings.Contains(b, "lock lost"):
					// claim-then-complete: the lease lapsed while the
					// renewal, too, waited for a connection.
				case code == http.StatusServiceUnavailable:
				default:
					err = fmt.Errorf("key %d: %d %s", k, code, b)
				}
				errs <- err
			}()
		}
	}
	close(start)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(90 * time.Second):
		t.Fatal("requests did not all answer within 90 s: something waits for a connection it cannot get")
	}
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	// Alone, each key's retries succeed (or replay). A key whose release
	// starved for a connection in the burst stays in flight until its lease
	// lapses (idem.DefaultLease after its last renewal): the retries wait
	// for that, and 409 is the only other answer they accept (CI saw a key
	// still in flight after the 10 s this waited before).
	for k := range keys {
		deadline := time.Now().Add(idem.DefaultLease + 10*time.Second)
		for {
			code, b, err := post(k)
			if err != nil {
				t.Fatal(err)
			}
			if code == http.StatusCreated {
				break
			}
			if time.Now().After(deadline) || code != http.StatusConflict {
				t.Fatalf("retry of key %d alone: %d %s", k, code, b)
			}
			time.Sleep(250 * time.Millisecond)
		}
	}
	stop()
	bg.Wait()
	srv.Close()
	var n int
	if err := db.QueryRow("SELECT count(*) FROM `" + orders + "`").Scan(&n); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if n != keys || len(calls) != keys {
		t.Errorf("%d orders, %d keys' steps run, want %d", n, len(calls), keys)
	}
	for k, c := range calls {
		if len(c) != 1 {
			t.Errorf("step of %s ran with %d derived keys, want one", k, len(c))
		}
	}
}
