package pgstore_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// isolationLevels are every level PostgreSQL offers (READ UNCOMMITTED is READ
// COMMITTED there).
var isolationLevels = []string{"read committed", "repeatable read", "serializable"}

// isoPool opens a pool on db's database whose sessions default to isolation
// level (as ALTER ROLE … SET default_transaction_isolation would).
func isoPool(t *testing.T, level string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = level
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// countingStore counts the lease renewals that succeeded.
type countingStore struct {
	*pgstore.Store
	renewals atomic.Int64
}

func (s *countingStore) Extend(ctx context.Context, scope, key, token string, now, leaseUntil time.Time) error {
	err := s.Store.Extend(ctx, scope, key, token, now, leaseUntil)
	if err == nil {
		s.renewals.Add(1)
	}
	return err
}

// isoStore is a migrated store on a fresh table of db, on a pool whose
// sessions default to level.
func isoStore(t *testing.T, db *testDB, level string) (*countingStore, *pgxpool.Pool) {
	t.Helper()
	pool := isoPool(t, level, 6)
	s, err := pgstore.New(pool, &pgstore.Config{Table: db.table("records")})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx30(t)); err != nil {
		t.Fatal(err)
	}
	return &countingStore{Store: s}, pool
}

// TestEveryIsolationLevel: at every isolation level, as the session default
// and (claim-then-complete) set by the handler with SET TRANSACTION, in both
// flows, a handler that outlives several lease renewals completes: 201 once,
// its order committed once, and the retry replays it. Under REPEATABLE READ
// and SERIALIZABLE the renewals used to commit an UPDATE of the record row
// after the handler's snapshot, so that the completion failed with 40001
// ("could not serialize access due to concurrent update") on every attempt.
func TestEveryIsolationLevel(t *testing.T) {
	t.Parallel()
	for _, level := range isolationLevels {
		for _, f := range flows {
			for _, how := range []string{"session", "set transaction", "commented set transaction", "set transaction by query"} {
				if how != "session" && f.flow == idem.FlowSingleTx {
					continue // BeginLocked's lookup is the transaction's first statement
				}
				t.Run(strings.ReplaceAll(level, " ", "_")+"/"+f.name+"/"+strings.ReplaceAll(how, " ", "_"), func(t *testing.T) {
					t.Parallel()
					set := ""
					switch how {
					case "set transaction":
						set = "SET TRANSACTION ISOLATION LEVEL " + level
					case "set transaction by query":
						set = "query:SET TRANSACTION ISOLATION LEVEL " + level
					case "commented set transaction":
						set = "-- raise the level\n  /* for this\n order */ set\ttransaction isolation level " + level
					}
					testIsolationLevel(t, level, f.flow, set)
				})
			}
		}
	}
}

// testIsolationLevel runs a handler at level, the session default when set is
// empty, else raised by the handler's statement set.
func testIsolationLevel(t *testing.T, level string, flow idem.Flow, set string) {
	setTx := set != ""
	db := newTestDB(t, 2)
	sessionLevel := level
	if setTx {
		sessionLevel = "read committed"
	}
	s, pool := isoStore(t, db, sessionLevel)
	orders := pgx.Identifier{db.schema, "orders"}.Sanitize()
	if _, err := pool.Exec(ctx30(t), `CREATE TABLE `+orders+` (id bigserial PRIMARY KEY, idem_key text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	mw, err := idem.New(s, &idem.Config{Flow: flow, Lease: 300 * time.Millisecond, HandlerTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		ctx := r.Context()
		tx := pgstore.Tx(ctx)
		if setTx {
			var err error
			if q, ok := strings.CutPrefix(set, "query:"); ok {
				var rows pgx.Rows
				if rows, err = tx.Query(ctx, q); err == nil {
					rows.Close()
					err = rows.Err()
				}
			} else {
				_, err = tx.Exec(ctx, set)
			}
			if err != nil {
				http.Error(w, "set transaction: "+err.Error(), 500)
				return
			}
		}
		var got string
		if err := tx.QueryRow(ctx, "SHOW transaction_isolation").Scan(&got); err != nil || got != level {
			http.Error(w, fmt.Sprintf("transaction_isolation %q (%v), want %q", got, err, level), 500)
			return
		}
		_, key, _ := idem.KeyFrom(ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO `+orders+` (idem_key) VALUES ($1)`, key); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if flow == idem.FlowClaimComplete {
			// Outlive two renewals (every Lease/3); gated on the renewals
			// themselves, not on a sleep.
			start := s.renewals.Load()
			for deadline := time.Now().Add(30 * time.Second); s.renewals.Load() < start+2; time.Sleep(5 * time.Millisecond) {
				if time.Now().After(deadline) {
					http.Error(w, "no lease renewal within 30 s", 500)
					return
				}
			}
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, "created")
	})))
	t.Cleanup(srv.Close)
	key := "iso-" + randomHex(4)
	first := post(srv.URL+"/orders", key, []byte("{}"))
	if first.err != nil || first.status != http.StatusCreated {
		t.Fatalf("first: %d %s %v, want 201", first.status, first.body, first.err)
	}
	again := post(srv.URL+"/orders", key, []byte("{}"))
	if again.status != http.StatusCreated || !again.replayed || string(again.body) != "created" {
		t.Fatalf("retry: %d %s (replayed %v), want the 201 replayed", again.status, again.body, again.replayed)
	}
	var n int
	if err := pool.QueryRow(ctx30(t), `SELECT count(*) FROM `+orders+` WHERE idem_key = $1`, key).Scan(&n); err != nil || n != 1 || runs.Load() != 1 {
		t.Fatalf("%d orders (%v), %d runs; want 1 and 1", n, err, runs.Load())
	}
	assertNoSessionLocks(t, pool)
}

