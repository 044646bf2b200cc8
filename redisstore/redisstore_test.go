package redisstore_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/storetest"
)

var (
	_ idem.Store             = (*redisstore.Store)(nil)
	_ storetest.SelfExpiring = (*redisstore.Store)(nil)
)

// testBundle is what a test needs to talk to the shared Redis under its own prefix.
type testBundle struct {
	client *redis.Client
	prefix string
	store  *redisstore.Store
}

// setup connects to the test Redis and returns a store under a fresh random
// prefix. Every key under the prefix is deleted when the test ends.
func setup(t testing.TB) *testBundle {
	t.Helper()
	opts, err := redis.ParseURL(testenv.RedisURL(t))
	if err != nil {
		t.Fatalf("IDEM_TEST_REDIS_URL: %v", err)
	}
	client := redis.NewClient(opts)
	prefix := "idemtest:" + randomHex(6) + ":"
	t.Cleanup(func() {
		deletePrefix(t, client, prefix)
		_ = client.Close()
	})
	store, err := redisstore.New(client, &redisstore.Config{Prefix: prefix})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return &testBundle{client: client, prefix: prefix, store: store}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// keysUnder lists the keys under prefix (SCAN, so it never blocks the server).
func keysUnder(t testing.TB, client redis.UniversalClient, prefix string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var keys []string
	iter := client.Scan(ctx, 0, globEscape(prefix)+"*", 1000).Iterator()
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	if err := iter.Err(); err != nil {
		t.Errorf("SCAN %s*: %v", prefix, err)
	}
	return keys
}

// deletePrefix deletes every key under prefix with SCAN + DEL.
func deletePrefix(t testing.TB, client redis.UniversalClient, prefix string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	keys := keysUnder(t, client, prefix)
	for len(keys) > 0 {
		n := min(len(keys), 500)
		if err := client.Del(ctx, keys[:n]...).Err(); err != nil {
			t.Errorf("cleaning up %s*: %v", prefix, err)
			return
		}
		keys = keys[n:]
	}
}

func globEscape(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`*?[]\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

func TestConformance(t *testing.T) {
	t.Parallel()
	setup(t) // skip early, once, when Redis is unreachable
	storetest.Run(t, func(t *testing.T) idem.Store {
		return setup(t).store
	})
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	defer client.Close()
	if _, err := redisstore.New(nil, nil); err == nil || !strings.Contains(err.Error(), "redis.NewClient") {
		t.Errorf("New(nil, nil) error = %v, want one that says how to make a client", err)
	}
	for _, p := range []string{"idem{", "a}b", "{x}:"} {
		if _, err := redisstore.New(client, &redisstore.Config{Prefix: p}); err == nil || !strings.Contains(err.Error(), "hash tag") {
			t.Errorf("New with Prefix %q: error = %v, want a hash tag error", p, err)
		}
	}
	cfg := &redisstore.Config{}
	if _, err := redisstore.New(client, cfg); err != nil {
		t.Fatalf("New with an empty Config: %v", err)
	}
	if cfg.Prefix != "" {
		t.Errorf("New modified the caller's Config: Prefix = %q", cfg.Prefix)
	}
	s, err := redisstore.New(client, nil)
	if err != nil {
		t.Fatalf("New(client, nil): %v", err)
	}
	if s.Prefix() != redisstore.DefaultPrefix {
		t.Errorf("Prefix() = %q, want the default %q", s.Prefix(), redisstore.DefaultPrefix)
	}
}

// TestKeyLayout checks the stored key: prefix, one hash tag that is exactly the
// encoded (scope, key) pair, whatever braces the tenant sends.
func TestKeyLayout(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	now := time.Now()
	pairs := [][2]string{
		{"tenant", "plain"},
		{"}{", "{}"},
		{"a}", "{b"},
		{"", "}"},
		{"{tag}", "x"},
	}
	seen := map[string]bool{}
	for _, p := range pairs {
		_, claimed, err := tb.store.Claim(ctx, idem.ClaimRequest{
			Scope: p[0], Key: p[1], Fingerprint: "v1:k", Token: randomHex(8),
			Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour),
		})
		if err != nil || !claimed {
			t.Fatalf("Claim(%q, %q) = %v, %v", p[0], p[1], claimed, err)
		}
	}
	keys := keysUnder(t, tb.client, tb.prefix)
	if len(keys) != len(pairs) {
		t.Fatalf("%d keys under the prefix, want %d (one per record): %q", len(keys), len(pairs), keys)
	}
	for _, k := range keys {
		rest, ok := strings.CutPrefix(k, tb.prefix)
		if !ok {
			t.Fatalf("key %q lacks the prefix %q", k, tb.prefix)
		}
		if !strings.HasPrefix(rest, "{") || !strings.HasSuffix(rest, "}") || strings.Count(rest, "{") != 1 || strings.Count(rest, "}") != 1 {
			t.Errorf("key %q: want exactly one hash tag spanning the encoded pair", k)
		}
		seen[k] = true
	}
	if len(seen) != len(pairs) {
		t.Errorf("keys collide: %q", keys)
	}
}

// TestSchema checks what a complete record looks like in Redis: one hash with
// the documented fields, and a Redis expiry at ExpiresAt (when the clocks agree).
func TestSchema(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	now := time.Now()
	req := idem.ClaimRequest{
		Scope: "s", Key: "k", Fingerprint: "v1:schema", Token: "tok-" + randomHex(8),
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour),
	}
	if _, _, err := tb.store.Claim(ctx, req); err != nil {
		t.Fatal(err)
	}
	keys := keysUnder(t, tb.client, tb.prefix)
	if len(keys) != 1 {
		t.Fatalf("keys = %q, want one", keys)
	}
	key := keys[0]
	wantExpiry := func(at time.Time) {
		t.Helper()
		got, err := tb.client.PExpireTime(ctx, key).Result()
		if err != nil {
			t.Fatalf("PEXPIRETIME: %v", err)
		}
		// The store sets a duration (ExpiresAt − Now) and the test's clock is
		// the server's, so the instant Redis computed is ExpiresAt within the
		// time the call took.
		if d := got - time.Duration(at.UnixMilli())*time.Millisecond; d < -time.Second || d > time.Second {
			t.Errorf("Redis expiry = %d ms, want ExpiresAt %d ms (± 1 s)", got/time.Millisecond, at.UnixMilli())
		}
	}
	wantExpiry(req.ExpiresAt)
	expires := now.Add(2 * time.Hour)
	resp := &idem.Response{Status: 201, Header: http.Header{"Location": {"/o/1"}}, Body: []byte("{}"), Ref: "o1"}
	if err := tb.store.Complete(ctx, "s", "k", req.Token, resp, now, expires); err != nil {
		t.Fatal(err)
	}
	wantExpiry(expires)
	fields, err := tb.client.HGetAll(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"state", "fp", "token", "created", "lease", "expires", "status", "headers", "body", "ref", "done"} {
		if _, ok := fields[f]; !ok {
			t.Errorf("field %q missing from %v", f, fields)
		}
	}
	if _, ok := fields["omitted"]; ok {
		t.Errorf("field omitted written for a stored body")
	}
	if fields["state"] != "2" || fields["body"] != "{}" || fields["expires"] != strconv.FormatInt(expires.UnixMilli(), 10) {
		t.Errorf("fields = %v", fields)
	}
}

// TestClaimRetried covers a claim command that go-redis re-sends after its first
// reply was lost: the second run finds the record held under its own token and
// reports the claim as won, once, instead of a 409 against itself.
func TestClaimRetried(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	now := time.Now()
	req := idem.ClaimRequest{
		Scope: "s", Key: "k", Fingerprint: "v1:retry", Token: "tok-" + randomHex(8),
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour),
	}
	first, claimed, err := tb.store.Claim(ctx, req)
	if err != nil || !claimed {
		t.Fatalf("first Claim = %v, %v", claimed, err)
	}
	again, claimed, err := tb.store.Claim(ctx, req)
	if err != nil || !claimed {
		t.Fatalf("re-sent Claim = %v, %v; want claimed (it is the same claim)", claimed, err)
	}
	if !again.CreatedAt.Equal(first.CreatedAt) || again.Token != req.Token {
		t.Errorf("re-sent Claim returned %+v, want %+v", again, first)
	}
	other := req
	other.Token = "tok-" + randomHex(8)
	if _, claimed, err := tb.store.Claim(ctx, other); err != nil || claimed {
		t.Errorf("Claim with another token = %v, %v; want not claimed", claimed, err)
	}
}

// TestMalformedRecord: a key under the prefix that this package did not write
// gives an error that says what to do, not a panic or a bogus record.
func TestMalformedRecord(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	now := time.Now()
	req := idem.ClaimRequest{
		Scope: "s", Key: "k", Fingerprint: "v1:m", Token: "tok",
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour),
	}
	if _, _, err := tb.store.Claim(ctx, req); err != nil {
		t.Fatal(err)
	}
	key := keysUnder(t, tb.client, tb.prefix)[0]
	if err := tb.client.HSet(ctx, key, "state", "2", "status", "201", "headers", "\x05garbage").Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := tb.store.Get(ctx, "s", "k", now); err == nil || !strings.Contains(err.Error(), "headers") {
		t.Errorf("Get of a corrupt record: err = %v, want a malformed headers error", err)
	}
	if err := tb.client.Set(ctx, key, "a string", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	req.Token = "tok2"
	if _, _, err := tb.store.Claim(ctx, req); err == nil || !strings.Contains(err.Error(), "Config.Prefix") {
		t.Errorf("Claim over a foreign key: err = %v, want a WRONGTYPE error naming Config.Prefix", err)
	}
	if _, err := tb.store.Get(ctx, "s", "k", now); err == nil || errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get over a foreign key: err = %v, want a store error", err)
	}
}

func TestDeleteExpiredIsNoop(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	now := time.Now()
	req := idem.ClaimRequest{
		Scope: "s", Key: "k", Fingerprint: "v1:j", Token: "tok",
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour),
	}
	if _, _, err := tb.store.Claim(ctx, req); err != nil {
		t.Fatal(err)
	}
	n, err := tb.store.DeleteExpired(ctx, now.Add(48*time.Hour), 100)
	if n != 0 || err != nil {
		t.Errorf("DeleteExpired = %d, %v; want 0, nil", n, err)
	}
	if got := len(keysUnder(t, tb.client, tb.prefix)); got != 1 {
		t.Errorf("%d keys after DeleteExpired, want 1 (it must not delete)", got)
	}
	if !tb.store.ExpiresRecordsItself() {
		t.Error("ExpiresRecordsItself() = false")
	}
}
