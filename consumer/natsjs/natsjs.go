// Package natsjs runs NATS JetStream messages through a consumer.Processor:
// each message is processed once per message ID however often JetStream
// delivers it, and acknowledged only after its outcome is committed.
//
//	cons, _ := js.CreateOrUpdateConsumer(ctx, "ORDERS", jetstream.ConsumerConfig{
//		Durable: "orders-worker", AckPolicy: jetstream.AckExplicitPolicy,
//		AckWait: 30 * time.Second, MaxDeliver: -1, // the Processor dead-letters
//	})
//	cc, _ := cons.Consume(natsjs.Handler(proc, handle, &natsjs.Config{JetStream: js, DeadLetterSubject: "orders.dead"}))
//	defer cc.Stop()
//
// The key is the Nats-Msg-Id header (Config.KeyHeader names another), the
// delivery number JetStream's NumDelivered. Outcomes map to JetStream as
// follows: Ack → Ack; Retry → NakWithDelay(Outcome.Delay); DeadLetter → the
// message is published to Config.DeadLetterSubject (when set) with the reason
// in headers, then Term. Leave the consumer's MaxDeliver unlimited (-1) or
// above the Processor's MaxDeliveries, so that JetStream never drops a message
// the Processor has not dead-lettered; keep AckWait above the longest handler
// run, or JetStream redelivers while it runs (the redelivery is then told to
// wait, not run twice).
package natsjs

import (
	"context"
	"errors"
	"fmt"
	"strconv"
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
	}
	if md, err := msg.Metadata(); err == nil {
		m.Delivery = int(md.NumDelivered)
	}
	return m
}

// Handle processes one message and settles it with JetStream; it returns the
// Processor's outcome and the error of acknowledging, naking or terminating.
func Handle(ctx context.Context, p *consumer.Processor, msg jetstream.Msg, h consumer.Handler, cfg *Config) (consumer.Outcome, error) {
	if cfg == nil {
		cfg = &Config{}
	}
	m := Message(msg, cfg.KeyHeader)
	out := p.Process(ctx, m, h)
	switch out.Action {
	case consumer.Ack:
		return out, msg.Ack()
	case consumer.Retry:
		return out, msg.NakWithDelay(out.Delay)
	default:
		if cfg.DeadLetterSubject != "" {
			if err := deadLetter(ctx, cfg, msg, m, out); err != nil {
				// Not terminated: better redelivered than lost.
				return out, errors.Join(err, msg.NakWithDelay(time.Second))
			}
		}
		return out, msg.Term()
	}
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
	dl.Header.Set(HeaderDeadDeliveries, strconv.Itoa(m.Delivery))
	_, err := cfg.JetStream.PublishMsg(ctx, dl)
	if errors.Is(err, nats.ErrMaxPayload) {
		// A payload near max_payload has no room for the Idem-Dead-* headers.
		// Failing here would nak the message and dead-letter it again on every
		// redelivery, forever: send the copy without its payload (and with a
		// shortened error), saying where the original is.
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
