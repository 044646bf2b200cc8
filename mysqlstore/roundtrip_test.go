package mysqlstore_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/mysqlstore"
)

// wire counts what the store's connections send: round trips (a write after a
// read starts one) and commands (client packets with sequence number 0).
type wire struct{ trips, commands atomic.Int64 }

type wireConn struct {
	net.Conn
	w         *wire
	readSince atomic.Bool
	pending   int // bytes of the packet being written still to pass over
}

func (c *wireConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.readSince.Store(true)
	}
	return n, err
}

func (c *wireConn) Write(p []byte) (int, error) {
	if c.readSince.Swap(false) {
		c.w.trips.Add(1)
	}
	for b := p; len(b) > 0; {
		if c.pending > 0 {
			k := min(c.pending, len(b))
			c.pending -= k
			b = b[k:]
			continue
		}
		if len(b) < 4 {
			break // a header split across writes: the driver never does that
		}
		size := int(b[0]) | int(b[1])<<8 | int(b[2])<<16
		if b[3] == 0 {
			c.w.commands.Add(1)
		}
		c.pending = size
		b = b[4:]
	}
	return c.Conn.Write(p)
}

// countedDB opens a pool whose connections count round trips and commands.
func countedDB(t testing.TB, extra string) (*sql.DB, *wire) {
	t.Helper()
	openDB(t, 1, extra) // skips when the server is unreachable
	cfg, err := mysql.ParseDSN(testenv.MySQLDSN(testenv.MySQLURL(t)) + extra)
	if err != nil {
		t.Fatal(err)
	}
	w := &wire{}
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		wc := &wireConn{Conn: c, w: w}
		wc.readSince.Store(true)
		return wc, nil
	}
	conn, err := mysql.NewConnector(cfg)
	if err != nil {
		t.Fatal(err)
	}
	db := sql.OpenDB(conn)
	db.SetMaxOpenConns(4)
	db.SetMaxIdleConns(4)
	t.Cleanup(func() { _ = db.Close() })
	return db, w
}

// roundTrips reports the round trips and commands of one first-time request
// through the middleware with flow, after warm-up requests (statements prepared,
// settings read, connections open).
func roundTrips(t *testing.T, extra string, flow idem.Flow) (trips, commands int64) {
	first, _ := roundTripsOf(t, extra, flow)
	return first.trips, first.commands
}

type tripCount struct{ trips, commands int64 }

// roundTripsOf reports the round trips and commands of one first-time request
// and of one replay through the middleware with flow, after warm-up requests.
func roundTripsOf(t *testing.T, extra string, flow idem.Flow) (first, replay tripCount) {
	return roundTripsWith(t, extra, flow, orderHandler)
}

