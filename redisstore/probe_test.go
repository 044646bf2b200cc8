package redisstore_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/racetest"
	"github.com/idemkit/idem/redisstore"
)

// TestScriptCacheLost runs every script right after the server's script cache
// was emptied — SCRIPT FLUSH, and a restart of a Redis without persistence —
// and checks that each operation still works (EVALSHA's NOSCRIPT falls back to
// EVAL, which reloads the script), that the Redis expiry of the record follows
// each step (PTTL), and that a record lost with the restart makes the
// holder's Extend, Complete and Release report ErrLockLost, never a store
// error that would leave the key unusable.
func TestScriptCacheLost(t *testing.T) {
	t.Parallel()
	rs := startPrivateRedis(t, 0)
	client := redis.NewClient(&redis.Options{Addr: rs.addr(), DialTimeout: time.Second, ReadTimeout: 5 * time.Second})
	defer client.Close()
	store, err := redisstore.New(client, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	flush := func() {
		t.Helper()
		if err := client.ScriptFlush(ctx).Err(); err != nil {
			t.Fatalf("SCRIPT FLUSH: %v", err)
		}
	}
	pttl := func(key string, lo, hi time.Duration, what string) {
		t.Helper()
		got, err := client.PTTL(ctx, store.Prefix()+key).Result()
		if err != nil {
			t.Fatalf("%s: PTTL: %v", what, err)
		}
		if got < lo || got > hi {
			t.Fatalf("%s: PTTL = %v, want within [%v, %v]", what, got, lo, hi)
		}
	}
	// A binary 255-byte key with every character that means something to
	// Redis Cluster hash tags or glob patterns.
	scope := "tenant{*}?[a]"
	key := strings.Repeat("{}*?[\x00\xff", 40)[:255]
	recKey := func() string {
		t.Helper()
		keys, err := client.Keys(ctx, "*").Result()
		if err != nil || len(keys) != 1 {
			t.Fatalf("keys = %q, %v; want exactly one record", keys, err)
		}
		return strings.TrimPrefix(keys[0], store.Prefix())
	}

	now := time.Now()
	const lease, ttl = time.Minute, time.Hour
	claim := idem.ClaimRequest{Scope: scope, Key: key, Fingerprint: "v1:a", Token: "tok-" + randomHex(8), Now: now, LeaseUntil: now.Add(lease), ExpiresAt: now.Add(ttl)}
	flush()
	if _, claimed, err := store.Claim(ctx, claim); err != nil || !claimed {
		t.Fatalf("Claim after SCRIPT FLUSH = %v, %v", claimed, err)
	}
	rk := recKey()
	pttl(rk, ttl-10*time.Second, ttl, "after Claim")
	flush()
	if err := store.Extend(ctx, scope, key, claim.Token, now, now.Add(lease)); err != nil {
		t.Fatalf("Extend after SCRIPT FLUSH: %v", err)
	}
	pttl(rk, ttl-10*time.Second, ttl, "after an Extend within the TTL (never lowered)")
	// An Extend whose lease outruns the TTL raises the expiry to two leases.
	if err := store.Extend(ctx, scope, key, claim.Token, now, now.Add(2*ttl)); err != nil {
		t.Fatalf("Extend past the TTL: %v", err)
	}
	pttl(rk, 4*ttl-10*time.Second, 4*ttl, "after an Extend past the TTL")
	flush()
	if err := store.Complete(ctx, scope, key, claim.Token, &idem.Response{Status: 201, Body: []byte("ok")}, now, now.Add(ttl)); err != nil {
		t.Fatalf("Complete after SCRIPT FLUSH: %v", err)
	}
	pttl(rk, ttl-10*time.Second, ttl, "after Complete (the TTL from now, not the extended one)")
	if rec, err := store.Get(ctx, scope, key, now); err != nil || rec.State != idem.StateComplete || !bytes.Equal(rec.Response.Body, []byte("ok")) {
		t.Fatalf("Get = %+v, %v; want the complete record", rec, err)
	}
	flush()
	second := claim
	second.Token = "tok-" + randomHex(8)
	if rec, claimed, err := store.Claim(ctx, second); err != nil || claimed || rec.State != idem.StateComplete {
		t.Fatalf("Claim of the complete record = %+v, %v, %v; want it, not claimed", rec, claimed, err)
	}

	// A new in-flight claim, then Redis restarts without its data or scripts.
	client.Del(ctx, store.Prefix()+rk)
	third := claim
	third.Token = "tok-" + randomHex(8)
	if _, claimed, err := store.Claim(ctx, third); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	rs.kill()
	rs.start()
	// The pooled connections died with the server: go-redis may answer the
	// first command on each with an error. Nothing may stay broken for long.
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := store.Extend(ctx, scope, key, third.Token, now, now.Add(lease))
		if errors.Is(err, idem.ErrLockLost) {
			break
		}
		if err == nil {
			t.Fatal("Extend of a record the restart lost succeeded")
		}
		if time.Now().After(deadline) {
			t.Fatalf("Extend still fails 30 s after the restart: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := store.Complete(ctx, scope, key, third.Token, &idem.Response{Status: 201}, now, now.Add(ttl)); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("Complete of a lost record = %v, want ErrLockLost", err)
	}
	if err := store.Release(ctx, scope, key, third.Token); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("Release of a lost record = %v, want ErrLockLost", err)
	}
	// The documented effect: the key is absent, a retry claims it anew.
	fourth := claim
	fourth.Token = "tok-" + randomHex(8)
	if _, claimed, err := store.Claim(ctx, fourth); err != nil || !claimed {
		t.Fatalf("Claim after the restart = %v, %v; want the lost key claimed anew", claimed, err)
	}
	flush()
	if err := store.Release(ctx, scope, key, fourth.Token); err != nil {
		t.Fatalf("Release after SCRIPT FLUSH: %v", err)
	}
	if n, err := client.Exists(ctx, store.Prefix()+rk).Result(); err != nil || n != 0 {
		t.Fatalf("record still there after Release: %d, %v", n, err)
	}
}

// TestTwoInstancesRace releases 200 requests with one key from a barrier,
// alternating between two middleware instances that each have their own
// store and Redis client (two processes' worth of connection pools) on one
// Redis, while a janitor sweeps the store on each instance. The handler runs
// exactly once; every other answer is its byte-identical replay or a 409.
func TestTwoInstancesRace(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	h := newOrderHandler()
	h.pause = 50 * time.Millisecond
	var urls []string
	for range 2 {
		opts := *tb.client.Options()
		opts.PoolSize = 64
		client := redis.NewClient(&opts)
		defer client.Close()
		store, err := redisstore.New(client, &redisstore.Config{Prefix: tb.prefix})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			for ctx.Err() == nil {
				if n, err := store.DeleteExpired(ctx, time.Now().Add(24*time.Hour), 1000); n != 0 || err != nil {
					t.Errorf("DeleteExpired = %d, %v; want the no-op", n, err)
					return
				}
				time.Sleep(time.Millisecond)
			}
		}()
		mw, err := idem.New(store, nil)
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(mw(h))
		defer srv.Close()
		urls = append(urls, srv.URL)
	}
	key := "race2-" + randomHex(8)
	body := []byte(`{"item":"pen"}`) // what post sends
	results := racetest.Fire(200, func(i int) (*http.Request, error) {
		return racetest.Post(urls[i%2], key, body, nil)(i)
	})
	var first []byte
	var replays [][]byte
	for _, r := range results {
		switch {
		case r.Err != nil:
			t.Fatalf("request failed: %v", r.Err)
		case r.Status == http.StatusCreated && r.Header.Get(idem.ReplayedHeader) == "true":
			replays = append(replays, r.Body)
		case r.Status == http.StatusCreated:
			if first != nil {
				t.Fatal("two first-time 201 answers")
			}
			first = r.Body
		case r.Status == http.StatusConflict:
		default:
			t.Errorf("unexpected answer %d: %s", r.Status, r.Body)
		}
	}
	if got := h.total.Load(); got != 1 || first == nil {
		t.Fatalf("handler ran %d times for one key over two instances, want exactly 1 (first answer seen: %v)", got, first != nil)
	}
	for _, b := range replays {
		if !bytes.Equal(b, first) {
			t.Fatalf("replay %q differs from the first answer %q", b, first)
		}
	}
	// Once complete, both instances replay it.
	for i, u := range urls {
		if status, hdr, b := post(t, u, key); status != http.StatusCreated || hdr.Get(idem.ReplayedHeader) != "true" || !bytes.Equal(b, first) {
			t.Fatalf("instance %d after completion: %d replayed=%q %q", i, status, hdr.Get(idem.ReplayedHeader), b)
		}
	}
}

