// Package natsjs runs NATS JetStream messages through a consumer.Processor:
// each message is processed once per message ID however often JetStream
// delivers it, and acknowledged only after its outcome is committed.
//
//	cons, _ := js.CreateOrUpdateConsumer(ctx, "ORDERS", jetstream.ConsumerConfig{
//		Durable: "orders-worker", AckPolicy: jetstream.AckExplicitPolicy,
//		AckWait: 30 * time.Second, MaxDeliver: -1, // the Processor dead-letters
//	})
//	cc, _ := cons.Consume(natsjs.Handler(proc, handle, &natsjs.Config{JetStream: js, DeadLetterSubject: "orders.dead", AckWait: 30 * time.Second}))
//	defer cc.Stop()
//
// The key is the Nats-Msg-Id header (Config.KeyHeader names another; a
// republished dead-letter copy's Idem-Dead-Msg-Id counts too), the delivery
// number 1 on a first delivery and the store's count on a redelivery (see
// Message). Outcomes map to JetStream as follows: Ack →
// Ack; Retry → NakWithDelay(Outcome.Delay); DeadLetter → the message is
// published to Config.DeadLetterSubject (when set) with the reason in
// headers, then Term. While a message is handled, and while it waits in
// process for the store to come back or for another instance's lease
// (Config.MaxWait), Handle tells JetStream it is in progress every AckWait/3,
// so that neither a long handler nor a store outage is redelivered and spends
// a delivery. Leave the consumer's MaxDeliver unlimited (-1) or above the
// Processor's MaxDeliveries, so that JetStream never drops a message the
// Processor has not dead-lettered, and give Config.AckWait the consumer's.
package natsjs

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
)

// Headers set on a dead-lettered copy.
const (
	// HeaderDeadReason holds the Reason ("poison", "mismatch", "invalid_id").
	HeaderDeadReason = "Idem-Dead-Reason"
	// HeaderDeadError holds the error text.
	HeaderDeadError = "Idem-Dead-Error"
	// HeaderDeadSubject holds the subject the message came on.
	HeaderDeadSubject = "Idem-Dead-Subject"
	// HeaderDeadDeliveries holds how many times it was delivered.
	HeaderDeadDeliveries = "Idem-Dead-Deliveries"
	// HeaderDeadTruncated is set on a copy that leaves the payload out because
	// the payload and the Idem-Dead-* headers together exceed the server's
	// max_payload. It says how many bytes were left out and where the original
	// is: "N bytes; stream S sequence Q".
	HeaderDeadTruncated = "Idem-Dead-Truncated"
	// HeaderDeadMsgID holds the message ID (the copy leaves Nats-Msg-Id out, so
	// that the dead-letter stream's duplicate window keeps every copy). A copy
	// republished as it is is processed under this ID.
	HeaderDeadMsgID = "Idem-Dead-Msg-Id"
)

// Config configures Handler. A nil *Config means all defaults.
type Config struct {
	// KeyHeader is the header that carries the message ID. Default "Nats-Msg-Id"
	// (which JetStream also uses for its own duplicate window).
	KeyHeader string
	// DeadLetterSubject, when set, receives a copy of every dead-lettered message
	// (payload and headers, plus the Idem-Dead-* headers) before it is
	// terminated; when the payload leaves no room for those headers under the
	// server's max_payload, the copy leaves the payload out and says so in
	// Idem-Dead-Truncated. Make a stream capture it. Requires JetStream.
	DeadLetterSubject string
	// JetStream publishes the dead-lettered copies.
	JetStream jetstream.JetStream
	// OnError, when set, is called when acknowledging or dead-lettering fails
	// (the message is then redelivered after AckWait).
	OnError func(msg jetstream.Msg, out consumer.Outcome, err error)
	// AckWait is the JetStream consumer's AckWait: Handle reports the message
	// in progress every AckWait/3. Default 30 s (JetStream's default).
	AckWait time.Duration
	// MaxWait bounds how long one delivery waits in process, reporting
	// progress, for the store to answer again (StoreFailed) before it is naked
	// for redelivery. Neither spends one of MaxDeliveries: the Processor counts
	// attempts in the store, not JetStream's NumDelivered. Default 2 min (a
	// database failover takes ~30 s); a negative value naks at once.
	MaxWait time.Duration
	// DeadLetterRetries bounds the redeliveries of a message whose dead-letter
	// copy JetStream keeps refusing: past MaxDeliveries + DeadLetterRetries
	// deliveries it is terminated anyway, and OnError is told where it stays
	// (its stream and sequence). Default 10.
	DeadLetterRetries int
}

