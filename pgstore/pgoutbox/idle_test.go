package pgoutbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/pgstore/pgoutbox"
)

// TestRelaySessionsEndedWhilePublishing: while the relay publishes what it
// leased, the pool's idle sessions are ended (pg_terminate_backend, as an
// operator's cleanup or a failover does; the pool pings only connections idle
// for more than a second). The relay's marks that follow must land: every
// message published once, the batch without a source error, nothing left to
// publish again.
func TestRelaySessionsEndedWhilePublishing(t *testing.T) {
	admin, schema := testDB(t)
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	name := "idem_pgoutbox_" + randHex(5)
	cfg.ConnConfig.RuntimeParams["application_name"] = name
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	o, err := pgoutbox.New(pool, &pgoutbox.Config{Table: schema + ".outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range partitions(3, "a", "b", "c", "d") {
		if err := o.Enqueue(ctx, tx, m); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var (
		mu        sync.Mutex
		published = map[string]int{}
		once      sync.Once
	)
	pub := outbox.PublisherFunc(func(ctx context.Context, m *outbox.Stored) error {
		once.Do(func() {
			// End the relay's sessions, idle now, and wait until they are gone.
			if _, err := admin.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", name); err != nil {
				t.Error(err)
			}
			for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				var n int
				if err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name).Scan(&n); err != nil || n == 0 {
					break
				}
			}
		})
		mu.Lock()
		published[m.ID]++
		mu.Unlock()
		return nil
	})
	r := &outbox.Relay{Source: o, Publisher: pub, BatchSize: 100, LeaseDuration: time.Minute}
	n, err := r.PublishBatch(ctx)
	if err != nil || n != 12 {
		t.Errorf("PublishBatch: %d, %v; want 12, nil", n, err)
	}
	n, err = r.PublishBatch(ctx)
	if err != nil || n != 0 {
		t.Errorf("second PublishBatch: %d, %v; want 0, nil (every message marked)", n, err)
	}
	var pending int
	if err := admin.QueryRow(ctx, "SELECT count(*) FROM "+schema+".outbox WHERE published_at IS NULL").Scan(&pending); err != nil {
		t.Fatal(err)
	}
	if pending != 0 {
		t.Errorf("%d messages not marked published", pending)
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
