package idemprom_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemprom"
	"github.com/idemkit/idem/memstore"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// outageStore fails every Claim while down is set, as an unreachable database
// would.
type outageStore struct {
	idem.Store
	down atomic.Bool
}

func (s *outageStore) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	if s.down.Load() {
		return nil, false, errors.New("dial tcp 127.0.0.1:5432: connect: connection refused")
	}
	return s.Store.Claim(ctx, req)
}

// scrape fetches url and parses it with the Prometheus text parser.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(string(body)))
	if err != nil {
		t.Fatalf("parse /metrics: %v\n%s", err, body)
	}
	return fams
}

// value returns the value of the series of fam whose labels include want
// (counter, gauge, or a histogram's count).
func value(t *testing.T, fams map[string]*dto.MetricFamily, fam string, want ...string) float64 {
	t.Helper()
	f := fams[fam]
	if f == nil {
		t.Fatalf("no metric %s in the scrape", fam)
	}
	for _, m := range f.Metric {
		match := true
		for i := 0; i+1 < len(want); i += 2 {
			found := false
			for _, l := range m.Label {
				if l.GetName() == want[i] && l.GetValue() == want[i+1] {
					found = true
				}
			}
			match = match && found
		}
		if !match {
			continue
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount())
		}
	}
	t.Fatalf("no series %s%v in the scrape", fam, want)
	return 0
}

