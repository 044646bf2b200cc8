package pgstore_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// testDB is one test's private schema on the shared PostgreSQL.
type testDB struct {
	pool   *pgxpool.Pool
	schema string
	n      atomic.Int64
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// newTestDB connects to testenv.PostgresURL, creates schema idem_test_<random>
// and drops it when t ends. maxConns bounds the pool (the server is shared).
func newTestDB(t testing.TB, maxConns int32) *testDB {
	t.Helper()
	url := testenv.PostgresURL(t)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("parse %s: %v", url, err)
	}
	cfg.MaxConns = maxConns
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	db := &testDB{pool: pool, schema: "idem_test_" + randomHex(6)}
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{db.schema}.Sanitize()); err != nil {
		pool.Close()
		if testenv.Required() {
			t.Fatalf("create schema: %v", err)
		}
		t.Skipf("PostgreSQL at %s refuses to create a schema (%v); set IDEM_TEST_POSTGRES_URL to a database this role may use", url, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{db.schema}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("drop schema %s: %v", db.schema, err)
		}
		pool.Close()
	})
	return db
}

// table returns a fresh schema-qualified table name in the test schema.
func (db *testDB) table(prefix string) string {
	return fmt.Sprintf("%s.%s_%d", db.schema, prefix, db.n.Add(1))
}

// newStore returns a migrated store on a fresh table.
func (db *testDB) newStore(t testing.TB) *pgstore.Store {
	t.Helper()
	return db.newStoreWith(t, pgstore.Config{})
}

// newStoreWith returns a migrated store on a fresh table, configured by cfg.
func (db *testDB) newStoreWith(t testing.TB, cfg pgstore.Config) *pgstore.Store {
	t.Helper()
	cfg.Table = db.table("records")
	s, err := pgstore.New(db.pool, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return s
}

// exec runs sql or fails the test.
func (db *testDB) exec(t testing.TB, sql string, args ...any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := db.pool.Exec(ctx, sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// count returns the result of a count(*) query.
func (db *testDB) count(t testing.TB, sql string, args ...any) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var n int
	if err := db.pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}
