package mysqloutbox_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/mysqlstore/mysqloutbox"
)

// oldTableDDL is the outbox table as releases before head_idx created it.
const oldTableDDL = `CREATE TABLE %s (
  seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
  id VARBINARY(255) NOT NULL,
  subject VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  payload LONGBLOB NOT NULL,
  headers MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
  partition_key VARBINARY(255) NOT NULL,
  enqueued_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
  attempts INT NOT NULL DEFAULT 0,
  next_attempt_at TIMESTAMP(6) NULL DEFAULT NULL,
  lease_owner VARBINARY(255) NULL DEFAULT NULL,
  lease_until TIMESTAMP(6) NULL DEFAULT NULL,
  last_error TEXT CHARACTER SET utf8mb4 NULL,
  published_at TIMESTAMP(6) NULL DEFAULT NULL,
  KEY pending_idx (published_at, seq),
  KEY partition_idx (partition_key, published_at, seq)
) ENGINE=InnoDB`

// TestMigrateOldTable: an outbox table as an earlier release left it (no
// head_idx), holding messages: eight Migrates at once (one barrier) all
// succeed, the index is there once, the messages are kept and leased heads
// first, and Migrate again is a no-op.
func TestMigrateOldTable(t *testing.T) {
	db := testDB(t)
	table := "outbox_" + randHex(5)
	t.Cleanup(func() { _, _ = db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_dead") })
	if _, err := db.Exec(fmt.Sprintf(oldTableDDL, table)); err != nil {
		t.Fatal(err)
	}
	o, err := mysqloutbox.New(db, &mysqloutbox.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	fill(t, db, o, 300, 100, 0)
	ctx := context.Background()
	if _, err := o.Lease(ctx, "r", 1, time.Minute); err == nil {
		t.Fatal("Lease on a table without head_idx: no error")
	} else if !strings.Contains(err.Error(), "run Migrate") {
		t.Fatalf("Lease on a table without head_idx: %v (want it to say to run Migrate)", err)
	}
	start := make(chan struct{})
	errs := make(chan error, 8)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			errs <- o.Migrate(ctx)
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("concurrent Migrate of an old table: %v", err)
		}
	}
	if err := o.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	var cols int
	if err := db.QueryRow("SELECT COUNT(*) FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND INDEX_NAME = 'head_idx'", table).Scan(&cols); err != nil {
		t.Fatal(err)
	}
	if cols != 3 {
		t.Fatalf("head_idx has %d columns, want 3 (published_at, partition_key, seq)", cols)
	}
	got, err := o.Lease(ctx, "r", 3, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 {
		t.Fatalf("leased %d after Migrate, want 3", len(got))
	}
	for i, want := range []string{"m0", "m100", "m200"} {
		if got[i].ID != want {
			t.Fatalf("leased %s, want %s (the three partitions' heads)", got[i].ID, want)
		}
	}
}
