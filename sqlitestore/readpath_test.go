package sqlitestore_test

import (
	"context"
	"database/sql"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/racetest"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// Many retries of a completed key arriving at once in the single-transaction
// flow are all replays: none of them is taken for the execution in flight
// (409), and none waits for the write lock.
func TestSingleTxConcurrentReplays(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	createOrders(t, db)
	store := newStore(t, db)
	srv := serve(t, store, &idem.Config{Flow: idem.FlowSingleTx}, orderHandler(nil))
	first := post(t, srv.URL, "done", "book")
	if first.status != http.StatusCreated {
		t.Fatalf("first request: %d %s", first.status, first.body)
	}
	const n = 64
	results := racetest.Fire(n, racetest.Post(srv.URL, "done", []byte(`{"item":"book"}`), nil))
	replays := 0
	for _, r := range results {
		switch {
		case r.Err != nil:
			t.Fatalf("request failed: %v", r.Err)
		case r.Status == http.StatusCreated && r.Header.Get(idem.ReplayedHeader) == "true" && string(r.Body) == first.body:
			replays++
		default:
			t.Errorf("retry of a completed key: %d %s, want its replay", r.Status, r.Body)
		}
	}
	if replays != n {
		t.Fatalf("%d of %d concurrent retries replayed", replays, n)
	}
	if got := countOrders(t, db); got != 1 {
		t.Fatalf("%d orders, want 1", got)
	}
}

// blockingHandler is orderHandler that, for the key "held", signals inside once
// its order is inserted (its transaction holds the write lock) and waits for
// release (at most 10 s).
func blockingHandler(t *testing.T) (h http.Handler, inside <-chan struct{}, release func()) {
	in, rel := make(chan struct{}, 1), make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(rel) }) }
	t.Cleanup(release)
	blocking := orderHandler(func(context.Context) {
		in <- struct{}{}
		select {
		case <-rel:
		case <-time.After(10 * time.Second):
		}
	})
	plain := orderHandler(nil)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Idempotency-Key") == "held" {
			blocking.ServeHTTP(w, r)
			return
		}
		plain.ServeHTTP(w, r)
	}), in, release
}

// While one request's handler holds the write lock, the retry of a completed
// key is replayed and a second request for the key in flight hears 409, both
// at once: neither needs the write lock (here LockTimeout would turn a wait for
// it into a 503), in either flow.
func TestAnswersWithoutTheWriteLock(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			db := openDB(t)
			createOrders(t, db)
			store, err := sqlitestore.New(db, &sqlitestore.Config{Table: "idem_" + randomHex(6), LockTimeout: 5 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			if err := store.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			h, inside, release := blockingHandler(t)
			srv := serve(t, store, &idem.Config{Flow: flow}, h)
			if a := post(t, srv.URL, "complete", "lamp"); a.status != http.StatusCreated {
				t.Fatalf("first request: %d %s", a.status, a.body)
			}

			holder := make(chan answer, 1)
			go func() { holder <- post(t, srv.URL, "held", "book") }()
			<-inside // the holder's transaction is open now, holding the write lock
			replay := post(t, srv.URL, "complete", "lamp")
			conflict := post(t, srv.URL, "held", "book")
			select {
			case a := <-holder:
				t.Fatalf("the holder answered %d before the other requests were answered: they waited for its write lock", a.status)
			default:
			}
			release()
			if a := <-holder; a.status != http.StatusCreated {
				t.Fatalf("holder: %d %s", a.status, a.body)
			}
			if replay.status != http.StatusCreated || replay.header.Get(idem.ReplayedHeader) != "true" {
				t.Errorf("retry of the completed key while the lock was held: %d %s, want its replay", replay.status, replay.body)
			}
			if conflict.status != http.StatusConflict || problemCode(conflict.body) != idem.CodeKeyInUse {
				t.Errorf("second request for the key in flight: %d %s, want 409", conflict.status, conflict.body)
			}
		})
	}
}

