// Package natsjs publishes an outbox's messages to NATS JetStream: an
// outbox.Publisher that sends each message with Nats-Msg-Id set to its ID
// (so the stream's duplicate window drops a republication within it, and a
// consumer deduplicates any other) and returns only once the stream's PubAck
// came back.
//
// A message larger than the server's max_payload, one over the stream's
// max_msg_size and one whose subject no stream captures are refused as
// outbox.Permanent: the relay dead-letters them with the reason instead of
// retrying. Every other failure (no connection, a timeout, a stream leader
// election) is retried.
package natsjs

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemkit/idem/outbox"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Publisher is an outbox.Publisher on JetStream. Safe for concurrent use.
type Publisher struct {
	js jetstream.JetStream
}

// NewPublisher returns a Publisher on js.
func NewPublisher(js jetstream.JetStream) *Publisher { return &Publisher{js: js} }

// Publish sends m to the subject m.Subject with Nats-Msg-Id = m.ID and m's
// headers, and waits for the stream's acknowledgement.
func (p *Publisher) Publish(ctx context.Context, m *outbox.Stored) error {
	msg := nats.NewMsg(m.Subject)
	msg.Data = m.Payload
	for k, v := range m.Headers {
		msg.Header.Set(k, v)
	}
	msg.Header.Set(jetstream.MsgIDHeader, m.ID)
	if nc := p.js.Conn(); nc != nil && nc.IsConnected() {
		if max := nc.MaxPayload(); max > 0 && int64(len(m.Payload)+headerSize(msg.Header)) > max {
			return outbox.Permanent(fmt.Errorf("natsjs: message of %d bytes with headers is over the NATS server's max_payload of %d bytes", len(m.Payload)+headerSize(msg.Header), max))
		}
	}
	_, err := p.js.PublishMsg(ctx, msg)
	if err == nil {
		return nil
	}
	return p.classify(ctx, m, err)
}

func headerSize(h nats.Header) int {
	n := len("NATS/1.0\r\n\r\n")
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + 2 + len(v) + 2
		}
	}
	return n
}

func (p *Publisher) classify(ctx context.Context, m *outbox.Stored, err error) error {
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, nats.ErrMaxPayload):
		return outbox.Permanent(fmt.Errorf("natsjs: %w (%d bytes)", err, len(m.Payload)))
	case errors.Is(err, nats.ErrBadSubject):
		return outbox.Permanent(fmt.Errorf("natsjs: subject %q: %w", m.Subject, err))
	case errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum:
		return outbox.Permanent(fmt.Errorf("natsjs: the stream refused the message of %d bytes: %w", len(m.Payload), err))
	case errors.Is(err, jetstream.ErrNoStreamResponse), errors.Is(err, nats.ErrNoResponders):
		// No responder: no stream captures the subject — or JetStream is
		// unavailable for a moment. Ask.
		if _, e := p.js.StreamNameBySubject(ctx, m.Subject); errors.Is(e, jetstream.ErrStreamNotFound) {
			return outbox.Permanent(fmt.Errorf("natsjs: no stream captures subject %q (create one, then enqueue the message again)", m.Subject))
		}
	}
	return fmt.Errorf("natsjs: publish to %q: %w", m.Subject, err)
}

var _ outbox.Publisher = (*Publisher)(nil)
