package pgoutbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/pgstore/pgoutbox"
)

// BenchmarkLeaseBacklog measures one Lease of 100 (the relay's default batch)
// on a table holding a backlog of unpublished messages, written straight
// into the table (generate_series), in three shapes:
//
//   - bursts: partitions of 1,000 consecutive messages (an aggregate's
//     events enqueued together), so the heads are 1,000 seqs apart;
//   - single: one message per partition (the default partition, one
//     request's), every message a head;
//   - stuck: one message per partition, the older half of them waiting for
//     a retry (a broker refusing them for a while);
//   - allstuck: one message per partition, all of them waiting for a retry
//     (the broker down): the lease finds nothing.
//
// Each iteration's leases are released (outside the timing), so every
// iteration sees the same backlog.
//
//	go test -run '^$' -bench BenchmarkLeaseBacklog -benchtime 20x ./pgoutbox/
func BenchmarkLeaseBacklog(b *testing.B) {
	for _, size := range []int{100_000, 1_000_000} {
		for _, shape := range []string{"bursts", "single", "stuck", "allstuck"} {
			b.Run(fmt.Sprintf("%s/%d", shape, size), func(b *testing.B) { benchLease(b, shape, size) })
		}
	}
}

func benchLease(b *testing.B, shape string, size int) {
	pool, schema := testDB(b)
	ctx := context.Background()
	o, err := pgoutbox.New(pool, &pgoutbox.Config{Table: schema + ".outbox"})
	if err != nil {
		b.Fatal(err)
	}
	if err := o.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	part := "md5(g::text)"
	if shape == "bursts" {
		part = "md5((g / 1000)::text)"
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+o.Table()+` (id, subject, payload, partition_key)
SELECT 'm' || g, 'bench.x', '\x00', `+part+` FROM generate_series(0, $1 - 1) g`, size); err != nil {
		b.Fatal(err)
	}
	if shape == "stuck" || shape == "allstuck" {
		stuck := size / 2
		if shape == "allstuck" {
			stuck = size
		}
		if _, err := pool.Exec(ctx, `UPDATE `+o.Table()+` SET next_attempt_at = now() + interval '1 hour' WHERE seq <= $1`, stuck); err != nil {
			b.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE "+o.Table()); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for range b.N {
		got, err := o.Lease(ctx, "bench", 100, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		if (len(got) == 0) != (shape == "allstuck") {
			b.Fatalf("leased %d", len(got))
		}
		b.StopTimer()
		if _, err := pool.Exec(ctx, "UPDATE "+o.Table()+" SET lease_owner = NULL, lease_until = NULL WHERE lease_owner = 'bench'"); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}
