package idem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/racetest"
	"github.com/idemkit/idem/memstore"
)

// orders is a small orders handler that counts its executions.
type orders struct {
	runs  atomic.Int64
	delay time.Duration
	// gate, when set, is waited on by every execution before it answers.
	gate chan struct{}
}

func (o *orders) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := o.runs.Add(1)
	body, _ := io.ReadAll(r.Body)
	if o.gate != nil {
		<-o.gate
	}
	if o.delay > 0 {
		time.Sleep(o.delay)
	}
	if bytes.Contains(body, []byte("invalid")) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusBadRequest)
		fmt.Fprint(w, `{"status":400,"title":"invalid order"}`)
		return
	}
	if bytes.Contains(body, []byte("boom")) {
		w.WriteHeader(http.StatusInternalServerError)
		fmt.Fprintf(w, "failure %d", n)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/orders/"+strconv.FormatInt(n, 10))
	w.Header().Set("Set-Cookie", "session=secret")
	w.Header().Set("X-Not-Stored", "x")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":%d,"body":%q,"scope":%q}`, n, body, idem.ScopeFrom(r.Context()))
}

type bundle struct {
	store  *memstore.Store
	orders *orders
	server *httptest.Server
	client *http.Client
}

// setup serves o behind idem with cfg on a real loopback socket. A bearer token,
// when sent, becomes the scope.
func setup(t *testing.T, cfg *idem.Config, o *orders) *bundle {
	t.Helper()
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	mw, err := idem.New(store, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	h := mw(o)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
			r = r.WithContext(idem.WithScope(r.Context(), tok))
		}
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	// One attempt per request: Go's Transport re-sends requests that carry an
	// Idempotency-Key when a reused connection drops (docs/design.md §6).
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
	return &bundle{store: store, orders: o, server: srv, client: client}
}

type answer struct {
	status int
	header http.Header
	body   []byte
}

func (b *bundle) do(t *testing.T, method, path, body string, header ...string) answer {
	t.Helper()
	req, err := http.NewRequest(method, b.server.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	resp, err := b.client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, got}
}

func (b *bundle) post(t *testing.T, key, body string, header ...string) answer {
	t.Helper()
	if key != "" {
		header = append(header, "Idempotency-Key", key)
	}
	return b.do(t, http.MethodPost, "/orders", body, header...)
}

func wantProblem(t *testing.T, a answer, status int, code string) idem.Problem {
	t.Helper()
	if a.status != status {
		t.Fatalf("status = %d, want %d (body %s)", a.status, status, a.body)
	}
	if ct := a.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Errorf("Content-Type = %q, want application/problem+json", ct)
	}
	var p idem.Problem
	if err := json.Unmarshal(a.body, &p); err != nil {
		t.Fatalf("problem body %s: %v", a.body, err)
	}
	if p.Code != code || p.Status != status || p.Type != idem.ProblemTypeBase+code || p.Title == "" || p.Detail == "" {
		t.Errorf("problem = %+v, want code %s, status %d, type, title and detail", p, code, status)
	}
	return p
}

func TestReplay(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, &orders{})
	first := b.post(t, "k1", `{"cart_id":"c_42"}`)
	if first.status != 201 || first.header.Get(idem.ReplayedHeader) != "" {
		t.Fatalf("first answer: %d %v", first.status, first.header)
	}
	if first.header.Get("Set-Cookie") == "" {
		t.Errorf("the first answer lost the handler's Set-Cookie")
	}
	for _, key := range []string{"k1", `"k1"`} { // the bare and the sf-string form name the same key
		again := b.post(t, key, `{"cart_id":"c_42"}`)
		if again.status != 201 || !bytes.Equal(again.body, first.body) {
			t.Fatalf("replay = %d %s, want 201 %s", again.status, again.body, first.body)
		}
		if again.header.Get(idem.ReplayedHeader) != "true" {
			t.Errorf("replay lacks %s: true", idem.ReplayedHeader)
		}
		for _, h := range []string{"Content-Type", "Location"} {
			if again.header.Get(h) != first.header.Get(h) {
				t.Errorf("replayed %s = %q, want %q", h, again.header.Get(h), first.header.Get(h))
			}
		}
		for _, h := range []string{"Set-Cookie", "X-Not-Stored"} {
			if v := again.header.Get(h); v != "" {
				t.Errorf("replay carries %s: %q; only allow-listed headers are stored", h, v)
			}
		}
	}
	if n := b.orders.runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
}

