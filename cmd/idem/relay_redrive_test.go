package main

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/sqlitestore/embedded"
	"github.com/idemkit/idem/sqlitestore/sqliteoutbox"
)

// TestRedriveAllWhileTheCausePersists: `idem relay --redrive all` while a
// relay runs and the cause is not fixed yet (the relay dead-letters each
// redriven message again at once, under a new sequence number) redrives the
// dead letters that were there when it started, once, and ends; it does not
// chase the new ones for ever.
func TestRedriveAllWhileTheCausePersists(t *testing.T) {
	ctx := context.Background()
	db, err := embedded.Open(filepath.Join(t.TempDir(), "o.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ob, err := sqliteoutbox.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := ob.Enqueue(ctx, tx, outbox.Message{ID: fmt.Sprint("r", i), Subject: "nowhere"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	relay := func() { // a relay whose broker still refuses the messages
		ms, err := ob.Lease(ctx, "relay", 100, time.Minute)
		if err != nil {
			t.Error(err)
		}
		for _, m := range ms {
			if err := ob.DeadLetter(ctx, "relay", m.Seq, "no stream"); err != nil {
				t.Error(err)
			}
		}
	}
	relay()
	eo := &eventsOutbox{table: "idem_outbox", source: ob,
		dead: func(ctx context.Context, limit int) ([]deadLetter, error) {
			list, err := ob.DeadLetters(ctx, limit)
			out := make([]deadLetter, 0, len(list))
			for _, d := range list {
				out = append(out, deadLetter{Seq: d.Seq, ID: d.ID})
			}
			return out, err
		},
		redrive: func(ctx context.Context, seqs ...int64) (int, error) {
			n, err := ob.Redrive(ctx, seqs...)
			relay()
			return n, err
		},
	}
	var out strings.Builder
	done := make(chan int, 1)
	go func() { done <- relayRedrive(ctx, eo, nil, &out, io.Discard) }()
	select {
	case code := <-done:
		if code != exitOK || !strings.Contains(out.String(), "redrove 3 dead letters") {
			t.Fatalf("exit %d: %s", code, out.String())
		}
	case <-time.After(10 * time.Second):
		st, _ := ob.Stats(ctx)
		t.Fatalf("--redrive all still running after 10 s (%+v): it chases the messages the relay dead-letters again", st)
	}
}
