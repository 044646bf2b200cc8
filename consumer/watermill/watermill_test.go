package watermill_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/consumer/internal/prooftest"
	idemwm "github.com/idemkit/idem/consumer/watermill"
	"github.com/idemkit/idem/memstore"
)

// TestMiddleware: through a Watermill router, every message published twice
// (one UUID) makes one row and produces its output message twice with one UUID;
// a poison message goes to the poison topic after MaxDeliveries attempts; one
// UUID with another payload goes there unrun.
func TestMiddleware(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	env, err := prooftest.Open(ctx, prooftest.NewTarget(t, "sqlite"))
	if err != nil {
		t.Fatal(err)
	}
	defer env.Close(true)
	p, err := consumer.New(env.Store, consumer.Config{Name: "wm", MaxDeliveries: 3, Backoff: func(int) time.Duration { return 10 * time.Millisecond }})
	if err != nil {
		t.Fatal(err)
	}
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1000}, wm.NopLogger{})
	mw, err := idemwm.Middleware(p, idemwm.Config{Poison: ps, PoisonTopic: "dead"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idemwm.Middleware(p, idemwm.Config{}); err == nil {
		t.Fatal("a middleware without a poison topic was accepted")
	}
	router, err := message.NewRouter(message.RouterConfig{}, wm.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(mw)
	var poisonRuns atomic.Int32
	router.AddHandler("orders", "orders", ps, "out", ps, func(msg *message.Message) ([]*message.Message, error) {
		if string(msg.Payload) == "poison" {
			poisonRuns.Add(1)
			return nil, errors.New("cannot parse")
		}
		if _, err := env.Insert(msg.Context(), &consumer.Message{ID: msg.UUID, Payload: msg.Payload}); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(wm.NewUUID(), []byte("created "+msg.UUID))}, nil
	})
	outs, err := ps.Subscribe(ctx, "out")
	if err != nil {
		t.Fatal(err)
	}
	dead, err := ps.Subscribe(ctx, "dead")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	defer router.Close()

	const n = 50
	for round := 0; round < 2; round++ {
		for i := 0; i < n; i++ {
			if err := ps.Publish("orders", message.NewMessage(fmt.Sprintf("w-%03d", i), []byte(fmt.Sprintf(`{"i":%d}`, i)))); err != nil {
				t.Fatal(err)
			}
		}
	}

	outUUID := map[string]map[string]bool{}
	for i := 0; i < 2*n; i++ {
		select {
		case m := <-outs:
			m.Ack()
			k := string(m.Payload)
			if outUUID[k] == nil {
				outUUID[k] = map[string]bool{}
			}
			outUUID[k][m.UUID] = true
		case <-ctx.Done():
			t.Fatalf("got %d output messages of %d; stats %+v", i, 2*n, p.Stats())
		}
	}
	// Now that w-000 is processed: the same UUID with another payload, and a poison message.
	_ = ps.Publish("orders", message.NewMessage("p-1", []byte("poison")))
	_ = ps.Publish("orders", message.NewMessage("w-000", []byte("another payload")))
	reasons := map[string]string{}
	for i := 0; i < 2; i++ {
		select {
		case m := <-dead:
			m.Ack()
			reasons[m.UUID] = m.Metadata.Get(idemwm.MetaDeadReason) + "/" + m.Metadata.Get(idemwm.MetaDeadAttempts)
		case <-ctx.Done():
			t.Fatal("dead letters missing")
		}
	}
	rows, distinct, _ := env.Count(ctx)
	if rows != n || distinct != n {
		t.Fatalf("%d rows for %d IDs; want %d", rows, distinct, n)
	}
	if len(outUUID) != n {
		t.Fatalf("%d distinct outputs, want %d", len(outUUID), n)
	}
	for k, u := range outUUID {
		if len(u) != 1 {
			t.Fatalf("output %q came with %d UUIDs; a duplicate must reproduce the stored one", k, len(u))
		}
	}
	if reasons["p-1"] != "poison/3" || reasons["w-000"] != "mismatch/0" || poisonRuns.Load() != 3 {
		t.Fatalf("dead letters %v, poison ran %d times", reasons, poisonRuns.Load())
	}
	t.Logf("stats %+v", p.Stats())
}

// downStore fails its first n claims, as a store that is down for a while.
type downStore struct {
	idem.Store
	n atomic.Int32
}

func (s *downStore) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	if s.n.Add(-1) >= 0 {
		return nil, false, errors.New("connection refused")
	}
	return s.Store.Claim(ctx, req)
}

// TestStoreOutageIsNotPoison: Watermill has no delivery count, so the
// middleware counts its own attempts; a store that is down for more attempts
// than MaxDeliveries must not turn a message that never ran into a poison
// message (the table in docs/consumers.md: store down, "waits, runs again").
// The handler runs once when the store is back, and nothing is dead-lettered.
func TestStoreOutageIsNotPoison(t *testing.T) {
	st := &downStore{Store: memstore.New(nil)}
	const maxDeliveries = 3
	st.n.Store(2 * maxDeliveries)
	var delays []int
	p, err := consumer.New(st, consumer.Config{Name: "wm-outage", MaxDeliveries: maxDeliveries, Backoff: func(n int) time.Duration {
		delays = append(delays, n)
		return time.Millisecond
	}})
	if err != nil {
		t.Fatal(err)
	}
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 10}, wm.NopLogger{})
	defer ps.Close()
	dead, err := ps.Subscribe(context.Background(), "dead")
	if err != nil {
		t.Fatal(err)
	}
	mw, err := idemwm.Middleware(p, idemwm.Config{Poison: ps, PoisonTopic: "dead"})
	if err != nil {
		t.Fatal(err)
	}
	runs := 0
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		runs++
		return nil, nil
	})
	if _, err := h(message.NewMessage("o-1", []byte("order"))); err != nil {
		t.Fatal(err)
	}
	if s := p.Stats(); s.Poison != 0 || s.Executed != 1 || runs != 1 {
		m := <-dead
		t.Fatalf("stats %+v, handler runs %d: dead-lettered (%s: %s) after a store outage, though it never ran", s, runs, m.Metadata.Get(idemwm.MetaDeadReason), m.Metadata.Get(idemwm.MetaDeadError))
	}
	if runs != 1 {
		t.Fatalf("the handler ran %d times, want 1 (stats %+v)", runs, p.Stats())
	}
	// The outage's retries still back off: Backoff sees the attempts grow.
	if slices.Max(delays) != 2*maxDeliveries {
		t.Fatalf("Backoff called with %v for %d store failures; want the attempt numbers to grow to %[2]d", delays, 2*maxDeliveries)
	}
}
