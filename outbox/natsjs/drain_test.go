package natsjs_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/natsjs"
)

// TestDrainRate measures how fast relays drain a PostgreSQL (and a MariaDB) outbox of
// IDEM_OUTBOX_DRAIN messages (one partition each, as the orders of distinct
// keys are) to JetStream, with 1 and 2 relays. By hand only:
//
//	IDEM_OUTBOX_DRAIN=10000 go test -run TestDrainRate -v ./outbox/natsjs/
func TestDrainRate(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("IDEM_OUTBOX_DRAIN"))
	if n <= 0 {
		t.Skip("set IDEM_OUTBOX_DRAIN=10000 to measure")
	}
	for _, c := range []struct {
		kind   string
		relays int
	}{{"postgres", 1}, {"postgres", 2}, {"mysql", 1}, {"mysql", 2}} {
		kind, relays := c.kind, c.relays
		t.Run(fmt.Sprint(kind, "/", relays, "relays"), func(t *testing.T) {
			ctx := context.Background()
			d := openDB(t, kind, freshTable(t, kind))
			b := newBroker(t, jetstream.StreamConfig{})
			var batch []outbox.Message
			for i := range n {
				batch = append(batch, outbox.Message{ID: fmt.Sprint("m", i), Subject: b.subject + ".orders", Payload: []byte(`{"order_id":` + strconv.Itoa(i) + `}`)})
				if len(batch) == 500 || i == n-1 {
					if err := d.enqueue(ctx, batch...); err != nil {
						t.Fatal(err)
					}
					batch = nil
				}
			}
			rctx, cancel := context.WithCancel(ctx)
			var wg sync.WaitGroup
			start := time.Now()
			for i := range relays {
				r := &outbox.Relay{Source: d.src, Publisher: natsjs.NewPublisher(b.js), Owner: fmt.Sprint("r", i), StatsInterval: -1}
				wg.Add(1)
				go func() { defer wg.Done(); _ = r.Run(rctx) }()
			}
			var curve []string
			for {
				st, err := d.src.Stats(ctx)
				if err != nil {
					t.Fatal(err)
				}
				curve = append(curve, fmt.Sprintf("%.1fs:%d(%.1fs)", time.Since(start).Seconds(), st.Pending, st.OldestPending.Seconds()))
				if st.Pending == 0 {
					break
				}
				time.Sleep(250 * time.Millisecond)
			}
			took := time.Since(start)
			cancel()
			wg.Wait()
			t.Logf("%s, %d relays: %d messages in %v = %.0f messages/s; pending(oldest age) every 250 ms: %v", kind, relays, n, took.Round(time.Millisecond), float64(n)/took.Seconds(), curve)
		})
	}
}

// TestHotPartitionDrain measures one relay draining IDEM_OUTBOX_DRAIN
// messages of ONE partition (published strictly one after the other). By
// hand only, like TestDrainRate.
func TestHotPartitionDrain(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("IDEM_OUTBOX_DRAIN"))
	if n <= 0 {
		t.Skip("set IDEM_OUTBOX_DRAIN=1000 to measure")
	}
	for _, kind := range []string{"postgres", "mysql"} {
		t.Run(kind, func(t *testing.T) {
			ctx := context.Background()
			d := openDB(t, kind, freshTable(t, kind))
			b := newBroker(t, jetstream.StreamConfig{})
			var msgs []outbox.Message
			for i := range n {
				msgs = append(msgs, outbox.Message{ID: fmt.Sprint("m", i), Subject: b.subject + ".x", PartitionKey: "hot"})
			}
			if err := d.enqueue(ctx, msgs...); err != nil {
				t.Fatal(err)
			}
			r := &outbox.Relay{Source: d.src, Publisher: natsjs.NewPublisher(b.js)}
			start := time.Now()
			for {
				k, err := r.PublishBatch(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if k == 0 {
					break
				}
			}
			took := time.Since(start)
			t.Logf("%s: %d messages of one partition in %v = %.0f messages/s", kind, n, took.Round(time.Millisecond), float64(n)/took.Seconds())
		})
	}
}
