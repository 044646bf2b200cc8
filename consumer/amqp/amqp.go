// Package amqp runs RabbitMQ deliveries (github.com/rabbitmq/amqp091-go)
// through a consumer.Processor: each message is processed once per message ID
// however often RabbitMQ delivers it, and acknowledged only after its outcome
// is committed.
//
// Declare sets up three queues for a queue named q:
//
//   - q, a quorum queue whose dead-letter exchange routes to q.dead (and which
//     counts redeliveries in x-delivery-count, so that a message that crashes
//     its consumer every time still reaches MaxDeliveries);
//   - q.retry, where a message waits out its delay (per-message TTL) before
//     RabbitMQ's dead-lettering routes it back to q;
//   - q.dead, the dead letters.
//
// The key is the message_id property (Config.KeyHeader names a header
// instead). Outcomes map to RabbitMQ as follows: Ack → Ack; Retry → a copy
// is published to q.retry with the delay as its expiration and the retry
// count in the x-idem-retries header, confirmed, and the delivery is then
// acknowledged (a copy lost to a crash in between means one more delivery,
// never a lost message); DeadLetter → Nack without requeue, which the
// dead-letter exchange routes to q.dead.
package amqp

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
)

// RetriesHeader counts the failed deliveries of a message republished through
// q.retry: the ones whose handler failed, which MaxDeliveries bounds.
const RetriesHeader = "x-idem-retries"

// OutagesHeader counts the retries of a message republished through q.retry
// because the store failed (or the lease was lost): its handler did not fail,
// so they do not count toward MaxDeliveries; they only lengthen the backoff.
const OutagesHeader = "x-idem-outages"

