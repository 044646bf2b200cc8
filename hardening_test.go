package idem_test

// Regression tests for the exactly-once holes an adversarial review and a
// black-box probe found in the middleware. Each fails on the code before its fix.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// A handler that outlives the TTL keeps its key: its lease renewal keeps the
// record from expiring, so a retry (with the same or another body) is refused,
// the janitor does not delete it, and the handler runs once.
//
// The handler waits on a gate, not on a timer, and the middleware's clock
// stops when the gate opens: the replay at the end must find the record within
// its TTL of the completion, which a loaded machine's scheduling must not decide.
func TestLongHandlerPastTTLRunsOnce(t *testing.T) {
	t.Parallel()
	o := &orders{gate: make(chan struct{})}
	var release sync.Once
	open := func() { release.Do(func() { close(o.gate) }) }
	defer open() // a failed check must not leave the handler (and the server's Close) waiting for ever
	var stopped atomic.Pointer[time.Time]
	clock := func() time.Time {
		if at := stopped.Load(); at != nil {
			return *at
		}
		return time.Now()
	}
	// Leases of several hundred milliseconds: at 200 ms a renewal delayed by a
	// loaded machine let a duplicate take the request over.
	const ttl = 900 * time.Millisecond
	b := setup(t, &idem.Config{Lease: 600 * time.Millisecond, TTL: ttl, NowFunc: clock}, o)
	first := make(chan answer, 1)
	go func() { first <- b.post(t, "k", `{"cart":1}`) }()
	for o.runs.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(2*ttl + 50*time.Millisecond) // past twice the TTL, on the real clock
	janitor := idem.Janitor{Store: b.store}
	if _, err := janitor.Sweep(context.Background()); err != nil {
		t.Fatal(err)
	}
	wantProblem(t, b.post(t, "k", `{"cart":1}`), http.StatusConflict, idem.CodeKeyInUse)
	wantProblem(t, b.post(t, "k", `{"cart":2}`), http.StatusUnprocessableEntity, idem.CodeKeyReused)
	now := time.Now()
	stopped.Store(&now)
	open()
	if a := <-first; a.status != http.StatusCreated {
		t.Fatalf("the long request: %d %s, want 201", a.status, a.body)
	}
	if a := b.post(t, "k", `{"cart":1}`); a.header.Get(idem.ReplayedHeader) != "true" {
		t.Fatalf("retry after the long request: %d %s, want its replay", a.status, a.body)
	}
	if n := o.runs.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want once", n)
	}
}

// A client that hangs up does not stop the claimed operation: the handler's
// context keeps going, its real outcome is stored, and the retry replays it.
func TestClientHangUpDoesNotStopTheOperation(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	var sawCancel atomic.Bool
	started := make(chan struct{}, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		started <- struct{}{}
		select {
		case <-time.After(300 * time.Millisecond):
		case <-r.Context().Done():
			sawCancel.Store(true)
			w.WriteHeader(http.StatusInternalServerError)
			fmt.Fprint(w, r.Context().Err())
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, n)
	})
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	mw, err := idem.New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(h))
	t.Cleanup(srv.Close)
	hangUp(t, srv.URL+"/orders", "hangup", "{}", started)
	b := &bundle{server: srv, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}}
	var a answer
	deadline := time.Now().Add(5 * time.Second)
	for {
		if a = b.post(t, "hangup", "{}"); a.status != http.StatusConflict || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "true" || string(a.body) != `{"id":1}` {
		t.Fatalf("retry after the hang-up: %d %s (replayed %q), want the replay of 201 {\"id\":1}", a.status, a.body, a.header.Get(idem.ReplayedHeader))
	}
	if sawCancel.Load() || runs.Load() != 1 {
		t.Fatalf("handler saw the client's cancellation: %v, ran %d times; want no cancellation and one run", sawCancel.Load(), runs.Load())
	}
}