// TestRestartLosesInFlight restarts a Redis without persistence while a
// handler runs: its record is gone when the handler returns, so the
// completion is fenced out. As the README says of a store without a shared
// transaction, the handler's effects stand and its client hears its own
// answer (not a 409 claiming nothing was done, not a 503); and as the
// Persistence limit says, a retry runs the operation again.
func TestRestartLosesInFlight(t *testing.T) {
	t.Parallel()
	rs := startPrivateRedis(t, 0)
	client := redis.NewClient(&redis.Options{Addr: rs.addr(), DialTimeout: time.Second, ReadTimeout: 5 * time.Second})
	defer client.Close()
	_, h, srv := serveOrders(t, client, nil)
	h.gateKey, h.gate, h.started = "lost", make(chan struct{}), make(chan struct{}, 1)
	// Warm the pool's connections' view of the server, then run the request.
	if status, _, body := post(t, srv.URL, "warm"); status != http.StatusCreated {
		t.Fatalf("warm-up: %d %s", status, body)
	}
	type answer struct {
		status int
		hdr    http.Header
		body   []byte
		err    error
	}
	done := make(chan answer, 1)
	go func() {
		status, hdr, body, err := tryPost(srv.URL, "lost")
		done <- answer{status, hdr, body, err}
	}()
	<-h.started
	rs.kill()
	rs.start()
	// Wait until the store answers again, so the completion reaches the
	// restarted server rather than failing on a dead pooled connection.
	deadline := time.Now().Add(30 * time.Second)
	for client.Ping(context.Background()).Err() != nil {
		if time.Now().After(deadline) {
			t.Fatal("the restarted Redis does not answer")
		}
		time.Sleep(100 * time.Millisecond)
	}
	close(h.gate)
	a := <-done
	if a.err != nil {
		t.Fatalf("request in flight at the restart: %v", a.err)
	}
	if a.status != http.StatusCreated || a.hdr.Get(idem.ReplayedHeader) != "" {
		t.Fatalf("request whose record the restart lost heard %d %s, want its own 201", a.status, a.body)
	}
	if n, err := client.DBSize(context.Background()).Result(); err != nil || n != 0 {
		t.Fatalf("keys after the lost completion = %d, %v; want none (no record to replay)", n, err)
	}
	if status, hdr, body := post(t, srv.URL, "lost"); status != http.StatusCreated || hdr.Get(idem.ReplayedHeader) != "" || h.runsOf("lost") != 2 {
		t.Fatalf("retry after the lost record: %d replayed=%q runs=%d %s; want it to run again (Persistence limit)", status, hdr.Get(idem.ReplayedHeader), h.runsOf("lost"), body)
	}
}