// Handler returns a jetstream.MessageHandler that processes every message
// through p and h, for Consumer.Consume.
func Handler(p *consumer.Processor, h consumer.Handler, cfg *Config) jetstream.MessageHandler {
	var c Config
	if cfg != nil {
		c = *cfg
	}
	return func(msg jetstream.Msg) {
		out, err := Handle(context.Background(), p, msg, h, &c)
		if err != nil && c.OnError != nil {
			c.OnError(msg, out, err)
		}
	}
}

// Message converts a JetStream message into a consumer.Message, reading the ID
// from keyHeader ("" means Nats-Msg-Id).
func Message(msg jetstream.Msg, keyHeader string) *consumer.Message {
	if keyHeader == "" {
		keyHeader = jetstream.MsgIDHeader
	}
	m := &consumer.Message{Payload: msg.Data(), Header: msg.Headers()}
	if hd := msg.Headers(); hd != nil {
		m.ID = hd.Get(keyHeader)
		if m.ID == "" && keyHeader == jetstream.MsgIDHeader {
			m.ID = hd.Get(HeaderDeadMsgID) // a dead-letter copy, republished
		}
	}
	if md, err := msg.Metadata(); err == nil && md.NumDelivered > 1 {
		// A redelivery: JetStream's count also counts naks that were no failed
		// attempt (a store outage, a message in flight elsewhere) and
		// redeliveries of messages that waited in the client's buffer, so the
		// Processor counts the attempts itself, in the store (0).
		m.Delivery = 0
	} else {
		m.Delivery = 1
	}
	return m
}

func numDelivered(msg jetstream.Msg) int {
	if md, err := msg.Metadata(); err == nil {
		return int(md.NumDelivered)
	}
	return 0
}

// Handle processes one message and settles it with JetStream; it returns the
// Processor's outcome and the error of acknowledging, naking or terminating.
func Handle(ctx context.Context, p *consumer.Processor, msg jetstream.Msg, h consumer.Handler, cfg *Config) (consumer.Outcome, error) {
	if p == nil {
		return consumer.Outcome{}, errors.New("natsjs: the Processor is nil; make one with consumer.New (the message is left unacknowledged)")
	}
	if cfg == nil {
		cfg = &Config{}
	}
	ackWait := cfg.AckWait
	if ackWait <= 0 {
		ackWait = 30 * time.Second
	}
	maxWait := cfg.MaxWait
	if maxWait == 0 {
		maxWait = 2 * time.Minute
	}
	stop := heartbeat(msg, ackWait/3)
	defer stop()
	m := Message(msg, cfg.KeyHeader)
	out := p.Process(ctx, m, h)
	deadline := time.Now().Add(maxWait)
	for out.Action == consumer.Retry && out.Reason == consumer.StoreFailed {
		// Not a failed delivery: wait in process, reporting progress, rather
		// than nak and come back through JetStream's redelivery. (A message in
		// flight elsewhere is naked at once: waiting for it here would hold up
		// every message behind it.)
		wait := min(out.Delay, 5*time.Second)
		if time.Now().Add(wait).After(deadline) {
			break
		}
		select {
		case <-ctx.Done():
			return out, msg.NakWithDelay(out.Delay)
		case <-time.After(wait):
		}
		out = p.Process(ctx, m, h)
	}
	stop() // no progress report after the settlement below
	switch out.Action {
	case consumer.Ack:
		return out, msg.Ack()
	case consumer.Retry:
		return out, msg.NakWithDelay(out.Delay)
	default:
		if cfg.DeadLetterSubject != "" {
			if err := deadLetter(ctx, cfg, msg, m, out); err != nil {
				retries := cfg.DeadLetterRetries
				if retries <= 0 {
					retries = 10
				}
				if nd := numDelivered(msg); nd < p.MaxDeliveries()+retries {
					// Not terminated: better redelivered than lost, but not forever.
					return out, errors.Join(err, msg.NakWithDelay(p.Backoff(nd)))
				}
				where := "its stream"
				if md, merr := msg.Metadata(); merr == nil {
					where = fmt.Sprintf("stream %s sequence %d", md.Stream, md.Sequence.Stream)
				}
				err = fmt.Errorf("natsjs: gave up dead-lettering message %q after %d deliveries and terminated it; with limits retention it stays in %s: %w", m.ID, numDelivered(msg), where, err)
				return out, errors.Join(err, msg.Term())
			}
		}
		if err := msg.Term(); err != nil {
			return out, err
		}
		return out, p.DeadLettered(ctx, m, out)
	}
}