// HandlerTimeout bounds the handler's context, and the contexts the handler
// derives from it (as drivers and clients do) end with it. A derived context
// reports context.Canceled, with context.DeadlineExceeded as its cause (see
// Config.HandlerTimeout).
func TestHandlerTimeoutEndsTheHandlersContext(t *testing.T) {
	t.Parallel()
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	mw, err := idem.New(store, &idem.Config{HandlerTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		derived, cancel := context.WithCancel(r.Context())
		defer cancel()
		select {
		case <-derived.Done():
			w.WriteHeader(http.StatusGatewayTimeout)
			if !errors.Is(context.Cause(derived), context.DeadlineExceeded) {
				fmt.Fprintf(w, "derived context's cause %v, handler's %v", context.Cause(derived), r.Context().Err())
				return
			}
			fmt.Fprint(w, r.Context().Err())
		case <-time.After(10 * time.Second):
			w.WriteHeader(http.StatusCreated)
		}
	})))
	t.Cleanup(srv.Close)
	b := &bundle{server: srv, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}}
	start := time.Now()
	a := b.post(t, "k", "{}")
	if a.status != http.StatusGatewayTimeout || string(a.body) != context.DeadlineExceeded.Error() || time.Since(start) > 5*time.Second {
		t.Fatalf("answer %d %q after %v, want 504 %q well before 10 s", a.status, a.body, time.Since(start), context.DeadlineExceeded)
	}
}

// A lowercase method is keyed like its uppercase form: a route registered
// without a method pattern runs its handler for it.
func TestLowercaseMethodIsKeyed(t *testing.T) {
	t.Parallel()
	o := &orders{}
	b := setup(t, nil, o)
	for range 2 {
		b.do(t, "post", "/orders", "{}", "Idempotency-Key", "lower")
	}
	if n := o.runs.Load(); n != 1 {
		t.Fatalf("two 'post' requests with one key ran the handler %d times", n)
	}
	wantProblem(t, b.do(t, "post", "/orders", "{}"), http.StatusBadRequest, idem.CodeKeyMissing)
}

// The fingerprint covers the escaped path: /files/a%2Fb and /files/a/b are two
// requests, as ServeMux routes them apart.
func TestEscapedPathIsFingerprinted(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, &orders{})
	if a := b.do(t, http.MethodPost, "/files/a%2Fb", "{}", "Idempotency-Key", "p"); a.status != http.StatusCreated {
		t.Fatalf("first: %d %s", a.status, a.body)
	}
	wantProblem(t, b.do(t, http.MethodPost, "/files/a/b", "{}", "Idempotency-Key", "p"), http.StatusUnprocessableEntity, idem.CodeKeyReused)
}

// Bare keys are RFC 9651 tokens: parameters and lists (two header lines a
// proxy folded into one) are refused.
func TestKeyListsAndParametersAreRefused(t *testing.T) {
	t.Parallel()
	o := &orders{}
	b := setup(t, nil, o)
	for _, v := range []string{"abc;p=1", "k1, k2", `"k1", "k2"`, `"abc";p=1`} {
		wantProblem(t, b.post(t, "", "{}", "Idempotency-Key", v), http.StatusBadRequest, idem.CodeKeyInvalid)
	}
	if n := o.runs.Load(); n != 0 {
		t.Fatalf("handler ran %d times for invalid keys", n)
	}
}

// scopeRecorder is a memstore that notes the longest scope it was given.
type scopeRecorder struct {
	*memstore.Store
	longest atomic.Int64
}

func (s *scopeRecorder) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	for {
		old := s.longest.Load()
		if int64(len(req.Scope)) <= old || s.longest.CompareAndSwap(old, int64(len(req.Scope))) {
			break
		}
	}
	return s.Store.Claim(ctx, req)
}

