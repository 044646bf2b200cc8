package sqlitestore_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestSingleTxTakesOverLapsedClaim: a claim-then-complete request crashed and left
// its key in flight; once its lease lapsed, the single-transaction flow on the
// same route takes the key over (fenced) instead of answering 409 until the
// record expires.
func TestSingleTxTakesOverLapsedClaim(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	createOrders(t, db)
	store := newStore(t, db)
	srv := serve(t, store, &idem.Config{Flow: idem.FlowSingleTx}, orderHandler(nil))

	body := `{"item":"lamp"}`
	fp := idem.FingerprintV1(httptest.NewRequest(http.MethodPost, "/", strings.NewReader(body)), []byte(body))
	crashed := func(leaseLeft time.Duration) {
		now := time.Now()
		if _, claimed, err := store.Claim(context.Background(), idem.ClaimRequest{
			Key: "k", Fingerprint: fp, Token: "crashed", Now: now.Add(-time.Minute),
			LeaseUntil: now.Add(leaseLeft), ExpiresAt: now.Add(time.Hour),
		}); err != nil || !claimed {
			t.Fatalf("claim of the crashed request: %v %v", claimed, err)
		}
	}
	crashed(time.Hour) // lease still live
	if a := post(t, srv.URL, "k", "lamp"); a.status != http.StatusConflict || problemCode(a.body) != idem.CodeKeyInUse {
		t.Fatalf("while the crashed request's lease is live: %d %s, want 409", a.status, a.body)
	}
	if err := store.Release(context.Background(), "", "k", "crashed"); err != nil {
		t.Fatal(err)
	}
	crashed(-time.Second) // lease lapsed
	first := post(t, srv.URL, "k", "lamp")
	if first.status != http.StatusCreated || first.header.Get(idem.ReplayedHeader) != "" {
		t.Fatalf("after the lease lapsed: %d %s, want a fresh 201", first.status, first.body)
	}
	if a := post(t, srv.URL, "k", "lamp"); a.header.Get(idem.ReplayedHeader) != "true" || a.body != first.body {
		t.Fatalf("retry: %d %s, want the replay of %s", a.status, a.body, first.body)
	}
	if n := countOrders(t, db); n != 1 {
		t.Fatalf("%d orders, want 1", n)
	}
	if err := store.Complete(context.Background(), "", "k", "crashed", &idem.Response{Status: 200}, time.Now(), time.Now().Add(time.Hour)); err == nil {
		t.Fatal("the crashed request could still complete after the takeover")
	}
}
