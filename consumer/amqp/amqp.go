// Package amqp runs RabbitMQ deliveries (github.com/rabbitmq/amqp091-go)
// through a consumer.Processor: each message is processed once per message ID
// however often RabbitMQ delivers it, and acknowledged only after its outcome
// is committed.
//
// Declare sets up three queues for a queue named q:
//
//   - q, a quorum queue whose dead-letter exchange routes to q.dead (a message
//     that crashes its consumer every time reaches MaxDeliveries because the
//     Processor counts each takeover of its lapsed claim as an attempt);
//   - one delay queue per delay bucket, q.retry.10ms to q.retry.1h (see
//     RetryQueues), where a message waits out its delay (the queue's
//     x-message-ttl) before RabbitMQ's dead-lettering routes it back to q.
//     Every message in one bucket waits the same time, so none waits behind
//     a longer one (RabbitMQ only expires the head of a queue); a delay is
//     rounded up to the next bucket, and capped at 1 h;
//   - q.retry, the single delay queue of earlier versions, kept so that the
//     copies still in it flow back (nothing new goes there);
//   - q.dead, the dead letters.
//
// The key is the message_id property (Config.KeyHeader names a header
// instead; a numeric or byte-string header value counts as its text).
// Outcomes map to RabbitMQ as follows: Ack → Ack; Retry → a copy is published
// to the delay bucket with the retry count in the x-idem-retries header,
// confirmed, and the delivery is then acknowledged (a copy lost to a crash in
// between means one more delivery, never a lost message); DeadLetter → a copy
// is published to q.dead with the reason in x-idem-dead-reason and
// x-idem-dead-error, confirmed, and the delivery acknowledged (if that
// publish fails: Nack without requeue, which the dead-letter exchange routes
// to q.dead without our headers). A dead letter carries no x-idem-retries, so
// shovelled back to q it is processed afresh with its MaxDeliveries.
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
// a delay queue: the ones whose handler failed. It is for operators: the
// attempts MaxDeliveries bounds are counted in the store.
const RetriesHeader = "x-idem-retries"

// OutagesHeader counts the retries of a message republished through a delay
// queue because the store failed (or the lease was lost): its handler did not
// fail, so they do not count toward MaxDeliveries; they only lengthen the
// backoff.
const OutagesHeader = "x-idem-outages"

// Headers set on a dead letter published to q.dead.
const (
	// DeadReasonHeader holds the Reason ("poison", "mismatch", "invalid_id").
	DeadReasonHeader = "x-idem-dead-reason"
	// DeadErrorHeader holds the error text.
	DeadErrorHeader = "x-idem-dead-error"
	// DeadDeliveriesHeader holds the attempt number it was dead-lettered at.
	DeadDeliveriesHeader = "x-idem-dead-deliveries"
)

// retryBuckets are the delays of the delay queues.
var retryBuckets = []time.Duration{
	10 * time.Millisecond, 50 * time.Millisecond, 100 * time.Millisecond, 250 * time.Millisecond, 500 * time.Millisecond,
	time.Second, 2 * time.Second, 5 * time.Second, 10 * time.Second, 30 * time.Second,
	time.Minute, 2 * time.Minute, 5 * time.Minute, 15 * time.Minute, 30 * time.Minute, time.Hour,
}

// bucket returns the delay queue for delay: the shortest bucket at least as
// long, or the longest.
func bucket(queue string, delay time.Duration) string {
	for _, b := range retryBuckets {
		if delay <= b {
			return bucketName(queue, b)
		}
	}
	return bucketName(queue, retryBuckets[len(retryBuckets)-1])
}

