package dbopen_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/dbopen"
	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/jackc/pgx/v5"
)

func TestParseDB(t *testing.T) {
	t.Parallel()
	ok := []struct {
		in      string
		dialect orders.Dialect
		check   func(dbopen.Target) bool
	}{
		{"sqlite:idem-demo.db", orders.SQLite, func(tg dbopen.Target) bool { return tg.Path == "idem-demo.db" }},
		{"sqlite://data/x.db", orders.SQLite, func(tg dbopen.Target) bool { return tg.Path == "data/x.db" }},
		{"sqlite:///var/lib/idem.db", orders.SQLite, func(tg dbopen.Target) bool { return tg.Path == "/var/lib/idem.db" }},
		{"postgres://u:secret@db:5432/app?sslmode=disable", orders.Postgres, func(tg dbopen.Target) bool {
			return tg.URL == "postgres://u:secret@db:5432/app?sslmode=disable" && !strings.Contains(tg.Display, "secret")
		}},
		{"postgresql://db/app", orders.Postgres, nil},
		{"mysql://root@127.0.0.1:3306/test", orders.MySQL, func(tg dbopen.Target) bool {
			return strings.HasPrefix(tg.DSN, "root@tcp(127.0.0.1:3306)/test?") && strings.Contains(tg.DSN, "parseTime=true")
		}},
		{"mysql://u:p%40ss@db/app?timeout=5s", orders.MySQL, func(tg dbopen.Target) bool {
			return strings.HasPrefix(tg.DSN, "u:p@ss@tcp(db:3306)/app?") && strings.Contains(tg.DSN, "timeout=5s") && !strings.Contains(tg.Display, "p%40ss")
		}},
	}
	for _, c := range ok {
		tg, err := dbopen.ParseDB(c.in)
		if err != nil {
			t.Errorf("ParseDB(%q): %v", c.in, err)
			continue
		}
		if tg.Dialect != c.dialect || (c.check != nil && !c.check(tg)) {
			t.Errorf("ParseDB(%q) = %+v", c.in, tg)
		}
	}
	bad := []struct{ in, want string }{
		{"", "--db is empty"},
		{"x://foo", `--db: unknown scheme "x"; use sqlite:PATH, postgres://… or mysql://…`},
		{"idem.db", "has no scheme; use sqlite:idem.db"},
		{"sqlite:", "needs a file path"},
		{"sqlite::memory:", "in-memory"},
		{"mysql://root@127.0.0.1:3306", "name the server and the database"},
		{"postgres://u:secret@db:notaport/app", "not a valid PostgreSQL URL"},
	}
	for _, c := range bad {
		_, err := dbopen.ParseDB(c.in)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ParseDB(%q) error = %v, want one containing %q", c.in, err, c.want)
			continue
		}
		if strings.Contains(err.Error(), "secret") {
			t.Errorf("ParseDB(%q) error leaks the password: %v", c.in, err)
		}
	}
}

// roundTrip claims, completes and reads back one record through h.Store.
func roundTrip(t *testing.T, h *dbopen.Handle) {
	t.Helper()
	ctx := context.Background()
	var b [6]byte
	_, _ = rand.Read(b[:])
	key := "k-" + hex.EncodeToString(b[:])
	now := time.Now()
	_, claimed, err := h.Store.Claim(ctx, idem.ClaimRequest{Scope: "s", Key: key, Fingerprint: "v1:x", Token: "tok",
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)})
	if err != nil || !claimed {
		t.Fatalf("Claim: claimed=%v err=%v", claimed, err)
	}
	if err := h.Store.Complete(ctx, "s", key, "tok", &idem.Response{Status: 201, Body: []byte("{}")}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	rec, err := h.Store.Get(ctx, "s", key, time.Now())
	if err != nil || rec.State != idem.StateComplete || rec.Response.Status != 201 {
		t.Fatalf("Get: %+v %v", rec, err)
	}
	if err := h.Store.Release(ctx, "s", key, "other"); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("Release with a stale token: %v, want ErrLockLost", err)
	}
}

