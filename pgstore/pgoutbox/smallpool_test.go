package pgoutbox_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
)

// TestSmallPools (guard): pools of one and two connections serve
// concurrent duplicates whose handlers write an order and enqueue its two
// events in the request's transaction, in both flows, while a relay
// publishes and a janitor sweeps the records on the same pool: every
// request answers, one order per key, and every event is published.
func TestSmallPools(t *testing.T) {
	t.Parallel()
	for _, conns := range []int32{1, 2} {
		for _, flow := range []idem.Flow{idem.FlowSingleTx, idem.FlowClaimComplete} {
			t.Run(fmt.Sprintf("%d/%s", conns, flow), func(t *testing.T) {
				t.Parallel()
				testSmallPool(t, conns, flow)
			})
		}
	}
}

func testSmallPool(t *testing.T, conns int32, flow idem.Flow) {
	big, schema := testDB(t)
	newService(t, big, schema, true)
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = conns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	svc := newService(t, pool, schema, false)
	mw, err := idem.New(svc.store, &idem.Config{Flow: flow})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(svc.handler("a", nil)))
	// Closed on success only: Close waits for the handlers, which stand
	// still for ever when something waits for a connection it cannot get.

	var mu sync.Mutex
	published := map[string]int{}
	rctx, stop := context.WithCancel(context.Background())
	var bg sync.WaitGroup
	relay := &outbox.Relay{Source: svc.outbox, Publisher: outbox.PublisherFunc(func(_ context.Context, m *outbox.Stored) error {
		mu.Lock()
		published[m.ID]++
		mu.Unlock()
		return nil
	}), PollInterval: 5 * time.Millisecond}
	bg.Add(2)
	go func() { defer bg.Done(); _ = relay.Run(rctx) }()
	go func() {
		defer bg.Done()
		for rctx.Err() == nil {
			_, _ = svc.store.DeleteExpired(rctx, time.Now(), 100)
			time.Sleep(2 * time.Millisecond)
		}
	}()

	prefix := randHex(4)
	const keys, copies = 6, 3
	client := &http.Client{Timeout: 60 * time.Second}
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan error, keys*copies)
	for k := range keys {
		for range copies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				for attempt := 0; ; attempt++ {
					req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{}`))
					req.Header.Set("Idempotency-Key", fmt.Sprintf("%s-%d", prefix, k))
					resp, err := client.Do(req)
					if err != nil {
						errs <- err
						return
					}
					b, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					switch {
					case resp.StatusCode == http.StatusCreated:
						errs <- nil
						return
					case resp.StatusCode == http.StatusConflict && attempt < 400:
						time.Sleep(5 * time.Millisecond)
						continue
					}
					errs <- fmt.Errorf("key %d: %d %s", k, resp.StatusCode, b)
					return
				}
			}()
		}
	}
	close(start)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("requests did not all answer within 60 s: something waits for a connection it cannot get")
	}
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		mu.Lock()
		n := len(published)
		mu.Unlock()
		if n >= 2*keys || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	bg.Wait()
	srv.Close()
	var orders int
	if err := big.QueryRow(context.Background(), "SELECT count(*) FROM "+schema+".orders").Scan(&orders); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if orders != keys || len(published) != 2*keys {
		t.Fatalf("%d orders, %d events published; want %d and %d", orders, len(published), keys, 2*keys)
	}
	for id, c := range published {
		if c != 1 {
			t.Errorf("event %s published %d times", id, c)
		}
	}
}
