package idemotel_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemotel"
	"github.com/idemkit/idem/memstore"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

type outage struct {
	idem.Store
	down atomic.Bool
}

func (s *outage) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	if s.down.Load() {
		return nil, false, errors.New("connection refused")
	}
	return s.Store.Claim(ctx, req)
}

type setup struct {
	spans  *tracetest.SpanRecorder
	reader *sdkmetric.ManualReader
	mem    *memstore.Store
	raw    *outage
	url    string
}

func start(t *testing.T, withMiddleware bool) *setup {
	t.Helper()
	s := &setup{spans: tracetest.NewSpanRecorder(), reader: sdkmetric.NewManualReader()}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(s.spans))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(s.reader))
	tel, err := idemotel.New(&idemotel.Config{TracerProvider: tp, MeterProvider: mp})
	if err != nil {
		t.Fatal(err)
	}
	s.mem = memstore.New(nil)
	t.Cleanup(func() { _ = s.mem.Close() })
	s.raw = &outage{Store: s.mem}
	mw, err := idem.New(tel.Store(s.raw), &idem.Config{Observer: tel, ScopeFunc: func(*http.Request) string { return "tenant-acme" }})
	if err != nil {
		t.Fatal(err)
	}
	var h http.Handler = mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) }))
	if withMiddleware {
		h = tel.Middleware(h)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	s.url = srv.URL
	return s
}

func (s *setup) post(t *testing.T, key, body string, want int) {
	t.Helper()
	req, _ := http.NewRequest("POST", s.url+"/orders", strings.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != want {
		t.Fatalf("POST %s: %d, want %d", key, resp.StatusCode, want)
	}
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

// TestSpans drives executed, replayed, a store outage and a takeover, with
// and without Middleware, and checks the spans the in-memory exporter got:
// one idem.request span per request with its outcome, the store operations as
// its children (with Middleware), Error status on the outage, the takeover as
// an event, and no raw key or scope anywhere.
func TestSpans(t *testing.T) {
	t.Parallel()
	for _, withMW := range []bool{true, false} {
		name := "middleware"
		if !withMW {
			name = "observer-only"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			s := start(t, withMW)
			s.post(t, "raw-key-1", "{}", 201)
			s.post(t, "raw-key-1", "{}", 201)
			s.raw.down.Store(true)
			s.post(t, "raw-key-2", "{}", 503)
			s.raw.down.Store(false)
			fp := idem.FingerprintV3(httptest.NewRequest("POST", "/orders", strings.NewReader("{}")), []byte("{}"))
			past := time.Now().Add(-time.Hour)
			if _, ok, err := s.mem.Claim(context.Background(), idem.ClaimRequest{Scope: "tenant-acme", Key: "raw-key-3", Fingerprint: fp, Token: "dead",
				Now: past, LeaseUntil: past.Add(time.Minute), ExpiresAt: past.Add(2 * time.Hour)}); err != nil || !ok {
				t.Fatalf("plant a crashed claim: %v %v", ok, err)
			}
			s.post(t, "raw-key-3", "{}", 201)

			ended := s.spans.Ended()
			var reqs []sdktrace.ReadOnlySpan
			children := map[string][]string{}
			for _, sp := range ended {
				for _, kv := range sp.Attributes() {
					if v := kv.Value.String(); strings.Contains(v, "raw-key") || strings.Contains(v, "tenant-acme") {
						t.Errorf("span %s attribute %s=%q carries a raw key or scope", sp.Name(), kv.Key, v)
					}
				}
				for _, ev := range sp.Events() {
					for _, kv := range ev.Attributes {
						if v := kv.Value.String(); strings.Contains(v, "raw-key") || strings.Contains(v, "tenant-acme") {
							t.Errorf("span %s event %s=%q carries a raw key or scope", sp.Name(), kv.Key, v)
						}
					}
				}
				if sp.Name() == "idem.request" {
					reqs = append(reqs, sp)
				} else {
					children[sp.Parent().SpanID().String()] = append(children[sp.Parent().SpanID().String()], sp.Name())
				}
			}
			if len(reqs) != 4 {
				t.Fatalf("%d idem.request spans, want 4", len(reqs))
			}
			wantOutcome := []string{"executed", "replayed", "store_error", "executed"}
			for i, sp := range reqs {
				a := attrs(sp)
				if a["idem.outcome"].AsString() != wantOutcome[i] {
					t.Errorf("span %d: outcome %q, want %q", i, a["idem.outcome"].AsString(), wantOutcome[i])
				}
				if a["idem.key_hash"].AsString() == "" || a["idem.scope_hash"].AsString() == "" {
					t.Errorf("span %d lacks the hashes: %v", i, a)
				}
				if withMW {
					kids := strings.Join(children[sp.SpanContext().SpanID().String()], ",")
					want := map[int]string{0: "idem.store.claim,idem.store.complete", 1: "idem.store.claim", 2: "idem.store.claim,idem.store.release", 3: "idem.store.claim,idem.store.complete"}[i]
					if kids != want {
						t.Errorf("span %d (%s): children %q, want %q", i, wantOutcome[i], kids, want)
					}
				}
			}
			if reqs[2].Status().Code != codes.Error || len(reqs[2].Events()) == 0 {
				t.Errorf("the outage's span: status %v, events %v; want Error with the error recorded", reqs[2].Status(), reqs[2].Events())
			}
			if reqs[0].Status().Code == codes.Error {
				t.Errorf("executed span has status Error")
			}
			if withMW {
				var evs []string
				for _, ev := range reqs[3].Events() {
					evs = append(evs, ev.Name)
				}
				if strings.Join(evs, ",") != "idem.taken_over,idem.claimed" {
					t.Errorf("takeover span events %v, want idem.taken_over, idem.claimed", evs)
				}
			}
		})
	}
}

// TestMetrics checks the OpenTelemetry metrics after a known sequence.
func TestMetrics(t *testing.T) {
	t.Parallel()
	s := start(t, true)
	s.post(t, "k1", "{}", 201)
	s.post(t, "k1", "{}", 201)
	s.post(t, "k1", "{other}", 422)
	s.raw.down.Store(true)
	s.post(t, "k2", "{}", 503)
	var rm metricdata.ResourceMetrics
	if err := s.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					label := ""
					for _, kv := range p.Attributes.ToSlice() {
						label += "{" + kv.Value.AsString() + "}"
					}
					got[m.Name+label] = p.Value
				}
			case metricdata.Histogram[float64]:
				for _, p := range d.DataPoints {
					label := ""
					for _, kv := range p.Attributes.ToSlice() {
						label += "{" + kv.Value.AsString() + "}"
					}
					got[m.Name+label] = int64(p.Count)
				}
			}
		}
	}
	want := map[string]int64{
		"idem.requests{executed}": 1, "idem.requests{replayed}": 1, "idem.requests{mismatch}": 1, "idem.requests{store_error}": 1,
		"idem.request.duration{executed}": 1, "idem.store.duration{claim}": 4, "idem.store.errors{claim}": 1,
		"idem.store.duration{complete}": 1, "idem.in_flight": 0,
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			t.Errorf("%s = %d, want %d (all: %v)", k, got[k], v, got)
		}
	}
}
