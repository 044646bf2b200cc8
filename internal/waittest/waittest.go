// Package waittest is the middleware-level test of Config.InFlightWait shared
// by the store packages: duplicates of a running request, over real loopback
// sockets, get its outcome instead of 409 — in one middleware and across two
// middlewares with store handles of their own (as two processes would).
package waittest

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// Events counts the EventWaited events of one key, by outcome, and keeps the
// time each wait took.
type Events struct {
	mu     sync.Mutex
	key    string
	waits  map[idem.WaitOutcome]int
	kinds  map[idem.EventKind]int
	waited []time.Duration
	ch     chan idem.WaitOutcome
}

// NewEvents returns an Observer that counts the events of key.
func NewEvents(key string) *Events {
	return &Events{key: key, waits: map[idem.WaitOutcome]int{}, kinds: map[idem.EventKind]int{}, ch: make(chan idem.WaitOutcome, 100000)}
}

// Observe implements idem.Observer.
func (e *Events) Observe(_ context.Context, ev idem.Event) {
	if ev.Key != e.key {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.kinds[ev.Kind]++
	if ev.Kind == idem.EventWaited {
		e.waits[ev.Wait]++
		e.waited = append(e.waited, ev.Waited)
		e.ch <- ev.Wait
	}
}

// Waits returns the number of waits that ended with o.
func (e *Events) Waits(o idem.WaitOutcome) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.waits[o]
}

// Ended receives the outcome of every wait as it ends.
func (e *Events) Ended() <-chan idem.WaitOutcome { return e.ch }

// Answer is what a client got.
type Answer struct {
	Status     int
	Header     http.Header
	Body       []byte
	Err        error
	Took       time.Duration
	Replayed   bool
	RetryAfter int
}

// Client returns an HTTP client that opens as many connections as asked.
func Client() *http.Client {
	return &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, DisableKeepAlives: true}, Timeout: 2 * time.Minute}
}

// Post sends one keyed POST with body.
func Post(ctx context.Context, c *http.Client, url, key string, body []byte) Answer {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return Answer{Err: err}
	}
	req.Header.Set("Idempotency-Key", key)
	start := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		return Answer{Err: err, Took: time.Since(start)}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	a := Answer{Status: resp.StatusCode, Header: resp.Header, Body: b, Err: err, Took: time.Since(start)}
	a.Replayed = resp.Header.Get(idem.ReplayedHeader) == "true"
	a.RetryAfter, _ = strconv.Atoi(resp.Header.Get("Retry-After"))
	return a
}

// Gated is a handler that counts its executions, tells when one started, and
// answers an unusual body (every byte value, random bytes) with a Location
// once its gate opens.
type Gated struct {
	Runs    atomic.Int64
	Entered chan struct{}
	gate    chan struct{}
	once    sync.Once
	Body    []byte
}

// NewGated returns a closed-gate handler.
func NewGated() *Gated {
	body := make([]byte, 256+64)
	for i := range 256 {
		body[i] = byte(i)
	}
	_, _ = rand.Read(body[256:])
	return &Gated{Entered: make(chan struct{}, 1000), gate: make(chan struct{}), Body: body}
}

// Open lets every execution answer.
func (g *Gated) Open() { g.once.Do(func() { close(g.gate) }) }

func (g *Gated) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := g.Runs.Add(1)
	g.Entered <- struct{}{}
	<-g.gate
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Location", fmt.Sprintf("/orders/%d", n))
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write(g.Body)
}

// Server is a middleware over a store, serving h on a loopback socket, with
// an Observer of its own.
func Server(t testing.TB, store idem.Store, cfg idem.Config, h http.Handler) *httptest.Server {
	t.Helper()
	mw, err := idem.New(store, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(h))
	t.Cleanup(srv.Close)
	return srv
}

// Key returns a key of the test's own.
func Key(t testing.TB) string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("wait-%x", b)
}

// arrivals counts the requests that reached a server.
type arrivals struct {
	n    atomic.Int64
	next http.Handler
}

func (a *arrivals) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a.n.Add(1)
	a.next.ServeHTTP(w, r)
}

