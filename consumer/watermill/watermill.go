// Package watermill is a Watermill (github.com/ThreeDotsLabs/watermill) handler
// middleware that runs every message through a consumer.Processor, which
// brings idem's once-per-message-ID processing to every broker Watermill
// supports (Kafka, SQS, Google Pub/Sub, AMQP, SQL, …).
//
//	h, err := watermill.Handler(proc, watermill.Config{Poison: pub, PoisonTopic: "orders.dead"}, handle)
//	router.AddHandler("orders", "orders", sub, "orders.out", pub, h)
//
// Handler wraps the handler itself, so idem sits innermost, inside every
// router middleware. That order is the safe one, and the only one Handler
// allows: a Retry middleware inside idem would run every attempt in one idem
// transaction, and a failed attempt's writes would commit together with the
// successful one's. idem retries by itself (MaxDeliveries, Backoff), so a
// Retry middleware is not needed; one outside idem is harmless. Middleware is
// the same as a router middleware: add it last (innermost), after any Retry.
//
// The key is the message's UUID, which Watermill producers set once per
// message (Config.KeyMetadata names a metadata field instead). The messages a
// handler produces are stored with its record and returned again for a
// duplicate, with their UUIDs, so that downstream consumers dedupe them too.
//
// Watermill reports no delivery count, so the middleware carries the
// Processor's policy out itself, inside one delivery, and the Processor counts
// the attempts in the store (Message.Delivery 0), where they survive a crash:
// a failed handler is retried after Config.Backoff up to MaxDeliveries, each
// attempt with a fresh claim and transaction; a redelivery after a consumer
// crashed takes the lapsed claim over, which counts as an attempt, so a
// message that crashes every consumer is dead-lettered unrun after
// MaxDeliveries crashes; a delivery in flight elsewhere waits out the lease;
// a store failure is retried after Config.Backoff until the store answers or
// the message's context ends, and does not count toward MaxDeliveries.
// A dead-lettered message (MaxDeliveries reached, a Permanent error, one ID with
// a different payload, no ID) is published to Config.PoisonTopic with the
// reason in its metadata and acknowledged: never a silent drop, and never an
// endless nack loop.
package watermill

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/consumer"
)

// Metadata set on a message published to the poison topic.
const (
	// MetaDeadReason holds the Reason ("poison", "mismatch", "invalid_id").
	MetaDeadReason = "idem_dead_reason"
	// MetaDeadError holds the error text.
	MetaDeadError = "idem_dead_error"
	// MetaDeadAttempts holds the attempt number it was dead-lettered at (0 for
	// a mismatch or a message without an ID, which never got one).
	MetaDeadAttempts = "idem_dead_attempts"
)

// Config configures Middleware.
type Config struct {
	// Poison publishes dead-lettered messages. Required.
	Poison message.Publisher
	// PoisonTopic is the topic they go to. Required.
	PoisonTopic string
	// KeyMetadata, when set, names the metadata field that carries the message
	// ID instead of the message's UUID.
	KeyMetadata string
}

// inFlightPoll is the longest wait before looking again at a message in flight
// elsewhere.
const inFlightPoll = 100 * time.Millisecond

type produced struct {
	UUID     string            `json:"uuid"`
	Metadata map[string]string `json:"metadata,omitempty"`
	Payload  []byte            `json:"payload"`
}

// Middleware returns the handler middleware. It returns an error, saying what
// to set, when cfg is incomplete.
func Middleware(p *consumer.Processor, cfg Config) (message.HandlerMiddleware, error) {
	if p == nil {
		return nil, errors.New("watermill: the Processor is nil; make one with consumer.New")
	}
	if cfg.Poison == nil || cfg.PoisonTopic == "" {
		return nil, errors.New("watermill: Config.Poison and Config.PoisonTopic are required: dead-lettered messages are published there (a Watermill consumer has no delivery count, so nacking them would loop forever)")
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			return handle(p, &cfg, h, msg)
		}
	}, nil
}

