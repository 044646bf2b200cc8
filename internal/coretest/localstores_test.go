package idem_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// newSQLiteStore opens a migrated SQLite store in a file of the test's own.
func newSQLiteStore(t *testing.T) *sqlitestore.Store {
	t.Helper()
	db, err := embedded.Open(filepath.Join(t.TempDir(), "records.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	s, err := sqlitestore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s
}

// onLocalStores runs check, a store suite such as replaytest.Fidelity, on
// memstore and on SQLite in both flows, in parallel; the stores that need a
// server run it in their own packages.
func onLocalStores(t *testing.T, check func(t *testing.T, newStore func(*testing.T) idem.Store, flow idem.Flow)) {
	t.Run("memstore", func(t *testing.T) {
		t.Parallel()
		check(t, func(t *testing.T) idem.Store {
			s := memstore.New(nil)
			t.Cleanup(func() { _ = s.Close() })
			return s
		}, idem.FlowAuto)
	})
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(fmt.Sprintf("sqlite-flow%d", flow), func(t *testing.T) {
			t.Parallel()
			check(t, func(t *testing.T) idem.Store { return newSQLiteStore(t) }, flow)
		})
	}
}
