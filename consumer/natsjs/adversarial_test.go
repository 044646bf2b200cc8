package natsjs_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/consumer/internal/prooftest"
	"github.com/idemkit/idem/consumer/natsjs"
	"github.com/idemkit/idem/memstore"
)

// deadLetterOne publishes one message with the given headers, dead-letters it
// with handler error herr and returns the copy on the dead-letter subject.
func deadLetterOne(t *testing.T, hdrOf func(b *broker) nats.Header, herr error) (*jetstream.RawStreamMsg, error) {
	t.Helper()
	ctx := context.Background()
	b := newBroker(t)
	dlStream := b.stream + "_DEAD"
	if _, err := b.js.CreateStream(ctx, jetstream.StreamConfig{Name: dlStream, Subjects: []string{b.subj + "dead"}, Storage: jetstream.MemoryStorage, AllowRollup: true}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.js.DeleteStream(context.Background(), dlStream) })
	cons := b.consumer(t, "dlh", 30*time.Second)
	s := memstore.New(nil)
	t.Cleanup(func() { s.Close() })
	p, _ := consumer.New(s, consumer.Config{Name: "dlh"})
	m := nats.NewMsg(b.subj + ".orders")
	for k, v := range hdrOf(b) {
		m.Header[k] = v
	}
	m.Data = []byte(`{"order":1}`)
	if _, err := b.js.PublishMsg(ctx, m); err != nil {
		t.Fatal(err)
	}
	cfg := &natsjs.Config{JetStream: b.js, DeadLetterSubject: b.subj + "dead", DeadLetterRetries: 1}
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var herrOut error
	for msg := range batch.Messages() {
		out, err := natsjs.Handle(ctx, p, msg, func(context.Context, *consumer.Message) ([]byte, error) {
			return nil, consumer.Permanent(herr)
		}, cfg)
		if out.Action != consumer.DeadLetter {
			t.Fatalf("Handle = %+v; want dead-letter", out)
		}
		herrOut = err
	}
	ds, _ := b.js.Stream(ctx, dlStream)
	raw, err := ds.GetLastMsgForSubject(ctx, b.subj+"dead")
	if err != nil {
		return nil, errors.Join(err, herrOut)
	}
	return raw, herrOut
}

// A message published with JetStream's own headers for its stream (an
// expected stream, an expected last sequence) is dead-lettered into the
// dead-letter stream: the copy must not carry them, or that stream refuses
// it (or, Nats-Rollup, purges what it holds).
func TestDeadLetterDropsJetStreamControlHeaders(t *testing.T) {
	raw, err := deadLetterOne(t, func(b *broker) nats.Header {
		hdr := nats.Header{}
		hdr.Set(jetstream.MsgIDHeader, "ctl-1")
		hdr.Set("Nats-Expected-Stream", b.stream)
		return hdr
	}, errors.New("bad order"))
	if err != nil {
		t.Fatalf("the dead-letter copy was refused: %v", err)
	}
	if raw.Header.Get(natsjs.HeaderDeadMsgID) != "ctl-1" || raw.Header.Get("Nats-Expected-Stream") != "" {
		t.Fatalf("copy headers %v", raw.Header)
	}
}

// A handler error of several lines (errors.Join, a database's DETAIL line)
// goes into Idem-Dead-Error without breaking the copy's headers.
func TestDeadLetterErrorOfSeveralLines(t *testing.T) {
	raw, err := deadLetterOne(t, func(*broker) nats.Header {
		hdr := nats.Header{}
		hdr.Set(jetstream.MsgIDHeader, "nl-1")
		hdr.Set("Tenant", "t1")
		return hdr
	}, errors.New("line one\r\nFake-Header: injected\nline three"))
	if err != nil {
		t.Fatalf("the dead-letter copy was refused: %v", err)
	}
	t.Logf("%q", raw.Header)
	if raw.Header.Get("Fake-Header") != "" || raw.Header.Get("Tenant") != "t1" || raw.Header.Get(natsjs.HeaderDeadMsgID) != "nl-1" {
		t.Fatalf("copy headers %q", raw.Header)
	}
}

