package consumer_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

func newSQLite(t *testing.T, cfg consumer.Config) (*consumer.Processor, *sqlitestore.Store, *sql.DB) {
	t.Helper()
	db, s := sqliteOrders(t)
	if cfg.Name == "" {
		cfg.Name = "orders"
	}
	p, err := consumer.New(s, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p, s, db
}

// Item 1: every message ID the docs promise (1 to 255 bytes of visible ASCII)
// is processed, however little it looks like an HTTP header token; longer IDs
// are keyed by a digest, and only empty or non-visible IDs are refused, with
// an error that speaks of messages.
func TestMessageIDsOfVisibleASCII(t *testing.T) {
	p, _, db := newSQLite(t, consumer.Config{})
	ctx := context.Background()
	var runs atomic.Int32
	h := func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		runs.Add(1)
		_, err := sqlitestore.Tx(ctx).ExecContext(ctx, `INSERT INTO orders VALUES (?)`, m.ID)
		return []byte(m.ID), err
	}
	long := strings.Repeat("x", 300)
	valid := []string{
		"q83vEjRWeJA=", "<id@host>", "<1234.5678@mail.example.com>", "order=42", "{a:1}", "(paren)",
		`"quoted"`, `back\slash`, "a,b;c", "~!@#$%^&*", strings.Repeat("z", 255),
		long, long[:299] + "y", "sha256:" + strings.Repeat("0", 64), "sha256:short",
	}
	for _, id := range valid {
		out := p.Process(ctx, &consumer.Message{ID: id, Payload: []byte("p"), Delivery: 1}, h)
		if out.Action != consumer.Ack || out.Reason != consumer.Executed || string(out.Result) != id {
			t.Fatalf("ID %q: %+v; want it executed", id, out)
		}
		if out := p.Process(ctx, &consumer.Message{ID: id, Payload: []byte("p"), Delivery: 2}, h); out.Reason != consumer.Duplicate {
			t.Fatalf("ID %q again: %+v; want a duplicate", id, out)
		}
	}
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(DISTINCT msg_id) FROM orders`).Scan(&n); err != nil || n != len(valid) || int(runs.Load()) != len(valid) {
		t.Fatalf("%d distinct rows, %d runs (%v); want %d each", n, runs.Load(), err, len(valid))
	}
	for _, id := range []string{"", "a b", " lead", "caf\u00e9", "nul\x00", "del\x7f"} {
		out := p.Process(ctx, &consumer.Message{ID: id, Payload: []byte("p")}, h)
		if out.Action != consumer.DeadLetter || out.Reason != consumer.InvalidID {
			t.Fatalf("ID %q: %+v; want invalid_id", id, out)
		}
		if e := out.Err.Error(); strings.Contains(e, "quoted") || strings.Contains(e, "Idempotency-Key") || !strings.Contains(e, "message") {
			t.Fatalf("ID %q: error %q should speak of message IDs, not of HTTP keys", id, e)
		}
	}
	if k1, _ := consumer.Key(long); len(k1) != 71 || !strings.HasPrefix(k1, "sha256:") {
		t.Fatalf("Key of a 300-byte ID = %q; want its digest", k1)
	}
}

// httpStoredForm reports whether s can be the stored form of an HTTP scope:
// the range of idem.StoredScope.
func httpStoredForm(s string) bool {
	if strings.HasPrefix(s, "sha256:") {
		h := s[len("sha256:"):]
		return len(h) == 64 && strings.Trim(h, "0123456789abcdef") == ""
	}
	return idem.StoredScope(s) == s
}

// Item 2: a consumer's records never share a scope with an HTTP tenant's,
// whatever scope the tenant has: a tenant named like the consumer, sending the
// message's ID as its Idempotency-Key through the middleware on the same store
// and table, and the consumer both run once, neither is a mismatch.
func TestConsumerScopeIsNoHTTPScope(t *testing.T) {
	p, s, _ := newSQLite(t, consumer.Config{Name: "orders-worker", Scope: func(m *consumer.Message) string {
		if v := m.Header["Tenant"]; len(v) > 0 {
			return v[0]
		}
		return ""
	}})
	for _, name := range []string{"orders-worker", "a/b", strings.Repeat("n", 200), "sha256:x"} {
		for _, tenant := range []string{"", "t1", "x/y", strings.Repeat("t", 200)} {
			st := consumer.StoredScope(name, tenant)
			if httpStoredForm(st) || len(st) > idem.MaxStoredScopeLength {
				t.Fatalf("StoredScope(%q, %q) = %q is in the HTTP scopes' range", name, tenant, st)
			}
		}
	}
	if consumer.StoredScope("a/b", "c") == consumer.StoredScope("a", "b/c") || consumer.StoredScope("a", "") == consumer.StoredScope("a", "/") {
		t.Fatal("two (name, tenant) pairs share a stored scope")
	}
	var httpRuns atomic.Int32
	hostile := []string{"orders-worker", consumer.StoredScope("orders-worker", ""), consumer.StoredScope("orders-worker", "t1"), "sha256:consumer:orders-worker"}
	var scope atomic.Value
	mw, err := idem.New(s, &idem.Config{ScopeFunc: func(*http.Request) string { return scope.Load().(string) }})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		httpRuns.Add(1)
		_, _ = io.WriteString(w, "http")
	})))
	defer srv.Close()
	ctx := context.Background()
	for i, sc := range hostile {
		scope.Store(sc)
		key := fmt.Sprintf("o-%d", i)
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(`{"cart_id":"c_1"}`))
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("HTTP scope %q: status %d", sc, resp.StatusCode)
		}
		hdr := map[string][]string{}
		if i == 2 {
			hdr["Tenant"] = []string{"t1"}
		}
		out := p.Process(ctx, &consumer.Message{ID: key, Payload: []byte(`{"cart_id":"c_1"}`), Delivery: 1, Header: hdr}, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
			return []byte("msg"), nil
		})
		if out.Reason != consumer.Executed || string(out.Result) != "msg" {
			t.Fatalf("message %s after an HTTP request of scope %q with that key: %+v; want it executed", key, sc, out)
		}
	}
	if httpRuns.Load() != int32(len(hostile)) {
		t.Fatalf("%d HTTP runs", httpRuns.Load())
	}
}

// Item 3: with Config.Scope, two tenants' message "o-1" are two messages, each
// acked as a duplicate only of itself, and a fingerprinted header sent again
// with another value is a mismatch.
func TestTenantsShareNoMessageIDs(t *testing.T) {
	p, _, db := newSQLite(t, consumer.Config{
		Scope:              func(m *consumer.Message) string { return strings.Join(m.Header["Tenant"], ",") },
		FingerprintHeaders: []string{"Tenant", "Priority"},
	})
	ctx := context.Background()
	h := func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		t := m.Header["Tenant"][0]
		_, err := sqlitestore.Tx(ctx).ExecContext(ctx, `INSERT INTO orders VALUES (?)`, t+"/"+m.ID)
		return []byte("order of " + t), err
	}
	msg := func(tenant, prio string, d int) *consumer.Message {
		return &consumer.Message{ID: "o-1", Payload: []byte(`{"cart_id":"c_1"}`), Delivery: d, Header: map[string][]string{"Tenant": {tenant}, "Priority": {prio}}}
	}
	if out := p.Process(ctx, msg("t1", "low", 1), h); out.Reason != consumer.Executed || string(out.Result) != "order of t1" {
		t.Fatalf("t1: %+v", out)
	}
	if out := p.Process(ctx, msg("t2", "low", 1), h); out.Reason != consumer.Executed || string(out.Result) != "order of t2" {
		t.Fatalf("t2's o-1: %+v; want it executed with t2's order, not acked as t1's", out)
	}
	if out := p.Process(ctx, msg("t1", "low", 2), h); out.Reason != consumer.Duplicate || string(out.Result) != "order of t1" {
		t.Fatalf("t1's o-1 again: %+v", out)
	}
	if out := p.Process(ctx, msg("t1", "high", 1), h); out.Reason != consumer.Mismatch {
		t.Fatalf("t1's o-1 with another Priority: %+v; want a mismatch", out)
	}
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil || n != 2 {
		t.Fatalf("%d orders (%v); want 2", n, err)
	}
}

// deferredTarget opens a store and a table with a constraint checked only at
// COMMIT, and returns a handler that violates it: the database refuses every
// commit of that handler's transaction.
func deferredTarget(t *testing.T, kind string) (idem.Store, consumer.Handler) {
	t.Helper()
	ctx := context.Background()
	sfx := fmt.Sprint(time.Now().UnixNano())
	switch kind {
	case "postgres":
		pool, err := pgxpool.New(ctx, testenv.PostgresURL(t))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		s, err := pgstore.New(pool, &pgstore.Config{Table: "cons_def_rec_" + sfx})
		if err == nil {
			err = s.Migrate(ctx)
		}
		tbl := "cons_def_" + sfx
		if err == nil {
			_, err = pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s (v INT, CONSTRAINT %s_u UNIQUE (v) DEFERRABLE INITIALLY DEFERRED); INSERT INTO %s VALUES (1)`, tbl, tbl, tbl))
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_, _ = pool.Exec(context.Background(), fmt.Sprintf(`DROP TABLE IF EXISTS %s; DROP TABLE IF EXISTS cons_def_rec_%s`, tbl, sfx))
		})
		return s, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
			_, err := pgstore.Tx(ctx).Exec(ctx, fmt.Sprintf(`INSERT INTO %s VALUES (1)`, tbl))
			return nil, err
		}
	default:
		db, err := embedded.Open(filepath.Join(t.TempDir(), "d.db"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		s, err := sqlitestore.New(db, nil)
		if err == nil {
			err = s.Migrate(ctx)
		}
		if err == nil {
			_, err = db.ExecContext(ctx, `CREATE TABLE parent (id INTEGER PRIMARY KEY); CREATE TABLE child (pid INTEGER REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED)`)
		}
		if err != nil {
			t.Fatal(err)
		}
		return s, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
			_, err := sqlitestore.Tx(ctx).ExecContext(ctx, `INSERT INTO child VALUES (42)`)
			return nil, err
		}
	}
}

