package mysqloutbox_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/outbox"
)

// TestRelayConnsKilledWhilePublishing: while the relay publishes what it
// leased, every idle connection of its pool is ended (KILL CONNECTION, their
// IDs read on each). The relay's marks that follow must land: every message
// published once, the batch without a source error, nothing left over. A
// guard: database/sql retries a statement on a connection the driver finds
// closed before it sends anything.
func TestRelayConnsKilledWhilePublishing(t *testing.T) {
	ctx := context.Background()
	admin := testDB(t)
	db := testDB(t)
	db.SetMaxOpenConns(4)
	db.SetMaxIdleConns(4)
	o := newOutbox(t, db)
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		for _, p := range []string{"a", "b", "c", "d"} {
			if err := o.Enqueue(ctx, tx, outbox.Message{ID: fmt.Sprintf("%s%d", p, i), Subject: "k.x", PartitionKey: p}); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	var (
		mu        sync.Mutex
		published = map[string]int{}
		once      sync.Once
	)
	pub := outbox.PublisherFunc(func(ctx context.Context, m *outbox.Stored) error {
		once.Do(func() {
			var ids []int64
			var held []func() error
			for range 4 {
				c, err := db.Conn(ctx)
				if err != nil {
					t.Error(err)
					return
				}
				held = append(held, c.Close)
				var id int64
				if err := c.QueryRowContext(ctx, "SELECT CONNECTION_ID()").Scan(&id); err != nil {
					t.Error(err)
					return
				}
				ids = append(ids, id)
			}
			for _, c := range held {
				_ = c()
			}
			for _, id := range ids {
				if _, err := admin.ExecContext(ctx, fmt.Sprintf("KILL CONNECTION %d", id)); err != nil {
					t.Error(err)
				}
			}
			time.Sleep(100 * time.Millisecond) // the server closes them
		})
		mu.Lock()
		published[m.ID]++
		mu.Unlock()
		return nil
	})
	r := &outbox.Relay{Source: o, Publisher: pub, BatchSize: 100, Concurrency: 1, LeaseDuration: time.Minute}
	n, err := r.PublishBatch(ctx)
	if err != nil || n != 12 {
		t.Errorf("PublishBatch: %d, %v; want 12, nil", n, err)
	}
	if n, err := r.PublishBatch(ctx); err != nil || n != 0 {
		t.Errorf("second PublishBatch: %d, %v; want 0, nil (every message marked)", n, err)
	}
	for id, k := range published {
		if k != 1 {
			t.Errorf("message %s published %d times", id, k)
		}
	}
	if len(published) != 12 {
		t.Errorf("%d messages published, want 12", len(published))
	}
}