func TestOpenSQLite(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "demo.db")
	h, err := dbopen.Open(context.Background(), dbopen.Options{DB: "sqlite:" + path})
	if err != nil {
		t.Fatal(err)
	}
	if h.SQL == nil || h.Pool != nil || !h.Transactional() || !h.Orders.Transactional() || h.Orders.Dialect() != orders.SQLite {
		t.Fatalf("handle = %+v", h)
	}
	if !strings.Contains(h.KeysAt, "idem_records") {
		t.Errorf("KeysAt = %q", h.KeysAt)
	}
	for range 2 {
		if err := h.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	roundTrip(t, h)
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if err := h.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestOpenErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	// A port nobody listens on.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	cases := []struct {
		opts dbopen.Options
		want string
	}{
		{dbopen.Options{DB: "oracle://x"}, `unknown scheme "oracle"`},
		{dbopen.Options{DB: "sqlite:" + filepath.Join(dir, "x.db"), Keys: "memcached://x"}, `--keys: unknown scheme "memcached"`},
		{dbopen.Options{DB: "sqlite:" + filepath.Join(dir, "no", "such", "dir", "x.db")}, "--db sqlite:"},
		{dbopen.Options{DB: "postgres://postgres:pw@" + closed + "/test?connect_timeout=2"}, "PostgreSQL does not answer"},
		{dbopen.Options{DB: "mysql://root@" + closed + "/test?timeout=2s"}, "MySQL does not answer"},
		{dbopen.Options{DB: "sqlite:" + filepath.Join(dir, "y.db"), Keys: "redis://" + closed + "/0?dial_timeout=2s"}, "Redis does not answer"},
		{dbopen.Options{DB: "sqlite:" + filepath.Join(dir, "z.db"), KeyTable: "bad-name"}, "sqlitestore"},
	}
	for _, c := range cases {
		h, err := dbopen.Open(context.Background(), c.opts)
		if err == nil {
			h.Close()
			t.Errorf("Open(%+v): no error", c.opts)
			continue
		}
		if !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), ":pw@") {
			t.Errorf("Open(%+v) error = %v, want one containing %q", c.opts, err, c.want)
		}
	}
}

func TestOpenPostgres(t *testing.T) {
	t.Parallel()
	url := testenv.PostgresURL(t)
	table := "idem_dbopen_" + randHex()
	h, err := dbopen.Open(context.Background(), dbopen.Options{DB: url, KeyTable: table})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	t.Cleanup(func() {
		_, _ = h.Pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+pgx.Identifier{table}.Sanitize())
	})
	if h.Pool == nil || !h.Transactional() || h.Orders.Dialect() != orders.Postgres {
		t.Fatalf("handle = %+v", h)
	}
	if err := h.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	roundTrip(t, h)
}

func TestOpenMySQL(t *testing.T) {
	t.Parallel()
	url := testenv.MySQLURL(t)
	table := "idem_dbopen_" + randHex()
	h, err := dbopen.Open(context.Background(), dbopen.Options{DB: url, KeyTable: table})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	t.Cleanup(func() {
		_, _ = h.SQL.Exec("DROP TABLE IF EXISTS `" + table + "`, `" + table + "_migrations`")
	})
	if h.SQL == nil || !h.Transactional() || h.Orders.Dialect() != orders.MySQL {
		t.Fatalf("handle = %+v", h)
	}
	if err := h.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	roundTrip(t, h)
}

func TestOpenRedisKeys(t *testing.T) {
	t.Parallel()
	url := testenv.RedisURL(t)
	prefix := "idem-dbopen-" + randHex() + ":"
	h, err := dbopen.Open(context.Background(), dbopen.Options{DB: "sqlite:" + filepath.Join(t.TempDir(), "r.db"), Keys: url, KeyTable: prefix})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	t.Cleanup(func() {
		ctx := context.Background()
		keys, _ := h.Redis.Keys(ctx, prefix+"*").Result()
		if len(keys) > 0 {
			h.Redis.Del(ctx, keys...)
		}
	})
	if h.Redis == nil || h.Transactional() || h.Orders.Transactional() {
		t.Fatalf("handle with Redis keys = %+v", h)
	}
	if err := h.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	roundTrip(t, h)
}