// roundTripsWith is roundTripsOf with the handler handler makes.
func roundTripsWith(t *testing.T, extra string, flow idem.Flow, handler func(table string, hold func(r *http.Request)) http.Handler) (first, replay tripCount) {
	db, w := countedDB(t, extra)
	s := newStore(t, db)
	orders := ordersTable(t, db)
	srv := newServer(t, s, &idem.Config{Flow: flow}, handler(orders, nil))
	post := func(key string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{"item":"rt"}`))
		req.Header.Set("Idempotency-Key", key)
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	for i := range 8 {
		post(fmt.Sprintf("warm-%d", i))
	}
	const n = 10
	measure := func(key func(i int) string) tripCount {
		t0, c0 := w.trips.Load(), w.commands.Load()
		for i := range n {
			post(key(i))
		}
		return tripCount{(w.trips.Load() - t0) / n, (w.commands.Load() - c0) / n}
	}
	first = measure(func(i int) string { return fmt.Sprintf("k-%d", i) })
	replay = measure(func(i int) string { return fmt.Sprintf("k-%d", i) })
	return first, replay
}

// TestRoundTrips counts the round trips of a first-time request (the handler's
// own insert included), which is what the store's speed mostly is on a fast
// network: the counts are deterministic, so they are checked exactly.
func TestRoundTrips(t *testing.T) {
	t.Parallel()
	// The handler's insert takes 2 (prepare and execute: no interpolateParams).
	// Before: 13 single-transaction, 15 claim-then-complete, either DSN. The
	// single transaction's lock-free read (one round trip per replay instead of
	// 4 or 6) costs a first-time request one more round trip.
	for _, tc := range []struct {
		name, dsn string
		flow      idem.Flow
		max       int64
	}{
		{"single/plain", "", idem.FlowSingleTx, 11},
		{"single/multiStatements", "&multiStatements=true", idem.FlowSingleTx, 7},
		{"claim/plain", "", idem.FlowClaimComplete, 11},
		{"claim/multiStatements", "&multiStatements=true", idem.FlowClaimComplete, 9},
	} {
		t.Run(tc.name, func(t *testing.T) {
			trips, commands := roundTrips(t, tc.dsn, tc.flow)
			t.Logf("%s: %d round trips, %d commands per first-time request", tc.name, trips, commands)
			if trips > tc.max {
				t.Errorf("%d round trips per first-time request, want at most %d", trips, tc.max)
			}
		})
	}
}

// TestRoundTripsConn: a handler on mysqlstore.Conn (the documented default) in
// the single-transaction flow, with multiStatements and interpolateParams,
// costs three round trips in all — the read, the lock and the transaction's
// beginning; the handler's insert; the record, COMMIT and the lock's release —
// like the hand-written reference of `idem bench`. (Found: 6 with
// mysqlstore.Tx, the *sql.Tx's START TRANSACTION and trailing COMMIT
// included.) The same handler on mysqlstore.Tx still works, at 6 as before.
func TestRoundTripsConn(t *testing.T) {
	t.Parallel()
	const dsn = "&multiStatements=true&interpolateParams=true"
	for _, tc := range []struct {
		name    string
		handler func(string, func(*http.Request)) http.Handler
		want    int64
	}{{"Conn", connOrderHandler, 3}, {"Tx", orderHandler, 6}} {
		t.Run(tc.name, func(t *testing.T) {
			first, _ := roundTripsWith(t, dsn, idem.FlowSingleTx, tc.handler)
			t.Logf("%s: %d round trips, %d commands per first-time request", tc.name, first.trips, first.commands)
			if first.trips != tc.want {
				t.Errorf("%d round trips per first-time request, want %d", first.trips, tc.want)
			}
		})
	}
}

// A replay in the single-transaction flow is one round trip, one query: the
// lock-free read (with multiStatements, the guard that does not take the lock
// rides along). Found: 4 round trips with multiStatements, 6 without (START
// TRANSACTION, the lock and the read, ROLLBACK, the release), slower than the
// bare handler's insert.
func TestReplayRoundTrips(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, dsn string }{{"plain", ""}, {"multiStatements", "&multiStatements=true"}} {
		t.Run(tc.name, func(t *testing.T) {
			_, replay := roundTripsOf(t, tc.dsn, idem.FlowSingleTx)
			t.Logf("%s: %d round trips, %d commands per replay", tc.name, replay.trips, replay.commands)
			if replay.trips != 1 || replay.commands != 1 {
				t.Errorf("%d round trips, %d commands per replay, want 1 and 1", replay.trips, replay.commands)
			}
		})
	}
}

// The store prefers the single-transaction flow: with a nil Config, no record
// exists while the handler runs (claim-then-complete would have an in-flight
// one), and the key's record is written with the handler's order.
func TestPreferredFlow(t *testing.T) { bothModes(t, testPreferredFlow) }

func testPreferredFlow(t *testing.T) {
	db := openDB(t, 4, "")
	s := newStore(t, db)
	if f := s.PreferredFlow(); f != idem.FlowSingleTx {
		t.Fatalf("PreferredFlow = %v, want single-tx", f)
	}
	orders := ordersTable(t, db)
	key := randomName("k-")
	var during error
	srv := newServer(t, s, nil, orderHandler(orders, func(r *http.Request) {
		_, during = s.Get(r.Context(), "", key, time.Now())
	}))
	for range 2 {
		req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{"item":"pref"}`))
		req.Header.Set("Idempotency-Key", key)
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	if !errors.Is(during, idem.ErrNotFound) {
		t.Fatalf("Get while the handler ran = %v, want ErrNotFound (no in-flight record: the single-transaction flow)", during)
	}
	if n := countOrders(t, db, orders, "pref"); n != 1 {
		t.Fatalf("%d orders, want 1", n)
	}
}

// Concurrent retries of a complete key are all replayed in the
// single-transaction flow; none gets 409 because another retry holds the key's
// lock for its read. Found: 409s at 32 concurrent replays.
func TestConcurrentReplaysSingleTx(t *testing.T) { bothModes(t, testConcurrentReplaysSingleTx) }

