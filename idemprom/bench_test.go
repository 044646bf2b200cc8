package idemprom_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemobs"
	"github.com/idemkit/idem/idemprom"
	"github.com/idemkit/idem/memstore"
	"github.com/prometheus/client_golang/prometheus"
)

// BenchmarkObserverPerRequest is what the metrics cost one executed request in
// the claim-then-complete flow: EventClaimed, EventExecuted, and the claim and
// completion timed.
func BenchmarkObserverPerRequest(b *testing.B) {
	m, err := idemprom.New(prometheus.NewRegistry(), nil)
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		m.Observe(ctx, idem.Event{Kind: idem.EventClaimed})
		for _, op := range []idemobs.Op{idemobs.OpClaim, idemobs.OpComplete} {
			c := m.StoreStart(ctx, op)
			m.StoreDone(c, op, 200*time.Microsecond, nil)
		}
		m.Observe(ctx, idem.Event{Kind: idem.EventExecuted, Status: 201, Took: time.Millisecond, Claimed: true})
	}
}

// BenchmarkMiddleware runs executed requests through the middleware over
// memstore without an Observer and with the Prometheus metrics (observer and
// store decorator); the difference is the metrics' per-request cost.
func BenchmarkMiddleware(b *testing.B) {
	for _, withMetrics := range []bool{false, true} {
		name := "none"
		if withMetrics {
			name = "prometheus"
		}
		b.Run(name, func(b *testing.B) {
			mem := memstore.New(nil)
			defer mem.Close()
			var store idem.Store = mem
			cfg := &idem.Config{}
			if withMetrics {
				m, err := idemprom.New(prometheus.NewRegistry(), nil)
				if err != nil {
					b.Fatal(err)
				}
				store, cfg.Observer = m.Store(mem), m
			}
			mw, err := idem.New(store, cfg)
			if err != nil {
				b.Fatal(err)
			}
			h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }))
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				r := httptest.NewRequest("POST", "/orders", strings.NewReader(`{"cart_id":"c_42"}`))
				r.Header.Set("Idempotency-Key", name+strconv.Itoa(i))
				h.ServeHTTP(httptest.NewRecorder(), r)
			}
		})
	}
}
