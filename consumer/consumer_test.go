package consumer_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

func newMem(t *testing.T, cfg consumer.Config) *consumer.Processor {
	t.Helper()
	s := memstore.New(nil)
	t.Cleanup(func() { _ = s.Close() })
	if cfg.Name == "" {
		cfg.Name = "test"
	}
	p, err := consumer.New(s, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestOutcomes(t *testing.T) {
	p := newMem(t, consumer.Config{MaxDeliveries: 3, Backoff: func(n int) time.Duration { return time.Duration(n) * time.Second }})
	ctx := context.Background()
	var runs atomic.Int32
	ok := func(context.Context, *consumer.Message) ([]byte, error) { runs.Add(1); return []byte("r1"), nil }

	out := p.Process(ctx, &consumer.Message{ID: "m1", Payload: []byte("a")}, ok)
	if out.Action != consumer.Ack || out.Reason != consumer.Executed || string(out.Result) != "r1" {
		t.Fatalf("first delivery: %+v", out)
	}
	out = p.Process(ctx, &consumer.Message{ID: "m1", Payload: []byte("a"), Delivery: 2}, ok)
	if out.Action != consumer.Ack || out.Reason != consumer.Duplicate || string(out.Result) != "r1" {
		t.Fatalf("redelivery: %+v", out)
	}
	out = p.Process(ctx, &consumer.Message{ID: "m1", Payload: []byte("b")}, ok)
	if out.Action != consumer.DeadLetter || out.Reason != consumer.Mismatch {
		t.Fatalf("same ID, other payload: %+v", out)
	}
	if runs.Load() != 1 {
		t.Fatalf("handler ran %d times, want 1", runs.Load())
	}
	for _, id := range []string{"", "a b", "caf\u00e9", "tab\tx"} {
		if out := p.Process(ctx, &consumer.Message{ID: id}, ok); out.Action != consumer.DeadLetter || out.Reason != consumer.InvalidID {
			t.Fatalf("ID %q: %+v", id, out)
		}
	}

	// Handler errors: retried with backoff, then dead-lettered at MaxDeliveries;
	// the key is released each time, so the next delivery runs.
	fails := 0
	bad := func(context.Context, *consumer.Message) ([]byte, error) { fails++; return nil, errors.New("boom") }
	for d := 1; d <= 3; d++ {
		out := p.Process(ctx, &consumer.Message{ID: "m2", Payload: []byte("x"), Delivery: d}, bad)
		want := consumer.Retry
		if d == 3 {
			want = consumer.DeadLetter
		}
		if out.Action != want || (d < 3 && out.Delay != time.Duration(d)*time.Second) {
			t.Fatalf("delivery %d: %+v", d, out)
		}
	}
	if fails != 3 {
		t.Fatalf("failing handler ran %d times, want 3", fails)
	}
	// Permanent: dead-lettered on the first delivery.
	out = p.Process(ctx, &consumer.Message{ID: "m3", Payload: []byte("x")}, func(context.Context, *consumer.Message) ([]byte, error) {
		return nil, consumer.Permanent(errors.New("invalid order"))
	})
	if out.Action != consumer.DeadLetter || out.Reason != consumer.Poison || !consumer.IsPermanent(out.Err) {
		t.Fatalf("permanent error: %+v", out)
	}
	// A panic is a failed delivery, and the key is free again.
	out = p.Process(ctx, &consumer.Message{ID: "m4", Payload: []byte("x")}, func(context.Context, *consumer.Message) ([]byte, error) { panic("oops") })
	if out.Action != consumer.Retry || out.Reason != consumer.Failed {
		t.Fatalf("panic: %+v", out)
	}
	if out := p.Process(ctx, &consumer.Message{ID: "m4", Payload: []byte("x"), Delivery: 2}, ok); out.Reason != consumer.Executed {
		t.Fatalf("after a panic: %+v", out)
	}
	// Past MaxDeliveries with no outcome (consumers crashed): dead-lettered unrun.
	before := runs.Load()
	if out := p.Process(ctx, &consumer.Message{ID: "m5", Payload: []byte("x"), Delivery: 4}, ok); out.Action != consumer.DeadLetter || out.Reason != consumer.Poison || runs.Load() != before {
		t.Fatalf("past MaxDeliveries: %+v", out)
	}
	st := p.Stats()
	if st.Executed != 2 || st.Duplicate != 1 || st.Mismatch != 1 || st.InvalidID != 4 || st.Failed != 3 || st.Poison != 3 {
		t.Fatalf("stats %+v", st)
	}
}

// While one delivery runs, others of the same ID (many at once) are told to
// retry after the lease left; the lease is renewed while the handler runs.
func TestInFlightConcurrent(t *testing.T) {
	// A lease of 1.5 s: the renewal every Lease/3 may come up to 1 s late on a
	// loaded machine before the lease lapses (150 ms left 100 ms).
	const lease = 1500 * time.Millisecond
	p := newMem(t, consumer.Config{Lease: lease})
	ctx := context.Background()
	started, release := make(chan struct{}), make(chan struct{})
	var runs atomic.Int32
	h := func(context.Context, *consumer.Message) ([]byte, error) {
		if runs.Add(1) == 1 {
			close(started)
		}
		<-release
		return nil, nil
	}
	first := make(chan consumer.Outcome)
	go func() { first <- p.Process(ctx, &consumer.Message{ID: "k", Payload: []byte("p")}, h) }()
	<-started
	time.Sleep(lease + 500*time.Millisecond) // longer than the lease: renewal must keep it
	var wg sync.WaitGroup
	outs := make([]consumer.Outcome, 16)
	for i := range outs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[i] = p.Process(ctx, &consumer.Message{ID: "k", Payload: []byte("p"), Delivery: 2}, h)
		}()
	}
	wg.Wait()
	for i, o := range outs {
		// Delay is the lease left as of the delivery's clock reading, taken
		// before its claim: a renewal between that reading and the claim leaves a
		// little more than a whole lease.
		if o.Action != consumer.Retry || o.Reason != consumer.InFlight || o.Delay <= 0 || o.Delay > lease+time.Second {
			t.Fatalf("concurrent delivery %d: %+v", i, o)
		}
	}
	close(release)
	if o := <-first; o.Reason != consumer.Executed {
		t.Fatalf("first: %+v", o)
	}
	if runs.Load() != 1 {
		t.Fatalf("handler ran %d times", runs.Load())
	}
}

