package idem_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"pgregory.net/rapid"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// TestModelStepsSQLitePlain runs the middleware's step model (runStepModel)
// with held requests and takeovers between steps on sqlitestore, whose step
// records live in a file of their own beside the records' file: each sequence
// on a fresh database. The store is used as a plain idem.Store and
// idem.StepStore, without its transactions (TestModelStepsSQLite runs the
// flows with them, without holds): the model takes a held request's key over
// once its lease lapsed, which SQLite's write lock, held by the handler's
// transaction, rightly forbids (a takeover is a write; see "Leases and the
// one writer" in the sqlitestore package documentation).
func TestModelStepsSQLitePlain(t *testing.T) {
	t.Parallel()
	budget := modelBudget()
	if budget > 0 {
		budget = 12
	}
	dir := t.TempDir()
	rapid.Check(t, func(rt *rapid.T) {
		sub, err := os.MkdirTemp(dir, "seq")
		if err != nil {
			rt.Fatal(err)
		}
		db, err := embedded.Open(filepath.Join(sub, "records.db"))
		if err != nil {
			rt.Fatal(err)
		}
		defer db.Close()
		s, err := sqlitestore.New(db, nil)
		if err != nil {
			rt.Fatal(err)
		}
		if err := s.Migrate(context.Background()); err != nil {
			rt.Fatal(err)
		}
		runStepModel(rt, struct {
			idem.Store
			idem.StepStore
		}{s, s}, stepModelRun{budget: budget, flow: idem.FlowClaimComplete, hold: true})
	})
}
