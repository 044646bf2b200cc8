package idem_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// fakeTxStore is an in-memory TxStore for unit tests of the middleware's
// transactional path: business writes staged in a transaction become visible in
// committed only when the transaction commits. The real stores prove the same
// against real databases.
type fakeTxStore struct {
	*memstore.Store
	mu         sync.Mutex
	committed  []string
	failCommit atomic.Bool
	// commitErr, when set, is what Commit returns instead of committing.
	commitErr   func() error
	failRelease atomic.Bool
	beforeDone  func() // called in Tx.Complete before the fenced check
}

// Release fails while failRelease is set, as an unreachable store would.
func (s *fakeTxStore) Release(ctx context.Context, scope, key, token string) error {
	if s.failRelease.Load() {
		return errors.New("release: connection refused")
	}
	return s.Store.Release(ctx, scope, key, token)
}

type fakeTx struct {
	s        *fakeTxStore
	staged   []string
	complete func() error
	done     bool
}

type fakeTxKey struct{}

func (s *fakeTxStore) BeginTx(ctx context.Context) (context.Context, idem.Tx, error) {
	tx := &fakeTx{s: s}
	return context.WithValue(ctx, fakeTxKey{}, tx), tx, nil
}

func (tx *fakeTx) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, now, exp time.Time) error {
	if tx.s.beforeDone != nil {
		tx.s.beforeDone()
	}
	rec, err := tx.s.Get(ctx, scope, key, time.Now())
	if err != nil || rec.State != idem.StateInFlight || rec.Token != token {
		return idem.ErrLockLost
	}
	tx.complete = func() error { return tx.s.Store.Complete(ctx, scope, key, token, resp, now, exp) }
	return nil
}

func (tx *fakeTx) Commit(context.Context) error {
	if tx.s.failCommit.Load() {
		tx.done = true
		return errors.New("commit failed: connection reset")
	}
	if tx.s.commitErr != nil {
		tx.done = true
		return tx.s.commitErr()
	}
	if err := tx.complete(); err != nil {
		return err
	}
	tx.s.mu.Lock()
	tx.s.committed = append(tx.s.committed, tx.staged...)
	tx.s.mu.Unlock()
	tx.done = true
	return nil
}

func (tx *fakeTx) Rollback(context.Context) error { tx.done = true; return nil }

func (s *fakeTxStore) orders() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.committed...)
}

func newTxBundle(t *testing.T, cfg *idem.Config, h http.HandlerFunc) (*fakeTxStore, *bundle) {
	t.Helper()
	s := &fakeTxStore{Store: memstore.New(nil)}
	t.Cleanup(func() { _ = s.Close() })
	mw, err := idem.New(s, cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(h))
	t.Cleanup(srv.Close)
	return s, &bundle{server: srv, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}}
}

// insertOrder stages an order in the request's transaction.
func insertOrder(w http.ResponseWriter, r *http.Request) {
	tx := r.Context().Value(fakeTxKey{}).(*fakeTx)
	_, key, _ := idem.KeyFrom(r.Context())
	tx.staged = append(tx.staged, "order-for-"+key)
	w.WriteHeader(http.StatusCreated)
	fmt.Fprint(w, `{"ok":true}`)
}

func TestTxCommitsOrderAndOutcomeTogether(t *testing.T) {
	t.Parallel()
	s, b := newTxBundle(t, nil, insertOrder)
	b.post(t, "k", "{}")
	if a := b.post(t, "k", "{}"); a.header.Get(idem.ReplayedHeader) != "true" {
		t.Fatalf("not replayed: %d %s", a.status, a.body)
	}
	if got := s.orders(); len(got) != 1 {
		t.Fatalf("orders = %v, want one", got)
	}
}

func TestTxCommitFailureLeavesNothing(t *testing.T) {
	t.Parallel()
	s, b := newTxBundle(t, nil, insertOrder)
	s.failCommit.Store(true)
	wantProblem(t, b.post(t, "k", "{}"), 503, idem.CodeCommitFailed)
	if got := s.orders(); len(got) != 0 {
		t.Fatalf("orders after a failed commit = %v", got)
	}
	if _, err := s.Get(context.Background(), "", "k", time.Now()); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("the claim must be released after a failed commit: %v", err)
	}
	s.failCommit.Store(false)
	if a := b.post(t, "k", "{}"); a.status != 201 || a.header.Get(idem.ReplayedHeader) != "" {
		t.Fatalf("retry after a failed commit: %d, want a fresh 201", a.status)
	}
	if got := s.orders(); len(got) != 1 {
		t.Fatalf("orders = %v, want one", got)
	}
}

