package pgoutbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/pgstore/pgoutbox"
)

// TestRunBehindAnotherRelaysHead: after transactions of one partition
// overlapped, relay a leases the later ones (here: second and third, its head
// and run) while relay b's lease finds first, committed last, as the head.
// Relay b must lease first alone: the run behind it is relay a's. Failed
// before: relay b read the run from its snapshot as free and leased it again,
// so two relays published second and third at once.
func TestRunBehindAnotherRelaysHead(t *testing.T) {
	pool, schema := testDB(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	o, err := pgoutbox.New(pool, &pgoutbox.Config{Table: schema + ".ob"})
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
	for _, id := range []string{"first", "second", "third"} {
		if err := o.Enqueue(ctx, tx, outbox.Message{ID: id, Subject: "s", PartitionKey: "P"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	hold, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = hold.Rollback(context.Background()) }()
	if _, err := hold.Exec(ctx, "UPDATE "+o.Table()+" SET lease_owner = 'relay-a', lease_until = now() + interval '1 minute' WHERE id <> 'first'"); err != nil {
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
	for waited := false; !waited; {
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()").Scan(&n); err != nil {
			t.Fatal(err)
		}
		waited = n > 0
		select {
		case r := <-done:
			done <- r
			waited = true
		case <-time.After(10 * time.Millisecond):
		}
	}
	if err := hold.Commit(ctx); err != nil {
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
}
