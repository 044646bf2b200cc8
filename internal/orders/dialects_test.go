package orders_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/go-sql-driver/mysql"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/jackc/pgx/v5/pgxpool"
)

func randomTable(t *testing.T) string {
	var b [5]byte
	_, _ = rand.Read(b[:])
	return "orders_test_" + hex.EncodeToString(b[:])
}

// exercise migrates twice, creates an order and reads it back.
func exercise(t *testing.T, b orders.Backend, table string) {
	t.Helper()
	ctx := context.Background()
	svc, err := orders.New(b, &orders.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := svc.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
	}
	h := svc.Handler(nil)
	req := httptest.NewRequest("POST", "/orders", strings.NewReader(`{"cart_id":"c_42","total_cents":1900}`))
	req = req.WithContext(idem.WithScope(req.Context(), "t1"))
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusCreated {
		t.Fatalf("POST: %d %s", rec.Code, rec.Body)
	}
	list, err := svc.Orders(ctx, "t1", "c_42")
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 || list[0].TotalCents != 1900 || list[0].CreatedAt.IsZero() {
		t.Fatalf("orders = %+v", list)
	}
	get := httptest.NewRequest("GET", "/orders/"+list[0].ID, nil)
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, get.WithContext(idem.WithScope(get.Context(), "t1")))
	if rec.Code != 200 || !strings.Contains(rec.Body.String(), list[0].ID) {
		t.Fatalf("GET: %d %s", rec.Code, rec.Body)
	}
	if other, _ := svc.Orders(ctx, "t2", "c_42"); len(other) != 0 {
		t.Fatalf("tenant t2 sees %d orders of t1", len(other))
	}
}

func TestPostgres(t *testing.T) {
	t.Parallel()
	url := testenv.PostgresURL(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	table := randomTable(t)
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+table) })
	b, err := orders.Pgx(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	exercise(t, b, table)
}

func TestMySQL(t *testing.T) {
	t.Parallel()
	dsn := testenv.MySQLDSN(testenv.MySQLURL(t))
	if _, err := mysql.ParseDSN(dsn); err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	table := randomTable(t)
	t.Cleanup(func() { _, _ = db.Exec("DROP TABLE IF EXISTS " + table) })
	b, err := orders.SQL(db, orders.MySQL, nil)
	if err != nil {
		t.Fatal(err)
	}
	exercise(t, b, table)
}

// TestPostgresSchema keeps the orders table in a schema of its own
// (Config.Table "schema.table"), as `idem demo --schema` does.
func TestPostgresSchema(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	schema := randomTable(t)
	if _, err := pool.Exec(context.Background(), "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE") })
	b, err := orders.Pgx(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	exercise(t, b, schema+".orders")
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND indexname = 'orders_tenant_cart_idx'", schema).Scan(&n); err != nil || n != 1 {
		t.Fatalf("index in the schema: %d (%v), want 1", n, err)
	}
	sq, _ := orders.SQL(openSQLite(t), orders.SQLite, nil)
	if _, err := orders.New(sq, &orders.Config{Table: "main.orders"}); err == nil {
		t.Error("SQLite accepted a schema-qualified table")
	}
}