func bucketName(queue string, d time.Duration) string {
	switch {
	case d < time.Second:
		return fmt.Sprintf("%s.retry.%dms", queue, d.Milliseconds())
	case d < time.Minute:
		return fmt.Sprintf("%s.retry.%ds", queue, int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%s.retry.%dm", queue, int(d.Minutes()))
	}
	return fmt.Sprintf("%s.retry.%dh", queue, int(d.Hours()))
}

// RetryQueues returns the names of the delay queues Declare makes for queue,
// shortest delay first (queue+".retry.10ms" … queue+".retry.1h"), for tools
// and tests that delete them.
func RetryQueues(queue string) []string {
	out := make([]string, len(retryBuckets))
	for i, b := range retryBuckets {
		out[i] = bucketName(queue, b)
	}
	return out
}

// Declare declares queue, its delay queues, queue+".retry" and
// queue+".dead" (see the package doc) on ch. It is safe to call again with the
// same name.
func Declare(ch *amqp091.Channel, queue string) error {
	if _, err := ch.QueueDeclare(queue+".dead", true, false, false, false, nil); err != nil {
		return fmt.Errorf("amqp: declare %s.dead: %w", queue, err)
	}
	if _, err := ch.QueueDeclare(queue+".retry", true, false, false, false, amqp091.Table{
		"x-dead-letter-exchange": "", "x-dead-letter-routing-key": queue,
	}); err != nil {
		return fmt.Errorf("amqp: declare %s.retry: %w", queue, err)
	}
	for _, b := range retryBuckets {
		name := bucketName(queue, b)
		if _, err := ch.QueueDeclare(name, true, false, false, false, amqp091.Table{
			"x-dead-letter-exchange": "", "x-dead-letter-routing-key": queue, "x-message-ttl": b.Milliseconds(),
		}); err != nil {
			return fmt.Errorf("amqp: declare %s: %w", name, err)
		}
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
	// are republished to the delay queues and dead letters to Queue+".dead".
	// Required; it may be the consuming channel.
	Publisher *amqp091.Channel
	// KeyHeader, when set, names the header that carries the message ID instead
	// of the message_id property.
	KeyHeader string
}

// Message converts a delivery into a consumer.Message. The delivery number is
// 1 for a first delivery (no x-idem-retries, no x-delivery-count, not flagged
// Redelivered) and 0 otherwise: the Processor then counts the attempts in the
// store, where a crash cannot lose them and a producer cannot forge them. A
// message that RabbitMQ dead-lettered (x-first-death-reason "rejected") and
// that was shovelled back counts as a first delivery.
func Message(d *amqp091.Delivery, keyHeader string) *consumer.Message {
	m := &consumer.Message{Payload: d.Body, ID: d.MessageId}
	if keyHeader != "" {
		m.ID = headerString(d.Headers[keyHeader])
	}
	if retriesOf(d) == 0 && headerInt(d.Headers, "x-delivery-count") == 0 && !d.Redelivered {
		m.Delivery = 1
	} else {
		// A retry or a redelivery: RabbitMQ's x-delivery-count also counts
		// messages that were only prefetched by a consumer that crashed, and
		// headers can be set by anyone who publishes, so the Processor counts
		// the attempts itself, in the store (0).
		m.Delivery = 0
	}
	if len(d.Headers) > 0 {
		m.Header = make(map[string][]string, len(d.Headers))
		for k, v := range d.Headers {
			if t := headerString(v); t != "" {
				m.Header[k] = []string{t}
			} else {
				m.Header[k] = []string{fmt.Sprint(v)}
			}
		}
	}
	return m
}

// retriesOf is the x-idem-retries count, or 0 for a dead letter replayed.
func retriesOf(d *amqp091.Delivery) int {
	if r, _ := d.Headers["x-first-death-reason"].(string); r == "rejected" {
		return 0
	}
	return headerInt(d.Headers, RetriesHeader)
}

// headerString is the text of a header value: a string, a byte string or a
// number; "" for anything else.
func headerString(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case []byte:
		return string(v)
	case int, int8, int16, int32, int64, uint8, uint16, uint32, uint64:
		return fmt.Sprint(v)
	}
	return ""
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
	if p == nil || d == nil {
		return consumer.Outcome{}, errors.New("amqp: the Processor or the delivery is nil; make the Processor with consumer.New (the delivery is left unacknowledged)")
	}
	if cfg == nil {
		cfg = &Config{}
	}
	m := Message(d, cfg.KeyHeader)
	out := p.Process(ctx, m, h)
	switch out.Action {
	case consumer.Ack:
		return out, d.Ack(false)
	case consumer.Retry:
		retries := retriesOf(d) + headerInt(d.Headers, "x-delivery-count")
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
			// Requeued for an immediate redelivery: wait a little first, so that a
			// broken publisher does not make the message spin.
			select {
			case <-ctx.Done():
			case <-time.After(min(delay, time.Second)):
			}
			return out, errors.Join(err, d.Nack(false, true))
		}
		return out, d.Ack(false)
	default:
		if err := deadLetter(ctx, cfg, d, m, out); err != nil {
			// RabbitMQ's dead-lettering still puts it in q.dead, without our headers.
			if nerr := d.Nack(false, false); nerr != nil {
				return out, errors.Join(err, nerr)
			}
			return out, errors.Join(err, p.DeadLettered(ctx, m, out))
		}
		if err := d.Ack(false); err != nil {
			return out, err
		}
		return out, p.DeadLettered(ctx, m, out)
	}
}

