package idemotel

import (
	"context"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/idemkit/idem/outbox"
)

// OutboxLagBuckets are the bounds of idem.outbox.lag, in seconds
// (idemprom.DefaultOutboxLagBuckets).
var OutboxLagBuckets = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900}

// Outbox is an outbox.Observer that records an outbox.Relay's work as
// OpenTelemetry metrics: set it as Relay.Observer. Safe for concurrent use.
// The instruments: idem.outbox.published, idem.outbox.failed,
// idem.outbox.dead_lettered, idem.outbox.deleted, idem.outbox.source_errors
// (counters), idem.outbox.lag and idem.outbox.batch.duration (histograms, s),
// idem.outbox.pending, idem.outbox.oldest_pending_age (s) and
// idem.outbox.dead_letters (gauges, every Relay.StatsInterval).
type Outbox struct {
	outbox.NopObserver
	published, failed, dead, deleted, sourceErrs metric.Int64Counter
	lag, batch                                   metric.Float64Histogram
	pending, deadLetters                         metric.Int64Gauge
	oldest                                       metric.Float64Gauge
}

// NewOutbox creates the outbox instruments on mp's meter (nil:
// otel.GetMeterProvider()).
func NewOutbox(mp metric.MeterProvider) (*Outbox, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := mp.Meter(ScopeName)
	o := &Outbox{}
	var err error
	must := func(e error) {
		if err == nil {
			err = e
		}
	}
	var e error
	o.published, e = meter.Int64Counter("idem.outbox.published", metric.WithDescription("Outbox messages the broker confirmed (a republication after a crash counts again)."), metric.WithUnit("{message}"))
	must(e)
	o.failed, e = meter.Int64Counter("idem.outbox.failed", metric.WithDescription("Outbox publications that failed and are retried with backoff."), metric.WithUnit("{message}"))
	must(e)
	o.dead, e = meter.Int64Counter("idem.outbox.dead_lettered", metric.WithDescription("Outbox messages moved to the dead-letter table."), metric.WithUnit("{message}"))
	must(e)
	o.deleted, e = meter.Int64Counter("idem.outbox.deleted", metric.WithDescription("Published outbox messages deleted by the retention."), metric.WithUnit("{message}"))
	must(e)
	o.sourceErrs, e = meter.Int64Counter("idem.outbox.source_errors", metric.WithDescription("Calls of the relay to the outbox table that failed."), metric.WithUnit("{error}"))
	must(e)
	o.lag, e = meter.Float64Histogram("idem.outbox.lag", metric.WithDescription("Time from an outbox message's enqueue to the broker's confirmation."), metric.WithUnit("s"), metric.WithExplicitBucketBoundaries(OutboxLagBuckets...))
	must(e)
	o.batch, e = meter.Float64Histogram("idem.outbox.batch.duration", metric.WithDescription("Time the relay took for one leased batch."), metric.WithUnit("s"), metric.WithExplicitBucketBoundaries(RequestBuckets...))
	must(e)
	o.pending, e = meter.Int64Gauge("idem.outbox.pending", metric.WithDescription("Outbox messages not yet published."), metric.WithUnit("{message}"))
	must(e)
	o.oldest, e = meter.Float64Gauge("idem.outbox.oldest_pending_age", metric.WithDescription("Age of the oldest unpublished outbox message, 0 when none."), metric.WithUnit("s"))
	must(e)
	o.deadLetters, e = meter.Int64Gauge("idem.outbox.dead_letters", metric.WithDescription("Messages in the outbox's dead-letter table."), metric.WithUnit("{message}"))
	must(e)
	if err != nil {
		return nil, err
	}
	return o, nil
}

// Published implements outbox.Observer.
func (o *Outbox) Published(_ *outbox.Stored, lag time.Duration) {
	ctx := context.Background()
	o.published.Add(ctx, 1)
	o.lag.Record(ctx, max(0, lag.Seconds()))
}

// Failed implements outbox.Observer.
func (o *Outbox) Failed(*outbox.Stored, error, time.Duration) { o.failed.Add(context.Background(), 1) }

// DeadLettered implements outbox.Observer.
func (o *Outbox) DeadLettered(*outbox.Stored, string) { o.dead.Add(context.Background(), 1) }

// Batch implements outbox.Observer.
func (o *Outbox) Batch(_ int, d time.Duration) { o.batch.Record(context.Background(), d.Seconds()) }

// Stats implements outbox.Observer.
func (o *Outbox) Stats(s outbox.Stats) {
	ctx := context.Background()
	o.pending.Record(ctx, s.Pending)
	o.oldest.Record(ctx, s.OldestPending.Seconds())
	o.deadLetters.Record(ctx, s.DeadLetters)
}

// SourceFailed implements outbox.Observer.
func (o *Outbox) SourceFailed(error) { o.sourceErrs.Add(context.Background(), 1) }

// Deleted implements outbox.Observer.
func (o *Outbox) Deleted(n int) { o.deleted.Add(context.Background(), int64(n)) }

var _ outbox.Observer = (*Outbox)(nil)
