package redisstore_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/redisstore"
)

// replyLoser makes a go-redis client lose the reply of one command: the first
// request written that contains marker reaches Redis and runs there, its reply
// is read from the socket and thrown away, and the connection is closed, as
// when a connection dies after the server ran the command. go-redis then sees
// io.EOF, which it retries: it re-sends the command on a new connection.
type replyLoser struct {
	marker []byte
	fired  atomic.Bool
	mu     sync.Mutex
	lost   []byte // the reply that was thrown away
}

func (l *replyLoser) lostReply() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return string(l.lost)
}

type lossyConn struct {
	net.Conn
	l     *replyLoser
	armed atomic.Bool
}

func (c *lossyConn) Write(b []byte) (int, error) {
	if bytes.Contains(b, c.l.marker) && c.l.fired.CompareAndSwap(false, true) {
		c.armed.Store(true)
	}
	return c.Conn.Write(b)
}

func (c *lossyConn) Read(b []byte) (int, error) {
	if !c.armed.Load() {
		return c.Conn.Read(b)
	}
	buf := make([]byte, 64<<10)
	n, _ := c.Conn.Read(buf) // the command's reply: it ran
	c.l.mu.Lock()
	c.l.lost = append(c.l.lost, buf[:n]...)
	c.l.mu.Unlock()
	_ = c.Conn.Close()
	return 0, io.EOF
}

