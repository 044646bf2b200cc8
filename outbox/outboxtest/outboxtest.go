// Package outboxtest is the conformance suite of outbox.Source: a store's
// outbox package runs Run against a real database to prove the lease, the
// head-of-partition rule, the fencing of the marks, retries, dead letters,
// retention, the stats and several relays at once.
package outboxtest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/outbox"
)

// Harness is what a store gives the suite.
type Harness struct {
	// New returns a Source on a fresh, empty table.
	New func(t *testing.T) outbox.Source
	// Enqueue commits msgs in one transaction of src's database.
	Enqueue func(ctx context.Context, src outbox.Source, msgs ...outbox.Message) error
	// Begin, if set, opens a transaction of src's database and returns the
	// functions that enqueue in it and commit it: the commit-order and the
	// opposite-order tests run only with it.
	Begin func(ctx context.Context, src outbox.Source) (enqueue func(outbox.Message) error, commit func() error, err error)
	// Relays is how many relays the concurrency test runs at once (4 if 0).
	Relays int
	// Messages is how many messages it enqueues (400 if 0).
	Messages int
	// Serial says that the database runs write transactions one at a time
	// (SQLite): Begin waits for the open one to end, and the commit-order
	// test, which needs two open at once, is skipped.
	Serial bool
	// Pairs is how many pairs of transactions the opposite-order test runs
	// at once (12 if 0); each transaction holds a connection.
	Pairs int
}

func msg(id, partition string) outbox.Message {
	return outbox.Message{ID: id, Subject: "outboxtest.x", Payload: []byte("payload of " + id), PartitionKey: partition, Headers: map[string]string{"X-Id": id}}
}