// Any scope works: long or odd ones reach the store and the Observer as a
// bounded digest, and tenants stay apart.
func TestLongAndOddScopes(t *testing.T) {
	t.Parallel()
	store := &scopeRecorder{Store: memstore.New(nil)}
	t.Cleanup(func() { _ = store.Close() })
	var longestEvent atomic.Int64
	mw, err := idem.New(store, &idem.Config{Observer: idem.ObserverFunc(func(_ context.Context, e idem.Event) {
		if n := int64(len(e.Scope)); n > longestEvent.Load() {
			longestEvent.Store(n)
		}
	})})
	if err != nil {
		t.Fatal(err)
	}
	o := &orders{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tok, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		mw(o).ServeHTTP(w, r.WithContext(idem.WithScope(r.Context(), tok)))
	}))
	t.Cleanup(srv.Close)
	b := &bundle{server: srv, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}}
	long := strings.Repeat("t", 2800)
	scopes := []string{long + "a", long + "b", "tenant\xff", "tenant\xfe", "sha256:abc"}
	for _, sc := range scopes {
		for range 2 {
			if a := b.post(t, "k", "{}", "Authorization", "Bearer "+sc); a.status != http.StatusCreated {
				t.Fatalf("scope of %d bytes: %d %s", len(sc), a.status, a.body)
			}
		}
	}
	if n := o.runs.Load(); n != int64(len(scopes)) {
		t.Fatalf("the handler ran %d times for %d tenants with one key each, want once per tenant", n, len(scopes))
	}
	if store.longest.Load() > idem.MaxStoredScopeLength || longestEvent.Load() > idem.MaxStoredScopeLength {
		t.Fatalf("the store got a %d-byte scope and the Observer a %d-byte one; want at most %d", store.longest.Load(), longestEvent.Load(), idem.MaxStoredScopeLength)
	}
	if got := idem.StoredScope("tenant-1"); got != "tenant-1" {
		t.Errorf("StoredScope of a short printable scope = %q, want it unchanged", got)
	}
}

// Replays copy the stored header values: a middleware outside idem that
// changes the header map cannot change the stored outcome, or race with other
// replays.
func TestReplayHeadersAreCopies(t *testing.T) {
	t.Parallel()
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	mw, err := idem.New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	inner := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["Link"] = append(make([]string, 0, 4), "<a>")
		w.WriteHeader(http.StatusCreated)
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		inner.ServeHTTP(&mutatingWriter{ResponseWriter: w}, r)
	}))
	t.Cleanup(srv.Close)
	b := &bundle{server: srv, client: &http.Client{}}
	b.post(t, "k", "{}")
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() { b.post(t, "k", "{}") })
	}
	wg.Wait()
	rec, err := store.Get(context.Background(), "", "k", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if got := rec.Response.Header["Link"]; len(got) != 1 || got[0] != "<a>" {
		t.Fatalf("stored Link = %q after replays through a mutating middleware, want [<a>]", got)
	}
}

// mutatingWriter is an outer middleware that changes and appends to a header
// as the answer goes out.
type mutatingWriter struct{ http.ResponseWriter }

func (w *mutatingWriter) WriteHeader(status int) {
	h := w.Header()
	if v := h["Link"]; len(v) > 0 {
		v[0] = "<mutated>"
		h["Link"] = append(v, "<outer>")
	}
	w.ResponseWriter.WriteHeader(status)
}

// A problem written after the handler keeps the headers that middleware
// outside idem set (CORS, request IDs), and drops only the handler's.
func TestProblemAfterHandlerKeepsOuterHeaders(t *testing.T) {
	t.Parallel()
	s := &fakeTxStore{Store: memstore.New(nil)}
	t.Cleanup(func() { _ = s.Close() })
	s.failCommit.Store(true)
	mw, err := idem.New(s, nil)
	if err != nil {
		t.Fatal(err)
	}
	inner := mw(http.HandlerFunc(insertOrderWithHeader))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Request-Id", "req-1")
		w.Header().Set("Access-Control-Allow-Origin", "*")
		inner.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	b := &bundle{server: srv, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}}
	a := b.post(t, "k", "{}")
	wantProblem(t, a, http.StatusServiceUnavailable, idem.CodeCommitFailed)
	if a.header.Get("X-Request-Id") != "req-1" || a.header.Get("Access-Control-Allow-Origin") != "*" {
		t.Errorf("outer headers lost: %v", a.header)
	}
	if a.header.Get("X-Handler") != "" {
		t.Errorf("the handler's header reached the problem answer: %v", a.header)
	}
}

func insertOrderWithHeader(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("X-Handler", "1")
	insertOrder(w, r)
}