// lossyStore returns a store on its own client whose connections go through a
// replyLoser for marker, under tb's prefix.
func lossyStore(t *testing.T, tb *testBundle, marker string) (*redisstore.Store, *replyLoser) {
	t.Helper()
	opts, err := redis.ParseURL(testenv.RedisURL(t))
	if err != nil {
		t.Fatal(err)
	}
	l := &replyLoser{marker: []byte(marker)}
	opts.Dialer = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &lossyConn{Conn: c, l: l}, nil
	}
	client := redis.NewClient(opts)
	t.Cleanup(func() { _ = client.Close() })
	s, err := redisstore.New(client, &redisstore.Config{Prefix: tb.prefix})
	if err != nil {
		t.Fatal(err)
	}
	// Load the scripts into the server's cache, so that the command whose reply
	// is lost is the script itself, not an EVALSHA answered NOSCRIPT.
	warm := time.Now()
	wreq := idem.ClaimRequest{Scope: "warm", Key: "up", Fingerprint: "v1:w", Token: "warm", Now: warm, LeaseUntil: warm.Add(time.Minute), ExpiresAt: warm.Add(time.Hour)}
	if _, _, err := s.Claim(context.Background(), wreq); err != nil {
		t.Fatal(err)
	}
	if err := s.Extend(context.Background(), "warm", "up", "warm", warm, warm.Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(context.Background(), "warm", "up", "warm", &idem.Response{Status: 200}, warm, warm.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	return s, l
}

// TestReplyLost kills the connection after Redis ran a script and before its
// reply arrived. go-redis re-sends the script; the re-run must report what the
// first run did, not a failure of its own making.
func TestReplyLost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("claim", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		token := "tok-lost-" + randomHex(8)
		s, l := lossyStore(t, tb, token)
		now := time.Now()
		req := idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:l", Token: token, Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
		rec, claimed, err := s.Claim(ctx, req)
		if !strings.HasPrefix(l.lostReply(), "$") {
			t.Fatalf("lost reply = %q, want the claim's created time (the script must have run)", l.lostReply())
		}
		if err != nil || !claimed || rec.Token != token {
			t.Fatalf("Claim whose reply was lost = %+v, %v, %v; want claimed", rec, claimed, err)
		}
	})

	t.Run("complete", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		body := "body-lost-" + randomHex(8)
		s, l := lossyStore(t, tb, body)
		now := time.Now()
		req := idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:l", Token: "tok-" + randomHex(8), Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
		if _, claimed, err := tb.store.Claim(ctx, req); err != nil || !claimed {
			t.Fatalf("Claim = %v, %v", claimed, err)
		}
		err := s.Complete(ctx, "s", "k", req.Token, &idem.Response{Status: 201, Body: []byte(body)}, now, now.Add(time.Hour))
		if got := l.lostReply(); got != ":1\r\n" {
			t.Fatalf("lost reply = %q, want :1 (the script completed the record)", got)
		}
		if err != nil {
			t.Errorf("Complete whose reply was lost and that go-redis re-sent: %v; want nil (the record was completed, by this very call)", err)
		}
		rec, err := tb.store.Get(ctx, "s", "k", now)
		if err != nil || rec.State != idem.StateComplete || string(rec.Response.Body) != body {
			t.Fatalf("record = %+v, %v; want it complete with the body", rec, err)
		}
		// A second Complete call (not a re-send) is still refused.
		if err := tb.store.Complete(ctx, "s", "k", req.Token, &idem.Response{Status: 201, Body: []byte(body)}, now, now.Add(time.Hour)); !errors.Is(err, idem.ErrLockLost) {
			t.Errorf("second Complete call = %v, want ErrLockLost", err)
		}
	})

	t.Run("extend", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		token := "tok-lost-" + randomHex(8)
		now := time.Now()
		req := idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v1:l", Token: token, Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
		if _, claimed, err := tb.store.Claim(ctx, req); err != nil || !claimed {
			t.Fatalf("Claim = %v, %v", claimed, err)
		}
		s, l := lossyStore(t, tb, token)
		if err := s.Extend(ctx, "s", "k", token, now, now.Add(2*time.Hour)); err != nil {
			t.Errorf("Extend whose reply was lost: %v, want nil", err)
		}
		if got := l.lostReply(); got != ":1\r\n" {
			t.Fatalf("lost reply = %q, want :1", got)
		}
		if rec, err := tb.store.Get(ctx, "s", "k", now); err != nil || !rec.LeaseUntil.Equal(time.UnixMilli(now.Add(2*time.Hour).UnixMilli())) {
			t.Fatalf("record = %+v, %v; want the lease extended", rec, err)
		}
	})

	// Through the middleware: the lost reply of the completion is not a lost
	// lease (before the fix the re-sent script answered "lock lost" and the
	// middleware reported EventLeaseLost for an execution that was stored).
	t.Run("http", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		marker := "order-lost-" + randomHex(8)
		s, l := lossyStore(t, tb, marker)
		events := &eventCounter{}
		mw, err := idem.New(s, &idem.Config{Observer: events})
		if err != nil {
			t.Fatal(err)
		}
		runs := atomic.Int64{}
		srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			runs.Add(1)
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, marker)
		})))
		defer srv.Close()
		key := "k-" + randomHex(8)
		if status, _, body := post(t, srv.URL, key); status != http.StatusCreated || string(body) != marker {
			t.Fatalf("first request: %d %q", status, body)
		}
		if got := l.lostReply(); got != ":1\r\n" {
			t.Fatalf("lost reply = %q, want :1 (the completion ran)", got)
		}
		if status, hdr, body := post(t, srv.URL, key); status != http.StatusCreated || hdr.Get(idem.ReplayedHeader) != "true" || string(body) != marker {
			t.Fatalf("retry: %d %q replayed=%q, want the 201 replay", status, body, hdr.Get(idem.ReplayedHeader))
		}
		if runs.Load() != 1 {
			t.Errorf("handler ran %d times, want 1", runs.Load())
		}
		if n := events.count(idem.EventLeaseLost); n != 0 {
			t.Errorf("%d lease-lost events for a completion whose reply was lost, want 0", n)
		}
		if n := events.count(idem.EventExecuted); n != 1 {
			t.Errorf("%d executed events, want 1", n)
		}
	})
}

