// Package expirytest is a middleware-level test shared by the store packages:
// a complete record reaching its expiry while duplicates on servers with
// different clocks and janitors race for it.
package expirytest

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/racetest"
)

// counter answers 201 with the number of its execution, so that a replay names
// the execution it replays.
type counter struct{ runs atomic.Int64 }

func (c *counter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := c.runs.Add(1)
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"exec":%d}`, n)
}

// Boundary runs rounds of this race on stores made by newStore, with flow: a
// complete record (TTL one hour) reaches its ExpiresAt exactly while n
// duplicates, released from one barrier, arrive on two servers sharing the
// store — half on one whose clock reads 1 ms before ExpiresAt, half on one
// whose clock reads ExpiresAt — and (after the first round, where the store's
// own expiry check alone decides) janitors sweep at ExpiresAt in batches of
// one. The operation runs exactly once more (whichever request claims first
// runs it), the server at ExpiresAt never replays the expired execution, every
// other answer is a replay or a 409 (and a 409 only once the second execution
// exists), and afterwards the second execution is replayed: the janitors
// deleted nothing live.
func Boundary(t *testing.T, newStore func(t *testing.T) idem.Store, flow idem.Flow) {
	t.Helper()
	const (
		ttl    = time.Hour
		n      = 24
		rounds = 4
	)
	store := newStore(t)
	for round := range rounds {
		t0 := time.Now().Truncate(time.Millisecond).Add(-ttl)
		expires := t0.Add(ttl)
		h := &counter{}
		serve := func(now time.Time) string {
			mw, err := idem.New(store, &idem.Config{Flow: flow, TTL: ttl, Lease: 30 * time.Second, NowFunc: func() time.Time { return now }})
			if err != nil {
				t.Fatalf("New: %v", err)
			}
			srv := httptest.NewServer(mw(h))
			t.Cleanup(srv.Close)
			return srv.URL
		}
		first, before, at := serve(t0), serve(expires.Add(-time.Millisecond)), serve(expires)
		key := fmt.Sprintf("expiry-%d-%d", round, time.Now().UnixNano())
		body := []byte(`{"item":"chair"}`)
		post := func(url string) racetest.Result {
			r := racetest.Fire(1, racetest.Post(url, key, body, nil))[0]
			if r.Err != nil {
				t.Fatalf("POST %s: %v", url, r.Err)
			}
			return r
		}
		if r := post(first); r.Status != http.StatusCreated || string(r.Body) != `{"exec":1}` {
			t.Fatalf("round %d: first = %d %s", round, r.Status, r.Body)
		}

		janitor := &idem.Janitor{Store: store, BatchSize: 1, NowFunc: func() time.Time { return expires }}
		var jwg sync.WaitGroup
		start := make(chan struct{})
		for range min(round, 2) { // round 0 without janitors: the store's own check decides
			jwg.Go(func() {
				<-start
				for range 5 {
					if _, err := janitor.Sweep(context.Background()); err != nil {
						t.Errorf("Sweep: %v", err)
					}
				}
			})
		}
		urlOf := func(i int) string {
			if i%2 == 0 {
				return before
			}
			return at
		}
		close(start)
		results := racetest.Fire(n, func(i int) (*http.Request, error) { return racetest.Post(urlOf(i), key, body, nil)(i) })
		jwg.Wait()

		fresh, conflicts, oldReplays := 0, 0, 0
		for i, r := range results {
			if r.Err != nil {
				t.Fatalf("round %d request %d: %v", round, i, r.Err)
			}
			replayed := r.Header.Get(idem.ReplayedHeader) == "true"
			switch {
			case r.Status == http.StatusConflict:
				conflicts++
			case r.Status == http.StatusCreated && string(r.Body) == `{"exec":2}`:
				if !replayed {
					fresh++
				}
			case r.Status == http.StatusCreated && replayed && string(r.Body) == `{"exec":1}`:
				oldReplays++
				if urlOf(i) == at {
					t.Errorf("round %d request %d: at ExpiresAt it got the replay of the expired execution", round, i)
				}
			default:
				t.Errorf("round %d request %d: %d replayed=%v %s", round, i, r.Status, replayed, r.Body)
			}
		}
		if got := h.runs.Load(); got != 2 || fresh != 1 {
			t.Fatalf("round %d: the handler ran %d times (%d fresh answers), want 2 (one after the expiry); %d 409s, %d replays of the expired execution", round, got, fresh, conflicts, oldReplays)
		}
		if r := post(at); r.Header.Get(idem.ReplayedHeader) != "true" || string(r.Body) != `{"exec":2}` {
			t.Fatalf("round %d: after the race %d %s, want the replay of execution 2", round, r.Status, r.Body)
		}
	}
}
