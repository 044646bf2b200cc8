package idemotel_test

import (
	"context"
	"errors"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemkit/idem/idemotel"
	"github.com/idemkit/idem/outbox"
)

// TestOutboxMetrics feeds the observer what a relay reports (the relay's
// calls of its Observer are tested in package outbox) and reads the
// instruments back.
func TestOutboxMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	o, err := idemotel.NewOutbox(mp)
	if err != nil {
		t.Fatal(err)
	}
	var r outbox.Observer = o
	s := &outbox.Stored{Message: outbox.Message{ID: "a"}}
	r.Published(s, 30*time.Millisecond)
	r.Published(s, 2*time.Second)
	r.Failed(s, errors.New("timeout"), time.Second)
	r.DeadLettered(s, "too large")
	r.Batch(3, 5*time.Millisecond)
	r.SourceFailed(errors.New("db down"))
	r.Deleted(7)
	r.Stats(outbox.Stats{Pending: 4, OldestPending: 1500 * time.Millisecond, DeadLetters: 1})
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				got[m.Name] = float64(d.DataPoints[0].Value)
			case metricdata.Gauge[int64]:
				got[m.Name] = float64(d.DataPoints[0].Value)
			case metricdata.Gauge[float64]:
				got[m.Name] = d.DataPoints[0].Value
			case metricdata.Histogram[float64]:
				got[m.Name] = float64(d.DataPoints[0].Count)
			}
		}
	}
	want := map[string]float64{
		"idem.outbox.published": 2, "idem.outbox.failed": 1, "idem.outbox.dead_lettered": 1, "idem.outbox.deleted": 7,
		"idem.outbox.source_errors": 1, "idem.outbox.lag": 2, "idem.outbox.batch.duration": 1,
		"idem.outbox.pending": 4, "idem.outbox.oldest_pending_age": 1.5, "idem.outbox.dead_letters": 1,
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
}
