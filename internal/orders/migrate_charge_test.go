package orders_test

import (
	"context"
	"database/sql"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The orders table before charge_id, as idem demo created it until
// --payment-url came, in each dialect.
var oldSchema = map[orders.Dialect]string{
	orders.SQLite: `CREATE TABLE %s (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, cart_id TEXT NOT NULL,
	total_cents INTEGER NOT NULL CHECK (total_cents >= 0), created_at TEXT NOT NULL)`,
	orders.Postgres: `CREATE TABLE %s (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, cart_id TEXT NOT NULL,
	total_cents BIGINT NOT NULL CHECK (total_cents >= 0), created_at TIMESTAMPTZ NOT NULL)`,
	orders.MySQL: `CREATE TABLE %s (id VARCHAR(64) NOT NULL PRIMARY KEY, tenant VARCHAR(255) NOT NULL,
	cart_id VARCHAR(255) NOT NULL, total_cents BIGINT NOT NULL, created_at DATETIME(6) NOT NULL)
	ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin`,
}

// migrateOld creates the old table with one order in it, migrates twice, and
// checks that the old order reads without a charge and a new one can be made.
func migrateOld(t *testing.T, b orders.Backend, exec func(string) error, table string) {
	t.Helper()
	ctx := context.Background()
	if err := exec(strings.Replace(oldSchema[b.Dialect()], "%s", table, 1)); err != nil {
		t.Fatal(err)
	}
	created := "'2025-01-02 03:04:05.000000'"
	if err := exec("INSERT INTO " + table + " (id, tenant, cart_id, total_cents, created_at) VALUES ('ord_000000000000000000000001', 't1', 'c_old', 5, " + created + ")"); err != nil {
		t.Fatal(err)
	}
	svc, err := orders.New(b, &orders.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := svc.Migrate(ctx); err != nil {
			t.Fatalf("migrating a table without charge_id: %v", err)
		}
	}
	list, err := svc.Orders(ctx, "t1", "c_old")
	if err != nil || len(list) != 1 || list[0].ChargeID != "" {
		t.Fatalf("the old order after the migration: %+v, %v", list, err)
	}
	req := httptest.NewRequest("POST", "/orders", strings.NewReader(`{"cart_id":"c_new","total_cents":7}`))
	rec := httptest.NewRecorder()
	svc.Handler(nil).ServeHTTP(rec, req.WithContext(idem.WithScope(req.Context(), "t1")))
	if rec.Code != http.StatusCreated || strings.Contains(rec.Body.String(), "charge_id") {
		t.Fatalf("a new order without payments after the migration: %d %s (want 201, no charge_id)", rec.Code, rec.Body)
	}
}

func TestMigrateChargeIDSQLite(t *testing.T) {
	t.Parallel()
	db := openSQLite(t)
	b, _ := orders.SQL(db, orders.SQLite, nil)
	migrateOld(t, b, func(q string) error { _, err := db.Exec(q); return err }, "orders")
}

func TestMigrateChargeIDPostgres(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	table := randomTable(t)
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+table) })
	b, _ := orders.Pgx(pool, nil)
	migrateOld(t, b, func(q string) error { _, err := pool.Exec(context.Background(), q); return err }, table)
}

func TestMigrateChargeIDMySQL(t *testing.T) {
	t.Parallel()
	db, err := sql.Open("mysql", testenv.MySQLDSN(testenv.MySQLURL(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	table := randomTable(t)
	t.Cleanup(func() { _, _ = db.Exec("DROP TABLE IF EXISTS " + table) })
	b, _ := orders.SQL(db, orders.MySQL, nil)
	migrateOld(t, b, func(q string) error { _, err := db.Exec(q); return err }, table)
}