func ctx30(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// Run runs every test of the suite as a subtest of t.
func Run(t *testing.T, h Harness) {
	t.Run("LeaseHeadsOnly", func(t *testing.T) { testLeaseHeads(t, h) })
	t.Run("RetryBlocksItsPartitionOnly", func(t *testing.T) { testRetry(t, h) })
	t.Run("LapsedLeaseTakenOver", func(t *testing.T) { testLapse(t, h) })
	t.Run("DeadLetter", func(t *testing.T) { testDeadLetter(t, h) })
	t.Run("Retention", func(t *testing.T) { testRetention(t, h) })
	t.Run("Stats", func(t *testing.T) { testStats(t, h) })
	t.Run("CommitOrderInPartition", func(t *testing.T) { testCommitOrder(t, h) })
	t.Run("OppositeOrdersNoDeadlock", func(t *testing.T) { testOppositeOrders(t, h) })
	t.Run("ConcurrentRelays", func(t *testing.T) { testConcurrent(t, h, false) })
	t.Run("ConcurrentRelaysWithCrashes", func(t *testing.T) { testConcurrent(t, h, true) })
	t.Run("RelaysWhileSerialisedWritersCommit", func(t *testing.T) { testLiveWriters(t, h) })
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func ids(s []outbox.Stored) []string {
	var out []string
	for _, m := range s {
		out = append(out, m.ID)
	}
	return out
}

func testLeaseHeads(t *testing.T, h Harness) {
	ctx := ctx30(t)
	src := h.New(t)
	must(t, h.Enqueue(ctx, src, msg("a1", "A"), msg("b1", "B"), msg("a2", "A")))
	must(t, h.Enqueue(ctx, src, msg("a3", "A"), msg("c1", "C")))
	got, err := src.Lease(ctx, "r1", 10, time.Minute)
	must(t, err)
	// The heads, each possibly with the run behind it: a1 [a2 [a3]], b1, c1.
	switch fmt.Sprint(ids(got)) {
	case "[a1 b1 c1]", "[a1 b1 a2 c1]", "[a1 b1 a2 a3 c1]":
	default:
		t.Fatalf("first lease: %v, want the head of each partition [a1 b1 c1], possibly with the ones behind a1 in order", ids(got))
	}
	run := len(got) > 3
	m := got[0]
	if string(m.Payload) != "payload of a1" || m.Subject != "outboxtest.x" || m.Headers["X-Id"] != "a1" || m.PartitionKey != "A" || m.Attempts != 0 || m.EnqueuedAt.IsZero() || m.Seq <= 0 {
		t.Fatalf("leased message read back as %+v", m)
	}
	if !(got[0].Seq < got[1].Seq && got[1].Seq < got[2].Seq) {
		t.Fatalf("lease not in seq order: %d %d %d", got[0].Seq, got[1].Seq, got[2].Seq)
	}
	again, err := src.Lease(ctx, "r2", 10, time.Minute)
	must(t, err)
	if len(again) != 0 {
		t.Fatalf("a second relay leased %v while r1's leases hold", ids(again))
	}
	n, err := src.MarkPublished(ctx, "r2", got[0].Seq)
	must(t, err)
	if n != 0 {
		t.Fatal("r2 marked a message r1 leases")
	}
	n, err = src.MarkPublished(ctx, "r1", got[0].Seq, got[1].Seq)
	must(t, err)
	if n != 2 {
		t.Fatalf("r1 marked %d of its 2", n)
	}
	next, err := src.Lease(ctx, "r2", 10, time.Minute)
	must(t, err)
	if run {
		if len(next) != 0 {
			t.Fatalf("after a1 was published: r2 leased %v, which r1 leases behind a1", ids(next))
		}
	} else if fmt.Sprint(ids(next)) != "[a2]" {
		t.Fatalf("after a1 was published: %v, want [a2]", ids(next))
	}
	n, err = src.MarkPublished(ctx, "r1", got[0].Seq)
	must(t, err)
	if n != 0 {
		t.Fatal("a message was marked published twice")
	}
	// A run stops at a message another relay leases.
	if run {
		src2 := h.New(t)
		must(t, h.Enqueue(ctx, src2, msg("x1", "X"), msg("x2", "X"), msg("x3", "X")))
		first, err := src2.Lease(ctx, "r1", 1, time.Minute) // x1 alone
		must(t, err)
		if fmt.Sprint(ids(first)) != "[x1]" {
			t.Fatalf("lease of 1: %v", ids(first))
		}
		n, err := src2.MarkPublished(ctx, "r1", first[0].Seq)
		must(t, err)
		if n != 1 {
			t.Fatal("mark")
		}
	}
}

// leaseHeads leases like Lease and releases at once what a Source leased
// behind the heads (runs), for the tests that follow one message per
// partition.
func leaseHeads(ctx context.Context, t *testing.T, src outbox.Source, owner string, n int, d time.Duration) []outbox.Stored {
	t.Helper()
	got, err := src.Lease(ctx, owner, n, d)
	must(t, err)
	seen := map[string]bool{}
	var heads []outbox.Stored
	for _, m := range got {
		if seen[m.PartitionKey] {
			must(t, src.Retry(ctx, owner, m.Seq, 0, "released by the test"))
			continue
		}
		seen[m.PartitionKey] = true
		heads = append(heads, m)
	}
	return heads
}

func testRetry(t *testing.T, h Harness) {
	ctx := ctx30(t)
	src := h.New(t)
	must(t, h.Enqueue(ctx, src, msg("a1", "A"), msg("a2", "A"), msg("b1", "B")))
	got := leaseHeads(ctx, t, src, "r1", 10, time.Minute)
	if len(got) != 2 {
		t.Fatalf("lease: %v", ids(got))
	}
	must(t, src.Retry(ctx, "r1", got[0].Seq, 700*time.Millisecond, "broker down: connection refused"))
	_, err := src.MarkPublished(ctx, "r1", got[1].Seq)
	must(t, err)
	now, err := src.Lease(ctx, "r1", 10, time.Minute)
	must(t, err)
	if len(now) != 0 {
		t.Fatalf("leased %v before a1's retry time (a2 must wait behind a1)", ids(now))
	}
	time.Sleep(800 * time.Millisecond)
	later := leaseHeads(ctx, t, src, "r2", 10, time.Minute)
	if fmt.Sprint(ids(later)) != "[a1]" || later[0].Attempts != 1 {
		t.Fatalf("after the retry time: %v (attempts %v), want [a1] with 1 attempt before", ids(later), later)
	}
}

func testLapse(t *testing.T, h Harness) {
	ctx := ctx30(t)
	src := h.New(t)
	must(t, h.Enqueue(ctx, src, msg("a1", "A")))
	got, err := src.Lease(ctx, "r1", 10, time.Second)
	must(t, err)
	if len(got) != 1 {
		t.Fatal(ids(got))
	}
	none, err := src.Lease(ctx, "r2", 10, time.Minute)
	must(t, err)
	if len(none) != 0 {
		t.Fatalf("leased twice: %+v", none)
	}
	time.Sleep(1200 * time.Millisecond)
	again, err := src.Lease(ctx, "r2", 10, time.Minute)
	must(t, err)
	if len(again) != 1 || again[0].ID != "a1" || again[0].Seq != got[0].Seq || again[0].Attempts != 1 {
		t.Fatalf("after the lease lapsed: %+v", again)
	}
	n, err := src.MarkPublished(ctx, "r1", got[0].Seq)
	must(t, err)
	if n != 0 {
		t.Fatal("the relay whose lease lapsed and was taken over still marked the message")
	}
	n, err = src.MarkPublished(ctx, "r2", got[0].Seq)
	must(t, err)
	if n != 1 {
		t.Fatal("the new holder could not mark")
	}
}

func testDeadLetter(t *testing.T, h Harness) {
	ctx := ctx30(t)
	src := h.New(t)
	must(t, h.Enqueue(ctx, src, msg("a1", "A"), msg("a2", "A")))
	got := leaseHeads(ctx, t, src, "r1", 10, time.Minute)
	must(t, src.DeadLetter(ctx, "r2", got[0].Seq, "not mine"))
	st, err := src.Stats(ctx)
	must(t, err)
	if st.DeadLetters != 0 || st.Pending != 2 {
		t.Fatalf("a relay dead-lettered a message it does not lease: %+v", st)
	}
	must(t, src.DeadLetter(ctx, "r1", got[0].Seq, "too large: \x00 1048577 bytes \xff"))
	next, err := src.Lease(ctx, "r1", 10, time.Minute)
	must(t, err)
	if fmt.Sprint(ids(next)) != "[a2]" {
		t.Fatalf("after a1 was dead-lettered: %v, want [a2]", ids(next))
	}
	st, err = src.Stats(ctx)
	must(t, err)
	if st.DeadLetters != 1 || st.Pending != 1 {
		t.Fatalf("stats %+v", st)
	}
	rd, ok := src.(interface {
		Redrive(ctx context.Context, seqs ...int64) (int, error)
	})
	if !ok {
		return
	}
	n, err := rd.Redrive(ctx, got[0].Seq, 999999)
	must(t, err)
	if n != 1 {
		t.Fatalf("redrove %d, want 1", n)
	}
	st, err = src.Stats(ctx)
	must(t, err)
	if st.DeadLetters != 0 || st.Pending != 2 {
		t.Fatalf("after Redrive: %+v", st)
	}
	_, err = src.MarkPublished(ctx, "r1", next[0].Seq)
	must(t, err)
	again, err := src.Lease(ctx, "r1", 10, time.Minute)
	must(t, err)
	if len(again) != 1 || again[0].ID != "a1" || again[0].Seq <= next[0].Seq || string(again[0].Payload) != "payload of a1" || again[0].Headers["X-Id"] != "a1" {
		t.Fatalf("the redriven message: %+v", again)
	}
}

func testRetention(t *testing.T, h Harness) {
	ctx := ctx30(t)
	src := h.New(t)
	var all []outbox.Message
	for i := range 5 {
		all = append(all, msg(fmt.Sprint("p", i), fmt.Sprint("P", i)))
	}
	all = append(all, msg("pending", "Q"), msg("dead", "R"))
	must(t, h.Enqueue(ctx, src, all...))
	got, err := src.Lease(ctx, "r1", 10, time.Minute)
	must(t, err)
	var pub []int64
	for _, m := range got {
		switch m.ID {
		case "dead":
			must(t, src.DeadLetter(ctx, "r1", m.Seq, "refused"))
		case "pending":
			must(t, src.Retry(ctx, "r1", m.Seq, time.Hour, "down"))
		default:
			pub = append(pub, m.Seq)
		}
	}
	if n, err := src.MarkPublished(ctx, "r1", pub...); err != nil || n != 5 {
		t.Fatal(n, err)
	}
	n, err := src.DeletePublished(ctx, time.Hour, 100)
	must(t, err)
	if n != 0 {
		t.Fatalf("deleted %d messages published less than the retention ago", n)
	}
	time.Sleep(300 * time.Millisecond)
	n, err = src.DeletePublished(ctx, 100*time.Millisecond, 2)
	must(t, err)
	if n != 2 {
		t.Fatalf("first batch deleted %d, want the limit 2", n)
	}
	total := n
	for {
		n, err = src.DeletePublished(ctx, 100*time.Millisecond, 2)
		must(t, err)
		if n == 0 {
			break
		}
		if n > 2 {
			t.Fatalf("batch of %d over the limit 2", n)
		}
		total += n
	}
	if total != 5 {
		t.Fatalf("deleted %d published messages, want 5", total)
	}
	st, err := src.Stats(ctx)
	must(t, err)
	if st.Pending != 1 || st.DeadLetters != 1 {
		t.Fatalf("retention touched unpublished or dead-lettered messages: %+v", st)
	}
}

func testStats(t *testing.T, h Harness) {
	ctx := ctx30(t)
	src := h.New(t)
	st, err := src.Stats(ctx)
	must(t, err)
	if st != (outbox.Stats{}) {
		t.Fatalf("empty table: %+v", st)
	}
	must(t, h.Enqueue(ctx, src, msg("a1", "A"), msg("a2", "A"), msg("b1", "B")))
	time.Sleep(250 * time.Millisecond)
	must(t, h.Enqueue(ctx, src, msg("c1", "C")))
	st, err = src.Stats(ctx)
	must(t, err)
	if st.Pending != 4 || st.OldestPending < 200*time.Millisecond || st.OldestPending > time.Minute {
		t.Fatalf("stats %+v, want 4 pending, the oldest about 250ms old", st)
	}
}

// checker is a Publisher that proves the relays' guarantees: no message in
// flight twice at once, and per partition, messages confirmed in seq order.
type checker struct {
	mu        sync.Mutex
	inFlight  map[string]bool
	lastSeq   map[string]int64 // partition -> last confirmed seq
	confirmed map[string]int   // ID -> confirmations
	fails     atomic.Int64
	failRate  float64
	errs      []string
	// partInFlight, when set, is the message of each partition in flight:
	// a second one of the partition at once is an error.
	partInFlight map[string]string
}

func (c *checker) Publish(ctx context.Context, m *outbox.Stored) error {
	c.mu.Lock()
	if c.inFlight[m.ID] {
		c.errs = append(c.errs, "message "+m.ID+" published by two relays at once")
	}
	c.inFlight[m.ID] = true
	if c.partInFlight != nil {
		if other, ok := c.partInFlight[m.PartitionKey]; ok {
			c.errs = append(c.errs, fmt.Sprintf("partition %s: %s published while %s was in flight", m.PartitionKey, m.ID, other))
		}
		c.partInFlight[m.PartitionKey] = m.ID
	}
	c.mu.Unlock()
	time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond)
	fail := rand.Float64() < c.failRate
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.inFlight, m.ID)
	if c.partInFlight != nil && c.partInFlight[m.PartitionKey] == m.ID {
		delete(c.partInFlight, m.PartitionKey)
	}
	if fail {
		c.fails.Add(1)
		return errors.New("outboxtest: broker unavailable")
	}
	if last := c.lastSeq[m.PartitionKey]; m.Seq < last {
		c.errs = append(c.errs, fmt.Sprintf("partition %s: seq %d confirmed after %d", m.PartitionKey, m.Seq, last))
	}
	c.lastSeq[m.PartitionKey] = m.Seq
	c.confirmed[m.ID]++
	return nil
}

