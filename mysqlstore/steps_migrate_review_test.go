package mysqlstore_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestStepsOldDatabase: a database migrated before step records existed
// (version 1 applied: the records table, no step table) under a service
// upgraded without running Migrate, which uses no step: its janitor sweeps as
// before and reads of a key's steps find none. Then Migrate, run by four
// processes at once and again, applies version 2, keeps the records, and
// steps work. Failed before the fix: the janitor's sweep failed on the
// missing table every time.
func TestStepsOldDatabase(t *testing.T) {
	t.Parallel()
	db := openDB(t, 8, "")
	s := newStore(t, db)
	ctx := ctxFor(t)
	// The database as version 1 left it.
	if _, err := db.ExecContext(ctx, "DROP TABLE `"+s.StepsTable()+"`"); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, "DELETE FROM `"+s.Table()+"_migrations` WHERE `version` >= 2"); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: "s", Key: "old", Fingerprint: "v1:x", Token: "t", Now: now.Add(-2 * time.Hour), LeaseUntil: now.Add(-2 * time.Hour).Add(time.Minute), ExpiresAt: now.Add(-time.Hour)}); err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: "s", Key: "kept", Fingerprint: "v1:x", Token: "t", Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	n, err := (&idem.Janitor{Store: s}).Sweep(ctx)
	if err != nil || n != 1 {
		t.Fatalf("janitor on a database without the step table: deleted %d, %v; want the expired record deleted and no error", n, err)
	}
	if steps, err := s.GetSteps(ctx, "s", "kept", now); err != nil || len(steps) != 0 {
		t.Fatalf("GetSteps without the step table: %v %v; want none, no error", steps, err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- s.Migrate(ctx) }()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("concurrent Migrate: %v", err)
		}
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	if r, err := s.Get(ctx, "s", "kept", now); err != nil || r.Token != "t" {
		t.Fatalf("the record after Migrate: %+v %v", r, err)
	}
	if _, began, err := s.BeginStep(ctx, idem.BeginStepRequest{Scope: "s", Key: "kept", Name: "charge", Owner: "t", Holder: true,
		DerivedKey: "idem_x", Now: now, ExpiresAt: now.Add(time.Hour)}); err != nil || !began {
		t.Fatalf("BeginStep after Migrate: %v %v", began, err)
	}
	if _, err := (&idem.Janitor{Store: s}).Sweep(context.Background()); err != nil {
		t.Fatalf("janitor after Migrate: %v", err)
	}
}
