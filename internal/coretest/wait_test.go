package idem_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/waittest"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// TestInFlightWaitConcurrent: 50 requests with one key, the first one's
// handler held for a second, InFlightWait 5s: one execution, 49 byte-exact
// replays, no 409 (without InFlightWait all 49 get 409).
func TestInFlightWaitConcurrent(t *testing.T) {
	onLocalStores(t, func(t *testing.T, newStore func(*testing.T) idem.Store, flow idem.Flow) {
		waittest.Concurrent(t, []idem.Store{newStore(t)}, flow, 50)
	})
}

// openSQLite opens the migrated SQLite store at path through a database
// handle of its own.
func openSQLite(t *testing.T, path string) *sqlitestore.Store {
	t.Helper()
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	s, err := sqlitestore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestInFlightWaitTwoMiddlewares: the duplicates are split over two
// middlewares, each with a store handle of its own (two database handles on
// one SQLite file; one memstore shared), as two processes would be: the
// waiters of the other middleware are woken too (by polling on SQLite).
func TestInFlightWaitTwoMiddlewares(t *testing.T) {
	t.Run("memstore", func(t *testing.T) {
		t.Parallel()
		s := memstore.New(nil)
		t.Cleanup(func() { _ = s.Close() })
		waittest.Concurrent(t, []idem.Store{s, s}, idem.FlowAuto, 50)
	})
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(fmt.Sprintf("sqlite-flow%d", flow), func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(t.TempDir(), "records.db")
			waittest.Concurrent(t, []idem.Store{openSQLite(t, path), openSQLite(t, path)}, flow, 50)
		})
	}
}

// TestInFlightWaitShorterThanTheHandler: every duplicate waits InFlightWait,
// then gets 409 with a Retry-After within the lease.
func TestInFlightWaitShorterThanTheHandler(t *testing.T) {
	onLocalStores(t, func(t *testing.T, newStore func(*testing.T) idem.Store, flow idem.Flow) {
		waittest.ShortWait(t, newStore(t), flow)
	})
}

// TestInFlightWaitManyWaiters: 2,000 requests wait on one key on memstore
// (300 on SQLite, whose one writer makes each claim slow under -race); each
// waiter gets the replay (on memstore another key runs meanwhile; on SQLite
// the holder's transaction holds the database's write lock).
func TestInFlightWaitManyWaiters(t *testing.T) {
	onLocalStores(t, func(t *testing.T, newStore func(*testing.T) idem.Store, flow idem.Flow) {
		key := waittest.Key(t)
		store := newStore(t)
		_, mem := store.(*memstore.Store)
		n := 300
		if mem {
			n = 2000
		}
		waittest.Many(t, store, flow, n, key, nil, mem)
	})
}

// TestInFlightWaitMismatch: another request with the key gets 422 at once,
// while the holder still runs (claim-then-complete: its fingerprint is
// stored); in the single-transaction flow the holder's fingerprint is known
// only once it commits, so the other request waits, then gets 422.
func TestInFlightWaitMismatch(t *testing.T) {
	onLocalStores(t, func(t *testing.T, newStore func(*testing.T) idem.Store, flow idem.Flow) {
		key := waittest.Key(t)
		g := waittest.NewGated()
		srv := waittest.Server(t, newStore(t), idem.Config{Flow: flow, InFlightWait: 10 * time.Minute}, g)
		defer g.Open()
		c := waittest.Client()
		first := make(chan waittest.Answer, 1)
		go func() { first <- waittest.Post(context.Background(), c, srv.URL, key, []byte("a")) }()
		<-g.Entered
		other := make(chan waittest.Answer, 1)
		go func() { other <- waittest.Post(context.Background(), c, srv.URL, key, []byte("b")) }()
		if flow != idem.FlowSingleTx {
			if a := <-other; a.Status != http.StatusUnprocessableEntity {
				t.Errorf("another request with the key while the holder runs: %d, want 422 at once", a.Status)
			}
			g.Open()
		} else {
			g.Open()
			if a := <-other; a.Status != http.StatusUnprocessableEntity {
				t.Errorf("another request with the key: %d, want 422 once the holder committed", a.Status)
			}
		}
		<-first
	})
}

