package mysqlstore_test

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/storetest"
)

// sqlModeDSN sets the session sql_mode of every connection of the pool, through
// go-sql-driver's system-variable DSN parameters.
func sqlModeDSN(mode string) string {
	return "&sql_mode=" + url.QueryEscape("'"+mode+"'")
}

// The claim must not depend on the order in which the server applies the
// assignments of ON DUPLICATE KEY UPDATE: MariaDB's SIMULTANEOUS_ASSIGNMENT (also
// part of sql_mode=ORACLE) makes every assignment see the old row.
// TestConformanceSQLModes runs testConformanceSQLModes with and without multiStatements (see bothModes).
func TestConformanceSQLModes(t *testing.T) { bothModes(t, testConformanceSQLModes) }

func testConformanceSQLModes(t *testing.T) {
	for _, mode := range []string{"SIMULTANEOUS_ASSIGNMENT,STRICT_TRANS_TABLES", "ORACLE"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			db := openDB(t, 24, sqlModeDSN(mode))
			var got string
			if err := db.QueryRowContext(ctxFor(t), "SELECT @@SESSION.sql_mode").Scan(&got); err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(got, "SIMULTANEOUS_ASSIGNMENT") {
				t.Skipf("the server has no SIMULTANEOUS_ASSIGNMENT mode (sql_mode = %q): not MariaDB", got)
			}
			storetest.Run(t, func(t *testing.T) idem.Store { return newStore(t, db) })
		})
	}
}

// The two claim transitions that rewrite an existing row, under
// SIMULTANEOUS_ASSIGNMENT: an expired complete record is replaced whole, and a
// lapsed lease is taken over with the new lease (not the old, lapsed one).
// TestClaimSimultaneousAssignment runs testClaimSimultaneousAssignment with and without multiStatements (see bothModes).
func TestClaimSimultaneousAssignment(t *testing.T) { bothModes(t, testClaimSimultaneousAssignment) }

