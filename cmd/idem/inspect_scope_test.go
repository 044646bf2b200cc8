package main

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// claimIn claims key under scope in s with a lease that lapsed a minute ago
// (expiring in an hour), and completes it when complete.
func claimIn(t *testing.T, s idem.Store, scope, key string, complete bool) {
	t.Helper()
	ctx := context.Background()
	now := time.Now()
	tok := "tok-" + scope + "-" + key
	if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: scope, Key: key, Fingerprint: "v2:x", Token: tok, Now: now.Add(-2 * time.Minute), LeaseUntil: now.Add(-time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
		t.Fatalf("claim %s/%s: %v %v", scope, key, ok, err)
	}
	if complete {
		if err := s.Complete(ctx, scope, key, tok, &idem.Response{Status: 201}, now, now.Add(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestInspectHintsOtherScopes: a key that is not found in --scope (or without
// one) but has a record under other scopes is named with them, on every store;
// a key kept nowhere, or only in an expired record, gets no hint. inspect
// reported `no record … in scope ""` and nothing else.
func TestInspectHintsOtherScopes(t *testing.T) {
	t.Parallel()
	table := "insp_sc_" + cliRandHex(4)
	stores := sqlKeyStores(table)
	stores = append(stores, sqlKeyStore{"redis", func(t *testing.T) (string, idem.Store) {
		url := testenv.RedisURL(t)
		opts, err := redis.ParseURL(url)
		if err != nil {
			t.Fatal(err)
		}
		rdb := redis.NewClient(opts)
		t.Cleanup(func() { deleteRedisPrefix(t, url, table+":"); _ = rdb.Close() })
		s, err := redisstore.New(rdb, &redisstore.Config{Prefix: table + ":"})
		if err != nil {
			t.Fatal(err)
		}
		return url, s
	}})
	for _, c := range stores {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db, s := c.open(t)
			tbl := table
			var args []string
			if c.name == "redis" {
				tbl = table + ":" // --table is the Redis prefix
				orders := filepath.Join(t.TempDir(), "o.db")
				sqliteKeyStore(t, orders, nil) // --db must exist; the keys are in Redis
				args = []string{"--keys", db, "--db", "sqlite:" + orders}
			} else {
				args = []string{"--db", db}
			}
			args = append(args, "--table", tbl)
			claimIn(t, s, "acme", "k-shared", true)
			claimIn(t, s, "globex", "k-shared", false)
			claimIn(t, s, "acme", "k-other", true)
			ctx := context.Background()
			now := time.Now()
			if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: "initech", Key: "k-expired", Fingerprint: "v2:x", Token: "t", Now: now.Add(-3 * time.Hour), LeaseUntil: now.Add(-3 * time.Hour).Add(time.Minute), ExpiresAt: now.Add(-time.Hour)}); err != nil || !ok {
				t.Fatalf("claim expired: %v %v", ok, err)
			}
			inspect := func(extra ...string) (int, string) {
				code, out, stderr := runIdem(t, t.TempDir(), nil, append(append([]string{"inspect"}, args...), extra...)...)
				return code, out + stderr
			}
			code, out := inspect("k-shared") // no --scope
			if code != exitFailure || !strings.Contains(out, `but the key has a record under scope "acme", "globex" (as stored)`) || !strings.Contains(out, "--scope acme") || !strings.Contains(out, "no --scope was given") {
				t.Errorf("inspect without --scope: exit %d; want 1 and the scopes acme and globex named:\n%s", code, out)
			}
			code, out = inspect("--scope", "umbrella", "k-other")
			if code != exitFailure || !strings.Contains(out, `under scope "acme"`) || strings.Contains(out, "no --scope was given") {
				t.Errorf("inspect --scope umbrella: exit %d; want 1 and the scope acme named:\n%s", code, out)
			}
			// A scope kept as a digest is named as stored, with what to type instead.
			long := strings.Repeat("tenant-", 30)
			claimIn(t, s, idem.StoredScope(long), "k-long", true)
			code, out = inspect("k-long")
			if code != exitFailure || !strings.Contains(out, `under scope "`+idem.StoredScope(long)+`" (as stored): a digest`) || !strings.Contains(out, "the original value") {
				t.Errorf("inspect of a key under a digested scope: exit %d\n%s", code, out)
			}
			if code, out = inspect("--scope", long, "k-long"); code != exitOK {
				t.Errorf("inspect --scope <the long scope>: exit %d\n%s", code, out)
			}
			for _, k := range []string{"k-nowhere", "k-expired"} {
				if code, out = inspect("--scope", "acme", k); code != exitFailure || strings.Contains(out, "under scope") {
					t.Errorf("inspect %s: exit %d; want 1 and no hint:\n%s", k, code, out)
				}
			}
			if code, out = inspect("--scope", "acme", "k-shared"); code != exitOK || !strings.Contains(out, "state:       complete") {
				t.Errorf("inspect --scope acme k-shared: exit %d\n%s", code, out)
			}
		})
	}
}

// TestInspectResolvePrefixSchema: inspect and resolve find the key records'
// table by --prefix and --schema, as demo, migrate and gc name it (they had
// only --table).
func TestInspectResolvePrefixSchema(t *testing.T) {
	t.Parallel()
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		dbURL := newPostgresDatabase(t)
		if code, out, stderr := runIdem(t, t.TempDir(), nil, "migrate", "--db", dbURL, "--schema", "shop", "--prefix", "p_"); code != exitOK {
			t.Fatalf("migrate: exit %d\n%s%s", code, out, stderr)
		}
		pool, err := pgxpool.New(context.Background(), dbURL)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		s, err := pgstore.New(pool, &pgstore.Config{Table: "shop.p_idem_records"})
		if err != nil {
			t.Fatal(err)
		}
		checkPrefixSchema(t, s, []string{"--db", dbURL, "--schema", "shop", "--prefix", "p_"}, []string{"IDEM_DB=" + dbURL, "IDEM_SCHEMA=shop", "IDEM_PREFIX=p_"})
	})
	t.Run("sqlite", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(t.TempDir(), "p.db")
		s := sqliteKeyStore(t, path, &sqlitestore.Config{Table: "demo_idem_records"})
		checkPrefixSchema(t, s, []string{"--db", "sqlite:" + path, "--prefix", "demo_"}, []string{"IDEM_DB=sqlite:" + path, "IDEM_PREFIX=demo_"})
	})
}

