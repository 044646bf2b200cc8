package steptest

import (
	"context"
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

// HTTP proves, over loopback HTTP through the middleware in flow, that
// idem.Step records a step while the handler's transaction is open, and that
// the record outlives the transaction. The handler first writes through the
// request's transaction (write, the store's own: an insert through its Tx,
// so that the transaction holds its locks), then runs one step that calls a
// counting "provider", then answers. The first request's answer is a 503 the
// middleware does not keep (the transaction rolls back, the key is released);
// the retry gets the step's recorded result without calling the provider
// again, and its 201 is kept and replayed. Each step must take under 3
// seconds: far less than the lock timeouts a step waiting for the open
// transaction would meet.
func HTTP(t *testing.T, store idem.Store, flow idem.Flow, write func(ctx context.Context) error) {
	t.Helper()
	var (
		calls   atomic.Int64
		fail    atomic.Bool
		mu      sync.Mutex
		keys    []string
		slowest time.Duration
	)
	fail.Store(true)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		if err := write(ctx); err != nil {
			http.Error(w, "write: "+err.Error(), http.StatusInternalServerError)
			return
		}
		start := time.Now()
		id, err := idem.Step(ctx, "charge", func(ctx context.Context, key string) (string, error) {
			n := calls.Add(1)
			mu.Lock()
			keys = append(keys, key)
			mu.Unlock()
			return fmt.Sprintf("ch_%d", n), nil
		})
		d := time.Since(start)
		mu.Lock()
		slowest = max(slowest, d)
		mu.Unlock()
		if err != nil {
			http.Error(w, "step: "+err.Error(), http.StatusInternalServerError)
			return
		}
		if fail.Swap(false) {
			http.Error(w, "the provider charged, then this handler failed", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, id)
	})
	mw, err := idem.New(store, &idem.Config{Flow: flow, KeepFunc: func(status int) bool { return status < 500 }})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(h))
	defer srv.Close()
	client := &http.Client{Timeout: 20 * time.Second}
	post := func() (int, string, bool) {
		t.Helper()
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"cart":"c1"}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Idempotency-Key", "order-"+Rand(6))
		req.Header.Set("Content-Type", "application/json")
		return do(t, client, req)
	}
	key := "order-" + Rand(6)
	send := func() (int, string, bool) {
		t.Helper()
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"cart":"c1"}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Content-Type", "application/json")
		return do(t, client, req)
	}
	if status, body, _ := send(); status != http.StatusServiceUnavailable {
		t.Fatalf("first request: %d %s, want the handler's 503", status, body)
	}
	status, body, replayed := send()
	if status != http.StatusCreated || body != "ch_1" || replayed {
		t.Fatalf("retry: %d %q (replayed %v), want 201 ch_1 executed again", status, body, replayed)
	}
	status, body, replayed = send()
	if status != http.StatusCreated || body != "ch_1" || !replayed {
		t.Fatalf("second retry: %d %q (replayed %v), want the replayed 201 ch_1", status, body, replayed)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("the provider was called %d times for one key, want 1", n)
	}
	// Another key is another operation: the provider is called, with another
	// derived key.
	if status, body, _ := post(); status != http.StatusServiceUnavailable && status != http.StatusCreated {
		t.Fatalf("another key: %d %s", status, body)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(keys) != 2 || keys[0] == keys[1] || !strings.HasPrefix(keys[0], "idem_") {
		t.Fatalf("derived keys %q, want two different idem_ keys", keys)
	}
	if slowest > 3*time.Second {
		t.Fatalf("the slowest Step took %v inside the open transaction", slowest)
	}
	t.Logf("slowest Step inside the handler's transaction: %v", slowest)
}

func do(t *testing.T, client *http.Client, req *http.Request) (int, string, bool) {
	t.Helper()
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("POST: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b), resp.Header.Get(idem.ReplayedHeader) == "true"
}
