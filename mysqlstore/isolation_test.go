package mysqlstore_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

// countingStore counts the lease renewals that succeeded.
type countingStore struct {
	*mysqlstore.Store
	renewals atomic.Int64
}

func (s *countingStore) Extend(ctx context.Context, scope, key, token string, now, leaseUntil time.Time) error {
	err := s.Store.Extend(ctx, scope, key, token, now, leaseUntil)
	if err == nil {
		s.renewals.Add(1)
	}
	return err
}

// TestEveryIsolationLevel: at every isolation level MySQL and MariaDB offer,
// as the session default, in both flows, a handler that outlives several lease
// renewals completes: 201 once, its order committed once, the retry replays.
func TestEveryIsolationLevel(t *testing.T) { bothModes(t, testEveryIsolationLevel) }

func testEveryIsolationLevel(t *testing.T) {
	for _, level := range []string{"READ-UNCOMMITTED", "READ-COMMITTED", "REPEATABLE-READ", "SERIALIZABLE"} {
		for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
			t.Run(level+"/"+flow.String(), func(t *testing.T) {
				t.Parallel()
				db := openDB(t, 6, "&tx_isolation="+url.QueryEscape("'"+level+"'"))
				var got string
				if err := db.QueryRowContext(ctxFor(t), "SELECT @@tx_isolation").Scan(&got); err != nil || got != level {
					t.Fatalf("session isolation %q (%v), want %q", got, err, level)
				}
				s := &countingStore{Store: newStore(t, db)}
				orders := ordersTable(t, db)
				var runs atomic.Int64
				mw, err := idem.New(s, &idem.Config{Flow: flow, Lease: 300 * time.Millisecond, HandlerTimeout: time.Minute})
				if err != nil {
					t.Fatal(err)
				}
				srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					runs.Add(1)
					tx := mysqlstore.Tx(r.Context())
					if _, err := tx.ExecContext(r.Context(), "INSERT INTO `"+orders+"` (item) VALUES ('iso')"); err != nil {
						http.Error(w, err.Error(), 500)
						return
					}
					if flow == idem.FlowClaimComplete {
						start := s.renewals.Load()
						for deadline := time.Now().Add(30 * time.Second); s.renewals.Load() < start+2; time.Sleep(5 * time.Millisecond) {
							if time.Now().After(deadline) {
								http.Error(w, "no lease renewal within 30 s", 500)
								return
							}
						}
					}
					w.WriteHeader(http.StatusCreated)
					fmt.Fprint(w, "created")
				})))
				t.Cleanup(srv.Close)
				key := randomName("key-")
				for attempt := range 2 {
					status, body, replayed := postKey(t, srv.URL, key)
					if status != 201 || body != "created" || replayed != (attempt == 1) {
						t.Fatalf("attempt %d: %d %q (replayed %v), want 201, replayed the second time", attempt, status, body, replayed)
					}
				}
				if n := countOrders(t, db, orders, "iso"); n != 1 || runs.Load() != 1 {
					t.Fatalf("%d orders, %d runs; want 1 and 1", n, runs.Load())
				}
			})
		}
	}
}

func postKey(t *testing.T, base, key string) (int, string, bool) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+"/orders", strings.NewReader("{}"))
	req.Header.Set("Idempotency-Key", key)
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 60 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header.Get(idem.ReplayedHeader) == "true"
}