// heartbeat reports msg in progress every interval until stop is called.
func heartbeat(msg jetstream.Msg, interval time.Duration) (stop func()) {
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(max(interval, time.Millisecond))
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				_ = msg.InProgress()
			}
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(done); <-finished }) }
}

func deadLetter(ctx context.Context, cfg *Config, msg jetstream.Msg, m *consumer.Message, out consumer.Outcome) error {
	if cfg.JetStream == nil {
		return errors.New("natsjs: Config.DeadLetterSubject is set but Config.JetStream is nil; set it to publish dead-lettered messages")
	}
	dl := nats.NewMsg(cfg.DeadLetterSubject)
	dl.Data = msg.Data()
	for k, v := range msg.Headers() {
		if k == jetstream.MsgIDHeader {
			continue // not deduplicated away by the dead-letter stream's window
		}
		dl.Header[k] = v
	}
	dl.Header.Set(HeaderDeadReason, out.Reason.String())
	if out.Err != nil {
		dl.Header.Set(HeaderDeadError, out.Err.Error())
	}
	dl.Header.Set(HeaderDeadSubject, msg.Subject())
	dl.Header.Set(HeaderDeadDeliveries, strconv.Itoa(numDelivered(msg)))
	if m.ID != "" {
		dl.Header.Set(HeaderDeadMsgID, m.ID)
	}
	_, err := cfg.JetStream.PublishMsg(ctx, dl)
	if tooLarge(err) {
		// A payload near max_payload has no room for the Idem-Dead-* headers, or
		// the dead-letter stream's max_msg_size is smaller than the message.
		// Failing here would nak the message and dead-letter it again on every
		// redelivery: send the copy without its payload (and with a shortened
		// error), saying where the original is.
		where := "the stream it came from"
		if md, merr := msg.Metadata(); merr == nil {
			where = fmt.Sprintf("stream %s sequence %d", md.Stream, md.Sequence.Stream)
		}
		dl.Header.Set(HeaderDeadTruncated, fmt.Sprintf("%d bytes; %s", len(dl.Data), where))
		if e := dl.Header.Get(HeaderDeadError); len(e) > 1024 {
			dl.Header.Set(HeaderDeadError, e[:1024]+"…")
		}
		dl.Data = nil
		_, err = cfg.JetStream.PublishMsg(ctx, dl)
	}
	if err != nil {
		return fmt.Errorf("natsjs: publish to dead-letter subject %s: %w", cfg.DeadLetterSubject, err)
	}
	return nil
}

// tooLarge reports whether err refuses a message for its size: the server's
// max_payload, or a stream's max_msg_size (JetStream API error 10054).
func tooLarge(err error) bool {
	var apiErr *jetstream.APIError
	return errors.Is(err, nats.ErrMaxPayload) || (errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum)
}
