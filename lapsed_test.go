package idem_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// crashedHolder leaves an in-flight record for key with the fingerprint of
// POST /orders with body, as a holder that died mid-request does.
func crashedHolder(t *testing.T, b *bundle, now time.Time, key, body string) {
	t.Helper()
	req := httptest.NewRequest("POST", "/orders", nil)
	if _, claimed, err := b.store.Claim(context.Background(), idem.ClaimRequest{
		Key: key, Fingerprint: idem.FingerprintV2(req, []byte(body)), Token: "crashed",
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour),
	}); !claimed || err != nil {
		t.Fatalf("Claim: %v %v", claimed, err)
	}
}

func TestLapsedRefuseAnswersOutcomeUnknownUntilResolved(t *testing.T) {
	t.Parallel()
	clk := &clock{now: time.Now()}
	b := setup(t, &idem.Config{NowFunc: clk.Now, Lease: time.Minute, LapsedLease: idem.LapsedRefuse}, &orders{})
	start := clk.Now()
	crashedHolder(t, b, start, "k", `{}`)
	wantProblem(t, b.post(t, "k", `{}`), 409, idem.CodeKeyInUse)
	clk.Add(61 * time.Second)

	// Many retries at once after the lease lapsed: every one is refused, none runs.
	var wg sync.WaitGroup
	answers := make([]answer, 40)
	for i := range answers {
		wg.Add(1)
		go func() { defer wg.Done(); answers[i] = b.post(t, "k", `{}`) }()
	}
	wg.Wait()
	for _, a := range answers {
		if a.status != http.StatusServiceUnavailable {
			t.Fatalf("a retry after the lease lapsed got %d %s, want 503 %s", a.status, a.body, idem.CodeOutcomeUnknown)
		}
	}
	wantProblem(t, answers[0], 503, idem.CodeOutcomeUnknown)
	if n := b.orders.runs.Load(); n != 0 {
		t.Fatalf("handler ran %d times, want 0: the outcome is unknown", n)
	}
	if a := b.post(t, "k", `{"other":1}`); a.status != 422 {
		t.Errorf("another request with the key: %d, want 422", a.status)
	}
	// Refusals write nothing: the record is still the lapsed holder's.
	if rec, err := b.store.Get(context.Background(), "", "k", clk.Now()); err != nil || rec.Token != "crashed" {
		t.Errorf("record after refusals: %+v %v, want the lapsed holder's", rec, err)
	}
	// An operator resolves it with an answer (what idem resolve does).
	now := clk.Now()
	rec, err := b.store.Get(context.Background(), "", "k", now)
	if err != nil || rec.State != idem.StateInFlight || rec.LeaseUntil.After(now) {
		t.Fatalf("record after refusals: %+v %v, want in flight with its lease lapsed", rec, err)
	}
	if err := b.store.Complete(context.Background(), "", "k", rec.Token, &idem.Response{Status: 201, Body: []byte(`{"id":"resolved"}`)}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if a := b.post(t, "k", `{}`); a.status != 201 || string(a.body) != `{"id":"resolved"}` || a.header.Get(idem.ReplayedHeader) != "true" {
		t.Fatalf("after resolving: %d %s, want the replayed answer", a.status, a.body)
	}

	// Resolved by a release: the next request runs.
	crashedHolder(t, b, clk.Now(), "k2", `{}`)
	clk.Add(61 * time.Second)
	wantProblem(t, b.post(t, "k2", `{}`), 503, idem.CodeOutcomeUnknown)
	rec, err = b.store.Get(context.Background(), "", "k2", clk.Now())
	if err != nil {
		t.Fatal(err)
	}
	if err := b.store.Release(context.Background(), "", "k2", rec.Token); err != nil {
		t.Fatal(err)
	}
	if a := b.post(t, "k2", `{}`); a.status != 201 || a.header.Get(idem.ReplayedHeader) != "" {
		t.Fatalf("after a release: %d %s, want a fresh execution", a.status, a.body)
	}
	if n := b.orders.runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
}

func TestMarkOutcomeUnknownLeavesTheKeyInFlight(t *testing.T) {
	t.Parallel()
	for _, policy := range []idem.LapsedLease{idem.LapsedTakeOver, idem.LapsedRefuse} {
		t.Run(policy.String(), func(t *testing.T) {
			t.Parallel()
			clk := &clock{now: time.Now()}
			var mu sync.Mutex
			runs := 0
			store := memstore.New(nil)
			t.Cleanup(func() { _ = store.Close() })
			mw, err := idem.New(store, &idem.Config{NowFunc: clk.Now, Lease: time.Minute, LapsedLease: policy})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				runs++
				n := runs
				mu.Unlock()
				if n == 1 {
					if !idem.MarkOutcomeUnknown(r.Context()) {
						t.Error("MarkOutcomeUnknown reported false inside idem")
					}
					w.WriteHeader(http.StatusBadGateway)
					return
				}
				w.WriteHeader(http.StatusCreated)
			})))
			t.Cleanup(srv.Close)
			b := &bundle{store: store, server: srv, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}}
			if a := b.post(t, "k", `{}`); a.status != http.StatusBadGateway || a.header.Get(idem.ReplayedHeader) != "" {
				t.Fatalf("first: %d, want the handler's 502", a.status)
			}
			wantProblem(t, b.post(t, "k", `{}`), 409, idem.CodeKeyInUse)
			clk.Add(61 * time.Second)
			a := b.post(t, "k", `{}`)
			if policy == idem.LapsedRefuse {
				wantProblem(t, a, 503, idem.CodeOutcomeUnknown)
			} else if a.status != http.StatusCreated {
				t.Fatalf("after the lease lapsed: %d, want a second execution (201)", a.status)
			}
			mu.Lock()
			defer mu.Unlock()
			if want := map[idem.LapsedLease]int{idem.LapsedTakeOver: 2, idem.LapsedRefuse: 1}[policy]; runs != want {
				t.Errorf("handler ran %d times, want %d", runs, want)
			}
		})
	}
	if idem.MarkOutcomeUnknown(context.Background()) {
		t.Error("MarkOutcomeUnknown reported true outside idem")
	}
}

func TestLapsedLeaseValidation(t *testing.T) {
	t.Parallel()
	if err := (&idem.Config{LapsedLease: 7}).Validate(); err == nil {
		t.Error("LapsedLease 7 accepted")
	}
}
