package idemobs_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemobs"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// panicAt is a StoreObserver whose StoreStart or StoreDone panics the first
// time it is told about op.
type panicAt struct {
	op      idemobs.Op
	inStart bool
	fired   atomic.Bool
}

func (p *panicAt) StoreStart(ctx context.Context, op idemobs.Op) context.Context {
	if p.inStart && op == p.op && p.fired.CompareAndSwap(false, true) {
		panic("exporter bug in StoreStart")
	}
	return ctx
}

func (p *panicAt) StoreDone(_ context.Context, op idemobs.Op, _ time.Duration, _ error) {
	if !p.inStart && op == p.op && p.fired.CompareAndSwap(false, true) {
		panic("exporter bug in StoreDone")
	}
}

// TestObserverPanicInTransactionDoesNotWedgeSQLite: a StoreObserver that
// panics while told of Tx.Complete, Tx.Commit (claim-then-complete) or
// LockedTx.Insert, LockedTx.Commit (single transaction) must not leave the
// transaction open. On SQLite an open transaction holds the write lock: every
// later request, for any key, would wait LockTimeout and get 503. The
// handler's write of the unwound request is rolled back with it, and the retry
// with its key runs afresh.
func TestObserverPanicInTransactionDoesNotWedgeSQLite(t *testing.T) {
	t.Parallel()
	cases := []struct {
		flow    idem.Flow
		op      idemobs.Op
		inStart bool
	}{
		{idem.FlowClaimComplete, idemobs.OpComplete, false},
		{idem.FlowClaimComplete, idemobs.OpComplete, true},
		{idem.FlowClaimComplete, idemobs.OpCommit, true},
		{idem.FlowSingleTx, idemobs.OpInsert, false},
		{idem.FlowSingleTx, idemobs.OpInsert, true},
		{idem.FlowSingleTx, idemobs.OpCommit, true},
	}
	for i, c := range cases {
		where := "StoreDone"
		if c.inStart {
			where = "StoreStart"
		}
		t.Run(fmt.Sprintf("%v/%v/%s", c.flow, c.op, where), func(t *testing.T) {
			t.Parallel()
			table := fmt.Sprintf("wedge%d", i)
			db, err := embedded.Open(filepath.Join(t.TempDir(), table+".db"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = db.Close() })
			// Long enough that a wedged store answers 503 rather than waiting
			// for the lock to come free, short enough to fail fast.
			s, err := sqlitestore.New(db, &sqlitestore.Config{Table: table, LockTimeout: 2 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			if _, err := db.Exec(`CREATE TABLE orders (id INTEGER PRIMARY KEY, cart TEXT NOT NULL)`); err != nil {
				t.Fatal(err)
			}
			mw, err := idem.New(idemobs.Store(s, &panicAt{op: c.op, inStart: c.inStart}), &idem.Config{Flow: c.flow, LapsedLease: idem.LapsedRefuse, Lease: time.Hour})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewUnstartedServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if _, err := sqlitestore.Tx(r.Context()).ExecContext(r.Context(), `INSERT INTO orders (cart) VALUES (?)`, r.URL.Path); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				w.WriteHeader(http.StatusCreated)
			})))
			srv.Config.ErrorLog = log.New(io.Discard, "", 0)
			srv.Start()
			t.Cleanup(srv.Close)
			post := func(path, key string) (int, error) {
				req, _ := http.NewRequest("POST", srv.URL+path, strings.NewReader("{}"))
				req.Header.Set("Idempotency-Key", key)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					return 0, err
				}
				resp.Body.Close()
				return resp.StatusCode, nil
			}
			if code, err := post("/a", "k-a"); err == nil {
				t.Fatalf("first request: %d; want the connection dropped by the observer's panic", code)
			}
			if code, err := post("/b", "k-b"); err != nil || code != 201 {
				t.Fatalf("another key after the observer panicked: %d, %v; want 201 (the panicking request's transaction must not hold SQLite's write lock)", code, err)
			}
			code, err := post("/a", "k-a")
			var n int
			_ = db.QueryRow(`SELECT count(*) FROM orders WHERE cart = '/a'`).Scan(&n)
			if c.op == idemobs.OpCommit && c.inStart {
				// The commit ran: the outcome is stored and the retry hears it.
				if err != nil || code != 201 || n != 1 {
					t.Fatalf("retry of the unwound request: %d, %v, %d orders; want the stored 201 and one order", code, err, n)
				}
				return
			}
			if err != nil || code != 201 || n != 1 {
				t.Fatalf("retry of the unwound request: %d, %v, %d orders; want 201 from a fresh run, its first write rolled back (1 order)", code, err, n)
			}
		})
	}
}

// extendWatcher panics on the first Extend it is told about and counts them.
type extendWatcher struct {
	n      atomic.Int64
	second chan struct{}
	once   sync.Once
}

func (e *extendWatcher) StoreStart(ctx context.Context, _ idemobs.Op) context.Context { return ctx }

func (e *extendWatcher) StoreDone(_ context.Context, op idemobs.Op, _ time.Duration, _ error) {
	if op != idemobs.OpExtend {
		return
	}
	if e.n.Add(1) == 1 {
		panic("exporter bug on extend")
	}
	e.once.Do(func() { close(e.second) })
}

