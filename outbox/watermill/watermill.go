// Package watermill publishes an outbox's messages through any Watermill
// message.Publisher (Kafka, SQL, Google Cloud Pub/Sub, …): the message's
// UUID is the outbox message's ID, its metadata the headers, its topic the
// subject. The outbox's guarantee holds when the Watermill publisher's
// Publish returns only once the broker has the message (the Kafka, AMQP and
// NATS publishers do, in their synchronous modes).
//
// Watermill's Publish takes no context: when the relay's publication
// deadline passes, Publish returns an error, but Watermill's call goes on in
// the background and may still deliver the message, even after the lease
// lapsed and another relay (or this one) published it again: a duplicate,
// under the same UUID, that the consumer must absorb. Give the Watermill
// publisher timeouts of its own shorter than the relay's PublishTimeout.
//
// Watermill's errors say nothing portable about permanence: Config.Permanent
// decides which are, none by default.
package watermill

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/outbox"
)

// Config configures a Publisher.
type Config struct {
	// Permanent reports whether err, returned by the Watermill publisher for
	// m, will never succeed (the relay then dead-letters m with the reason).
	// nil: every failure is retried.
	Permanent func(m *outbox.Stored, err error) bool
	// MaxPending bounds the Watermill Publish calls running at once,
	// including those the relay gave up on that have not returned
	// (DefaultMaxPending if 0). Once that many are running, as when the
	// broker stalls, Publish fails at once without starting another, so
	// a stalled broker costs at most MaxPending goroutines.
	MaxPending int
}

// DefaultMaxPending is Config.MaxPending's default: four times the relay's
// default Concurrency.
const DefaultMaxPending = 64

// Publisher is an outbox.Publisher on a Watermill message.Publisher.
type Publisher struct {
	pub     message.Publisher
	cfg     Config
	pending chan struct{} // a slot per running Watermill Publish
}

// NewPublisher returns a Publisher on pub; cfg may be nil.
func NewPublisher(pub message.Publisher, cfg *Config) *Publisher {
	p := &Publisher{pub: pub}
	if cfg != nil {
		p.cfg = *cfg
	}
	if p.cfg.MaxPending <= 0 {
		p.cfg.MaxPending = DefaultMaxPending
	}
	p.pending = make(chan struct{}, p.cfg.MaxPending)
	return p
}

// Publish publishes m to topic m.Subject with UUID m.ID. Watermill's Publish
// takes no context: when ctx ends first, Publish returns ctx's error and the
// publication, which may still complete, is tried again later with the same
// UUID. At most Config.MaxPending such calls run at once.
func (p *Publisher) Publish(ctx context.Context, m *outbox.Stored) error {
	msg := message.NewMessage(m.ID, m.Payload)
	for k, v := range m.Headers {
		msg.Metadata.Set(k, v)
	}
	msg.SetContext(ctx)
	select {
	case p.pending <- struct{}{}:
	default:
		return fmt.Errorf("outbox/watermill: %s not sent: %d Watermill publications are still running (the broker is not answering; MaxPending)", m.ID, cap(p.pending))
	}
	done := make(chan error, 1)
	go func() {
		defer func() { <-p.pending }()
		done <- p.pub.Publish(m.Subject, msg)
	}()
	select {
	case err := <-done:
		if err == nil {
			return nil
		}
		err = fmt.Errorf("outbox/watermill: publish %s to %q: %w", m.ID, m.Subject, err)
		if p.cfg.Permanent != nil && p.cfg.Permanent(m, err) {
			return outbox.Permanent(err)
		}
		return err
	case <-ctx.Done():
		return fmt.Errorf("outbox/watermill: publish %s to %q: %w", m.ID, m.Subject, context.Cause(ctx))
	}
}

var _ outbox.Publisher = (*Publisher)(nil)
