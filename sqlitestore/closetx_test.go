package sqlitestore_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// TestTxAfterCloseOneConnection: a transaction begun before Store.Close,
// on a pool of one connection, still completes and commits: its statements,
// closed by Close, are prepared again on the transaction's own connection,
// not on the pool, whose only connection the transaction holds.
func TestTxAfterCloseOneConnection(t *testing.T) {
	t.Parallel()
	db, err := embedded.Open(filepath.Join(t.TempDir(), "app.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	db.SetMaxOpenConns(1)
	s, err := sqlitestore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	rec, ok, err := s.Claim(ctx, idem.ClaimRequest{Key: "k", Fingerprint: "f", Token: "tok", Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)})
	if err != nil || !ok || rec == nil {
		t.Fatalf("claim: %v %v %v", rec, ok, err)
	}
	_, tx, err := s.BeginTx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		err := tx.Complete(ctx, "", "k", "tok", &idem.Response{Status: 201}, now, now.Add(time.Hour))
		if err == nil {
			err = tx.Commit(ctx)
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Complete in a transaction begun before Close did not return in 20 s: it waits for a second connection to prepare its statement on")
	}
	got, err := s.Get(ctx, "", "k", time.Now())
	if err != nil || got == nil || got.State != idem.StateComplete {
		t.Fatalf("record after commit: %+v %v", got, err)
	}
}
