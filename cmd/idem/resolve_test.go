package main

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// sqliteKeyStore opens the SQLite database at path and returns its migrated
// key store, closed when t ends.
func sqliteKeyStore(t *testing.T, path string, cfg *sqlitestore.Config) *sqlitestore.Store {
	t.Helper()
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	s, err := sqlitestore.New(db, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s
}

func TestResolveRefusals(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "keys.db")
	s := sqliteKeyStore(t, path, nil)
	ctx := context.Background()
	now := time.Now()
	claim := func(key string, lease time.Duration) {
		if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: "t1", Key: key, Fingerprint: "v2:x", Token: "tok-" + key, Now: now, LeaseUntil: now.Add(lease), ExpiresAt: now.Add(time.Hour)}); !ok || err != nil {
			t.Fatalf("claim %s: %v %v", key, ok, err)
		}
	}
	claim("live", time.Hour)
	claim("done", time.Hour)
	if err := s.Complete(ctx, "t1", "done", "tok-done", &idem.Response{Status: 201}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	dbURL := "sqlite:" + path
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"--scope", "t1", "--status", "201"}, 2, "exactly one KEY"},
		{[]string{"--scope", "t1", "live"}, 2, "--status N"},
		{[]string{"--scope", "t1", "--status", "201", "--release", "live"}, 2, "--status N"},
		{[]string{"--scope", "t1", "--status", "99", "live"}, 2, "200 to 599"},
		{[]string{"--scope", "t1", "--release", "--body", "x", "live"}, 2, "go with --status"},
		// A complete record that expires at once would let the next request run
		// the operation again, though resolve said it is replayed.
		{[]string{"--scope", "t1", "--status", "201", "--ttl", "0", "--force", "live"}, 2, "--ttl 0s"},
		{[]string{"--scope", "t1", "--status", "201", "--ttl", "-1h", "--force", "live"}, 2, "--ttl -1h"},
		{[]string{"--scope", "t1", "--release", "absent"}, 1, "no record"},
		{[]string{"--scope", "t1", "--release", "done"}, 1, "already complete"},
		{[]string{"--scope", "t1", "--release", "live"}, 1, "running now"},
		{[]string{"--scope", "t1", "--release", "--force", "live"}, 0, "released"},
	} {
		code, out, errOut := runIdem(t, dir, nil, append([]string{"resolve", "--db", dbURL}, c.args...)...)
		if code != c.code || !strings.Contains(out+errOut, c.want) {
			t.Errorf("idem resolve %v: exit %d, output %q; want exit %d and %q", c.args, code, out+errOut, c.code, c.want)
		}
	}
	if _, err := s.Get(ctx, "t1", "live", time.Now()); err != idem.ErrNotFound {
		t.Errorf("after --release --force: %v, want no record", err)
	}
}

// TestResolveLongTTL: the longest --ttl a duration can say (2562047h, 292
// years) lies past 2262, where a time no longer fits in int64 nanoseconds. The
// answer must still be stored and replayed, not wrap around into the past
// and expire at once (the next request would run the operation again).
func TestResolveLongTTL(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "keys.db")
	s := sqliteKeyStore(t, path, nil)
	ctx := context.Background()
	for _, ttl := range []string{"2000000h", "2562047h"} {
		key := "k-" + ttl
		now := time.Now().Add(-time.Minute)
		if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: "t1", Key: key, Fingerprint: "v2:x", Token: "tok", Now: now, LeaseUntil: now.Add(time.Second), ExpiresAt: now.Add(time.Hour)}); !ok || err != nil {
			t.Fatalf("claim: %v %v", ok, err)
		}
		code, out, errOut := runIdem(t, dir, nil, "resolve", "--db", "sqlite:"+path, "--scope", "t1", "--status", "201", "--ttl", ttl, key)
		if code != 0 {
			t.Fatalf("resolve --ttl %s: exit %d\n%s%s", ttl, code, out, errOut)
		}
		rec, err := s.Get(ctx, "t1", key, time.Now())
		if err != nil || rec.State != idem.StateComplete || rec.Response.Status != 201 {
			t.Fatalf("after resolve --ttl %s: %+v, %v; want the complete record with 201", ttl, rec, err)
		}
	}
}