// TestOutOfMemory fills a private Redis run as the docs ask (maxmemory with
// noeviction): a new request is refused with 503 idempotency_store_unavailable
// and its handler does not run; the store's error names the cause; and a key
// completed before Redis filled up still replays (reads are allowed).
func TestOutOfMemory(t *testing.T) {
	t.Parallel()
	rs := startPrivateRedis(t, 0, "--maxmemory-policy", "noeviction")
	client := redis.NewClient(&redis.Options{Addr: rs.addr(), DialTimeout: time.Second, ReadTimeout: 5 * time.Second})
	defer client.Close()
	store, h, srv := serveOrders(t, client, nil)
	if status, _, body := post(t, srv.URL, "before"); status != http.StatusCreated {
		t.Fatalf("before filling Redis: %d %s", status, body)
	}
	ctx := context.Background()
	now := time.Now()
	held := idem.ClaimRequest{Scope: "", Key: "held", Fingerprint: "v1:x", Token: "tok-" + randomHex(8), Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
	if _, claimed, err := store.Claim(ctx, held); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	// Well over the limit, so that no query buffer freed after a refused
	// command brings it back under: fill first, then lower maxmemory.
	if err := client.Set(ctx, "filler", strings.Repeat("x", 8<<20), 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := client.ConfigSet(ctx, "maxmemory", "4mb").Err(); err != nil {
		t.Fatal(err)
	}
	if err := client.Set(ctx, "probe", "x", 0).Err(); err == nil || !strings.HasPrefix(err.Error(), "OOM ") {
		t.Fatalf("SET on the full Redis = %v, want OOM", err)
	}
	_, _, err := store.Claim(ctx, idem.ClaimRequest{Scope: "", Key: "oom", Fingerprint: "v1:x", Token: "tok-" + randomHex(8), Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)})
	if err == nil || !strings.Contains(err.Error(), "maxmemory") || !strings.Contains(err.Error(), "noeviction") {
		t.Fatalf("Claim on a full Redis = %v; want an error naming maxmemory and noeviction", err)
	}
	t.Logf("Claim on a full Redis: %v", err)
	status, hdr, body := post(t, srv.URL, "during")
	wantUnavailable(t, status, hdr, body)
	if got := h.runsOf("during"); got != 0 {
		t.Fatalf("handler ran %d times on a full Redis, want 0", got)
	}
	if status, hdr, _ := post(t, srv.URL, "before"); status != http.StatusCreated || hdr.Get(idem.ReplayedHeader) != "true" {
		t.Fatalf("retry of a complete key on a full Redis: %d replayed=%q, want the 201 replay", status, hdr.Get(idem.ReplayedHeader))
	}

	// A request claimed before Redis filled up can neither renew nor complete:
	// a store error (never ErrLockLost, which would tell the holder another
	// request took over), and the record stays in flight, as after any failed
	// completion. Release, a deletion, still works.
	if err := store.Extend(ctx, "", "held", held.Token, now, now.Add(time.Minute)); err == nil || errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("Extend on a full Redis = %v; want a store error", err)
	}
	if err := store.Complete(ctx, "", "held", held.Token, &idem.Response{Status: 201}, now, now.Add(time.Hour)); err == nil || errors.Is(err, idem.ErrLockLost) || !strings.Contains(err.Error(), "maxmemory") {
		t.Fatalf("Complete on a full Redis = %v; want a store error naming maxmemory", err)
	}
	if rec, err := store.Get(ctx, "", "held", now); err != nil || rec.State != idem.StateInFlight {
		t.Fatalf("record after the refused completion = %+v, %v; want it still in flight", rec, err)
	}
	if err := store.Release(ctx, "", "held", held.Token); err != nil {
		t.Fatalf("Release on a full Redis = %v; want it to delete the record", err)
	}
	if n, err := client.Exists(ctx, recordKeyOf(store.Prefix(), "", "during")).Result(); err != nil || n != 0 {
		t.Fatalf("a refused claim left a record: %d, %v", n, err)
	}
}

