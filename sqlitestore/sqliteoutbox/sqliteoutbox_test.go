package sqliteoutbox_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/outboxtest"
	"github.com/idemkit/idem/sqlitestore/embedded"
	"github.com/idemkit/idem/sqlitestore/sqliteoutbox"
)

func TestSource(t *testing.T) {
	db, err := embedded.Open(filepath.Join(t.TempDir(), "outbox.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	n := 0
	outboxtest.Run(t, outboxtest.Harness{
		Relays: 2, Messages: 200, // one writer: more relays only queue
		New: func(t *testing.T) outbox.Source {
			n++
			o, err := sqliteoutbox.New(db, &sqliteoutbox.Config{Table: fmt.Sprint("outbox_", n)})
			if err != nil {
				t.Fatal(err)
			}
			if err := o.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			return o
		},
		// A write transaction holds SQLite's only write lock from its BEGIN
		// (IMMEDIATE), so a second one waits for the first's commit: commit
		// order is enqueue order. Few pairs: the waits queue up behind one
		// another within the busy timeout.
		Serial: true, Pairs: 4,
		Begin: func(ctx context.Context, src outbox.Source) (func(outbox.Message) error, func() error, error) {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return nil, nil, err
			}
			return func(m outbox.Message) error { return src.(*sqliteoutbox.Outbox).Enqueue(ctx, tx, m) }, tx.Commit, nil
		},
		Enqueue: func(ctx context.Context, src outbox.Source, msgs ...outbox.Message) error {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback() }()
			for _, m := range msgs {
				if err := src.(*sqliteoutbox.Outbox).Enqueue(ctx, tx, m); err != nil {
					return err
				}
			}
			return tx.Commit()
		},
	})
}