func randHex() string {
	var b [5]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func TestOptionsCheck(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		opts dbopen.Options
		want string
	}{
		{dbopen.Options{}, ""},
		{dbopen.Options{DB: "postgres://db/app", Keys: "redis://127.0.0.1:6379/2"}, ""},
		{dbopen.Options{DB: "nope:x"}, `unknown scheme "nope"`},
		{dbopen.Options{Keys: "redis://:bad:port:/x"}, "--keys: not a valid Redis URL"},
		{dbopen.Options{Keys: "postgres://x"}, `--keys: unknown scheme "postgres"`},
	} {
		err := c.opts.Check()
		if (c.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.want)) {
			t.Errorf("Check(%+v) = %v, want %q", c.opts, err, c.want)
		}
	}
}

func TestParseFlagsOfOtherNames(t *testing.T) {
	t.Parallel()
	if _, err := dbopen.ParseDBFlag("--mysql", "mysql://root@127.0.0.1"); err == nil || !strings.HasPrefix(err.Error(), "--mysql ") {
		t.Errorf("ParseDBFlag(--mysql, no database) = %v, want an error about --mysql", err)
	}
	// The go-sql-driver DSN form names the same database as the URL.
	for _, in := range []string{"root:secret@tcp(127.0.0.1:3306)/test?timeout=5s", "mysql://root:secret@tcp(127.0.0.1:3306)/test?timeout=5s"} {
		got, err := dbopen.ParseDB(in)
		if err != nil {
			t.Errorf("ParseDB(%q): %v", in, err)
			continue
		}
		cfg, err := mysql.ParseDSN(got.DSN)
		if got.Dialect != orders.MySQL || err != nil || cfg.Addr != "127.0.0.1:3306" || cfg.DBName != "test" || cfg.Passwd != "secret" || !cfg.ParseTime || cfg.Timeout != 5*time.Second {
			t.Errorf("ParseDB(%q) = %+v (%v); want MySQL test at 127.0.0.1:3306 with the password, parseTime and timeout", in, got, err)
		}
		if got.Display != "mysql://root:xxxxx@127.0.0.1:3306/test" {
			t.Errorf("ParseDB(%q).Display = %q; want the URL without the password", in, got.Display)
		}
	}
	if _, err := dbopen.ParseDB("root:secret@tcp(127.0.0.1:3306)/test?parseTime=maybe"); err == nil || !strings.Contains(err.Error(), "--db root:xxxxx@tcp(127.0.0.1:3306)/test?parseTime=maybe: invalid bool value") || strings.Contains(err.Error(), "secret") {
		t.Errorf("ParseDB(a DSN with a bad parameter) = %v; want an error naming it, without the password", err)
	}
	if _, err := dbopen.ParseDB("root@tcp(127.0.0.1:3306)/"); err == nil || !strings.Contains(err.Error(), "name the server and the database") {
		t.Errorf("ParseDB(a DSN without a database) = %v", err)
	}
	for in, want := range map[string]string{
		"root@tcp(127.0.0.1:3306)/test":       "mysql://root@127.0.0.1:3306/test",
		"tcp(db:3307)/app?parseTime=true":     "mysql://db:3307/app",
		"u:p@tcp(db:3306)/app":                "mysql://u:xxxxx@db:3306/app",
		"mysql://root@127.0.0.1:3306/test":    "",
		"root@unix(/tmp/mysql.sock)/test":     "",
		"root@tcp(127.0.0.1:3306)/":           "",
		"postgres://u@tcp(x)/db?sslmode=none": "",
	} {
		got, ok := dbopen.MySQLURLFromDSN(in)
		if got != want || ok != (want != "") {
			t.Errorf("MySQLURLFromDSN(%q) = %q, %v; want %q", in, got, ok, want)
		}
	}
	if _, err := dbopen.ParseRedis("--redis", "127.0.0.1:6379"); err == nil || !strings.HasPrefix(err.Error(), `--redis "127.0.0.1:6379" is not a Redis URL`) {
		t.Errorf("ParseRedis(no scheme) = %v", err)
	}
	if o, err := dbopen.ParseRedis("--redis", "redis://127.0.0.1:6379/3"); err != nil || o.DB != 3 {
		t.Errorf("ParseRedis(redis://…/3) = %+v, %v", o, err)
	}
}