// Concurrent sends n requests with one key at the same moment, split over
// stores (one middleware and server per store, each with its own handle, as
// separate processes would be), while the first runs a handler held for
// about a second: one execution, n-1 byte-exact replays, no 409.
func Concurrent(t *testing.T, stores []idem.Store, flow idem.Flow, n int) {
	key := Key(t)
	ev := NewEvents(key)
	g := NewGated()
	defer g.Open()
	var urls []string
	var arrived []*arrivals
	for _, s := range stores {
		cfg := idem.Config{Flow: flow, InFlightWait: 5 * time.Second, Observer: ev, InFlightMaxWaitersPerKey: n}
		mw, err := idem.New(s, &cfg)
		if err != nil {
			t.Fatal(err)
		}
		a := &arrivals{next: mw(g)}
		srv := httptest.NewServer(a)
		t.Cleanup(srv.Close)
		urls = append(urls, srv.URL)
		arrived = append(arrived, a)
	}
	c := Client()
	body := []byte(`{"sku":"wait","qty":1}`)
	ctx := context.Background()
	first := make(chan Answer, 1)
	go func() { first <- Post(ctx, c, urls[0], key, body) }()
	<-g.Entered
	answers := make([]Answer, n-1)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			answers[i] = Post(ctx, c, urls[(i+1)%len(urls)], key, body)
		}()
	}
	close(start)
	// The handler runs on for a second after every duplicate reached a server:
	// without waiting, each would have had its 409 by then.
	for deadline := time.Now().Add(time.Minute); ; {
		var total int64
		for _, a := range arrived {
			total += a.n.Load()
		}
		if total >= int64(n) || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(time.Second)
	g.Open()
	wg.Wait()
	f := <-first
	if f.Err != nil || f.Status != http.StatusCreated || f.Replayed || !bytes.Equal(f.Body, g.Body) {
		t.Fatalf("first request: %d %v replayed=%v, want 201 with the handler's body", f.Status, f.Err, f.Replayed)
	}
	if runs := g.Runs.Load(); runs != 1 {
		t.Errorf("the handler ran %d times, want once", runs)
	}
	var conflicts, replays int
	for i, a := range answers {
		switch {
		case a.Err != nil:
			t.Errorf("duplicate %d: %v", i, a.Err)
		case a.Status == http.StatusConflict:
			conflicts++
		case a.Status == f.Status && a.Replayed && bytes.Equal(a.Body, f.Body) &&
			a.Header.Get("Location") == f.Header.Get("Location") && a.Header.Get("Content-Type") == f.Header.Get("Content-Type"):
			replays++
		default:
			t.Errorf("duplicate %d: %d replayed=%v Location %q body %d bytes, want the first answer replayed byte for byte", i, a.Status, a.Replayed, a.Header.Get("Location"), len(a.Body))
		}
	}
	if conflicts != 0 || replays != n-1 {
		t.Errorf("%d duplicates: %d byte-exact replays, %d × 409; want %d replays and no 409", n-1, replays, conflicts, n-1)
	}
	waited := ev.Waits(idem.WaitReplayed)
	if waited == 0 {
		t.Errorf("no duplicate waited for the outcome (EventWaited with WaitReplayed); events: %v", ev.waits)
	}
	t.Logf("%d of %d duplicates waited and were replayed (the rest came after the outcome); waits by outcome: %v", waited, n-1, ev.waits)
}

// ShortWait: with InFlightWait shorter than the handler, every duplicate gets
// 409 with a Retry-After within the lease, after waiting about InFlightWait
// (not less, and — by a generous bound — not much more).
func ShortWait(t *testing.T, store idem.Store, flow idem.Flow) {
	const n, wait, lease = 10, 300 * time.Millisecond, 20 * time.Second
	key := Key(t)
	ev := NewEvents(key)
	g := NewGated()
	srv := Server(t, store, idem.Config{Flow: flow, InFlightWait: wait, Lease: lease, Observer: ev}, g)
	defer g.Open() // before the server closes (cleanups run later)
	c := Client()
	body := []byte(`{}`)
	done := make(chan Answer, 1)
	go func() { done <- Post(context.Background(), c, srv.URL, key, body) }()
	<-g.Entered
	answers := make([]Answer, n)
	var wg sync.WaitGroup
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			answers[i] = Post(context.Background(), c, srv.URL, key, body)
		}()
	}
	wg.Wait()
	for i, a := range answers {
		if a.Err != nil || a.Status != http.StatusConflict {
			t.Errorf("duplicate %d: %d %v, want 409", i, a.Status, a.Err)
			continue
		}
		if a.RetryAfter < 1 || a.RetryAfter > int(lease/time.Second) {
			t.Errorf("duplicate %d: Retry-After %d, want 1 to %d (what is left of the lease)", i, a.RetryAfter, int(lease/time.Second))
		}
		if flow != idem.FlowSingleTx && a.RetryAfter < int(lease/time.Second)/2 {
			// The holder renews its lease: at least half of it is always left.
			t.Errorf("duplicate %d: Retry-After %d, want at least %d: the holder's lease is renewed", i, a.RetryAfter, int(lease/time.Second)/2)
		}
		if a.Took < wait {
			t.Errorf("duplicate %d answered after %v, before its InFlightWait (%v) ended", i, a.Took, wait)
		}
		if a.Took > wait+30*time.Second {
			t.Errorf("duplicate %d answered after %v: it waited far longer than InFlightWait (%v)", i, a.Took, wait)
		}
	}
	if got := ev.Waits(idem.WaitTimedOut); got != n {
		t.Errorf("%d waits timed out, want %d (%v)", got, n, ev.waits)
	}
	g.Open()
	if f := <-done; f.Status != http.StatusCreated {
		t.Errorf("the first request: %d, want 201", f.Status)
	}
}