// assertNoSessionLocks checks that no connection of pool holds an advisory
// lock once it is idle.
func assertNoSessionLocks(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); pool.Stat().AcquiredConns() != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d connections still acquired", pool.Stat().AcquiredConns())
		}
	}
	for _, c := range pool.AcquireAllIdle(ctx30(t)) {
		var n int
		err := c.Conn().QueryRow(ctx30(t), `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()`).Scan(&n)
		st := c.Conn().PgConn().TxStatus()
		c.Release()
		if err != nil || n != 0 || st != 'I' {
			t.Fatalf("an idle pooled connection holds %d advisory locks (%v), transaction status %q", n, err, st)
		}
	}
}

// TestHandlerSerializationFailureIsAConflict: a statement of the handler fails
// with a serialization failure (REPEATABLE READ, a row updated by a concurrent
// transaction after the handler read it). The handler answers 500, as
// handlers do with an unexpected error — but nothing committed and running it
// again may well succeed: 503 idempotency_transaction_conflict with
// Retry-After and the key released, never the 500 kept and replayed. The
// retry then succeeds. Both flows.
func TestHandlerSerializationFailureIsAConflict(t *testing.T) {
	t.Parallel()
	for _, f := range flows {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 2)
			s, pool := isoStore(t, db, "repeatable read")
			acct := pgx.Identifier{db.schema, "acct"}.Sanitize()
			if _, err := pool.Exec(ctx30(t), `CREATE TABLE `+acct+` (id int PRIMARY KEY, balance int NOT NULL); INSERT INTO `+acct+` VALUES (1, 100)`); err != nil {
				t.Fatal(err)
			}
			var interfere atomic.Bool
			interfere.Store(true)
			mw, err := idem.New(s, &idem.Config{Flow: f.flow})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				ctx := r.Context()
				tx := pgstore.Tx(ctx)
				var balance int
				if err := tx.QueryRow(ctx, `SELECT balance FROM `+acct+` WHERE id = 1`).Scan(&balance); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				if interfere.Swap(false) {
					if _, err := db.pool.Exec(ctx, `UPDATE `+acct+` SET balance = balance + 1 WHERE id = 1`); err != nil {
						http.Error(w, err.Error(), 500)
						return
					}
				}
				if _, err := tx.Exec(ctx, `UPDATE `+acct+` SET balance = $1 WHERE id = 1`, balance-10); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				w.WriteHeader(http.StatusCreated)
			})))
			t.Cleanup(srv.Close)
			key := "conflict-" + randomHex(4)
			a := post(srv.URL+"/pay", key, []byte("{}"))
			if a.err != nil || a.status != http.StatusServiceUnavailable || problemCode(a.body) != idem.CodeTxConflict || a.header.Get("Retry-After") == "" {
				t.Fatalf("first: %d %s (Retry-After %q) %v, want 503 %s with Retry-After", a.status, a.body, a.header.Get("Retry-After"), a.err, idem.CodeTxConflict)
			}
			if b := post(srv.URL+"/pay", key, []byte("{}")); b.status != http.StatusCreated || b.replayed {
				t.Fatalf("retry: %d %s (replayed %v), want a fresh 201", b.status, b.body, b.replayed)
			}
			var balance int
			if err := pool.QueryRow(ctx30(t), `SELECT balance FROM `+acct+` WHERE id = 1`).Scan(&balance); err != nil || balance != 91 {
				t.Fatalf("balance %d (%v), want 91: the interfering +1, then one -10", balance, err)
			}
		})
	}
}

