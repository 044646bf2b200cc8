package sqlitestore_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
)

// A client that hangs up while the handler's transaction is open does not roll
// it back: the order and its stored answer commit, and the retry replays them
// instead of inserting a second order.
func TestHangUpKeepsTheTransaction(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(fmt.Sprint("flow ", flow), func(t *testing.T) {
			t.Parallel()
			db := openDB(t)
			createOrders(t, db)
			store := newStore(t, db)
			started, hungUp := make(chan struct{}, 1), make(chan struct{})
			srv := serve(t, store, &idem.Config{Flow: flow}, orderHandler(func(context.Context) {
				started <- struct{}{}
				// The client gives up meanwhile: the handler goes on only once it
				// has (a sleep let a slow client's hang-up come after the answer).
				select {
				case <-hungUp:
				case <-time.After(30 * time.Second):
				}
			}))
			ctx, cancel := context.WithCancel(context.Background())
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(`{"item":"lamp"}`))
			req.Header.Set("Idempotency-Key", "hangup")
			go func() {
				select {
				case <-started: // the order is inserted: hang up now
				case <-time.After(30 * time.Second):
				}
				cancel()
			}()
			c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
			resp, err := c.Do(req)
			close(hungUp)
			if err == nil {
				resp.Body.Close()
				t.Fatalf("the client got %d; the test needs it to hang up", resp.StatusCode)
			}
			var a answer
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				if a = post(t, srv.URL, "hangup", "lamp"); a.status != http.StatusConflict || time.Now().After(deadline) {
					break
				}
			}
			if a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "true" {
				t.Fatalf("retry after the hang-up: %d %s, want the replayed 201", a.status, a.body)
			}
			if n := countOrders(t, db); n != 1 {
				t.Fatalf("%d orders, want 1", n)
			}
		})
	}
}

// The single-transaction flow taking over a lapsed claim gives the completion a
// cleanup deadline that starts after the handler, not before it: a handler
// longer than CleanupTimeout still commits.
func TestSingleTxTakeoverOutlivesCleanupTimeout(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	createOrders(t, db)
	store := newStore(t, db)
	// The commit after the handler has the whole CleanupTimeout, 1 s, which a
	// loaded machine needs (100 ms was a flake); the handler's sleep is longer
	// than it whatever the load.
	cfg := &idem.Config{Flow: idem.FlowSingleTx, CleanupTimeout: time.Second}
	srv := serve(t, store, cfg, orderHandler(func(context.Context) { time.Sleep(1500 * time.Millisecond) }))
	body := `{"item":"lamp"}`
	fp := idem.FingerprintV2(httptest.NewRequest(http.MethodPost, "/", strings.NewReader(body)), []byte(body))
	now := time.Now()
	if _, claimed, err := store.Claim(context.Background(), idem.ClaimRequest{
		Key: "k", Fingerprint: fp, Token: "crashed", Now: now.Add(-time.Minute),
		LeaseUntil: now.Add(-time.Second), ExpiresAt: now.Add(time.Hour),
	}); err != nil || !claimed {
		t.Fatalf("claim of the crashed request: %v %v", claimed, err)
	}
	if a := post(t, srv.URL, "k", "lamp"); a.status != http.StatusCreated {
		t.Fatalf("takeover with a handler longer than CleanupTimeout: %d %s, want 201", a.status, a.body)
	}
	if a := post(t, srv.URL, "k", "lamp"); a.header.Get(idem.ReplayedHeader) != "true" {
		t.Fatalf("retry: %d %s, want the replay", a.status, a.body)
	}
	if n := countOrders(t, db); n != 1 {
		t.Fatalf("%d orders, want 1", n)
	}
}

// Cleanup deadlines run on the wall clock: a Config.NowFunc a minute behind
// (a test clock, or record times from another source) does not make every
// completion miss its deadline.
func TestNowFuncBehindTheWallClock(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			testNowFuncBehindTheWallClock(t, flow)
		})
	}
}

func testNowFuncBehindTheWallClock(t *testing.T, flow idem.Flow) {
	db := openDB(t)
	createOrders(t, db)
	store := newStore(t, db)
	behind := func() time.Time { return time.Now().Add(-time.Minute) }
	srv := serve(t, store, &idem.Config{NowFunc: behind, Flow: flow}, orderHandler(nil))
	if a := post(t, srv.URL, "k", "lamp"); a.status != http.StatusCreated {
		t.Fatalf("with NowFunc a minute behind: %d %s, want 201", a.status, a.body)
	}
	if a := post(t, srv.URL, "k", "lamp"); a.header.Get(idem.ReplayedHeader) != "true" {
		t.Fatalf("retry: %d %s, want the replay", a.status, a.body)
	}
}

// A failed statement the handler catches and answers for (a unique violation
// answered 409) is the request's outcome: SQLite rolls back only the statement,
// the answer is stored with the transaction, and the retry replays it without
// running the handler again.
func TestHandledConstraintViolationIsReplayed(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			testHandledConstraintViolationIsReplayed(t, flow)
		})
	}
}

func testHandledConstraintViolationIsReplayed(t *testing.T, flow idem.Flow) {
	db := openDB(t)
	if _, err := db.Exec(`CREATE TABLE carts (id TEXT PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`INSERT INTO carts (id) VALUES ('c_42')`); err != nil {
		t.Fatal(err)
	}
	store := newStore(t, db)
	runs := 0
	srv := serve(t, store, &idem.Config{Flow: flow}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		tx := sqlitestore.Tx(r.Context())
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO carts (id) VALUES ('c_42')`); err != nil {
			w.WriteHeader(http.StatusConflict)
			fmt.Fprint(w, "cart exists")
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	first := post(t, srv.URL, "dup", "x")
	again := post(t, srv.URL, "dup", "x")
	if first.status != http.StatusConflict || again.status != http.StatusConflict || again.header.Get(idem.ReplayedHeader) != "true" || runs != 1 {
		t.Fatalf("first %d %s, retry %d (replayed %q), %d runs; want 409, its replay, one run",
			first.status, first.body, again.status, again.header.Get(idem.ReplayedHeader), runs)
	}
}
