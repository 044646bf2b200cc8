package redisstore_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// recordKeyOf is the Redis key the store uses for (scope, key) under prefix
// (the documented layout).
func recordKeyOf(prefix, scope, key string) string {
	enc := base64.RawURLEncoding
	return prefix + "{" + enc.EncodeToString([]byte(scope)) + "." + enc.EncodeToString([]byte(key)) + "}"
}

// wantPTTL checks that key exists in Redis with a remaining time to live
// within [lo, hi].
func wantPTTL(t *testing.T, tb *testBundle, key string, lo, hi time.Duration, what string) {
	t.Helper()
	got, err := tb.client.PTTL(context.Background(), key).Result()
	if err != nil {
		t.Fatalf("%s: PTTL: %v", what, err)
	}
	if got < lo || got > hi {
		t.Errorf("%s: the record's Redis TTL is %v, want between %v and %v (got -2ns: the key is gone; -1ns: no expiry)", what, got, lo, hi)
	}
}

// TestSkewedClockStore drives the Store with a middleware clock two minutes
// behind and two minutes ahead of the clock of the machine Redis runs on, with a
// one-minute TTL. Redis must keep every record for ExpiresAt − Now of its own
// time: behind, an absolute PEXPIREAT would lie in Redis's past and delete a
// live claim at once; ahead, it would keep the record three minutes.
func TestSkewedClockStore(t *testing.T) {
	t.Parallel()
	for _, skew := range []time.Duration{-2 * time.Minute, 2 * time.Minute} {
		t.Run(skew.String(), func(t *testing.T) {
			t.Parallel()
			tb := setup(t)
			ctx := context.Background()
			const ttl, lease = time.Minute, 30 * time.Second
			now := time.Now().Add(skew)
			req := idem.ClaimRequest{
				Scope: "s", Key: "k", Fingerprint: "v1:skew", Token: "tok-" + randomHex(8),
				Now: now, LeaseUntil: now.Add(lease), ExpiresAt: now.Add(ttl),
			}
			if _, claimed, err := tb.store.Claim(ctx, req); err != nil || !claimed {
				t.Fatalf("Claim = %v, %v", claimed, err)
			}
			rk := recordKeyOf(tb.prefix, "s", "k")
			wantPTTL(t, tb, rk, ttl-5*time.Second, ttl, "after Claim")
			if rec, err := tb.store.Get(ctx, "s", "k", now); err != nil || rec.State != idem.StateInFlight {
				t.Fatalf("Get after Claim = %+v, %v; want the in-flight record", rec, err)
			}
			other := req
			other.Token = "tok-" + randomHex(8)
			if rec, claimed, err := tb.store.Claim(ctx, other); err != nil || claimed || rec.Token != req.Token {
				t.Fatalf("second Claim = %+v, %v, %v; want the live claim to win", rec, claimed, err)
			}

			// Extend to a lease past the expiry: the Redis TTL follows the lease
			// (kept for one more lease, for a late renewal).
			now = time.Now().Add(skew)
			if err := tb.store.Extend(ctx, "s", "k", req.Token, now, now.Add(2*ttl)); err != nil {
				t.Fatalf("Extend: %v", err)
			}
			wantPTTL(t, tb, rk, 4*ttl-5*time.Second, 4*ttl, "after Extend past the TTL")

			now = time.Now().Add(skew)
			if err := tb.store.Complete(ctx, "s", "k", req.Token, &idem.Response{Status: 201, Body: []byte("ok")}, now, now.Add(ttl)); err != nil {
				t.Fatalf("Complete: %v", err)
			}
			wantPTTL(t, tb, rk, ttl-5*time.Second, ttl, "after Complete")
			if rec, err := tb.store.Get(ctx, "s", "k", now); err != nil || rec.State != idem.StateComplete {
				t.Fatalf("Get after Complete = %+v, %v; want the complete record", rec, err)
			}
		})
	}
}