func TestTxLostLeaseRollsBack(t *testing.T) {
	t.Parallel()
	var s *fakeTxStore
	s, b := newTxBundle(t, nil, insertOrder)
	var once sync.Once
	s.beforeDone = func() {
		once.Do(func() {
			// Between the handler and the completion, the lease lapses and another
			// request takes the key over.
			req := httptest.NewRequest("POST", "/orders", nil)
			later := time.Now().Add(time.Hour)
			if _, claimed, err := s.Claim(context.Background(), idem.ClaimRequest{
				Key: "k", Fingerprint: idem.FingerprintV3(req, []byte("{}")), Token: "taker",
				Now: later, LeaseUntil: later.Add(time.Minute), ExpiresAt: later.Add(time.Hour),
			}); !claimed || err != nil {
				t.Errorf("takeover: %v %v", claimed, err)
			}
		})
	}
	wantProblem(t, b.post(t, "k", "{}"), 409, idem.CodeLeaseLost)
	if got := s.orders(); len(got) != 0 {
		t.Fatalf("the fenced-out request committed its order: %v", got)
	}
	rec, err := s.Get(context.Background(), "", "k", time.Now())
	if err != nil || rec.Token != "taker" {
		t.Fatalf("the taker's claim must stay: %+v %v", rec, err)
	}
}

func TestTxPanicRollsBack(t *testing.T) {
	t.Parallel()
	s, b := newTxBundle(t, nil, func(w http.ResponseWriter, r *http.Request) {
		tx := r.Context().Value(fakeTxKey{}).(*fakeTx)
		tx.staged = append(tx.staged, "half-done")
		panic(http.ErrAbortHandler)
	})
	req, _ := http.NewRequest("POST", b.server.URL, nil)
	req.Header.Set("Idempotency-Key", "k")
	if resp, err := b.client.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("an aborted handler answered %d", resp.StatusCode)
	}
	waitFor(t, func() bool {
		_, err := s.Get(context.Background(), "", "k", time.Now())
		return errors.Is(err, idem.ErrNotFound)
	})
	if got := s.orders(); len(got) != 0 {
		t.Fatalf("orders after a panic = %v", got)
	}
}

func TestTxOversizedResponseCommitsNothing(t *testing.T) {
	t.Parallel()
	s, b := newTxBundle(t, &idem.Config{MaxStoredBody: 4}, insertOrder)
	wantProblem(t, b.post(t, "k", "{}"), 500, idem.CodeResponseTooLarge)
	if got := s.orders(); len(got) != 0 {
		t.Fatalf("orders = %v, want none", got)
	}
}

// A handler that ignores its context and returns after HandlerTimeout commits
// nothing, even on a store whose transaction does not end with the context by
// itself (this fake, like pgx, does not watch it): the middleware rolls back,
// answers 503 idempotency_commit_failed, releases the key, and the retry runs
// the handler afresh.
func TestTxHandlerPastTimeoutCommitsNothing(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	s, b := newTxBundle(t, &idem.Config{HandlerTimeout: 100 * time.Millisecond}, func(w http.ResponseWriter, r *http.Request) {
		if runs.Add(1) == 1 {
			time.Sleep(500 * time.Millisecond) // five times HandlerTimeout, ignoring the context
		}
		insertOrder(w, r)
	})
	a := wantProblem(t, b.post(t, "k", "{}"), http.StatusServiceUnavailable, idem.CodeCommitFailed)
	if !strings.Contains(a.Detail, "HandlerTimeout") {
		t.Errorf("detail %q does not say the handler ran past HandlerTimeout", a.Detail)
	}
	if got := s.orders(); len(got) != 0 {
		t.Fatalf("orders after a handler past HandlerTimeout = %v, want none", got)
	}
	if _, err := s.Get(context.Background(), "", "k", time.Now()); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("the key must be released: %v", err)
	}
	if a := b.post(t, "k", "{}"); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "" {
		t.Fatalf("retry: %d %s, want a fresh 201", a.status, a.body)
	}
	if got := s.orders(); len(got) != 1 || runs.Load() != 2 {
		t.Fatalf("orders = %v after %d runs, want one order after two", got, runs.Load())
	}
}