// TestInFlightWaitCrashedHolder: a holder that crashed (its claim stays in
// flight, nobody renews it) wakes its waiters when its lease lapses; they get
// what a fresh request gets: a takeover, or under LapsedRefuse 503.
func TestInFlightWaitCrashedHolder(t *testing.T) {
	for _, policy := range []idem.LapsedLease{idem.LapsedTakeOver, idem.LapsedRefuse} {
		onLocalStores(t, func(t *testing.T, newStore func(*testing.T) idem.Store, flow idem.Flow) {
			if flow == idem.FlowSingleTx {
				flow = idem.FlowClaimComplete // a crashed single-transaction holder leaves no record: its lock goes with its connection
			}
			store := newStore(t)
			key := waittest.Key(t)
			ev := waittest.NewEvents(key)
			body := []byte(`{"crash":true}`)
			r := httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body))
			now := time.Now()
			const lease = 500 * time.Millisecond
			if _, ok, err := store.Claim(context.Background(), idem.ClaimRequest{Key: key, Fingerprint: idem.FingerprintV2(r, body), Token: "crashed-holder-token00",
				Now: now, LeaseUntil: now.Add(lease), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
				t.Fatalf("claim as the crashed holder: %v %v", ok, err)
			}
			srv := waittest.Server(t, store, idem.Config{Flow: flow, InFlightWait: 10 * time.Minute, LapsedLease: policy, Observer: ev},
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }))
			c := waittest.Client()
			answers := make([]waittest.Answer, 5)
			var wg sync.WaitGroup
			for i := range answers {
				wg.Add(1)
				go func() { defer wg.Done(); answers[i] = waittest.Post(context.Background(), c, srv.URL, key, body) }()
			}
			wg.Wait()
			created := 0
			for _, a := range answers {
				switch {
				case policy == idem.LapsedTakeOver && a.Status == http.StatusCreated:
					created++
				case policy == idem.LapsedRefuse && a.Status == http.StatusServiceUnavailable && strings.Contains(string(a.Body), idem.CodeOutcomeUnknown):
				default:
					t.Errorf("%v: a waiter got %d %s", policy, a.Status, a.Body)
				}
				if a.Took > 5*time.Minute {
					t.Errorf("a waiter took %v", a.Took)
				}
			}
			if policy == idem.LapsedTakeOver && created != 5 {
				t.Errorf("takeover: %d of 5 got 201 (one executed, the rest its replay)", created)
			}
		})
	}
}

// TestInFlightWaitLatency logs the wake-up latency (p50/p99 from the
// holder's answer to the waiters' answers) on memstore and SQLite, by hand:
// IDEM_WAIT_LATENCY=1.
func TestInFlightWaitLatency(t *testing.T) {
	if os.Getenv("IDEM_WAIT_LATENCY") == "" {
		t.Skip("set IDEM_WAIT_LATENCY=1 to measure")
	}
	mem := memstore.New(nil)
	t.Cleanup(func() { _ = mem.Close() })
	p50, p99 := waittest.WakeLatency(t, []idem.Store{mem, mem}, idem.FlowAuto, 20, 10)
	t.Logf("memstore, two middlewares: wake-up p50 %v p99 %v", p50, p99)
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		path := filepath.Join(t.TempDir(), "records.db")
		p50, p99 := waittest.WakeLatency(t, []idem.Store{openSQLite(t, path), openSQLite(t, path)}, flow, 20, 10)
		t.Logf("SQLite flow %v, two database handles (polled): wake-up p50 %v p99 %v", flow, p50, p99)
	}
}
