package idemprom_test

import (
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/idemkit/idem/idemprom"
	"github.com/idemkit/idem/outbox"
)

// TestOutboxMetrics feeds the observer what a relay reports (the relay's
// calls of its Observer are tested in package outbox) and reads the metrics
// back from the registry.
func TestOutboxMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := idemprom.NewOutbox(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	var r outbox.Observer = m
	s := &outbox.Stored{Message: outbox.Message{ID: "a"}}
	r.Published(s, 30*time.Millisecond)
	r.Published(s, 2*time.Second)
	r.Failed(s, errors.New("timeout"), time.Second)
	r.Failed(s, errors.New("timeout"), time.Second)
	r.DeadLettered(s, "too large")
	r.Batch(3, 5*time.Millisecond)
	r.Batch(1, 5*time.Millisecond)
	r.SourceFailed(errors.New("db down"))
	r.Deleted(7)
	r.Stats(outbox.Stats{Pending: 1, OldestPending: 1500 * time.Millisecond, DeadLetters: 1})
	val := func(name string) float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == name {
				mm := mf.GetMetric()[0]
				switch mf.GetType() {
				case dto.MetricType_COUNTER:
					return mm.GetCounter().GetValue()
				case dto.MetricType_GAUGE:
					return mm.GetGauge().GetValue()
				case dto.MetricType_HISTOGRAM:
					return float64(mm.GetHistogram().GetSampleCount())
				}
			}
		}
		t.Fatalf("no metric %s", name)
		return 0
	}
	if v := val("idem_outbox_published_total"); v != 2 {
		t.Errorf("published %v, want 2", v)
	}
	if v := val("idem_outbox_lag_seconds"); v != 2 {
		t.Errorf("lag samples %v, want 2", v)
	}
	if v := val("idem_outbox_failed_total"); v != 2 {
		t.Errorf("failed %v, want 2", v)
	}
	if v := val("idem_outbox_deleted_total"); v != 7 {
		t.Errorf("deleted %v, want 7", v)
	}
	if v := val("idem_outbox_source_errors_total"); v != 1 {
		t.Errorf("source errors %v, want 1", v)
	}
	if v := val("idem_outbox_dead_lettered_total"); v != 1 {
		t.Errorf("dead-lettered %v, want 1", v)
	}
	if v := val("idem_outbox_pending"); v != 1 {
		t.Errorf("pending gauge %v, want 1 (down)", v)
	}
	if v := val("idem_outbox_oldest_pending_age_seconds"); v != 1.5 {
		t.Errorf("oldest pending age %v", v)
	}
	if v := val("idem_outbox_dead_letters"); v != 1 {
		t.Errorf("dead letters gauge %v, want 1", v)
	}
	if v := val("idem_outbox_batch_duration_seconds"); v != 2 {
		t.Errorf("batches %v", v)
	}
	if _, err := idemprom.NewOutbox(reg, nil); err == nil {
		t.Error("a second NewOutbox on one registry did not fail")
	}
}