// TestSkewedClockHTTP runs the middleware, over a real loopback server, with a
// clock two minutes behind and two minutes ahead of the real one and a TTL of
// one minute: a retry that arrives while the handler runs gets 409 and the
// handler runs once; Redis keeps the record for the TTL, no more, no less.
func TestSkewedClockHTTP(t *testing.T) {
	t.Parallel()
	for _, skew := range []time.Duration{-2 * time.Minute, 2 * time.Minute} {
		t.Run(skew.String(), func(t *testing.T) {
			t.Parallel()
			tb := setup(t)
			const ttl = time.Minute
			key := "skew-" + randomHex(8)
			h := newGatedHandler()
			mw, err := idem.New(tb.store, &idem.Config{TTL: ttl, NowFunc: func() time.Time { return time.Now().Add(skew) }})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(mw(h))
			defer srv.Close()
			defer h.open() // before srv.Close, which waits for the handlers

			first := make(chan int, 1)
			go func() {
				status, _, body, err := tryPost(srv.URL, key)
				if err != nil {
					t.Errorf("first request: %v", err)
				} else if status != http.StatusCreated {
					t.Errorf("first request: %d %s, want 201", status, body)
				}
				first <- status
			}()
			select {
			case <-h.started:
			case <-time.After(30 * time.Second):
				t.Fatal("the handler did not start")
			}
			rk := recordKeyOf(tb.prefix, "", key)
			wantPTTL(t, tb, rk, ttl-5*time.Second, ttl, "while the handler runs")
			if status, _, body := post(t, srv.URL, key); status != http.StatusConflict {
				t.Errorf("retry while the handler runs: %d %s, want 409", status, body)
			}
			h.open()
			<-first
			if got := h.runs.Load(); got != 1 {
				t.Fatalf("handler ran %d times, want 1", got)
			}
			wantPTTL(t, tb, rk, ttl-5*time.Second, ttl, "after completion")
			if status, hdr, body := post(t, srv.URL, key); status != http.StatusCreated || hdr.Get(idem.ReplayedHeader) != "true" {
				t.Errorf("retry after completion: %d %s (replayed %q), want a 201 replay", status, body, hdr.Get(idem.ReplayedHeader))
			}
			if got := h.runs.Load(); got != 1 {
				t.Fatalf("handler ran %d times after the retries, want 1", got)
			}
		})
	}
}

// TestLeaseOutlivesTTL: a handler that runs far past the TTL (lease 50 ms,
// renewed every ~17 ms, TTL 150 ms, handler 500 ms) keeps its record: a retry at
// 300 ms gets 409, never a second execution, and the key exists in Redis all
// along.
//
// A 50 ms lease lapses for real when a loaded machine delays a renewal by more
// than that; that is the lease working, not the store failing. So an attempt in
// which a renewal came more than a lease after the previous one (before the
// first failed renewal or the retry) is not judged and is run again, up to five
// times; an attempt whose renewals were on time is judged strictly.
func TestLeaseOutlivesTTL(t *testing.T) {
	t.Parallel()
	const lease = 50 * time.Millisecond
	var starved []string
	for range 5 {
		a := leaseAttempt(t, lease)
		if a.starved {
			starved = append(starved, a.renewals)
			continue
		}
		if a.status != http.StatusConflict {
			t.Errorf("retry %v into a 500 ms handler (TTL 150 ms): %d %s, want 409", a.retryAt.Round(time.Millisecond), a.status, a.body)
		}
		if a.runs != 1 {
			t.Errorf("handler ran %d times, want 1", a.runs)
		}
		if a.absent > 0 {
			t.Errorf("the record was absent from Redis in %d of %d polls while its handler ran (first at %v)", a.absent, a.polls, a.firstAbsence.Round(time.Millisecond))
		}
		if a.polls < 10 {
			t.Errorf("only %d polls of the key while the handler ran", a.polls)
		}
		if t.Failed() {
			t.Logf("renewals (ms after the handler started: error): %s", a.renewals)
		}
		return
	}
	t.Fatalf("in 5 attempts a renewal always came more than a lease (%v) late; the machine is too loaded to run this test. Renewals:\n%s", lease, strings.Join(starved, "\n"))
}

type leaseOutcome struct {
	status       int
	body         []byte
	retryAt      time.Duration
	runs         int
	polls        int64
	absent       int64
	firstAbsence time.Duration
	starved      bool
	renewals     string
}

func leaseAttempt(t *testing.T, lease time.Duration) leaseOutcome {
	tb := setup(t)
	store := &extendLog{Store: tb.store}
	h := newOrderHandler()
	h.pause = 500 * time.Millisecond
	key := "long-" + randomHex(8)
	h.gateKey, h.gate, h.started = key, make(chan struct{}), make(chan struct{}, 8)
	close(h.gate) // only the start signal is wanted
	mw, err := idem.New(store, &idem.Config{Lease: lease, TTL: 3 * lease})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(h))
	defer srv.Close()

	first := make(chan struct{})
	go func() {
		defer close(first)
		status, _, body, err := tryPost(srv.URL, key)
		if err != nil {
			t.Errorf("first request: %v", err)
		} else if status != http.StatusCreated {
			t.Errorf("first request: %d %s, want 201", status, body)
		}
	}()
	select {
	case <-h.started:
	case <-time.After(30 * time.Second):
		t.Fatal("the handler did not start")
	}
	start := time.Now()

	// Watch the key until the first answer arrives (completion precedes it).
	rk := recordKeyOf(tb.prefix, "", key)
	var out leaseOutcome
	var firstAbsence atomic.Int64
	var polls, absent atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-first:
				return
			default:
			}
			n, err := tb.client.Exists(context.Background(), rk).Result()
			if err != nil {
				t.Errorf("EXISTS: %v", err)
				return
			}
			polls.Add(1)
			if n == 0 && absent.Add(1) == 1 {
				firstAbsence.Store(int64(time.Since(start)))
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()

	time.Sleep(6*lease - time.Since(start))
	out.retryAt = time.Since(start)
	out.status, _, out.body = post(t, srv.URL, key)
	<-first
	wg.Wait()
	out.runs = h.runsOf(key)
	out.polls, out.absent = polls.Load(), absent.Load()
	out.firstAbsence = time.Duration(firstAbsence.Load())
	out.starved, out.renewals = store.starved(start, start.Add(out.retryAt), lease)
	return out
}

