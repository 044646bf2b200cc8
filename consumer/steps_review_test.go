package consumer_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
)

// fakeClock is a clock the test moves.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// TestStepRecordsOutliveConsumerTakeovers: delivery A records "charge" and
// "ship" and stalls (its claim stays in flight); delivery B takes the lapsed
// claim over 50 minutes later, replays "charge" and stalls before "ship";
// delivery C takes over 20 minutes after that, past A's claim + TTL but well
// within the record's life: "ship" is replayed, not run again with a new
// derived key. Failed before the fix (ship ran twice, with two keys).
func TestStepRecordsOutliveConsumerTakeovers(t *testing.T) {
	// memstore only: a stalled delivery's transaction would hold SQLite's
	// one write lock, and no takeover could claim.
	for name, store := range map[string]idem.Store{"memstore": stepStores(t)["memstore"]} {
		t.Run(name, func(t *testing.T) {
			clk := &fakeClock{now: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
			p, err := consumer.New(store, consumer.Config{Name: "steps-takeover-" + name, MaxDeliveries: 10,
				TTL: time.Hour, Lease: time.Minute, NowFunc: clk.Now})
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			runs := map[string][]string{}
			stall := make(chan struct{})
			reached := make(chan struct{}, 3)
			delivery := 0
			h := func(ctx context.Context, msg *consumer.Message) ([]byte, error) {
				mu.Lock()
				delivery++
				d := delivery
				mu.Unlock()
				step := func(name string) error {
					_, err := idem.Step(ctx, name, func(ctx context.Context, key string) (string, error) {
						mu.Lock()
						runs[name] = append(runs[name], key)
						mu.Unlock()
						return name + "-done", nil
					})
					return err
				}
				if err := step("charge"); err != nil {
					return nil, err
				}
				if d == 2 { // B stalls between the steps
					reached <- struct{}{}
					<-stall
					return nil, nil
				}
				if err := step("ship"); err != nil {
					return nil, err
				}
				if d == 1 { // A stalls after both steps
					reached <- struct{}{}
					<-stall
				}
				return []byte("ok"), nil
			}
			var wg sync.WaitGroup
			defer wg.Wait()
			defer close(stall)
			for d := 1; d <= 2; d++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					p.Process(context.Background(), &consumer.Message{ID: "order-1", Payload: []byte("x"), Delivery: d}, h)
				}()
				<-reached
				clk.Add(50 * time.Minute)
				if d == 2 {
					clk.Add(-30 * time.Minute) // C comes 20 minutes after B
				}
			}
			out := p.Process(context.Background(), &consumer.Message{ID: "order-1", Payload: []byte("x"), Delivery: 3}, h)
			if out.Action != consumer.Ack {
				t.Fatalf("delivery C: %+v", out)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(runs["charge"]) != 1 || len(runs["ship"]) != 1 {
				t.Fatalf("the steps ran with derived keys %v; want each step run once", runs)
			}
		})
	}
}