// Two Stores on one *sql.DB and one table (two middlewares, say) know each
// other's single-transaction requests in flight: a second request for the key
// hears 409 at once, rather than waiting for the write lock.
func TestSingleTxInFlightAcrossStores(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	createOrders(t, db)
	table := "idem_" + randomHex(6)
	var stores [2]*sqlitestore.Store
	for i := range stores {
		s, err := sqlitestore.New(db, &sqlitestore.Config{Table: table, LockTimeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		stores[i] = s
	}
	h, inside, release := blockingHandler(t)
	cfg := &idem.Config{Flow: idem.FlowSingleTx}
	srvA, srvB := serve(t, stores[0], cfg, h), serve(t, stores[1], cfg, h)
	holder := make(chan answer, 1)
	go func() { holder <- post(t, srvA.URL, "held", "book") }()
	<-inside
	second := post(t, srvB.URL, "held", "book")
	select {
	case a := <-holder:
		t.Fatalf("the holder answered %d before the second request: it waited for the write lock", a.status)
	default:
	}
	release()
	if a := <-holder; a.status != http.StatusCreated {
		t.Fatalf("holder: %d %s", a.status, a.body)
	}
	if second.status != http.StatusConflict || problemCode(second.body) != idem.CodeKeyInUse {
		t.Fatalf("second request through the other Store: %d %s, want 409", second.status, second.body)
	}
	if got := countOrders(t, db); got != 1 {
		t.Fatalf("%d orders, want 1", got)
	}
}

// openWith opens the database file at path with embedded's DSN changed by edit
// (a driver set up otherwise).
func openWith(t *testing.T, path string, edit func(dsn string) string) *sql.DB {
	t.Helper()
	db, err := sql.Open(embedded.DriverName, edit(embedded.DSN(path)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// With a driver whose BEGIN is deferred, BeginLocked still holds the write lock
// when it returns: another process's write fails (here after a 50 ms busy
// timeout) until the transaction ends.
func TestBeginLockedHoldsTheLockWithDeferredBegin(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	first, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	createOrders(t, first)
	_ = first.Close()
	deferred := openWith(t, path, func(dsn string) string { return strings.Replace(dsn, "&_txlock=immediate", "", 1) })
	if !strings.Contains(embedded.DSN(path), "&_txlock=immediate") || !strings.Contains(embedded.DSN(path), "busy_timeout(10000)") {
		t.Fatal("embedded.DSN no longer sets _txlock=immediate: fix this test's DSN edits")
	}
	other := openWith(t, path, func(dsn string) string { return strings.Replace(dsn, "busy_timeout(10000)", "busy_timeout(50)", 1) })
	store := newStore(t, deferred)
	ctx := context.Background()
	for _, key := range []string{"absent", "absent-again"} {
		_, tx, rec, err := store.BeginLocked(ctx, "", key, time.Now())
		if err != nil || rec != nil {
			t.Fatalf("BeginLocked = %v, %v", rec, err)
		}
		if _, err := other.Exec(`INSERT INTO orders (item) VALUES ('other')`); err == nil {
			t.Fatal("another process wrote while BeginLocked's transaction was open: it does not hold the write lock")
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := other.Exec(`INSERT INTO orders (item) VALUES ('other')`); err != nil {
			t.Fatalf("write after the rollback: %v", err)
		}
	}
}

// A record another process commits while BeginLocked waits for the write lock
// (after its first read found nothing) is found in the transaction: BeginLocked
// returns it, and the handler does not run again.
func TestBeginLockedFindsRecordWrittenWhileWaiting(t *testing.T) {
	t.Parallel()
	db, counts := openCountingDB(t)
	store := newStore(t, db)
	path := ""
	if err := db.QueryRow(`SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&path); err != nil {
		t.Fatal(err)
	}
	otherDB, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = otherDB.Close() })
	other, err := sqlitestore.New(otherDB, &sqlitestore.Config{Table: store.Table()})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	now := time.Now()
	_, otx, rec, err := other.BeginLocked(ctx, "", "k", now)
	if err != nil || rec != nil {
		t.Fatalf("other process: BeginLocked = %v, %v", rec, err)
	}
	if err := otx.Insert(ctx, &idem.Record{Key: "k", State: idem.StateComplete, Fingerprint: "v1:x", Token: "t",
		CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(time.Hour), Response: &idem.Response{Status: 201, Body: []byte("theirs")}}); err != nil {
		t.Fatal(err)
	}
	start := counts.snapshot()
	type result struct {
		rec *idem.Record
		err error
	}
	got := make(chan result, 1)
	go func() {
		_, tx, rec, err := store.BeginLocked(ctx, "", "k", now)
		if tx != nil {
			_ = tx.Rollback(ctx)
		}
		got <- result{rec, err}
	}()
	// The first read (one statement) found nothing; BEGIN (the second) waits for
	// the other process's lock.
	for deadline := time.Now().Add(10 * time.Second); counts.snapshot().sub(start).stmts < 2; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("BeginLocked ran %d statements in 10 s, want a read and then a BEGIN waiting for the lock", counts.snapshot().sub(start).stmts)
		}
	}
	time.Sleep(20 * time.Millisecond)
	if err := otx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-got
	if r.err != nil || r.rec == nil || r.rec.State != idem.StateComplete || string(r.rec.Response.Body) != "theirs" {
		t.Fatalf("BeginLocked after waiting for the other process = %+v, %v; want its complete record", r.rec, r.err)
	}
	if d := counts.snapshot().sub(start); d.begins != 1 {
		t.Fatalf("%d transactions begun, want 1 (the record must be found in the transaction, not by the first read)", d.begins)
	}
}

// A replay, a 409 and a 422 of the single-transaction flow begin no
// transaction: one read answers them.
func TestSingleTxAnswersWithOneRead(t *testing.T) {
	t.Parallel()
	db, counts := openCountingDB(t)
	createOrders(t, db)
	store := newStore(t, db)
	h, inside, release := blockingHandler(t)
	srv := serve(t, store, &idem.Config{Flow: idem.FlowSingleTx}, h)
	if a := post(t, srv.URL, "done", "book"); a.status != http.StatusCreated {
		t.Fatalf("first request: %d %s", a.status, a.body)
	}
	holder := make(chan answer, 1)
	go func() { holder <- post(t, srv.URL, "held", "book") }()
	<-inside
	for _, c := range []struct {
		key, item string
		status    int
	}{{"done", "book", http.StatusCreated}, {"done", "lamp", http.StatusUnprocessableEntity}, {"held", "book", http.StatusConflict}} {
		start := counts.snapshot()
		a := post(t, srv.URL, c.key, c.item)
		d := counts.snapshot().sub(start)
		if a.status != c.status {
			t.Errorf("%s %s: %d %s, want %d", c.key, c.item, a.status, a.body, c.status)
		}
		if d.begins != 0 || d.writes != 0 || d.stmts > 1 {
			t.Errorf("%s %s: %d statements, %d writes, %d transactions; want one read", c.key, c.item, d.stmts, d.writes, d.begins)
		}
	}
	release()
	<-holder
}
