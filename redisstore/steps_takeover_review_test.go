package redisstore_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestStepsOutliveTakeovers: on Redis, over loopback HTTP, A records
// "charge" and "ship" and leaves its outcome unknown (the record stays in
// flight); B takes the lapsed lease over 50 minutes later and stops before
// "ship"; C takes over 20 minutes after that, past A's start + TTL: "ship" is
// replayed, not run again with a new derived key (the middleware's takeover
// moves the operation's step records' expiry, in the hash and in Redis).
func TestStepsOutliveTakeovers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var cmu sync.Mutex
	clk := time.Now()
	now := func() time.Time { cmu.Lock(); defer cmu.Unlock(); return clk }
	advance := func(d time.Duration) { cmu.Lock(); clk = clk.Add(d); cmu.Unlock() }
	mw, err := idem.New(b.store, &idem.Config{NowFunc: now, TTL: time.Hour, Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	runs := map[string]int{}
	run := 0
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		run++
		n := run
		mu.Unlock()
		for i, name := range []string{"charge", "ship"} {
			if n == 2 && i == 1 {
				break
			}
			if _, err := idem.Step(r.Context(), name, func(ctx context.Context, key string) (string, error) {
				mu.Lock()
				runs[name]++
				mu.Unlock()
				return key, nil
			}); err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
		}
		if n < 3 {
			idem.MarkOutcomeUnknown(r.Context())
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	t.Cleanup(srv.Close)
	post := func() int {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "order-takeovers")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for i, want := range []int{http.StatusServiceUnavailable, http.StatusServiceUnavailable, http.StatusCreated} {
		if s := post(); s != want {
			t.Fatalf("execution %d: %d, want %d", i+1, s, want)
		}
		advance([]time.Duration{50 * time.Minute, 20 * time.Minute, 0}[i])
	}
	mu.Lock()
	defer mu.Unlock()
	if run != 3 || runs["charge"] != 1 || runs["ship"] != 1 {
		t.Fatalf("handler runs %d, step runs %v; want 3 runs and each step once", run, runs)
	}
}
