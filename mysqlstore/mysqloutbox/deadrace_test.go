package mysqloutbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/outbox"
)

// TestDeadLetterLosesItsLease: a relay dead-letters a message whose lease
// another relay takes (after it lapsed) while the dead letter runs. The
// message must be in one place: still in the outbox, the other relay's (or
// dead-lettered, and gone from the outbox), never both. The test holds the
// message's row while the first relay's DeadLetter runs and hands the lease
// to the second before it lets go. Before, DeadLetter copied the row into
// the dead letters by a plain read (INSERT … SELECT at READ COMMITTED takes
// no lock), then its DELETE waited, found the row the other relay's and
// deleted nothing: the message was dead-lettered and published too, and a
// second dead letter of it failed on the dead table's key for ever.
func TestDeadLetterLosesItsLease(t *testing.T) {
	db := testDB(t)
	o := newOutbox(t, db)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Enqueue(ctx, tx, outbox.Message{ID: "m", Subject: "s", PartitionKey: "P"}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	got, err := o.Lease(ctx, "relay-a", 10, time.Minute)
	if err != nil || len(got) != 1 {
		t.Fatalf("lease: %v, %d messages", err, len(got))
	}
	hold, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = hold.Rollback() }()
	var seq int64
	if err := hold.QueryRowContext(ctx, "SELECT seq FROM "+o.Table()+" WHERE seq = ? FOR UPDATE", got[0].Seq).Scan(&seq); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- o.DeadLetter(ctx, "relay-a", seq, "refused") }()
	// Until the dead letter waits for the held row.
	for {
		var waiting int
		// A statement of the dead letter on the table for a second or
		// more: it waits for the held row.
		if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.processlist WHERE command <> 'Sleep' AND time >= 1 AND info LIKE ?", "%"+o.Table()+"%").Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("DeadLetter ended (%v) without waiting for the held row", err)
		case <-ctx.Done():
			t.Fatal("DeadLetter never waited for the held row")
		case <-time.After(10 * time.Millisecond):
		}
	}
	// The lease lapsed and relay b took it.
	if _, err := hold.ExecContext(ctx, "UPDATE "+o.Table()+" SET lease_owner = 'relay-b' WHERE seq = ?", seq); err != nil {
		t.Fatal(err)
	}
	if err := hold.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	dead, err := o.DeadLetters(ctx, 10)
	if err != nil {
		t.Fatal(err)
	}
	var pending int
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+o.Table()+" WHERE seq = ?", seq).Scan(&pending); err != nil {
		t.Fatal(err)
	}
	if len(dead)+pending != 1 {
		t.Fatalf("the message is in the dead letters %d times and in the outbox %d times: want one place", len(dead), pending)
	}
}
