package amqp_test

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
	outboxamqp "github.com/idemkit/idem/outbox/amqp"
)

// TestTimedOutReturnNotKept: publications of unroutable messages whose
// confirmation times out (the broker connection black-holed until after the
// deadline, then released: the broker's return and ack arrive late) must
// leave nothing behind. Before, each late return stayed in the Publisher's
// map of returns for ever (one entry per timed-out publication), and a
// later publication of the same ID, now routable (its queue declared, as an
// operator would), collected the stale return and was dead-lettered as
// unroutable although the broker had routed it.
func TestTimedOutReturnNotKept(t *testing.T) {
	ch, q := queue(t)
	u, _ := url.Parse(testenv.AMQPURL(t))
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "5672")
	}
	proxy, err := faults.Listen(host)
	if err != nil {
		t.Fatal(err)
	}
	defer proxy.Close()
	u.Host = proxy.Addr()
	p, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: u.String()})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	publish := func(m *outbox.Stored, timeout time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		return p.Publish(ctx, m)
	}
	// The channel, opened before the black hole.
	if err := publish(&outbox.Stored{Message: outbox.Message{ID: "warm", Subject: q, Payload: []byte("x")}}, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	missing := "idem-outbox-later-" + randHex(5)
	const n = 20
	for i := range n {
		m := &outbox.Stored{Message: outbox.Message{ID: fmt.Sprint("late-", i), Subject: missing, Payload: []byte("x")}}
		proxy.Hold()
		err := publish(m, 200*time.Millisecond)
		proxy.Release()
		if err == nil {
			t.Fatalf("publication %d confirmed through a black hole", i)
		}
		// Let the late return and ack arrive.
		time.Sleep(100 * time.Millisecond)
	}
	if k := outboxamqp.PendingReturns(p); k != 0 {
		t.Errorf("after %d timed-out publications of unroutable messages, the Publisher keeps %d returns nobody will collect", n, k)
	}
	// The queue the messages were meant for now exists: a republication of
	// one of them is routed, and must be confirmed.
	if _, err := ch.QueueDeclare(missing, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = ch.QueueDelete(missing, false, false, false) })
	m := &outbox.Stored{Message: outbox.Message{ID: "late-3", Subject: missing, Payload: []byte("x")}}
	var perr error
	for range 50 { // the first attempts may meet a channel being redialled
		if perr = publish(m, 10*time.Second); perr == nil || outbox.IsPermanent(perr) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if perr != nil {
		t.Fatalf("republication of late-3, now routable: %v (permanent: %v)", perr, outbox.IsPermanent(perr))
	}
	d, ok, err := ch.Get(missing, true)
	if err != nil || !ok || d.MessageId != "late-3" {
		t.Fatalf("queue %s: %v %v %q", missing, err, ok, d.MessageId)
	}
}