// Item 5: a COMMIT the database refuses (a deferred constraint) is a failed
// delivery: retried under Backoff and dead-lettered at MaxDeliveries, not
// retried as a store outage forever.
func TestRefusedCommitIsAFailedDelivery(t *testing.T) {
	for _, kind := range []string{"postgres", "sqlite"} {
		t.Run(kind, func(t *testing.T) {
			s, h := deferredTarget(t, kind)
			p, err := consumer.New(s, consumer.Config{Name: "def", MaxDeliveries: 3})
			if err != nil {
				t.Fatal(err)
			}
			var runs atomic.Int32
			counted := func(ctx context.Context, m *consumer.Message) ([]byte, error) { runs.Add(1); return h(ctx, m) }
			ctx := context.Background()
			for d := 1; d <= 3; d++ {
				// Delivery 0: the Processor's own count, as under Watermill.
				out := p.Process(ctx, &consumer.Message{ID: "m1", Payload: []byte("x")}, counted)
				want, reason := consumer.Retry, consumer.Failed
				if d == 3 {
					want, reason = consumer.DeadLetter, consumer.Poison
				}
				if out.Action != want || out.Reason != reason {
					t.Fatalf("attempt %d: %+v; want %s (%s)", d, out, want, reason)
				}
			}
			if runs.Load() != 3 {
				t.Fatalf("handler ran %d times; want 3 (MaxDeliveries)", runs.Load())
			}
		})
	}
}