// Many: n waiters on key; while they wait, the store still serves other
// keys (the waiters hold no connection), and each gets the replay. joins, when
// not nil, receives once for each request that starts waiting (the core's
// test hook): the waiters are then sent in batches of 100, each once the one
// before waits, so that the test is of the waiting, not of n claims at one
// moment; without it they are sent at once, and the check runs a second after
// every one reached the server.
//
// otherKey runs the check of another key; leave it false for SQLite, where the
// holder's transaction holds the database's one write lock.
func Many(t *testing.T, store idem.Store, flow idem.Flow, n int, key string, joins <-chan struct{}, otherKey bool) {
	ev := NewEvents(key)
	g := NewGated()
	a := &arrivals{}
	mw, err := idem.New(store, &idem.Config{Flow: flow, InFlightWait: 5 * time.Minute, Lease: 5 * time.Minute, Observer: ev, InFlightMaxWaitersPerKey: n, InFlightMaxWaiters: n})
	if err != nil {
		t.Fatal(err)
	}
	a.next = mw(g)
	srv := httptest.NewServer(a)
	t.Cleanup(srv.Close)
	defer g.Open()
	c := Client()
	body := []byte(`{}`)
	ctx := context.Background()
	first := make(chan Answer, 1)
	go func() { first <- Post(ctx, c, srv.URL, key, body) }()
	<-g.Entered
	answers := make([]Answer, n)
	var wg sync.WaitGroup
	const batch = 100
	for lo := 0; lo < n; lo += batch {
		hi := min(lo+batch, n)
		for i := lo; i < hi; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				answers[i] = Post(ctx, c, srv.URL, key, body)
			}()
		}
		if joins != nil {
			for range hi - lo {
				<-joins
			}
		}
	}
	if joins == nil {
		for deadline := time.Now().Add(2 * time.Minute); a.n.Load() < int64(n+1) && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(time.Second)
	}
	if otherKey {
		// While they wait: another key runs (in a server of its own, whose
		// handler's gate is open).
		other := NewGated()
		other.Open()
		osrv := Server(t, store, idem.Config{Flow: flow}, other)
		if a := Post(ctx, c, osrv.URL, Key(t), body); a.Status != http.StatusCreated {
			t.Errorf("another key while %d requests wait: %d %v %s, want 201 (the waiters must not hold the store's connections)", n, a.Status, a.Err, a.Body)
		}
	}
	g.Open()
	wg.Wait()
	<-first
	bad := 0
	for _, a := range answers {
		if a.Err != nil || !a.Replayed || !bytes.Equal(a.Body, g.Body) {
			if bad++; bad <= 5 {
				t.Errorf("a waiter got %d %v replayed=%v %.200s, want the replay", a.Status, a.Err, a.Replayed, a.Body)
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d waiters did not get the replay", bad, n)
	}
	if runs := g.Runs.Load(); runs != 1 {
		t.Errorf("the handler ran %d times, want once", runs)
	}
	t.Logf("%d waiters: %d waited and were replayed", n, ev.Waits(idem.WaitReplayed))
}

// WakeLatency measures, rounds times, the time from the holder's answer to
// each of waiters duplicates' answers, and returns p50 and p99.
func WakeLatency(t *testing.T, stores []idem.Store, flow idem.Flow, rounds, waiters int) (p50, p99 time.Duration) {
	var lat []time.Duration
	c := Client()
	for range rounds {
		key := Key(t)
		ev := NewEvents(key)
		g := NewGated()
		var done atomic.Int64 // Unix nanoseconds when the holder's handler returned
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			g.ServeHTTP(w, r)
			done.Store(time.Now().UnixNano())
		})
		var urls []string
		for _, s := range stores {
			urls = append(urls, Server(t, s, idem.Config{Flow: flow, InFlightWait: time.Minute, Observer: ev}, h).URL)
		}
		first := make(chan Answer, 1)
		go func() { first <- Post(context.Background(), c, urls[0], key, nil) }()
		<-g.Entered
		ends := make([]time.Time, waiters)
		var wg sync.WaitGroup
		for i := range waiters {
			wg.Add(1)
			go func() {
				defer wg.Done()
				Post(context.Background(), c, urls[(i+1)%len(urls)], key, nil)
				ends[i] = time.Now()
			}()
		}
		time.Sleep(300 * time.Millisecond)
		g.Open()
		wg.Wait()
		<-first
		t0 := time.Unix(0, done.Load())
		for _, e := range ends {
			lat = append(lat, e.Sub(t0))
		}
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	return lat[len(lat)/2], lat[len(lat)*99/100]
}
