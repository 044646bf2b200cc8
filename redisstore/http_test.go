package redisstore_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/racetest"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/redisstore"
)

// orderHandler is a business handler: it counts its executions per key, records
// an "order" in Redis (the business database of this test) and answers 201 with
// a body unique to the execution, so that a replay can be told from a re-run.
type orderHandler struct {
	mu    sync.Mutex
	runs  map[string]int
	total atomic.Int64
	// record, when set, writes the order somewhere countable.
	record func(ctx context.Context, key, id string) error
	// gateKey, when set, names the key whose handler signals started and then
	// blocks until gate is closed. Set these before serving.
	gateKey string
	gate    chan struct{}
	started chan struct{}
	pause   time.Duration
}

func newOrderHandler() *orderHandler { return &orderHandler{runs: map[string]int{}} }

// serveOrders serves an orderHandler behind idem with cfg, keys in Redis
// through client, on a loopback server closed when t ends.
func serveOrders(t *testing.T, client *redis.Client, cfg *idem.Config) (*redisstore.Store, *orderHandler, *httptest.Server) {
	t.Helper()
	store, err := redisstore.New(client, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := newOrderHandler()
	mw, err := idem.New(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(h))
	t.Cleanup(srv.Close)
	return store, h, srv
}

func (h *orderHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	h.mu.Lock()
	h.runs[key]++
	h.mu.Unlock()
	n := h.total.Add(1)
	if h.gateKey != "" && key == h.gateKey {
		h.started <- struct{}{}
		<-h.gate
	}
	time.Sleep(h.pause)
	id := fmt.Sprintf("order-%d-%s", n, randomHex(4))
	if h.record != nil {
		if err := h.record(r.Context(), key, id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/orders/"+id)
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(map[string]string{"id": id})
}

func (h *orderHandler) runsOf(key string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.runs[key]
}

// TestRaceOverHTTP releases 100 requests with one key from a barrier, over
// loopback HTTP with one connection each, and then counts: the handler ran once,
// one order exists in Redis, every answer is the 201, its byte-identical replay,
// or 409.
func TestRaceOverHTTP(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	const n = 100
	ordersKey := tb.prefix + "orders"
	h := newOrderHandler()
	h.pause = 50 * time.Millisecond // keep the key in flight while the others arrive
	h.record = func(ctx context.Context, _, id string) error {
		return tb.client.RPush(ctx, ordersKey, id).Err()
	}
	events := &eventCounter{}
	mw, err := idem.New(tb.store, &idem.Config{Observer: events})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(h))
	defer srv.Close()

	key := "race-" + randomHex(8)
	results := racetest.Fire(n, racetest.Post(srv.URL+"/orders", key, []byte(`{"item":"book"}`), nil))
	var created []racetest.Result
	var replays []racetest.Result
	conflicts := 0
	for _, r := range results {
		if r.Err != nil {
			t.Fatalf("request failed: %v", r.Err)
		}
		switch {
		case r.Status == http.StatusCreated && r.Header.Get(idem.ReplayedHeader) == "true":
			replays = append(replays, r)
		case r.Status == http.StatusCreated:
			created = append(created, r)
		case r.Status == http.StatusConflict:
			conflicts++
			if r.Header.Get("Retry-After") == "" {
				t.Errorf("409 without Retry-After")
			}
		default:
			t.Errorf("unexpected answer %d: %s", r.Status, r.Body)
		}
	}
	if got := h.total.Load(); got != 1 {
		t.Fatalf("handler ran %d times for one key, want exactly 1", got)
	}
	if len(created) != 1 {
		t.Fatalf("%d first-time 201 answers, want 1", len(created))
	}
	orders, err := tb.client.LRange(context.Background(), ordersKey, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(orders) != 1 {
		t.Fatalf("%d orders stored in Redis, want 1: %q", len(orders), orders)
	}
	orig := created[0]
	checkReplay := func(r racetest.Result) {
		t.Helper()
		if !bytes.Equal(r.Body, orig.Body) || r.Header.Get("Location") != orig.Header.Get("Location") {
			t.Errorf("replay differs: %q %q, want %q %q", r.Body, r.Header.Get("Location"), orig.Body, orig.Header.Get("Location"))
		}
	}
	for _, r := range replays {
		checkReplay(r)
	}
	t.Logf("%d requests: 1 executed, %d replayed, %d got 409", n, len(replays), conflicts)

	if got := events.count(idem.EventExecuted); got != 1 {
		t.Errorf("%d executed events, want 1", got)
	}
	for _, k := range []idem.EventKind{idem.EventTakenOver, idem.EventStoreError, idem.EventLeaseLost} {
		if got := events.count(k); got != 0 {
			t.Errorf("%d %s events, want none", got, k)
		}
	}

	// Now that it is complete, every concurrent retry is a byte-identical replay.
	again := racetest.Fire(20, racetest.Post(srv.URL+"/orders", key, []byte(`{"item":"book"}`), nil))
	for _, r := range again {
		if r.Err != nil || r.Status != http.StatusCreated || r.Header.Get(idem.ReplayedHeader) != "true" {
			t.Fatalf("retry after completion: %d %v %q, want a 201 replay", r.Status, r.Err, r.Body)
		}
		checkReplay(r)
	}
	if got := h.total.Load(); got != 1 {
		t.Fatalf("handler ran %d times after the retries, want 1", got)
	}
	// In Redis: the order list and exactly one idem record, complete.
	keys := keysUnder(t, tb.client, tb.prefix)
	if len(keys) != 2 {
		t.Fatalf("keys under the prefix = %q, want the order list and one record", keys)
	}
	rec, err := tb.store.Get(context.Background(), "", key, time.Now())
	if err != nil || rec.State != idem.StateComplete || !bytes.Equal(rec.Response.Body, orig.Body) {
		t.Fatalf("stored record = %+v, %v; want complete with the first answer's body", rec, err)
	}
}

// eventCounter is an idem.Observer that counts events by kind.
type eventCounter struct {
	mu sync.Mutex
	n  map[idem.EventKind]int
}

func (c *eventCounter) Observe(_ context.Context, e idem.Event) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[idem.EventKind]int{}
	}
	c.n[e.Kind]++
}

func (c *eventCounter) count(k idem.EventKind) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[k]
}

