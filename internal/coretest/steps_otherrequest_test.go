package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestStepKeyReusedForAnotherRequest: a request charges 10 as a step and
// answers 503 (not kept: the key is released, the step's record stays). The
// key is then sent with another body (amount 20): the step is not run, nor
// its recorded charge of 10 handed to the order of 20 — the middleware
// answers 422 idempotency_key_reused instead of the handler, and stores
// nothing. The first request, retried as it was sent, still gets its
// recorded charge (one provider call in all) and 201. On memstore, SQLite
// and PostgreSQL, in both flows. Failed before: the second request got 201
// "order of 20 paid by the charge of 10".
func TestStepKeyReusedForAnotherRequest(t *testing.T) {
	check := func(t *testing.T, store idem.Store, flow idem.Flow) {
		mw, err := idem.New(store, &idem.Config{Flow: flow, KeepFunc: func(s int) bool { return s < 500 }})
		if err != nil {
			t.Fatal(err)
		}
		var calls atomic.Int32
		var fail atomic.Bool
		fail.Store(true)
		var mu sync.Mutex
		var stepErrs []error
		srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			var in struct{ Amount int }
			_ = json.NewDecoder(r.Body).Decode(&in)
			charged, err := idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (int, error) {
				calls.Add(1)
				return in.Amount, nil
			})
			if err != nil {
				mu.Lock()
				stepErrs = append(stepErrs, err)
				mu.Unlock()
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			if fail.Load() {
				http.Error(w, "the database went away", http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "order of %d paid by the charge of %d", in.Amount, charged)
		})))
		key := "reuse-" + flow.String()
		post := func(body string) (int, string, string) {
			t.Helper()
			for range 50 { // the single-tx flow may still be rolling back: 409 meanwhile
				req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(body))
				req.Header.Set("Idempotency-Key", key)
				resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}).Do(req)
				if err != nil {
					t.Fatal(err)
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusConflict {
					return resp.StatusCode, resp.Header.Get("Content-Type"), string(b)
				}
				time.Sleep(50 * time.Millisecond)
			}
			t.Fatal("409 for 2.5 s")
			return 0, "", ""
		}
		if st, _, b := post(`{"amount":10}`); st != http.StatusServiceUnavailable || calls.Load() != 1 {
			t.Fatalf("first request: %d %s, %d calls; want 503 after one call", st, b, calls.Load())
		}
		fail.Store(false)
		st, ct, b := post(`{"amount":20}`)
		var p idem.Problem
		_ = json.Unmarshal([]byte(b), &p)
		if st != http.StatusUnprocessableEntity || ct != "application/problem+json" || p.Code != idem.CodeKeyReused {
			t.Errorf("another request with the released key: %d %s %s; want 422 %s", st, ct, b, idem.CodeKeyReused)
		}
		if calls.Load() != 1 {
			t.Errorf("the provider was called %d times, want once", calls.Load())
		}
		mu.Lock()
		if len(stepErrs) != 1 || !errors.Is(stepErrs[0], idem.ErrStepOtherRequest) {
			t.Errorf("the second request's Step returned %v, want ErrStepOtherRequest", stepErrs)
		}
		mu.Unlock()
		// Nothing stored, the key free: the first request, as it was sent,
		// carries on from its recorded step.
		if st, _, b := post(`{"amount":10}`); st != http.StatusCreated || b != "order of 10 paid by the charge of 10" || calls.Load() != 1 {
			t.Errorf("the first request retried: %d %s, %d calls; want 201 with the recorded charge and one call", st, b, calls.Load())
		}
		if st, _, b := post(`{"amount":20}`); st != http.StatusUnprocessableEntity {
			t.Errorf("another request once the first one's answer is kept: %d %s, want 422", st, b)
		}
	}
	t.Run("memstore", func(t *testing.T) {
		t.Parallel()
		check(t, newMem(t), idem.FlowAuto)
	})
	fpStores(t, check)
}

// TestStepRecordedUnderOlderFingerprint: a step recorded by a request
// fingerprinted under FingerprintV2 (a release before), whose answer was not
// kept, is the same request's step for a retry fingerprinted under the
// default FingerprintV3 (compared with the v2 algorithm, as records are): it
// is replayed, not refused, and the retry answers 201 with one provider call.
// A different body under v3 is still refused.
func TestStepRecordedUnderOlderFingerprint(t *testing.T) {
	t.Parallel()
	store := newMem(t)
	var calls atomic.Int32
	handler := func(status int) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			id, err := idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (string, error) {
				calls.Add(1)
				return "ch_" + string(body), nil
			})
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			w.WriteHeader(status)
			_, _ = io.WriteString(w, id)
		})
	}
	serve := func(cfg *idem.Config, status int) string {
		cfg.KeepFunc = func(s int) bool { return s < 500 }
		mw, err := idem.New(store, cfg)
		if err != nil {
			t.Fatal(err)
		}
		return serveLoopback(t, mw(handler(status))).URL + "/orders"
	}
	old := serve(&idem.Config{FingerprintFunc: idem.FingerprintV2}, http.StatusServiceUnavailable)
	cur := serve(&idem.Config{}, http.StatusCreated)
	if st, b := send(t, old, "fp-old", `10`); st != http.StatusServiceUnavailable {
		t.Fatalf("first request (v2): %d %s", st, b)
	}
	if st, b := send(t, cur, "fp-old", `20`); st != http.StatusUnprocessableEntity {
		t.Errorf("another request (v3): %d %s, want 422", st, b)
	}
	if st, b := send(t, cur, "fp-old", `10`); st != http.StatusCreated || b != "ch_10" || calls.Load() != 1 {
		t.Errorf("the first request again, fingerprinted under v3: %d %s, %d calls; want 201 ch_10 and one call", st, b, calls.Load())
	}
}
