package idem_test

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/expirytest"
	"github.com/idemkit/idem/internal/racetest"
	"github.com/idemkit/idem/memstore"
)

// execCounter is a handler that counts its executions and answers with the
// number of each, so that a replay names the execution it replays. When gate is
// set, the first execution reports on started and waits for gate (or for its
// context to end); later ones report and answer at once.
type execCounter struct {
	runs    atomic.Int64
	started chan int64
	gate    chan struct{}
}

func (e *execCounter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := e.runs.Add(1)
	_, _ = io.Copy(io.Discard, r.Body)
	if e.started != nil {
		e.started <- n
	}
	if e.gate != nil && n == 1 {
		select {
		case <-e.gate:
		case <-r.Context().Done():
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"exec":%d}`, n)
}

// serveWith serves h behind a middleware on store with cfg, over loopback.
func serveWith(t *testing.T, store idem.Store, cfg *idem.Config, h http.Handler) string {
	t.Helper()
	mw, err := idem.New(store, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	srv := httptest.NewServer(mw(h))
	t.Cleanup(srv.Close)
	return srv.URL
}

func postOnce(t *testing.T, url, key, body string) racetest.Result {
	t.Helper()
	res := racetest.Fire(1, racetest.Post(url, key, []byte(body), nil))[0]
	if res.Err != nil {
		t.Fatalf("POST %s: %v", url, res.Err)
	}
	return res
}

// TestExpiryBoundaryConcurrent: expirytest.Boundary on memstore and on SQLite
// in both flows (the other stores run it in their packages).
func TestExpiryBoundaryConcurrent(t *testing.T) {
	t.Parallel()
	onLocalStores(t, expirytest.Boundary)
}

// TestClockSkewLimit: two servers share a store, B's clock ahead of A's. A's
// lease is renewed every Lease/3 on the wall clock, within a scheduler tick
// (at most Lease/12) of that, so just before a renewal A's lease has 7/12 of
// Lease left by A's clock. The README promises that clocks within half the
// Lease of each other never take over a live lease: B, half a Lease ahead,
// hears 409 at that worst moment. It also states the limit: B 0.6 Lease ahead
// (less than the Lease) takes the live lease over and runs the handler a second
// time while A's still runs; A's completion is fenced out, and the key's
// outcome is B's.
func TestClockSkewLimit(t *testing.T) {
	t.Parallel()
	const lease = time.Minute // no renewal falls due on the wall clock during the test
	for _, tc := range []struct {
		name     string
		skew     time.Duration
		takeover bool
	}{
		{"half a lease ahead", lease / 2, false},
		{"0.6 lease ahead", lease * 6 / 10, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			store := memstore.New(nil)
			t.Cleanup(func() { _ = store.Close() })
			var base atomic.Int64 // A's clock, in ns past t0
			t0 := time.Now()
			clockA := func() time.Time { return t0.Add(time.Duration(base.Load())) }
			clockB := func() time.Time { return clockA().Add(tc.skew) }
			h := &execCounter{started: make(chan int64, 4), gate: make(chan struct{})}
			urlA := serveWith(t, store, &idem.Config{Lease: lease, NowFunc: clockA}, h)
			urlB := serveWith(t, store, &idem.Config{Lease: lease, NowFunc: clockB}, h)
			key, body := "skew", `{"item":"chair"}`

			answerA := make(chan racetest.Result, 1)
			go func() { answerA <- racetest.Fire(1, racetest.Post(urlA, key, []byte(body), nil))[0] }()
			<-h.started
			// A's renewal is due: Lease/3 plus a tick (Lease/12) since its claim.
			base.Store(int64(lease/3 + lease/12))

			b := racetest.Fire(1, racetest.Post(urlB, key, []byte(body), nil))[0]
			if b.Err != nil {
				t.Fatal(b.Err)
			}
			if !tc.takeover {
				close(h.gate)
				a := <-answerA
				if b.Status != http.StatusConflict || a.Status != http.StatusCreated {
					t.Fatalf("B = %d %s, A = %d %s; want 409 for B (A's lease is live) and A's 201", b.Status, b.Body, a.Status, a.Body)
				}
				if n := h.runs.Load(); n != 1 {
					t.Fatalf("handler ran %d times, want 1", n)
				}
				return
			}
			// B took over: its handler started while A's still runs.
			if b.Status != http.StatusCreated || string(b.Body) != `{"exec":2}` {
				t.Fatalf("B = %d %s; want B's own execution (the limit the README states)", b.Status, b.Body)
			}
			close(h.gate)
			a := <-answerA
			if a.Err != nil {
				t.Fatal(a.Err)
			}
			// memstore has no transaction to roll back: A's effects happened and its
			// client hears them, but its completion was fenced out (B's is stored).
			if a.Status != http.StatusCreated || !bytes.Equal(a.Body, []byte(`{"exec":1}`)) {
				t.Fatalf("A = %d %s; want its own 201", a.Status, a.Body)
			}
			if n := h.runs.Load(); n != 2 {
				t.Fatalf("handler ran %d times, want 2", n)
			}
			// Both servers now replay B's outcome.
			for _, u := range []string{urlA, urlB} {
				if r := postOnce(t, u, key, body); r.Header.Get(idem.ReplayedHeader) != "true" || !strings.Contains(string(r.Body), `"exec":2`) {
					t.Fatalf("replay = %d %s, want execution 2", r.Status, r.Body)
				}
			}
		})
	}
}