// TestSlowServer stalls a private Redis (DEBUG SLEEP, then CLIENT PAUSE WRITE)
// longer than the client's ReadTimeout while a Complete is on the wire. go-redis
// gives up on the attempt and re-sends the script on another connection; a
// stalled server still runs a command it had read once it wakes up (DEBUG
// SLEEP), while a paused one drops the command of a client that went away
// (CLIENT PAUSE). Whatever ran, Complete must not report a lost lock: it either
// succeeds or fails with a store error, and the record ends complete.
func TestSlowServer(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"debug-sleep", "client-pause"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			rs := startPrivateRedis(t, 0, "--enable-debug-command", "yes")
			ctx := context.Background()
			admin := redis.NewClient(&redis.Options{Addr: rs.addr()})
			defer admin.Close()
			client := slowServerClient(rs.addr())
			defer client.Close()
			s, err := redisstore.New(client, nil)
			if err != nil {
				t.Fatal(err)
			}
			now := time.Now()
			warm := idem.ClaimRequest{Scope: "s", Key: "warm", Fingerprint: "v1:slow", Token: "tok-" + randomHex(8), Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
			if _, claimed, err := s.Claim(ctx, warm); err != nil || !claimed {
				t.Fatalf("Claim = %v, %v", claimed, err)
			}
			if err := s.Complete(ctx, "s", "warm", warm.Token, &idem.Response{Status: 200}, now, now.Add(time.Hour)); err != nil {
				t.Fatal(err) // the scripts are in the server's cache now
			}
			req := warm
			req.Key, req.Token = "k", "tok-"+randomHex(8)
			if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
				t.Fatalf("Claim = %v, %v", claimed, err)
			}
			fillPool(t, client)
			if err := admin.ConfigResetStat(ctx).Err(); err != nil {
				t.Fatal(err)
			}
			stalled := stallServer(admin, mode)
			err = s.Complete(ctx, "s", "k", req.Token, &idem.Response{Status: 201, Body: []byte("done")}, now, now.Add(time.Hour))
			if e := <-stalled; e != nil {
				t.Fatalf("stalling the server: %v", e)
			}
			if errors.Is(err, idem.ErrLockLost) {
				t.Errorf("Complete across a %s longer than ReadTimeout: %v; the record was ours, want nil or a store error", mode, err)
			}
			var rec *idem.Record
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				var gerr error
				if rec, gerr = s.Get(ctx, "s", "k", now); gerr != nil {
					t.Fatalf("Get: %v", gerr)
				}
				if rec.State == idem.StateComplete || time.Now().After(deadline) {
					break
				}
			}
			if rec.State != idem.StateComplete || string(rec.Response.Body) != "done" {
				t.Errorf("record = %+v; want it complete", rec)
			}
			stats, _ := admin.Info(ctx, "commandstats").Result()
			t.Logf("%s: Complete = %v; the server ran %s", mode, err, evalCalls(stats))
		})
	}
}

// slowServerClient is a client that gives up on an answer after 100 ms and
// re-sends the command, up to 30 times, on another of its 16 connections. A
// busy service keeps idle, handshaken connections in its pool: each re-send
// goes out at once on one of them. A fresh connection would wait for its
// handshake, time out and end the retries, so fillPool fills the pool and it
// is never refilled in the background (MinIdleConns dials connections whose
// handshake waits for their first use, and go-redis hands out the newest idle
// one first).
func slowServerClient(addr string) *redis.Client {
	return redis.NewClient(&redis.Options{Addr: addr, ReadTimeout: 100 * time.Millisecond, MaxRetries: 30, PoolSize: 16})
}