// TestClaimOutlivesItsTimeout stalls Redis (DEBUG SLEEP) past the client's
// ReadTimeout while a Claim is on the wire, with no retries left: the
// middleware answers 503 and does not run the handler, but the server runs the
// claim when it wakes up. The key is then in flight with a token nobody holds,
// as after a crashed holder: retries hear 409 with a Retry-After no longer than
// the lease, and once the lease has lapsed a retry takes it over and runs the
// handler, once.
func TestClaimOutlivesItsTimeout(t *testing.T) {
	t.Parallel()
	rs := startPrivateRedis(t, 0, "--enable-debug-command", "yes")
	ctx := context.Background()
	admin := redis.NewClient(&redis.Options{Addr: rs.addr()})
	defer admin.Close()
	client := redis.NewClient(&redis.Options{Addr: rs.addr(), ReadTimeout: 100 * time.Millisecond, MaxRetries: -1, PoolSize: 4})
	defer client.Close()
	store, err := redisstore.New(client, nil)
	if err != nil {
		t.Fatal(err)
	}
	var clock atomic.Int64
	clock.Store(time.Now().UnixNano())
	const lease = 30 * time.Second
	h := newOrderHandler()
	mw, err := idem.New(store, &idem.Config{Lease: lease, NowFunc: func() time.Time { return time.Unix(0, clock.Load()) }})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(h))
	defer srv.Close()
	if status, _, body := post(t, srv.URL, "warm"); status != http.StatusCreated { // scripts cached, pool dialled
		t.Fatalf("warm-up: %d %s", status, body)
	}
	stalled := make(chan error, 1)
	go func() { stalled <- admin.Do(ctx, "DEBUG", "SLEEP", "3").Err() }()
	for { // wait until the server is asleep: a PING on a fresh connection times out
		c := redis.NewClient(&redis.Options{Addr: rs.addr(), ReadTimeout: 200 * time.Millisecond, MaxRetries: -1})
		err := c.Ping(ctx).Err()
		c.Close()
		if err != nil {
			break
		}
	}
	status, hdr, body := post(t, srv.URL, "orphan")
	wantUnavailable(t, status, hdr, body)
	if err := <-stalled; err != nil {
		t.Fatalf("DEBUG SLEEP: %v", err)
	}
	rec, err := store.Get(ctx, "", "orphan", time.Unix(0, clock.Load()))
	if err != nil {
		t.Skipf("the stalled claim did not run after the server woke (%v); nothing to check", err)
	}
	if rec.State != idem.StateInFlight {
		t.Fatalf("record = %+v, want in flight", rec)
	}
	status, hdr, body = post(t, srv.URL, "orphan")
	if status != http.StatusConflict {
		t.Fatalf("retry while the orphaned claim's lease runs: %d %s, want 409", status, body)
	}
	if ra, err := strconv.Atoi(hdr.Get("Retry-After")); err != nil || ra < 1 || time.Duration(ra)*time.Second > lease+time.Second {
		t.Fatalf("Retry-After = %q, want 1..%v seconds", hdr.Get("Retry-After"), lease)
	}
	clock.Add(int64(lease + time.Second))
	if status, hdr, body := post(t, srv.URL, "orphan"); status != http.StatusCreated || hdr.Get(idem.ReplayedHeader) != "" {
		t.Fatalf("retry after the lease lapsed: %d %s, want the handler's 201", status, body)
	}
	if got := h.runsOf("orphan"); got != 1 {
		t.Fatalf("handler ran %d times, want 1", got)
	}
}