// Declare declares queue, queue+".retry" and queue+".dead" (see the package
// doc) on ch. It is safe to call again with the same name.
func Declare(ch *amqp091.Channel, queue string) error {
	if _, err := ch.QueueDeclare(queue+".dead", true, false, false, false, nil); err != nil {
		return fmt.Errorf("amqp: declare %s.dead: %w", queue, err)
	}
	if _, err := ch.QueueDeclare(queue+".retry", true, false, false, false, amqp091.Table{
		"x-dead-letter-exchange": "", "x-dead-letter-routing-key": queue,
	}); err != nil {
		return fmt.Errorf("amqp: declare %s.retry: %w", queue, err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, amqp091.Table{
		"x-queue-type": "quorum", "x-dead-letter-exchange": "", "x-dead-letter-routing-key": queue + ".dead",
	}); err != nil {
		return fmt.Errorf("amqp: declare %s (a quorum queue; an existing classic queue of that name must be deleted first): %w", queue, err)
	}
	return nil
}

// Config configures Handle.
type Config struct {
	// Queue is the queue consumed, as given to Declare. Required.
	Queue string
	// Publisher is a channel in confirm mode (Channel.Confirm) on which retries
	// are republished to Queue+".retry". Required; it may be the consuming
	// channel.
	Publisher *amqp091.Channel
	// KeyHeader, when set, names the header that carries the message ID instead
	// of the message_id property.
	KeyHeader string
}

// Message converts a delivery into a consumer.Message. The delivery number is
// 1 + the x-idem-retries header + RabbitMQ's x-delivery-count (quorum queues),
// and at least 2 for a delivery flagged Redelivered.
func Message(d *amqp091.Delivery, keyHeader string) *consumer.Message {
	m := &consumer.Message{Payload: d.Body, ID: d.MessageId}
	if keyHeader != "" {
		m.ID, _ = d.Headers[keyHeader].(string)
	}
	m.Delivery = 1 + headerInt(d.Headers, RetriesHeader) + headerInt(d.Headers, "x-delivery-count")
	if d.Redelivered && m.Delivery < 2 {
		m.Delivery = 2
	}
	if len(d.Headers) > 0 {
		m.Header = make(map[string][]string, len(d.Headers))
		for k, v := range d.Headers {
			m.Header[k] = []string{fmt.Sprint(v)}
		}
	}
	return m
}

func headerInt(h amqp091.Table, name string) int {
	var n int64
	switch v := h[name].(type) {
	case int:
		n = int64(v)
	case int8:
		n = int64(v)
	case int16:
		n = int64(v)
	case int32:
		n = int64(v)
	case int64:
		n = v
	case string:
		n, _ = strconv.ParseInt(v, 10, 64)
	}
	// Anyone who can publish can set these headers: a negative count would
	// keep a failing message below MaxDeliveries forever, and a huge one would
	// wrap around to negative when added up. Keep it in [0, maxCount].
	return int(min(max(n, 0), maxCount))
}

// maxCount bounds a delivery count read from a header: far above any
// MaxDeliveries, and sums of a few stay well inside an int32.
const maxCount = 1 << 24

// Handle processes one delivery through p and h and settles it; it returns the
// Processor's outcome and the error of settling it (the delivery then stays
// unacknowledged, and RabbitMQ redelivers it when the channel closes).
func Handle(ctx context.Context, p *consumer.Processor, d *amqp091.Delivery, h consumer.Handler, cfg *Config) (consumer.Outcome, error) {
	m := Message(d, cfg.KeyHeader)
	out := p.Process(ctx, m, h)
	switch out.Action {
	case consumer.Ack:
		return out, d.Ack(false)
	case consumer.Retry:
		retries := headerInt(d.Headers, RetriesHeader) + headerInt(d.Headers, "x-delivery-count")
		outages := headerInt(d.Headers, OutagesHeader)
		delay := out.Delay
		switch out.Reason {
		case consumer.InFlight:
			// Waiting for another delivery to finish is not a failed delivery.
		case consumer.Failed:
			retries++
		default:
			// The store failed, or the lease was lost: the handler did not fail,
			// so this is no delivery for MaxDeliveries (a long store outage must
			// not dead-letter messages that never ran), but the retries back off.
			outages = min(outages+1, maxCount)
			delay = p.Backoff(outages)
		}
		if err := retry(ctx, cfg, d, retries, outages, delay); err != nil {
			return out, errors.Join(err, d.Nack(false, true))
		}
		return out, d.Ack(false)
	default:
		return out, d.Nack(false, false)
	}
}

// retry republishes d to the retry queue with delay and waits for the
// broker's confirmation.
func retry(ctx context.Context, cfg *Config, d *amqp091.Delivery, retries, outages int, delay time.Duration) error {
	if cfg.Publisher == nil || cfg.Queue == "" {
		return errors.New("amqp: Config.Publisher and Config.Queue are required to retry a message; set them (Publisher in confirm mode)")
	}
	headers := amqp091.Table{}
	for k, v := range d.Headers {
		if k != "x-delivery-count" && k != "x-death" && k != "x-first-death-exchange" && k != "x-first-death-queue" && k != "x-first-death-reason" {
			headers[k] = v
		}
	}
	headers[RetriesHeader] = int32(retries)
	if outages > 0 {
		headers[OutagesHeader] = int32(outages)
	}
	ms := max(delay.Milliseconds(), 1)
	c, err := cfg.Publisher.PublishWithDeferredConfirmWithContext(ctx, "", cfg.Queue+".retry", false, false, amqp091.Publishing{
		Headers: headers, ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
		DeliveryMode: amqp091.Persistent, CorrelationId: d.CorrelationId, ReplyTo: d.ReplyTo,
		Expiration: strconv.FormatInt(ms, 10), MessageId: d.MessageId, Timestamp: d.Timestamp,
		Type: d.Type, AppId: d.AppId, Body: d.Body,
	})
	if err != nil {
		return fmt.Errorf("amqp: republish to %s.retry: %w", cfg.Queue, err)
	}
	if c == nil {
		return errors.New("amqp: Config.Publisher is not in confirm mode; call Channel.Confirm(false) on it")
	}
	ok, err := c.WaitContext(ctx)
	if err != nil || !ok {
		return fmt.Errorf("amqp: RabbitMQ did not confirm the retry copy in %s.retry (%v)", cfg.Queue, err)
	}
	return nil
}