// extendSpy reports when the lease renewal calls Extend and how it ended.
type extendSpy struct {
	*sqlitestore.Store
	started chan struct{}
	once    sync.Once
	errs    chan error
}

func (s *extendSpy) Extend(ctx context.Context, scope, key, token string, now, leaseUntil time.Time) error {
	s.once.Do(func() { close(s.started) })
	err := s.Store.Extend(ctx, scope, key, token, now, leaseUntil)
	select {
	case s.errs <- err:
	default:
	}
	return err
}

// Item 6: with SQLite a renewal that falls due while the handler's transaction
// holds the write lock waits for that lock; the settling of the delivery must
// not wait for that renewal (up to Lease/3) before it commits.
func TestSQLiteCommitDoesNotWaitForRenewal(t *testing.T) {
	_, s := sqliteOrders(t)
	spy := &extendSpy{Store: s, started: make(chan struct{}), errs: make(chan error, 8)}
	// A lease of 6 s: the renewal falls due after 2 s and would wait up to 2 s.
	p, err := consumer.New(spy, consumer.Config{Name: "orders", Lease: 6 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	out := p.Process(ctx, &consumer.Message{ID: "m1", Payload: []byte("x"), Delivery: 1}, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		if _, err := sqlitestore.Tx(ctx).ExecContext(ctx, `INSERT INTO orders VALUES (?)`, m.ID); err != nil {
			return nil, err
		}
		<-spy.started // the renewal is now waiting for the lock this transaction holds
		time.Sleep(50 * time.Millisecond)
		return nil, nil
	})
	if out.Reason != consumer.Executed {
		t.Fatalf("%+v", out)
	}
	select {
	case err := <-spy.errs:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("the renewal ended with %v; want it cancelled when the handler returned, not waited for", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the renewal never returned")
	}
}

// clock is an injected clock.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time      { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// Item 7: attempts are counted in the store, where they survive a crash: a
// message whose every delivery crashes its consumer (the claim left in flight,
// taken over once its lease lapsed) is dead-lettered unrun after
// MaxDeliveries attempts, also where the broker counts nothing (Delivery 0,
// Watermill) or restarts its count at 1.
func TestCrashLoopCountedInTheStore(t *testing.T) {
	_, s := sqliteOrders(t)
	c := &clock{t: time.Now()}
	const lease = time.Minute
	p, err := consumer.New(s, consumer.Config{Name: "orders", Lease: lease, MaxDeliveries: 3, NowFunc: c.now})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	payload := []byte("x")
	// crash leaves what a consumer killed mid-handler leaves: the claim, in flight.
	crash := func(i int) {
		now := c.now()
		_, claimed, err := s.Claim(ctx, idem.ClaimRequest{Scope: consumer.StoredScope("orders", ""), Key: "m1", Fingerprint: consumer.Fingerprint(payload),
			Token: fmt.Sprintf("crashed-holder-%02d-xxxxxxxxxx", i), Now: now, LeaseUntil: now.Add(lease), ExpiresAt: now.Add(24 * time.Hour)})
		if err != nil || !claimed {
			t.Fatalf("crash %d: claimed %v, %v", i, claimed, err)
		}
		c.add(lease + time.Second)
	}
	var runs atomic.Int32
	crashing := func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		runs.Add(1)
		return nil, errors.New("stand-in for the crash: never returns in the real run")
	}
	// First attempt crashes; the second (a takeover) runs and fails; the third
	// crashes; the fourth is past MaxDeliveries.
	crash(0)
	if out := p.Process(ctx, &consumer.Message{ID: "m1", Payload: payload}, crashing); out.Reason != consumer.Failed {
		t.Fatalf("attempt 2: %+v; want a failed delivery", out)
	}
	crash(1) // attempt 3, restarted process: the broker says delivery 1 again
	out := p.Process(ctx, &consumer.Message{ID: "m1", Payload: payload, Delivery: 1}, crashing)
	if out.Action != consumer.DeadLetter || out.Reason != consumer.Poison || runs.Load() != 1 {
		t.Fatalf("attempt 4: %+v after %d runs; want it dead-lettered unrun (attempts 1 and 3 crashed, 2 failed)", out, runs.Load())
	}
	// Once dead-lettered, a republished copy gets its attempts again.
	if err := p.DeadLettered(ctx, &consumer.Message{ID: "m1", Payload: payload}, out); err != nil {
		t.Fatal(err)
	}
	if out := p.Process(ctx, &consumer.Message{ID: "m1", Payload: payload}, func(context.Context, *consumer.Message) ([]byte, error) { return nil, nil }); out.Reason != consumer.Executed {
		t.Fatalf("republished after dead-lettering: %+v; want it executed", out)
	}
}

// Item 11: a handler that panics with a Permanent error is dead-lettered at
// once, as if it had returned it.
func TestPanicPermanentKeepsTheMark(t *testing.T) {
	p := newMem(t, consumer.Config{})
	out := p.Process(context.Background(), &consumer.Message{ID: "m1", Payload: []byte("x"), Delivery: 1}, func(context.Context, *consumer.Message) ([]byte, error) {
		panic(consumer.Permanent(errors.New("bad order")))
	})
	if out.Action != consumer.DeadLetter || out.Reason != consumer.Poison || !consumer.IsPermanent(out.Err) {
		t.Fatalf("%+v; want dead-lettered as permanent", out)
	}
}

// lostAnswer wraps a store whose Commit answers with an error: after
// committing (the answer lost on the way back), or without committing while
// the store is also unreadable.
type lostAnswer struct {
	*sqlitestore.Store
	commit   bool // commit, then report an error
	readable bool
}

type lostTx struct {
	idem.Tx
	s *lostAnswer
}

func (s *lostAnswer) BeginTx(ctx context.Context) (context.Context, idem.Tx, error) {
	ctx, tx, err := s.Store.BeginTx(ctx)
	if err != nil {
		return ctx, tx, err
	}
	return ctx, &lostTx{tx, s}, nil
}

func (t *lostTx) Commit(ctx context.Context) error {
	if t.s.commit {
		if err := t.Tx.Commit(ctx); err != nil {
			return err
		}
	} else {
		_ = t.Tx.Rollback(ctx)
	}
	return errors.New("read tcp 127.0.0.1:5432: connection reset by peer")
}

func (s *lostAnswer) Get(ctx context.Context, scope, key string, now time.Time) (*idem.Record, error) {
	if !s.readable {
		return nil, errors.New("dial tcp 127.0.0.1:5432: connection refused")
	}
	return s.Store.Get(ctx, scope, key, now)
}

// Item 11: a commit whose answer is lost is read back: committed, it is acked
// as executed (not reported as "nothing was committed"); unreadable, the
// outcome says it is unknown.
func TestCommitAnswerLost(t *testing.T) {
	db, s := sqliteOrders(t)
	ctx := context.Background()
	h := func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		_, err := sqlitestore.Tx(ctx).ExecContext(ctx, `INSERT INTO orders VALUES (?)`, m.ID)
		return []byte("r"), err
	}
	p, _ := consumer.New(&lostAnswer{Store: s, commit: true, readable: true}, consumer.Config{Name: "lost"})
	if out := p.Process(ctx, &consumer.Message{ID: "m1", Payload: []byte("x"), Delivery: 1}, h); out.Action != consumer.Ack || out.Reason != consumer.Executed || string(out.Result) != "r" {
		t.Fatalf("committed, answer lost: %+v; want it acked as executed", out)
	}
	p, _ = consumer.New(&lostAnswer{Store: s, commit: false, readable: false}, consumer.Config{Name: "lost"})
	out := p.Process(ctx, &consumer.Message{ID: "m2", Payload: []byte("x"), Delivery: 1}, h)
	if out.Reason != consumer.StoreFailed || !strings.Contains(out.Err.Error(), "unknown") || strings.Contains(out.Err.Error(), "nothing was committed") {
		t.Fatalf("unknown outcome: %+v; want store_failed saying the outcome is unknown", out)
	}
	var n int
	_ = db.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&n)
	if n != 1 {
		t.Fatalf("%d rows; want 1", n)
	}
}

