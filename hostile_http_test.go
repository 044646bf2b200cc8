package idem_test

import (
	"context"
	"net/http"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// panicOnce is a ClaimObserver that panics the first time it sees kind.
type panicOnce struct {
	kind   idem.EventKind
	panics atomic.Int64
}

func (p *panicOnce) ObservesClaims() bool { return true }

func (p *panicOnce) Observe(_ context.Context, e idem.Event) {
	if e.Kind == p.kind && p.panics.Add(1) == 1 {
		panic(http.ErrAbortHandler)
	}
}

// An Observer that panics on the event that starts a request's hold on its key
// (EventClaimed, or EventTakenOver before it) must not leave the key held: the
// panic ends the request as a handler's panic does, the key is released (the
// single transaction rolled back), and the retry runs at once. Before the fix
// those events came before the cleanup was in place, so the claim stayed in
// flight for the whole lease (30 s) and the retry got 409 — under LapsedRefuse,
// 503 until an operator resolved the key.
func TestObserverPanicOnClaimReleasesTheKey(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name     string
		flow     idem.Flow
		kind     idem.EventKind
		takeOver bool // plant a lapsed in-flight record first
	}{
		{"claim-complete/claimed", idem.FlowClaimComplete, idem.EventClaimed, false},
		{"claim-complete/taken-over", idem.FlowClaimComplete, idem.EventTakenOver, true},
		{"single-tx/claimed", idem.FlowSingleTx, idem.EventClaimed, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			var store idem.Store
			if c.flow == idem.FlowSingleTx {
				db, err := embedded.Open(filepath.Join(t.TempDir(), "obs.db"))
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
				store = s
			} else {
				store = newMem(t)
			}
			if c.takeOver {
				past := time.Now().Add(-time.Hour)
				_, claimed, err := store.Claim(context.Background(), idem.ClaimRequest{
					Key: "k", Fingerprint: "fp", Token: "crashed-holder-token-0",
					Now: past, LeaseUntil: past.Add(time.Second), ExpiresAt: past.Add(48 * time.Hour),
				})
				if err != nil || !claimed {
					t.Fatalf("planting a lapsed claim: %v %v", claimed, err)
				}
			}
			obs := &panicOnce{kind: c.kind}
			var runs atomic.Int64
			mw, err := idem.New(store, &idem.Config{
				Flow: c.flow, Observer: obs,
				FingerprintFunc: func(*http.Request, []byte) string { return "fp" },
			})
			if err != nil {
				t.Fatal(err)
			}
			srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				w.WriteHeader(http.StatusCreated)
			})))
			req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"item":"book"}`))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Idempotency-Key", "k")
			client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
			if resp, err := client.Do(req); err == nil {
				resp.Body.Close()
				t.Fatalf("the request whose Observer panicked got %d, want a dropped connection", resp.StatusCode)
			}
			if n := obs.panics.Load(); n != 1 {
				t.Fatalf("the Observer saw the %v event %d times, want 1", c.kind, n)
			}
			if a := postAnswer(t, srv, "k"); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "" {
				t.Fatalf("the retry: %d %s, want a fresh 201 (the key released)", a.status, a.body)
			}
			if a := postAnswer(t, srv, "k"); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "true" {
				t.Fatalf("the second retry: %d %s, want the replay", a.status, a.body)
			}
			if n := runs.Load(); n != 1 {
				t.Errorf("the handler ran %d times, want once", n)
			}
		})
	}
}