// dropMarks is a Source whose MarkPublished is lost (the relay crashed
// between the broker's confirmation and the mark) for the marks of one relay
// with probability rate.
type dropMarks struct {
	outbox.Source
	rate    float64
	dropped atomic.Int64
}

func (d *dropMarks) MarkPublished(ctx context.Context, owner string, seqs ...int64) (int, error) {
	if rand.Float64() < d.rate {
		d.dropped.Add(int64(len(seqs)))
		return 0, errors.New("outboxtest: relay crashed before the mark")
	}
	return d.Source.MarkPublished(ctx, owner, seqs...)
}

func testConcurrent(t *testing.T, h Harness, crashes bool) {
	ctx := ctx30(t)
	src := h.New(t)
	nMsg, nRelay := h.Messages, h.Relays
	if nMsg == 0 {
		nMsg = 400
	}
	if nRelay == 0 {
		nRelay = 4
	}
	const partitions = 25
	var batch []outbox.Message
	for i := range nMsg {
		batch = append(batch, msg(fmt.Sprintf("m%05d", i), fmt.Sprintf("P%02d", i%partitions)))
		if len(batch) == 50 {
			must(t, h.Enqueue(ctx, src, batch...))
			batch = nil
		}
	}
	if len(batch) > 0 {
		must(t, h.Enqueue(ctx, src, batch...))
	}
	c := &checker{inFlight: map[string]bool{}, lastSeq: map[string]int64{}, confirmed: map[string]int{}, failRate: 0.1}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := make(chan struct{})
	var wg sync.WaitGroup
	var drops []*dropMarks
	// Without crashes the lease never lapses (so a second publication would
	// be a bug); with them it lapses soon, so the lost marks are made good.
	lease := 5 * time.Second
	if crashes {
		lease = 500 * time.Millisecond
	}
	for i := range nRelay {
		s := src
		if crashes {
			d := &dropMarks{Source: src, rate: 0.2}
			drops = append(drops, d)
			s = d
		}
		r := &outbox.Relay{Source: s, Publisher: c, Owner: fmt.Sprint("relay-", i), BatchSize: 7, PollInterval: 5 * time.Millisecond,
			MinBackoff: time.Millisecond, MaxBackoff: 20 * time.Millisecond, LeaseDuration: lease, StatsInterval: -1, Retention: -1}
		wg.Add(1)
		go func() { defer wg.Done(); <-start; _ = r.Run(rctx) }()
	}
	close(start)
	waitDrained(ctx, t, src, nMsg)
	cancel()
	wg.Wait()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range c.errs {
		t.Error(e)
	}
	if len(c.confirmed) != nMsg {
		t.Fatalf("%d distinct messages confirmed, want %d", len(c.confirmed), nMsg)
	}
	dups := 0
	for id, n := range c.confirmed {
		if n > 1 {
			dups += n - 1
			if !crashes {
				t.Errorf("message %s confirmed %d times with no crash", id, n)
			}
		}
	}
	var dropped int64
	for _, d := range drops {
		dropped += d.dropped.Load()
	}
	if crashes && (dropped == 0 || dups == 0) {
		t.Fatalf("the crash run lost no marks (%d dropped, %d republished): it proved nothing", dropped, dups)
	}
	if c.fails.Load() == 0 {
		t.Fatal("no publication failed: the retries were not exercised")
	}
	t.Logf("%d messages, %d relays: %d transient failures retried, %d marks lost, %d republished with the same ID", nMsg, nRelay, c.fails.Load(), dropped, dups)
}