// A failed release is not reported as a released key.
func TestProblemDetailsSayOnlyWhatIsTrue(t *testing.T) {
	t.Parallel()
	s, b := newTxBundle(t, nil, insertOrder)
	s.failCommit.Store(true)
	s.failRelease.Store(true)
	p := wantProblem(t, b.post(t, "k", "{}"), http.StatusServiceUnavailable, idem.CodeCommitFailed)
	if strings.Contains(p.Detail, "was released") || !strings.Contains(p.Detail, "could not be released") {
		t.Errorf("detail %q: the release failed, so it must not say the key was released", p.Detail)
	}
	s.failRelease.Store(false)
	p = wantProblem(t, b.post(t, "k2", "{}"), http.StatusServiceUnavailable, idem.CodeCommitFailed)
	if strings.Contains(p.Detail, "could not be released") {
		t.Errorf("detail %q: the release worked", p.Detail)
	}
}

// When the database aborted the handler's transaction, an error answer of the
// handler is its true outcome (kept and replayed, the handler does not run
// again); a success answer is not (the key is released, and the client hears
// that nothing was committed).
func TestAbortedTransaction(t *testing.T) {
	t.Parallel()
	t.Run("error answer is kept", func(t *testing.T) {
		t.Parallel()
		var runs atomic.Int64
		s, b := newTxBundle(t, nil, func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusConflict)
			fmt.Fprint(w, `{"error":"duplicate cart"}`)
		})
		s.commitErr = func() error { return fmt.Errorf("commit: %w", idem.ErrTxAborted) }
		first := b.post(t, "k", "{}")
		again := b.post(t, "k", "{}")
		if first.status != http.StatusConflict || string(first.body) != `{"error":"duplicate cart"}` {
			t.Fatalf("first: %d %s, want the handler's 409", first.status, first.body)
		}
		if again.status != http.StatusConflict || again.header.Get(idem.ReplayedHeader) != "true" || runs.Load() != 1 {
			t.Fatalf("retry: %d (replayed %q), handler ran %d times; want the replayed 409 and one run", again.status, again.header.Get(idem.ReplayedHeader), runs.Load())
		}
		if got := s.orders(); len(got) != 0 {
			t.Fatalf("orders = %v, want none", got)
		}
	})
	t.Run("success answer is not", func(t *testing.T) {
		t.Parallel()
		s, b := newTxBundle(t, nil, insertOrder)
		s.commitErr = func() error { return fmt.Errorf("commit: %w", idem.ErrTxAborted) }
		wantProblem(t, b.post(t, "k", "{}"), http.StatusInternalServerError, idem.CodeTxAborted)
		if _, err := s.Get(context.Background(), "", "k", time.Now()); !errors.Is(err, idem.ErrNotFound) {
			t.Fatalf("the key must be released: %v", err)
		}
		s.commitErr = nil
		if a := b.post(t, "k", "{}"); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "" {
			t.Fatalf("retry: %d, want a fresh 201", a.status)
		}
	})
}

// A commit that failed after the lease was lost is a lost lease, whatever
// error the driver gave: one predicate decides for completion and commit.
func TestCommitFailureAfterLostLeaseIsLeaseLost(t *testing.T) {
	t.Parallel()
	var events []idem.EventKind
	var mu sync.Mutex
	s := &fakeTxStore{Store: memstore.New(nil)}
	t.Cleanup(func() { _ = s.Close() })
	s.commitErr = func() error { return errors.New("driver: bad connection") }
	mw, err := idem.New(s, &idem.Config{Lease: 30 * time.Millisecond, TTL: time.Hour, Observer: idem.ObserverFunc(func(_ context.Context, e idem.Event) {
		mu.Lock()
		events = append(events, e.Kind)
		mu.Unlock()
	})})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Another request takes the key over; the next renewal finds it lost.
		later := time.Now().Add(time.Minute)
		if _, claimed, err := s.Claim(context.Background(), idem.ClaimRequest{
			Key: "k", Fingerprint: idem.FingerprintV3(r, []byte("{}")), Token: "taker",
			Now: later, LeaseUntil: later.Add(time.Minute), ExpiresAt: later.Add(time.Hour),
		}); !claimed || err != nil {
			t.Errorf("takeover: %v %v", claimed, err)
		}
		<-r.Context().Done()
		insertOrder(w, r)
	})))
	t.Cleanup(srv.Close)
	b := &bundle{server: srv, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}}
	wantProblem(t, b.post(t, "k", "{}"), http.StatusConflict, idem.CodeLeaseLost)
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(events) != fmt.Sprint([]idem.EventKind{idem.EventLeaseLost}) {
		t.Errorf("events = %v, want one lease_lost (reported once, from the request)", events)
	}
}

