package pgstore_test

import (
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestStepsTableWithoutFingerprint: a step table as migration 002 left it
// (no fingerprint column), holding a done step an older release recorded.
// This release's BeginStep fails saying to run Migrate, the janitor still
// sweeps expired step records; Migrate (twice) adds the column, keeps the
// row with an empty fingerprint, and a request with a fingerprint gets the
// old step's result (records written before are not told apart).
func TestStepsTableWithoutFingerprint(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	s := db.newStore(t)
	ctx := ctx30(t)
	now := time.Now()
	if _, err := db.pool.Exec(ctx, "ALTER TABLE "+s.StepsTable()+" DROP COLUMN fingerprint"); err != nil {
		t.Fatal(err)
	}
	if _, err := db.pool.Exec(ctx, "INSERT INTO "+s.StepsTable()+` (scope, key, name, state, owner, derived_key, result, started_at, expires_at, attempt)
		VALUES ('s', 'k', 'charge', 2, '', 'idem_old', '{"amount":10}', $1, $2, ''), ('s', 'gone', 'charge', 2, '', 'idem_gone', '1', $3, $4, '')`,
		now, now.Add(time.Hour), now.Add(-2*time.Hour), now.Add(-time.Hour)); err != nil {
		t.Fatal(err)
	}
	req := idem.BeginStepRequest{Scope: "s", Key: "k", Name: "charge", Owner: "own", DerivedKey: "idem_new",
		Fingerprint: "v3:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", Now: now, ExpiresAt: now.Add(time.Hour)}
	if _, _, err := s.BeginStep(ctx, req); err == nil || !strings.Contains(err.Error(), "Migrate") {
		t.Errorf("BeginStep on a table without the fingerprint column: %v; want an error saying to run Migrate", err)
	}
	if n, err := s.DeleteExpiredSteps(ctx, now, 100); err != nil || n != 1 {
		t.Errorf("DeleteExpiredSteps on the old table: %d, %v; want the expired step deleted", n, err)
	}
	for range 2 {
		if err := s.Migrate(ctx); err != nil {
			t.Fatalf("Migrate: %v", err)
		}
	}
	rec, began, err := s.BeginStep(ctx, req)
	if err != nil || began || rec.State != idem.StepDone || rec.DerivedKey != "idem_old" || string(rec.Result) != `{"amount":10}` || rec.Fingerprint != "" {
		t.Fatalf("BeginStep after Migrate: %+v began=%v %v; want the old done record, no fingerprint", rec, began, err)
	}
	steps, err := s.GetSteps(ctx, "s", "k", now)
	if err != nil || len(steps) != 1 || steps[0].Fingerprint != "" {
		t.Fatalf("GetSteps after Migrate: %+v %v", steps, err)
	}
}
