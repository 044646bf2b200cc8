package natsjs_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/consumer/internal/prooftest"
	"github.com/idemkit/idem/consumer/natsjs"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/memstore"
)

// Item 1: message IDs that are not HTTP header tokens — padded base64, the
// AMQP/e-mail <id@host> form, order=42, {…}, (…) — are processed, not
// dead-lettered as invalid_id.
func TestMessageIDsOverJetStream(t *testing.T) {
	ctx := context.Background()
	env, err := prooftest.Open(ctx, prooftest.NewTarget(t, "sqlite"))
	if err != nil {
		t.Fatal(err)
	}
	defer env.Close(true)
	b := newBroker(t)
	cons := b.consumer(t, "ids", 5*time.Second)
	p, _ := consumer.New(env.Store, consumer.Config{Name: "ids"})
	all := []string{"q83vEjRWeJA=", "<id@host>", "order=42", "{order:42}", "(42)", `"q"`}
	var settled atomic.Int32
	stopc, err := consumeG(cons, func(msg jetstream.Msg) {
		_, _ = natsjs.Handle(ctx, p, msg, env.Insert, nil)
		settled.Add(1)
	})
	if err != nil {
		t.Fatal(err)
	}
	b.publish(t, jetstream.MsgIDHeader, all, payload)
	drained(t, cons, 20*time.Second, func() bool { return settled.Load() == int32(len(all)) })
	stopc()
	rows, distinct, _ := env.Count(ctx)
	if st := p.Stats(); rows != len(all) || distinct != len(all) || st.InvalidID != 0 {
		t.Fatalf("%d rows, %d distinct, stats %+v; want %d executed and no invalid_id", rows, distinct, st, len(all))
	}
}

// Item 4: a store outage several AckWaits long spends no JetStream delivery:
// the message is kept in progress and retried in process, and no message is
// dead-lettered unrun. The store is real PostgreSQL behind a proxy that cuts
// and refuses every connection while it is down.
func TestStoreOutageSpendsNoDelivery(t *testing.T) {
	// MaxWait past the outage: kept in progress in process. MaxWait -1: naked at
	// once on every store failure, which JetStream counts in NumDelivered and
	// the Processor does not.
	for _, maxWait := range []time.Duration{time.Minute, -1} {
		t.Run(fmt.Sprint("MaxWait=", maxWait), func(t *testing.T) { storeOutage(t, maxWait) })
	}
}

