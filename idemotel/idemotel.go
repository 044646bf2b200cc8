// Package idemotel reports what idem does through OpenTelemetry: a span per
// keyed request with its outcome, a child span per store operation, and the
// same metrics as idemprom through the OpenTelemetry metrics API.
//
//	tel, err := idemotel.New(nil)                // the global providers
//	store := tel.Store(sqlStore)                 // a child span and a timing per store operation
//	protect, err := idem.New(store, &idem.Config{Observer: tel})
//	http.Handle("POST /orders", tel.Middleware(protect(orders)))
//	janitor := &idem.Janitor{Store: store, OnSweep: tel.OnSweep}
//
// Middleware opens the "idem.request" span before idem runs, so that the store
// operations' spans ("idem.store.claim", …) and the handler's own spans are its
// children; the Observer then sets its attributes. Without Middleware the
// Observer records an "idem.request" span of its own when the request ends,
// timed from when it reached idem, as a child of the span in the request's
// context (an otelhttp server span, for example).
//
// Span attributes: idem.outcome (executed, replayed, in_flight, mismatch,
// rejected, store_error, lease_lost, released), idem.key_hash
// (idemobs.KeyHash of the scope and key) and idem.scope_hash (idemobs.Hash:
// never the raw key or scope),
// http.response.status_code; the events idem.claimed and idem.taken_over. A
// store_error or lease_lost outcome, and a failed store operation, set the
// span's status to Error.
//
// With idemgrpc the Observer (without Middleware) records the span as a child
// of the gRPC server span in the call's context (otelgrpc's, which carries
// rpc.grpc.status_code); its http.response.status_code is then the HTTP
// status idemgrpc stores the call's outcome under (idemgrpc.HTTPStatus), not
// what the client heard: read the gRPC code from the parent span.
//
// Metrics: idem.requests {outcome}, idem.request.duration (s) {outcome},
// idem.store.duration (s) {op}, idem.store.errors {op}, idem.in_flight,
// idem.janitor.deleted, idem.janitor.errors, idem.janitor.last_sweep_timestamp
// (Unix seconds), idem.waits {outcome} and idem.wait.duration (s) {outcome}
// (Config.InFlightWait: replayed, timed_out, hung_up, retried, full; a wait is
// also an idem.waited event on the request's span). The durations have
// explicit second-scale bucket boundaries (RequestBuckets, StoreBuckets:
// idemprom's). Exported to Prometheus (the
// OpenTelemetry Prometheus exporter, or a collector's prometheus exporter)
// they take the idemprom names and labels — idem_requests_total{outcome},
// idem_request_duration_seconds, idem_store_duration_seconds{op},
// idem_store_errors_total, idem_in_flight, idem_janitor_deleted_total,
// idem_janitor_errors_total, idem_janitor_last_sweep_timestamp_seconds,
// idem_waits_total{outcome}, idem_wait_duration_seconds — so
// deploy's rules and dashboard work for both; a test pins the mapping.
package idemotel

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemobs"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of idem's tracer and meter.
const ScopeName = "github.com/idemkit/idem/idemotel"

// RequestBuckets are the bucket boundaries of idem.request.duration, in
// seconds (idemprom.DefaultBuckets). The SDK's default boundaries are made for
// milliseconds (0, 5, 10, …): every request under 5 s would share a bucket.
var RequestBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}

// StoreBuckets are the bucket boundaries of idem.store.duration, in seconds
// (idemprom.DefaultStoreBuckets).
var StoreBuckets = []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5}

// Config configures the telemetry. A nil *Config means all defaults.
type Config struct {
	// TracerProvider makes the tracer. Defaults to otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
	// MeterProvider makes the meter. Defaults to otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
	// Methods are the request methods Middleware opens a span for; others pass
	// straight through. Defaults to idem.DefaultMethods: set it to the idem
	// middleware's Config.Methods.
	Methods []string
}

// Telemetry reports idem's events, store operations and janitor sweeps. It is
// an idem.ClaimObserver and an idemobs.StoreObserver, safe for concurrent use.
type Telemetry struct {
	tracer  trace.Tracer
	methods map[string]bool

	requests  metric.Int64Counter
	durations metric.Float64Histogram
	outcome   [16]metric.MeasurementOption
	storeDur  metric.Float64Histogram
	storeErrs metric.Int64Counter
	opAttrs   [idemobs.NumOps]metric.MeasurementOption
	inFlight  metric.Int64UpDownCounter
	janDel    metric.Int64Counter
	janErrs   metric.Int64Counter
	janLast   metric.Float64Gauge
	waits     metric.Int64Counter
	waitDur   metric.Float64Histogram
	waitAttrs [idem.WaitFull + 1]metric.MeasurementOption
}

