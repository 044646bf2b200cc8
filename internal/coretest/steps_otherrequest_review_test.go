package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// otherRequestServer serves a handler that charges the body's amount as the
// step "charge", answers 503 while fail is set, and otherwise ignores a Step
// error: it answers 201 whatever Step said, with a body of size bytes unless
// the amount is 10 (the first request, whose answer is kept whole). It
// returns the URL, the provider's call counter and the switch.
func otherRequestServer(t *testing.T, store idem.Store, cfg *idem.Config, size int) (string, *atomic.Int32, *atomic.Bool, *[]error, *sync.Mutex) {
	t.Helper()
	cfg.KeepFunc = func(s int) bool { return s < 500 }
	mw, err := idem.New(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	var fail atomic.Bool
	fail.Store(true)
	var mu sync.Mutex
	var errs []error
	srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in struct{ Amount int }
		_ = json.NewDecoder(r.Body).Decode(&in)
		charged, err := idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (int, error) {
			calls.Add(1)
			return in.Amount, nil
		})
		if err != nil {
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		}
		if fail.Load() {
			http.Error(w, "the database went away", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		msg := fmt.Sprintf("order of %d paid by the charge of %d;", in.Amount, charged)
		_, _ = io.WriteString(w, msg)
		if pad := size - len(msg); pad > 0 && in.Amount != 10 {
			_, _ = io.WriteString(w, strings.Repeat("x", pad))
		}
	})))
	return srv.URL + "/orders", &calls, &fail, &errs, &mu
}

// postKey posts body with key, retrying on 409 (a single-transaction
// rollback still under way), and returns the status and body.
func postKey(t *testing.T, url, key, body string) (int, string) {
	t.Helper()
	for range 100 {
		req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
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
	t.Fatal("409 for 5 s")
	return 0, ""
}

// TestStepOtherRequestIgnoredByHandler: the second request's handler ignores
// ErrStepOtherRequest and answers 201 anyway, with a small body and with one
// larger than MaxStoredBody (which, on a store without transactions, would
// stream and be stored as complete without its body). Either way the
// middleware answers 422 idempotency_key_reused, stores nothing under the
// second request, and the first request retried as sent gets 201 with its
// recorded charge, the provider called once in all.
func TestStepOtherRequestIgnoredByHandler(t *testing.T) {
	const maxStored = 1 << 10
	check := func(t *testing.T, store idem.Store, flow idem.Flow) {
		for _, size := range []int{10, 64 << 10} {
			t.Run(fmt.Sprintf("body%d", size), func(t *testing.T) {
				url, calls, fail, errs, mu := otherRequestServer(t, store, &idem.Config{Flow: flow, MaxStoredBody: maxStored}, size)
				key := fmt.Sprintf("ignored-%d-%d", flow, size)
				if st, b := postKey(t, url, key, `{"amount":10}`); st != http.StatusServiceUnavailable || calls.Load() != 1 {
					t.Fatalf("first request: %d %.80s, %d calls; want 503 after one call", st, b, calls.Load())
				}
				fail.Store(false)
				st, b := postKey(t, url, key, `{"amount":20}`)
				var p idem.Problem
				_ = json.Unmarshal([]byte(b), &p)
				if st != http.StatusUnprocessableEntity || p.Code != idem.CodeKeyReused {
					t.Errorf("another request whose handler ignored the Step error: %d %.80s; want 422 %s", st, b, idem.CodeKeyReused)
				}
				mu.Lock()
				if len(*errs) != 1 || !errors.Is((*errs)[0], idem.ErrStepOtherRequest) {
					t.Errorf("Step errors %v, want one ErrStepOtherRequest", *errs)
				}
				mu.Unlock()
				st, b = postKey(t, url, key, `{"amount":10}`)
				if st != http.StatusCreated || !strings.HasPrefix(b, "order of 10 paid by the charge of 10;") || calls.Load() != 1 {
					t.Errorf("the first request retried: %d %.80s, %d calls; want 201 with the recorded charge of 10, one call", st, b, calls.Load())
				}
			})
		}
	}
	t.Run("memstore", func(t *testing.T) {
		t.Parallel()
		check(t, newMem(t), idem.FlowAuto)
	})
	fpStores(t, check)
}

// TestStepOtherRequestRace: after the first request charged 10 and was
// answered 503 (the key released, the step recorded), 16 retries of it and
// 16 requests of another body with the same key are released at once by one
// barrier. The provider is never called again; a retry of the first request
// gets 201 with the recorded charge or 409, another request 422 or 409 (never
// 201, never a charge of its own); afterwards the first request gets 201.
func TestStepOtherRequestRace(t *testing.T) {
	check := func(t *testing.T, store idem.Store, flow idem.Flow) {
		url, calls, fail, _, _ := otherRequestServer(t, store, &idem.Config{Flow: flow}, 0)
		key := fmt.Sprintf("race-%d", flow)
		if st, b := postKey(t, url, key, `{"amount":10}`); st != http.StatusServiceUnavailable || calls.Load() != 1 {
			t.Fatalf("first request: %d %.80s, %d calls; want 503 after one call", st, b, calls.Load())
		}
		fail.Store(false)
		const n = 16
		start := make(chan struct{})
		var wg sync.WaitGroup
		type result struct {
			first bool
			st    int
			body  string
		}
		results := make(chan result, 2*n)
		client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2 * n}, Timeout: time.Minute}
		for i := range 2 * n {
			first := i%2 == 0
			body := `{"amount":20}`
			if first {
				body = `{"amount":10}`
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
				req.Header.Set("Idempotency-Key", key)
				<-start
				resp, err := client.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				results <- result{first, resp.StatusCode, string(b)}
			}()
		}
		close(start)
		wg.Wait()
		close(results)
		counts := map[string]int{}
		for r := range results {
			counts[fmt.Sprintf("first=%v %d", r.first, r.st)]++
			switch {
			case r.st == http.StatusConflict:
			case r.first && r.st == http.StatusCreated && strings.HasPrefix(r.body, "order of 10 paid by the charge of 10;"):
			case !r.first && r.st == http.StatusUnprocessableEntity:
			case r.first && r.st == http.StatusUnprocessableEntity && strings.Contains(r.body, idem.CodeKeyReused):
				// A retry of the first request that arrived while the other
				// request held the key (claim-then-complete commits its
				// in-flight record): a record of another fingerprint, 422.
			default:
				t.Errorf("first request %v: %d %.100s", r.first, r.st, r.body)
			}
		}
		t.Logf("answers: %v", counts)
		if calls.Load() != 1 {
			t.Errorf("the provider was called %d times, want once", calls.Load())
		}
		if st, b := postKey(t, url, key, `{"amount":10}`); st != http.StatusCreated || !strings.HasPrefix(b, "order of 10 paid by the charge of 10;") || calls.Load() != 1 {
			t.Errorf("the first request afterwards: %d %.80s, %d calls", st, b, calls.Load())
		}
	}
	t.Run("memstore", func(t *testing.T) {
		t.Parallel()
		check(t, newMem(t), idem.FlowAuto)
	})
	fpStores(t, check)
}

