package pgstore_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/internal/waittest"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

var waitFlows = []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx}

// secondStore opens the table of s through a pool of its own, as another
// process would.
func secondStore(t *testing.T, s *pgstore.Store) *pgstore.Store {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s2, err := pgstore.New(pool, &pgstore.Config{Table: unquote(s.Table())})
	if err != nil {
		t.Fatal(err)
	}
	return s2
}

// TestInFlightWait: 50 requests with one key, the first held a second,
// InFlightWait 5s: one execution, 49 byte-exact replays, no 409 — in one
// middleware, and split over two middlewares with pools of their own (as two
// processes), woken by LISTEN/NOTIFY; in both flows.
func TestInFlightWait(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 8)
	for _, flow := range waitFlows {
		t.Run(fmt.Sprintf("one/flow%d", flow), func(t *testing.T) {
			t.Parallel()
			waittest.Concurrent(t, []idem.Store{db.newStore(t)}, flow, 50)
		})
		t.Run(fmt.Sprintf("two-pools/flow%d", flow), func(t *testing.T) {
			t.Parallel()
			s := db.newStore(t)
			waittest.Concurrent(t, []idem.Store{s, secondStore(t, s)}, flow, 50)
		})
	}
}

// TestInFlightWaitShorterThanTheHandler: 409 with Retry-After once
// InFlightWait passes.
func TestInFlightWaitShorterThanTheHandler(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	for _, flow := range waitFlows {
		t.Run(fmt.Sprintf("flow%d", flow), func(t *testing.T) {
			t.Parallel()
			waittest.ShortWait(t, db.newStore(t), flow)
		})
	}
}

// TestInFlightWaitManyWaiters: 2,000 requests wait on one key with a pool of
// 4 connections; another key runs meanwhile.
func TestInFlightWaitManyWaiters(t *testing.T) {
	db := newTestDB(t, 4)
	for _, flow := range waitFlows {
		t.Run(fmt.Sprintf("flow%d", flow), func(t *testing.T) {
			waittest.Many(t, db.newStore(t), flow, 2000, waittest.Key(t), nil, true)
		})
	}
}

// TestOutcomeNotifierAcrossPools: a notification sent through one pool wakes
// a watch of another, and the watch holds no pool connection.
func TestOutcomeNotifierAcrossPools(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 2)
	a := db.newStore(t)
	b := secondStore(t, a)
	ctx := context.Background()
	wake, stop, err := a.WatchOutcome(ctx, "tenant", "k1")
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	other, stopOther, err := a.WatchOutcome(ctx, "tenant", "k2")
	if err != nil {
		t.Fatal(err)
	}
	defer stopOther()
	if n := db.pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d pool connections held while watching, want 0 (the listener has its own)", n)
	}
	if err := b.NotifyOutcome(ctx, "tenant", "k1"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-wake:
	case <-time.After(time.Minute):
		t.Fatal("no notification a minute after NotifyOutcome through another pool")
	}
	select {
	case <-other:
		t.Error("a watch of another key was woken")
	default:
	}
}

// TestInFlightWaitLatency logs the wake-up latency (p50/p99 from the
// holder's answer to the waiters' answers), by hand: IDEM_WAIT_LATENCY=1.
func TestInFlightWaitLatency(t *testing.T) {
	if os.Getenv("IDEM_WAIT_LATENCY") == "" {
		t.Skip("set IDEM_WAIT_LATENCY=1 to measure")
	}
	db := newTestDB(t, 8)
	for _, flow := range waitFlows {
		s := db.newStore(t)
		p50, p99 := waittest.WakeLatency(t, []idem.Store{s, secondStore(t, s)}, flow, 20, 10)
		t.Logf("PostgreSQL flow %v, two pools: wake-up p50 %v p99 %v", flow, p50, p99)
	}
}

// TestInFlightWaitHolderConnectionDies: in the single-transaction flow a
// holder whose connection dies (pg_terminate_backend, as when its server
// crashes) leaves no record, and its lock goes with the connection; its
// waiters, in another middleware with a pool of its own, notice the free lock
// and go on as fresh requests: one executes, the others get its replay.
func TestInFlightWaitHolderConnectionDies(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 8)
	a := db.newStore(t)
	b := secondStore(t, a)
	key := waittest.Key(t)
	pids := make(chan uint32, 1)
	gate := make(chan struct{})
	defer close(gate)
	var mu sync.Mutex
	runs := 0
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		runs++
		nth := runs
		mu.Unlock()
		if nth == 1 {
			pids <- pgstore.Tx(r.Context()).Conn().PgConn().PID()
			<-gate
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, "run %d", nth)
	})
	holder := waittest.Server(t, a, idem.Config{Flow: idem.FlowSingleTx}, h)
	ev := waittest.NewEvents(key)
	waiters := waittest.Server(t, b, idem.Config{Flow: idem.FlowSingleTx, InFlightWait: 5 * time.Minute, Observer: ev}, h)
	c := waittest.Client()
	go waittest.Post(context.Background(), c, holder.URL, key, nil)
	pid := <-pids
	const n = 5
	answers := make([]waittest.Answer, n)
	var wg sync.WaitGroup
	for i := range answers {
		wg.Add(1)
		go func() { defer wg.Done(); answers[i] = waittest.Post(context.Background(), c, waiters.URL, key, nil) }()
	}
	time.Sleep(300 * time.Millisecond) // most likely waiting by now; if not, they find the key free
	if _, err := db.pool.Exec(context.Background(), "SELECT pg_terminate_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	executed, replayed := 0, 0
	for _, ans := range answers {
		switch {
		case ans.Status == http.StatusCreated && string(ans.Body) == "run 2" && !ans.Replayed:
			executed++
		case ans.Status == http.StatusCreated && string(ans.Body) == "run 2" && ans.Replayed:
			replayed++
		default:
			t.Errorf("a waiter got %d %q replayed=%v, want run 2", ans.Status, ans.Body, ans.Replayed)
		}
	}
	if executed != 1 || replayed != n-1 {
		t.Errorf("%d executed, %d replayed, want 1 and %d (waits: %v)", executed, replayed, n-1, ev)
	}
}
