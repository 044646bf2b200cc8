package sqlitestore_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/racetest"
)

// One key, 100 requests released together over loopback HTTP: exactly one order
// is written, and every answer is the 201, its byte-identical replay, or a 409.
func TestRaceOneKey(t *testing.T) {
	t.Parallel()
	t.Run("claim-complete", func(t *testing.T) { t.Parallel(); testRaceOneKey(t, idem.FlowClaimComplete) })
	t.Run("single-tx", func(t *testing.T) { t.Parallel(); testRaceOneKey(t, idem.FlowSingleTx) })
}

func testRaceOneKey(t *testing.T, flow idem.Flow) {
	const n = 100
	db := openDB(t)
	createOrders(t, db)
	store := newStore(t, db)
	// The handler keeps its transaction open a little, so that many requests
	// arrive while the key is in flight.
	srv := serve(t, store, &idem.Config{Flow: flow}, orderHandler(func(context.Context) { time.Sleep(200 * time.Millisecond) }))

	results := racetest.Fire(n, racetest.Post(srv.URL, "race-key", []byte(`{"item":"book"}`), nil))

	var first *racetest.Result
	created, replayed, inFlight := 0, 0, 0
	for i := range results {
		r := &results[i]
		switch {
		case r.Err != nil:
			t.Fatalf("request failed: %v", r.Err)
		case r.Status == http.StatusCreated && r.Header.Get(idem.ReplayedHeader) == "":
			created++
			first = r
		case r.Status == http.StatusCreated && r.Header.Get(idem.ReplayedHeader) == "true":
			replayed++
		case r.Status == http.StatusConflict && problemCode(string(r.Body)) == idem.CodeKeyInUse:
			inFlight++
		default:
			t.Errorf("unexpected answer %d %s: %s", r.Status, r.Header, r.Body)
		}
	}
	t.Logf("%d requests: %d executed, %d replayed, %d in flight (409)", n, created, replayed, inFlight)
	if created != 1 {
		t.Fatalf("%d requests executed the handler, want exactly 1", created)
	}
	for _, r := range results {
		if r.Header.Get(idem.ReplayedHeader) == "true" && (string(r.Body) != string(first.Body) || r.Header.Get("Location") != first.Header.Get("Location")) {
			t.Errorf("replay %q (Location %q) differs from the original %q (Location %q)", r.Body, r.Header.Get("Location"), first.Body, first.Header.Get("Location"))
		}
	}
	if got := countOrders(t, db); got != 1 {
		t.Fatalf("%d orders in the database, want exactly 1", got)
	}
	rec, err := store.Get(context.Background(), "", "race-key", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if rec.State != idem.StateComplete || string(rec.Response.Body) != string(first.Body) {
		t.Errorf("stored record = %v %q, want complete with the original body", rec.State, rec.Response.Body)
	}
	// After the race, a retry replays.
	if a := post(t, srv.URL, "race-key", "book"); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "true" || a.body != string(first.Body) {
		t.Errorf("retry after the race = %d %q, want the replayed 201", a.status, a.body)
	}
}

// 100 different keys released together: every request writes in the one SQLite
// file, and none fails with SQLITE_BUSY (a 503).
func TestRaceManyKeys(t *testing.T) {
	t.Parallel()
	t.Run("claim-complete", func(t *testing.T) { t.Parallel(); testRaceManyKeys(t, idem.FlowClaimComplete) })
	t.Run("single-tx", func(t *testing.T) { t.Parallel(); testRaceManyKeys(t, idem.FlowSingleTx) })
}

func testRaceManyKeys(t *testing.T, flow idem.Flow) {
	const n = 100
	db := openDB(t)
	createOrders(t, db)
	store := newStore(t, db)
	srv := serve(t, store, &idem.Config{Flow: flow}, orderHandler(nil))

	results := racetest.Fire(n, func(i int) (*http.Request, error) {
		return racetest.Post(srv.URL, fmt.Sprintf("key-%d", i), []byte(fmt.Sprintf(`{"item":"item-%d"}`, i)), nil)(i)
	})
	for _, r := range results {
		if r.Err != nil {
			t.Fatalf("request failed: %v", r.Err)
		}
		if r.Status != http.StatusCreated || r.Header.Get(idem.ReplayedHeader) != "" {
			t.Errorf("answer %d %s, want a fresh 201", r.Status, r.Body)
		}
	}
	if got := countOrders(t, db); got != n {
		t.Fatalf("%d orders in the database, want %d", got, n)
	}
	var complete int
	if err := db.QueryRow(`SELECT count(*) FROM "` + store.Table() + `" WHERE state = 2`).Scan(&complete); err != nil {
		t.Fatal(err)
	}
	if complete != n {
		t.Errorf("%d complete records, want %d", complete, n)
	}
}

// A handler that panics leaves nothing behind: its order is rolled back and the
// key released, so the retry runs afresh.
func TestPanicRollsBack(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			testPanicRollsBack(t, flow)
		})
	}
}

func testPanicRollsBack(t *testing.T, flow idem.Flow) {
	db := openDB(t)
	createOrders(t, db)
	store := newStore(t, db)
	var panicking atomic.Bool
	panicking.Store(true)
	srv := serve(t, store, &idem.Config{Flow: flow}, orderHandler(func(context.Context) {
		if panicking.Load() {
			panic(http.ErrAbortHandler) // net/http drops the connection without logging
		}
	}))
	r, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{"item":"x"}`))
	if err != nil {
		t.Fatal(err)
	}
	r.Header.Set("Idempotency-Key", "panic-key")
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	if resp, err := c.Do(r); err == nil {
		resp.Body.Close()
		t.Fatalf("the panicking request got an answer (%d), want the connection dropped", resp.StatusCode)
	}
	if got := countOrders(t, db); got != 0 {
		t.Fatalf("%d orders after the handler panicked, want 0 (rolled back)", got)
	}
	if _, err := store.Get(context.Background(), "", "panic-key", time.Now()); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("Get after the panic: %v; want ErrNotFound (the key released)", err)
	}
	panicking.Store(false)
	if a := post(t, srv.URL, "panic-key", "x"); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "" {
		t.Fatalf("retry after the panic = %d %s, want a fresh 201", a.status, a.body)
	}
	if got := countOrders(t, db); got != 1 {
		t.Fatalf("%d orders, want 1", got)
	}
}
