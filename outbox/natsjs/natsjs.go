// Package natsjs publishes an outbox's messages to NATS JetStream: an
// outbox.Publisher that sends each message with Nats-Msg-Id set to its ID
// (so the stream's duplicate window drops a republication within it, and a
// consumer deduplicates any other) and returns only once the stream's PubAck
// came back.
//
// A message larger than the server's max_payload, one over the stream's
// max_msg_size and one whose subject no stream captures are refused as
// outbox.Permanent: the relay dead-letters them with the reason instead of
// retrying, as is a subject no one can publish to (an empty token, a
// wildcard). Every other failure (no connection, a timeout, a stream leader
// election) is retried.
package natsjs

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/idemkit/idem/outbox"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Publisher is an outbox.Publisher on JetStream. Safe for concurrent use.
type Publisher struct {
	mu  sync.Mutex
	js  jetstream.JetStream
	own bool // Dial made the connection: redial it when it is closed
	url string
	opt []nats.Option
}

// NewPublisher returns a Publisher on js, whose connection the caller owns:
// let it reconnect forever (nats.MaxReconnects(-1)), or a relay stops
// publishing once nats.go gives up, and give it nats.ReconnectBufSize(-1),
// or a publication that timed out while the connection was down is still
// sent, from nats.go's buffer, when it is back (a late duplicate, possibly
// after the stream's duplicate window). Dial does both, and dials again
// even after the connection was closed.
func NewPublisher(js jetstream.JetStream) *Publisher { return &Publisher{js: js} }

// Dial connects to the NATS server at url (with nats.MaxReconnects(-1),
// nats.RetryOnFailedConnect(true), nats.ReconnectBufSize(-1): nothing is
// buffered while disconnected, a publication then fails at once and the
// relay retries it; and opts) and returns a Publisher that owns
// the connection: if it is ever closed, the next Publish dials again. Close
// it when done.
func Dial(url string, opts ...nats.Option) (*Publisher, error) {
	p := &Publisher{own: true, url: url, opt: append([]nats.Option{nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true), nats.ReconnectBufSize(-1)}, opts...)}
	if _, err := p.jetStream(); err != nil {
		return nil, err
	}
	return p, nil
}

// Close closes the connection Dial made; it does nothing to NewPublisher's.
func (p *Publisher) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.own && p.js != nil {
		p.js.Conn().Close()
	}
}

func (p *Publisher) jetStream() (jetstream.JetStream, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.js != nil && (!p.own || !p.js.Conn().IsClosed()) {
		return p.js, nil
	}
	nc, err := nats.Connect(p.url, p.opt...)
	if err != nil {
		return nil, fmt.Errorf("natsjs: connect to %s: %w", p.url, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("natsjs: %w", err)
	}
	p.js = js
	return js, nil
}

// subjectOK reports whether s is a subject one may publish to: tokens
// separated by dots, none empty, no wildcard.
func subjectOK(s string) bool {
	for _, tok := range strings.Split(s, ".") {
		if tok == "" || tok == "*" || tok == ">" {
			return false
		}
	}
	return true
}

// Publish sends m to the subject m.Subject with Nats-Msg-Id = m.ID and m's
// headers, and waits for the stream's acknowledgement.
func (p *Publisher) Publish(ctx context.Context, m *outbox.Stored) error {
	if !subjectOK(m.Subject) {
		return outbox.Permanent(fmt.Errorf("natsjs: %q is not a subject one can publish to (empty token or wildcard)", m.Subject))
	}
	js, err := p.jetStream()
	if err != nil {
		return err
	}
	msg := nats.NewMsg(m.Subject)
	msg.Data = m.Payload
	for k, v := range m.Headers {
		msg.Header.Set(k, v)
	}
	msg.Header.Set(jetstream.MsgIDHeader, m.ID)
	if nc := js.Conn(); nc != nil && nc.IsConnected() {
		if max := nc.MaxPayload(); max > 0 && int64(len(m.Payload)+headerSize(msg.Header)) > max {
			return outbox.Permanent(fmt.Errorf("natsjs: message of %d bytes with headers is over the NATS server's max_payload of %d bytes", len(m.Payload)+headerSize(msg.Header), max))
		}
	}
	if _, err := js.PublishMsg(ctx, msg); err != nil {
		return classify(ctx, js, m, err)
	}
	return nil
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

func classify(ctx context.Context, js jetstream.JetStream, m *outbox.Stored, err error) error {
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
		if _, e := js.StreamNameBySubject(ctx, m.Subject); errors.Is(e, jetstream.ErrStreamNotFound) {
			return outbox.Permanent(fmt.Errorf("natsjs: no stream captures subject %q (create one, then enqueue the message again)", m.Subject))
		}
	}
	return fmt.Errorf("natsjs: publish to %q: %w", m.Subject, err)
}

var _ outbox.Publisher = (*Publisher)(nil)