// fillPool leaves the 16 connections of a slowServerClient idle and handshaken.
func fillPool(t *testing.T, client *redis.Client) {
	t.Helper()
	ctx := context.Background()
	held := make([]*redis.Conn, 16)
	for i := range held {
		held[i] = client.Conn()
		if err := held[i].Ping(ctx).Err(); err != nil {
			t.Fatalf("handshaking pool connection %d: %v", i, err)
		}
	}
	for _, c := range held {
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if idle := client.PoolStats().IdleConns; idle != 16 {
		t.Fatalf("the pool has %d idle connections, want 16", idle)
	}
}

// stallServer stalls the server through admin for 600 ms: "debug-sleep"
// (DEBUG SLEEP: the server runs what it had read once it wakes up) or
// "client-pause" (CLIENT PAUSE WRITE: it drops the commands of a client that
// went away). It returns when the server is stalled, with a channel that
// carries the stall's error.
func stallServer(admin *redis.Client, mode string) <-chan error {
	ctx := context.Background()
	stalled := make(chan error, 1)
	switch mode {
	case "debug-sleep":
		go func() { stalled <- admin.Do(ctx, "DEBUG", "SLEEP", "0.6").Err() }()
		time.Sleep(50 * time.Millisecond) // the server is asleep now (if not, the command simply runs at once)
	case "client-pause":
		stalled <- admin.Do(ctx, "CLIENT", "PAUSE", "600", "WRITE").Err()
	}
	return stalled
}

// evalCalls extracts the EVALSHA and EVAL call counts from INFO commandstats.
func evalCalls(info string) string {
	var out []string
	for _, line := range strings.Split(info, "\n") {
		for _, c := range []string{"cmdstat_evalsha:", "cmdstat_eval:"} {
			if rest, ok := strings.CutPrefix(strings.TrimSpace(line), c); ok {
				calls, _, _ := strings.Cut(rest, ",")
				out = append(out, strings.TrimSuffix(c, ":")[len("cmdstat_"):]+" "+calls)
			}
		}
	}
	if len(out) == 0 {
		return "no scripts"
	}
	return strings.Join(out, ", ")
}

// TestHostileInputs: scopes and keys that contain the separators a naive
// layout would use never share a record; a 16 MiB body with every byte value
// and non-UTF-8 header values come back byte for byte.
func TestHostileInputs(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	now := time.Now()
	pairs := [][2]string{{"a:b", "c"}, {"a", "b:c"}, {"a.b", "c"}, {"a", "b.c"}, {"a}", "{b"}, {"a", "}{b"}, {"é", "x"}}
	for i, p := range pairs {
		req := idem.ClaimRequest{Scope: p[0], Key: p[1], Fingerprint: "v1:" + strconv.Itoa(i), Token: "tok-" + randomHex(8), Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
		if rec, claimed, err := tb.store.Claim(ctx, req); err != nil || !claimed {
			t.Fatalf("Claim(%q, %q) = %+v, %v, %v; want its own record", p[0], p[1], rec, claimed, err)
		}
	}
	for i, p := range pairs {
		if rec, err := tb.store.Get(ctx, p[0], p[1], now); err != nil || rec.Fingerprint != "v1:"+strconv.Itoa(i) {
			t.Errorf("Get(%q, %q) = %+v, %v; want fingerprint v1:%d", p[0], p[1], rec, err, i)
		}
	}

	body := make([]byte, 16<<20)
	for i := range body {
		body[i] = byte(i * 7)
	}
	hdr := http.Header{"Content-Disposition": {"attachment; filename=\"caf\xe9\xff\x00.txt\""}, "X-Raw": {"\x80\xfe", ""}}
	req := idem.ClaimRequest{Scope: "big", Key: "k", Fingerprint: "v1:big", Token: "tok-" + randomHex(8), Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
	if _, claimed, err := tb.store.Claim(ctx, req); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	if err := tb.store.Complete(ctx, "big", "k", req.Token, &idem.Response{Status: 201, Header: hdr, Body: body}, now, now.Add(time.Hour)); err != nil {
		t.Fatalf("Complete with a 16 MiB body: %v", err)
	}
	other := req
	other.Token = "tok-" + randomHex(8)
	rec, claimed, err := tb.store.Claim(ctx, other)
	if err != nil || claimed {
		t.Fatalf("Claim of the complete record = %v, %v", claimed, err)
	}
	if !bytes.Equal(rec.Response.Body, body) {
		t.Errorf("16 MiB body came back changed (%d bytes)", len(rec.Response.Body))
	}
	for name, vals := range hdr {
		if got := rec.Response.Header[name]; len(got) != len(vals) || strings.Join(got, "\n") != strings.Join(vals, "\n") {
			t.Errorf("header %s = %q, want %q byte for byte", name, got, vals)
		}
	}
}
