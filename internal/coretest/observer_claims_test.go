package idem_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// claimCounter is a ClaimObserver that keeps a gauge of the claims held, and
// every event it saw.
type claimCounter struct {
	mu      sync.Mutex
	held    int
	maxHeld int
	claimed int
	ended   int
	kinds   map[idem.EventKind]int
	bad     []string
}

func (c *claimCounter) ObservesClaims() bool { return true }

func (c *claimCounter) Observe(_ context.Context, e idem.Event) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.kinds == nil {
		c.kinds = map[idem.EventKind]int{}
	}
	c.kinds[e.Kind]++
	if e.Kind == idem.EventClaimed {
		if e.Claimed {
			c.bad = append(c.bad, "an EventClaimed with Claimed set")
		}
		c.claimed++
		c.held++
		c.maxHeld = max(c.maxHeld, c.held)
		return
	}
	if e.Claimed {
		if e.Kind == idem.EventTakenOver {
			c.bad = append(c.bad, "taken_over with Claimed set: it comes before the claim")
		}
		c.ended++
		c.held--
	}
}

// TestClaimObserverCountsEveryHold drives many concurrent requests — executed,
// replayed, refused in flight, panicking, not kept — through both flows, and
// checks that every EventClaimed is matched by exactly one later event with
// Claimed set: a gauge built on them returns to zero. A plain Observer never
// sees EventClaimed.
func TestClaimObserverCountsEveryHold(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			db, err := embedded.Open(filepath.Join(t.TempDir(), "claims.db"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = db.Close() })
			var store idem.Store
			if flow == idem.FlowSingleTx {
				s, err := sqlitestore.New(db, &sqlitestore.Config{Table: "claims_records"})
				if err != nil {
					t.Fatal(err)
				}
				if err := s.Migrate(context.Background()); err != nil {
					t.Fatal(err)
				}
				store = s
			} else {
				m := memstore.New(nil)
				t.Cleanup(func() { _ = m.Close() })
				store = m
			}
			counter := &claimCounter{}
			var plainMu sync.Mutex
			plain := map[idem.EventKind]int{}
			plainObs := idem.ObserverFunc(func(_ context.Context, e idem.Event) {
				plainMu.Lock()
				plain[e.Kind]++
				plainMu.Unlock()
			})
			handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				switch {
				case strings.HasPrefix(r.URL.Path, "/panic"):
					panic(http.ErrAbortHandler)
				case strings.HasPrefix(r.URL.Path, "/fail"):
					w.WriteHeader(http.StatusInternalServerError) // not kept: released
				default:
					w.WriteHeader(http.StatusCreated)
				}
			})
			keep := func(status int) bool { return status < 500 }
			var servers []*httptest.Server
			for _, obs := range []idem.Observer{counter, plainObs} {
				mw, err := idem.New(store, &idem.Config{Flow: flow, Observer: obs, KeepFunc: keep})
				if err != nil {
					t.Fatal(err)
				}
				srv := httptest.NewServer(mw(handler))
				t.Cleanup(srv.Close)
				servers = append(servers, srv)
			}
			const n = 24
			var wg sync.WaitGroup
			start := make(chan struct{})
			for i := range n {
				for _, path := range []string{"/ok", "/panic", "/fail"} {
					for _, srv := range servers {
						for range 2 { // the same key twice at once: 409 or a replay for one
							wg.Add(1)
							go func() {
								defer wg.Done()
								<-start
								req, _ := http.NewRequest("POST", srv.URL+path, strings.NewReader("{}"))
								req.Header.Set("Idempotency-Key", fmt.Sprintf("%s-%s-%d", strings.TrimPrefix(srv.URL, "http://"), path, i))
								resp, err := http.DefaultClient.Do(req)
								if err == nil {
									resp.Body.Close()
								}
							}()
						}
					}
				}
			}
			close(start)
			wg.Wait()

			counter.mu.Lock()
			defer counter.mu.Unlock()
			if len(counter.bad) > 0 {
				t.Errorf("misplaced Claimed flags: %v", counter.bad)
			}
			if counter.held != 0 || counter.claimed != counter.ended {
				t.Errorf("claimed %d, ended %d, held at the end %d; want every claim ended once (events %v)", counter.claimed, counter.ended, counter.held, counter.kinds)
			}
			// Every key was claimed at least once; panics and 500s release, so
			// their second request may claim again.
			if counter.claimed < 3*n {
				t.Errorf("claimed %d times, want at least %d (events %v)", counter.claimed, 3*n, counter.kinds)
			}
			if counter.kinds[idem.EventReleased] < 2*n {
				t.Errorf("released %d times, want at least %d (every panic and every 500)", counter.kinds[idem.EventReleased], 2*n)
			}
			plainMu.Lock()
			defer plainMu.Unlock()
			if plain[idem.EventClaimed] != 0 {
				t.Errorf("a plain Observer saw %d EventClaimed", plain[idem.EventClaimed])
			}
			if plain[idem.EventReleased] < 2*n {
				t.Errorf("plain Observer: released %d times, want at least %d (every panic and every 500)", plain[idem.EventReleased], 2*n)
			}
		})
	}
}
