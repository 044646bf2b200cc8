package mysqlstore_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	_ "github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/storetest"
)

// Pin the interfaces at compile time.
var (
	_ idem.Store   = (*mysqlstore.Store)(nil)
	_ idem.TxStore = (*mysqlstore.Store)(nil)
)

// openDB opens the test database, skipping (or failing under
// IDEM_REQUIRE_SERVICES=1) when it cannot be reached. extra is appended to the DSN.
func openDB(t testing.TB, maxConns int, extra string) *sql.DB {
	t.Helper()
	dsn := testenv.MySQLDSN(testenv.MySQLURL(t)) + extra + modeDSN(t)
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatalf("sql.Open: %v", err)
	}
	db.SetMaxOpenConns(maxConns)
	db.SetMaxIdleConns(maxConns)
	t.Cleanup(func() { _ = db.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		msg := "MySQL/MariaDB accepts TCP connections but not this DSN (" + err.Error() + "); set IDEM_TEST_MYSQL_URL"
		if testenv.Required() {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return db
}

// bothModes runs f twice, in parallel: as "plain", with the DSN as it is, and as
// "multi", where every pool openDB and binlogPool open has go-sql-driver's
// multiStatements=true, with which the store sends its statements in fewer
// round trips. Every guarantee must hold both ways.
func bothModes(t *testing.T, f func(t *testing.T)) {
	t.Parallel()
	for _, mode := range []string{"plain", "multi"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			f(t)
		})
	}
}

// modeDSN returns the DSN parameters of the mode bothModes runs t in.
func modeDSN(t testing.TB) string {
	if strings.Contains(t.Name(), "/multi") {
		return "&multiStatements=true"
	}
	return ""
}

func randomName(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// dropAtEnd drops the tables when the test ends.
func dropAtEnd(t testing.TB, db *sql.DB, tables ...string) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for _, tb := range tables {
			if _, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS `"+tb+"`"); err != nil {
				t.Errorf("dropping %s: %v", tb, err)
			}
		}
	})
}