// SET TRANSACTION after the handler's first statement: PostgreSQL refuses it
// (25001, it must come before any query) and the transaction is aborted; it
// must not roll back what the handler wrote and carry on in a fresh
// transaction, which would commit a 201 whose order is gone.
func TestLateSetTransactionLosesNothing(t *testing.T) {
	t.Parallel()
	for _, level := range []string{"repeatable read", "serializable"} {
		t.Run(strings.ReplaceAll(level, " ", "_"), func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 2)
			s, pool := isoStore(t, db, "read committed")
			orders := pgx.Identifier{db.schema, "orders"}.Sanitize()
			if _, err := pool.Exec(ctx30(t), `CREATE TABLE `+orders+` (id bigserial PRIMARY KEY, idem_key text NOT NULL)`); err != nil {
				t.Fatal(err)
			}
			mw, err := idem.New(s, &idem.Config{Flow: idem.FlowClaimComplete})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				ctx := r.Context()
				tx := pgstore.Tx(ctx)
				_, key, _ := idem.KeyFrom(ctx)
				if _, err := tx.Exec(ctx, `INSERT INTO `+orders+` (idem_key) VALUES ($1)`, key); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				if _, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL "+strings.ToUpper(level)); err != nil {
					http.Error(w, "set transaction: "+err.Error(), 500)
					return
				}
				w.WriteHeader(http.StatusCreated)
			})))
			t.Cleanup(srv.Close)
			key := "late-" + randomHex(4)
			got := post(srv.URL+"/orders", key, []byte("{}"))
			if got.err != nil {
				t.Fatal(got.err)
			}
			var n int
			if err := pool.QueryRow(ctx30(t), `SELECT count(*) FROM `+orders+` WHERE idem_key = $1`, key).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if got.status == http.StatusCreated && n != 1 {
				t.Fatalf("answer 201 with %d orders committed: the handler's insert was rolled back by a SET TRANSACTION sent after it", n)
			}
			if got.status != http.StatusInternalServerError || !strings.Contains(string(got.body), "25001") || !strings.Contains(string(got.body), "first statement") || n != 0 {
				t.Fatalf("answer %d %s with %d orders; want the handler's 500 naming PostgreSQL's refusal (25001) and nothing committed", got.status, got.body, n)
			}
			assertNoSessionLocks(t, pool)
		})
	}
}

// In the single-transaction flow idem's lookup is the transaction's first
// statement, so PostgreSQL refuses a handler's SET TRANSACTION: the error says
// so and what to do (claim-then-complete, or the session default), and nothing
// commits.
func TestSetTransactionInSingleTxIsExplained(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 2)
	s, pool := isoStore(t, db, "read committed")
	orders := pgx.Identifier{db.schema, "orders"}.Sanitize()
	if _, err := pool.Exec(ctx30(t), `CREATE TABLE `+orders+` (id bigserial PRIMARY KEY, idem_key text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	mw, err := idem.New(s, &idem.Config{Flow: idem.FlowSingleTx})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		tx := pgstore.Tx(ctx)
		if _, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE"); err != nil {
			http.Error(w, "set transaction: "+err.Error(), 500)
			return
		}
		_, key, _ := idem.KeyFrom(ctx)
		if _, err := tx.Exec(ctx, `INSERT INTO `+orders+` (idem_key) VALUES ($1)`, key); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	t.Cleanup(srv.Close)
	key := "single-" + randomHex(4)
	got := post(srv.URL+"/orders", key, []byte("{}"))
	if got.err != nil {
		t.Fatal(got.err)
	}
	var n int
	if err := pool.QueryRow(ctx30(t), `SELECT count(*) FROM `+orders+` WHERE idem_key = $1`, key).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if got.status != http.StatusInternalServerError || !strings.Contains(string(got.body), "idem.FlowClaimComplete") || !strings.Contains(string(got.body), "25001") || n != 0 {
		t.Fatalf("answer %d %s with %d orders; want the handler's 500 with an error naming claim-then-complete and 25001, nothing committed", got.status, got.body, n)
	}
}