// New creates the tracer and the instruments.
func New(cfg *Config) (*Telemetry, error) {
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.TracerProvider == nil {
		c.TracerProvider = otel.GetTracerProvider()
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if len(c.Methods) == 0 {
		c.Methods = idem.DefaultMethods
	}
	t := &Telemetry{tracer: c.TracerProvider.Tracer(ScopeName), methods: map[string]bool{}}
	for _, m := range c.Methods {
		t.methods[strings.ToUpper(m)] = true
	}
	meter := c.MeterProvider.Meter(ScopeName)
	var err error
	must := func(e error) {
		if err == nil {
			err = e
		}
	}
	t.requests, err = meter.Int64Counter("idem.requests", metric.WithDescription("Keyed requests by how idem answered them."), metric.WithUnit("{request}"))
	var e error
	t.durations, e = meter.Float64Histogram("idem.request.duration", metric.WithDescription("Time from a keyed request reaching idem to its outcome, handler included."), metric.WithUnit("s"), metric.WithExplicitBucketBoundaries(RequestBuckets...))
	must(e)
	t.storeDur, e = meter.Float64Histogram("idem.store.duration", metric.WithDescription("Duration of idem store operations."), metric.WithUnit("s"), metric.WithExplicitBucketBoundaries(StoreBuckets...))
	must(e)
	t.storeErrs, e = meter.Int64Counter("idem.store.errors", metric.WithDescription("Store operations that failed."), metric.WithUnit("{error}"))
	must(e)
	t.inFlight, e = meter.Int64UpDownCounter("idem.in_flight", metric.WithDescription("Keys this process holds right now."), metric.WithUnit("{claim}"))
	must(e)
	t.janDel, e = meter.Int64Counter("idem.janitor.deleted", metric.WithDescription("Expired idempotency records deleted by the janitor."), metric.WithUnit("{record}"))
	must(e)
	t.janErrs, e = meter.Int64Counter("idem.janitor.errors", metric.WithDescription("Janitor sweeps that failed."), metric.WithUnit("{sweep}"))
	must(e)
	t.janLast, e = meter.Float64Gauge("idem.janitor.last_sweep_timestamp", metric.WithDescription("Unix time at which the last successful janitor sweep ended."), metric.WithUnit("s"))
	must(e)
	t.waits, e = meter.Int64Counter("idem.waits", metric.WithDescription("Waits for the outcome of a request holding the key (Config.InFlightWait), by how they ended."), metric.WithUnit("{wait}"))
	must(e)
	t.waitDur, e = meter.Float64Histogram("idem.wait.duration", metric.WithDescription("Time a request waited for the outcome of the request holding its key, by how the wait ended."), metric.WithUnit("s"), metric.WithExplicitBucketBoundaries(RequestBuckets...))
	must(e)
	if err != nil {
		return nil, err
	}
	for _, k := range idemobs.Outcomes {
		t.outcome[k] = metric.WithAttributeSet(attribute.NewSet(attribute.String("outcome", k.String())))
	}
	for op := idemobs.Op(0); op < idemobs.NumOps; op++ {
		t.opAttrs[op] = metric.WithAttributeSet(attribute.NewSet(attribute.String("op", op.String())))
	}
	for w := idem.WaitReplayed; w <= idem.WaitFull; w++ {
		t.waitAttrs[w] = metric.WithAttributeSet(attribute.NewSet(attribute.String("outcome", w.String())))
	}
	return t, nil
}

type spanKey struct{}

// Middleware returns next with an "idem.request" span around each request
// whose method is keyed: wrap the handler idem protects, outside idem's
// middleware (tel.Middleware(protect(h))).
func (t *Telemetry) Middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !t.methods[r.Method] && !t.methods[strings.ToUpper(r.Method)] {
			next.ServeHTTP(w, r)
			return
		}
		ctx, span := t.tracer.Start(r.Context(), "idem.request", trace.WithSpanKind(trace.SpanKindInternal))
		defer span.End()
		ctx = context.WithValue(ctx, spanKey{}, span)
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// ObservesClaims returns true: EventClaimed keeps idem.in_flight and becomes
// a span event.
func (t *Telemetry) ObservesClaims() bool { return true }

// Observe records e on the request's span and in the metrics. It implements
// idem.Observer.
func (t *Telemetry) Observe(ctx context.Context, e idem.Event) {
	own, _ := ctx.Value(spanKey{}).(trace.Span)
	switch e.Kind {
	case idem.EventClaimed:
		t.inFlight.Add(ctx, 1)
		if own != nil {
			own.AddEvent("idem.claimed")
		}
		return
	case idem.EventTakenOver:
		t.count(ctx, e)
		span := own
		if span == nil {
			span = trace.SpanFromContext(ctx)
		}
		span.AddEvent("idem.taken_over")
		return
	case idem.EventWaited:
		// A wait is not how the request ended (its own event follows): counted
		// apart, and an event on the request's span, never a span of its own.
		if e.Wait >= idem.WaitReplayed && e.Wait <= idem.WaitFull {
			t.waits.Add(ctx, 1, t.waitAttrs[e.Wait])
			t.waitDur.Record(ctx, e.Waited.Seconds(), t.waitAttrs[e.Wait])
		}
		span := own
		if span == nil {
			span = trace.SpanFromContext(ctx)
		}
		span.AddEvent("idem.waited", trace.WithAttributes(attribute.String("idem.wait", e.Wait.String()), attribute.Float64("idem.waited_seconds", e.Waited.Seconds())))
		return
	}
	if e.Claimed {
		t.inFlight.Add(ctx, -1)
	}
	t.count(ctx, e)
	span := own
	if span == nil {
		// No Middleware: a span of its own, from when the request reached idem.
		now := time.Now()
		_, span = t.tracer.Start(ctx, "idem.request", trace.WithTimestamp(now.Add(-e.Took)), trace.WithSpanKind(trace.SpanKindInternal))
		defer span.End(trace.WithTimestamp(now))
	}
	if !span.IsRecording() {
		return
	}
	attrs := make([]attribute.KeyValue, 0, 4)
	attrs = append(attrs, attribute.String("idem.outcome", e.Kind.String()))
	if e.Key != "" {
		attrs = append(attrs, attribute.String("idem.key_hash", idemobs.KeyHash(e.Scope, e.Key)))
	}
	if e.Scope != "" {
		attrs = append(attrs, attribute.String("idem.scope_hash", idemobs.Hash(e.Scope)))
	}
	if e.Status != 0 {
		attrs = append(attrs, attribute.Int("http.response.status_code", e.Status))
	}
	span.SetAttributes(attrs...)
	if e.Kind == idem.EventStoreError || e.Kind == idem.EventLeaseLost {
		if e.Err != nil {
			span.RecordError(redacted{e.Err, e.Key, e.Scope})
		}
		span.SetStatus(codes.Error, e.Kind.String())
	}
}

func (t *Telemetry) count(ctx context.Context, e idem.Event) {
	if int(e.Kind) >= len(t.outcome) || t.outcome[e.Kind] == nil {
		return
	}
	t.requests.Add(ctx, 1, t.outcome[e.Kind])
	t.durations.Record(ctx, e.Took.Seconds(), t.outcome[e.Kind])
}

// Store returns s with a child span and a timing per operation. The result
// implements the same optional interfaces as s (see idemobs.Store).
func (t *Telemetry) Store(s idem.Store) idem.Store { return idemobs.Store(s, t) }

// StoreStart starts the operation's span. It implements idemobs.StoreObserver.
func (t *Telemetry) StoreStart(ctx context.Context, op idemobs.Op) context.Context {
	ctx, _ = t.tracer.Start(ctx, "idem.store."+op.String(), trace.WithSpanKind(trace.SpanKindClient))
	return ctx
}

// StoreDone ends the operation's span and records its duration. It implements
// idemobs.StoreObserver.
func (t *Telemetry) StoreDone(ctx context.Context, op idemobs.Op, took time.Duration, err error) {
	span := trace.SpanFromContext(ctx)
	if op < idemobs.NumOps {
		t.storeDur.Record(ctx, took.Seconds(), t.opAttrs[op])
	}
	switch {
	case idemobs.Failed(err):
		if op < idemobs.NumOps {
			t.storeErrs.Add(ctx, 1, t.opAttrs[op])
		}
		// Not the message: a database may quote the key in it.
		span.SetAttributes(attribute.String("error.type", errorType(err)))
		span.SetStatus(codes.Error, "store operation failed")
	case err != nil: // an answer of the protocol, not a failure
		span.SetAttributes(attribute.String("idem.store.result", protocolAnswer(err)))
	}
	span.End()
}

// errorType names the innermost error's type.
func errorType(err error) string {
	for {
		u := errors.Unwrap(err)
		if u == nil {
			return fmt.Sprintf("%T", err)
		}
		err = u
	}
}

// protocolAnswer names an error the protocol expects.
func protocolAnswer(err error) string {
	switch {
	case errors.Is(err, idem.ErrLockLost):
		return "lock_lost"
	case errors.Is(err, idem.ErrNotFound):
		return "not_found"
	case errors.Is(err, idem.ErrInFlight):
		return "in_flight"
	case errors.Is(err, idem.ErrTxAborted):
		return "tx_aborted"
	}
	return "other"
}

// redacted is an error whose message has the key and scope replaced by their
// hashes.
type redacted struct {
	err        error
	key, scope string
}

func (r redacted) Error() string { return idemobs.Redact(r.err.Error(), r.key, r.scope) }

func (r redacted) Unwrap() error { return r.err }

// OnSweep records a janitor sweep; set it as idem.Janitor.OnSweep.
func (t *Telemetry) OnSweep(deleted int, err error) {
	ctx := context.Background()
	t.janDel.Add(ctx, int64(deleted))
	if err != nil {
		t.janErrs.Add(ctx, 1)
		return
	}
	t.janLast.Record(ctx, float64(time.Now().UnixNano())/1e9)
}
