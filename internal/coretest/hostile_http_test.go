package idem_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// panicOnce is a ClaimObserver that panics the first time it sees kind.
type panicOnce struct {
	kind   idem.EventKind
	panics atomic.Int64
}

func (p *panicOnce) ObservesClaims() bool { return true }

func (p *panicOnce) Observe(_ context.Context, e idem.Event) {
	if e.Kind == p.kind && p.panics.Add(1) == 1 {
		panic(http.ErrAbortHandler)
	}
}

// An Observer that panics on the event that starts a request's hold on its key
// (EventClaimed, or EventTakenOver before it) must not leave the key held: the
// panic ends the request as a handler's panic does, the key is released (the
// single transaction rolled back), and the retry runs at once. Before the fix
// those events came before the cleanup was in place, so the claim stayed in
// flight for the whole lease (30 s) and the retry got 409 — under LapsedRefuse,
// 503 until an operator resolved the key.
func TestObserverPanicOnClaimReleasesTheKey(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name     string
		flow     idem.Flow
		kind     idem.EventKind
		takeOver bool // plant a lapsed in-flight record first
	}{
		{"claim-complete/claimed", idem.FlowClaimComplete, idem.EventClaimed, false},
		{"claim-complete/taken-over", idem.FlowClaimComplete, idem.EventTakenOver, true},
		{"single-tx/claimed", idem.FlowSingleTx, idem.EventClaimed, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			var store idem.Store
			if c.flow == idem.FlowSingleTx {
				store = newSQLiteStore(t)
			} else {
				store = newMem(t)
			}
			if c.takeOver {
				past := time.Now().Add(-time.Hour)
				_, claimed, err := store.Claim(context.Background(), idem.ClaimRequest{
					Key: "k", Fingerprint: "fp", Token: "crashed-holder-token-0",
					Now: past, LeaseUntil: past.Add(time.Second), ExpiresAt: past.Add(48 * time.Hour),
				})
				if err != nil || !claimed {
					t.Fatalf("planting a lapsed claim: %v %v", claimed, err)
				}
			}
			obs := &panicOnce{kind: c.kind}
			var runs atomic.Int64
			mw, err := idem.New(store, &idem.Config{
				Flow: c.flow, Observer: obs,
				FingerprintFunc: func(*http.Request, []byte) string { return "fp" },
			})
			if err != nil {
				t.Fatal(err)
			}
			srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				w.WriteHeader(http.StatusCreated)
			})))
			req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"item":"book"}`))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Idempotency-Key", "k")
			client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
			if resp, err := client.Do(req); err == nil {
				resp.Body.Close()
				t.Fatalf("the request whose Observer panicked got %d, want a dropped connection", resp.StatusCode)
			}
			if n := obs.panics.Load(); n != 1 {
				t.Fatalf("the Observer saw the %v event %d times, want 1", c.kind, n)
			}
			if a := postAnswer(t, srv, "k"); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "" {
				t.Fatalf("the retry: %d %s, want a fresh 201 (the key released)", a.status, a.body)
			}
			if a := postAnswer(t, srv, "k"); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "true" {
				t.Fatalf("the second retry: %d %s, want the replay", a.status, a.body)
			}
			if n := runs.Load(); n != 1 {
				t.Errorf("the handler ran %d times, want once", n)
			}
		})
	}
}

// A claimed handler cannot hijack the connection, neither through
// http.ResponseController (which unwraps the middleware's writer) nor by a type
// assertion: what it wrote on the raw connection could not be stored, and the
// empty 200 left behind was stored and replayed instead of the answer the
// client got. Before the fix the first answer was the handler's 201 "hi" on the
// hijacked connection, and the retry got 409 (the hijacked answer reached the
// client before the completion) or the replay of an empty 200.
func TestKeyedHandlerCannotHijack(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	mw, err := idem.New(newMem(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		hijack := http.NewResponseController(w).Hijack
		if strings.Contains(r.URL.Path, "assert") {
			hj, ok := w.(http.Hijacker)
			if !ok {
				w.WriteHeader(http.StatusNotImplemented)
				return
			}
			hijack = hj.Hijack
		}
		c, brw, err := hijack()
		if err != nil {
			if !errors.Is(err, http.ErrNotSupported) {
				t.Errorf("Hijack: %v, want an error wrapping http.ErrNotSupported", err)
			}
			w.WriteHeader(http.StatusNotImplemented)
			return
		}
		defer c.Close()
		_, _ = brw.WriteString("HTTP/1.1 201 Created\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi")
		_ = brw.Flush()
	})))
	for _, path := range []string{"/controller", "/assert"} {
		send := func() answer {
			req, err := http.NewRequest(http.MethodPost, srv.URL+path, strings.NewReader("{}"))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Idempotency-Key", "k"+path[1:])
			client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			return answer{resp.StatusCode, resp.Header, body}
		}
		first, retry := send(), send()
		if first.status != http.StatusNotImplemented {
			t.Errorf("%s: first answer %d %q, want the handler's 501 after a refused hijack", path, first.status, first.body)
		}
		if retry.status != first.status || string(retry.body) != string(first.body) || retry.header.Get(idem.ReplayedHeader) != "true" {
			t.Errorf("%s: the retry got %d %q (replayed %q), want the replay of %d %q", path, retry.status, retry.body, retry.header.Get(idem.ReplayedHeader), first.status, first.body)
		}
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("the handler ran %d times, want once per key", n)
	}
}

// A clock that jumps back while a request holds its key (or a record written
// by a server whose clock is ahead) makes the lease look far longer than Lease:
// the 409's Retry-After must still not exceed the lease (a lease is never
// renewed further ahead than that). Before the fix an hour's jump back told the
// client to come back in 3602 s.
func TestInFlightRetryAfterCappedAtLease(t *testing.T) {
	t.Parallel()
	var offset atomic.Int64
	clock := func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }
	gate := make(chan struct{})
	started := make(chan struct{}, 1)
	mw, err := idem.New(newMem(t), &idem.Config{NowFunc: clock, Lease: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		<-gate
		w.WriteHeader(http.StatusCreated)
	})))
	first := make(chan answer, 1)
	go func() { first <- postAnswer(t, srv, "k") }()
	<-started
	offset.Store(int64(-time.Hour))
	a := postAnswer(t, srv, "k")
	close(gate)
	wantProblem(t, a, http.StatusConflict, idem.CodeKeyInUse)
	if ra := a.header.Get("Retry-After"); ra != "5" {
		t.Errorf("Retry-After = %q after the clock went back an hour, want 5 (the lease)", ra)
	}
	if a := <-first; a.status != http.StatusCreated {
		t.Errorf("the holder: %d %s, want 201", a.status, a.body)
	}
}

// A handler that writes a status net/http refuses (outside 100–999) panics as
// it would without idem, and leaves nothing behind. Before the fix a status of
// 1000 was stored first and only then sent, so net/http's panic came after the
// completion: the key stayed complete and every retry's replay panicked and
// dropped the connection until the record expired (24 h); a status under 100
// was stored and replayed as 200.
func TestInvalidStatusIsNotStored(t *testing.T) {
	t.Parallel()
	for _, code := range []int{1000, 99, 0} {
		var runs atomic.Int64
		mw, err := idem.New(newMem(t), nil)
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewUnstartedServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) == 1 {
				w.WriteHeader(code)
				_, _ = w.Write([]byte("x"))
				return
			}
			w.WriteHeader(http.StatusCreated)
		})))
		srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the handler's panic
		srv.Start()
		t.Cleanup(srv.Close)
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"item":"book"}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Idempotency-Key", "k")
		client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			t.Errorf("WriteHeader(%d): the first request got %d, want a dropped connection", code, resp.StatusCode)
		}
		if a := postAnswer(t, srv, "k"); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "" {
			t.Errorf("WriteHeader(%d): the retry got %d (replayed %q), want a fresh 201", code, a.status, a.header.Get(idem.ReplayedHeader))
		}
	}
}

// The request body is read whole before the key is touched: at MaxRequestBody
// it passes and one byte more is 413, with and without Content-Length (chunked);
// a client that sends half its body and stalls holds nothing, so a second
// request with the key runs meanwhile and the stalled one, once its body is
// complete, hears that outcome; one that hangs up mid-body leaves the key free.
func TestBodyBoundsAndStalledBodies(t *testing.T) {
	t.Parallel()
	const max = 64
	b := setup(t, &idem.Config{MaxRequestBody: max}, &orders{})
	for _, chunked := range []bool{false, true} {
		for _, n := range []int{max - 1, max, max + 1} {
			body := strings.Repeat("x", n)
			var r io.Reader = strings.NewReader(body)
			if chunked {
				r = io.MultiReader(strings.NewReader(body)) // no length known: sent chunked
			}
			req, err := http.NewRequest(http.MethodPost, b.server.URL+"/orders", r)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Idempotency-Key", fmt.Sprintf("b-%v-%d", chunked, n))
			resp, err := b.client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			got, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			a := answer{resp.StatusCode, resp.Header, got}
			if n > max {
				wantProblem(t, a, http.StatusRequestEntityTooLarge, idem.CodeBodyTooLarge)
			} else if a.status != http.StatusCreated || !strings.Contains(string(a.body), body) {
				t.Errorf("chunked %v, %d bytes: %d %s, want 201 with the body", chunked, n, a.status, a.body)
			}
		}
	}

	host := strings.TrimPrefix(b.server.URL, "http://")
	stalled, err := net.Dial("tcp", host)
	if err != nil {
		t.Fatal(err)
	}
	defer stalled.Close()
	body := `{"cart":"stalled"}`
	half := len(body) / 2
	fmt.Fprintf(stalled, "POST /orders HTTP/1.1\r\nHost: %s\r\nIdempotency-Key: stall\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", host, len(body), body[:half])
	// While its body stalls, the key is free: another request with it runs.
	if a := b.post(t, "stall", body); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "" {
		t.Fatalf("a request while another's body stalls: %d %s, want a fresh 201", a.status, a.body)
	}
	if _, err := io.WriteString(stalled, body[half:]); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(stalled), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || resp.Header.Get(idem.ReplayedHeader) != "true" {
		t.Errorf("the stalled request once its body arrived: %d (replayed %q), want the replay", resp.StatusCode, resp.Header.Get(idem.ReplayedHeader))
	}

	// A client that hangs up mid-body leaves the key free.
	gone, err := net.Dial("tcp", host)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(gone, "POST /orders HTTP/1.1\r\nHost: %s\r\nIdempotency-Key: gone\r\nContent-Length: %d\r\n\r\n%s", host, len(body), body[:half])
	_ = gone.Close()
	if a := b.post(t, "gone", body); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "" {
		t.Errorf("after a client hung up mid-body: %d %s, want a fresh 201", a.status, a.body)
	}
	if n := b.orders.runs.Load(); n != 6 {
		t.Errorf("the handler ran %d times, want 6 (4 bodies within the bound, the stalled key once, the hung-up key once)", n)
	}
}
