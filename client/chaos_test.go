package client_test

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

	"github.com/hashicorp/go-retryablehttp"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/client"
	"github.com/idemkit/idem/client/clienttest"
)

// The chaos tests place orders through a lossy TCP proxy (clienttest.Proxy) in
// front of an idem-protected orders handler whose orders table has NO unique
// constraint on cart_id: only idempotency stands between a lost answer and a
// duplicate order. Each operation carries its own cart_id; the tests count rows
// and distinct cart_ids in the table afterwards.

const (
	chaosOps      = 500
	chaosWorkers  = 8
	chaosDropRate = 0.3  // fraction of connections whose answer the proxy drops
	chaosMinLoss  = 0.20 // the loss rate the run must have achieved
)

// orderBackend is where orders end up: newOrderBackend (orders_backend_test.go)
// builds one on the idem store under test.
type orderBackend struct {
	store idem.Store
	// insert creates one order for cartID in the request's transaction (when the
	// store has one) and returns its ID.
	insert func(r *http.Request, cartID string) (int64, error)
	// count returns the number of orders and of distinct cart_ids.
	count func(ctx context.Context) (rows, distinct int, err error)
}

// orderServer is an idem-protected orders service on a loopback socket.
type orderServer struct {
	backend    *orderBackend
	url        string
	requests   atomic.Int64 // requests that reached the server, before idem
	executions atomic.Int64 // times the orders handler ran
}

type orderReq struct {
	CartID string `json:"cart_id"`
	Qty    int    `json:"qty"`
}

type orderResp struct {
	OrderID int64  `json:"order_id"`
	CartID  string `json:"cart_id"`
}

func newOrderServer(t *testing.T) *orderServer {
	t.Helper()
	s := &orderServer{backend: newOrderBackend(t)}
	mw, err := idem.New(s.backend.store, &idem.Config{Lease: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	orders := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.executions.Add(1)
		var in orderReq
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.CartID == "" {
			http.Error(w, "send {\"cart_id\": …}", http.StatusBadRequest)
			return
		}
		id, err := s.backend.insert(r, in.CartID)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(orderResp{OrderID: id, CartID: in.CartID})
	})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw(orders))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.requests.Add(1)
		mux.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	s.url = srv.URL
	return s
}

