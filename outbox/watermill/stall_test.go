package watermill_test

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/idemkit/idem/outbox"
	outboxwm "github.com/idemkit/idem/outbox/watermill"
)

// TestStalledBrokerBoundsGoroutines: a Watermill publisher that never
// returns (Go channel pub/sub waiting for the ack of a subscriber that never
// acks: a stalled broker) and 300 publications, each given up after 20 ms.
// Watermill's Publish takes no context, so each given-up call goes on in a
// goroutine; before, each publication left one more (300 goroutines for as
// long as the broker stalls). Their number must stay bounded.
func TestStalledBrokerBoundsGoroutines(t *testing.T) {
	ps := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer func() { _ = ps.Close() }()
	sub, err := ps.Subscribe(context.Background(), "stalled")
	if err != nil {
		t.Fatal(err)
	}
	_ = sub // delivered to, never acked
	p := outboxwm.NewPublisher(ps, nil)
	before := runtime.NumGoroutine()
	const n = 300
	failed := 0
	for i := range n {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		err := p.Publish(ctx, &outbox.Stored{Message: outbox.Message{ID: fmt.Sprint("s", i), Subject: "stalled", Payload: []byte("x")}})
		cancel()
		if err != nil {
			failed++
		}
	}
	if failed != n {
		t.Fatalf("%d of %d publications to a stalled broker failed, want all", failed, n)
	}
	grown := runtime.NumGoroutine() - before
	if grown > outboxwm.DefaultMaxPending+20 {
		t.Fatalf("%d publications given up on a stalled broker left %d more goroutines, want at most about %d ", n, grown, 64)
	}
	t.Logf("%d given-up publications: %d more goroutines", n, grown)
}
