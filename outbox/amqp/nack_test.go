package amqp_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
	outboxamqp "github.com/idemkit/idem/outbox/amqp"
)

type countFailed struct {
	outbox.NopObserver
	failed, dead atomic.Int64
}

func (c *countFailed) Failed(*outbox.Stored, error, time.Duration) { c.failed.Add(1) }
func (c *countFailed) DeadLettered(*outbox.Stored, string)         { c.dead.Add(1) }

// TestNackedByFullQueue: a queue that refuses publications when full
// (x-overflow reject-publish) makes RabbitMQ nack them: a nacked message is
// neither marked published (lost) nor dead-lettered; it is retried, and
// arrives once the consumer made room, with no operator.
func TestNackedByFullQueue(t *testing.T) {
	o, pool := newOutbox(t)
	conn, err := amqp091.Dial(testenv.AMQPURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	q, err := ch.QueueDeclare("idem-outbox-full-"+randHex(5), false, false, false, false,
		amqp091.Table{"x-max-length": int32(2), "x-overflow": "reject-publish"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _, _ = ch.QueueDelete(q.Name, false, false, false) }()
	const n = 6
	var msgs []outbox.Message
	for i := range n {
		msgs = append(msgs, outbox.Message{ID: fmt.Sprint("n", i), Subject: q.Name, Payload: []byte(fmt.Sprint(i))})
	}
	enqueue(t, o, pool, msgs...)
	p, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: testenv.AMQPURL(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	obs := &countFailed{}
	r := &outbox.Relay{Source: o, Publisher: p, Observer: obs, PollInterval: 10 * time.Millisecond,
		MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, StatsInterval: -1}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(20 * time.Second)
	for obs.failed.Load() < 4 {
		if time.Now().After(deadline) {
			t.Fatalf("only %d nacked publications after 20 s", obs.failed.Load())
		}
		time.Sleep(20 * time.Millisecond)
	}
	st, err := o.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.Pending < n-2 || st.DeadLetters != 0 {
		t.Fatalf("with the queue full: %+v; want at least %d pending (the nacked ones), no dead letter", st, n-2)
	}
	got := map[string]int{}
	for {
		d, ok, err := ch.Get(q.Name, true)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			got[d.MessageId]++
		} else {
			st, err := o.Stats(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if st.Pending == 0 && len(got) == n {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("got %v; %+v", got, st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if obs.dead.Load() != 0 {
		t.Fatalf("%d dead-lettered", obs.dead.Load())
	}
	t.Logf("%d nacked publications retried; delivered %v", obs.failed.Load(), got)
}
