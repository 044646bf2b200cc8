package steptest

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// OtherRequestFirstStep proves, over loopback HTTP through the middleware in
// flow on store, that a request whose first step is one another request of
// the same key never recorded does not run it. The step names depend on the
// body (reserve-<item>). A request for item a reserves it as a step and
// answers 503 (not kept: the key is released, the step's record stays). The
// key is then sent for item b, whose first step, reserve-b, the first request
// never recorded: it is not run, the answer is 422 idempotency_key_reused,
// and nothing is stored (no record of reserve-b, the key free); the first
// request, retried as it was sent, recovers (201, one provider call in all).
func OtherRequestFirstStep(t *testing.T, store idem.Store, flow idem.Flow) {
	t.Helper()
	check := func(t *testing.T, store idem.Store, flow idem.Flow) {
		mw, err := idem.New(store, &idem.Config{Flow: flow, KeepFunc: func(s int) bool { return s < 500 }})
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		calls := map[string]int{}
		var fail atomic.Bool
		fail.Store(true)
		srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
		t.Cleanup(srv.Close)
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
	check(t, store, flow)
}
