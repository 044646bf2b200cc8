package client_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/go-retryablehttp"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/client"
	"github.com/idemkit/idem/memstore"
)

// newOrdersServer starts an idem-protected endpoint that creates an order per
// execution and answers with its number.
func newOrdersServer() (srv *httptest.Server, orders *atomic.Int64) {
	orders = new(atomic.Int64)
	mw, err := idem.New(memstore.New(&memstore.Config{JanitorInterval: -1}), nil)
	if err != nil {
		panic(err)
	}
	return httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := orders.Add(1)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d", n)
	}))), orders
}

// loseFirstAnswer is a network that delivers the first request and loses its
// answer, as a connection reset after the server replied would.
type loseFirstAnswer struct {
	base http.RoundTripper
	lost atomic.Bool
}

func (l *loseFirstAnswer) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := l.base.RoundTrip(r)
	if err == nil && !l.lost.Swap(true) {
		_ = resp.Body.Close()
		return nil, fmt.Errorf("read: %w", syscall.ECONNRESET)
	}
	return resp, err
}

func Example() {
	srv, orders := newOrdersServer()
	defer srv.Close()

	// The first answer is lost on the way back. The Transport retries with the
	// same key, and the server replays the outcome instead of ordering twice.
	c := client.New(&client.Transport{Base: &loseFirstAnswer{base: http.DefaultTransport}})
	resp, err := c.Post(srv.URL+"/orders", "application/json", strings.NewReader(`{"cart_id":"c-1"}`))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Printf("%d %s, attempts: %d, replayed: %v, orders created: %d\n",
		resp.StatusCode, body, client.Attempts(resp), client.Replayed(resp), orders.Load())
	// Output: 201 order 1, attempts: 2, replayed: true, orders created: 1
}

func ExampleWithKey() {
	srv, orders := newOrdersServer()
	defer srv.Close()
	c := client.New(nil)

	// The order is keyed by its cart, so that resubmitting the cart — after a crash,
	// from another tab — repeats the same operation instead of ordering twice.
	place := func(cartID string) {
		ctx := client.WithKey(context.Background(), "cart-"+cartID)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"cart_id":"`+cartID+`"}`))
		resp, err := c.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		fmt.Printf("%d %s, replayed: %v\n", resp.StatusCode, body, client.Replayed(resp))
	}
	place("7f3a")
	place("7f3a")
	fmt.Println("orders created:", orders.Load())
	// Output:
	// 201 order 1, replayed: false
	// 201 order 1, replayed: true
	// orders created: 1
}

func ExampleRetryError() {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		idem.WriteProblem(w, idem.NewProblem(idem.CodeStoreUnavailable, "the store is down"), 0)
	}))
	defer srv.Close()

	c := client.New(&client.Transport{MaxAttempts: 3, MinBackoff: time.Millisecond, KeyFunc: func() string { return "op-1" }})
	_, err := c.Post(srv.URL, "application/json", strings.NewReader(`{}`))
	var re *client.RetryError
	if errors.As(err, &re) {
		// Keep re.Key: sending the operation again later with it (client.WithKey)
		// gets its outcome, whether or not it ran.
		fmt.Println(re.Attempts, re.Status, re.Code, re.Key)
	}
	// Output: 3 503 idempotency_store_unavailable op-1
}

// Under go-retryablehttp, which calls its transport once per attempt, make the key
// before its retry loop and pass it down in the context: the same context reaches
// every attempt. The Transport makes no retries of its own (MaxAttempts: 1).
func Example_retryablehttp() {
	srv, orders := newOrdersServer()
	defer srv.Close()

	rc := retryablehttp.NewClient()
	rc.Logger = nil
	rc.RetryWaitMin, rc.RetryWaitMax = time.Millisecond, 10*time.Millisecond
	rc.HTTPClient.Transport = &client.Transport{
		Base:        &loseFirstAnswer{base: http.DefaultTransport},
		MaxAttempts: 1,
	}

	ctx := client.WithKey(context.Background(), client.NewKey()) // one key per operation
	req, _ := retryablehttp.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", []byte(`{"cart_id":"c-2"}`))
	resp, err := rc.Do(req)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Printf("%d %s, replayed: %v, orders created: %d\n", resp.StatusCode, body, client.Replayed(resp), orders.Load())
	// Output: 201 order 1, replayed: true, orders created: 1
}
