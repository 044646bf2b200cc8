package mysqloutbox_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"
)

// BenchmarkLeaseBacklog measures one Lease of 100 (the relay's default batch)
// on a table holding a backlog of unpublished messages, written straight
// into the table, in the shapes pgoutbox's BenchmarkLeaseBacklog uses:
//
//   - bursts: partitions of 1,000 consecutive messages;
//   - single: one message per partition, every message a head;
//   - stuck: one message per partition, the older half waiting for a retry;
//   - allstuck: one message per partition, all waiting for a retry (the
//     lease finds nothing).
//
// Each iteration's leases are released (outside the timing). The tables are
// dropped at the end. IDEM_BENCH_1M=1 adds backlogs of 1,000,000.
//
//	go test -run '^$' -bench BenchmarkLeaseBacklog -benchtime 10x ./mysqloutbox/
func BenchmarkLeaseBacklog(b *testing.B) {
	sizes := []int{100_000}
	if os.Getenv("IDEM_BENCH_1M") == "1" {
		sizes = append(sizes, 1_000_000)
	}
	for _, size := range sizes {
		for _, shape := range []string{"bursts", "single", "stuck", "allstuck"} {
			b.Run(fmt.Sprintf("%s/%d", shape, size), func(b *testing.B) { benchLease(b, shape, size) })
		}
	}
}

func benchLease(b *testing.B, shape string, size int) {
	db := testDB(b)
	o := newOutbox(b, db)
	per, stuck := 1, 0
	switch shape {
	case "bursts":
		per = 1000
	case "stuck":
		stuck = size / 2
	case "allstuck":
		stuck = size
	}
	fill(b, db, o, size, per, stuck)
	ctx := context.Background()
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
		if _, err := db.Exec("UPDATE " + o.Table() + " SET lease_owner = NULL, lease_until = NULL WHERE lease_owner = 'bench'"); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}
