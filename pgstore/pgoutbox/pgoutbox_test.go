package pgoutbox_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/outboxtest"
	"github.com/idemkit/idem/pgstore/pgoutbox"
)

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// testDB is a pool on a fresh schema, dropped when t ends.
func testDB(t testing.TB) (*pgxpool.Pool, string) {
	t.Helper()
	url := testenv.PostgresURL(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 40
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	schema := "idem_pgoutbox_" + randHex(5)
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		pool.Close()
		t.Fatalf("create schema: %v", err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
		pool.Close()
	})
	return pool, schema
}

func TestSource(t *testing.T) {
	pool, schema := testDB(t)
	n := 0
	outboxtest.Run(t, outboxtest.Harness{
		New: func(t *testing.T) outbox.Source {
			n++
			o, err := pgoutbox.New(pool, &pgoutbox.Config{Table: schema + ".outbox_" + string(rune('a'+n))})
			if err != nil {
				t.Fatal(err)
			}
			if err := o.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			return o
		},
		Begin: func(ctx context.Context, src outbox.Source) (func(outbox.Message) error, func() error, error) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return nil, nil, err
			}
			return func(m outbox.Message) error { return src.(*pgoutbox.Outbox).Enqueue(ctx, tx, m) },
				func() error { return tx.Commit(ctx) }, nil
		},
		Enqueue: func(ctx context.Context, src outbox.Source, msgs ...outbox.Message) error {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(ctx) }()
			for _, m := range msgs {
				if err := src.(*pgoutbox.Outbox).Enqueue(ctx, tx, m); err != nil {
					return err
				}
			}
			return tx.Commit(ctx)
		},
	})
}

