// Package amqp publishes an outbox's messages to RabbitMQ (AMQP 0-9-1): an
// outbox.Publisher that sends each message persistent, with message-id set
// to its ID, mandatory, on a channel in confirm mode, and returns only once
// the broker confirmed it.
//
// A message the broker returns as unroutable (no queue bound for its routing
// key) and one over the broker's max_message_size are refused as
// outbox.Permanent: the relay dead-letters them with the reason. Every other
// failure (no connection, a nack, a timeout, a missing exchange, which an
// operator may yet declare) is retried; the Publisher dials again after the
// connection was lost.
package amqp

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/outbox"
)

// Config configures a Publisher.
type Config struct {
	// URL is the broker to dial ("amqp://guest:guest@127.0.0.1:5672/").
	// Required unless Dial is set.
	URL string
	// Dial, if set, opens the connection instead of amqp091.Dial(URL).
	Dial func() (*amqp091.Connection, error)
	// Exchange is the exchange messages are published to; "" is the default
	// exchange, which routes by queue name. The routing key is the message's
	// Subject.
	Exchange string
}

// Publisher is an outbox.Publisher on RabbitMQ. Safe for concurrent use;
// Close it when done.
type Publisher struct {
	cfg Config

	sem    chan struct{} // guards what follows; a channel, so that waits end with ctx
	conn   *amqp091.Connection
	ch     *amqp091.Channel
	rets   *returns
	closed bool
}

// returns records the messages the broker returned on one channel. The
// client hands a return over, on an unbuffered channel, before it handles
// the confirmation that follows it; a barrier that this goroutine answers
// after it has recorded every return it received is thus answered after the
// return of a message whose confirmation has come.
type returns struct {
	mu       sync.Mutex
	returned map[string]string
	// waiting counts the publications of each ID that wait for their
	// confirmation on this channel: a return is kept only for them, and
	// forgotten with the last of them, so that the map holds no more than
	// what is in flight.
	waiting map[string]int
	barrier chan chan struct{}
	done    chan struct{}

	closed   chan struct{} // closed once the channel closed, closeErr set
	closeErr error
}

// watch records why the channel closed.
func (r *returns) watch(in <-chan *amqp091.Error) {
	e, ok := <-in
	if ok && e != nil {
		r.closeErr = e
	} else {
		r.closeErr = amqp091.ErrClosed
	}
	close(r.closed)
}

func (r *returns) loop(in <-chan amqp091.Return) {
	defer close(r.done)
	for {
		select {
		case ret, ok := <-in:
			if !ok {
				return
			}
			r.mu.Lock()
			if r.waiting[ret.MessageId] == 0 {
				// Its publication gave up (and dropped the channel):
				// nobody will collect it.
				r.mu.Unlock()
				continue
			}
			r.returned[ret.MessageId] = fmt.Sprintf("%d %s (exchange %q, routing key %q)", ret.ReplyCode, ret.ReplyText, ret.Exchange, ret.RoutingKey)
			r.mu.Unlock()
		case reply := <-r.barrier:
			close(reply)
		}
	}
}

// expect registers a publication of id about to be sent; forget, called
// once it ended whatever the outcome, undoes it.
func (r *returns) expect(id string) {
	r.mu.Lock()
	r.waiting[id]++
	r.mu.Unlock()
}

func (r *returns) forget(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.waiting[id]--; r.waiting[id] <= 0 {
		delete(r.waiting, id)
		delete(r.returned, id)
	}
}