func storeOutage(t *testing.T, maxWait time.Duration) {
	ctx := context.Background()
	tg := prooftest.NewTarget(t, "postgres")
	direct, err := prooftest.Open(ctx, tg)
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close(true)
	out := prooftest.NewOutage(t, prooftest.HostPort(t, tg.URL))
	ptg := tg
	ptg.URL = out.URL(t, tg.URL)
	env, err := prooftest.Open(ctx, ptg)
	if err != nil {
		t.Fatal(err)
	}
	defer env.Close(false)
	b := newBroker(t)
	const ackWait = time.Second
	cons := b.consumer(t, "outage", ackWait)
	p, _ := consumer.New(env.Store, consumer.Config{Name: "outage", MaxDeliveries: 2, Lease: 3 * time.Second, CleanupTimeout: time.Second,
		Backoff: func(int) time.Duration { return 200 * time.Millisecond }})
	const n = 20
	var mu sync.Mutex
	acked, maxDelivered := map[string]bool{}, 0
	var dead atomic.Int32
	cfg := &natsjs.Config{AckWait: ackWait, MaxWait: maxWait}
	out.SetDown(true)
	stopc, err := consumeG(cons, func(msg jetstream.Msg) {
		o, _ := natsjs.Handle(ctx, p, msg, env.Insert, cfg)
		md, _ := msg.Metadata()
		mu.Lock()
		defer mu.Unlock()
		maxDelivered = max(maxDelivered, int(md.NumDelivered))
		switch o.Action {
		case consumer.Ack:
			acked[natsjs.Message(msg, "").ID] = true
		case consumer.DeadLetter:
			dead.Add(1)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	b.publish(t, jetstream.MsgIDHeader, ids(n, "o"), payload)
	time.Sleep(4 * ackWait) // down for four AckWaits, twenty backoffs
	out.SetDown(false)
	drained(t, cons, 60*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return len(acked) == n })
	stopc()
	rows, distinct, _ := direct.Count(ctx)
	st := p.Stats()
	t.Logf("stats %+v; most deliveries of a message %d", st, maxDelivered)
	if dead.Load() != 0 || st.Poison != 0 || rows != n || distinct != n {
		t.Fatalf("%d dead-lettered, %d rows (%d distinct); want 0 dead-lettered and %d rows", dead.Load(), rows, distinct, n)
	}
	if st.Failed != 0 || st.Executed != n {
		t.Fatalf("stats %+v: the outage counted as failed deliveries, or a message ran twice", st)
	}
}

// Items 9 and 10: a dead-letter stream whose max_msg_size is smaller than the
// message still gets a copy (without the payload, saying so) instead of the
// message being naked forever; the copy keeps the message ID, and republished
// as it is, it is processed normally.
func TestDeadLetterKeepsTheIDAndFits(t *testing.T) {
	ctx := context.Background()
	b := newBroker(t)
	dlStream := b.stream + "_DEAD"
	if _, err := b.js.CreateStream(ctx, jetstream.StreamConfig{Name: dlStream, Subjects: []string{b.subj + "dead"}, Storage: jetstream.MemoryStorage, MaxMsgSize: 2048}); err != nil {
		t.Fatal(err)
	}
	defer b.js.DeleteStream(context.Background(), dlStream)
	cons := b.consumer(t, "dl", 30*time.Second)
	s := memstore.New(nil)
	defer s.Close()
	p, _ := consumer.New(s, consumer.Config{Name: "dl"})
	var runs atomic.Int32
	var fail atomic.Bool
	fail.Store(true)
	h := func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		runs.Add(1)
		if fail.Load() {
			return nil, consumer.Permanent(errors.New("cannot parse the order"))
		}
		return nil, nil
	}
	m := nats.NewMsg(b.subj + ".orders")
	m.Header.Set(jetstream.MsgIDHeader, "<big-1@host>")
	m.Data = bytes.Repeat([]byte("x"), 4096)
	if _, err := b.js.PublishMsg(ctx, m); err != nil {
		t.Fatal(err)
	}
	cfg := &natsjs.Config{JetStream: b.js, DeadLetterSubject: b.subj + "dead"}
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	for msg := range batch.Messages() {
		out, err := natsjs.Handle(ctx, p, msg, h, cfg)
		if err != nil || out.Action != consumer.DeadLetter {
			t.Fatalf("Handle = %+v, %v; want the message dead-lettered (its copy without the payload)", out, err)
		}
	}
	ds, _ := b.js.Stream(ctx, dlStream)
	raw, err := ds.GetLastMsgForSubject(ctx, b.subj+"dead")
	if err != nil {
		t.Fatalf("nothing on the dead-letter subject: %v", err)
	}
	if raw.Header.Get(natsjs.HeaderDeadTruncated) == "" || raw.Header.Get(natsjs.HeaderDeadMsgID) != "<big-1@host>" {
		t.Fatalf("dead-letter copy headers %v; want it truncated, with the message ID", raw.Header)
	}
	drained(t, cons, 10*time.Second, nil)

	// Republished as it is (an operator's replay, once the handler is fixed).
	fail.Store(false)
	re := nats.NewMsg(b.subj + ".orders")
	re.Header, re.Data = raw.Header, raw.Data
	if _, err := b.js.PublishMsg(ctx, re); err != nil {
		t.Fatal(err)
	}
	batch, err = cons.Fetch(1, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	for msg := range batch.Messages() {
		if out, err := natsjs.Handle(ctx, p, msg, h, cfg); err != nil || out.Reason != consumer.Executed {
			t.Fatalf("the republished copy: %+v, %v; want it executed", out, err)
		}
	}
	if runs.Load() != 2 {
		t.Fatalf("handler ran %d times; want 2 (the first delivery and the replay)", runs.Load())
	}
}

var _ = testenv.NATSURL

// Item 10: a message whose dead-letter copy is refused every time (no stream
// captures the subject) is not redelivered forever, and its handler does not
// run again on each redelivery: after MaxDeliveries + DeadLetterRetries
// deliveries it is terminated, and OnError says where it stays.
func TestDeadLetteringFailsBounded(t *testing.T) {
	ctx := context.Background()
	b := newBroker(t)
	cons := b.consumer(t, "dlfail", 30*time.Second)
	s := memstore.New(nil)
	defer s.Close()
	p, _ := consumer.New(s, consumer.Config{Name: "dlfail", MaxDeliveries: 2, Backoff: func(int) time.Duration { return 10 * time.Millisecond }})
	var runs, handled atomic.Int32
	var lastErr atomic.Value
	cfg := &natsjs.Config{JetStream: b.js, DeadLetterSubject: "nobody.listens." + prooftest.Rand(), DeadLetterRetries: 2}
	stopc, err := consumeG(cons, func(msg jetstream.Msg) {
		_, err := natsjs.Handle(ctx, p, msg, func(context.Context, *consumer.Message) ([]byte, error) {
			runs.Add(1)
			return nil, consumer.Permanent(errors.New("bad order"))
		}, cfg)
		if err != nil {
			lastErr.Store(err.Error())
		}
		handled.Add(1)
	})
	if err != nil {
		t.Fatal(err)
	}
	b.publish(t, jetstream.MsgIDHeader, []string{"dl-1"}, payload)
	drained(t, cons, 30*time.Second, func() bool { return handled.Load() >= 4 })
	time.Sleep(200 * time.Millisecond) // no further delivery comes
	stopc()
	e, _ := lastErr.Load().(string)
	if handled.Load() != 4 || runs.Load() != 1 || !strings.Contains(e, "sequence") {
		t.Fatalf("handled %d deliveries, ran the handler %d times, last error %q; want 4 (MaxDeliveries + DeadLetterRetries), 1 run, and where the message stays", handled.Load(), runs.Load(), e)
	}
}

// Item 5: a COMMIT the database always refuses (a deferred constraint) is a
// failed attempt on JetStream too: the message is dead-lettered after
// MaxDeliveries runs, not naked forever.
func TestRefusedCommitIsPoison(t *testing.T) {
	for _, kind := range prooftest.Kinds {
		t.Run(kind, func(t *testing.T) {
			ctx := context.Background()
			env, err := prooftest.Open(ctx, prooftest.NewTarget(t, kind))
			if err != nil {
				t.Fatal(err)
			}
			defer env.Close(true)
			if err := env.CreateRefusedAtCommit(ctx); err != nil {
				t.Fatal(err)
			}
			b := newBroker(t)
			cons := b.consumer(t, "refused", 5*time.Second)
			p, _ := consumer.New(env.Store, consumer.Config{Name: "refused", MaxDeliveries: 3, Backoff: func(int) time.Duration { return 10 * time.Millisecond }})
			var runs, dead atomic.Int32
			stopc, err := consumeG(cons, func(msg jetstream.Msg) {
				out, _ := natsjs.Handle(ctx, p, msg, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
					runs.Add(1)
					return env.InsertRefusedAtCommit(ctx, m)
				}, nil)
				if out.Action == consumer.DeadLetter {
					dead.Add(1)
				}
			})
			if err != nil {
				t.Fatal(err)
			}
			b.publish(t, jetstream.MsgIDHeader, []string{"refused-1"}, payload)
			drained(t, cons, 30*time.Second, func() bool { return dead.Load() == 1 })
			stopc()
			if runs.Load() != 3 {
				t.Fatalf("the handler ran %d times; want MaxDeliveries (3)", runs.Load())
			}
		})
	}
}
