package idem_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/steptest"
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
	check := steptest.OtherRequestFirstStep
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