func newLossyProxy(t *testing.T, s *orderServer) *clienttest.Proxy {
	t.Helper()
	p, err := clienttest.NewProxy(strings.TrimPrefix(s.url, "http://"), chaosDropRate, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	t.Logf("lossy proxy seed %d (drop rate %.2f)", p.Seed(), chaosDropRate)
	return p
}

// noKeepAlive sends every attempt on a fresh connection, so that net/http never
// re-sends a request on its own (docs/design.md §6) and each attempt the client counts
// is exactly one request at the server.
func noKeepAlive() *http.Transport {
	return &http.Transport{DisableKeepAlives: true}
}

// outcome is what one operation reported.
type outcome struct {
	status   int
	attempts int
	replayed bool
	order    orderResp
	err      error
}

// runOps performs chaosOps operations with chaosWorkers workers; op(i) sends
// operation i (cart "cart-i") and reports its outcome.
func runOps(n int, op func(i int) outcome) []outcome {
	out := make([]outcome, n)
	next := make(chan int)
	var wg sync.WaitGroup
	for range chaosWorkers {
		wg.Go(func() {
			for i := range next {
				out[i] = op(i)
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	return out
}

func orderBody(i int) string {
	b, _ := json.Marshal(orderReq{CartID: fmt.Sprintf("cart-%04d", i), Qty: 1})
	return string(b)
}

func readOutcome(resp *http.Response, err error) outcome {
	if err != nil {
		return outcome{err: err}
	}
	defer resp.Body.Close()
	o := outcome{status: resp.StatusCode, attempts: client.Attempts(resp), replayed: client.Replayed(resp)}
	body, err := io.ReadAll(resp.Body)
	if err == nil {
		err = json.Unmarshal(body, &o.order)
	}
	if err != nil {
		o.err = fmt.Errorf("reading answer %d %q: %w", resp.StatusCode, body, err)
	}
	return o
}

// checkExactlyOnce asserts that every operation succeeded with its own order, that
// the table holds exactly one order per operation, and that the proxy lost enough
// answers to make that mean something.
func checkExactlyOnce(t *testing.T, s *orderServer, p *clienttest.Proxy, outs []outcome) {
	t.Helper()
	ids := map[int64]bool{}
	for i, o := range outs {
		if o.err != nil {
			t.Fatalf("operation %d failed: %v", i, o.err)
		}
		if o.status != http.StatusCreated || o.order.CartID != fmt.Sprintf("cart-%04d", i) {
			t.Fatalf("operation %d: status %d, order %+v", i, o.status, o.order)
		}
		if ids[o.order.OrderID] {
			t.Fatalf("operation %d was told order %d, which another operation was told too", i, o.order.OrderID)
		}
		ids[o.order.OrderID] = true
	}
	rows, distinct, err := s.backend.count(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	st := p.Stats()
	loss := float64(st.Dropped) / float64(max(st.Answered, 1))
	t.Logf("%d operations: %d orders (%d distinct carts); server saw %d requests, handler ran %d times; proxy: %d connections, %d answered, %d answers dropped (%.1f%%)",
		len(outs), rows, distinct, s.requests.Load(), s.executions.Load(), st.Connections, st.Answered, st.Dropped, 100*loss)
	if rows != len(outs) || distinct != len(outs) {
		t.Fatalf("%d operations left %d orders for %d distinct carts; want exactly one order per operation", len(outs), rows, distinct)
	}
	if got := s.executions.Load(); got != int64(len(outs)) {
		t.Fatalf("the orders handler ran %d times for %d operations", got, len(outs))
	}
	if loss < chaosMinLoss {
		t.Fatalf("the proxy dropped only %.1f%% of answers (%d of %d); the test needs at least %.0f%% to prove anything", 100*loss, st.Dropped, st.Answered, 100*chaosMinLoss)
	}
}

// TestChaosExactlyOnce: the client's own retries through the lossy link.
func TestChaosExactlyOnce(t *testing.T) {
	t.Parallel()
	s := newOrderServer(t)
	p := newLossyProxy(t, s)
	c := client.New(&client.Transport{
		Base:        noKeepAlive(),
		MaxAttempts: 20, // 0.3^20: no operation runs out of attempts
		MinBackoff:  time.Millisecond,
		MaxBackoff:  20 * time.Millisecond,
	})
	outs := runOps(chaosOps, func(i int) outcome {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, p.URL()+"/orders", strings.NewReader(orderBody(i)))
		req.Header.Set("Content-Type", "application/json")
		return readOutcome(c.Do(req))
	})
	checkExactlyOnce(t, s, p, outs)

	// Every attempt reached the server once, every retry followed a lost answer,
	// and exactly the retried operations ended with a replay.
	total, replays := 0, 0
	for i, o := range outs {
		total += o.attempts
		if o.replayed {
			replays++
		}
		if o.replayed != (o.attempts > 1) {
			t.Errorf("operation %d: %d attempts but Replayed = %v; after a lost answer the retry must be a replay", i, o.attempts, o.replayed)
		}
	}
	st := p.Stats()
	if int64(total) != s.requests.Load() {
		t.Errorf("the client counted %d attempts, the server saw %d requests", total, s.requests.Load())
	}
	if int64(total-chaosOps) != st.Dropped {
		t.Errorf("%d retries for %d dropped answers; each lost answer should cost exactly one retry", total-chaosOps, st.Dropped)
	}
	t.Logf("%d attempts, %d operations answered by a replay", total, replays)
}

// TestChaosRetryableHTTP: the same outcome with go-retryablehttp doing the
// retrying and the idem Transport below it supplying the key. The key is made
// once per operation, before retryablehttp's loop, and handed down in the context
// (client.WithKey), which reaches every attempt.
func TestChaosRetryableHTTP(t *testing.T) {
	t.Parallel()
	s := newOrderServer(t)
	p := newLossyProxy(t, s)
	rc := newRetryableClient()
	outs := runOps(chaosOps, func(i int) outcome {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		ctx = client.WithKey(ctx, client.NewKey()) // one key per operation, made before the loop
		req, err := retryablehttp.NewRequestWithContext(ctx, http.MethodPost, p.URL()+"/orders", []byte(orderBody(i)))
		if err != nil {
			return outcome{err: err}
		}
		req.Header.Set("Content-Type", "application/json")
		return readOutcome(rc.Do(req))
	})
	checkExactlyOnce(t, s, p, outs)
}

func newRetryableClient() *retryablehttp.Client {
	rc := retryablehttp.NewClient()
	rc.Logger = nil
	rc.RetryMax = 20
	rc.RetryWaitMin = time.Millisecond
	rc.RetryWaitMax = 20 * time.Millisecond
	rc.HTTPClient = &http.Client{Transport: &client.Transport{
		Base:        noKeepAlive(),
		MaxAttempts: 1, // retryablehttp retries; the Transport only keys
	}}
	return rc
}

// TestChaosControl proves the chaos tests can fail: through the same lossy link,
// a client that makes a new key per attempt — here go-retryablehttp over the
// Transport without a key made before its loop — creates duplicate orders.
func TestChaosControl(t *testing.T) {
	t.Parallel()
	s := newOrderServer(t)
	p := newLossyProxy(t, s)
	rc := newRetryableClient()
	const ops = 100
	outs := runOps(ops, func(i int) outcome {
		req, err := retryablehttp.NewRequest(http.MethodPost, p.URL()+"/orders", []byte(orderBody(i)))
		if err != nil {
			return outcome{err: err}
		}
		return readOutcome(rc.Do(req))
	})
	for i, o := range outs {
		if o.err != nil || o.status != http.StatusCreated {
			t.Fatalf("operation %d: status %d, %v", i, o.status, o.err)
		}
	}
	rows, distinct, err := s.backend.count(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	st := p.Stats()
	t.Logf("a new key per attempt: %d operations made %d orders (%d distinct carts); %d answers dropped", ops, rows, distinct, st.Dropped)
	if distinct != ops {
		t.Fatalf("%d distinct carts, want %d", distinct, ops)
	}
	if int64(rows-ops) != st.Dropped || st.Dropped == 0 {
		t.Fatalf("%d duplicate orders for %d dropped answers; each lost answer should have made one duplicate", rows-ops, st.Dropped)
	}
}