// copyHeaders copies d's headers but RabbitMQ's dead-lettering ones and ours.
func copyHeaders(d *amqp091.Delivery) amqp091.Table {
	headers := amqp091.Table{}
	for k, v := range d.Headers {
		switch k {
		case "x-delivery-count", "x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
			"x-last-death-exchange", "x-last-death-queue", "x-last-death-reason",
			RetriesHeader, OutagesHeader, DeadReasonHeader, DeadErrorHeader, DeadDeliveriesHeader:
		default:
			headers[k] = v
		}
	}
	return headers
}

// publish publishes a copy of d to queue and waits for the confirmation.
func publish(ctx context.Context, cfg *Config, d *amqp091.Delivery, queue string, headers amqp091.Table) error {
	if cfg.Publisher == nil || cfg.Queue == "" {
		return errors.New("amqp: Config.Publisher and Config.Queue are required to retry or dead-letter a message; set them (Publisher in confirm mode)")
	}
	c, err := cfg.Publisher.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, amqp091.Publishing{
		Headers: headers, ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
		DeliveryMode: amqp091.Persistent, CorrelationId: d.CorrelationId, ReplyTo: d.ReplyTo,
		MessageId: d.MessageId, Timestamp: d.Timestamp, Type: d.Type, AppId: d.AppId, Body: d.Body,
	})
	if err != nil {
		return fmt.Errorf("amqp: publish to %s: %w", queue, err)
	}
	if c == nil {
		return errors.New("amqp: Config.Publisher is not in confirm mode; call Channel.Confirm(false) on it")
	}
	ok, err := c.WaitContext(ctx)
	if err != nil || !ok {
		return fmt.Errorf("amqp: RabbitMQ did not confirm the copy in %s (%v)", queue, err)
	}
	return nil
}

// deadLetter publishes d to q.dead with the reason, without the retry counts.
func deadLetter(ctx context.Context, cfg *Config, d *amqp091.Delivery, m *consumer.Message, out consumer.Outcome) error {
	headers := copyHeaders(d)
	headers[DeadReasonHeader] = out.Reason.String()
	if out.Err != nil {
		e := out.Err.Error()
		if len(e) > 4096 {
			e = e[:4096] + "…"
		}
		headers[DeadErrorHeader] = e
	}
	headers[DeadDeliveriesHeader] = int32(min(m.Delivery, maxCount))
	return publish(ctx, cfg, d, cfg.Queue+".dead", headers)
}

// retry republishes d to the delay queue of delay and waits for the
// broker's confirmation.
func retry(ctx context.Context, cfg *Config, d *amqp091.Delivery, retries, outages int, delay time.Duration) error {
	headers := copyHeaders(d)
	headers[RetriesHeader] = int32(retries)
	if outages > 0 {
		headers[OutagesHeader] = int32(outages)
	}
	return publish(ctx, cfg, d, bucket(cfg.Queue, delay), headers)
}
