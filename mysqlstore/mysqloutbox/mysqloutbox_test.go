package mysqloutbox_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"testing"

	_ "github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/mysqlstore/mysqloutbox"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/outboxtest"
)

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func testDB(t testing.TB) *sql.DB {
	t.Helper()
	db, err := sql.Open("mysql", testenv.MySQLDSN(testenv.MySQLURL(t)))
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(40)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

func newOutbox(t testing.TB, db *sql.DB) *mysqloutbox.Outbox {
	t.Helper()
	table := "outbox_" + randHex(5)
	o, err := mysqloutbox.New(db, &mysqloutbox.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_dead, " + table + "_locks")
	})
	return o
}

func TestSource(t *testing.T) {
	db := testDB(t)
	outboxtest.Run(t, outboxtest.Harness{
		New: func(t *testing.T) outbox.Source { return newOutbox(t, db) },
		Begin: func(ctx context.Context, src outbox.Source) (func(outbox.Message) error, func() error, error) {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return nil, nil, err
			}
			return func(m outbox.Message) error { return src.(*mysqloutbox.Outbox).Enqueue(ctx, tx, m) }, tx.Commit, nil
		},
		Enqueue: func(ctx context.Context, src outbox.Source, msgs ...outbox.Message) error {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback() }()
			for _, m := range msgs {
				if err := src.(*mysqloutbox.Outbox).Enqueue(ctx, tx, m); err != nil {
					return err
				}
			}
			return tx.Commit()
		},
	})
}