type problemBody struct {
	Type   string `json:"type"`
	Status int    `json:"status"`
	Code   string `json:"code"`
}

// post sends one keyed POST on a fresh connection (no Transport re-sends).
func post(t *testing.T, url, key string) (status int, hdr http.Header, body []byte) {
	t.Helper()
	status, hdr, body, err := tryPost(url, key)
	if err != nil {
		t.Fatal(err)
	}
	return status, hdr, body
}

func tryPost(url, key string) (int, http.Header, []byte, error) {
	c := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader([]byte(`{"item":"pen"}`)))
	if err != nil {
		return 0, nil, nil, err
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, nil, fmt.Errorf("POST: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, nil, nil, fmt.Errorf("reading answer: %w", err)
	}
	return resp.StatusCode, resp.Header, body, nil
}

func wantUnavailable(t *testing.T, status int, hdr http.Header, body []byte) {
	t.Helper()
	var p problemBody
	if err := json.Unmarshal(body, &p); err != nil {
		t.Fatalf("answer %d %q is not a problem document: %v", status, body, err)
	}
	if status != http.StatusServiceUnavailable || p.Code != idem.CodeStoreUnavailable ||
		hdr.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("answer = %d %s (%s), want 503 problem %s", status, body, hdr.Get("Content-Type"), idem.CodeStoreUnavailable)
	}
}

// freePort returns a loopback TCP port that nothing listens on right now.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	return port
}

// TestStoreUnreachable points the store at a closed port: the middleware fails
// closed with a 503 problem and the handler never runs.
func TestStoreUnreachable(t *testing.T) {
	t.Parallel()
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(freePort(t)), DialTimeout: time.Second, DialerRetries: 1})
	defer client.Close()
	_, h, srv := serveOrders(t, client, nil)
	for i := range 3 {
		status, hdr, body := post(t, srv.URL, "down-"+strconv.Itoa(i))
		wantUnavailable(t, status, hdr, body)
	}
	if got := h.total.Load(); got != 0 {
		t.Fatalf("handler ran %d times with the store unreachable, want 0", got)
	}
}

// quietLogger drops go-redis's log lines: the outage tests make it fail to dial
// on purpose, and what matters is asserted on the answers.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

func TestMain(m *testing.M) {
	redis.SetLogger(quietLogger{})
	os.Exit(m.Run())
}

// privateRedis is a redis-server started by a test on its own port, without
// persistence, that the test may kill and restart.
type privateRedis struct {
	t    *testing.T
	port int
	dir  string
	args []string // extra server arguments
	cmd  *exec.Cmd
}

const redisServerBin = "/usr/bin/redis-server"

// needRedisServer skips the test when redis-server is not installed, unless
// IDEM_REQUIRE_SERVICES=1.
func needRedisServer(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(redisServerBin); err != nil {
		msg := redisServerBin + " is not installed (" + err.Error() + "); install redis-server to run this test"
		if testenv.Required() {
			t.Fatal(msg + " (IDEM_REQUIRE_SERVICES=1, so this is a failure)")
		}
		t.Skip(msg)
	}
}

// startPrivateRedis starts a redis-server on port (a free one when 0) with the
// extra arguments, and kills it when the test ends.
func startPrivateRedis(t *testing.T, port int, args ...string) *privateRedis {
	t.Helper()
	needRedisServer(t)
	if port == 0 {
		port = freePort(t)
	}
	p := &privateRedis{t: t, port: port, dir: t.TempDir(), args: args}
	p.start()
	t.Cleanup(p.kill)
	return p
}

