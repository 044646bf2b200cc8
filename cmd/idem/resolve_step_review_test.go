package main

import (
	"context"
	"database/sql"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/redisstore"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

// TestResolveStepEveryStore: idem inspect shows a key's step records and idem
// resolve --step settles one, on SQLite, PostgreSQL, MySQL and Redis: a
// started step of a key whose lease is live is left alone (and settled with
// --force), one whose lease lapsed is settled --done, --failed or --forget as
// asked, and a key with no record and no step is "nothing to settle".
func TestResolveStepEveryStore(t *testing.T) {
	t.Parallel()
	table := "rs_step_" + cliRandHex(4)
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
			ss := s.(idem.StepStore)
			if st, ok := s.(interface{ StepsTable() string }); ok && c.name != "sqlite" {
				t.Cleanup(func() { dropStepsTable(c.name, db, st.StepsTable()) })
			}
			tbl := table
			var args []string
			if c.name == "redis" {
				tbl = table + ":"
				orders := filepath.Join(t.TempDir(), "o.db")
				sqliteKeyStore(t, orders, nil)
				args = []string{"--keys", db, "--db", "sqlite:" + orders}
			} else {
				args = []string{"--db", db}
			}
			args = append(args, "--table", tbl, "--scope", "acme")
			idemRun := func(cmd string, extra ...string) (int, string) {
				code, out, stderr := runIdem(t, t.TempDir(), nil, append(append([]string{cmd}, args...), extra...)...)
				return code, out + stderr
			}
			ctx := context.Background()
			now := time.Now()
			scope := idem.StoredScope("acme")
			begin := func(key, tok string, lease time.Time) string {
				t.Helper()
				if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: scope, Key: key, Fingerprint: "v2:x", Token: tok, Now: now.Add(-2 * time.Minute), LeaseUntil: lease, ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
					t.Fatalf("claim %s: %v %v", key, ok, err)
				}
				rec, began, err := ss.BeginStep(ctx, idem.BeginStepRequest{Scope: scope, Key: key, Name: "charge", Owner: tok, Holder: lease.After(now),
					DerivedKey: "idem_dk_" + key, Now: now.Add(-time.Minute), ExpiresAt: now.Add(time.Hour)})
				if err != nil || !began {
					t.Fatalf("begin step of %s: %v %v", key, began, err)
				}
				return rec.DerivedKey
			}
			step := func(key string) *idem.StepRecord {
				t.Helper()
				recs, err := ss.GetSteps(ctx, scope, key, time.Now())
				if err != nil {
					t.Fatal(err)
				}
				for i := range recs {
					if recs[i].Name == "charge" {
						return &recs[i]
					}
				}
				return nil
			}

			dk := begin("k-live", "tok-live", now.Add(time.Hour))
			if code, out := idemRun("inspect", "k-live"); code != exitOK || !strings.Contains(out, "charge") || !strings.Contains(out, dk) {
				t.Errorf("inspect k-live: exit %d; want the step charge and its derived key %s:\n%s", code, dk, out)
			}
			if code, out := idemRun("resolve", "--step", "charge", "--done", `{"id":"ch_9"}`, "k-live"); code != exitFailure || !strings.Contains(out, "held by a request running now") {
				t.Errorf("resolve --step of a key with a live lease: exit %d, want 1 and left alone:\n%s", code, out)
			}
			if r := step("k-live"); r == nil || r.State != idem.StepStarted {
				t.Fatalf("after the refused resolve the step is %+v, want still started", r)
			}
			if code, out := idemRun("resolve", "--step", "charge", "--done", `{"id":"ch_9"}`, "--force", "k-live"); code != exitOK {
				t.Errorf("resolve --step --force: exit %d\n%s", code, out)
			}
			if r := step("k-live"); r == nil || r.State != idem.StepDone || string(r.Result) != `{"id":"ch_9"}` || r.DerivedKey != dk {
				t.Fatalf("after --done --force the step is %+v, want done with the result and its derived key", r)
			}

			begin("k-failed", "tok-f", now.Add(-time.Minute))
			if code, out := idemRun("resolve", "--step", "charge", "--failed", "card declined", "k-failed"); code != exitOK {
				t.Errorf("resolve --step --failed: exit %d\n%s", code, out)
			}
			if r := step("k-failed"); r == nil || r.State != idem.StepFailed || !strings.Contains(string(r.Result), "card declined") {
				t.Fatalf("after --failed the step is %+v", r)
			}
			begin("k-forget", "tok-g", now.Add(-time.Minute))
			if code, out := idemRun("resolve", "--step", "charge", "--forget", "k-forget"); code != exitOK {
				t.Errorf("resolve --step --forget: exit %d\n%s", code, out)
			}
			if r := step("k-forget"); r != nil {
				t.Fatalf("after --forget the step is %+v, want gone", r)
			}
			if code, out := idemRun("resolve", "--step", "charge", "--forget", "k-nothing"); code != exitFailure || !strings.Contains(out, "nothing to settle") {
				t.Errorf("resolve --step of a key with no record: exit %d, want 1 and nothing to settle:\n%s", code, out)
			}
			if code, out := idemRun("inspect", "k-forget"); code != exitOK || strings.Contains(out, "idem_dk_k-forget") {
				t.Errorf("inspect after --forget: exit %d, want the record without the step:\n%s", code, out)
			}
		})
	}
}

// dropStepsTable drops a test's step records' table on PostgreSQL or MySQL.
func dropStepsTable(kind, url, table string) {
	switch kind {
	case "postgres":
		if conn, err := pgx.Connect(context.Background(), url); err == nil {
			_, _ = conn.Exec(context.Background(), "DROP TABLE IF EXISTS "+table)
			_ = conn.Close(context.Background())
		}
	case "mysql":
		if db, err := sql.Open("mysql", testenv.MySQLDSN(url)); err == nil {
			_, _ = db.Exec("DROP TABLE IF EXISTS `" + strings.Trim(table, "`") + "`")
			_ = db.Close()
		}
	}
}