// take returns and forgets why id was returned, "" if it was not.
func (r *returns) take(ctx context.Context, id string) (string, error) {
	reply := make(chan struct{})
	select {
	case r.barrier <- reply:
	case <-r.done:
	case <-ctx.Done():
		return "", ctx.Err()
	}
	select {
	case <-reply:
	case <-r.done:
	case <-ctx.Done():
		return "", ctx.Err()
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	why := r.returned[id]
	delete(r.returned, id)
	return why, nil
}

// NewPublisher returns a Publisher; it dials on the first Publish.
func NewPublisher(cfg Config) (*Publisher, error) {
	if cfg.URL == "" && cfg.Dial == nil {
		return nil, errors.New("outbox/amqp: Config needs URL (amqp://user:pass@host:5672/) or Dial")
	}
	return &Publisher{cfg: cfg, sem: make(chan struct{}, 1)}, nil
}

func (p *Publisher) lock(ctx context.Context) error {
	select {
	case p.sem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("outbox/amqp: waiting for the connection: %w", context.Cause(ctx))
	}
}

func (p *Publisher) unlock() { <-p.sem }

// Close closes the connection.
func (p *Publisher) Close() error {
	_ = p.lock(context.Background())
	defer p.unlock()
	p.closed = true
	return p.reset()
}

func (p *Publisher) reset() error {
	var err error
	if p.conn != nil {
		err = p.conn.Close()
	}
	p.conn, p.ch, p.rets = nil, nil, nil
	if errors.Is(err, amqp091.ErrClosed) {
		err = nil
	}
	return err
}

// channel returns the confirm-mode channel, dialling if needed, within ctx.
func (p *Publisher) channel(ctx context.Context) (*amqp091.Channel, *returns, error) {
	if err := p.lock(ctx); err != nil {
		return nil, nil, err
	}
	defer p.unlock()
	if p.closed {
		return nil, nil, errors.New("outbox/amqp: Publisher is closed")
	}
	if p.ch != nil && !p.ch.IsClosed() && !p.conn.IsClosed() {
		return p.ch, p.rets, nil
	}
	_ = p.reset()
	var conn *amqp091.Connection
	var err error
	if p.cfg.Dial != nil {
		conn, err = p.cfg.Dial()
	} else {
		// The dial and the handshake end by ctx's deadline (a black-holed
		// broker must not hold a publication past its lease).
		timeout := 30 * time.Second
		if d, ok := ctx.Deadline(); ok {
			timeout = min(timeout, time.Until(d))
		}
		conn, err = amqp091.DialConfig(p.cfg.URL, amqp091.Config{Dial: amqp091.DefaultDial(max(timeout, time.Millisecond)), Heartbeat: 10 * time.Second, Locale: "en_US"})
	}
	if err != nil {
		return nil, nil, fmt.Errorf("outbox/amqp: dial: %w", err)
	}
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
		return nil, nil, fmt.Errorf("outbox/amqp: open channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = conn.Close()
		return nil, nil, fmt.Errorf("outbox/amqp: confirm mode: %w", err)
	}
	r := &returns{returned: map[string]string{}, waiting: map[string]int{}, barrier: make(chan chan struct{}), done: make(chan struct{}), closed: make(chan struct{})}
	go r.loop(ch.NotifyReturn(make(chan amqp091.Return)))
	go r.watch(ch.NotifyClose(make(chan *amqp091.Error, 1)))
	p.conn, p.ch, p.rets = conn, ch, r
	return ch, r, nil
}

// drop forgets ch after a failure on it, so that the next Publish opens a
// new one.
func (p *Publisher) drop(ch *amqp091.Channel) {
	_ = p.lock(context.Background())
	defer p.unlock()
	if p.ch == ch {
		_ = p.reset()
	}
}

// abandon drops ch after a publication gave up waiting for its
// confirmation, closing its connection within a second (a black-holed
// broker does not answer the close).
func (p *Publisher) abandon(ch *amqp091.Channel) {
	_ = p.lock(context.Background())
	defer p.unlock()
	if p.ch != ch {
		return
	}
	if p.conn != nil {
		_ = p.conn.CloseDeadline(time.Now().Add(time.Second))
	}
	p.conn, p.ch, p.rets = nil, nil, nil
}

// Publish sends m with message-id = m.ID, persistent and mandatory, to the
// configured exchange with routing key m.Subject, and waits for the broker's
// confirmation.
func (p *Publisher) Publish(ctx context.Context, m *outbox.Stored) error {
	ch, rets, err := p.channel(ctx)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("outbox/amqp: %s not sent: %w", m.ID, err) // never after the deadline
	}
	headers := amqp091.Table{}
	for k, v := range m.Headers {
		headers[k] = v
	}
	msg := amqp091.Publishing{
		MessageId:    m.ID,
		DeliveryMode: amqp091.Persistent,
		Body:         m.Payload,
		Headers:      headers,
		Timestamp:    m.EnqueuedAt,
		ContentType:  m.Headers["Content-Type"],
	}
	rets.expect(m.ID)
	defer rets.forget(m.ID)
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, p.cfg.Exchange, m.Subject, true, false, msg)
	if err != nil {
		p.drop(ch)
		return p.classify(m, err)
	}
	acked, err := dc.WaitContext(ctx)
	if err != nil {
		// The broker's return and confirmation may still come: on a new
		// channel they cannot be taken for those of a later publication
		// of the same ID (the relay's republication of this one).
		p.abandon(ch)
		return fmt.Errorf("outbox/amqp: no confirmation for %s: %w", m.ID, err)
	}
	if !acked {
		// A nack, or the channel closed before the confirmation: why?
		t := time.NewTimer(time.Second)
		defer t.Stop()
		select {
		case <-rets.closed:
			p.drop(ch)
			return p.classify(m, rets.closeErr)
		case <-t.C:
		case <-ctx.Done():
		}
		return fmt.Errorf("outbox/amqp: the broker nacked %s", m.ID)
	}
	why, err := rets.take(ctx, m.ID)
	if err != nil {
		return err
	}
	if why != "" {
		return outbox.Permanent(fmt.Errorf("outbox/amqp: the broker returned the message as unroutable: %s", why))
	}
	return nil
}

func (p *Publisher) classify(m *outbox.Stored, err error) error {
	var ae *amqp091.Error
	if errors.As(err, &ae) && ae.Code == amqp091.PreconditionFailed && strings.Contains(ae.Reason, "larger than") {
		return outbox.Permanent(fmt.Errorf("outbox/amqp: the broker refused the message of %d bytes: %w", len(m.Payload), err))
	}
	return fmt.Errorf("outbox/amqp: publish %s to %q: %w", m.ID, m.Subject, err)
}

var _ outbox.Publisher = (*Publisher)(nil)