// TestMetricsOverRealSockets drives a known sequence through the middleware
// on a loopback server — executed, replayed, 409, 422, 400, a store outage
// (503), a takeover after a lapsed lease — scrapes /metrics from another
// loopback server, parses it with the Prometheus text parser and checks every
// counter's exact value, the in-flight gauge while a handler runs and after,
// and that no label carries a key or a path.
func TestMetricsOverRealSockets(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := idemprom.New(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	mem := memstore.New(nil)
	t.Cleanup(func() { _ = mem.Close() })
	raw := &outageStore{Store: mem}
	mw, err := idem.New(m.Store(raw), &idem.Config{Observer: m})
	if err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan struct{}), make(chan struct{})
	app := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow-orders" {
			close(entered)
			<-release
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":1}`)
	})))
	t.Cleanup(app.Close)
	metrics := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(metrics.Close)

	post := func(path, key, body string) *http.Response {
		t.Helper()
		req, _ := http.NewRequest("POST", app.URL+path, strings.NewReader(body))
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	expect := func(name string, resp *http.Response, status int) {
		t.Helper()
		if resp.StatusCode != status {
			t.Fatalf("%s: status %d, want %d", name, resp.StatusCode, status)
		}
	}
	const keyA, keyB, keyC = "secret-key-aaaa", "secret-key-bbbb", "secret-key-cccc"

	expect("executed", post("/orders", keyA, `{"n":1}`), 201)
	resp := post("/orders", keyA, `{"n":1}`)
	expect("replayed", resp, 201)
	if resp.Header.Get(idem.ReplayedHeader) != "true" {
		t.Fatal("the retry was not replayed")
	}
	expect("mismatch", post("/orders", keyA, `{"n":2}`), 422)
	expect("rejected", post("/orders", "", `{"n":1}`), 400)

	// A handler holds keyB: a retry gets 409, and the gauge shows the claim.
	slow := make(chan *http.Response, 1)
	go func() {
		req, _ := http.NewRequest("POST", app.URL+"/slow-orders", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", keyB)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Error(err)
			slow <- nil
			return
		}
		resp.Body.Close()
		slow <- resp
	}()
	<-entered
	expect("in flight", post("/slow-orders", keyB, `{}`), 409)
	if got := value(t, scrape(t, metrics.URL), "idem_in_flight"); got != 1 {
		t.Errorf("idem_in_flight while a handler runs = %v, want 1", got)
	}
	close(release)
	if r := <-slow; r == nil || r.StatusCode != 201 {
		t.Fatalf("the held request: %v, want 201", r)
	}

	raw.down.Store(true)
	expect("store outage", post("/orders", keyC, `{}`), 503)
	raw.down.Store(false)

	// A request that crashed: its claim is in flight, its lease lapsed a minute
	// ago. The retry takes it over and executes.
	body := `{"n":3}`
	fp := idem.FingerprintV3(httptest.NewRequest("POST", "/orders", strings.NewReader(body)), []byte(body))
	past := time.Now().Add(-2 * time.Minute)
	if _, claimed, err := mem.Claim(context.Background(), idem.ClaimRequest{
		Key: keyC, Fingerprint: fp, Token: "crashed", Now: past, LeaseUntil: past.Add(time.Minute), ExpiresAt: past.Add(time.Hour),
	}); err != nil || !claimed {
		t.Fatalf("plant the crashed claim: %v %v", claimed, err)
	}
	expect("takeover", post("/orders", keyC, body), 201)

	fams := scrape(t, metrics.URL)
	want := map[string]float64{
		"executed": 3, "replayed": 1, "in_flight": 1, "mismatch": 1, "rejected": 1,
		"store_error": 1, "taken_over": 1, "lease_lost": 0, "released": 0,
	}
	for outcome, n := range want {
		if got := value(t, fams, "idem_requests_total", "outcome", outcome); got != n {
			t.Errorf("idem_requests_total{outcome=%q} = %v, want %v", outcome, got, n)
		}
		if got := value(t, fams, "idem_request_duration_seconds", "outcome", outcome); got != n {
			t.Errorf("idem_request_duration_seconds{outcome=%q} count = %v, want %v", outcome, got, n)
		}
	}
	if got := value(t, fams, "idem_in_flight"); got != 0 {
		t.Errorf("idem_in_flight at rest = %v, want 0", got)
	}
	// Claims: executed A, replayed A, mismatch A, B, B's 409, the outage, the takeover.
	// The failed claim of the outage is given up (its answer may have been lost): one release.
	storeWant := map[string][2]float64{"claim": {7, 1}, "complete": {3, 0}, "release": {1, 0}, "get": {0, 0}}
	for op, w := range storeWant {
		if got := value(t, fams, "idem_store_duration_seconds", "op", op); got != w[0] {
			t.Errorf("idem_store_duration_seconds{op=%q} count = %v, want %v", op, got, w[0])
		}
		if got := value(t, fams, "idem_store_errors_total", "op", op); got != w[1] {
			t.Errorf("idem_store_errors_total{op=%q} = %v, want %v", op, got, w[1])
		}
	}
	for name, f := range fams {
		for _, mt := range f.Metric {
			for _, l := range mt.Label {
				if v := l.GetValue(); strings.Contains(v, "secret-key") || strings.Contains(v, "/") {
					t.Errorf("%s has label %s=%q: a key or a path as a label", name, l.GetName(), v)
				}
			}
		}
	}
}

// TestJanitorAndRoute checks the janitor metrics and the opt-in route label.
func TestJanitorAndRoute(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := idemprom.New(reg, &idemprom.Config{Route: idemprom.RouteFrom})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idemprom.New(reg, nil); err == nil || !strings.Contains(err.Error(), "one idemprom.Metrics per registry") {
		t.Errorf("a second New on one registry: %v, want the explanation", err)
	}
	mem := memstore.New(nil)
	t.Cleanup(func() { _ = mem.Close() })
	store := m.Store(mem)
	mw, err := idem.New(store, &idem.Config{Observer: m, TTL: time.Minute, NowFunc: func() time.Time { return time.Now().Add(-time.Hour) }})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(idemprom.WithRoute("POST /orders", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))))
	t.Cleanup(srv.Close)
	for _, k := range []string{"k1", "k2"} {
		req, _ := http.NewRequest("POST", srv.URL+"/orders/"+k, nil)
		req.Header.Set("Idempotency-Key", k)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	// The records were written an hour ago with a minute's TTL: both expired.
	j := &idem.Janitor{Store: store, OnSweep: m.OnSweep}
	before := time.Now()
	n, err := j.Sweep(context.Background())
	j.OnSweep(n, err)
	j.OnSweep(0, errors.New("connection refused"))

	metrics := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(metrics.Close)
	fams := scrape(t, metrics.URL)
	if got := value(t, fams, "idem_requests_total", "outcome", "executed", "route", "POST /orders"); got != 2 {
		t.Errorf("executed on route POST /orders = %v, want 2", got)
	}
	if got := value(t, fams, "idem_janitor_deleted_total"); got != 2 {
		t.Errorf("idem_janitor_deleted_total = %v, want 2", got)
	}
	if got := value(t, fams, "idem_janitor_errors_total"); got != 1 {
		t.Errorf("idem_janitor_errors_total = %v, want 1", got)
	}
	if got := value(t, fams, "idem_store_duration_seconds", "op", "delete_expired"); got != 1 {
		t.Errorf("delete_expired count = %v, want 1", got)
	}
	if got := value(t, fams, "idem_janitor_last_sweep_timestamp_seconds"); got < float64(before.Unix()) || got > float64(time.Now().Unix()+1) {
		t.Errorf("idem_janitor_last_sweep_timestamp_seconds = %v, want about %d", got, before.Unix())
	}
}

