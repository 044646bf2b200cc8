package idemotel_test

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemobs"
	"github.com/idemkit/idem/idemotel"
	"github.com/idemkit/idem/idemprom"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// drive reports one of every outcome, every store operation and a sweep.
func drive(o interface {
	idem.Observer
	idemobs.StoreObserver
	OnSweep(int, error)
}) {
	ctx := context.Background()
	o.Observe(ctx, idem.Event{Kind: idem.EventClaimed})
	for _, k := range idemobs.Outcomes {
		o.Observe(ctx, idem.Event{Kind: k, Took: 20 * time.Millisecond, Claimed: k == idem.EventExecuted})
	}
	for w := idem.WaitReplayed; w <= idem.WaitFull; w++ {
		o.Observe(ctx, idem.Event{Kind: idem.EventWaited, Wait: w, Waited: 300 * time.Millisecond})
	}
	for op := idemobs.Op(0); op < idemobs.NumOps; op++ {
		o.StoreDone(o.StoreStart(ctx, op), op, time.Millisecond, fmt.Errorf("down"))
	}
	o.OnSweep(3, nil)
	o.OnSweep(0, fmt.Errorf("down"))
}

// families returns, per exported family, its type and sorted label names
// (without the exporter's otel_scope_* labels), and its bucket bounds.
func families(t *testing.T, reg *prometheus.Registry) (map[string]string, map[string][]float64) {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	shape, bounds := map[string]string{}, map[string][]float64{}
	for _, f := range fams {
		if f.GetName() == "target_info" {
			continue
		}
		labels := map[string]bool{}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if !strings.HasPrefix(l.GetName(), "otel_scope_") {
					labels[l.GetName()] = true
				}
			}
			if h := m.GetHistogram(); h != nil && bounds[f.GetName()] == nil {
				for _, b := range h.GetBucket() {
					bounds[f.GetName()] = append(bounds[f.GetName()], b.GetUpperBound())
				}
			}
		}
		names := make([]string, 0, len(labels))
		for l := range labels {
			names = append(names, l)
		}
		sort.Strings(names)
		shape[f.GetName()] = f.GetType().String() + fmt.Sprint(names)
	}
	return shape, bounds
}

