package consumer_test

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// TestOneConnectionPoolSteps: SQLite with a pool of one connection
// (SetMaxOpenConns(1)); concurrent redeliveries of messages whose handler
// writes an order in the delivery's transaction and records a step. Every
// delivery settles (no step waits for a second connection of the records'
// pool: the handler's transaction holds the only one), each message is
// acknowledged, with one order and one step run.
func TestOneConnectionPoolSteps(t *testing.T) {
	t.Parallel()
	db, err := embedded.Open(filepath.Join(t.TempDir(), "app.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	db.SetMaxOpenConns(1)
	if _, err := db.Exec(`CREATE TABLE orders (id TEXT PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	s, err := sqlitestore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	p, err := consumer.New(s, consumer.Config{Name: "oneconn", MaxDeliveries: 1000})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	calls := map[string]int{}
	h := func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		if _, err := sqlitestore.Tx(ctx).ExecContext(ctx, `INSERT INTO orders VALUES (?)`, m.ID); err != nil {
			return nil, err
		}
		return idem.Step(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
			mu.Lock()
			calls[m.ID]++
			mu.Unlock()
			return []byte(key), nil
		})
	}
	const msgs, copies = 4, 4
	var wg sync.WaitGroup
	start := make(chan struct{})
	acked := make(chan string, msgs*copies)
	for i := range msgs {
		for range copies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				id := fmt.Sprint("order-", i)
				for d := 1; d < 200; d++ {
					out := p.Process(context.Background(), &consumer.Message{ID: id, Payload: []byte("x"), Delivery: d}, h)
					if out.Action == consumer.Ack {
						acked <- id
						return
					}
					time.Sleep(5 * time.Millisecond)
				}
				t.Errorf("%s never acknowledged", id)
			}()
		}
	}
	close(start)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("deliveries through a one-connection pool did not settle in 30 s: a step waits for a second connection")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM orders`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if n != msgs || len(calls) != msgs || len(acked) != msgs*copies {
		t.Fatalf("%d orders, steps of %d messages, %d deliveries acknowledged; want %d, %d, %d", n, len(calls), len(acked), msgs, msgs, msgs*copies)
	}
	for id, c := range calls {
		if c != 1 {
			t.Errorf("step of %s ran %d times, want once", id, c)
		}
	}
}
