package idem_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// stepClock is a clock the test moves.
type stepClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *stepClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *stepClock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// TestStepsOutliveTakeoversOnRealStores is the root package's
// TestStepRecordsOutliveTakeovers on SQLite and PostgreSQL, over loopback
// HTTP: A records "charge" and "ship" and leaves its outcome unknown (the
// record stays in flight, as after a crash); B takes the lapsed lease over
// 50 minutes later and stops before "ship"; C takes over 20 minutes after
// that, past A's start + TTL: "ship" is replayed, not run again with a new
// derived key. Failed before the fix (ship ran twice).
func TestStepsOutliveTakeoversOnRealStores(t *testing.T) {
	fpStores(t, func(t *testing.T, store idem.Store, flow idem.Flow) {
		clk := &stepClock{now: time.Now().Truncate(time.Millisecond)}
		mw, err := idem.New(store, &idem.Config{NowFunc: clk.Now, Flow: flow, TTL: time.Hour, Lease: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		runs := map[string][]string{}
		run := 0
		srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
		})))
		key := "order-" + t.Name()[len(t.Name())-6:]
		if a := postAnswer(t, srv, key); a.status != http.StatusServiceUnavailable {
			t.Fatalf("A: %d %s", a.status, a.body)
		}
		clk.Add(50 * time.Minute)
		if a := postAnswer(t, srv, key); a.status != http.StatusServiceUnavailable {
			t.Fatalf("B (a takeover): %d %s", a.status, a.body)
		}
		clk.Add(20 * time.Minute)
		if a := postAnswer(t, srv, key); a.status != http.StatusCreated {
			t.Fatalf("C (a takeover): %d %s", a.status, a.body)
		}
		mu.Lock()
		defer mu.Unlock()
		if run != 3 || len(runs["charge"]) != 1 || len(runs["ship"]) != 1 {
			t.Fatalf("handler runs %d; the steps ran with derived keys %v; want 3 runs and each step run once", run, runs)
		}
	})
}