// TestSlowServerOtherScripts is TestSlowServer for Claim, Extend and Release:
// the server stalls (DEBUG SLEEP, CLIENT PAUSE WRITE) longer than the client's
// ReadTimeout while the script is on the wire, and go-redis re-sends it. A
// Claim must not come back "not claimed" with its own record, an Extend must
// not report a lost lock, and a Release must leave the record gone (a re-sent
// Release may report ErrLockLost, which the middleware ignores).
func TestSlowServerOtherScripts(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"debug-sleep", "client-pause"} {
		for _, op := range []string{"claim", "extend", "release"} {
			t.Run(mode+"/"+op, func(t *testing.T) {
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
				req := idem.ClaimRequest{Scope: "s", Key: "warm", Fingerprint: "v1:slow", Token: "tok-" + randomHex(8), Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
				if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
					t.Fatalf("Claim = %v, %v", claimed, err)
				}
				if err := s.Extend(ctx, "s", "warm", req.Token, now, now.Add(time.Minute)); err != nil {
					t.Fatal(err)
				}
				if err := s.Release(ctx, "s", "warm", req.Token); err != nil {
					t.Fatal(err) // every script is in the server's cache now
				}
				req.Key, req.Token = "k", "tok-"+randomHex(8)
				if op != "claim" {
					if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
						t.Fatalf("Claim = %v, %v", claimed, err)
					}
				}
				fillPool(t, client)
				stalled := stallServer(admin, mode)
				var opErr error
				switch op {
				case "claim":
					var rec *idem.Record
					var claimed bool
					rec, claimed, opErr = s.Claim(ctx, req)
					if opErr == nil && !claimed {
						t.Errorf("Claim across a %s: not claimed, record %+v; a re-send must recognise its own claim", mode, rec)
					}
				case "extend":
					opErr = s.Extend(ctx, "s", "k", req.Token, now, now.Add(2*time.Minute))
					if errors.Is(opErr, idem.ErrLockLost) {
						t.Errorf("Extend across a %s: %v; the record was ours", mode, opErr)
					}
				case "release":
					opErr = s.Release(ctx, "s", "k", req.Token)
				}
				if e := <-stalled; e != nil {
					t.Fatalf("stalling the server: %v", e)
				}
				for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
					rec, err := s.Get(ctx, "s", "k", now)
					var ok bool
					switch op {
					case "claim":
						ok = err == nil && rec.Token == req.Token
					case "extend":
						ok = err == nil && rec.LeaseUntil.Equal(time.UnixMilli(now.Add(2*time.Minute).UnixMilli()))
					case "release":
						ok = errors.Is(err, idem.ErrNotFound)
					}
					if ok {
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("%s across a %s (%v): record = %+v, %v", op, mode, opErr, rec, err)
					}
				}
				t.Logf("%s across a %s: %v", op, mode, opErr)
			})
		}
	}
}