// Item 2, the upgrade: with LegacyScope a message processed by an earlier
// version (its record under the bare Name) is acked as a duplicate, not run
// again; an HTTP record under that scope never matches.
func TestLegacyScopeUpgrade(t *testing.T) {
	_, s := sqliteOrders(t)
	ctx := context.Background()
	now := time.Now()
	old := func(key, fp string) {
		tok := "legacy-" + key + "-xxxxxxxxxxxx"
		if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: "orders", Key: key, Fingerprint: fp, Token: tok, Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
			t.Fatal(ok, err)
		}
		if err := s.Complete(ctx, "orders", key, tok, &idem.Response{Status: 200, Body: []byte("old result")}, now, now.Add(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	old("m1", consumer.Fingerprint([]byte("x")))
	old("h1", "v1:an-http-request")
	runs := 0
	h := func(context.Context, *consumer.Message) ([]byte, error) { runs++; return []byte("new"), nil }
	p, _ := consumer.New(s, consumer.Config{Name: "orders", LegacyScope: true})
	if out := p.Process(ctx, &consumer.Message{ID: "m1", Payload: []byte("x"), Delivery: 2}, h); out.Reason != consumer.Duplicate || string(out.Result) != "old result" || runs != 0 {
		t.Fatalf("message processed before the upgrade: %+v, %d runs; want a duplicate of the old record", out, runs)
	}
	if out := p.Process(ctx, &consumer.Message{ID: "m1", Payload: []byte("x"), Delivery: 3}, h); out.Reason != consumer.Duplicate || runs != 0 {
		t.Fatalf("again: %+v", out)
	}
	if out := p.Process(ctx, &consumer.Message{ID: "h1", Payload: []byte("x"), Delivery: 1}, h); out.Reason != consumer.Executed || runs != 1 {
		t.Fatalf("message whose ID an HTTP request used under the old scope: %+v; want it executed", out)
	}
	p2, _ := consumer.New(s, consumer.Config{Name: "orders"})
	if out := p2.Process(ctx, &consumer.Message{ID: "m1", Payload: []byte("x"), Delivery: 2}, h); out.Reason != consumer.Duplicate {
		t.Fatalf("after the copy forward, without LegacyScope: %+v; want a duplicate (the record was copied into the namespace)", out)
	}
}

// A mismatched copy (one ID, another payload), dead-lettered, does not reset
// the attempts of the message whose ID it reuses.
func TestMismatchKeepsTheAttempts(t *testing.T) {
	p := newMem(t, consumer.Config{MaxDeliveries: 3})
	ctx := context.Background()
	bad := func(context.Context, *consumer.Message) ([]byte, error) { return nil, errors.New("boom") }
	for i := 0; i < 2; i++ {
		if out := p.Process(ctx, &consumer.Message{ID: "x", Payload: []byte("a")}, bad); out.Reason != consumer.Failed {
			t.Fatalf("attempt %d: %+v", i+1, out)
		}
	}
	// Keep x in flight while the copy comes, so that the copy is a mismatch.
	started, release := make(chan struct{}), make(chan struct{})
	done := make(chan consumer.Outcome)
	go func() {
		done <- p.Process(ctx, &consumer.Message{ID: "x", Payload: []byte("a")}, func(context.Context, *consumer.Message) ([]byte, error) {
			close(started)
			<-release
			return nil, errors.New("boom")
		})
	}()
	<-started
	copyMsg := &consumer.Message{ID: "x", Payload: []byte("b")}
	out := p.Process(ctx, copyMsg, bad)
	if out.Reason != consumer.Mismatch {
		t.Fatalf("copy: %+v", out)
	}
	if err := p.DeadLettered(ctx, copyMsg, out); err != nil {
		t.Fatal(err)
	}
	close(release)
	if out := <-done; out.Action != consumer.DeadLetter || out.Reason != consumer.Poison {
		t.Fatalf("attempt 3: %+v; want it dead-lettered at MaxDeliveries", out)
	}
}

// Neighbouring code: a nil message or handler is reported, not a panic.
func TestNilMessageOrHandler(t *testing.T) {
	p := newMem(t, consumer.Config{})
	if out := p.Process(context.Background(), nil, func(context.Context, *consumer.Message) ([]byte, error) { return nil, nil }); out.Action != consumer.DeadLetter || out.Err == nil {
		t.Fatalf("nil message: %+v", out)
	}
	if out := p.Process(context.Background(), &consumer.Message{ID: "m", Delivery: 1}, nil); out.Action != consumer.Retry || !strings.Contains(out.Err.Error(), "nil Handler") {
		t.Fatalf("nil handler: %+v", out)
	}
}