func TestErrorOutcomesAreReplayed(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, &orders{})
	for i, body := range []string{`{"invalid":1}`, `{"boom":1}`} {
		key := "key-" + strconv.Itoa(i)
		first := b.post(t, key, body)
		again := b.post(t, key, body)
		if first.status < 400 {
			t.Fatalf("%s: first answer %d, want the handler's error", body, first.status)
		}
		if again.status != first.status || !bytes.Equal(again.body, first.body) || again.header.Get(idem.ReplayedHeader) != "true" {
			t.Errorf("%s: replay = %d %q, want the stored %d %q", body, again.status, again.body, first.status, first.body)
		}
	}
	if n := b.orders.runs.Load(); n != 2 {
		t.Errorf("handler ran %d times, want 2", n)
	}
}

func TestKeepFuncReleasesUnkeptOutcomes(t *testing.T) {
	t.Parallel()
	cfg := &idem.Config{KeepFunc: func(status int) bool { return status < 500 }}
	b := setup(t, cfg, &orders{})
	first := b.post(t, "k", `{"boom":1}`)
	second := b.post(t, "k", `{"boom":1}`)
	if first.status != 500 || second.status != 500 || bytes.Equal(first.body, second.body) || second.header.Get(idem.ReplayedHeader) != "" {
		t.Errorf("an unkept 500 must run afresh: got %q then %q", first.body, second.body)
	}
	if n := b.orders.runs.Load(); n != 2 {
		t.Errorf("handler ran %d times, want 2", n)
	}
}

func TestRejectedBeforeTheStore(t *testing.T) {
	t.Parallel()
	b := setup(t, &idem.Config{MaxRequestBody: 64}, &orders{})
	wantProblem(t, b.post(t, "", `{}`), 400, idem.CodeKeyMissing)
	wantProblem(t, b.post(t, strings.Repeat("k", 256), `{}`), 400, idem.CodeKeyInvalid)
	wantProblem(t, b.post(t, `"unterminated`, `{}`), 400, idem.CodeKeyInvalid)
	wantProblem(t, b.post(t, "with space", `{}`), 400, idem.CodeKeyInvalid)
	wantProblem(t, b.post(t, "a", `{}`, "Idempotency-Key", "b"), 400, idem.CodeKeyInvalid) // two header lines
	wantProblem(t, b.post(t, "big", strings.Repeat("x", 65)), 413, idem.CodeBodyTooLarge)
	if n := b.orders.runs.Load(); n != 0 {
		t.Errorf("handler ran %d times for rejected requests", n)
	}
	// None of them bound the key.
	if a := b.post(t, "big", `{}`); a.status != 201 {
		t.Errorf("after a 413 the key must still be free: %d %s", a.status, a.body)
	}
	// A key of exactly 255 characters is fine.
	if a := b.post(t, strings.Repeat("k", 255), `{}`); a.status != 201 {
		t.Errorf("255-character key: %d %s", a.status, a.body)
	}
}

func TestUnkeyedMethodsAndOptionalKeys(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, &orders{})
	for _, m := range []string{"GET", "PUT", "DELETE"} {
		if a := b.do(t, m, "/orders", ""); a.status != 201 {
			t.Errorf("%s without a key: %d, want it passed through", m, a.status)
		}
	}
	opt := setup(t, &idem.Config{KeyOptional: true, Methods: []string{"POST", "DELETE"}}, &orders{})
	if a := opt.post(t, "", `{}`); a.status != 201 {
		t.Errorf("optional key, none sent: %d", a.status)
	}
	opt.do(t, "DELETE", "/orders", "", "Idempotency-Key", "d")
	if a := opt.do(t, "DELETE", "/orders", "", "Idempotency-Key", "d"); a.header.Get(idem.ReplayedHeader) != "true" {
		t.Errorf("a keyed DELETE was not replayed")
	}
}

func TestFingerprintMismatch(t *testing.T) {
	t.Parallel()
	o := &orders{gate: make(chan struct{})}
	b := setup(t, nil, o)
	done := make(chan answer)
	go func() { done <- b.post(t, "k", `{"cart_id":"a"}`) }()
	waitFor(t, func() bool { return o.runs.Load() == 1 })
	wantProblem(t, b.post(t, "k", `{"cart_id":"b"}`), 422, idem.CodeKeyReused) // in flight
	p := wantProblem(t, b.post(t, "k", `{"cart_id":"a"}`), 409, idem.CodeKeyInUse)
	_ = p
	close(o.gate)
	<-done
	wantProblem(t, b.post(t, "k", `{"cart_id":"b"}`), 422, idem.CodeKeyReused) // complete
	if n := o.runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
}