// A response larger than MaxStoredBody is not buffered past the limit: with a
// transaction it is discarded (and the request answered 500); without one the
// outcome is stored early, the body streams to the client, and retries get the
// response_too_large problem.
func TestOversizedResponseIsNotBuffered(t *testing.T) {
	// Not parallel: it measures the heap the process allocates.
	const chunk, chunks = 64 << 10, 1024 // 64 MiB
	write := func(w http.ResponseWriter, r *http.Request) {
		buf := make([]byte, chunk)
		w.WriteHeader(http.StatusOK)
		for range chunks {
			if _, err := w.Write(buf); err != nil {
				return
			}
		}
	}
	allocated := func(f func()) uint64 {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		f()
		runtime.ReadMemStats(&after)
		return after.TotalAlloc - before.TotalAlloc
	}
	const most = 24 << 20
	t.Run("transaction", func(t *testing.T) {
		s, b := newTxBundle(t, nil, write)
		var a answer
		if n := allocated(func() { a = b.post(t, "k", "{}") }); n > most {
			t.Errorf("a 64 MiB answer over MaxStoredBody allocated %d MiB", n>>20)
		}
		wantProblem(t, a, http.StatusInternalServerError, idem.CodeResponseTooLarge)
		if _, err := s.Get(context.Background(), "", "k", time.Now()); !errors.Is(err, idem.ErrNotFound) {
			t.Fatalf("the key must be released: %v", err)
		}
	})
	t.Run("streamed", func(t *testing.T) {
		store := memstore.New(nil)
		t.Cleanup(func() { _ = store.Close() })
		mw, _ := idem.New(store, nil)
		srv := httptest.NewServer(mw(http.HandlerFunc(write)))
		t.Cleanup(srv.Close)
		var got int64
		var status int
		n := allocated(func() {
			req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader("{}"))
			req.Header.Set("Idempotency-Key", "big")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			status = resp.StatusCode
			got, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		})
		if status != http.StatusOK || got != chunk*chunks {
			t.Fatalf("first caller: %d, %d bytes; want 200 and all %d", status, got, chunk*chunks)
		}
		if n > most {
			t.Errorf("a 64 MiB streamed answer allocated %d MiB", n>>20)
		}
		b := &bundle{server: srv, client: &http.Client{}}
		wantProblem(t, b.post(t, "big", "{}"), http.StatusInternalServerError, idem.CodeResponseTooLarge)
	})
}

// hangUp sends a keyed POST and hangs up once the handler has started (a
// receive on started), as a client that times out does.
func hangUp(t *testing.T, url, key, body string, started <-chan struct{}) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	go func() {
		select {
		case <-started:
		case <-time.After(30 * time.Second):
		}
		cancel()
	}()
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	if resp, err := c.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("the client got an answer (%d); the test needs it to hang up while the handler runs", resp.StatusCode)
	}
}

// preferringStore prefers the single-transaction flow but cannot run it.
type preferringStore struct{ *memstore.Store }

func (preferringStore) PreferredFlow() idem.Flow { return idem.FlowSingleTx }

// FlowAuto picks a store's preferred flow only when the store can run it.
func TestFlowAutoFallsBack(t *testing.T) {
	t.Parallel()
	store := preferringStore{memstore.New(nil)}
	t.Cleanup(func() { _ = store.Close() })
	if _, err := idem.New(store, nil); err != nil {
		t.Fatalf("FlowAuto with a store that prefers a flow it cannot run: %v", err)
	}
	if _, err := idem.New(store, &idem.Config{Flow: idem.FlowSingleTx}); err == nil {
		t.Fatal("FlowSingleTx on a store that is no SingleTxStore was accepted")
	}
	if idem.FlowAuto.String() != "auto" || idem.FlowSingleTx.String() != "single-tx" {
		t.Errorf("Flow names: %v %v", idem.FlowAuto, idem.FlowSingleTx)
	}
}
