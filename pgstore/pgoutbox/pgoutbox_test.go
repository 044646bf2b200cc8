package pgoutbox_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/outboxtest"
	"github.com/idemkit/idem/pgstore/pgoutbox"
)

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// testDB is a pool on a fresh schema, dropped when t ends.
func testDB(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	url := testenv.PostgresURL(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 40
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	schema := "idem_pgoutbox_" + randHex(5)
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		pool.Close()
		t.Fatalf("create schema: %v", err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
		pool.Close()
	})
	return pool, schema
}

func TestSource(t *testing.T) {
	pool, schema := testDB(t)
	n := 0
	outboxtest.Run(t, outboxtest.Harness{
		New: func(t *testing.T) outbox.Source {
			n++
			o, err := pgoutbox.New(pool, &pgoutbox.Config{Table: schema + ".outbox_" + string(rune('a'+n))})
			if err != nil {
				t.Fatal(err)
			}
			if err := o.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			return o
		},
		Begin: func(ctx context.Context, src outbox.Source) (func(outbox.Message) error, func() error, error) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return nil, nil, err
			}
			return func(m outbox.Message) error { return src.(*pgoutbox.Outbox).Enqueue(ctx, tx, m) },
				func() error { return tx.Commit(ctx) }, nil
		},
		Enqueue: func(ctx context.Context, src outbox.Source, msgs ...outbox.Message) error {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(ctx) }()
			for _, m := range msgs {
				if err := src.(*pgoutbox.Outbox).Enqueue(ctx, tx, m); err != nil {
					return err
				}
			}
			return tx.Commit(ctx)
		},
	})
}