func TestNamesAndMustExist(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		opts dbopen.Options
		want string
	}{
		{dbopen.Options{DB: "postgres://db/app", Prefix: "p_", Schema: "shop"}, ""},
		{dbopen.Options{DB: "mysql://root@db/app", Prefix: "m_"}, ""},
		{dbopen.Options{Prefix: "Bad-"}, `--prefix "Bad-" is not usable`},
		{dbopen.Options{DB: "postgres://db/app", Schema: "a.b"}, `--schema "a.b" is not usable`},
		{dbopen.Options{DB: "mysql://root@db/app", Schema: "shop"}, "--schema works on PostgreSQL only"},
		{dbopen.Options{Schema: "shop"}, "--schema works on PostgreSQL only"},
	} {
		err := c.opts.Check()
		if (c.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.want)) {
			t.Errorf("Check(%+v) = %v, want %q", c.opts, err, c.want)
		}
	}

	dir := t.TempDir()
	missing := filepath.Join(dir, "missing.db")
	_, err := dbopen.Open(context.Background(), dbopen.Options{DB: "sqlite:" + missing, MustExist: true})
	if err == nil || !strings.Contains(err.Error(), "does not exist") || !strings.Contains(err.Error(), "idem migrate --db sqlite:"+missing) {
		t.Errorf("Open(missing file, MustExist) = %v", err)
	}
	if _, err := os.Stat(missing); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Open with MustExist created the file (stat: %v)", err)
	}

	// Prefix names both tables; Migrate creates the key records' one.
	h, err := dbopen.Open(context.Background(), dbopen.Options{DB: "sqlite:" + filepath.Join(dir, "p.db"), Prefix: "demo_"})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if h.OrdersTable != "demo_orders" || !strings.Contains(h.KeysAt, "table demo_idem_records of") {
		t.Fatalf("OrdersTable %q, KeysAt %q", h.OrdersTable, h.KeysAt)
	}
	if err := h.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	roundTrip(t, h)
}

func TestMigrateSchemaPostgres(t *testing.T) {
	t.Parallel()
	schema := "s_" + randHex()
	dbURL := testenv.PostgresURL(t)
	h, err := dbopen.Open(context.Background(), dbopen.Options{DB: dbURL, Schema: schema, Prefix: "p_"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := h.Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE"); err != nil {
			t.Error(err)
		}
		h.Close()
	})
	if h.OrdersTable != schema+".p_orders" || !strings.Contains(h.KeysAt, `table "`+schema+`"."p_idem_records" of`) {
		t.Fatalf("OrdersTable %q, KeysAt %q", h.OrdersTable, h.KeysAt)
	}
	for range 2 { // the second run finds the schema and the table in place
		if err := h.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	roundTrip(t, h)
}

// TestMigrateSchemaConcurrently: `idem migrate --schema S` (or idem demo
// starting) in several processes at once, on a schema that does not exist
// yet. PostgreSQL's CREATE SCHEMA IF NOT EXISTS is not safe against a
// concurrent one (a unique violation in pg_namespace): every run must still
// succeed and leave the tables in place. Rounds of fresh schemas, four
// handles each, released together.
func TestMigrateSchemaConcurrently(t *testing.T) {
	t.Parallel()
	dbURL := testenv.PostgresURL(t)
	ctx := context.Background()
	for round := range 10 {
		schema := "c_" + randHex()
		var hs []*dbopen.Handle
		for range 4 {
			h, err := dbopen.Open(ctx, dbopen.Options{DB: dbURL, Schema: schema})
			if err != nil {
				t.Fatal(err)
			}
			hs = append(hs, h)
		}
		t.Cleanup(func() {
			if _, err := hs[0].Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE"); err != nil {
				t.Error(err)
			}
			for _, h := range hs {
				h.Close()
			}
		})
		start := make(chan struct{})
		errs := make(chan error, len(hs))
		for _, h := range hs {
			go func() {
				<-start
				err := h.Migrate(ctx)
				if err == nil { // as idem migrate does next
					var svc *orders.Service
					if svc, err = orders.New(h.Orders, &orders.Config{Table: h.OrdersTable}); err == nil {
						err = svc.Migrate(ctx)
					}
				}
				errs <- err
			}()
		}
		close(start)
		for range hs {
			if err := <-errs; err != nil {
				t.Fatalf("round %d: concurrent Migrate of schema %s: %v", round, schema, err)
			}
		}
		roundTrip(t, hs[0])
	}
}
