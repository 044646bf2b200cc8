package orders_test

import (
	"context"
	"database/sql"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/memstore"
)

// TestChargeAnsweredButUnreadable: a provider that honours no key charges and
// answers 201, and the answer cannot be read (a body that is no charge, a
// connection cut inside the body). The charge happened: with
// --payment-unknown refuse the retry must not charge again (the step's
// outcome is unknown, not a transient failure that every policy reruns).
// With rerun the retry asks again with the same derived key. Failed before
// the fix: the refuse policy charged twice.
func TestChargeAnsweredButUnreadable(t *testing.T) {
	for _, refuse := range []bool{false, true} {
		t.Run(map[bool]string{false: "rerun", true: "refuse"}[refuse], func(t *testing.T) {
			t.Parallel()
			var mu sync.Mutex
			var keys []string
			provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				keys = append(keys, r.Header.Get("Idempotency-Key"))
				first := len(keys) == 1
				mu.Unlock()
				w.WriteHeader(http.StatusCreated)
				if first {
					_, _ = w.Write([]byte(`{"id": ch_garbled`))
					return
				}
				_, _ = w.Write([]byte(`{"id":"ch_2"}`))
			}))
			t.Cleanup(provider.Close)

			db, err := sql.Open("sqlite", "file:"+filepath.Join(t.TempDir(), "shop.db"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = db.Close() })
			backend, err := orders.SQL(db, orders.SQLite, nil)
			if err != nil {
				t.Fatal(err)
			}
			svc, err := orders.New(backend, &orders.Config{Payments: &orders.Payments{URL: provider.URL, Timeout: 5 * time.Second, RefuseUnknown: refuse}})
			if err != nil {
				t.Fatal(err)
			}
			if err := svc.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			store := memstore.New(nil)
			t.Cleanup(func() { _ = store.Close() })
			clk := time.Now()
			var cmu sync.Mutex
			now := func() time.Time { cmu.Lock(); defer cmu.Unlock(); return clk }
			mw, err := idem.New(store, &idem.Config{NowFunc: now, KeepFunc: func(s int) bool { return s < 500 }})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(orders.Authenticate(svc.Handler(mw)))
			t.Cleanup(srv.Close)
			post := func() int {
				req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{"cart_id":"c_42","total_cents":1900}`))
				req.Header.Set("Authorization", "Bearer t1")
				req.Header.Set("Idempotency-Key", "order-unreadable")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				return resp.StatusCode
			}
			if s := post(); s != http.StatusBadGateway {
				t.Fatalf("first attempt: %d, want 502", s)
			}
			cmu.Lock()
			clk = clk.Add(idem.DefaultLease + time.Second) // past a lease the refuse policy leaves in flight
			cmu.Unlock()
			second := post()
			mu.Lock()
			defer mu.Unlock()
			if refuse {
				if len(keys) != 1 || second != http.StatusBadGateway {
					t.Fatalf("refuse: the retry got %d and the provider was called %d times (keys %v); want 502 payment_unknown and one call: the first was answered 201", second, len(keys), keys)
				}
				return
			}
			if len(keys) != 2 || keys[0] != keys[1] || second != http.StatusCreated {
				t.Fatalf("rerun: the retry got %d, the provider was called with keys %v; want 201 and a second call with the same key", second, keys)
			}
		})
	}
}