func TestInFlightRetryAfter(t *testing.T) {
	t.Parallel()
	o := &orders{gate: make(chan struct{})}
	b := setup(t, &idem.Config{Lease: 20 * time.Second}, o)
	go b.post(t, "k", `{}`)
	waitFor(t, func() bool { return o.runs.Load() == 1 })
	a := b.post(t, "k", `{}`)
	wantProblem(t, a, 409, idem.CodeKeyInUse)
	secs, err := strconv.Atoi(a.header.Get("Retry-After"))
	if err != nil || secs < 1 || secs > 20 {
		t.Errorf("Retry-After = %q, want the seconds left on a 20 s lease", a.header.Get("Retry-After"))
	}
	close(o.gate)
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 10s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestConcurrentRace is the test the source articles ask for: 100 requests with
// one key released at the same instant.
func TestConcurrentRace(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, &orders{delay: 20 * time.Millisecond})
	results := racetest.Fire(100, racetest.Post(b.server.URL+"/orders", "race-key", []byte(`{"cart_id":"c_42"}`), nil))
	var original []byte
	counts := map[string]int{}
	for _, r := range results {
		if r.Err != nil {
			t.Fatalf("request failed: %v", r.Err)
		}
		switch {
		case r.Status == 201 && r.Header.Get(idem.ReplayedHeader) == "":
			counts["original"]++
			original = r.Body
		case r.Status == 201:
			counts["replay"]++
		case r.Status == 409:
			counts["in flight"]++
		default:
			t.Errorf("unexpected answer %d %s", r.Status, r.Body)
		}
	}
	if n := b.orders.runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want exactly 1 (answers %v)", n, counts)
	}
	if counts["original"] != 1 {
		t.Fatalf("answers %v, want exactly one original", counts)
	}
	for _, r := range results {
		if r.Status == 201 && !bytes.Equal(r.Body, original) {
			t.Errorf("a replay differs from the original: %s vs %s", r.Body, original)
		}
	}
	t.Logf("answers: %v", counts)
}

func TestScopeIsolation(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, &orders{})
	a := b.post(t, "shared", `{}`, "Authorization", "Bearer tenant-a")
	c := b.post(t, "shared", `{}`, "Authorization", "Bearer tenant-b")
	if a.status != 201 || c.status != 201 || c.header.Get(idem.ReplayedHeader) != "" || bytes.Equal(a.body, c.body) {
		t.Errorf("two tenants with one key must both execute: %s / %s", a.body, c.body)
	}
	// Another tenant's changed body is not a mismatch either.
	if d := b.post(t, "shared", `{"other":1}`, "Authorization", "Bearer tenant-c"); d.status != 201 {
		t.Errorf("tenant c: %d %s", d.status, d.body)
	}
}

// clock is a settable clock for lease and TTL tests.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func TestExpiredRecordsRunAgain(t *testing.T) {
	t.Parallel()
	clk := &clock{now: time.Now()}
	b := setup(t, &idem.Config{NowFunc: clk.Now, TTL: time.Hour}, &orders{})
	b.post(t, "k", `{"a":1}`)
	clk.Add(59 * time.Minute)
	if a := b.post(t, "k", `{"a":1}`); a.header.Get(idem.ReplayedHeader) != "true" {
		t.Fatalf("within the TTL: not replayed")
	}
	clk.Add(2 * time.Minute)
	if a := b.post(t, "k", `{"other":1}`); a.status != 201 || a.header.Get(idem.ReplayedHeader) != "" {
		t.Fatalf("after the TTL the key is absent again: %d %s", a.status, a.body)
	}
	if n := b.orders.runs.Load(); n != 2 {
		t.Errorf("handler ran %d times, want 2", n)
	}
}

func TestLapsedLeaseIsTakenOver(t *testing.T) {
	t.Parallel()
	clk := &clock{now: time.Now()}
	b := setup(t, &idem.Config{NowFunc: clk.Now, Lease: time.Minute}, &orders{})
	// A holder that crashed: claimed with the same fingerprint, never completed.
	req := httptest.NewRequest("POST", "/orders", nil)
	now := clk.Now()
	if _, claimed, err := b.store.Claim(context.Background(), idem.ClaimRequest{
		Key: "k", Fingerprint: idem.FingerprintV2(req, []byte(`{}`)), Token: "crashed",
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour),
	}); !claimed || err != nil {
		t.Fatalf("Claim: %v %v", claimed, err)
	}
	wantProblem(t, b.post(t, "k", `{}`), 409, idem.CodeKeyInUse)
	clk.Add(61 * time.Second)
	if a := b.post(t, "k", `{}`); a.status != 201 || a.header.Get(idem.ReplayedHeader) != "" {
		t.Fatalf("after the lease lapsed: %d %s, want a fresh execution", a.status, a.body)
	}
	if err := b.store.Complete(context.Background(), "", "k", "crashed", &idem.Response{Status: 200}, now, now.Add(time.Hour)); !errors.Is(err, idem.ErrLockLost) {
		t.Errorf("the crashed holder's Complete: %v, want ErrLockLost", err)
	}
}

