package dbopen_test

import (
	"context"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/dbopen"
	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/jackc/pgx/v5"
)

// benchOrders measures one POST /orders with a fresh key (claim, insert,
// completion, commit) and one replay, in process, against the store Open built.
func benchOrders(b *testing.B, h *dbopen.Handle, table string) {
	ctx := context.Background()
	if err := h.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	svc, err := orders.New(h.Orders, &orders.Config{Table: table})
	if err != nil {
		b.Fatal(err)
	}
	if err := svc.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	mw, err := idem.New(h.Store, nil)
	if err != nil {
		b.Fatal(err)
	}
	app := orders.Authenticate(svc.Handler(mw))
	run := func(key string, want int) {
		req := httptest.NewRequest("POST", "/orders", strings.NewReader(`{"cart_id":"c_bench","total_cents":1900}`))
		req.Header.Set("Authorization", "Bearer bench")
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		app.ServeHTTP(rec, req)
		if rec.Code != want {
			b.Fatalf("status %d: %s", rec.Code, rec.Body)
		}
	}
	prefix := randHex()
	var n atomic.Int64
	b.Run("execute", func(b *testing.B) {
		for b.Loop() {
			run(prefix+"-"+strconv.FormatInt(n.Add(1), 10), 201)
		}
	})
	b.Run("replay", func(b *testing.B) {
		run(prefix+"-replay", 201)
		for b.Loop() {
			run(prefix+"-replay", 201)
		}
	})
}

func BenchmarkOrdersSQLite(b *testing.B) {
	h, err := dbopen.Open(context.Background(), dbopen.Options{DB: "sqlite:" + filepath.Join(b.TempDir(), "bench.db")})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = h.Close() })
	benchOrders(b, h, "orders")
}

func BenchmarkOrdersPostgres(b *testing.B) {
	url := testenv.PostgresURL(b)
	keys, table := "idem_bench_"+randHex(), "orders_bench_"+randHex()
	h, err := dbopen.Open(context.Background(), dbopen.Options{DB: url, KeyTable: keys})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = h.Close() })
	b.Cleanup(func() {
		for _, t := range []string{keys, table} {
			_, _ = h.Pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+pgx.Identifier{t}.Sanitize())
		}
	})
	benchOrders(b, h, table)
}
