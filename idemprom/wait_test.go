package idemprom_test

import (
	"context"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemprom"
	"github.com/idemkit/idem/internal/waittest"
	"github.com/idemkit/idem/memstore"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// TestWaitsAreCounted: a duplicate that waits for the holder's outcome and is
// replayed, and one whose wait times out, are counted by outcome in
// idem_waits_total and idem_wait_duration_seconds.
func TestWaitsAreCounted(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := idemprom.New(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	metrics := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(metrics.Close)
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	g := waittest.NewGated()
	long := waittest.Server(t, store, idem.Config{InFlightWait: 10 * time.Minute, Observer: m}, g)
	short := waittest.Server(t, store, idem.Config{InFlightWait: 50 * time.Millisecond, Observer: m}, g)
	defer g.Open()
	c := waittest.Client()
	ctx := context.Background()
	key := waittest.Key(t)
	first := make(chan waittest.Answer, 1)
	go func() { first <- waittest.Post(ctx, c, long.URL, key, nil) }()
	<-g.Entered
	if a := waittest.Post(ctx, c, short.URL, key, nil); a.Status != 409 {
		t.Fatalf("a duplicate with a 50ms wait: %d, want 409", a.Status)
	}
	waiter := make(chan waittest.Answer, 1)
	go func() { waiter <- waittest.Post(ctx, c, long.URL, key, nil) }()
	time.Sleep(200 * time.Millisecond) // most likely waiting by now; if not, it is replayed without a wait
	g.Open()
	w := <-waiter
	<-first
	fams := scrape(t, metrics.URL)
	if got := value(t, fams, "idem_waits_total", "outcome", "timed_out"); got != 1 {
		t.Errorf("idem_waits_total{outcome=timed_out} = %v, want 1", got)
	}
	if got := value(t, fams, "idem_wait_duration_seconds", "outcome", "timed_out"); got != 1 {
		t.Errorf("idem_wait_duration_seconds{outcome=timed_out} count = %v, want 1", got)
	}
	if !w.Replayed {
		t.Fatalf("the waiter: %d, want the replay", w.Status)
	}
	if got := value(t, fams, "idem_requests_total", "outcome", "replayed"); got != 1 {
		t.Errorf("idem_requests_total{outcome=replayed} = %v, want 1", got)
	}
	t.Logf("waits replayed: %v", fams["idem_waits_total"])
}