func TestLeaseRenewal(t *testing.T) {
	t.Parallel()
	// The handler runs for several leases; renewal (every Lease/3) keeps others
	// out. A lease of 1.5 s lets a renewal come up to 1 s late on a loaded
	// machine before the lease lapses (600 ms left 400 ms).
	const lease = 1500 * time.Millisecond
	b := setup(t, &idem.Config{Lease: lease}, &orders{delay: 3 * lease})
	done := make(chan answer)
	go func() { done <- b.post(t, "k", `{}`) }()
	waitFor(t, func() bool { return b.orders.runs.Load() == 1 })
	start, pastLease := time.Now(), 0
	for {
		time.Sleep(300 * time.Millisecond)
		a := b.post(t, "k", `{}`)
		if a.header.Get(idem.ReplayedHeader) == "true" {
			break // the holder finished (a loaded machine answers slowly)
		}
		if a.status != 409 {
			t.Fatalf("while the holder runs past its first lease: %d %s, want 409", a.status, a.body)
		}
		if time.Since(start) > lease {
			pastLease++
		}
	}
	if pastLease == 0 {
		t.Fatal("no retry landed after the first lease; the machine was too slow for the test to mean anything")
	}
	if a := <-done; a.status != 201 {
		t.Fatalf("holder: %d", a.status)
	}
	if n := b.orders.runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
}