func testClaimSimultaneousAssignment(t *testing.T) {
	db := openDB(t, 4, sqlModeDSN("SIMULTANEOUS_ASSIGNMENT,STRICT_TRANS_TABLES"))
	var got string
	if err := db.QueryRowContext(ctxFor(t), "SELECT @@SESSION.sql_mode").Scan(&got); err != nil || !strings.Contains(got, "SIMULTANEOUS_ASSIGNMENT") {
		t.Skipf("no SIMULTANEOUS_ASSIGNMENT (sql_mode %q, %v): not MariaDB", got, err)
	}
	s := newStore(t, db)
	ctx := ctxFor(t)
	now := time.Now()

	// Reclaim of an expired complete record.
	old := claimReq("t", "expired", "v1:old", now)
	if _, claimed, err := s.Claim(ctx, old); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	if err := s.Complete(ctx, old.Scope, old.Key, old.Token, &idem.Response{Status: 201, Body: []byte("old")}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	later := now.Add(2 * time.Hour)
	fresh := claimReq("t", "expired", "v1:new", later)
	rec, claimed, err := s.Claim(ctx, fresh)
	if err != nil || !claimed {
		t.Fatalf("reclaim of an expired record = %+v, %v, %v; want claimed", rec, claimed, err)
	}
	rec, err = s.Get(ctx, fresh.Scope, fresh.Key, later)
	if err != nil {
		t.Fatalf("Get after the reclaim: %v", err)
	}
	if rec.State != idem.StateInFlight || rec.Fingerprint != fresh.Fingerprint || !rec.ExpiresAt.Equal(fresh.ExpiresAt.Truncate(time.Microsecond)) ||
		!rec.LeaseUntil.Equal(fresh.LeaseUntil.Truncate(time.Microsecond)) || !rec.CreatedAt.Equal(later.Truncate(time.Microsecond)) || rec.Response != nil {
		t.Errorf("record after the reclaim = %+v, want the new in-flight claim", rec)
	}

	// Takeover of a lapsed lease: the new lease, so a second takeover is refused.
	held := claimReq("t", "lapsed", "v1:same", now)
	if _, claimed, err := s.Claim(ctx, held); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	at := now.Add(2 * time.Minute) // lease lapsed, record live
	taker := claimReq("t", "lapsed", "v1:same", at)
	if _, claimed, err := s.Claim(ctx, taker); err != nil || !claimed {
		t.Fatalf("takeover = %v, %v; want claimed", claimed, err)
	}
	if rec, err := s.Get(ctx, taker.Scope, taker.Key, at); err != nil || !rec.LeaseUntil.Equal(taker.LeaseUntil.Truncate(time.Microsecond)) || !rec.CreatedAt.Equal(now.Truncate(time.Microsecond)) {
		t.Errorf("record after the takeover = %+v, %v; want the taker's lease and the first claim's created_at", rec, err)
	}
	second := claimReq("t", "lapsed", "v1:same", at.Add(time.Second))
	if rec, claimed, err := s.Claim(ctx, second); err != nil || claimed {
		t.Errorf("a second takeover while the first taker's lease is live = %+v, %v, %v; want refused", rec, claimed, err)
	}
}

// Header values that are not valid UTF-8 replay byte for byte, through every
// path that stores a response.
// TestNonUTF8HeadersByteExact runs testNonUTF8HeadersByteExact with and without multiStatements (see bothModes).
func TestNonUTF8HeadersByteExact(t *testing.T) { bothModes(t, testNonUTF8HeadersByteExact) }

func testNonUTF8HeadersByteExact(t *testing.T) {
	db := openDB(t, 4, "")
	s := newStore(t, db)
	ctx := ctxFor(t)
	now := time.Now()
	hdr := http.Header{
		"Location":     {"/files/caf\xe9.pdf"},
		"X-Mixed":      {"ok", "\xff\xfe\x00bin", "caf\u00e9"},
		"Content-Type": {"application/json"},
	}
	check := func(path, key string) {
		t.Helper()
		rec, err := s.Get(ctx, "t", key, now)
		if err != nil {
			t.Fatalf("%s: Get: %v", path, err)
		}
		if rec.Response == nil || fmt.Sprintf("%q", rec.Response.Header) != fmt.Sprintf("%q", hdr) {
			t.Errorf("%s: stored headers = %q, want %q", path, rec.Response.Header, hdr)
		}
	}
	// Store.Complete.
	req := claimReq("t", "plain", "v1:h", now)
	if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	if err := s.Complete(ctx, "t", "plain", req.Token, &idem.Response{Status: 201, Header: hdr}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	check("Complete", "plain")
	// Tx.Complete.
	req = claimReq("t", "tx", "v1:h", now)
	if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	_, tx, err := s.BeginTx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, "t", "tx", req.Token, &idem.Response{Status: 201, Header: hdr}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	check("Tx.Complete", "tx")
	// LockedTx.Insert.
	_, ltx, _, err := s.BeginLocked(ctx, "t", "single", now)
	if err != nil {
		t.Fatal(err)
	}
	rec := completeRecord("t", "single", now, "b")
	rec.Response.Header = hdr
	if err := ltx.Insert(ctx, rec); err != nil {
		t.Fatal(err)
	}
	if err := ltx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	check("LockedTx.Insert", "single")
}

// Records written by earlier versions keep their headers as a JSON object; they
// still read back.
func TestReadsJSONHeaders(t *testing.T) {
	t.Parallel()
	db := openDB(t, 2, "")
	s := newStore(t, db)
	ctx := ctxFor(t)
	now := time.Now()
	_, err := db.ExecContext(ctx, "INSERT INTO `"+s.Table()+"` (`scope`, `key`, `state`, `fingerprint`, `token`, `created_at`, `lease_until`, `expires_at`, `status`, `headers`, `body`)"+
		" VALUES ('t', 'old', 2, 'v1:x', 'tok', ?, ?, ?, 201, ?, 'b')",
		now.UnixMicro(), now.UnixMicro(), now.Add(time.Hour).UnixMicro(), `{"Location":["/orders/1"],"X-A":["\u003c1\u003e","2"]}`)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := s.Get(ctx, "t", "old", now)
	if err != nil {
		t.Fatal(err)
	}
	want := http.Header{"Location": {"/orders/1"}, "X-A": {"<1>", "2"}}
	if fmt.Sprintf("%q", rec.Response.Header) != fmt.Sprintf("%q", want) {
		t.Errorf("headers of an old record = %q, want %q", rec.Response.Header, want)
	}
}

// The longest scope the middleware hands a store (idem.MaxStoredScopeLength bytes,
// here of 4-byte UTF-8 characters) and the longest key (255 bytes) work in every
// statement: claim, complete, get, the single-transaction lock and insert, expiry.
// TestLongestScopeAndKey runs testLongestScopeAndKey with and without multiStatements (see bothModes).
func TestLongestScopeAndKey(t *testing.T) { bothModes(t, testLongestScopeAndKey) }

func testLongestScopeAndKey(t *testing.T) {
	s := newStore(t, openDB(t, 4, ""))
	ctx := ctxFor(t)
	now := time.Now()
	scope := strings.Repeat("\U0001F600", idem.MaxStoredScopeLength/4) // 128 bytes
	if len(scope) != idem.MaxStoredScopeLength {
		t.Fatalf("scope is %d bytes", len(scope))
	}
	wide := strings.Repeat("\U0001F600", mysqlstore.MaxScopeLength/4) // 252 bytes: what the column takes
	key := strings.Repeat("~", idem.DefaultMaxKeyLength)
	for _, sc := range []string{scope, wide} {
		req := claimReq(sc, key, "v1:long", now)
		if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
			t.Fatalf("Claim with a %d-byte scope and a %d-byte key = %v, %v", len(sc), len(key), claimed, err)
		}
		_, tx, err := s.BeginTx(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Complete(ctx, sc, key, req.Token, &idem.Response{Status: 200, Body: []byte("x")}, now, now.Add(time.Hour)); err != nil {
			t.Fatalf("Complete: %v", err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		rec, err := s.Get(ctx, sc, key, now)
		if err != nil || rec.Scope != sc || rec.Key != key || rec.State != idem.StateComplete {
			t.Fatalf("Get = %+v, %v", rec, err)
		}
		// A different key in the same long scope is its own record.
		if _, err := s.Get(ctx, sc, key[:254]+"!", now); !errors.Is(err, idem.ErrNotFound) {
			t.Fatalf("Get of another key = %v, want ErrNotFound", err)
		}
		_, ltx, rec, err := s.BeginLocked(ctx, sc, key+"", now.Add(2*time.Hour))
		if err != nil || rec != nil {
			t.Fatalf("BeginLocked after expiry = %+v, %v", rec, err)
		}
		if err := ltx.Insert(ctx, completeRecord(sc, key, now.Add(2*time.Hour), "y")); err != nil {
			t.Fatalf("Insert replacing the expired record: %v", err)
		}
		if err := ltx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if rec, err := s.Get(ctx, sc, key, now.Add(2*time.Hour)); err != nil || string(rec.Response.Body) != "y" {
			t.Fatalf("Get after the single-transaction insert = %+v, %v", rec, err)
		}
	}
}

// A handled SQL error in the handler's transaction (a duplicate key it answers 409
// for, a string the column refuses that it answers 422 for) does not end the
// transaction on MySQL/MariaDB: the answer is stored and replayed, and the
// handler's other writes commit with it. No retryable 5xx.
// TestHandledSQLErrorIsStored runs testHandledSQLErrorIsStored with and without multiStatements (see bothModes).
func TestHandledSQLErrorIsStored(t *testing.T) { bothModes(t, testHandledSQLErrorIsStored) }

func testHandledSQLErrorIsStored(t *testing.T) {
	db := openDB(t, 8, "")
	s := newStore(t, db)
	orders := randomName("uorders_")
	dropAtEnd(t, db, orders)
	if _, err := db.ExecContext(ctxFor(t), "CREATE TABLE `"+orders+"` (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, item VARCHAR(20) CHARACTER SET utf8mb4 NOT NULL UNIQUE) ENGINE=InnoDB"); err != nil {
		t.Fatal(err)
	}
	audit := ordersTable(t, db)
	if _, err := db.ExecContext(ctxFor(t), "INSERT INTO `"+orders+"` (item) VALUES ('taken')"); err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	srv := newServer(t, s, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		tx := mysqlstore.Tx(r.Context())
		item, _ := io.ReadAll(r.Body)
		if _, err := tx.ExecContext(r.Context(), "INSERT INTO `"+audit+"` (item) VALUES ('attempt')"); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		_, err := tx.ExecContext(r.Context(), "INSERT INTO `"+orders+"` (item) VALUES (?)", item)
		switch {
		case err != nil && strings.Contains(err.Error(), "1062"):
			w.WriteHeader(http.StatusConflict)
			_, _ = io.WriteString(w, "exists")
		case err != nil && strings.Contains(err.Error(), "1366"):
			w.WriteHeader(http.StatusUnprocessableEntity)
			_, _ = io.WriteString(w, "bad string")
		case err != nil:
			http.Error(w, err.Error(), 500)
		default:
			w.WriteHeader(http.StatusCreated)
		}
	}))
	for i, tc := range []struct {
		body   string
		status int
	}{{"taken", http.StatusConflict}, {"caf\xe9", http.StatusUnprocessableEntity}} {
		key := randomName("key-")
		for attempt := range 2 {
			req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(tc.body))
			req.Header.Set("Idempotency-Key", key)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			replayed := resp.Header.Get("Idempotent-Replayed") == "true"
			if resp.StatusCode != tc.status || replayed != (attempt == 1) {
				t.Fatalf("%q attempt %d: %d %s (replayed %v), want %d, replayed on the second", tc.body, attempt, resp.StatusCode, b, replayed, tc.status)
			}
		}
		if n := runs.Load(); int(n) != i+1 {
			t.Fatalf("the handler ran %d times for %d keys", n, i+1)
		}
	}
	if n := countOrders(t, db, audit, "attempt"); n != 2 {
		t.Errorf("%d audit rows committed with the stored error answers, want 2", n)
	}
}
