// Package idemprom exports what idem does as Prometheus metrics. A Metrics is
// an idem.Observer (requests by outcome, the claims held), a store decorator
// (store operations by op) and a Janitor hook (expired records deleted):
//
//	m, err := idemprom.New(prometheus.DefaultRegisterer, nil)
//	store := m.Store(sqlStore)                   // times every store operation
//	protect, err := idem.New(store, &idem.Config{Observer: m})
//	janitor := &idem.Janitor{Store: store, OnSweep: m.OnSweep}
//	http.Handle("GET /metrics", promhttp.Handler())
//
// The metric names are a contract (dashboards and alerts are built on them):
//
//	idem_requests_total{outcome}                 counter: requests by outcome
//	idem_request_duration_seconds{outcome}       histogram: idem's time plus the handler's
//	idem_store_duration_seconds{op}              histogram: store operations
//	idem_store_errors_total{op}                  counter: failed store operations
//	idem_in_flight                               gauge: claims this process holds now
//	idem_janitor_deleted_total                   counter: expired records deleted
//	idem_janitor_errors_total                    counter: sweeps that failed
//	idem_janitor_last_sweep_timestamp_seconds    gauge: end of the last successful sweep
//	idem_waits_total{outcome}                    counter: waits for a holder's outcome (Config.InFlightWait)
//	idem_wait_duration_seconds{outcome}          histogram: time waited
//
// outcome is one of executed, replayed, in_flight, mismatch, rejected,
// store_error, lease_lost, released, taken_over (a takeover is counted, and the
// request that took over is counted again by how it ended); op is one of claim,
// complete, commit, release, extend, get, delete_expired, begin, insert. A
// wait's outcome is one of replayed, timed_out, hung_up, retried, full. No
// label ever carries a key, a scope or a path; a route label is added only when
// Config.Route is set, and its values are the caller's to keep few.
package idemprom

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemobs"
	"github.com/prometheus/client_golang/prometheus"
)

// DefaultBuckets are the request duration buckets, in seconds.
var DefaultBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}

// DefaultStoreBuckets are the store operation duration buckets, in seconds.
var DefaultStoreBuckets = []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5}

// Config configures the metrics. A nil *Config means all defaults.
type Config struct {
	// Buckets are the bounds of idem_request_duration_seconds. Defaults to
	// DefaultBuckets.
	Buckets []float64
	// StoreBuckets are the bounds of idem_store_duration_seconds. Defaults to
	// DefaultStoreBuckets.
	StoreBuckets []float64
	// Route, when set, adds a route label to idem_requests_total and
	// idem_request_duration_seconds, with the value it returns for the request's
	// context (WithRoute and RouteFrom put one there and read it). Return a route
	// pattern ("POST /orders"), never a path: every distinct value is a new
	// series. Defaults to nil: no route label.
	Route func(ctx context.Context) string
	// ConstLabels are added to every metric (for example the service's name).
	ConstLabels prometheus.Labels
}

// Metrics holds idem's Prometheus metrics. It is safe for concurrent use.
type Metrics struct {
	route func(ctx context.Context) string

	requests     *prometheus.CounterVec
	durations    *prometheus.HistogramVec
	byOutcome    [len(eventIndex)]prometheus.Counter
	durByOutcome [len(eventIndex)]prometheus.Observer

	storeDur  [idemobs.NumOps]prometheus.Observer
	storeErrs [idemobs.NumOps]prometheus.Counter

	inFlight      prometheus.Gauge
	waits         *prometheus.CounterVec
	waitDur       *prometheus.HistogramVec
	janDeleted    prometheus.Counter
	janErrors     prometheus.Counter
	janLastSweep  prometheus.Gauge
	collectorList []prometheus.Collector
}

// eventIndex maps an EventKind to its slot; it is sized for every kind.
var eventIndex [16]bool

func init() {
	for _, k := range idemobs.Outcomes {
		eventIndex[k] = true
	}
}

