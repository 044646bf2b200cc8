package idemprom

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/outbox"
)

// DefaultOutboxLagBuckets are the bounds of idem_outbox_lag_seconds, from
// enqueue to the broker's confirmation, in seconds.
var DefaultOutboxLagBuckets = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900}

// OutboxConfig configures the outbox relay's metrics. A nil *OutboxConfig
// means all defaults.
type OutboxConfig struct {
	// LagBuckets are the bounds of idem_outbox_lag_seconds
	// (DefaultOutboxLagBuckets).
	LagBuckets []float64
	// ConstLabels are added to every metric (for example the outbox's name,
	// when a process runs relays for several).
	ConstLabels prometheus.Labels
}

// Outbox is an outbox.Observer that exports an outbox.Relay's work to
// Prometheus: set it as Relay.Observer. Safe for concurrent use.
//
//   - idem_outbox_published_total, idem_outbox_failed_total (retried),
//     idem_outbox_dead_lettered_total, idem_outbox_deleted_total (retention),
//     idem_outbox_source_errors_total (database calls that failed);
//   - idem_outbox_lag_seconds: enqueue to the broker's confirmation;
//   - idem_outbox_batch_duration_seconds: one leased batch, published and
//     recorded;
//   - idem_outbox_pending, idem_outbox_oldest_pending_age_seconds and
//     idem_outbox_dead_letters: the table's counts, every
//     Relay.StatsInterval. Alert on the age: it grows when nothing drains.
type Outbox struct {
	outbox.NopObserver
	published, failed, dead, deleted, sourceErrs prometheus.Counter
	lag, batch                                   prometheus.Histogram
	pending, oldest, deadLetters                 prometheus.Gauge
	collectors                                   []prometheus.Collector
}

// NewOutbox creates the outbox metrics and registers them with reg (nil: not
// registered; use Collectors).
func NewOutbox(reg prometheus.Registerer, cfg *OutboxConfig) (*Outbox, error) {
	var c OutboxConfig
	if cfg != nil {
		c = *cfg
	}
	if c.LagBuckets == nil {
		c.LagBuckets = DefaultOutboxLagBuckets
	}
	counter := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: c.ConstLabels})
	}
	gauge := func(name, help string) prometheus.Gauge {
		return prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: c.ConstLabels})
	}
	o := &Outbox{
		published:   counter("idem_outbox_published_total", "Outbox messages the broker confirmed (a republication after a crash counts again)."),
		failed:      counter("idem_outbox_failed_total", "Outbox publications that failed and are retried with backoff."),
		dead:        counter("idem_outbox_dead_lettered_total", "Outbox messages moved to the dead-letter table (refused for good by the broker)."),
		deleted:     counter("idem_outbox_deleted_total", "Published outbox messages deleted by the retention."),
		sourceErrs:  counter("idem_outbox_source_errors_total", "Calls of the relay to the outbox table that failed."),
		pending:     gauge("idem_outbox_pending", "Outbox messages not yet published."),
		oldest:      gauge("idem_outbox_oldest_pending_age_seconds", "Age of the oldest unpublished outbox message, 0 when none: the outbox's lag."),
		deadLetters: gauge("idem_outbox_dead_letters", "Messages in the outbox's dead-letter table."),
	}
	o.lag = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "idem_outbox_lag_seconds", ConstLabels: c.ConstLabels, Buckets: c.LagBuckets,
		Help: "Time from an outbox message's enqueue to the broker's confirmation."})
	o.batch = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "idem_outbox_batch_duration_seconds", ConstLabels: c.ConstLabels, Buckets: DefaultBuckets,
		Help: "Time the relay took for one leased batch: publish it and record the outcomes."})
	o.collectors = []prometheus.Collector{o.published, o.failed, o.dead, o.deleted, o.sourceErrs, o.lag, o.batch, o.pending, o.oldest, o.deadLetters}
	if reg != nil {
		for _, col := range o.collectors {
			if err := reg.Register(col); err != nil {
				return nil, fmt.Errorf("idemprom: outbox metrics: %w; make one idemprom.Outbox per registry (ConstLabels tell several outboxes apart)", err)
			}
		}
	}
	return o, nil
}

// Collectors returns the metrics, for a registry of your own.
func (o *Outbox) Collectors() []prometheus.Collector { return o.collectors }

// Published implements outbox.Observer.
func (o *Outbox) Published(_ *outbox.Stored, lag time.Duration) {
	o.published.Inc()
	o.lag.Observe(max(0, lag.Seconds()))
}

// Failed implements outbox.Observer.
func (o *Outbox) Failed(*outbox.Stored, error, time.Duration) { o.failed.Inc() }

// DeadLettered implements outbox.Observer.
func (o *Outbox) DeadLettered(*outbox.Stored, string) { o.dead.Inc() }

// Batch implements outbox.Observer.
func (o *Outbox) Batch(_ int, d time.Duration) { o.batch.Observe(d.Seconds()) }

// Stats implements outbox.Observer.
func (o *Outbox) Stats(s outbox.Stats) {
	o.pending.Set(float64(s.Pending))
	o.oldest.Set(s.OldestPending.Seconds())
	o.deadLetters.Set(float64(s.DeadLetters))
}

// SourceFailed implements outbox.Observer.
func (o *Outbox) SourceFailed(error) { o.sourceErrs.Inc() }

// Deleted implements outbox.Observer.
func (o *Outbox) Deleted(n int) { o.deleted.Add(float64(n)) }

var _ outbox.Observer = (*Outbox)(nil)