// TestLeaseRoundRobin: Lease walks the partitions from where its last call
// stopped and wraps around, so small leases reach every partition's head,
// including a partition enqueued behind the cursor, and never one that
// is not a head.
func TestLeaseRoundRobin(t *testing.T) {
	pool, schema := testDB(t)
	ctx := context.Background()
	o, err := pgoutbox.New(pool, &pgoutbox.Config{Table: schema + ".outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	enqueue := func(msgs ...outbox.Message) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range msgs {
			if err := o.Enqueue(ctx, tx, m); err != nil {
				t.Fatal(err)
			}
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	m := func(id, part string) outbox.Message {
		return outbox.Message{ID: id, Subject: "rr.x", PartitionKey: part}
	}
	enqueue(m("c1", "c"), m("c2", "c"), m("d1", "d"), m("e1", "e"), m("f1", "f"))
	seen := map[string]int{}
	lease := func() []string {
		got, err := o.Lease(ctx, "r", 1, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, s := range got {
			ids = append(ids, s.ID)
			seen[s.ID]++
			if _, err := o.MarkPublished(ctx, "r", s.Seq); err != nil {
				t.Fatal(err)
			}
		}
		return ids
	}
	var order []string
	for range 2 {
		order = append(order, lease()...)
	}
	// Behind the cursor now: a new partition "a", and b.
	enqueue(m("a1", "a"), m("b1", "b"))
	for range 6 {
		order = append(order, lease()...)
	}
	for _, id := range []string{"a1", "b1", "c1", "c2", "d1", "e1", "f1"} {
		if seen[id] != 1 {
			t.Fatalf("leases of 1 in turn leased %v: %s %d times, want every message once", order, id, seen[id])
		}
	}
	pos := map[string]int{}
	for i, id := range order {
		pos[id] = i
	}
	if pos["c2"] < pos["c1"] {
		t.Fatalf("c2 leased before c1: %v", order)
	}
	if got := lease(); len(got) != 0 {
		t.Fatalf("leased %v from an empty outbox", got)
	}
}

// TestLeaseWalksPastStuckHeads: 5,000 partitions whose heads wait for a
// retry (a broker refusing them for now) sort before the one ready
// partition. One Lease walks a bounded number of partitions, so it may find
// nothing; the next ones must go on from where it stopped and reach the
// ready head within a few calls, not walk the same stuck heads again.
func TestLeaseWalksPastStuckHeads(t *testing.T) {
	pool, schema := testDB(t)
	ctx := context.Background()
	o, err := pgoutbox.New(pool, &pgoutbox.Config{Table: schema + ".outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+o.Table()+` (id, subject, payload, partition_key, next_attempt_at)
SELECT 's' || g, 'stuck.x', '\x00', 'a' || lpad(g::text, 5, '0'), now() + interval '1 hour' FROM generate_series(1, 5000) g`); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Enqueue(ctx, tx, outbox.Message{ID: "ready", Subject: "ready.x", PartitionKey: "z"}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
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

// newOutbox is an Outbox on a fresh table of its own schema, migrated, with
// msgs enqueued in one transaction, in their order.
func newOutbox(t *testing.T, msgs ...outbox.Message) *pgoutbox.Outbox {
	t.Helper()
	pool, schema := testDB(t)
	ctx := context.Background()
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
	defer func() { _ = tx.Rollback(ctx) }()
	for _, m := range msgs {
		if err := o.Enqueue(ctx, tx, m); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return o
}

// partitions is rounds messages in each of parts, enqueued round by round:
// a0 b0 c0 a1 b1 c1 ... (ID: partition and round).
func partitions(rounds int, parts ...string) []outbox.Message {
	var msgs []outbox.Message
	for i := range rounds {
		for _, p := range parts {
			msgs = append(msgs, outbox.Message{ID: fmt.Sprintf("%s%d", p, i), Subject: "rr.x", PartitionKey: p})
		}
	}
	return msgs
}

// leaseAll leases n at a time, times times, publishing each lease before
// the next, and returns each lease's IDs sorted, the leases joined by " | ".
func leaseAll(t *testing.T, o *pgoutbox.Outbox, n, times int) string {
	t.Helper()
	ctx := context.Background()
	var leases []string
	for range times {
		got, err := o.Lease(ctx, "r", n, time.Minute)
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
	return strings.Join(leases, " | ")
}

// TestLeaseRoundRobinOrder: three partitions of three messages, leases of
// one, each published before the next: the leases go round the partitions
// (a, b, c, a, ...: the next lease starts after the partition the last one
// took, so a partition with a backlog does not hold the others up), each
// its partition's head.
func TestLeaseRoundRobinOrder(t *testing.T) {
	o := newOutbox(t, partitions(3, "a", "b", "c")...)
	if got, want := leaseAll(t, o, 1, 10), "a0 | b0 | c0 | a1 | b1 | c1 | a2 | b2 | c2 | "; got != want {
		t.Fatalf("leased %s, want %s", got, want)
	}
}

// TestLeaseRoundRobinWraps: five partitions of three messages, leases of
// three, each published before the next: a lease that wraps around the keys
// (d, e, then a) leaves the next to start after a, so every partition gets
// its turn before any gets another.
func TestLeaseRoundRobinWraps(t *testing.T) {
	o := newOutbox(t, partitions(3, "a", "b", "c", "d", "e")...)
	if got, want := leaseAll(t, o, 3, 6), "a0 b0 c0 | a1 d0 e0 | b1 c1 d1 | a2 b2 e1 | c2 d2 e2 | "; got != want {
		t.Fatalf("leased %s, want %s", got, want)
	}
}

// TestLeaseRoundRobinWrapsOne: leases of one over partitions of unequal
// backlogs, the cursor wrapping around several times: strictly a, b, c, a,
// ... while each has messages left, then the rest in their turn.
func TestLeaseRoundRobinWrapsOne(t *testing.T) {
	msgs := partitions(2, "a", "b", "c")
	msgs = append(msgs, outbox.Message{ID: "a2", Subject: "rr.x", PartitionKey: "a"}, outbox.Message{ID: "c2", Subject: "rr.x", PartitionKey: "c"})
	o := newOutbox(t, msgs...)
	if got, want := leaseAll(t, o, 1, 9), "a0 | b0 | c0 | a1 | b1 | c1 | a2 | c2 | "; got != want {
		t.Fatalf("leased %s, want %s", got, want)
	}
}

// TestLeaseKeepsEveryHead: a lease of three finds the heads of a, b and c
// and takes them, not a's run (a1 a2, lower seqs than b's and c's heads,
// which would lose their turn); then a's run in turn.
func TestLeaseKeepsEveryHead(t *testing.T) {
	m := func(id, part string) outbox.Message {
		return outbox.Message{ID: id, Subject: "rr.x", PartitionKey: part}
	}
	o := newOutbox(t, m("a0", "a"), m("a1", "a"), m("a2", "a"), m("b0", "b"), m("c0", "c"), m("a3", "a"))
	got := leaseAll(t, o, 3, 1) + " | " + leaseAll(t, o, 1, 4)
	if want := "a0 b0 c0 | a1 | a2 | a3 | "; got != want {
		t.Fatalf("leased %s, want %s", got, want)
	}
}
