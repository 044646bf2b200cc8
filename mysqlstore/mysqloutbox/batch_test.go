package mysqloutbox_test

import (
	"context"
	"testing"
	"time"
)

// TestLeaseHugeBatch: a relay configured with a batch larger than the
// server's 65,535 placeholders per statement (idem relay --batch 70000)
// still leases, up to what one statement can name, instead of failing every
// lease for as long as that many messages wait.
func TestLeaseHugeBatch(t *testing.T) {
	if testing.Short() {
		t.Skip("70,000 rows")
	}
	ctx := context.Background()
	db := testDB(t)
	ob := newOutbox(t, db)
	var seqTable string
	if err := db.QueryRow("SELECT 'seq_1_to_70000' FROM seq_1_to_1").Scan(&seqTable); err != nil {
		t.Skipf("no Sequence engine (MariaDB only): %v", err)
	}
	if _, err := db.Exec("INSERT INTO " + ob.Table() + " (id, subject, payload, partition_key) SELECT CONCAT('m', seq), 'orders.created', '', CONCAT('p', seq) FROM seq_1_to_70000"); err != nil {
		t.Fatal(err)
	}
	ms, err := ob.Lease(ctx, "relay", 70000, time.Minute)
	if err != nil {
		t.Fatalf("lease of a 70,000 batch: %v", err)
	}
	if len(ms) == 0 {
		t.Fatal("leased nothing")
	}
	n, err := ob.MarkPublished(ctx, "relay", func() []int64 {
		s := make([]int64, len(ms))
		for i := range ms {
			s[i] = ms[i].Seq
		}
		return s
	}()...)
	if err != nil || n != len(ms) {
		t.Fatalf("marked %d of %d: %v", n, len(ms), err)
	}
	t.Logf("leased and marked %d", n)
}