// With a transactional store the handler's writes and the record commit
// together: a failed handler leaves neither, a successful one both.
// sqliteOrders opens a migrated SQLite store in a temporary file, beside an
// orders table of message IDs.
func sqliteOrders(t *testing.T) (*sql.DB, *sqlitestore.Store) {
	t.Helper()
	db, err := embedded.Open(filepath.Join(t.TempDir(), "c.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (msg_id TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	s, err := sqlitestore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return db, s
}

func TestSQLiteTransaction(t *testing.T) {
	db, s := sqliteOrders(t)
	ctx := context.Background()
	p, err := consumer.New(s, consumer.Config{Name: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	fail := true
	h := func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		if _, err := sqlitestore.Tx(ctx).ExecContext(ctx, `INSERT INTO orders VALUES (?)`, m.ID); err != nil {
			return nil, err
		}
		if fail {
			return nil, errors.New("after the insert")
		}
		return nil, nil
	}
	count := func() (n int) {
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if out := p.Process(ctx, &consumer.Message{ID: "o1", Payload: []byte("{}")}, h); out.Action != consumer.Retry || count() != 0 {
		t.Fatalf("failed handler: %+v, %d rows", out, count())
	}
	if _, err := s.Get(ctx, consumer.StoredScope("orders", ""), "o1", time.Now()); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("record after a failed handler: %v", err)
	}
	fail = false
	for d := 2; d <= 4; d++ {
		p.Process(ctx, &consumer.Message{ID: "o1", Payload: []byte("{}"), Delivery: d}, h)
	}
	if count() != 1 {
		t.Fatalf("%d rows, want 1", count())
	}
}

func TestConfigErrors(t *testing.T) {
	s := memstore.New(nil)
	defer s.Close()
	for _, c := range []consumer.Config{{}, {Name: "x", MaxDeliveries: -1}, {Name: "x", Lease: time.Hour, TTL: time.Minute}} {
		if _, err := consumer.New(s, c); err == nil {
			t.Fatalf("config %+v accepted", c)
		}
	}
	if _, err := consumer.New(nil, consumer.Config{Name: "x"}); err == nil {
		t.Fatal("nil store accepted")
	}
}

// A handler that ignores its context and returns after HandlerTimeout commits
// nothing in the store's transaction: the delivery is retried as a failed one,
// the key released, and the next delivery runs and commits once.
func TestSQLiteHandlerPastTimeoutCommitsNothing(t *testing.T) {
	db, s := sqliteOrders(t)
	ctx := context.Background()
	p, err := consumer.New(s, consumer.Config{Name: "orders", HandlerTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	slow := true
	h := func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		if _, err := sqlitestore.Tx(ctx).ExecContext(ctx, `INSERT INTO orders VALUES (?)`, m.ID); err != nil {
			return nil, err
		}
		if slow {
			time.Sleep(500 * time.Millisecond) // five times HandlerTimeout, ignoring the context
		}
		return []byte("ok"), nil
	}
	count := func() (n int) {
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	out := p.Process(ctx, &consumer.Message{ID: "o1", Payload: []byte("{}")}, h)
	if out.Action != consumer.Retry || out.Reason != consumer.Failed || count() != 0 {
		t.Fatalf("handler past HandlerTimeout: %+v, %d rows; want a failed delivery to retry and no row", out, count())
	}
	if _, err := s.Get(ctx, consumer.StoredScope("orders", ""), "o1", time.Now()); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("record after a handler past HandlerTimeout: %v; want the key released", err)
	}
	slow = false
	if out := p.Process(ctx, &consumer.Message{ID: "o1", Payload: []byte("{}"), Delivery: 2}, h); out.Action != consumer.Ack || out.Reason != consumer.Executed || count() != 1 {
		t.Fatalf("redelivery: %+v, %d rows; want it executed once", out, count())
	}
}
