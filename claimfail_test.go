package idem_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// lostAnswerStore is a memstore whose next Claim (when armed) is made but
// answers with an error, as a claim does whose acknowledgement was lost.
type lostAnswerStore struct {
	*memstore.Store
	drop atomic.Bool
	// gate, when set, holds every Claim until it is closed; a claim whose
	// context ended meanwhile is made all the same and answers with the
	// context's error, as a MySQL claim that waited on a row lock does after the
	// driver closed its connection.
	gate chan struct{}
}

func (s *lostAnswerStore) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	if s.gate != nil {
		<-s.gate
	}
	rec, claimed, err := s.Store.Claim(context.Background(), req)
	if err != nil {
		return rec, claimed, err
	}
	if s.drop.CompareAndSwap(true, false) {
		return nil, false, errors.New("read tcp: connection reset by peer (the claim's answer was lost)")
	}
	if ctx.Err() != nil {
		return nil, false, ctx.Err()
	}
	return rec, claimed, nil
}

// TestFailedClaimIsReleased: a claim that was made but whose answer was lost
// is given up, fenced by its token: the client hears 503 "not executed", and
// its retry runs the operation (once) instead of hearing 409 for a whole
// lease — under LapsedRefuse then 503 outcome-unknown until an operator
// resolves the key — for an operation that never ran.
func TestFailedClaimIsReleased(t *testing.T) {
	t.Parallel()
	for _, policy := range []idem.LapsedLease{idem.LapsedTakeOver, idem.LapsedRefuse} {
		store := &lostAnswerStore{Store: memstore.New(nil)}
		t.Cleanup(func() { _ = store.Close() })
		o := &orders{}
		mw, err := idem.New(store, &idem.Config{LapsedLease: policy})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(mw(o))
		t.Cleanup(srv.Close)
		b := &bundle{server: srv, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}}
		store.drop.Store(true)
		wantProblem(t, b.post(t, "lost", "{}"), http.StatusServiceUnavailable, idem.CodeStoreUnavailable)
		if a := b.post(t, "lost", "{}"); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "" {
			t.Fatalf("policy %d: retry after the lost claim answer: %d %s, want a fresh 201", policy, a.status, a.body)
		}
		if n := o.runs.Load(); n != 1 {
			t.Fatalf("policy %d: the handler ran %d times, want 1", policy, n)
		}
	}
}

// TestClaimOutlivesTheClient: the client hangs up while its claim waits in
// the store. The claim is not abandoned half-way (a driver that closes the
// connection does not stop a statement the database already runs): it ends,
// the operation runs once and its outcome is kept, so a retry replays it
// instead of meeting a key held under a token nobody holds.
func TestClaimOutlivesTheClient(t *testing.T) {
	t.Parallel()
	gate := make(chan struct{})
	store := &lostAnswerStore{Store: memstore.New(nil), gate: gate}
	t.Cleanup(func() { _ = store.Close() })
	o := &orders{}
	done := make(chan struct{})
	mw, err := idem.New(store, &idem.Config{Observer: idem.ObserverFunc(func(_ context.Context, e idem.Event) {
		if e.Kind == idem.EventExecuted {
			close(done)
		}
	})})
	if err != nil {
		t.Fatal(err)
	}
	var arrived atomic.Int64
	hungUp := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if arrived.Add(1) == 1 {
			go func() { <-r.Context().Done(); close(hungUp) }()
		}
		mw(o).ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader("{}"))
	req.Header.Set("Idempotency-Key", "hangup")
	errc := make(chan error, 1)
	go func() {
		resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req)
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	for arrived.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	cancel() // the client hangs up while the claim waits
	<-errc
	<-hungUp // the server saw the hang-up while the claim waited
	close(gate)
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the claimed operation did not run to its end")
	}
	b := &bundle{server: srv, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}}
	if a := b.post(t, "hangup", "{}"); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "true" {
		t.Fatalf("retry: %d %s, want the 201 replayed", a.status, a.body)
	}
	if n := o.runs.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
}
