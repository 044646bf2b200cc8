package client_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/client"
	"github.com/idemkit/idem/memstore"
)

// TestInFlightRetriedUntilReplay runs against the real middleware: a second
// operation with the key of one still running gets 409 idempotency_key_in_use
// with Retry-After (the seconds left on a 30s lease), waits the capped
// Retry-After, and ends with the replay of the first one's outcome.
func TestInFlightRetriedUntilReplay(t *testing.T) {
	t.Parallel()
	st := memstore.New(&memstore.Config{JanitorInterval: -1})
	defer st.Close()
	var inFlight, executions atomic.Int64
	mw, err := idem.New(st, &idem.Config{Observer: idem.ObserverFunc(func(_ context.Context, e idem.Event) {
		if e.Kind == idem.EventInFlight {
			inFlight.Add(1)
		}
	})})
	if err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan struct{}), make(chan struct{})
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		executions.Add(1)
		close(entered)
		<-release
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "order 1")
	})))
	defer srv.Close()

	c := client.New(&client.Transport{Base: noKeepAlive(), MaxAttempts: 50, MaxRetryAfter: 100 * time.Millisecond})
	send := func() (*http.Response, error) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		t.Cleanup(cancel)
		req, _ := http.NewRequestWithContext(client.WithKey(ctx, "cart-9"), http.MethodPost, srv.URL, strings.NewReader(`{"cart_id":"cart-9"}`))
		return c.Do(req)
	}
	type result struct {
		resp *http.Response
		err  error
	}
	first := make(chan result, 1)
	go func() {
		resp, err := send()
		first <- result{resp, err}
	}()
	<-entered
	second := make(chan result, 1)
	go func() {
		resp, err := send()
		second <- result{resp, err}
	}()
	deadline := time.Now().Add(30 * time.Second)
	for inFlight.Load() < 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if inFlight.Load() < 2 {
		t.Fatalf("the second operation got %d in-flight answers; want it to keep retrying them", inFlight.Load())
	}
	close(release)

	for name, ch := range map[string]chan result{"first": first, "second": second} {
		r := <-ch
		if r.err != nil {
			t.Fatalf("%s: %v", name, r.err)
		}
		body, _ := io.ReadAll(r.resp.Body)
		_ = r.resp.Body.Close()
		if r.resp.StatusCode != http.StatusCreated || string(body) != "order 1" {
			t.Fatalf("%s: %d %q", name, r.resp.StatusCode, body)
		}
		n, replayed := client.Attempts(r.resp), client.Replayed(r.resp)
		switch name {
		case "first":
			if n != 1 || replayed {
				t.Fatalf("first: %d attempts, replayed %v; want 1, false", n, replayed)
			}
		case "second":
			if int64(n) != inFlight.Load()+1 || !replayed {
				t.Fatalf("second: %d attempts (%d answered 409), replayed %v; want every 409 retried, then a replay", n, inFlight.Load(), replayed)
			}
		}
	}
	if executions.Load() != 1 {
		t.Fatalf("handler ran %d times", executions.Load())
	}
}
