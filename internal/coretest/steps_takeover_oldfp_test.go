package idem_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestStepsOutliveTakeoversAcrossFingerprintVersions: as
// TestStepsOutliveTakeoversOnRealStores, with A fingerprinted under
// FingerprintV2 (before an upgrade) and B and C under the default v3. A
// records "charge" and "ship" and leaves its outcome unknown; B takes the
// lapsed lease over 50 minutes later and stops before "ship"; C takes over 20
// minutes after that, past A's start + TTL. B's takeover must move the
// expiry of A's steps although they carry the v2 fingerprint (the same
// request, compared with the v2 algorithm): "ship" is replayed by C, not run
// again with a new derived key. Failed before: ship ran twice.
func TestStepsOutliveTakeoversAcrossFingerprintVersions(t *testing.T) {
	check := func(t *testing.T, store idem.Store, flow idem.Flow) {
		clk := &stepClock{now: time.Now().Truncate(time.Millisecond)}
		var mu sync.Mutex
		runs := map[string][]string{}
		run := 0
		handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			run++
			n := run
			mu.Unlock()
			step := func(name string) error {
				_, err := idem.Step(r.Context(), name, func(ctx context.Context, key string) (string, error) {
					mu.Lock()
					runs[name] = append(runs[name], key)
					mu.Unlock()
					return name + "-" + key[5:13], nil
				})
				return err
			}
			if err := step("charge"); err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			if n == 2 {
				idem.MarkOutcomeUnknown(r.Context())
				w.WriteHeader(http.StatusServiceUnavailable)
				return
			}
			if err := step("ship"); err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			if n == 1 {
				idem.MarkOutcomeUnknown(r.Context())
				w.WriteHeader(http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
		mwOld, err := idem.New(store, &idem.Config{NowFunc: clk.Now, Flow: flow, TTL: time.Hour, Lease: time.Minute, FingerprintFunc: idem.FingerprintV2})
		if err != nil {
			t.Fatal(err)
		}
		mwNew, err := idem.New(store, &idem.Config{NowFunc: clk.Now, Flow: flow, TTL: time.Hour, Lease: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		old, cur := serveLoopback(t, mwOld(handler)), serveLoopback(t, mwNew(handler))
		key := "order-oldfp"
		if a := postAnswer(t, old, key); a.status != http.StatusServiceUnavailable {
			t.Fatalf("A: %d %s", a.status, a.body)
		}
		clk.Add(50 * time.Minute)
		if a := postAnswer(t, cur, key); a.status != http.StatusServiceUnavailable {
			t.Fatalf("B: %d %s", a.status, a.body)
		}
		clk.Add(20 * time.Minute)
		if a := postAnswer(t, cur, key); a.status != http.StatusCreated {
			t.Fatalf("C: %d %s", a.status, a.body)
		}
		mu.Lock()
		defer mu.Unlock()
		if len(runs["charge"]) != 1 || len(runs["ship"]) != 1 {
			t.Errorf("charge ran %d times, ship %d times (%v); want once each", len(runs["charge"]), len(runs["ship"]), runs)
		}
	}
	t.Run("memstore", func(t *testing.T) {
		t.Parallel()
		check(t, newMem(t), idem.FlowAuto)
	})
	fpStores(t, check)
}