// New creates the metrics and registers them with reg (nil: not registered; use
// Collectors to register them yourself). It fails when reg already holds
// metrics with these names, for example when New is called twice for one
// registry: make one Metrics per process and share it between middlewares.
func New(reg prometheus.Registerer, cfg *Config) (*Metrics, error) {
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.Buckets == nil {
		c.Buckets = DefaultBuckets
	}
	if c.StoreBuckets == nil {
		c.StoreBuckets = DefaultStoreBuckets
	}
	labels := []string{"outcome"}
	if c.Route != nil {
		labels = append(labels, "route")
	}
	m := &Metrics{route: c.Route}
	m.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "idem_requests_total", ConstLabels: c.ConstLabels,
		Help: "Keyed requests by how idem answered them (outcome): executed, replayed, in_flight (409), mismatch (422), rejected (400/413), store_error, lease_lost, released, taken_over.",
	}, labels)
	m.durations = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "idem_request_duration_seconds", ConstLabels: c.ConstLabels, Buckets: c.Buckets,
		Help: "Time from a keyed request reaching idem to its outcome, handler included, by outcome.",
	}, labels)
	storeDur := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "idem_store_duration_seconds", ConstLabels: c.ConstLabels, Buckets: c.StoreBuckets,
		Help: "Duration of idem store operations, by op.",
	}, []string{"op"})
	storeErrs := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "idem_store_errors_total", ConstLabels: c.ConstLabels,
		Help: "Store operations that failed (not counting the protocol's answers: lock lost, not found, in flight), by op.",
	}, []string{"op"})
	m.inFlight = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "idem_in_flight", ConstLabels: c.ConstLabels,
		Help: "Keys this process holds right now (claimed, handler running or completing).",
	})
	m.janDeleted = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "idem_janitor_deleted_total", ConstLabels: c.ConstLabels,
		Help: "Expired idempotency records deleted by the janitor.",
	})
	m.janErrors = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "idem_janitor_errors_total", ConstLabels: c.ConstLabels,
		Help: "Janitor sweeps that failed.",
	})
	m.janLastSweep = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "idem_janitor_last_sweep_timestamp_seconds", ConstLabels: c.ConstLabels,
		Help: "Unix time at which the last successful janitor sweep ended.",
	})
	if c.Route == nil {
		for _, k := range idemobs.Outcomes {
			m.byOutcome[k] = m.requests.WithLabelValues(k.String())
			m.durByOutcome[k] = m.durations.WithLabelValues(k.String())
		}
	}
	for op := idemobs.Op(0); op < idemobs.NumOps; op++ {
		m.storeDur[op] = storeDur.WithLabelValues(op.String())
		m.storeErrs[op] = storeErrs.WithLabelValues(op.String())
	}
	m.waits = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "idem_waits_total", ConstLabels: c.ConstLabels,
		Help: "Waits for the outcome of a request holding the key (Config.InFlightWait), by how they ended (outcome): replayed, timed_out (409), hung_up, retried (the holder let go without an outcome), full (409 without waiting).",
	}, []string{"outcome"})
	m.waitDur = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "idem_wait_duration_seconds", ConstLabels: c.ConstLabels, Buckets: c.Buckets,
		Help: "Time a request waited for the outcome of the request holding its key, by how the wait ended.",
	}, []string{"outcome"})
	m.collectorList = []prometheus.Collector{m.requests, m.durations, storeDur, storeErrs, m.inFlight, m.janDeleted, m.janErrors, m.janLastSweep, m.waits, m.waitDur}
	if reg != nil {
		for _, col := range m.collectorList {
			if err := reg.Register(col); err != nil {
				return nil, fmt.Errorf("idemprom: %w; does the registry already hold idem's metrics? Create one idemprom.Metrics per registry and share it between middlewares", err)
			}
		}
	}
	return m, nil
}

// Collectors returns the metrics' collectors, to register them yourself.
func (m *Metrics) Collectors() []prometheus.Collector { return m.collectorList }

// ObservesClaims returns true: the metrics keep idem_in_flight from
// EventClaimed.
func (m *Metrics) ObservesClaims() bool { return true }

// Observe counts e. It implements idem.Observer.
func (m *Metrics) Observe(ctx context.Context, e idem.Event) {
	if e.Kind == idem.EventClaimed {
		m.inFlight.Inc()
		return
	}
	if e.Claimed {
		m.inFlight.Dec()
	}
	if e.Kind == idem.EventWaited {
		outcome := e.Wait.String()
		m.waits.WithLabelValues(outcome).Inc()
		m.waitDur.WithLabelValues(outcome).Observe(e.Waited.Seconds())
		return
	}
	if int(e.Kind) >= len(eventIndex) || !eventIndex[e.Kind] {
		return
	}
	secs := e.Took.Seconds()
	if m.route == nil {
		m.byOutcome[e.Kind].Inc()
		m.durByOutcome[e.Kind].Observe(secs)
		return
	}
	outcome, route := e.Kind.String(), m.route(ctx)
	if !utf8.ValidString(route) {
		// A label value must be UTF-8 (WithLabelValues panics otherwise, in the
		// request): keep the route, with its invalid bytes replaced.
		route = strings.ToValidUTF8(route, "\uFFFD")
	}
	m.requests.WithLabelValues(outcome, route).Inc()
	m.durations.WithLabelValues(outcome, route).Observe(secs)
}

// Store returns s with every operation timed into idem_store_duration_seconds
// and its failures counted in idem_store_errors_total. The result implements
// the same optional interfaces as s (see idemobs.Store).
func (m *Metrics) Store(s idem.Store) idem.Store { return idemobs.Store(s, m) }

// StoreStart implements idemobs.StoreObserver; it returns ctx.
func (m *Metrics) StoreStart(ctx context.Context, _ idemobs.Op) context.Context { return ctx }

// StoreDone implements idemobs.StoreObserver.
func (m *Metrics) StoreDone(_ context.Context, op idemobs.Op, took time.Duration, err error) {
	if op >= idemobs.NumOps {
		return
	}
	m.storeDur[op].Observe(took.Seconds())
	if idemobs.Failed(err) {
		m.storeErrs[op].Inc()
	}
}

// OnSweep records a janitor sweep; set it as idem.Janitor.OnSweep.
func (m *Metrics) OnSweep(deleted int, err error) {
	m.janDeleted.Add(float64(deleted))
	if err != nil {
		m.janErrors.Inc()
		return
	}
	m.janLastSweep.SetToCurrentTime()
}

type routeKey struct{}

// WithRoute returns next with route put in each request's context, for
// Config.Route = RouteFrom. Wrap each route's idem middleware with its pattern:
//
//	mux.Handle("POST /orders", idemprom.WithRoute("POST /orders", protect(orders)))
func WithRoute(route string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		next.ServeHTTP(w, r.WithContext(ContextWithRoute(r.Context(), route)))
	})
}

// ContextWithRoute returns ctx carrying route, for Config.Route = RouteFrom:
// the counterpart of WithRoute where there is no http.Handler to wrap. With
// idemgrpc, an interceptor in front of the idem interceptor names each call's
// route by its method:
//
//	route := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
//		return h(idemprom.ContextWithRoute(ctx, info.FullMethod), req)
//	}
func ContextWithRoute(ctx context.Context, route string) context.Context {
	return context.WithValue(ctx, routeKey{}, route)
}

// RouteFrom returns the route WithRoute put in ctx, or "" when none.
func RouteFrom(ctx context.Context) string {
	s, _ := ctx.Value(routeKey{}).(string)
	return s
}
