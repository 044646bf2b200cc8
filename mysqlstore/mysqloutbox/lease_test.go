package mysqloutbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/mysqlstore/mysqloutbox"
	"github.com/idemkit/idem/outbox"
)

// fill writes count messages straight into o's table, in partitions of per
// consecutive messages (keyed by MD5 hashes, so key order is not seq order),
// next_attempt_at in an hour for the first stuck of them.
func fill(t testing.TB, db *sql.DB, o *mysqloutbox.Outbox, count, per, stuck int) {
	t.Helper()
	const batch = 1000
	for i := 0; i < count; i += batch {
		var q strings.Builder
		args := make([]any, 0, 3*batch)
		q.WriteString("INSERT INTO " + o.Table() + " (id, subject, payload, partition_key, next_attempt_at) VALUES ")
		for j := i; j < min(count, i+batch); j++ {
			if j > i {
				q.WriteString(",")
			}
			q.WriteString("(?, 'fill.x', 'x', MD5(?), IF(?, NOW(6) + INTERVAL 1 HOUR, NULL))")
			args = append(args, fmt.Sprintf("m%d", j), fmt.Sprintf("p%07d", j/per), j < stuck)
		}
		if _, err := db.Exec(q.String(), args...); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.Exec("ANALYZE TABLE " + o.Table()); err != nil {
		t.Fatal(err)
	}
}

// handlerReads is the rows the server's storage engine handed the session so
// far (the Handler_read_* counters of the one connection of db).
func handlerReads(t *testing.T, db *sql.DB) int64 {
	t.Helper()
	rows, err := db.Query("SHOW SESSION STATUS LIKE 'Handler_read%'")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var total int64
	for rows.Next() {
		var name string
		var v int64
		if err := rows.Scan(&name, &v); err != nil {
			t.Fatal(err)
		}
		total += v
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return total
}

// TestLeaseReadsHeadsNotBacklog: a lease of 10 behind 20,000 messages in
// partitions of 500 reads the partitions it walks, not the messages queued
// behind their heads (counted by the server, not timed): the head query
// before tested the messages in seq order (about 4,500 for 10 heads), and
// the runs read each partition's whole backlog (5,000).
func TestLeaseReadsHeadsNotBacklog(t *testing.T) {
	db := testDB(t)
	db.SetMaxOpenConns(1) // one session: its counters are the lease's
	o := newOutbox(t, db)
	fill(t, db, o, 20_000, 500, 0)
	ctx := context.Background()
	base := handlerReads(t, db)
	overhead := handlerReads(t, db) - base // what SHOW STATUS itself reads
	before := handlerReads(t, db)
	got, err := o.Lease(ctx, "r", 10, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	reads := handlerReads(t, db) - before - overhead
	if len(got) != 10 {
		t.Fatalf("leased %d, want 10", len(got))
	}
	t.Logf("a lease of 10 behind 20,000 messages in 40 partitions: %d rows read", reads)
	if reads > 4000 {
		t.Fatalf("a lease of 10 read %d rows behind 40 partitions of 500 (want at most 4,000: the partitions walked and the runs, not the backlog)", reads)
	}
}

// TestLeaseWalksPastStuckHeads: 5,000 partitions whose heads wait for a
// retry, then one ready message: leases of one go on from where the last
// stopped, so one of the first few reaches it, and none leases a stuck head.
func TestLeaseWalksPastStuckHeads(t *testing.T) {
	db := testDB(t)
	o := newOutbox(t, db)
	fill(t, db, o, 5000, 1, 5000)
	ctx := context.Background()
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Enqueue(ctx, tx, outbox.Message{ID: "ready", Subject: "ready.x", PartitionKey: "z"}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= 100; i++ {
		got, err := o.Lease(ctx, "r", 1, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) == 1 {
			if got[0].ID != "ready" {
				t.Fatalf("leased %s, a head waiting for its retry", got[0].ID)
			}
			t.Logf("the ready head leased by lease %d", i)
			return
		}
	}
	t.Fatal("100 leases did not reach the one ready head behind 5,000 partitions waiting for a retry")
}

// TestLeaseRoundRobin: three partitions of three messages, leases of one,
// each published before the next: the leases go round the partitions (a, b,
// c, a, ...: the next lease starts after the partition the last one took, so
// a partition with a backlog does not hold the others up), each its
// partition's head.
func TestLeaseRoundRobin(t *testing.T) {
	db := testDB(t)
	o := newOutbox(t, db)
	ctx := context.Background()
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		for _, p := range []string{"a", "b", "c"} {
			if err := o.Enqueue(ctx, tx, outbox.Message{ID: fmt.Sprintf("%s%d", p, i), Subject: "rr.x", PartitionKey: p}); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for range 9 {
		got, err := o.Lease(ctx, "r", 1, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 1 {
			t.Fatalf("leased %d after %v, want 1", len(got), ids)
		}
		ids = append(ids, got[0].ID)
		if _, err := o.MarkPublished(ctx, "r", got[0].Seq); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := strings.Join(ids, " "), "a0 b0 c0 a1 b1 c1 a2 b2 c2"; got != want {
		t.Fatalf("leased %s, want %s", got, want)
	}
}

// TestLeaseRoundRobinWraps: five partitions of three messages, leases of
// three, each published before the next: a lease that wraps around the keys
// (d, e, then a) leaves the next to start after a, so every partition gets
// its turn before any gets another.
func TestLeaseRoundRobinWraps(t *testing.T) {
	db := testDB(t)
	o := newOutbox(t, db)
	ctx := context.Background()
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		for _, p := range []string{"a", "b", "c", "d", "e"} {
			if err := o.Enqueue(ctx, tx, outbox.Message{ID: fmt.Sprintf("%s%d", p, i), Subject: "rr.x", PartitionKey: p}); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	var leases []string
	for range 5 {
		got, err := o.Lease(ctx, "r", 3, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, s := range got {
			ids = append(ids, s.ID)
			if _, err := o.MarkPublished(ctx, "r", s.Seq); err != nil {
				t.Fatal(err)
			}
		}
		slices.Sort(ids)
		leases = append(leases, strings.Join(ids, " "))
	}
	if got, want := strings.Join(leases, " | "), "a0 b0 c0 | a1 d0 e0 | b1 c1 d1 | a2 b2 e1 | c2 d2 e2"; got != want {
		t.Fatalf("leased %s, want %s", got, want)
	}
}