// TestConcurrentGauge sends many requests at once, half of them panicking,
// and checks that every counter adds up and idem_in_flight returns to 0.
func TestConcurrentGauge(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := idemprom.New(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	mem := memstore.New(nil)
	t.Cleanup(func() { _ = mem.Close() })
	mw, err := idem.New(m.Store(mem), &idem.Config{Observer: m})
	if err != nil {
		t.Fatal(err)
	}
	var panics atomic.Int64
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/panic") {
			panics.Add(1)
			panic(http.ErrAbortHandler)
		}
	})))
	// No keep-alive: net/http retries a keyed POST whose reused connection
	// closed, which would run a panicking handler twice.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	t.Cleanup(srv.Close)
	const n = 64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			path := "/ok"
			if i%2 == 1 {
				path = "/panic"
			}
			req, _ := http.NewRequest("POST", srv.URL+path, nil)
			req.Header.Set("Idempotency-Key", fmt.Sprintf("k%d", i))
			if resp, err := client.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
	}
	close(start)
	wg.Wait()
	metrics := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(metrics.Close)
	fams := scrape(t, metrics.URL)
	if got := value(t, fams, "idem_requests_total", "outcome", "executed"); got != n/2 {
		t.Errorf("executed = %v, want %d", got, n/2)
	}
	if got := value(t, fams, "idem_requests_total", "outcome", "released"); got != float64(panics.Load()) || got < n/2 {
		t.Errorf("released = %v, want one per panic (%d, at least %d)", got, panics.Load(), n/2)
	}
	if got := value(t, fams, "idem_in_flight"); got != 0 {
		t.Errorf("idem_in_flight = %v, want 0", got)
	}
}

// A route that is not valid UTF-8 (a Config.Route that returns a raw path, say)
// is counted with its invalid bytes replaced: Prometheus refuses such a label
// value with a panic, which must not reach the request.
func TestInvalidUTF8RouteIsCounted(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := idemprom.New(reg, &idemprom.Config{Route: idemprom.RouteFrom})
	if err != nil {
		t.Fatal(err)
	}
	mem := memstore.New(nil)
	t.Cleanup(func() { _ = mem.Close() })
	mw, err := idem.New(m.Store(mem), &idem.Config{Observer: m})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(idemprom.WithRoute("POST /\xffrders", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	}))))
	t.Cleanup(srv.Close)
	req, _ := http.NewRequest("POST", srv.URL+"/orders", nil)
	req.Header.Set("Idempotency-Key", "k")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("a request on a route that is not UTF-8: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("status %d, want 201", resp.StatusCode)
	}
	metrics := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(metrics.Close)
	if got := value(t, scrape(t, metrics.URL), "idem_requests_total", "outcome", "executed", "route", "POST /\uFFFDrders"); got != 1 {
		t.Errorf("executed on the route = %v, want 1", got)
	}
}