// hangingStore never answers a claim: a store behind a network that drops
// packets, where no call fails, it just does not return.
type hangingStore struct {
	idem.Store
	gone chan struct{}
}

func (s *hangingStore) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	select {
	case <-ctx.Done():
		return nil, false, ctx.Err()
	case <-s.gone:
		return nil, false, errors.New("test over")
	}
}

// MaxWait bounds a delivery also when the store does not answer at all: the
// message is naked for redelivery (to an instance whose store answers)
// instead of being reported in progress forever, holding up every message
// behind it in the serial Consume callback.
func TestMaxWaitBoundsAStoreThatDoesNotAnswer(t *testing.T) {
	ctx := context.Background()
	b := newBroker(t)
	cons := b.consumer(t, "hang", 30*time.Second)
	s := &hangingStore{Store: memstore.New(nil), gone: make(chan struct{})}
	defer close(s.gone)
	p, _ := consumer.New(s, consumer.Config{Name: "hang"})
	b.publish(t, jetstream.MsgIDHeader, []string{"h-1"}, payload)
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	for msg := range batch.Messages() {
		done := make(chan consumer.Outcome, 1)
		go func() {
			out, _ := natsjs.Handle(ctx, p, msg, func(context.Context, *consumer.Message) ([]byte, error) { return nil, nil }, &natsjs.Config{MaxWait: 200 * time.Millisecond, AckWait: 3 * time.Second})
			done <- out
		}()
		select {
		case out := <-done:
			if out.Action != consumer.Retry || out.Reason != consumer.StoreFailed {
				t.Fatalf("Handle = %+v; want a retry after a store failure", out)
			}
		case <-time.After(15 * time.Second):
			t.Fatal("Handle still waits for a store that does not answer, 15 s past a MaxWait of 200 ms")
		}
	}
	// Naked: JetStream redelivers it.
	batch, err = cons.Fetch(1, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for msg := range batch.Messages() {
		n++
		_ = msg.Term()
	}
	if n != 1 {
		t.Fatal("the message was not redelivered after the nak")
	}
}

// failingStore refuses every claim at once and counts them.
type failingStore struct {
	idem.Store
	claims atomic.Int32
}

func (s *failingStore) Claim(context.Context, idem.ClaimRequest) (*idem.Record, bool, error) {
	s.claims.Add(1)
	return nil, false, errors.New("connection refused")
}

// A Backoff of 0 ("retry at once") does not make the in-process wait for a
// store that is down a busy loop hammering the store.
func TestOutageWaitDoesNotSpinWithZeroBackoff(t *testing.T) {
	ctx := context.Background()
	b := newBroker(t)
	cons := b.consumer(t, "spin", 30*time.Second)
	s := &failingStore{Store: memstore.New(nil)}
	p, _ := consumer.New(s, consumer.Config{Name: "spin", Backoff: func(int) time.Duration { return 0 }})
	b.publish(t, jetstream.MsgIDHeader, []string{"s-1"}, payload)
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	for msg := range batch.Messages() {
		out, _ := natsjs.Handle(ctx, p, msg, func(context.Context, *consumer.Message) ([]byte, error) { return nil, nil }, &natsjs.Config{MaxWait: 300 * time.Millisecond})
		if out.Reason != consumer.StoreFailed {
			t.Fatalf("Handle = %+v", out)
		}
	}
	// 300 ms at one claim per 10 ms at most is 31 claims.
	if n := s.claims.Load(); n > 40 {
		t.Fatalf("%d claims in a MaxWait of 300 ms: the wait spins against the store", n)
	}
}

// A nil message is reported, not a panic in the progress reporter.
func TestHandleNilMessage(t *testing.T) {
	p, _ := consumer.New(memstore.New(nil), consumer.Config{Name: "nilmsg"})
	defer func() {
		if v := recover(); v != nil {
			t.Fatalf("Handle panicked on a nil message: %v", v)
		}
	}()
	if _, err := natsjs.Handle(context.Background(), p, nil, func(context.Context, *consumer.Message) ([]byte, error) { return nil, nil }, nil); err == nil {
		t.Fatal("no error for a nil message")
	}
}

// outageStart is a store whose outage begins between a claim and the
// transaction: BeginTx fails once, and the release after it fails too, so
// the claim is left in flight.
type outageStart struct {
	idem.TxStore
	beginFails, releaseFails atomic.Int32
}

func (s *outageStart) BeginTx(ctx context.Context) (context.Context, idem.Tx, error) {
	if s.beginFails.Add(-1) >= 0 {
		return nil, nil, errors.New("connection reset by peer")
	}
	return s.TxStore.BeginTx(ctx)
}

func (s *outageStart) Release(ctx context.Context, scope, key, token string) error {
	if s.releaseFails.Add(-1) >= 0 {
		return errors.New("connection refused")
	}
	return s.TxStore.Release(ctx, scope, key, token)
}

// An outage that begins between the claim and the transaction, and leaves
// the claim in flight because its release fails too, costs the message no
// attempt: the in-process retry takes its own claim back instead of naking,
// waiting out the lease and counting the takeover as a crash. With
// MaxDeliveries 1 the message used to be dead-lettered unrun.
func TestOutageLeavingOurClaimSpendsNoAttempt(t *testing.T) {
	ctx := context.Background()
	env, err := prooftest.Open(ctx, prooftest.NewTarget(t, "sqlite"))
	if err != nil {
		t.Fatal(err)
	}
	defer env.Close(true)
	s := &outageStart{TxStore: env.Store.(idem.TxStore)}
	s.beginFails.Store(1)
	s.releaseFails.Store(1)
	p, _ := consumer.New(s, consumer.Config{Name: "ours", MaxDeliveries: 1, Lease: 300 * time.Millisecond, Backoff: func(int) time.Duration { return 10 * time.Millisecond }})
	b := newBroker(t)
	cons := b.consumer(t, "ours", 30*time.Second)
	b.publish(t, jetstream.MsgIDHeader, []string{"o-1"}, payload)
	cfg := &natsjs.Config{MaxWait: 20 * time.Second}
	var outs []consumer.Outcome
	for len(outs) < 5 {
		batch, err := cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		got := false
		for msg := range batch.Messages() {
			got = true
			out, _ := natsjs.Handle(ctx, p, msg, env.Insert, cfg)
			outs = append(outs, out)
		}
		if !got || outs[len(outs)-1].Action != consumer.Retry {
			break
		}
	}
	rows, _, _ := env.Count(ctx)
	last := outs[len(outs)-1]
	if last.Reason != consumer.Executed || rows != 1 || p.Stats().Poison != 0 {
		t.Fatalf("outcomes %+v, %d rows, stats %+v; want the message executed once, nothing dead-lettered", outs, rows, p.Stats())
	}
}

// Shutting down while a message waits in process for a store that is down:
// with Config.Context cancelled, Handler's callback returns at once and the
// message is naked for redelivery, instead of waiting out MaxWait.
func TestShutdownDuringOutageWait(t *testing.T) {
	b := newBroker(t)
	cons := b.consumer(t, "shutdown", 30*time.Second)
	s := &failingStore{Store: memstore.New(nil)}
	p, _ := consumer.New(s, consumer.Config{Name: "shutdown", Backoff: func(int) time.Duration { return 50 * time.Millisecond }})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	handler := natsjs.Handler(p, func(context.Context, *consumer.Message) ([]byte, error) { return nil, nil }, &natsjs.Config{Context: ctx, MaxWait: time.Minute})
	b.publish(t, jetstream.MsgIDHeader, []string{"w-1"}, payload)
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	for msg := range batch.Messages() {
		done := make(chan struct{})
		go func() { handler(msg); close(done) }()
		for s.claims.Load() < 2 { // waiting in process
			time.Sleep(5 * time.Millisecond)
		}
		cancel()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			t.Fatal("the callback still waits for the store 15 s after the shutdown")
		}
	}
	batch, err = cons.Fetch(1, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for msg := range batch.Messages() {
		n++
		_ = msg.Term()
	}
	if n != 1 {
		t.Fatal("the message was not naked for redelivery")
	}
}
