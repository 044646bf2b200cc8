package idem_test

import (
	"context"
	"encoding/json"
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

// TestStepOtherRequestFirstStepNeverRecorded: the step names depend on the
// body (reserve-<item>). A request for item a reserves it as a step and
// answers 503 (not kept: the key is released, the step's record stays). The
// key is then sent for item b, whose first step, reserve-b, is one the first
// request never recorded: it is not run (no provider call for b), the answer
// is 422 idempotency_key_reused, and nothing is stored (no step record of
// reserve-b, the key free). The first request, retried as it was sent, still
// recovers: 201 with its recorded reservation, one provider call in all. On
// memstore, SQLite and PostgreSQL, in both flows. Failed before: reserve-b
// ran (a provider call for b) before the 422 of a later step, or the second
// request got 201.
func TestStepOtherRequestFirstStepNeverRecorded(t *testing.T) {
	check := func(t *testing.T, store idem.Store, flow idem.Flow) {
		mw, err := idem.New(store, &idem.Config{Flow: flow, KeepFunc: func(s int) bool { return s < 500 }})
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		calls := map[string]int{}
		var fail atomic.Bool
		fail.Store(true)
		srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			var in struct{ Item string }
			_ = json.NewDecoder(r.Body).Decode(&in)
			res, err := idem.Step(r.Context(), "reserve-"+in.Item, func(ctx context.Context, key string) (string, error) {
				mu.Lock()
				calls[in.Item]++
				mu.Unlock()
				return "res_" + in.Item, nil
			})
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			if _, err := idem.Step(r.Context(), "ship", func(ctx context.Context, key string) (string, error) {
				return "shipped " + res, nil
			}); err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			if fail.Load() {
				http.Error(w, "the database went away", http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "order of %s: %s", in.Item, res)
		})))
		key := "first-" + flow.String()
		post := func(body string) (int, string) {
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
					return resp.StatusCode, string(b)
				}
				time.Sleep(50 * time.Millisecond)
			}
			t.Fatal("409 for 2.5 s")
			return 0, ""
		}
		count := func(item string) int {
			mu.Lock()
			defer mu.Unlock()
			return calls[item]
		}
		if st, b := post(`{"item":"a"}`); st != http.StatusServiceUnavailable || count("a") != 1 {
			t.Fatalf("first request: %d %s, %d calls; want 503 after one call", st, b, count("a"))
		}
		fail.Store(false)
		st, b := post(`{"item":"b"}`)
		var p idem.Problem
		_ = json.Unmarshal([]byte(b), &p)
		if st != http.StatusUnprocessableEntity || p.Code != idem.CodeKeyReused {
			t.Errorf("another request with the released key, its first step one the first never recorded: %d %s; want 422 %s", st, b, idem.CodeKeyReused)
		}
		if n := count("b"); n != 0 {
			t.Errorf("the second request's first step (reserve-b) ran %d times before the 422, want never", n)
		}
		recs, err := store.(idem.StepStore).GetSteps(context.Background(), idem.StoredScope(""), key, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		if len(recs) == 0 || recs[0].Name != "reserve-a" {
			t.Errorf("after the 422 the key has step records %+v, want the first request's reserve-a first", recs)
		}
		for _, r := range recs {
			if r.Name != "reserve-a" && r.Name != "ship" {
				t.Errorf("after the 422 the key has a step record %q (%+v), want only the first request's", r.Name, r)
			}
		}
		// Nothing stored, the key free: the first request, as it was sent,
		// carries on from its recorded steps.
		if st, b := post(`{"item":"a"}`); st != http.StatusCreated || b != "order of a: res_a" || count("a") != 1 {
			t.Errorf("the first request retried: %d %s, %d calls; want 201 with the recorded reservation and one call", st, b, count("a"))
		}
		if st, b := post(`{"item":"b"}`); st != http.StatusUnprocessableEntity || count("b") != 0 {
			t.Errorf("another request once the first one's answer is kept: %d %s, %d calls; want 422 and none", st, b, count("b"))
		}
	}
	t.Run("memstore", func(t *testing.T) {
		t.Parallel()
		check(t, newMem(t), idem.FlowAuto)
	})
	fpStores(t, check)
}

// TestStepOtherRequestFirstUnderOlderFingerprint: the first step of an
// execution is checked against every step record of the key, version-aware.
// A request fingerprinted under FingerprintV2 records step a and answers 503
// (not kept). Another body under the default FingerprintV3, whose first step
// is c (never recorded), is refused (422) without running c. The first
// request again, fingerprinted under v3 and beginning with a step b it never
// recorded (its step names come from a header, outside the fingerprint), is
// the same request: b runs, a is replayed, 201. On memstore, SQLite and
// PostgreSQL, both flows.
func TestStepOtherRequestFirstUnderOlderFingerprint(t *testing.T) {
	check := func(t *testing.T, store idem.Store, flow idem.Flow) {
		var mu sync.Mutex
		calls := map[string]int{}
		handler := func(status int) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				body, _ := io.ReadAll(r.Body)
				var out []string
				for _, name := range strings.Split(r.Header.Get("X-Steps"), ",") {
					v, err := idem.Step(r.Context(), name, func(ctx context.Context, key string) (string, error) {
						mu.Lock()
						calls[name]++
						mu.Unlock()
						return name + "_" + string(body), nil
					})
					if err != nil {
						http.Error(w, err.Error(), http.StatusBadGateway)
						return
					}
					out = append(out, v)
				}
				w.WriteHeader(status)
				_, _ = io.WriteString(w, strings.Join(out, " "))
			})
		}
		serve := func(cfg *idem.Config, status int) string {
			cfg.Flow = flow
			cfg.KeepFunc = func(s int) bool { return s < 500 }
			mw, err := idem.New(store, cfg)
			if err != nil {
				t.Fatal(err)
			}
			return serveLoopback(t, mw(handler(status))).URL + "/orders"
		}
		old := serve(&idem.Config{FingerprintFunc: idem.FingerprintV2}, http.StatusServiceUnavailable)
		cur := serve(&idem.Config{}, http.StatusCreated)
		post := func(url, steps, body string) (int, string) {
			t.Helper()
			for range 50 { // the single-tx flow may still be rolling back: 409 meanwhile
				req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
				req.Header.Set("Idempotency-Key", "fp-first")
				req.Header.Set("X-Steps", steps)
				resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}).Do(req)
				if err != nil {
					t.Fatal(err)
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusConflict {
					return resp.StatusCode, string(b)
				}
				time.Sleep(50 * time.Millisecond)
			}
			t.Fatal("409 for 2.5 s")
			return 0, ""
		}
		count := func(name string) int {
			mu.Lock()
			defer mu.Unlock()
			return calls[name]
		}
		if st, b := post(old, "a", `10`); st != http.StatusServiceUnavailable || count("a") != 1 {
			t.Fatalf("first request (v2): %d %s", st, b)
		}
		if st, b := post(cur, "c", `20`); st != http.StatusUnprocessableEntity || count("c") != 0 {
			t.Errorf("another request (v3), first step c: %d %s, c ran %d times; want 422 and never", st, b, count("c"))
		}
		if st, b := post(cur, "b,a", `10`); st != http.StatusCreated || b != "b_10 a_10" || count("a") != 1 || count("b") != 1 {
			t.Errorf("the first request again under v3, first step b: %d %s, a ran %d times, b %d; want 201 \"b_10 a_10\", each once", st, b, count("a"), count("b"))
		}
	}
	t.Run("memstore", func(t *testing.T) {
		t.Parallel()
		check(t, newMem(t), idem.FlowAuto)
	})
	fpStores(t, check)
}