// gatedHandler answers 201 with a body unique to the execution. Its first
// execution signals started and waits until open is called; later ones (which a
// correct store never lets happen for one key) answer at once, so that a failing
// test ends instead of hanging.
type gatedHandler struct {
	runs    atomic.Int64
	started chan struct{}
	gate    chan struct{}
	once    sync.Once
}

func newGatedHandler() *gatedHandler {
	return &gatedHandler{started: make(chan struct{}, 1), gate: make(chan struct{})}
}

func (h *gatedHandler) open() { h.once.Do(func() { close(h.gate) }) }

func (h *gatedHandler) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	if n := h.runs.Add(1); n == 1 {
		h.started <- struct{}{}
		<-h.gate
	}
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write([]byte("order-" + randomHex(8)))
}

// extendLog is an idem.Store that records when Extend was called and what it
// returned.
type extendLog struct {
	idem.Store
	mu    sync.Mutex
	calls []extendCall
}

type extendCall struct {
	at  time.Time
	err error
}

func (l *extendLog) Extend(ctx context.Context, scope, key, token string, now, leaseUntil time.Time) error {
	err := l.Store.Extend(ctx, scope, key, token, now, leaseUntil)
	l.mu.Lock()
	l.calls = append(l.calls, extendCall{at: time.Now(), err: err})
	l.mu.Unlock()
	return err
}

// starved reports whether a renewal of the first claim came more than lease
// after the previous one (or after start), counting the renewals until the
// first failed one or until retryAt, and lists them.
func (l *extendLog) starved(start, retryAt time.Time, lease time.Duration) (bool, string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b strings.Builder
	prev, starved, judged := start, false, true
	for _, c := range l.calls {
		fmt.Fprintf(&b, "%d:%v ", c.at.Sub(start).Milliseconds(), c.err)
		if !judged {
			continue
		}
		if c.at.Sub(prev) > lease {
			starved = true
		}
		prev = c.at
		if c.err != nil || c.at.After(retryAt) {
			judged = false
		}
	}
	if judged && retryAt.Sub(prev) > lease {
		starved = true // the lease had lapsed when the retry came
	}
	return starved, b.String()
}

// TestLateRenewal: a renewal that arrives after its lease deadline, with no other
// request having taken the key over meanwhile (a stalled application, a slow
// network), still finds the record and keeps it, as in the SQL stores whose row
// stays stored past the deadline. Redis keeps an extended in-flight record one
// lease past its deadline for this.
func TestLateRenewal(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	// Long enough that the late Extend below lands within the lease Redis keeps
	// the record past its deadline on a loaded machine (1 s to spare; 100 ms
	// leases left 50 ms).
	const lease = 2 * time.Second
	now := time.Now()
	req := idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:late", Token: "tok-" + randomHex(8), Now: now, LeaseUntil: now.Add(lease), ExpiresAt: now.Add(lease)}
	if _, claimed, err := tb.store.Claim(ctx, req); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	now = time.Now()
	if err := tb.store.Extend(ctx, "s", "k", req.Token, now, now.Add(lease)); err != nil {
		t.Fatalf("Extend: %v", err)
	}
	time.Sleep(lease + lease/2) // the renewal every Lease/3 stalled for 1.5 leases
	now = time.Now()
	if err := tb.store.Extend(ctx, "s", "k", req.Token, now, now.Add(lease)); err != nil {
		t.Fatalf("late Extend, nobody having taken the key over: %v; want the record kept", err)
	}
	if rec, err := tb.store.Get(ctx, "s", "k", now); err != nil || rec.State != idem.StateInFlight || rec.Token != req.Token {
		t.Fatalf("after the late Extend: %+v, %v; want in flight under the token", rec, err)
	}
	if err := tb.store.Complete(ctx, "s", "k", req.Token, &idem.Response{Status: 201}, now, now.Add(time.Minute)); err != nil {
		t.Fatalf("Complete after the late Extend: %v", err)
	}
}
