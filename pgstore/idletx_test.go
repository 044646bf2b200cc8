package pgstore_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// idlePool is a pool on testenv.PostgresURL whose sessions carry params as
// session settings (RuntimeParams).
func idlePool(t testing.TB, maxConns int32, params map[string]string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = maxConns
	for k, v := range params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	pool, err := pgxpool.NewWithConfig(ctx30(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestIdleInTransactionTimeout: a handler that sleeps in its transaction past
// the session's idle_in_transaction_session_timeout has its session ended by
// PostgreSQL. Its order is rolled back with it, so the request must not be
// recorded as done; a retry with the same key must execute once and be
// recorded (one order in all).
func TestIdleInTransactionTimeout(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	for _, f := range flows {
		t.Run(f.name, func(t *testing.T) {
			app := newOrderApp(t, db)
			pool := idlePool(t, 4, map[string]string{"idle_in_transaction_session_timeout": "300ms"})
			s, err := pgstore.New(pool, &pgstore.Config{Table: db.table("records")})
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Migrate(ctx30(t)); err != nil {
				t.Fatal(err)
			}
			app.store = s
			var calls atomic.Int64
			h := app.handler("o", func(ctx context.Context) {
				if calls.Add(1) == 1 {
					time.Sleep(1500 * time.Millisecond)
				}
			})
			var errs []error
			var mu sync.Mutex
			obs := idem.ObserverFunc(func(_ context.Context, e idem.Event) {
				if e.Err != nil {
					mu.Lock()
					errs = append(errs, e.Err)
					mu.Unlock()
				}
			})
			srv := httptest.NewServer(app.serve(t, &idem.Config{Flow: f.flow, Observer: obs}, h))
			defer srv.Close()
			first := post(srv.URL, "k1", []byte(`{}`))
			mu.Lock()
			if len(errs) == 0 {
				t.Errorf("no error observed for the first request")
			}
			for _, err := range errs {
				// The store knows nothing was committed, and why.
				if msg := err.Error(); strings.Contains(msg, "may or may not have committed") || !strings.Contains(msg, "nothing was committed") || !strings.Contains(msg, "idle_in_transaction_session_timeout") {
					t.Errorf("observed %v; want it to say that nothing was committed because of idle_in_transaction_session_timeout", err)
				}
			}
			mu.Unlock()
			t.Logf("first: %d %s %v", first.status, first.body, first.err)
			if first.status == 201 {
				t.Errorf("first answer 201 although its transaction was ended by the server")
			}
			if n := app.ordersFor(t, "k1", ""); n != 0 {
				t.Errorf("%d orders after the killed transaction, want 0", n)
			}
			var last answer
			for i := range 5 {
				last = post(srv.URL, "k1", []byte(`{}`))
				t.Logf("retry %d: %d %s %v", i, last.status, last.body, last.err)
				if last.status == 201 {
					break
				}
				time.Sleep(300 * time.Millisecond)
			}
			if last.status != 201 {
				t.Errorf("retry answered %d %s, want 201", last.status, last.body)
			}
			again := post(srv.URL, "k1", []byte(`{}`))
			if again.status != 201 || !again.replayed {
				t.Errorf("replay: %d replayed=%v %s", again.status, again.replayed, again.body)
			}
			if n := app.ordersFor(t, "k1", ""); n != 1 {
				t.Errorf("%d orders, want 1", n)
			}
		})
	}
}

// TestIdleSessionTimeout: PostgreSQL ends pooled sessions that sat idle past
// idle_session_timeout. A request that comes after must still succeed: the
// store must not hand the client an error for a session that died before it
// sent anything.
func TestIdleSessionTimeout(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	for _, f := range flows {
		t.Run(f.name, func(t *testing.T) {
			app := newOrderApp(t, db)
			pool := idlePool(t, 4, map[string]string{"idle_session_timeout": "200ms"})
			s, err := pgstore.New(pool, &pgstore.Config{Table: db.table("records")})
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Migrate(ctx30(t)); err != nil {
				t.Fatal(err)
			}
			app.store = s
			obs := idem.ObserverFunc(func(_ context.Context, e idem.Event) {
				if e.Err != nil {
					t.Logf("event %v: %v", e.Kind, e.Err)
				}
			})
			srv := httptest.NewServer(app.serve(t, &idem.Config{Flow: f.flow, Observer: obs}, app.handler("o", nil)))
			defer srv.Close()
			const n = 8 // twice the pool: every pooled session dies between rounds
			for round := range 4 {
				var wg sync.WaitGroup
				for i := range n {
					key := fmt.Sprintf("k%d-%d", round, i)
					wg.Go(func() {
						a := post(srv.URL, key, []byte(`{}`))
						if a.status != 201 || a.replayed {
							t.Errorf("%s: %d replayed=%v %s %v", key, a.status, a.replayed, a.body, a.err)
						}
					})
				}
				wg.Wait()
				for i := range n {
					key := fmt.Sprintf("k%d-%d", round, i)
					if got := app.ordersFor(t, key, ""); got != 1 {
						t.Errorf("%s: %d orders, want 1", key, got)
					}
					if r := post(srv.URL, key, []byte(`{}`)); r.status != 201 || !r.replayed {
						t.Errorf("%s again: %d replayed=%v %s %v", key, r.status, r.replayed, r.body, r.err)
					}
				}
				time.Sleep(500 * time.Millisecond) // past idle_session_timeout, short of pgxpool's ping after 1s idle
			}
		})
	}
}

// TestTerminatedIdleSessions: the pool's idle sessions are ended by
// pg_terminate_backend (an operator's cleanup, a failover's) while the pool is
// busy, so pgxpool does not ping them before it hands them out (it pings only
// connections idle for more than a second). The requests that come next must
// all execute once: none answers 503 for a session that died before it read
// the request's first statement.
func TestTerminatedIdleSessions(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	for _, f := range flows {
		t.Run(f.name, func(t *testing.T) {
			app := newOrderApp(t, db)
			name := "idem_test_" + randomHex(6)
			pool := idlePool(t, 4, map[string]string{"application_name": name})
			s, err := pgstore.New(pool, &pgstore.Config{Table: db.table("records")})
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Migrate(ctx30(t)); err != nil {
				t.Fatal(err)
			}
			app.store = s
			srv := httptest.NewServer(app.serve(t, &idem.Config{Flow: f.flow}, app.handler("o", nil)))
			defer srv.Close()
			const n = 8 // twice the pool
			for round := range 4 {
				var wg sync.WaitGroup
				for i := range n {
					key := fmt.Sprintf("k%d-%d", round, i)
					wg.Go(func() {
						a := post(srv.URL, key, []byte(`{}`))
						if a.status != 201 || a.replayed {
							t.Errorf("%s: %d replayed=%v %s %v", key, a.status, a.replayed, a.body, a.err)
						}
					})
				}
				wg.Wait()
				for i := range n {
					key := fmt.Sprintf("k%d-%d", round, i)
					if got := app.ordersFor(t, key, ""); got != 1 {
						t.Errorf("%s: %d orders, want 1", key, got)
					}
				}
				// End the pool's sessions, all idle now, and wait until they are gone.
				db.exec(t, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1`, name)
				deadline := time.Now().Add(10 * time.Second)
				for db.count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, name) > 0 && time.Now().Before(deadline) {
					time.Sleep(10 * time.Millisecond)
				}
			}
		})
	}
}

// terminateIdle ends every session whose application_name is name (all idle)
// and waits until they are gone.
func (db *testDB) terminateIdle(t testing.TB, name string) {
	t.Helper()
	db.exec(t, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1`, name)
	deadline := time.Now().Add(10 * time.Second)
	for db.count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, name) > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
}

// TestStepsAfterTerminatedIdleSessions: the step statements (BeginStep,
// FinishStep, GetSteps) succeed on a pool whose idle sessions were all ended
// (pg_terminate_backend) since its last statement.
func TestStepsAfterTerminatedIdleSessions(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 2)
	name := "idem_test_" + randomHex(6)
	pool := idlePool(t, 4, map[string]string{"application_name": name})
	s, err := pgstore.New(pool, &pgstore.Config{Table: db.table("records")})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx30(t)); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	for i := range 4 {
		step := fmt.Sprintf("n%d", i)
		db.terminateIdle(t, name)
		if _, began, err := s.BeginStep(ctx30(t), idem.BeginStepRequest{Scope: "s", Key: "k", Name: step, Owner: "o",
			DerivedKey: "idem_x", Now: now, ExpiresAt: now.Add(time.Hour)}); err != nil || !began {
			t.Fatalf("BeginStep %s: began %v, %v", step, began, err)
		}
		db.terminateIdle(t, name)
		if err := s.FinishStep(ctx30(t), "s", "k", step, "o", idem.StepDone, []byte("r"), now); err != nil {
			t.Fatalf("FinishStep %s: %v", step, err)
		}
		db.terminateIdle(t, name)
		recs, err := s.GetSteps(ctx30(t), "s", "k", now)
		if err != nil || len(recs) != i+1 {
			t.Fatalf("GetSteps: %d records, %v; want %d", len(recs), err, i+1)
		}
	}
}

// TestListenerOutlivesIdleSessionTimeout: the LISTEN connection of a store
// whose pool sets idle_session_timeout idles by design, between
// notifications; PostgreSQL must not end it every idle_session_timeout (each
// drop wakes every waiter, and reconnects after a growing pause during which
// notifications are missed). The session stays the same, no waiter is woken
// for nothing, and a notification arrives.
func TestListenerOutlivesIdleSessionTimeout(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 2)
	name := "idem_test_" + randomHex(6)
	pool := idlePool(t, 2, map[string]string{"application_name": name, "idle_session_timeout": "300ms"})
	s, err := pgstore.New(pool, &pgstore.Config{Table: db.table("records")})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx30(t)); err != nil {
		t.Fatal(err)
	}
	ch, done, err := s.WatchOutcome(ctx30(t), "s", "k")
	if err != nil {
		t.Fatal(err)
	}
	defer done()
	listenPID := func() int {
		var pid int
		err := db.pool.QueryRow(ctx30(t), `SELECT coalesce(max(pid), 0) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'`, name).Scan(&pid)
		if err != nil {
			t.Fatal(err)
		}
		return pid
	}
	before := listenPID()
	time.Sleep(1500 * time.Millisecond) // five idle_session_timeouts
	if after := listenPID(); before == 0 || after != before {
		t.Errorf("LISTEN session %d, then %d: the listener's session was ended and replaced", before, after)
	}
	select {
	case <-ch:
		t.Errorf("the watcher was woken with no notification (the LISTEN connection dropped)")
	default:
	}
	if err := s.NotifyOutcome(ctx30(t), "s", "k"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Errorf("no notification within 10s")
	}
}

// TestListenerReconnectsPromptlyEveryTime: the LISTEN connection is ended
// (pg_terminate_backend) eight times, each after it was back up. Each time it
// must come back after the first short pause, not after one that doubled with
// every drop in the store's life (about 13 s in all for the eight before).
func TestListenerReconnectsPromptlyEveryTime(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 2)
	name := "idem_test_" + randomHex(6)
	pool := idlePool(t, 2, map[string]string{"application_name": name})
	s, err := pgstore.New(pool, &pgstore.Config{Table: db.table("records")})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx30(t)); err != nil {
		t.Fatal(err)
	}
	_, done, err := s.WatchOutcome(ctx30(t), "s", "k")
	if err != nil {
		t.Fatal(err)
	}
	defer done()
	listenPID := func() int {
		var pid int
		err := db.pool.QueryRow(ctx30(t), `SELECT coalesce(max(pid), 0) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'`, name).Scan(&pid)
		if err != nil {
			t.Fatal(err)
		}
		return pid
	}
	start := time.Now()
	pid := listenPID()
	for i := range 8 {
		db.exec(t, `SELECT pg_terminate_backend($1)`, pid)
		deadline := time.Now().Add(30 * time.Second)
		for {
			if p := listenPID(); p != 0 && p != pid {
				pid = p
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("drop %d: the LISTEN connection is not back after 30s", i)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if took := time.Since(start); took > 8*time.Second {
		t.Errorf("eight reconnections took %v: the pause before reconnecting grows with every drop", took)
	}
}

// TestIdleInTransactionTimeoutWithDuplicates: under REPEATABLE READ (the
// claim's transaction holds the key's advisory lock) a handler sleeps in its
// transaction past idle_in_transaction_session_timeout while duplicates with
// its key keep coming. The server ends its session, which frees the lock; no
// duplicate may run alongside and none may get a stored answer for the
// rolled-back order; in the end exactly one order is committed and replayed.
func TestIdleInTransactionTimeoutWithDuplicates(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	for _, iso := range []string{"repeatable read", "read committed"} {
		t.Run(iso, func(t *testing.T) {
			app := newOrderApp(t, db)
			pool := idlePool(t, 8, map[string]string{"idle_in_transaction_session_timeout": "300ms", "default_transaction_isolation": iso})
			s, err := pgstore.New(pool, &pgstore.Config{Table: db.table("records")})
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Migrate(ctx30(t)); err != nil {
				t.Fatal(err)
			}
			app.store = s
			var calls atomic.Int64
			h := app.handler("o", func(ctx context.Context) {
				if calls.Add(1) == 1 {
					time.Sleep(2 * time.Second)
				}
			})
			srv := httptest.NewServer(app.serve(t, &idem.Config{Flow: idem.FlowClaimComplete, Lease: 2 * time.Second}, h))
			defer srv.Close()
			var wg sync.WaitGroup
			var created atomic.Int64
			var bodies sync.Map
			for i := range 12 {
				wg.Go(func() {
					time.Sleep(time.Duration(i) * 250 * time.Millisecond)
					a := post(srv.URL, "k1", []byte(`{}`))
					if a.status == 201 {
						created.Add(1)
						bodies.Store(string(a.body), true)
					} else if a.status != 409 && a.status != 503 {
						t.Errorf("duplicate %d: %d %s", i, a.status, a.body)
					}
				})
			}
			wg.Wait()
			var last answer
			for range 20 {
				if last = post(srv.URL, "k1", []byte(`{}`)); last.status == 201 {
					break
				}
				time.Sleep(300 * time.Millisecond)
			}
			if last.status != 201 {
				t.Fatalf("final: %d %s", last.status, last.body)
			}
			bodies.Store(string(last.body), true)
			n := 0
			bodies.Range(func(_, _ any) bool { n++; return true })
			if n != 1 {
				t.Errorf("%d different 201 bodies, want 1", n)
			}
			if got := app.ordersFor(t, "k1", ""); got != 1 {
				t.Errorf("%d orders, want 1 (%d calls)", got, calls.Load())
			}
		})
	}
}

// TestRefusedConnectionNotRetried: a connection the server refuses to open
// with a FATAL error (here: no such database; also "the database system is
// shutting down") is not a pooled session that died while idle: the store
// does not try again, once per connection of the pool, on a server that
// refuses them all.
func TestRefusedConnectionNotRetried(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Database = "idem_no_such_db_" + randomHex(4)
	cfg.MaxConns = 20
	var dials atomic.Int64
	cfg.BeforeConnect = func(context.Context, *pgx.ConnConfig) error {
		dials.Add(1)
		return nil
	}
	pool, err := pgxpool.NewWithConfig(ctx30(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s, err := pgstore.New(pool, &pgstore.Config{Table: "idem_records"})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	_, _, err = s.Claim(ctx30(t), idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "f", Token: "t", Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)})
	if err == nil {
		t.Fatal("Claim on a database that does not exist succeeded")
	}
	if n := dials.Load(); n > 2 {
		t.Errorf("%d connection attempts for one Claim, want 1 (%v)", n, err)
	}
}