// Handler returns h wrapped with the Processor, for Router.AddHandler: idem
// is then innermost, inside every router middleware (see the package doc).
// It returns an error, saying what to set, when cfg is incomplete.
func Handler(p *consumer.Processor, cfg Config, h message.HandlerFunc) (message.HandlerFunc, error) {
	if h == nil {
		return nil, errors.New("watermill: the handler is nil")
	}
	mw, err := Middleware(p, cfg)
	if err != nil {
		return nil, err
	}
	return mw(h), nil
}

func handle(p *consumer.Processor, cfg *Config, h message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	m := &consumer.Message{ID: msg.UUID, Payload: msg.Payload, Header: map[string][]string{}}
	if cfg.KeyMetadata != "" {
		m.ID = msg.Metadata.Get(cfg.KeyMetadata)
	}
	for k, v := range msg.Metadata {
		m.Header[k] = []string{v}
	}
	var out []*message.Message
	handler := func(hctx context.Context, m *consumer.Message) ([]byte, error) {
		orig := msg.Context()
		msg.SetContext(hctx)
		defer msg.SetContext(orig)
		msgs, err := h(msg)
		if err != nil {
			return nil, err
		}
		out = msgs
		return encode(msgs)
	}
	outages := 0
	for {
		m.Delivery = 0 // the Processor counts the attempts, in the store
		o := p.Process(ctx, m, handler)
		switch o.Action {
		case consumer.Ack:
			if o.Reason == consumer.Duplicate {
				return decode(o.Result)
			}
			return out, nil
		case consumer.DeadLetter:
			if err := poison(cfg, msg, o, m.Delivery); err != nil {
				return nil, err
			}
			return nil, p.DeadLettered(ctx, m, o)
		}
		wait := o.Delay
		switch o.Reason {
		case consumer.InFlight:
			// Not a failed delivery. The holder usually finishes well within its
			// lease: look again soon rather than wait the whole lease out.
			wait = min(wait, inFlightPoll)
		case consumer.Failed:
		default:
			// The store failed, or the lease was lost: the handler did not fail,
			// so this is no delivery for MaxDeliveries (past it the Processor
			// dead-letters the message unrun), but the retries back off.
			outages++
			wait = p.Backoff(outages)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("watermill: %w (the message will be redelivered): %v", ctx.Err(), o.Err)
		case <-time.After(wait):
		}
	}
}

func encode(msgs []*message.Message) ([]byte, error) {
	if len(msgs) == 0 {
		return nil, nil
	}
	ps := make([]produced, len(msgs))
	for i, m := range msgs {
		ps[i] = produced{UUID: m.UUID, Metadata: m.Metadata, Payload: m.Payload}
	}
	return json.Marshal(ps)
}

func decode(b []byte) ([]*message.Message, error) {
	if len(b) == 0 {
		return nil, nil
	}
	var ps []produced
	if err := json.Unmarshal(b, &ps); err != nil {
		return nil, fmt.Errorf("watermill: the stored messages of a processed message cannot be decoded: %w", err)
	}
	msgs := make([]*message.Message, len(ps))
	for i, p := range ps {
		msgs[i] = message.NewMessage(p.UUID, p.Payload)
		msgs[i].Metadata = p.Metadata
	}
	return msgs, nil
}

func poison(cfg *Config, msg *message.Message, o consumer.Outcome, attempts int) error {
	dl := msg.Copy()
	dl.Metadata.Set(MetaDeadReason, o.Reason.String())
	if o.Err != nil {
		dl.Metadata.Set(MetaDeadError, o.Err.Error())
	}
	dl.Metadata.Set(MetaDeadAttempts, fmt.Sprint(attempts))
	if err := cfg.Poison.Publish(cfg.PoisonTopic, dl); err != nil {
		// Not acknowledged: redelivered rather than lost.
		return fmt.Errorf("watermill: publish to the poison topic %s: %w (dead-lettered because: %v)", cfg.PoisonTopic, err, o.Err)
	}
	return nil
}
