package mysqloutbox_test

import (
	"context"
	"database/sql"
	"net/url"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/mysqlstore/mysqloutbox"
	"github.com/idemkit/idem/outbox"
)

// zoneDB is a pool whose sessions run with time_zone set to zone.
func zoneDB(t *testing.T, zone string) *sql.DB {
	t.Helper()
	db, err := sql.Open("mysql", testenv.MySQLDSN(testenv.MySQLURL(t))+"&time_zone="+url.QueryEscape("'"+zone+"'"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	var got string
	if err := db.QueryRow("SELECT @@session.time_zone").Scan(&got); err != nil || got != zone {
		t.Fatalf("session time_zone %q (%v), want %q", got, err, zone)
	}
	return db
}

// TestSessionTimeZones: the enqueuer's sessions at -11:00, one relay's at
// +13:00, another's at +00:00 (a day apart at the extremes). Leases, retry
// times, the retention and the ages must be judged by the instant, not by
// the wall clock of whichever session wrote or reads them: a lease taken at
// +13:00 holds against the relay at +00:00 and lapses for it on time, and
// so on. (The columns are TIMESTAMP(6) and the times NOW(6): this guards
// that. A zone with daylight saving time needs the server's time zone
// tables; see docs/stores.md.)
func TestSessionTimeZones(t *testing.T) {
	ctx := context.Background()
	enqDB, east, west := zoneDB(t, "-11:00"), zoneDB(t, "+13:00"), zoneDB(t, "+00:00")
	table := "outbox_tz_" + randHex(5)
	open := func(db *sql.DB) *mysqloutbox.Outbox {
		o, err := mysqloutbox.New(db, &mysqloutbox.Config{Table: table})
		if err != nil {
			t.Fatal(err)
		}
		return o
	}
	enq, r1, r2 := open(enqDB), open(east), open(west)
	if err := enq.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = west.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_dead") })
	tx, err := enqDB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"a", "b"} {
		if err := enq.Enqueue(ctx, tx, outbox.Message{ID: id, Subject: "tz.x", Payload: []byte(id)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	for _, o := range []*mysqloutbox.Outbox{enq, r1, r2} {
		st, err := o.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending != 2 || st.OldestPending < 0 || st.OldestPending > time.Minute {
			t.Fatalf("stats %+v, want 2 pending enqueued just now", st)
		}
	}
	const lease = 3 * time.Second
	got, err := r1.Lease(ctx, "east", 10, lease)
	if err != nil || len(got) != 2 {
		t.Fatalf("east leased %d (%v), want 2", len(got), err)
	}
	leased := time.Now()
	if d := time.Since(got[0].EnqueuedAt); d < -time.Minute || d > time.Minute {
		t.Fatalf("EnqueuedAt %v read back %v from now", got[0].EnqueuedAt, d)
	}
	if other, err := r2.Lease(ctx, "west", 10, lease); err != nil || len(other) != 0 {
		t.Fatalf("west leased %d (%v) while east's lease holds", len(other), err)
	}
	// a: retried in 3 s; b: its lease lapses.
	if err := r1.Retry(ctx, "east", got[0].Seq, lease, "tz test"); err != nil {
		t.Fatal(err)
	}
	if other, err := r2.Lease(ctx, "west", 10, lease); err != nil || len(other) != 0 {
		t.Fatalf("west leased %v (%v) before a's retry time", len(other), err)
	}
	for time.Since(leased) < lease+500*time.Millisecond {
		time.Sleep(100 * time.Millisecond)
	}
	again, err := r2.Lease(ctx, "west", 10, time.Minute)
	if err != nil || len(again) != 2 {
		t.Fatalf("west leased %d (%v) after the lease and the retry time passed, want 2", len(again), err)
	}
	if n, err := r2.MarkPublished(ctx, "west", again[0].Seq, again[1].Seq); err != nil || n != 2 {
		t.Fatalf("marked %d (%v)", n, err)
	}
	// Published just now: not older than an hour, whoever asks.
	for _, o := range []*mysqloutbox.Outbox{enq, r1} {
		if n, err := o.DeletePublished(ctx, time.Hour, 10); err != nil || n != 0 {
			t.Fatalf("deleted %d (%v) messages published just now as older than an hour", n, err)
		}
	}
}
