package mysqloutbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/outbox"
)

// TestRunBehindAnotherRelaysHead: a relay's lease takes, behind a head, only
// the messages no other relay is leasing, even when the other relay's lease
// of one of them commits while this lease runs. That happens when
// transactions overlap: relay a leased a partition's head 2 while 1 (enqueued
// earlier) had not committed; 1 commits and relay b takes it as the head,
// with the run behind it. The test holds a lease of 2 for relay a open while
// relay b leases and commits it once b waits for it. Before, b's run read 2
// as free (its lease not committed yet), b's UPDATE waited for a's and then
// leased 2 and 3 to b as well: both relays published 2 at once.
func TestRunBehindAnotherRelaysHead(t *testing.T) {
	db := testDB(t)
	o := newOutbox(t, db)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"first", "second", "third"} {
		if err := o.Enqueue(ctx, tx, outbox.Message{ID: id, Subject: "s", PartitionKey: "P"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	var second int64
	if err := db.QueryRowContext(ctx, "SELECT seq FROM "+o.Table()+" WHERE id = 'second'").Scan(&second); err != nil {
		t.Fatal(err)
	}
	// Relay a's lease of "second" and "third", not committed yet.
	hold, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = hold.Rollback() }()
	if _, err := hold.ExecContext(ctx, "UPDATE "+o.Table()+" SET lease_owner = 'relay-a', lease_until = NOW(6) + INTERVAL 1 MINUTE WHERE seq >= ?", second); err != nil {
		t.Fatal(err)
	}
	type result struct {
		got []outbox.Stored
		err error
	}
	done := make(chan result, 1)
	go func() {
		got, err := o.Lease(ctx, "relay-b", 10, time.Minute)
		done <- result{got, err}
	}()
	waited := false
	for !waited {
		var n int
		// A statement of relay b's lease on the table for a second or
		// more: it waits for relay a's rows.
		if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.processlist WHERE command <> 'Sleep' AND time >= 1 AND info LIKE ?", "%"+o.Table()+"%").Scan(&n); err != nil {
			t.Fatal(err)
		}
		waited = n > 0
		select {
		case r := <-done:
			// Ended without waiting: it must not have taken a's messages.
			done <- r
			waited = true
		case <-ctx.Done():
			t.Fatal("the lease neither ended nor waited")
		case <-time.After(10 * time.Millisecond):
		}
	}
	if err := hold.Commit(); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	var ids []string
	for _, s := range r.got {
		ids = append(ids, s.ID)
	}
	if len(ids) != 1 || ids[0] != "first" {
		t.Fatalf("relay b leased %v, want [first]: the rest is relay a's", ids)
	}
	var owner string
	if err := db.QueryRowContext(ctx, "SELECT lease_owner FROM "+o.Table()+" WHERE seq = ?", second).Scan(&owner); err != nil {
		t.Fatal(err)
	}
	if owner != "relay-a" {
		t.Fatalf("second's lease is %s's, want relay-a's", owner)
	}
}