// testCommitOrder: the order of a partition when its enqueuers'
// transactions overlap. Enqueue takes no lock that lasts until the commit (a
// lock per partition makes handlers' transactions that enqueue into two
// partitions in opposite orders deadlock: testOppositeOrders), so a
// transaction that enqueues into P while another that enqueued into P
// earlier is open commits without waiting, and a relay publishes its message
// first: the two overlapped, and either order is theirs. What must hold is
// that a message enqueued after another's commit is never published before
// it: "third", enqueued after "first" and "second" committed, waits for both
// to be published, and the late "first" is not passed over.
func testCommitOrder(t *testing.T, h Harness) {
	if h.Begin == nil {
		t.Skip("the harness gives no Begin")
	}
	if h.Serial {
		t.Skip("transactions on this database run one at a time: none overlaps another")
	}
	ctx := ctx30(t)
	src := h.New(t)
	enq1, commit1, err := h.Begin(ctx, src)
	must(t, err)
	committed := false
	t.Cleanup(func() {
		if !committed {
			_ = commit1() // end it, or dropping the table waits for it
		}
	})
	must(t, enq1(msg("first", "P")))
	second := make(chan error, 1)
	go func() {
		enq2, commit2, err := h.Begin(ctx, src)
		if err == nil {
			err = enq2(msg("second", "P"))
			// Ended even after a failure, or its connection is never
			// given back.
			if cerr := commit2(); err == nil {
				err = cerr
			}
		}
		second <- err
	}()
	select {
	case err := <-second:
		must(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("a transaction enqueuing into partition P waited 30 s for another open transaction that enqueued into P: a lock per partition, on which handlers' transactions that enqueue into two partitions in opposite orders deadlock")
	}
	expect := func(owner, want string) []outbox.Stored {
		t.Helper()
		got, err := src.Lease(ctx, owner, 10, time.Minute)
		must(t, err)
		if fmt.Sprint(ids(got)) != want {
			t.Fatalf("%s leases %v, want %s", owner, ids(got), want)
		}
		return got
	}
	mark := func(owner string, m outbox.Stored) {
		t.Helper()
		n, err := src.MarkPublished(ctx, owner, m.Seq)
		must(t, err)
		if n != 1 {
			t.Fatalf("%s marked %d of [%s], want 1", owner, n, m.ID)
		}
	}
	// Committed, while "first" is not: the head of P for now.
	sec := expect("r1", "[second]")
	committed = true
	must(t, commit1())
	// "first" is now the oldest unpublished message of P: its head, taken
	// although "second" is still in flight (they overlapped).
	fst := expect("r2", "[first]")
	must(t, h.Enqueue(ctx, src, msg("third", "P")))
	expect("r3", "[]")
	mark("r1", sec[0])
	expect("r3", "[]")
	mark("r2", fst[0])
	expect("r3", "[third]")
}

// testOppositeOrders: pairs of transactions, all released at once, each pair
// enqueuing into two partitions in opposite orders (X then Y, Y then X), each
// transaction waiting (briefly) for its partner's first Enqueue before its
// second. An Enqueue that locked its partition until the commit would make
// every pair a lock cycle: a deadlock (PostgreSQL 40P01, MySQL 1213) that
// fails a handler's transaction. Every transaction must commit, and every
// message must then be leased.
func testOppositeOrders(t *testing.T, h Harness) {
	if h.Begin == nil {
		t.Skip("the harness gives no Begin")
	}
	ctx := ctx30(t)
	src := h.New(t)
	pairs := h.Pairs
	if pairs == 0 {
		pairs = 12
	}
	start := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	run := func(pair int, first, second string, mine, partner chan struct{}) {
		defer wg.Done()
		<-start
		fail := func(err error) {
			mu.Lock()
			errs = append(errs, fmt.Errorf("pair %d, %s then %s: %w", pair, first, second, err))
			mu.Unlock()
		}
		enq, commit, err := h.Begin(ctx, src)
		if err != nil {
			close(mine)
			fail(err)
			return
		}
		err = enq(msg(fmt.Sprintf("%s-%s-1", first, second), first))
		close(mine)
		if err != nil {
			_ = commit()
			fail(err)
			return
		}
		// The partner's first Enqueue, if it can happen while this
		// transaction is open (not on SQLite, whose transactions take its
		// one write lock at BEGIN).
		select {
		case <-partner:
		case <-time.After(200 * time.Millisecond):
		}
		if err := enq(msg(fmt.Sprintf("%s-%s-2", first, second), second)); err != nil {
			_ = commit()
			fail(err)
			return
		}
		if err := commit(); err != nil {
			fail(err)
		}
	}
	for i := range pairs {
		x, y := fmt.Sprintf("X%02d", i), fmt.Sprintf("Y%02d", i)
		a, b := make(chan struct{}), make(chan struct{})
		wg.Add(2)
		go run(i, x, y, a, b)
		go run(i, y, x, b, a)
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		if i == 5 {
			t.Errorf("… and %d more", len(errs)-5)
			break
		}
		t.Error(err)
	}
	if len(errs) > 0 {
		t.Fatalf("%d of %d transactions that enqueued into two partitions in opposite orders failed", len(errs), 2*pairs)
	}
	st, err := src.Stats(ctx)
	must(t, err)
	if st.Pending != int64(4*pairs) {
		t.Fatalf("%d messages pending, want %d", st.Pending, 4*pairs)
	}
}

// testLiveWriters: relays run while writers commit. Each writer's
// transaction enqueues three messages into one partition, and the writers of
// a partition are serialised (each begins after the previous one committed,
// as a SELECT … FOR UPDATE on a business row would order them), so a
// partition's seq order is its commit order: every partition's messages must
// be confirmed in seq order, no two messages of one partition may be in
// flight at once, and none twice at once, while heads come and go under the
// relays' walks and publications fail and are retried.
func testLiveWriters(t *testing.T, h Harness) {
	if h.Begin == nil {
		t.Skip("the harness has no Begin")
	}
	ctx := ctx30(t)
	src := h.New(t)
	const partitions, writers, perWriter, perTx = 16, 6, 15, 3
	total := writers * perWriter * perTx
	c := &checker{inFlight: map[string]bool{}, lastSeq: map[string]int64{}, confirmed: map[string]int{}, failRate: 0.1,
		partInFlight: map[string]string{}}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := make(chan struct{})
	var relays sync.WaitGroup
	nRelay := min(max(h.Relays, 2), 3)
	if h.Serial {
		nRelay = 1
	}
	for i := range nRelay {
		r := &outbox.Relay{Source: src, Publisher: c, Owner: fmt.Sprint("live-", i), BatchSize: 5, PollInterval: 2 * time.Millisecond,
			MinBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond, LeaseDuration: 10 * time.Second, StatsInterval: -1, Retention: -1}
		relays.Add(1)
		go func() { defer relays.Done(); <-start; _ = r.Run(rctx) }()
	}
	var locks [partitions]sync.Mutex
	var wg sync.WaitGroup
	errc := make(chan error, writers)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for i := range perWriter {
				p := (w*7 + i*5) % partitions
				locks[p].Lock()
				err := func() error {
					enqueue, commit, err := h.Begin(ctx, src)
					if err != nil {
						return err
					}
					for k := range perTx {
						if err := enqueue(msg(fmt.Sprintf("w%d-%02d-%d", w, i, k), fmt.Sprintf("L%02d", p))); err != nil {
							return err
						}
					}
					return commit()
				}()
				locks[p].Unlock()
				if err != nil {
					errc <- err
					return
				}
			}
		}()
	}
	close(start)
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	waitDrained(ctx, t, src, total)
	cancel()
	relays.Wait()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range c.errs {
		t.Error(e)
	}
	if len(c.confirmed) != total {
		t.Fatalf("%d distinct messages confirmed, want %d", len(c.confirmed), total)
	}
	for id, n := range c.confirmed {
		if n > 1 {
			t.Errorf("message %s confirmed %d times with no crash", id, n)
		}
	}
	if c.fails.Load() == 0 {
		t.Fatal("no publication failed: the retries were not exercised")
	}
}

// waitDrained waits up to 45 s for src to have no unpublished message, and
// fails t if some of the total enqueued are still pending then.
func waitDrained(ctx context.Context, t *testing.T, src outbox.Source, total int) {
	t.Helper()
	deadline := time.Now().Add(45 * time.Second)
	for {
		st, err := src.Stats(ctx)
		must(t, err)
		if st.Pending == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d messages still unpublished", st.Pending, total)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