func testConcurrentReplaysSingleTx(t *testing.T) {
	db := openDB(t, 40, "")
	s := newStore(t, db)
	orders := ordersTable(t, db)
	srv := newServer(t, s, &idem.Config{Flow: idem.FlowSingleTx}, orderHandler(orders, nil))
	key := randomName("k-")
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	defer client.CloseIdleConnections()
	post := func() (int, string, error) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{"item":"replayed"}`))
		req.Header.Set("Idempotency-Key", key)
		resp, err := client.Do(req)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		return resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), nil
	}
	if st, _, err := post(); err != nil || st != http.StatusCreated {
		t.Fatalf("first request: %d, %v", st, err)
	}
	const n = 32
	var wg sync.WaitGroup
	start := make(chan struct{})
	var bad atomic.Int64
	for range 10 { // rounds, so that the retries meet
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				st, replayed, err := post()
				if err != nil || st != http.StatusCreated || replayed != "true" {
					bad.Add(1)
					t.Logf("replay: %d (replayed %q), %v", st, replayed, err)
				}
			}()
		}
	}
	close(start)
	wg.Wait()
	if bad.Load() != 0 {
		t.Fatalf("%d of %d concurrent retries of a complete key were not replays", bad.Load(), 10*n)
	}
	if c := countOrders(t, db, orders, "replayed"); c != 1 {
		t.Fatalf("%d orders, want 1", c)
	}
}

// Responses are stored byte for byte whether they travel as hexadecimal SQL
// text (small) or as parameters of a prepared statement (over 64 KiB), in both
// flows: every byte value in scope, key, headers, body and ref.
func TestRecordBytesExact(t *testing.T) { bothModes(t, testRecordBytesExact) }

func testRecordBytesExact(t *testing.T) {
	db := openDB(t, 4, "")
	s := newStore(t, db)
	ctx := ctxFor(t)
	all := make([]byte, 256)
	for i := range all {
		all[i] = byte(i)
	}
	for _, size := range []int{0, 256, 200 << 10} {
		body := bytes.Repeat(all, size/256)
		if size == 0 {
			body = []byte{}
		}
		resp := &idem.Response{Status: 201, Header: http.Header{"Location": {"/f/\xe9\x00'\\"}}, Body: body, Ref: "ref'\\\x00\xff"}
		scope, key := "sc'\\\x00\xff", fmt.Sprintf("k\x00'\"\\%d", size)
		now := time.Now()

		// Single transaction.
		_, tx, rec, err := s.BeginLocked(ctx, scope, key+"s", now)
		if err != nil || rec != nil {
			t.Fatalf("BeginLocked = %+v, %v", rec, err)
		}
		want := &idem.Record{Scope: scope, Key: key + "s", State: idem.StateComplete, Fingerprint: "fp'\\\x00",
			Token: "tok", CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(time.Hour), Response: resp}
		if err := tx.Insert(ctx, want); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		checkStored(t, s, scope, key+"s", resp, now)

		// Claim-then-complete, in the transaction.
		req := idem.ClaimRequest{Scope: scope, Key: key + "c", Fingerprint: "fp'\\\x00", Token: "tok'\\\x00",
			Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
		if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
			t.Fatalf("Claim = %v, %v", claimed, err)
		}
		_, ttx, err := s.BeginTx(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := ttx.Complete(ctx, scope, key+"c", req.Token, resp, now, now.Add(time.Hour)); err != nil {
			t.Fatal(err)
		}
		if err := ttx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		checkStored(t, s, scope, key+"c", resp, now)
	}
}

func checkStored(t *testing.T, s *mysqlstore.Store, scope, key string, want *idem.Response, now time.Time) {
	t.Helper()
	rec, err := s.Get(ctxFor(t), scope, key, now)
	if err != nil {
		t.Fatalf("Get(%q, %q): %v", scope, key, err)
	}
	got := rec.Response
	if rec.Scope != scope || rec.Key != key || got == nil || got.Status != want.Status || !bytes.Equal(got.Body, want.Body) ||
		got.Body == nil || got.Ref != want.Ref || got.Header.Get("Location") != want.Header.Get("Location") {
		t.Fatalf("stored (%q, %q) = %+v, want %+v", rec.Scope, rec.Key, got, want)
	}
}