// newStore returns a migrated store on a table of its own, dropped at the end.
func newStore(t testing.TB, db *sql.DB) *mysqlstore.Store {
	t.Helper()
	table := randomName("idem_test_")
	s, err := mysqlstore.New(db, &mysqlstore.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	dropAtEnd(t, db, table, table+"_migrations", table+"_steps")
	t.Cleanup(func() { _ = s.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return s
}

func ctxFor(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestConformance runs testConformance with and without multiStatements (see bothModes).
func TestConformance(t *testing.T) { bothModes(t, testConformance) }

func testConformance(t *testing.T) {
	db := openDB(t, 24, "")
	storetest.Run(t, func(t *testing.T) idem.Store { return newStore(t, db) })
}

func claimReq(scope, key, fp string, now time.Time) idem.ClaimRequest {
	return idem.ClaimRequest{
		Scope: scope, Key: key, Fingerprint: fp, Token: randomName("tok-"),
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour),
	}
}

// Keys and scopes are compared byte for byte: a case-insensitive or PAD SPACE
// collation would make these pairs collide.
func TestByteExactKeys(t *testing.T) {
	t.Parallel()
	s := newStore(t, openDB(t, 4, ""))
	ctx := ctxFor(t)
	now := time.Now()
	pairs := [][2][2]string{
		{{"tenant", "ABC"}, {"tenant", "abc"}},
		{{"Tenant", "k1"}, {"tenant", "k1"}},
		{{"tenant", "k2"}, {"tenant ", "k2"}},         // trailing space
		{{"tenant", "straße"}, {"tenant", "strasse"}}, // equal under some collations
		{{"tenant", "e\u0301"}, {"tenant", "\u00e9"}}, // canonically equivalent
	}
	for _, p := range pairs {
		a := claimReq(p[0][0], p[0][1], "v1:a", now)
		b := claimReq(p[1][0], p[1][1], "v1:b", now)
		for _, req := range []idem.ClaimRequest{a, b} {
			rec, claimed, err := s.Claim(ctx, req)
			if err != nil {
				t.Fatalf("Claim(%q, %q): %v", req.Scope, req.Key, err)
			}
			if !claimed {
				t.Fatalf("Claim(%q, %q) lost to the record of (%q, %q): the columns do not compare byte for byte", req.Scope, req.Key, rec.Scope, rec.Key)
			}
		}
		for _, req := range []idem.ClaimRequest{a, b} {
			rec, err := s.Get(ctx, req.Scope, req.Key, now)
			if err != nil {
				t.Fatalf("Get(%q, %q): %v", req.Scope, req.Key, err)
			}
			if rec.Token != req.Token || rec.Scope != req.Scope || rec.Key != req.Key {
				t.Errorf("Get(%q, %q) = (%q, %q, token %q), want its own record", req.Scope, req.Key, rec.Scope, rec.Key, rec.Token)
			}
		}
	}
}

func TestLimits(t *testing.T) {
	t.Parallel()
	s := newStore(t, openDB(t, 4, ""))
	ctx := ctxFor(t)
	now := time.Now()
	long := strings.Repeat("k", mysqlstore.MaxKeyLength+1)
	for _, req := range []idem.ClaimRequest{
		claimReq("tenant", long, "v1:x", now),
		claimReq(strings.Repeat("s", mysqlstore.MaxScopeLength+1), "k", "v1:x", now),
		claimReq("tenant", "k", "v1:"+strings.Repeat("f", mysqlstore.MaxFingerprintLength), now),
	} {
		_, _, err := s.Claim(ctx, req)
		if !errors.Is(err, idem.ErrFieldTooLarge) || !strings.Contains(err.Error(), "more than the") {
			t.Errorf("Claim with scope %d bytes, key %d bytes, fingerprint %d bytes: err = %v, want a length error", len(req.Scope), len(req.Key), len(req.Fingerprint), err)
		}
	}
	// The longest allowed values fit.
	max := claimReq(strings.Repeat("s", mysqlstore.MaxScopeLength), strings.Repeat("k", mysqlstore.MaxKeyLength), "v1:"+strings.Repeat("f", mysqlstore.MaxFingerprintLength-3), now)
	if _, claimed, err := s.Claim(ctx, max); err != nil || !claimed {
		t.Fatalf("Claim with the longest allowed values = %v, %v; want claimed", claimed, err)
	}
	if rec, err := s.Get(ctx, max.Scope, max.Key, now); err != nil || rec.Fingerprint != max.Fingerprint {
		t.Fatalf("Get of the longest values = %v, %v", rec, err)
	}
}

// Extending to the same deadline twice changes no lease column; it must still
// count as a held lease, whatever clientFoundRows says.
func TestExtendSameDeadline(t *testing.T) {
	t.Parallel()
	for _, dsn := range []string{"", "&clientFoundRows=true"} {
		s := newStore(t, openDB(t, 2, dsn))
		ctx := ctxFor(t)
		now := time.Now()
		req := claimReq("tenant", "k", "v1:e", now)
		if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
			t.Fatalf("Claim = %v, %v", claimed, err)
		}
		until := now.Add(2 * time.Minute)
		for i := range 3 {
			if err := s.Extend(ctx, req.Scope, req.Key, req.Token, now, until); err != nil {
				t.Fatalf("DSN%q: Extend #%d to the same deadline: %v", dsn, i+1, err)
			}
		}
		if err := s.Extend(ctx, req.Scope, req.Key, "other", now, until); !errors.Is(err, idem.ErrLockLost) {
			t.Fatalf("DSN%q: Extend with another token = %v, want ErrLockLost", dsn, err)
		}
		// A claim that loses changes nothing, and is reported as lost even where
		// clientFoundRows counts the untouched row.
		rec, claimed, err := s.Claim(ctx, claimReq("tenant", "k", "v1:e", now.Add(time.Second)))
		if err != nil || claimed || rec.Token != req.Token {
			t.Fatalf("DSN%q: second Claim = %+v, %v, %v; want the first claim's record", dsn, rec, claimed, err)
		}
	}
}

func TestMigrateConcurrently(t *testing.T) {
	t.Parallel()
	db := openDB(t, 8, "")
	table := randomName("idem_test_")
	dropAtEnd(t, db, table, table+"_migrations")
	s, err := mysqlstore.New(db, &mysqlstore.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := ctxFor(t)
	// Before Migrate, using the store says what to do.
	_, err = s.Get(ctx, "s", "k", time.Now())
	if err == nil || !strings.Contains(err.Error(), "Migrate") {
		t.Errorf("Get before Migrate: err = %v, want advice to run Migrate", err)
	}
	const n = 6
	start := make(chan struct{})
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			errs[i] = s.Migrate(ctx)
		}()
	}
	close(start)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("concurrent Migrate: %v", err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	var rows int
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM `"+table+"_migrations` WHERE version = 1").Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != 1 {
		t.Fatalf("migration 1 recorded %d times, want once", rows)
	}
	var engine, collation string
	if err := db.QueryRowContext(ctx, "SELECT ENGINE, TABLE_COLLATION FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?", table).Scan(&engine, &collation); err != nil {
		t.Fatal(err)
	}
	if engine != "InnoDB" {
		t.Errorf("engine = %s, want InnoDB", engine)
	}
	// The store works after the race.
	req := claimReq("tenant", "k", "v1:m", time.Now())
	if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
		t.Fatalf("Claim after Migrate = %v, %v", claimed, err)
	}
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	db, err := sql.Open("mysql", "root@tcp(127.0.0.1:1)/none") // never dialled
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := mysqlstore.New(nil, nil); err == nil || !strings.Contains(err.Error(), "sql.Open") {
		t.Errorf("New(nil, nil) = %v, want an error that says how to open a db", err)
	}
	for _, bad := range []string{"1abc", "a-b", "a`b", "db.table", "a b", strings.Repeat("t", 54), "idem_records; DROP TABLE x"} {
		if _, err := mysqlstore.New(db, &mysqlstore.Config{Table: bad}); err == nil {
			t.Errorf("New with Table %q succeeded, want an error", bad)
		}
	}
	cfg := &mysqlstore.Config{}
	s, err := mysqlstore.New(db, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if s.Table() != mysqlstore.DefaultTable || cfg.Table != "" {
		t.Errorf("Table() = %q, cfg.Table = %q; want the default and the caller's struct untouched", s.Table(), cfg.Table)
	}
	if mysqlstore.Tx(context.Background()) != nil {
		t.Error("Tx outside a request is not nil")
	}
}

// A store whose server is down fails, and says so; it never reports a claim.
func TestUnreachable(t *testing.T) {
	t.Parallel()
	db, err := sql.Open("mysql", "root@tcp(127.0.0.1:1)/test?timeout=2s")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	s, err := mysqlstore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	rec, claimed, err := s.Claim(ctxFor(t), claimReq("t", "k", "v1:x", time.Now()))
	if err == nil || claimed || rec != nil {
		t.Fatalf("Claim against a closed port = %v, %v, %v; want an error", rec, claimed, err)
	}
	ctx, _, err := s.BeginTx(ctxFor(t))
	if err == nil || mysqlstore.Tx(ctx) != nil {
		t.Fatalf("BeginTx against a closed port: err = %v", err)
	}
}

// TestTxRollbackAfterCommit runs testTxRollbackAfterCommit with and without multiStatements (see bothModes).
func TestTxRollbackAfterCommit(t *testing.T) { bothModes(t, testTxRollbackAfterCommit) }

func testTxRollbackAfterCommit(t *testing.T) {
	db := openDB(t, 4, "")
	s := newStore(t, db)
	ctx := ctxFor(t)
	now := time.Now()
	req := claimReq("tenant", "k", "v1:t", now)
	if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	tctx, tx, err := s.BeginTx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if mysqlstore.Tx(tctx) == nil {
		t.Fatal("Tx(ctx) is nil inside BeginTx's context")
	}
	resp := &idem.Response{Status: 201, Body: []byte("x")}
	if err := tx.Complete(ctx, req.Scope, req.Key, "wrong", resp, now, now.Add(time.Hour)); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("Complete with a wrong token in the tx = %v, want ErrLockLost", err)
	}
	if err := tx.Complete(ctx, req.Scope, req.Key, req.Token, resp, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	// Not visible outside before Commit.
	if rec, err := s.Get(ctx, req.Scope, req.Key, now); err != nil || rec.State != idem.StateInFlight {
		t.Fatalf("before Commit Get = %+v, %v; want in flight", rec, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("Rollback after Commit = %v, want nil", err)
	}
	if rec, err := s.Get(ctx, req.Scope, req.Key, now); err != nil || rec.State != idem.StateComplete {
		t.Fatalf("after Commit Get = %+v, %v; want complete", rec, err)
	}
}

// A response larger than the server's max_allowed_packet cannot be stored: Complete
// fails and the record stays in flight, so nothing half-stored is ever replayed.
// TestResponseLargerThanPacket runs testResponseLargerThanPacket with and without multiStatements (see bothModes).
func TestResponseLargerThanPacket(t *testing.T) { bothModes(t, testResponseLargerThanPacket) }

func testResponseLargerThanPacket(t *testing.T) {
	db := openDB(t, 2, "")
	s := newStore(t, db)
	ctx := ctxFor(t)
	var max int
	if err := db.QueryRowContext(ctx, "SELECT @@max_allowed_packet").Scan(&max); err != nil {
		t.Fatal(err)
	}
	if max > 64<<20 {
		t.Skipf("max_allowed_packet is %d bytes; too large to exceed in a test", max)
	}
	now := time.Now()
	req := claimReq("tenant", "big", "v1:big", now)
	if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	err := s.Complete(ctx, req.Scope, req.Key, req.Token, &idem.Response{Status: 200, Body: make([]byte, max+1)}, now, now.Add(time.Hour))
	if !errors.Is(err, idem.ErrFieldTooLarge) || errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("Complete with a body over max_allowed_packet = %v, want idem.ErrFieldTooLarge (the server refuses it every time)", err)
	}
	rec, err := s.Get(ctx, req.Scope, req.Key, now)
	if err != nil || rec.State != idem.StateInFlight {
		t.Fatalf("after the failed Complete Get = %+v, %v; want in flight", rec, err)
	}
	// The store still works (the driver may have dropped the connection).
	if err := s.Complete(ctx, req.Scope, req.Key, req.Token, &idem.Response{Status: 200, Body: []byte("ok")}, now, now.Add(time.Hour)); err != nil {
		t.Fatalf("Complete after the failure: %v", err)
	}
}

// Concurrent claims of a few keys never fail with a store error: a plain INSERT
// that deadlocks with another claim of its key (InnoDB rolls it back) is decided
// by the retried upsert, not reported as an error — each such error would be a
// 503 to a client. Found by a long linearizability run (about 0.3 % of claims).
func TestNoStoreErrorsUnderContention(t *testing.T) { bothModes(t, testNoStoreErrorsUnderContention) }

func testNoStoreErrorsUnderContention(t *testing.T) {
	db := openDB(t, 24, "")
	s := newStore(t, db)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := storetest.CheckLinearizability(ctx, s, storetest.LinearizabilityOptions{Ops: 10000})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Linearizable {
		t.Fatalf("not linearizable: %s (%s)", res.Problem, res.Visualization)
	}
	if res.Unknown > 0 {
		t.Fatalf("%d of %d operations failed with a store error, for example %q", res.Unknown, res.Ops, res.UnknownErrors)
	}
}