// checkPrefixSchema seeds s, whose table the flags (or the environment env)
// name, and inspects and resolves its records.
func checkPrefixSchema(t *testing.T, s idem.Store, flags, env []string) {
	t.Helper()
	claimIn(t, s, "t1", "k-done", true)
	claimIn(t, s, "t1", "k-lapsed", false)
	claimIn(t, s, "t1", "k-env", false)
	dir := t.TempDir()
	run := func(env []string, args ...string) (int, string) {
		code, out, stderr := runIdem(t, dir, env, args...)
		return code, out + stderr
	}
	if code, out := run(nil, append(append([]string{"inspect"}, flags...), "--scope", "t1", "k-done")...); code != exitOK || !strings.Contains(out, "state:       complete") {
		t.Errorf("inspect %v: exit %d\n%s", flags, code, out)
	}
	if code, out := run(nil, append(append([]string{"inspect"}, flags...), "--summary")...); code != exitOK || !strings.Contains(out, "past their lease:  2 ") {
		t.Errorf("inspect --summary %v: exit %d\n%s", flags, code, out)
	}
	if code, out := run(nil, append(append([]string{"resolve"}, flags...), "--scope", "t1", "--release", "k-lapsed")...); code != exitOK || !strings.Contains(out, "released") {
		t.Errorf("resolve %v: exit %d\n%s", flags, code, out)
	}
	if code, out := run(env, "resolve", "--scope", "t1", "--status", "201", "k-env"); code != exitOK {
		t.Errorf("resolve with %v: exit %d\n%s", env, code, out)
	}
	ctx := context.Background()
	if _, err := s.Get(ctx, "t1", "k-lapsed", time.Now()); err != idem.ErrNotFound {
		t.Errorf("k-lapsed after resolve --release: %v, want no record", err)
	}
	if rec, err := s.Get(ctx, "t1", "k-env", time.Now()); err != nil || rec.State != idem.StateComplete {
		t.Errorf("k-env after resolve --status 201: %+v, %v", rec, err)
	}
}