func (p *privateRedis) addr() string { return "127.0.0.1:" + strconv.Itoa(p.port) }

func (p *privateRedis) start() {
	p.t.Helper()
	p.cmd = exec.Command(redisServerBin, "--port", strconv.Itoa(p.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", p.dir, "--logfile", "")
	p.cmd.Args = append(p.cmd.Args, p.args...)
	dieWithTest(p.cmd)
	p.cmd.Stdout, p.cmd.Stderr = io.Discard, io.Discard
	if err := p.cmd.Start(); err != nil {
		p.t.Fatalf("starting redis-server: %v", err)
	}
	c := redis.NewClient(&redis.Options{Addr: p.addr(), MaxRetries: -1, DialerRetries: 1})
	defer c.Close()
	deadline := time.Now().Add(15 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("private redis-server on %s did not answer PING: %v", p.addr(), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// kill ends the server with SIGKILL (a crash, not a shutdown) and waits for it.
func (p *privateRedis) kill() {
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Kill()
	_ = p.cmd.Wait()
	p.cmd = nil
}

// TestRedisOutage runs requests against a private redis-server, kills it while
// a handler runs, checks that requests fail closed during the outage, restarts
// it on the same port and checks that requests succeed again.
func TestRedisOutage(t *testing.T) {
	t.Parallel()
	rs := startPrivateRedis(t, 0)
	client := redis.NewClient(&redis.Options{Addr: rs.addr(), DialTimeout: time.Second, DialerRetries: 1, ReadTimeout: 2 * time.Second})
	defer client.Close()
	_, h, srv := serveOrders(t, client, nil)
	h.gateKey, h.gate, h.started = "midway", make(chan struct{}), make(chan struct{}, 1)

	// Up: a request executes, its retry replays.
	if status, hdr, body := post(t, srv.URL, "before"); status != http.StatusCreated || hdr.Get(idem.ReplayedHeader) != "" {
		t.Fatalf("before the outage: %d %s, want 201", status, body)
	}
	if status, hdr, _ := post(t, srv.URL, "before"); status != http.StatusCreated || hdr.Get(idem.ReplayedHeader) != "true" {
		t.Fatalf("retry before the outage: %d, want a 201 replay", status)
	}

	// A handler is running when Redis dies: it finishes and its client gets the
	// answer, which could not be stored.
	midway := make(chan int, 1)
	go func() {
		status, _, body, err := tryPost(srv.URL, "midway")
		if err != nil {
			t.Errorf("request in flight at the crash: %v", err)
		} else if status != http.StatusCreated {
			t.Errorf("request in flight at the crash got %d %s, want the handler's 201", status, body)
		}
		midway <- status
	}()
	select {
	case <-h.started:
	case <-time.After(30 * time.Second):
		t.Fatal("the handler did not start")
	}
	rs.kill()
	close(h.gate)
	<-midway

	// Down: every request fails closed, nothing runs.
	runs := h.total.Load()
	for _, key := range []string{"before", "during-1", "during-2"} {
		status, hdr, body := post(t, srv.URL, key)
		wantUnavailable(t, status, hdr, body)
	}
	if got := h.total.Load(); got != runs {
		t.Fatalf("handler ran %d times during the outage, want 0", got-runs)
	}

	// Restarted on the same port: requests succeed again.
	rs.start()
	deadline := time.Now().Add(30 * time.Second)
	for {
		status, hdr, body := post(t, srv.URL, "after")
		if status == http.StatusCreated {
			break
		}
		wantUnavailable(t, status, hdr, body) // a pooled connection may still be broken
		if time.Now().After(deadline) {
			t.Fatal("requests still fail 30 s after Redis came back")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if got := h.runsOf("after"); got != 1 {
		t.Fatalf("handler ran %d times for the first key after recovery, want 1", got)
	}
	if status, hdr, _ := post(t, srv.URL, "after"); status != http.StatusCreated || hdr.Get(idem.ReplayedHeader) != "true" {
		t.Fatalf("retry after recovery: %d, want a 201 replay", status)
	}
	if got := h.runsOf("during-1") + h.runsOf("during-2"); got != 0 {
		t.Fatalf("handler ran %d times for keys sent during the outage", got)
	}
	// The documented limit: this server ran without persistence, so the records
	// written before the crash are gone, and a retry of them executes again.
	if status, hdr, _ := post(t, srv.URL, "before"); status != http.StatusCreated || hdr.Get(idem.ReplayedHeader) != "" || h.runsOf("before") != 2 {
		t.Errorf("retry of a record lost with a non-persistent Redis: %d replayed=%q runs=%d; want it to run again (see doc: Persistence)",
			status, hdr.Get(idem.ReplayedHeader), h.runsOf("before"))
	}
}