func TestLostLeaseCancelsHandler(t *testing.T) {
	t.Parallel()
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	cause := make(chan error, 1)
	started := make(chan struct{})
	mw, err := idem.New(store, &idem.Config{Lease: 60 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(started)
		<-r.Context().Done()
		cause <- context.Cause(r.Context())
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	go func() {
		req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", "k")
		if resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	<-started
	// Another request takes the key over, as it would after a long stall.
	req := httptest.NewRequest("POST", "/x", nil)
	later := time.Now().Add(time.Hour)
	if _, claimed, err := store.Claim(context.Background(), idem.ClaimRequest{
		Key: "k", Fingerprint: idem.FingerprintV3(req, []byte("{}")), Token: "taker",
		Now: later, LeaseUntil: later.Add(time.Hour), ExpiresAt: later.Add(time.Hour),
	}); !claimed || err != nil {
		t.Fatalf("takeover: %v %v", claimed, err)
	}
	select {
	case err := <-cause:
		if !errors.Is(err, idem.ErrLockLost) {
			t.Errorf("handler context cause = %v, want ErrLockLost", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the handler's context was not cancelled after its lease was lost")
	}
}

func TestPanicReleasesTheKey(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	mw, err := idem.New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	var recovered atomic.Value
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if runs.Add(1) == 1 {
			panic("handler bug")
		}
		w.WriteHeader(http.StatusCreated)
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			if v := recover(); v != nil {
				recovered.Store(v)
				w.WriteHeader(http.StatusInternalServerError)
			}
		}()
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	post := func() int {
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", "k")
		resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if s := post(); s != 500 || recovered.Load() != "handler bug" {
		t.Fatalf("panicking handler: status %d, recovered %v; want the panic re-raised", s, recovered.Load())
	}
	if _, err := store.Get(context.Background(), "", "k", time.Now()); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("after a panic the record must be gone: %v", err)
	}
	if s := post(); s != 201 {
		t.Errorf("retry after a panic: %d, want a fresh 201", s)
	}
}

// failingStore fails every call.
type failingStore struct{ idem.Store }

var errDown = errors.New("store is down")

func (failingStore) Claim(context.Context, idem.ClaimRequest) (*idem.Record, bool, error) {
	return nil, false, errDown
}

func (failingStore) Release(context.Context, string, string, string) error { return errDown }

func TestStoreUnavailable(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	var events []idem.Event
	var mu sync.Mutex
	mw, err := idem.New(failingStore{}, &idem.Config{Observer: idem.ObserverFunc(func(_ context.Context, e idem.Event) {
		mu.Lock()
		events = append(events, e)
		mu.Unlock()
	})})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { runs.Add(1) })))
	t.Cleanup(srv.Close)
	b := &bundle{server: srv, client: srv.Client()}
	a := b.post(t, "k", `{}`)
	wantProblem(t, a, 503, idem.CodeStoreUnavailable)
	if runs.Load() != 0 {
		t.Error("the handler ran although the store was down")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(events) != 1 || events[0].Kind != idem.EventStoreError || !errors.Is(events[0].Err, errDown) {
		t.Errorf("events = %+v, want one store_error wrapping the store's error", events)
	}
}

func TestReferenceReplay(t *testing.T) {
	t.Parallel()
	var stored []*idem.Response
	cfg := &idem.Config{ReplayFunc: func(w http.ResponseWriter, r *http.Request, rec *idem.Record) error {
		stored = append(stored, rec.Response)
		if rec.Response.Ref == "" {
			return errors.New("no reference recorded")
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(rec.Response.Status)
		fmt.Fprintf(w, `{"rebuilt_from":%q}`, rec.Response.Ref)
		return nil
	}}
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	mw, err := idem.New(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/ref" {
			idem.SetRef(r.Context(), "order-7")
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"id":7,"big":"payload"}`)
	})))
	t.Cleanup(srv.Close)
	b := &bundle{server: srv, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}}
	b.do(t, "POST", "/ref", "{}", "Idempotency-Key", "r")
	a := b.do(t, "POST", "/ref", "{}", "Idempotency-Key", "r")
	if a.status != 201 || string(a.body) != `{"rebuilt_from":"order-7"}` || a.header.Get(idem.ReplayedHeader) != "true" {
		t.Errorf("reference replay = %d %s %v", a.status, a.body, a.header)
	}
	if len(stored) != 1 || stored[0].Body != nil || !stored[0].BodyOmitted {
		t.Errorf("with a ReplayFunc the body must not be stored: %+v", stored)
	}
	b.do(t, "POST", "/marker", "{}", "Idempotency-Key", "m")
	wantProblem(t, b.do(t, "POST", "/marker", "{}", "Idempotency-Key", "m"), 500, idem.CodeReplayFailed)
}

func TestOversizedResponseIsNeverReplayedTruncated(t *testing.T) {
	t.Parallel()
	big := strings.Repeat("x", 100)
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	mw, _ := idem.New(store, &idem.Config{MaxStoredBody: 50})
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, big) })))
	t.Cleanup(srv.Close)
	b := &bundle{server: srv, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}}
	if a := b.post(t, "k", "{}"); a.status != 200 || string(a.body) != big {
		t.Fatalf("first caller: %d %d bytes, want the full response", a.status, len(a.body))
	}
	wantProblem(t, b.post(t, "k", "{}"), 500, idem.CodeResponseTooLarge)
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	store := memstore.New(&memstore.Config{JanitorInterval: -1})
	bad := map[string]*idem.Config{
		"Set-Cookie":    {StoredHeaders: []string{"set-cookie"}},
		"TTL < Lease":   {Lease: time.Minute, TTL: time.Second},
		"MaxKeyLength":  {MaxKeyLength: -1},
		"FlowSingleTx":  {Flow: idem.FlowSingleTx},
		"Lease":         {Lease: time.Microsecond},
		"unknown flow":  {Flow: 9},
		"MaxStoredBody": {MaxStoredBody: -5},
	}
	for name, cfg := range bad {
		if _, err := idem.New(store, cfg); err == nil || !strings.Contains(err.Error(), strings.Fields(name)[0]) {
			t.Errorf("%s: New = %v, want an error naming it", name, err)
		}
	}
	if _, err := idem.New(nil, nil); err == nil {
		t.Error("New(nil store) succeeded")
	}
	cfg := &idem.Config{}
	if _, err := idem.New(store, cfg); err != nil || cfg.Lease != 0 || cfg.HeaderName != "" {
		t.Errorf("New modified the caller's Config or failed: %v %+v", err, cfg)
	}
}

// TestFlushDoesNotLeakTheResponse: a handler that flushes (directly or through
// http.ResponseController) must not send anything before the outcome is stored.
func TestFlushDoesNotLeakTheResponse(t *testing.T) {
	t.Parallel()
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	mw, err := idem.New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		if err := http.NewResponseController(w).Flush(); err != nil {
			t.Errorf("Flush through ResponseController: %v", err)
		}
		w.(http.Flusher).Flush()
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, "created")
		_ = http.NewResponseController(w).Flush()
	})))
	t.Cleanup(srv.Close)
	b := &bundle{server: srv, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}}
	first := b.post(t, "k", "{}")
	again := b.post(t, "k", "{}")
	for _, a := range []answer{first, again} {
		if a.status != 201 || string(a.body) != "created" {
			t.Errorf("answer = %d %q, want 201 created (a flush must not send the default 200 early)", a.status, a.body)
		}
	}
}