// drivenRegistries drives idemprom and idemotel (through the OpenTelemetry
// Prometheus exporter) with the same events (drive) and returns the registry
// each exports to.
func drivenRegistries(t *testing.T) (promReg, otelReg *prometheus.Registry) {
	t.Helper()
	promReg = prometheus.NewRegistry()
	m, err := idemprom.New(promReg, nil)
	if err != nil {
		t.Fatal(err)
	}
	drive(m)
	otelReg = prometheus.NewRegistry()
	exp, err := otelprom.New(otelprom.WithRegisterer(otelReg), otelprom.WithoutScopeInfo(), otelprom.WithoutTargetInfo())
	if err != nil {
		t.Fatal(err)
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	tel, err := idemotel.New(&idemotel.Config{MeterProvider: mp})
	if err != nil {
		t.Fatal(err)
	}
	drive(tel)
	return promReg, otelReg
}

// TestPrometheusNamesMatchIdemprom: idemotel's metrics, exported to Prometheus
// by the OpenTelemetry Prometheus exporter, have idemprom's names, types,
// labels and bucket bounds, so deploy's rules and dashboard (built on
// idemprom) match them. Before, the gauge came out as
// idem_janitor_last_sweep_seconds and the labels as idem_outcome and
// idem_store_op.
func TestPrometheusNamesMatchIdemprom(t *testing.T) {
	t.Parallel()
	promReg, otelReg := drivenRegistries(t)

	want, wantBounds := families(t, promReg)
	got, gotBounds := families(t, otelReg)
	for name, shape := range want {
		if got[name] != shape {
			t.Errorf("%s: idemprom exports %s, idemotel through the Prometheus exporter %q", name, shape, got[name])
		}
	}
	for name := range got {
		if _, ok := want[name]; !ok {
			t.Errorf("idemotel exports %s (%s), which idemprom does not", name, got[name])
		}
	}
	for name, b := range wantBounds {
		// The exporter adds the +Inf bucket; client_golang leaves it implicit.
		g := slices.DeleteFunc(slices.Clone(gotBounds[name]), func(v float64) bool { return v > 1e300 })
		if !slices.Equal(g, b) {
			t.Errorf("%s: bucket bounds %v through OpenTelemetry, %v in idemprom", name, g, b)
		}
	}
}

// TestDurationBucketsAreSeconds: two request durations an order of magnitude
// apart (20 ms and 300 ms) land in different buckets; with the SDK's default
// boundaries (0, 5, 10, … made for milliseconds) both fell in the first.
func TestDurationBucketsAreSeconds(t *testing.T) {
	t.Parallel()
	promReg := prometheus.NewRegistry()
	exp, err := otelprom.New(otelprom.WithRegisterer(promReg), otelprom.WithoutScopeInfo(), otelprom.WithoutTargetInfo())
	if err != nil {
		t.Fatal(err)
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	tel, err := idemotel.New(&idemotel.Config{MeterProvider: mp})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []time.Duration{20 * time.Millisecond, 300 * time.Millisecond} {
		tel.Observe(context.Background(), idem.Event{Kind: idem.EventExecuted, Took: d})
		tel.StoreDone(tel.StoreStart(context.Background(), idemobs.OpClaim), idemobs.OpClaim, d/100, nil)
	}
	fams, err := promReg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, f := range fams {
		if f.GetType() != dto.MetricType_HISTOGRAM {
			continue
		}
		for _, m := range f.GetMetric() {
			var prev uint64
			var steps int
			for _, b := range m.GetHistogram().GetBucket() {
				if b.GetCumulativeCount() != prev {
					steps++
				}
				prev = b.GetCumulativeCount()
			}
			if steps != 2 {
				t.Errorf("%s: the two durations fill %d distinct buckets; want 2 (second-scale boundaries)", f.GetName(), steps)
			}
			checked++
		}
	}
	if checked != 2 {
		t.Fatalf("checked %d histograms; want 2 (request and store durations)", checked)
	}
}

// TestWaitIsNoRequestSpan: a wait (EventWaited, which comes before the
// request's own event) is counted in idem.waits and is an event on the span in
// the context; without Middleware it is never an "idem.request" span of its
// own (each waiting request recorded two).
func TestWaitIsNoRequestSpan(t *testing.T) {
	t.Parallel()
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	reader := sdkmetric.NewManualReader()
	tel, err := idemotel.New(&idemotel.Config{TracerProvider: tp, MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, parent := tp.Tracer("test").Start(context.Background(), "server")
	tel.Observe(ctx, idem.Event{Kind: idem.EventWaited, Wait: idem.WaitReplayed, Waited: 200 * time.Millisecond, Key: "k"})
	tel.Observe(ctx, idem.Event{Kind: idem.EventReplayed, Key: "k", Status: 201})
	parent.End()
	requests, waited := 0, false
	for _, s := range spans.Ended() {
		if s.Name() == "idem.request" {
			requests++
		}
		if s.Name() == "server" {
			for _, ev := range s.Events() {
				waited = waited || ev.Name == "idem.waited"
			}
		}
	}
	if requests != 1 || !waited {
		t.Errorf("%d idem.request spans (want 1), idem.waited event on the server span: %v", requests, waited)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	found := false
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "idem.waits" {
				for _, dp := range sum.DataPoints {
					if v, _ := dp.Attributes.Value("outcome"); v.AsString() == "replayed" && dp.Value == 1 {
						found = true
					}
				}
			}
		}
	}
	if !found {
		t.Error("idem.waits{outcome=replayed} is not 1")
	}
}
