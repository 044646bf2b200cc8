package sqlitestore_test

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// pausingStore stops the first BeginTx until the test lets it go: the moment
// between a committed claim and the transaction that runs the handler. It is the
// only moment another request can take a SQLite claim over, because from BeginTx
// on the holder's transaction has the database's one write lock (see
// TestNoTakeoverDuringTransaction).
type pausingStore struct {
	*sqlitestore.Store
	once    sync.Once
	paused  chan struct{} // closed when the first BeginTx waits
	proceed chan struct{} // closed by the test to let it go on
}

func (p *pausingStore) BeginTx(ctx context.Context) (context.Context, idem.Tx, error) {
	p.once.Do(func() {
		close(p.paused)
		<-p.proceed
	})
	return p.Store.BeginTx(ctx)
}

// A request whose lease lapsed and was taken over cannot commit its order: the
// fenced completion in its transaction fails, the transaction rolls back, and
// the client hears 409 idempotency_lease_lost. The taker commits its order once.
func TestFencedCompletion(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	createOrders(t, db)
	store := newStore(t, db)
	ps := &pausingStore{Store: store, paused: make(chan struct{}), proceed: make(chan struct{})}
	srv := serve(t, ps, &idem.Config{Lease: time.Minute, Flow: idem.FlowClaimComplete}, orderHandler(nil))

	const key = "fenced-key"
	first := make(chan answer, 1)
	go func() { first <- post(t, srv.URL, key, "from-first") }()
	select {
	case <-ps.paused:
	case <-time.After(30 * time.Second):
		t.Fatal("the first request never reached BeginTx")
	}

	// The first request holds the key; take it over as a request arriving after its
	// lease lapsed would.
	ctx := context.Background()
	held, err := store.Get(ctx, "", key, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	later := held.LeaseUntil.Add(time.Millisecond)
	taker := idem.ClaimRequest{Scope: "", Key: key, Fingerprint: held.Fingerprint, Token: "taker-token",
		Now: later, LeaseUntil: later.Add(time.Minute), ExpiresAt: later.Add(time.Hour)}
	if _, claimed, err := store.Claim(ctx, taker); err != nil || !claimed {
		t.Fatalf("takeover claim = %v, %v; want claimed", claimed, err)
	}

	// Let the first request go on: its handler inserts its order, but cannot
	// complete under its lost token.
	close(ps.proceed)
	var a answer
	select {
	case a = <-first:
	case <-time.After(30 * time.Second):
		t.Fatal("the first request did not finish")
	}
	if a.status != http.StatusConflict || problemCode(a.body) != idem.CodeLeaseLost {
		t.Fatalf("the overtaken request got %d %s, want 409 %s", a.status, a.body, idem.CodeLeaseLost)
	}
	if got := countOrders(t, db); got != 0 {
		t.Fatalf("%d orders after the overtaken request, want 0: its transaction must roll back", got)
	}

	// The taker runs its own transaction and completes under its token.
	tctx, tx, err := store.BeginTx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sqlitestore.Tx(tctx).ExecContext(tctx, `INSERT INTO orders (item) VALUES ('from-taker')`); err != nil {
		t.Fatal(err)
	}
	resp := &idem.Response{Status: http.StatusCreated, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"item":"from-taker"}`)}
	if err := tx.Complete(tctx, "", key, taker.Token, resp, later, later.Add(time.Hour)); err != nil {
		t.Fatalf("the taker's completion: %v", err)
	}
	if err := tx.Commit(tctx); err != nil {
		t.Fatal(err)
	}
	_ = tx.Rollback(tctx) // safe after Commit

	var items []string
	rows, err := db.Query(`SELECT item FROM orders`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var it string
		_ = rows.Scan(&it)
		items = append(items, it)
	}
	rows.Close()
	if len(items) != 1 || items[0] != "from-taker" {
		t.Fatalf("orders = %q, want exactly the taker's", items)
	}
	if a := post(t, srv.URL, key, "from-first"); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "true" || a.body != string(resp.Body) {
		t.Errorf("a retry got %d %q, want the taker's outcome replayed", a.status, a.body)
	}
}

// While a handler's transaction is open it holds SQLite's one write lock, so a
// takeover cannot happen, from this process or another, even after the lease
// lapsed: the claim waits for the lock, and once the handler committed, the key
// is complete. Lease renewal waits the same way (see the package documentation).
func TestNoTakeoverDuringTransaction(t *testing.T) {
	t.Parallel()
	path := t.TempDir() + "/idem.db"
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	createOrders(t, db)
	store, err := sqlitestore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	// Another *sql.DB on the file stands for another process.
	otherDB, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = otherDB.Close() })
	other, err := sqlitestore.New(otherDB, nil)
	if err != nil {
		t.Fatal(err)
	}

	inside, release := make(chan struct{}), make(chan struct{})
	srv := serve(t, store, &idem.Config{Lease: 300 * time.Millisecond, Flow: idem.FlowClaimComplete}, orderHandler(func(context.Context) {
		close(inside)
		<-release
	}))
	const key = "held-key"
	first := make(chan answer, 1)
	go func() { first <- post(t, srv.URL, key, "book") }()
	<-inside
	time.Sleep(400 * time.Millisecond) // the lease (300ms, never renewed while the lock is held) has lapsed

	held, err := store.Get(context.Background(), "", key, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if !held.LeaseUntil.Before(time.Now()) {
		t.Fatalf("lease until %v was renewed while the transaction held the write lock", held.LeaseUntil)
	}
	now := time.Now()
	for name, s := range map[string]*sqlitestore.Store{"same process": store, "other process": other} {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		rec, claimed, err := s.Claim(ctx, idem.ClaimRequest{Key: key, Fingerprint: held.Fingerprint, Token: "taker-" + name,
			Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)})
		cancel()
		if claimed || err == nil {
			t.Fatalf("%s: takeover during the holder's transaction = %v, %+v, %v; want it to wait for the lock and fail", name, claimed, rec, err)
		}
		t.Logf("%s: the takeover waited and failed: %v", name, err)
		if name == "same process" && !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s: err = %v, want the context deadline", name, err)
		}
	}
	close(release)
	if a := <-first; a.status != http.StatusCreated {
		t.Fatalf("the holder got %d %s, want 201", a.status, a.body)
	}
	rec, claimed, err := other.Claim(context.Background(), idem.ClaimRequest{Key: key, Fingerprint: held.Fingerprint, Token: "late",
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)})
	if err != nil || claimed || rec.State != idem.StateComplete {
		t.Fatalf("claim after the holder committed = %v, %v, %v; want the complete record", claimed, rec, err)
	}
	if got := countOrders(t, db); got != 1 {
		t.Fatalf("%d orders, want 1", got)
	}
}