// TestStepOtherRequestRollsBack: the second request's handler writes a
// business row in idem's transaction before its Step is refused, and then
// ignores the refusal: the 422 is answered and the row is not committed, in
// both flows, on SQLite and PostgreSQL; the first request's retry commits its
// own row once.
func TestStepOtherRequestRollsBack(t *testing.T) {
	check := func(t *testing.T, store idem.Store, flow idem.Flow) {
		var exec func(ctx context.Context, amount int) error
		var count func() int
		switch s := store.(type) {
		case *sqlitestore.Store:
			db := s.DB()
			if _, err := db.Exec(`CREATE TABLE orders_rb (amount INTEGER)`); err != nil {
				t.Fatal(err)
			}
			exec = func(ctx context.Context, amount int) error {
				_, err := sqlitestore.Tx(ctx).ExecContext(ctx, `INSERT INTO orders_rb VALUES (?)`, amount)
				return err
			}
			count = func() int {
				var n int
				_ = db.QueryRow(`SELECT count(*) FROM orders_rb`).Scan(&n)
				return n
			}
		case *pgstore.Store:
			_ = s
			table := fmt.Sprintf("idem_rb_orders_%d_%d", flow, time.Now().UnixNano())
			pool, err := pgxpool.New(context.Background(), testenv.PostgresURL(t))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			if _, err := pool.Exec(context.Background(), `CREATE TABLE `+table+` (amount int)`); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+table) })
			exec = func(ctx context.Context, amount int) error {
				_, err := pgstore.Tx(ctx).Exec(ctx, `INSERT INTO `+table+` VALUES ($1)`, amount)
				return err
			}
			count = func() int {
				var n int
				_ = pool.QueryRow(context.Background(), `SELECT count(*) FROM `+table).Scan(&n)
				return n
			}
		default:
			t.Fatalf("store %T", store)
		}
		mw, err := idem.New(store, &idem.Config{Flow: flow, KeepFunc: func(s int) bool { return s < 500 }})
		if err != nil {
			t.Fatal(err)
		}
		var fail atomic.Bool
		fail.Store(true)
		var calls atomic.Int32
		url := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			var in struct{ Amount int }
			_ = json.NewDecoder(r.Body).Decode(&in)
			if err := exec(r.Context(), in.Amount); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			_, _ = idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (int, error) {
				calls.Add(1)
				return in.Amount, nil
			})
			if fail.Load() {
				http.Error(w, "later", http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusCreated)
		}))).URL
		key := fmt.Sprintf("rollback-%d", flow)
		if st, b := postKey(t, url, key, `{"amount":10}`); st != http.StatusServiceUnavailable {
			t.Fatalf("first request: %d %s", st, b)
		}
		fail.Store(false)
		if st, b := postKey(t, url, key, `{"amount":20}`); st != http.StatusUnprocessableEntity {
			t.Errorf("another request: %d %.80s, want 422", st, b)
		}
		if n := count(); n != 0 {
			t.Errorf("%d business rows committed after a 503 and a 422, want none", n)
		}
		if st, b := postKey(t, url, key, `{"amount":10}`); st != http.StatusCreated {
			t.Errorf("the first request retried: %d %.80s, want 201", st, b)
		}
		if n := count(); n != 1 || calls.Load() != 1 {
			t.Errorf("%d business rows and %d provider calls, want one each", n, calls.Load())
		}
	}
	fpStores(t, check)
}
