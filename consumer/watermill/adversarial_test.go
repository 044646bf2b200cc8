package watermill_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	idemwm "github.com/idemkit/idem/consumer/watermill"
	"github.com/idemkit/idem/memstore"
)

// refusingStore refuses every claim at once and counts them.
type refusingStore struct {
	idem.Store
	claims atomic.Int32
}

func (s *refusingStore) Claim(context.Context, idem.ClaimRequest) (*idem.Record, bool, error) {
	s.claims.Add(1)
	return nil, false, errors.New("connection refused")
}

// A Backoff of 0 does not turn the wait for a store that is down into a busy
// loop hammering the store.
func TestOutageWaitDoesNotSpinWithZeroBackoff(t *testing.T) {
	s := &refusingStore{Store: memstore.New(nil)}
	p, _ := consumer.New(s, consumer.Config{Name: "spin", Backoff: func(int) time.Duration { return 0 }})
	ps := gochannel.NewGoChannel(gochannel.Config{}, wm.NopLogger{})
	defer ps.Close()
	h, err := idemwm.Handler(p, idemwm.Config{Poison: ps, PoisonTopic: "dead"}, func(*message.Message) ([]*message.Message, error) { return nil, nil })
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage("o-1", []byte("x"))
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	msg.SetContext(ctx)
	if _, err := h(msg); err == nil {
		t.Fatal("no error once the message's context ended")
	}
	if n := s.claims.Load(); n > 40 {
		t.Fatalf("%d claims in 300 ms: the wait spins against the store", n)
	}
}

// A nil handler given to the middleware is reported on every message, not
// run (a nil call panics, which the Processor counts as failed attempts and
// dead-letters valid messages after MaxDeliveries).
func TestMiddlewareNilHandler(t *testing.T) {
	s := memstore.New(nil)
	defer s.Close()
	p, _ := consumer.New(s, consumer.Config{Name: "nilh", MaxDeliveries: 2, Backoff: func(int) time.Duration { return time.Millisecond }})
	ps := gochannel.NewGoChannel(gochannel.Config{}, wm.NopLogger{})
	defer ps.Close()
	mw, err := idemwm.Middleware(p, idemwm.Config{Poison: ps, PoisonTopic: "dead"})
	if err != nil {
		t.Fatal(err)
	}
	h := mw(nil)
	for i := 0; i < 3; i++ {
		if _, err := h(message.NewMessage("o-1", []byte("x"))); err == nil {
			t.Fatal("a nil handler's message was acknowledged")
		}
	}
	if st := p.Stats(); st.Poison != 0 || st.Failed != 0 {
		t.Fatalf("stats %+v: the message was counted as failing, or dead-lettered, for a nil handler", st)
	}
}

// releaseFails fails every Release: the store goes down right after the
// message was dead-lettered.
type releaseFails struct{ idem.Store }

func (releaseFails) Release(context.Context, string, string, string) error {
	return errors.New("connection refused")
}

// A message in the poison topic is acknowledged even when deleting its
// attempt markers fails: a nack would bring it back and put a second copy in
// the poison topic.
func TestPoisonAckedWhenMarkersStay(t *testing.T) {
	s := memstore.New(nil)
	defer s.Close()
	p, _ := consumer.New(releaseFails{s}, consumer.Config{Name: "pm"})
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 10}, wm.NopLogger{})
	defer ps.Close()
	dead, err := ps.Subscribe(context.Background(), "dead")
	if err != nil {
		t.Fatal(err)
	}
	h, err := idemwm.Handler(p, idemwm.Config{Poison: ps, PoisonTopic: "dead"}, func(*message.Message) ([]*message.Message, error) {
		return nil, consumer.Permanent(errors.New("bad order"))
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h(message.NewMessage("o-1", []byte("x"))); err != nil {
		t.Fatalf("the dead-lettered message is nacked: %v", err)
	}
	select {
	case m := <-dead:
		m.Ack()
	case <-time.After(5 * time.Second):
		t.Fatal("nothing in the poison topic")
	}
}