// TestObserverPanicOnExtendKeepsProcessAndRenewal: the lease renewal runs on
// a goroutine of the middleware; a StoreObserver panic there would kill the
// process (before the fix this test binary died). The panic is stopped, and
// the renewal goes on: a second Extend comes while the handler still runs.
func TestObserverPanicOnExtendKeepsProcessAndRenewal(t *testing.T) {
	t.Parallel()
	mem := memstore.New(nil)
	t.Cleanup(func() { _ = mem.Close() })
	w := &extendWatcher{second: make(chan struct{})}
	mw, err := idem.New(idemobs.Store(mem, w), &idem.Config{Lease: 300 * time.Millisecond, TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		select {
		case <-w.second:
			rw.WriteHeader(http.StatusCreated)
		case <-r.Context().Done():
			http.Error(rw, "lease lost: "+context.Cause(r.Context()).Error(), http.StatusServiceUnavailable)
		}
	})))
	t.Cleanup(srv.Close)
	req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader("{}"))
	req.Header.Set("Idempotency-Key", "k-extend")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 201 || w.n.Load() < 2 {
		t.Fatalf("handler outliving its lease with a panicking observer: %d after %d extends; want 201 after the renewal went on", resp.StatusCode, w.n.Load())
	}
}

// recorder is an Observer and a StoreObserver that remembers what it saw.
type recorder struct {
	mu     sync.Mutex
	events []idem.EventKind
	dones  []idemobs.Op
}

func (r *recorder) Observe(_ context.Context, e idem.Event) {
	r.mu.Lock()
	r.events = append(r.events, e.Kind)
	r.mu.Unlock()
}

func (r *recorder) StoreStart(ctx context.Context, _ idemobs.Op) context.Context { return ctx }

func (r *recorder) StoreDone(_ context.Context, op idemobs.Op, _ time.Duration, _ error) {
	r.mu.Lock()
	r.dones = append(r.dones, op)
	r.mu.Unlock()
}

type panicky struct{}

func (panicky) Observe(context.Context, idem.Event) { panic("observer bug") }
func (panicky) StoreStart(context.Context, idemobs.Op) context.Context {
	panic("observer bug")
}
func (panicky) StoreDone(context.Context, idemobs.Op, time.Duration, error) { panic("observer bug") }

// TestMultiIsolatesObservers: one observer's panic does not keep the event
// from the observers after it (idemprom would never see the final event and
// idem_in_flight would stay raised); the panic still goes on afterwards.
func TestMultiIsolatesObservers(t *testing.T) {
	t.Parallel()
	before, after := &recorder{}, &recorder{}
	catch := func(f func()) (p any) {
		defer func() { p = recover() }()
		f()
		return nil
	}
	m := idemobs.Multi(before, panicky{}, after)
	if p := catch(func() { m.Observe(context.Background(), idem.Event{Kind: idem.EventExecuted}) }); p == nil {
		t.Error("Multi swallowed the observer's panic; want it passed on once every observer was told")
	}
	ms := idemobs.MultiStore(before, panicky{}, after)
	var ctx context.Context
	if p := catch(func() { ctx = ms.StoreStart(context.Background(), idemobs.OpGet) }); p == nil {
		t.Error("MultiStore.StoreStart swallowed the panic")
	}
	if p := catch(func() { ms.StoreDone(context.Background(), idemobs.OpGet, 0, nil) }); p == nil {
		t.Error("MultiStore.StoreDone swallowed the panic")
	}
	_ = ctx
	for name, r := range map[string]*recorder{"before": before, "after": after} {
		if fmt.Sprint(r.events) != fmt.Sprint([]idem.EventKind{idem.EventExecuted}) || fmt.Sprint(r.dones) != fmt.Sprint([]idemobs.Op{idemobs.OpGet}) {
			t.Errorf("observer %s saw events %v, store ops %v; want [executed] and [get] whatever the panicking one did", name, r.events, r.dones)
		}
	}
}

// TestMultiPanicKeepsInFlightBalanced: through the middleware, an observer
// placed before the metrics that panics on the final event does not leave
// the metrics' in-flight count raised.
func TestMultiPanicKeepsInFlightBalanced(t *testing.T) {
	t.Parallel()
	mem := memstore.New(nil)
	t.Cleanup(func() { _ = mem.Close() })
	var held atomic.Int64
	gauge := claimGauge{&held}
	mw, err := idem.New(mem, &idem.Config{Observer: idemobs.Multi(finalPanicker{}, gauge)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) })))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.Start()
	t.Cleanup(srv.Close)
	req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader("{}"))
	req.Header.Set("Idempotency-Key", "k-multi")
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
	}
	if held.Load() != 0 {
		t.Fatalf("in-flight count %d after the request ended; want 0: the panicking observer kept the final event from the metrics", held.Load())
	}
}

type finalPanicker struct{}

func (finalPanicker) Observe(_ context.Context, e idem.Event) {
	if e.Kind != idem.EventClaimed {
		panic("exporter bug on the final event")
	}
}

// claimGauge keeps the number of claims held, as idemprom's idem_in_flight.
type claimGauge struct{ n *atomic.Int64 }

func (g claimGauge) ObservesClaims() bool { return true }

func (g claimGauge) Observe(_ context.Context, e idem.Event) {
	switch {
	case e.Kind == idem.EventClaimed:
		g.n.Add(1)
	case e.Claimed:
		g.n.Add(-1)
	}
}
